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


@pytest.fixture
def compiles(monkeypatch):
    """Stand-ins for the jobs and their compiles: what was asked, in order."""
    import deform_plugin.ops.background_compile as background_compile
    import deform_plugin.ops.msda.precompile as precompile
    log = []
    monkeypatch.setattr(precompile, "compile_jobs", lambda variants: [("job", v) for v in variants])
    monkeypatch.setattr(background_compile, "compile_jobs_here", lambda jobs: log.append(("here", jobs)))

    class Worker:
        def __init__(self, job):
            self.args = ["worker", job]

        def wait(self):
            log.append(("waited", self.args[1]))
            return 0
    monkeypatch.setattr(background_compile, "start_background_compiles", lambda jobs: [Worker(j) for j in jobs])
    return log


VARIANTS = [MSDAVariant(1, 4, 1, 1), MSDAVariant(1, 4, 1, 1, reference_dim=4)]


def test_variants_compile_one_after_another_here_or_in_a_worker_each(compiles):
    assert compile_variants(VARIANTS, parallel=False) >= 0
    assert compiles == [("here", [("job", v) for v in VARIANTS])]
    compiles.clear()
    assert compile_variants(VARIANTS, parallel=True) >= 0
    assert compiles == [("waited", ("job", v)) for v in VARIANTS]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message where no CUDA device is")
def test_without_a_gpu_or_under_the_interpreter_warmup_says_why(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert run_warmup(str(ROOT / "configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py"), ["float32"]) == 2
    out = capsys.readouterr().out
    assert "error: warmup compiles Triton kernels for a CUDA device, and here: Triton runs in its interpreter" in out
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # read when asked: the kernels stay as they were built
    assert run_warmup(str(ROOT / "configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py"), ["float32"]) == 2
    out = capsys.readouterr().out
    assert "error: warmup compiles Triton kernels for a CUDA device, and here: no CUDA device (--arch" in out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the path where no CUDA device is")
def test_with_an_arch_warmup_compiles_for_it_without_a_gpu(compiles, monkeypatch, capsys):
    import deform_plugin.ops.compile_worker as compile_worker
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # read when asked: the kernels stay as they were built
    targets = []
    monkeypatch.setattr(compile_worker, "use_compile_only_target", lambda *target: targets.append(target))
    config = str(ROOT / "configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py")
    assert run_warmup(config, ["float32", "bfloat16"], arch=90) == 0
    assert targets == [("cuda", 90)]
    expected = [MSDAVariant(8, 32, 4, 4, dtype, reference_dim)
                for dtype in ("float32", "bfloat16") for reference_dim in (2, 4)]
    assert sorted((variant for _, (_, variant) in compiles), key=str) == sorted(expected, key=str)
    assert "for sm_90 in parallel processes" in capsys.readouterr().out
