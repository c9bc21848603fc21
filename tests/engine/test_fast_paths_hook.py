"""The fast paths are off unless a config selects them, and the fast configs select them."""
import os
import types
from pathlib import Path

import pytest
import torch
from detr_heads import hungarian_assigner
from mmcv.cnn.bricks.transformer import MultiheadAttention
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.engine import FastPathsHook, ShapeBucketsHook, fast_path_switches_from_config
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths, sdpa_multihead_attention_class


class _ModelWithBricks(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dims=16, num_heads=2, batch_first=True)
        self.bbox_head = nn.Module()
        self.bbox_head.assigner = hungarian_assigner()


class _FakeRunner:
    def __init__(self, model):
        self.model = model


def test_fast_paths_are_off_unless_the_config_asks():
    from mmengine.config import Config
    plain = Config(dict(optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-4))))
    assert fast_path_switches_from_config(plain) == {}
    assert "constructor" not in plain.optim_wrapper
    model = _ModelWithBricks()
    FastPathsHook().before_run(_FakeRunner(model))
    assert type(model.self_attn) is MultiheadAttention
    assert "assign" not in vars(model.bbox_head.assigner)
    assert apply_fast_paths(model) == {}
    assert type(model.self_attn) is MultiheadAttention


def test_fast_paths_hook_switches_only_what_it_is_given():
    model = _ModelWithBricks()
    FastPathsHook(sdpa_attention=True).before_run(_FakeRunner(model))
    assert type(model.self_attn) is sdpa_multihead_attention_class()
    assert "assign" not in vars(model.bbox_head.assigner)
    FastPathsHook(hungarian_host_syncs=True).before_run(_FakeRunner(model))
    assert "assign" in vars(model.bbox_head.assigner)


def test_fast_config_selects_everything():
    import os

    from mmengine.config import Config
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = Config.fromfile(os.path.join(root, "configs/fast/dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py"),
                          import_custom_modules=False)
    assert cfg.optim_wrapper.constructor == "MergedParamGroupsOptimWrapperConstructor"
    assert fast_path_switches_from_config(cfg) == dict(sdpa_attention=True, batched_matching=True,
                                                       sync_free_losses=True, sync_free_forward=True,
                                                       batched_losses=True, cuda_graphs=True,
                                                       relu_dropout_fusion=True, ffn_recompute=True)
    assert cfg.optim_wrapper.paramwise_cfg == dict(custom_keys={"backbone": dict(lr_mult=0.1)})
    assert cfg.model_wrapper_cfg == dict(type="FlatGradientsDataParallel")


_DETR_FAST_PATHS = dict(sdpa_attention=True, batched_matching=True, sync_free_losses=True, sync_free_forward=True,
                        batched_losses=True, cuda_graphs=True, relu_dropout_fusion=True, ffn_recompute=True)


@pytest.mark.parametrize("name, with_box_refine", [("deformable-detr_r50_16xb2-50e_coco_deform-plugin-fast.py", False),
                                                   ("deformable-detr-refine_r50_16xb2-50e_coco_deform-plugin-fast.py",
                                                    True)], ids=["plain", "refine"])
def test_single_stage_deformable_detr_fast_configs_select_every_detr_fast_path(name, with_box_refine):
    # Loaded as tools/train.py loads them (custom imports included): the stock model and pipeline of their family
    # config, and what the two-stage fast config selects.
    import os

    from mmengine.config import Config
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = Config.fromfile(os.path.join(root, "configs", "fast", name))
    two_stage = Config.fromfile(os.path.join(
        root, "configs", "fast", "deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py"))
    assert (cfg.model.with_box_refine, cfg.model.as_two_stage) == (with_box_refine, False)
    assert fast_path_switches_from_config(cfg) == _DETR_FAST_PATHS
    assert [hook.type for hook in cfg.custom_hooks] == ["FastPathsHook", "ShapeBucketsHook"]
    assert cfg.custom_hooks == two_stage.custom_hooks
    for key in ("custom_imports", "optim_wrapper", "default_hooks", "model_wrapper_cfg"):
        assert cfg[key] == two_stage[key], key
    assert cfg.train_dataloader.pin_memory and cfg.model.data_preprocessor.non_blocking
    assert cfg.train_dataloader.dataset.pipeline == two_stage.train_dataloader.dataset.pipeline


