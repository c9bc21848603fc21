"""deform_plugin.benchmarks.detector.profiling: the profiled step, the matching ranges and the analysis of profiler
events."""
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.autograd import DeviceType

from deform_plugin.benchmarks.detector.profiling import (analyse_profile, matching_ranges, profiled_train_step,
                                                         unprofiled_busy_fraction)

MSDA = re.compile(r"ms_?deform|msda", re.I)
CPU, GPU = DeviceType.CPU, DeviceType.CUDA


def event(name, device, start, end, event_id=0, linked=0, parent=None, self_us=None, annotation=None):
    return SimpleNamespace(name=name, device_type=device, is_async=False, id=event_id, linked_correlation_id=linked,
                           time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent,
                           self_cpu_time_total=end - start if self_us is None else self_us,
                           is_user_annotation=name.startswith("deform_plugin::") if annotation is None else annotation)


def test_cuda_profile_analysis_on_synthetic_events():
    """The CUDA branch of the analysis (not reachable on a CPU host) on hand-made events of one step."""
    addmm = event("aten::addmm", CPU, 10, 20, event_id=1, self_us=7)
    item = event("aten::item", CPU, 295, 315, self_us=2)
    local_scalar = event("aten::_local_scalar_dense", CPU, 296, 314, parent=item, self_us=2)
    events = [
        event("deform_plugin::train_step", CPU, 0, 1000),
        event("deform_plugin::matching", CPU, 100, 200),
        event("deform_plugin::optimizer", CPU, 800, 900),
        event("deform_plugin::wait_for_device", CPU, 950, 1000),
        addmm,
        event("cudaLaunchKernel", CPU, 14, 17, parent=addmm),            # host time of the GEMM
        event("aten::add", CPU, 150, 160, event_id=2),                   # launched inside matching
        event("aten::_foreach_mul_", CPU, 810, 820, event_id=3),
        item, local_scalar,
        event("cudaMemcpyAsync", CPU, 297, 300, parent=local_scalar),
        event("cudaStreamSynchronize", CPU, 300, 313, parent=local_scalar),  # the step's one host sync
        event("deform_plugin::deform_sdpa_forward", CPU, 400, 401, annotation=False),  # a custom op, not a range
        event("cudaDeviceSynchronize", CPU, 955, 999),                   # the benchmark's own: not counted
        event("sm90_xmma_gemm_f32f32_tn", GPU, 30, 130, event_id=11, linked=1),
        event("vectorized_elementwise_kernel", GPU, 170, 190, event_id=12, linked=2),
        event("multi_tensor_apply_kernel", GPU, 830, 850, event_id=13, linked=3),
        event("msda_backward_kernel", GPU, 400, 700, event_id=14),       # no launching op recorded: by name
        event("ms_deformable_col2im_gpu_kernel", GPU, 690, 720, event_id=15),
        event("Memcpy HtoD (Pageable -> Device)", GPU, 120, 125, event_id=16),
        event("deform_plugin::train_step", GPU, 0, 1000),                # GPU-side annotation: not a kernel
    ]
    result = analyse_profile(events, 1, torch.device("cuda"), MSDA)
    components = result["components_ms_per_step"]
    assert components["GEMM"] == pytest.approx(0.1)
    assert components["matching"] == pytest.approx(0.02)
    assert components["optimizer"] == pytest.approx(0.02)
    assert components["MSDA"] == pytest.approx(0.33)
    assert components["memcpy"] == pytest.approx(0.005)
    assert result["kernels_per_step"] == 6
    # Busy: [30,130] + [170,190] + [400,720] + [830,850] = 460 us of a 1000 us step.
    assert result["busy_fraction"] == pytest.approx(0.46)
    assert result["host_ms_per_step"] == {"matching": 0.1, "optimizer": 0.1, "wait_for_device": 0.05}
    host = result["host_components_ms_per_step"]
    assert host["GEMM"] == pytest.approx(0.010)            # addmm's self time and its launch
    assert host["matching"] == pytest.approx(0.010) and host["optimizer"] == pytest.approx(0.010)
    assert host["other"] == pytest.approx(0.021)           # item, its read, copy and sync; the custom op
    assert result["host_syncs_per_step"] == 1 and result["host_reads_per_step"] == 1


