"""python -m deform_plugin warmup: the variants of a config's model; compiled one after another or in processes."""
from pathlib import Path

import pytest

from deform_plugin.engine.triton_precompile import model_msda_variants
from deform_plugin.ops.msda.precompile import MSDAVariant
from deform_plugin.warmup import compile_variants, model_from_config, run_warmup

ROOT = Path(__file__).resolve().parents[1]


def test_the_variants_of_a_configs_model():
    model = model_from_config(str(ROOT / "configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py"))
    variants = model_msda_variants(model, ["float32", "bfloat16"])
    expected = [MSDAVariant(8, 32, 4, 4, dtype, reference_dim)
                for dtype in ("float32", "bfloat16") for reference_dim in (2, 4)]
    assert sorted(variants, key=str) == sorted(expected, key=str)


def test_variants_compile_one_after_another(monkeypatch):
    import deform_plugin.ops.msda.precompile as precompile
    ran = []
    monkeypatch.setattr(precompile, "run_variant", lambda variant: ran.append(variant))
    variants = [MSDAVariant(1, 4, 1, 1), MSDAVariant(1, 4, 1, 1, reference_dim=4)]
    assert compile_variants(variants, parallel=False) >= 0 and ran == variants


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message where no CUDA device is")
def test_without_a_gpu_warmup_says_why(capsys):
    assert run_warmup(str(ROOT / "configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py"), ["float32"]) == 2
    out = capsys.readouterr().out
    assert "error: warmup compiles Triton kernels for a CUDA device, and here: no CUDA device" in out