def test_mask2former_panoptic_fast_config_selects_the_instance_configs_fast_paths():
    import os

    from mmengine.config import Config
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = Config.fromfile(os.path.join(
        root, "configs", "fast", "mask2former_r50_8xb2-lsj-50e_coco-panoptic_deform-plugin-fast.py"))
    instance = Config.fromfile(os.path.join(
        root, "configs", "fast", "mask2former_r50_8xb2-lsj-50e_coco_deform-plugin-fast.py"))
    head = cfg.model.panoptic_head
    assert (head.num_things_classes, head.num_stuff_classes) == (80, 53)  # the stock panoptic model and data
    assert cfg.train_dataloader.dataset.type == "CocoPanopticDataset"
    assert "LoadPanopticAnnotations" in [step.type for step in cfg.train_dataloader.dataset.pipeline]
    assert fast_path_switches_from_config(cfg) == dict(sdpa_attention=True, batched_matching=True,
                                                       sync_free_forward=True, cuda_graphs=True)
    assert cfg.custom_hooks == instance.custom_hooks  # no shape buckets: LSJ's one 1024x1024 shape
    for key in ("custom_imports", "optim_wrapper", "default_hooks", "model_wrapper_cfg"):
        assert cfg[key] == instance[key], key
    assert cfg.train_dataloader.pin_memory and cfg.model.data_preprocessor.non_blocking
    assert cfg.model.data_preprocessor.pad_seg and cfg.model.data_preprocessor.seg_pad_value == 255


def test_graphs_split_at_the_features_only_under_ddp(monkeypatch):
    # Splitting lets DDP all-reduce gradients while the backbone's backward replays; on one process, or where the
    # regions write into a FlatGradientsDataParallel's gradient slots, it buys nothing.
    from mmengine.registry import MODEL_WRAPPERS

    from deform_plugin.engine.data_parallel import ParameterGradientSlots
    from deform_plugin.integration import mmdet_fast_paths
    calls = []
    monkeypatch.setattr(mmdet_fast_paths, "enable_cuda_graphs",
                        lambda model, split_at_features, gradient_slots, policy, feature_bucket_size: calls.append(
                            (split_at_features, gradient_slots, feature_bucket_size)) or 0)
    monkeypatch.setattr(mmdet_fast_paths, "enable_sync_free_forward", lambda model: 0)
    monkeypatch.setattr(mmdet_fast_paths, "check_mirrored_mmdet_version", lambda switch: None)
    # As for a model on CUDA (feature buckets are for graphs; off CUDA the regions run eagerly, unpadded). The hook
    # then also selects cuDNN's v7 API in the environment: recorded, so that the test leaves it as it found it.
    from deform_plugin.conv_planning import CUDNN_V8_API_DISABLED
    monkeypatch.setenv(CUDNN_V8_API_DISABLED, "")
    monkeypatch.delenv(CUDNN_V8_API_DISABLED)
    monkeypatch.setattr(FastPathsHook, "_model_on_cuda", staticmethod(lambda model: True))

    class SlottedWrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.gradient_slots = ParameterGradientSlots(self.module.parameters())

    MODEL_WRAPPERS.register_module(module=SlottedWrapper, force=True)
    try:
        wrapped = SlottedWrapper()
        for distributed in (False, True):
            monkeypatch.setattr(mmdet_fast_paths, "_distributed_over_processes", lambda: distributed)
            FastPathsHook(cuda_graphs=True).before_run(_FakeRunner(nn.Linear(2, 2)))
            FastPathsHook(cuda_graphs=True, split_graphs_at_features=not distributed).before_run(
                _FakeRunner(nn.Linear(2, 2)))
            FastPathsHook(cuda_graphs=True).before_run(_FakeRunner(wrapped))
    finally:
        MODEL_WRAPPERS._module_dict.pop("SlottedWrapper")
    # CPU parameters: no slots of the hook's own; the wrapper's slots reach the regions. No ShapeBucketsHook in these
    # runs: the transformer's graphs take 128 px feature buckets.
    assert calls == [(False, None, 128), (True, None, 128), (False, wrapped.gradient_slots, 128),
                     (True, None, 128), (False, None, 128), (False, wrapped.gradient_slots, 128)]
    # With ShapeBucketsHook the batch shapes recur: no feature buckets, unless the config sets a size; 0 is off.
    calls.clear()
    bucketed = _FakeRunner(nn.Linear(2, 2))
    bucketed.hooks = [ShapeBucketsHook()]
    FastPathsHook(cuda_graphs=True).before_run(bucketed)
    FastPathsHook(cuda_graphs=True, feature_bucket_size=64).before_run(bucketed)
    FastPathsHook(cuda_graphs=True, feature_bucket_size=0).before_run(_FakeRunner(nn.Linear(2, 2)))
    monkeypatch.setattr(FastPathsHook, "_model_on_cuda", staticmethod(lambda model: False))
    FastPathsHook(cuda_graphs=True).before_run(_FakeRunner(nn.Linear(2, 2)))
    assert [call[2] for call in calls] == [None, 64, None, None]
    cfg = dict(custom_hooks=[dict(type="FastPathsHook", cuda_graphs=1, split_graphs_at_features=None,
                                  feature_bucket_size=96)])
    assert fast_path_switches_from_config(cfg) == dict(cuda_graphs=True, split_graphs_at_features=None,
                                                       feature_bucket_size=96)