def test_cpu_profile_analysis_charges_ranges_and_counts_reads():
    steps = 2
    events = []
    for step in range(steps):
        t = 1000 * step
        events += [event("deform_plugin::train_step", CPU, t, t + 1000),
                   event("deform_plugin::msda", CPU, t + 100, t + 300),
                   event("aten::grid_sampler_2d", CPU, t + 110, t + 200),     # inside the op's range
                   event("aten::view", CPU, t + 210, t + 220),                # inside it too: MSDA, whatever its name
                   event("aten::mm", CPU, t + 400, t + 500),
                   event("aten::_local_scalar_dense", CPU, t + 600, t + 610)]
    result = analyse_profile(events, steps, torch.device("cpu"), MSDA)
    assert result["time_kind"] == "CPU" and result["ops_per_step"] == 4
    assert result["components_ms_per_step"]["MSDA"] == pytest.approx(0.1)
    assert result["components_ms_per_step"]["GEMM"] == pytest.approx(0.1)
    assert result["host_components_ms_per_step"] == result["components_ms_per_step"]
    assert result["host_syncs_per_step"] is None and result["host_reads_per_step"] == 1
    assert result["busy_fraction"] == pytest.approx(0.21)
    assert result["host_ms_per_step"] == {"msda": pytest.approx(0.2)}


def test_busy_fraction_against_the_unprofiled_step():
    # 46 ms of device work in a 100 ms profiled step; the same step takes 60 ms without the profiler.
    profiled = dict(time_kind="CUDA", busy_fraction=0.46, step_wall_ms=100.0)
    assert unprofiled_busy_fraction(profiled, 60.0) == pytest.approx(46 / 60)
    assert unprofiled_busy_fraction(profiled, 40.0) == 1.0  # capped: timing noise cannot make it exceed the wall
    assert unprofiled_busy_fraction(profiled, None) is None
    assert unprofiled_busy_fraction(dict(profiled, time_kind="CPU"), 60.0) is None  # no device on CPU rows


def _assigner_class():
    import deform_plugin  # noqa: F401  (mmdet.models imports with mmcv-lite)
    from mmdet.models.task_modules.assigners.base_assigner import BaseAssigner

    class Assigner(BaseAssigner):
        def assign(self, pred_instances, gt_instances, gt_instances_ignore=None, **kwargs):
            return "assigned"
    return Assigner


def test_matching_ranges_name_assign_calls_and_restore_the_instances():
    assigner, own = _assigner_class()(), _assigner_class()()
    own_assign = own.assign
    own.assign = own_assign            # an instance attribute already there is put back as it was
    model = nn.ModuleDict({"head": nn.Module(), "other_head": nn.Module()})
    model["head"].assigner = assigner
    model["other_head"].assigner = assigner  # shared: wrapped once
    model["other_head"].second = own
    from torch.profiler import profile
    with profile() as prof, matching_ranges(model):
        assert "assign" in vars(assigner)
        assert assigner.assign(None, None) == "assigned" and own.assign(None, None) == "assigned"
    assert [e.name for e in prof.events()].count("deform_plugin::matching") == 2
    assert "assign" not in vars(assigner) and assigner.assign(None, None) == "assigned"
    assert vars(own)["assign"] is own_assign


class _TinyModel:
    """An mmengine model small enough to step exactly: linear regression with a logged non-loss value."""

    @staticmethod
    def build(seed: int):
        from mmengine.model import BaseModel

        class Tiny(BaseModel):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(4, 1)

            def forward(self, inputs, data_samples=None, mode="tensor"):
                out = self.linear(inputs)
                if mode == "loss":
                    return {"loss": ((out - data_samples) ** 2).mean(), "mean_out": out.mean().detach()}
                return out
        torch.manual_seed(seed)
        return Tiny()


@pytest.mark.parametrize("accumulative_counts", [1, 2], ids=["no-accumulation", "accumulate-2"])
def test_profiled_step_updates_like_mmengine_train_step(accumulative_counts):
    from mmengine.optim import OptimWrapper

    generator = torch.Generator().manual_seed(1)
    batch = {"inputs": torch.randn(8, 4, generator=generator), "data_samples": torch.randn(8, 1, generator=generator)}
    runs = []
    for profiled in (False, True):
        model = _TinyModel.build(seed=0)
        wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               accumulative_counts=accumulative_counts, clip_grad=dict(max_norm=0.05))
        logs = []
        for _ in range(3):
            if profiled:
                logs.append(profiled_train_step(model, wrapper, batch, torch.device("cpu")))
            else:
                logs.append(model.train_step(batch, wrapper))
        runs.append(([p.detach().clone() for p in model.parameters()], logs))
    (params, logs), (profiled_params, profiled_logs) = runs
    assert all(torch.equal(a, b) for a, b in zip(params, profiled_params))
    assert [{k: v.item() for k, v in log.items()} for log in logs] == \
        [{k: v.item() for k, v in log.items()} for log in profiled_logs]
    assert not torch.equal(params[0], _TinyModel.build(seed=0).linear.weight)  # the steps did update
