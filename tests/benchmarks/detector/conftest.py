"""The synthetic COCO-like source, made once for the training benchmark's tests."""
import pytest
from train_benchmark_cases import PANOPTIC_SOURCE_IMAGES, SOURCE_IMAGES

from deform_plugin.benchmarks.detector import coco_panoptic_source, coco_source


@pytest.fixture(scope="session")
def source(tmp_path_factory) -> coco_source.CocoSource:
    return coco_source.ensure_coco_source(tmp_path_factory.mktemp("coco_cache"), num_images=SOURCE_IMAGES, seed=0)


@pytest.fixture(scope="session")
def panoptic_source(tmp_path_factory) -> coco_source.CocoSource:
    return coco_panoptic_source.ensure_coco_panoptic_source(tmp_path_factory.mktemp("coco_panoptic_cache"),
                                                            num_images=PANOPTIC_SOURCE_IMAGES, seed=0)