def test_a_config_key_that_is_no_switch_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown fast path switch sdpa: the switches are sdpa_attention, "):
        FastPathsHook(sdpa=True)
    cfg = dict(custom_hooks=[dict(type="FastPathsHook", cuda_graph=True)])
    with pytest.raises(ValueError, match="unknown fast path switch cuda_graph:"):
        fast_path_switches_from_config(cfg)
    assert FastPathsHook(cuda_graphs=1).fast_paths.cuda_graphs is True
    # The hook's own options are no switches.
    cfg = dict(custom_hooks=[dict(type="FastPathsHook", cuda_graphs=True, max_graphs=8, precompile_triton=False)])
    assert fast_path_switches_from_config(cfg) == dict(cuda_graphs=True)


class _RunnerWithHooks:
    def __init__(self, hooks):
        self.hooks = hooks


@pytest.mark.parametrize("hooks,given,expected", [
    ([], None, 2), (["buckets"], None, 1), (["buckets"], 3, 3), ([], 1, 1)],
    ids=["no-buckets", "buckets", "given-with-buckets", "given"])
def test_graphs_capture_a_shape_at_its_first_call_only_where_batches_are_padded_to_buckets(hooks, given, expected):
    from deform_plugin.engine import ShapeBucketsHook
    runner = _RunnerWithHooks([ShapeBucketsHook() if hook == "buckets" else hook for hook in hooks])
    policy = FastPathsHook(cuda_graphs=True, graph_capture_after=given, max_graphs=7).capture_policy(runner)
    assert (policy.capture_after, policy.max_graphs) == (expected, 7)


def test_a_bad_capture_setting_fails_when_the_hook_is_built():
    with pytest.raises(ValueError, match="max_graphs must be an int >= 1, got 0"):
        FastPathsHook(cuda_graphs=True, max_graphs=0)


