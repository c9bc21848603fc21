"""Each family's plugin config builds our MSDA wherever stock mmdet builds its own, and stock checkpoints load."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import stock_worker
import torch

import deform_plugin  # noqa: F401
from deform_plugin.models import MultiScaleDeformableAttention as PluginMSDA
from mmcv.ops import MultiScaleDeformableAttention as StockMSDA

# One pytest-xdist worker runs this whole module, so that its module-scoped fixture (processes) runs once.
pytestmark = pytest.mark.xdist_group("mmdet_msda_sites")

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"

FAMILY_CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*/*_deform-plugin.py"))
# Every MSDA in these models: encoder self-attention and decoder cross-attention (DETR family) or the pixel
# decoder's encoder (Mask2Former).
EXPECTED_MSDA = {"deformable-detr": 12, "dino": 12, "ddq": 12, "mask2former": 6, "grounding_dino": 12}


def run_stock(*args):
    result = subprocess.run([sys.executable, str(HELPERS / "stock_worker.py"), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_every_family_has_a_config():
    families = {Path(p).parent.name for p in FAMILY_CONFIGS}
    assert {"deformable_detr", "dino", "ddq", "mask2former", "grounding_dino"} <= families
    names = {Path(p).name for p in FAMILY_CONFIGS}
    for variant in ("deformable-detr_r50", "deformable-detr-refine_r50", "deformable-detr-refine-twostage_r50"):
        assert any(n.startswith(variant + "_") for n in names), variant


@pytest.fixture(scope="module")
def stock_counts():
    return json.loads(run_stock("count", *FAMILY_CONFIGS).strip().splitlines()[-1])


@pytest.mark.parametrize("config", FAMILY_CONFIGS, ids=[Path(p).stem for p in FAMILY_CONFIGS])
def test_config_builds_plugin_msda_in_every_stock_place(config, stock_counts):
    from mmengine.config import Config
    cfg = Config.fromfile(str(ROOT / config))  # imports deform_plugin through custom_imports
    assert cfg.custom_imports == dict(imports=["deform_plugin"], allow_failed_imports=False)
    model = stock_worker.build_msda_owner(cfg)
    attention = [m for m in model.modules() if isinstance(m, StockMSDA)]
    family = next(k for k in EXPECTED_MSDA if k in Path(config).name)
    assert len(attention) == EXPECTED_MSDA[family] == stock_counts[config]
    assert all(type(m) is PluginMSDA for m in attention)


def test_stock_checkpoint_loads_and_gives_same_outputs(tmp_path):
    config = "configs/deformable_detr/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py"
    saved = tmp_path / "stock.pt"
    run_stock("forward", config, str(saved))
    stock = torch.load(saved, weights_only=False)

    from mmengine.config import Config
    model = stock_worker.build_msda_owner(Config.fromfile(str(ROOT / config))).double().eval()
    assert sum(type(m) is PluginMSDA for m in model.modules()) == 12
    missing, unexpected = model.load_state_dict(stock["state_dict"], strict=True)
    assert not missing and not unexpected
    inputs, samples = stock_worker.detection_inputs()
    with torch.no_grad():
        outputs = model(inputs, samples, mode="tensor")
    flat_ours, flat_stock = torch.utils._pytree.tree_leaves(outputs), torch.utils._pytree.tree_leaves(stock["outputs"])
    assert len(flat_ours) == len(flat_stock) > 0
    for ours, theirs in zip(flat_ours, flat_stock):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)


def test_process_without_plugin_is_unchanged():
    code = ("import sys; import stock_worker; "
            "stock_worker.install_bare_ext(); "
            "import mmdet.models.layers.transformer.deformable_detr_layers as layers; "
            "from mmcv.ops import MultiScaleDeformableAttention as M; from mmengine.registry import MODELS; "
            "assert layers.MultiScaleDeformableAttention is M; "
            "assert MODELS.get('MultiScaleDeformableAttention') is M; "
            "assert 'deform_plugin' not in sys.modules; print('unchanged')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(HELPERS)))
    assert result.returncode == 0 and "unchanged" in result.stdout, result.stderr[-2000:]


def test_registry_name_resolves_to_plugin():
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules()
    module = MODELS.build(dict(type="MultiScaleDeformableAttention", embed_dims=64, num_heads=4))
    assert type(module) is PluginMSDA
