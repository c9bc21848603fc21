"""The configs and the synthetic COCO-like source the training benchmark's tests run on."""
from pathlib import Path

from deform_plugin.benchmarks.detector import user_path

REPO_ROOT = Path(__file__).resolve().parents[2]
FAST_DDETR = REPO_ROOT / "configs" / "fast" / "deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py"
FAST_MASK2FORMER = REPO_ROOT / "configs" / "fast" / "mask2former_r50_8xb2-lsj-50e_coco_deform-plugin-fast.py"
FAST_DDQ = REPO_ROOT / "configs" / "fast" / "ddq-detr-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py"
FAST_GROUNDING_DINO = (REPO_ROOT / "configs" / "fast"
                       / "grounding_dino_swin-t_finetune_16xb2_1x_coco_deform-plugin-fast.py")
PANOPTIC = REPO_ROOT / "configs" / "mask2former" / "mask2former_r50_8xb2-lsj-50e_coco-panoptic_deform-plugin.py"
FAST_PANOPTIC = REPO_ROOT / "configs" / "fast" / "mask2former_r50_8xb2-lsj-50e_coco-panoptic_deform-plugin-fast.py"
# Stock mmdet and deform_plugin both train it in seconds on the CPU.
TINY_COCO_CONFIG = (REPO_ROOT / "tests" / "benchmarks" / "detector" / "configs"
                    / "deformable-detr-refine_r18_tiny_1xb2_coco-format.py")
SOURCE_IMAGES = 24
PANOPTIC_SOURCE_IMAGES = 6


def merged_overlay(tmp_path: Path, config: Path, row_text: str, source, settings=None):
    """The overlay of ``row_text`` on ``config``, written and loaded back as mmengine merges it."""
    row = user_path.parse_row(row_text)
    base = user_path.read_base_config(config)
    overlay = user_path.overlay_settings(base, row, source, settings or user_path.Settings(), tmp_path / "t.json")
    path = tmp_path / f"{row.side}-{row.mode}.py"
    path.write_text(user_path.render_overlay(config, overlay, row))
    return base, user_path.read_base_config(path)