def test_the_kernels_to_precompile_are_the_models_msda_shapes_in_each_dtype_of_the_run():
    from mmengine.optim import OptimWrapper

    from deform_plugin.engine.triton_precompile import model_msda_variants, run_dtypes
    from deform_plugin.models.msda import MultiScaleDeformableAttention
    model = torch.nn.ModuleList([MultiScaleDeformableAttention(embed_dims=64, num_heads=4, num_levels=3, num_points=2),
                                 MultiScaleDeformableAttention(embed_dims=64, num_heads=4, num_levels=3, num_points=2)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert run_dtypes(OptimWrapper(optimizer)) == ["float32"]
    assert run_dtypes(None) == ["float32"]
    dtypes = ["float32", "bfloat16"]
    variants = model_msda_variants(model, dtypes)
    assert {(v.num_heads, v.head_dim, v.num_levels, v.num_points) for v in variants} == {(4, 16, 3, 2)}
    assert sorted((v.dtype, v.reference_dim) for v in variants) == [
        ("bfloat16", 2), ("bfloat16", 4), ("float32", 2), ("float32", 4)]
    # mmengine's AmpOptimWrapper keeps its autocast dtype as cast_dtype (it refuses to build without a GPU).
    assert run_dtypes(types.SimpleNamespace(cast_dtype=torch.bfloat16)) == dtypes
    from mmengine.optim import AmpOptimWrapper
    without_dtype = AmpOptimWrapper.__new__(AmpOptimWrapper)  # --amp: no dtype, CUDA's autocast default
    without_dtype.cast_dtype = None
    assert run_dtypes(without_dtype) == ["float32", "float16"]


@pytest.fixture
def precompile_on_cuda(monkeypatch):
    """precompile_model_kernels as on a CUDA host without the interpreter, its background start recorded."""
    import deform_plugin.ops.msda.precompile as precompile
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    started = []
    monkeypatch.setattr(precompile, "precompile_in_background", lambda variants: started.extend(variants) or
                        ["a process"] * len(variants))
    return started


def test_the_run_starts_compiling_its_models_variants_in_the_background(precompile_on_cuda):
    from deform_plugin.engine.triton_precompile import precompile_model_kernels
    from deform_plugin.models.msda import MultiScaleDeformableAttention
    model = MultiScaleDeformableAttention(embed_dims=64, num_heads=4, num_levels=3, num_points=2)
    assert precompile_model_kernels(model, types.SimpleNamespace(cast_dtype=torch.bfloat16)) == ["a process"] * 4
    assert sorted((v.dtype, v.reference_dim) for v in precompile_on_cuda) == [
        ("bfloat16", 2), ("bfloat16", 4), ("float32", 2), ("float32", 4)]


def test_a_background_compile_that_cannot_start_leaves_the_run_to_compile(precompile_on_cuda, monkeypatch):
    import deform_plugin.ops.msda.precompile as precompile
    from deform_plugin.engine.triton_precompile import precompile_model_kernels
    from deform_plugin.models.msda import MultiScaleDeformableAttention

    def broken(variants):
        raise RuntimeError("no jit_cache_hook here")
    monkeypatch.setattr(precompile, "precompile_in_background", broken)
    model = MultiScaleDeformableAttention(embed_dims=64, num_heads=4, num_levels=3, num_points=2)
    assert precompile_model_kernels(model, None) == []


def test_nothing_is_compiled_ahead_under_the_interpreter(precompile_on_cuda, monkeypatch):
    from deform_plugin.engine.triton_precompile import precompile_model_kernels
    from deform_plugin.models.msda import MultiScaleDeformableAttention
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = MultiScaleDeformableAttention(embed_dims=64, num_heads=4, num_levels=3, num_points=2)
    assert precompile_model_kernels(model, None) == [] and precompile_on_cuda == []


def test_cudnn_v7_api_is_selected_before_the_run_only_when_asked(monkeypatch):
    from deform_plugin.conv_planning import CUDNN_V8_API_DISABLED
    monkeypatch.setenv(CUDNN_V8_API_DISABLED, "")  # recorded, so that the test leaves the variable as it found it
    monkeypatch.delenv(CUDNN_V8_API_DISABLED)
    # The default on a CPU model: cuDNN is not involved, nothing is set.
    FastPathsHook(precompile_triton=False).before_run(_FakeRunner(nn.Linear(2, 2)))
    assert CUDNN_V8_API_DISABLED not in os.environ
    FastPathsHook(precompile_triton=False, cudnn_v7_api=False).before_run(_FakeRunner(nn.Linear(2, 2)))
    assert CUDNN_V8_API_DISABLED not in os.environ
    FastPathsHook(precompile_triton=False, cudnn_v7_api=True).before_run(_FakeRunner(nn.Linear(2, 2)))
    assert os.environ[CUDNN_V8_API_DISABLED] == "1"


class _ModelPaddingTo(nn.Module):
    """A model whose data preprocessor pads its batches as mmdet's does: to one size (BatchFixedSizePad) or not."""

    def __init__(self, fixed_size):
        from mmdet.models.data_preprocessors import DetDataPreprocessor
        super().__init__()
        self.layer = nn.Linear(2, 2)
        augments = [dict(type="BatchFixedSizePad", size=fixed_size)] if fixed_size else None
        self.data_preprocessor = DetDataPreprocessor(batch_augments=augments)


def _runner_for(case):
    from deform_plugin.engine import ShapeBucketsHook
    runner = _RunnerWithHooks([ShapeBucketsHook()] if case == "buckets" else [])
    runner.model = _ModelPaddingTo((64, 64) if case == "one-size" else None)
    return runner


@pytest.mark.parametrize("case, v7", [("random-sizes", True), ("buckets", False), ("one-size", False)])
def test_cudnn_v7_api_by_default_exactly_where_batch_shapes_do_not_recur(monkeypatch, case, v7):
    # Under v7, PyTorch runs bfloat16 convolutions on its own im2col kernels: a run whose shapes recur (buckets, or
    # Mask2Former's one LSJ size) keeps v8, whose plan for a shape is made once.
    from deform_plugin.conv_planning import CUDNN_V8_API_DISABLED
    monkeypatch.setenv(CUDNN_V8_API_DISABLED, "")
    monkeypatch.delenv(CUDNN_V8_API_DISABLED)
    monkeypatch.setattr(FastPathsHook, "_model_on_cuda", staticmethod(lambda model: True))  # where cuDNN matters
    runner = _runner_for(case)
    hook = FastPathsHook(precompile_triton=False)
    assert hook.shapes_recur(runner) is not v7
    hook.before_run(runner)
    assert (os.environ.get(CUDNN_V8_API_DISABLED) == "1") is v7
    assert hook.capture_policy(runner).capture_after == (2 if v7 else 1)


def test_the_mask2former_fast_configs_pad_every_training_batch_to_one_size():
    from mmengine.config import Config
    from mmengine.registry import MODELS, DefaultScope

    configs = Path(__file__).resolve().parents[2] / "configs" / "fast"
    for name in ("mask2former_r50_8xb2-lsj-50e_coco_deform-plugin-fast.py",
                 "mask2former_r50_8xb2-lsj-50e_coco-panoptic_deform-plugin-fast.py"):
        cfg = Config.fromfile(str(configs / name))
        with DefaultScope.overwrite_default_scope("mmdet"):
            preprocessor = MODELS.build(cfg.model.data_preprocessor)
        assert FastPathsHook._padded_to_one_size(nn.Module()) is False
        holder = nn.Module()
        holder.data_preprocessor = preprocessor
        assert FastPathsHook._padded_to_one_size(holder), name


def test_the_dtypes_of_a_run_read_from_its_optimizer_wrappers_config_before_it_is_built():
    from deform_plugin.engine.triton_precompile import run_dtypes
    assert run_dtypes(dict(type="OptimWrapper", optimizer=dict(type="AdamW"))) == ["float32"]
    assert run_dtypes(dict(type="AmpOptimWrapper")) == ["float32", "float16"]  # mmdet's --amp
    assert run_dtypes(dict(type="SyncFreeAmpOptimWrapper", dtype="bfloat16")) == ["float32", "bfloat16"]


class _RunnerBeforeTrain:
    """A Runner as tools/train.py holds it before ``train()``: hooks built, the optimizer wrapper still a config."""

    def __init__(self, hooks):
        from deform_plugin.models.msda import MultiScaleDeformableAttention
        self.hooks = hooks
        self.model = MultiScaleDeformableAttention(embed_dims=64, num_heads=4, num_levels=3, num_points=2)
        self.optim_wrapper = dict(type="SyncFreeAmpOptimWrapper", dtype="bfloat16")


def test_the_training_script_starts_the_hooks_compiles_as_soon_as_the_runner_is_built(precompile_on_cuda):
    from deform_plugin.engine.triton_precompile import precompile_runner_kernels
    assert precompile_runner_kernels(_RunnerBeforeTrain([FastPathsHook(precompile_triton=False)])) == []
    assert precompile_runner_kernels(_RunnerBeforeTrain([])) == [] and precompile_on_cuda == []
    assert len(precompile_runner_kernels(_RunnerBeforeTrain([FastPathsHook()]))) == 4
    assert sorted({v.dtype for v in precompile_on_cuda}) == ["bfloat16", "float32"]


@pytest.mark.parametrize("name", ["deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py",
                                  "mask2former_r50_8xb2-lsj-50e_coco_deform-plugin-fast.py"])
def test_the_variants_read_from_a_config_are_those_of_its_built_model(name):
    import copy

    from mmengine.config import Config
    from mmengine.registry import MODELS, DefaultScope

    from deform_plugin.engine.triton_precompile import config_msda_variants, model_msda_variants
    cfg = Config.fromfile(str(Path(__file__).resolve().parents[2] / "configs" / "fast" / name))
    cfg.optim_wrapper = dict(type="AmpOptimWrapper", dtype="bfloat16")
    model_cfg = copy.deepcopy(cfg.model)
    variants = config_msda_variants(cfg)
    assert cfg.model == model_cfg  # the Runner builds the model from the config as it was
    with DefaultScope.overwrite_default_scope(cfg.default_scope):
        model = MODELS.build(cfg.model)
    assert variants == model_msda_variants(model, ["float32", "bfloat16"]) and len(variants) == 4


def test_the_training_script_starts_the_compiles_from_the_config_before_the_runner(precompile_on_cuda):
    from mmengine.config import Config

    from deform_plugin.engine.triton_precompile import precompile_config_kernels
    msda = dict(type="MultiScaleDeformableAttention", embed_dims=64, num_heads=4, num_levels=3, num_points=2)
    cfg = Config(dict(default_scope="mmdet", model=msda, optim_wrapper=dict(type="AmpOptimWrapper", dtype="bfloat16"),
                      custom_hooks=[dict(type="FastPathsHook", precompile_triton=False)]))
    assert precompile_config_kernels(cfg) == [] and precompile_on_cuda == []
    cfg.custom_hooks = [dict(type="FastPathsHook")]
    assert len(precompile_config_kernels(cfg)) == 4
    assert sorted((v.dtype, v.reference_dim, v.num_levels) for v in precompile_on_cuda) == [
        ("bfloat16", 2, 3), ("bfloat16", 4, 3), ("float32", 2, 3), ("float32", 4, 3)]


def test_a_config_whose_model_cannot_be_built_on_the_meta_device_starts_nothing(precompile_on_cuda):
    from mmengine.config import Config

    from deform_plugin.engine.triton_precompile import precompile_config_kernels
    cfg = Config(dict(default_scope="mmdet", model=dict(type="NoSuchDetector"),
                      custom_hooks=[dict(type="FastPathsHook")]))
    assert precompile_config_kernels(cfg) == [] and precompile_on_cuda == []
