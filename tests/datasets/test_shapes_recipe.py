"""The recipe for training a stock family config on the shapes set builds, and the usual mistake is explained."""
from pathlib import Path

import pytest

import deform_plugin  # noqa: F401  (registers the dataset; mmcv-lite stand-in)

ROOT = Path(__file__).resolve().parents[2]


def test_stock_family_config_on_the_shapes_set_builds_its_datasets(tmp_path):
    from mmdet.registry import DATASETS, METRICS
    from mmdet.utils import register_all_modules
    from mmengine.config import Config
    register_all_modules(init_default_scope=True)
    cfg = Config.fromfile(str(ROOT / "configs" / "shapes" / "dino-4scale_r50_1xb2-2k_shapes.py"))
    for key in ("train_dataloader", "val_dataloader"):
        dataset_cfg = cfg[key].dataset
        assert "data_root" not in dataset_cfg and "ann_file" not in dataset_cfg, key
        dataset = DATASETS.build(dict(dataset_cfg, cache_root=str(tmp_path), lazy_init=True))
        dataset.full_init()
        assert len(dataset) == (512 if key == "train_dataloader" else 128)
    assert cfg.train_dataloader.dataset.pipeline == cfg.train_pipeline  # the stock pipeline is kept
    METRICS.build(dict(cfg.val_evaluator, cache_root=str(tmp_path)))
    assert cfg.model.bbox_head.num_classes == 4


def test_inherited_coco_paths_get_a_message_that_says_what_to_do(tmp_path):
    from deform_plugin.datasets import ShapesCocoDataset
    with pytest.raises(FileNotFoundError, match=r"looks inherited from a COCO config.*_delete_=True"):
        ShapesCocoDataset(split="train", data_root="data/coco/", ann_file="annotations/instances_train2017.json",
                          cache_root=str(tmp_path))
