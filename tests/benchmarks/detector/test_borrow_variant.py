"""deform_plugin/benchmarks/detector/borrow_variant.py: the A/B config of ShapeBucketsHook's borrowed shapes."""
import os

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FAST_DDETR = os.path.join(REPO_ROOT, "configs", "fast",
                          "deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py")


def test_the_variant_changes_only_the_borrowing_settings(tmp_path):
    from mmengine.config import Config

    from deform_plugin.benchmarks.detector.borrow_variant import borrow_variant
    path = tmp_path / "ddetr_no_borrowing.py"
    path.write_text(borrow_variant(FAST_DDETR, 1, 1.5))
    base = Config.fromfile(FAST_DDETR, import_custom_modules=False)
    variant = Config.fromfile(str(path), import_custom_modules=False)
    base_hooks = [dict(h) for h in base.custom_hooks]
    variant_hooks = [dict(h) for h in variant.custom_hooks]
    assert [h["type"] for h in variant_hooks] == [h["type"] for h in base_hooks]
    for ours, theirs in zip(variant_hooks, base_hooks):
        if theirs["type"] == "ShapeBucketsHook":
            assert theirs["borrow_until_seen"] == 5  # the shipped setting
            assert ours == dict(theirs, borrow_until_seen=1, borrow_max_pixels=1.5)
        else:
            assert ours == theirs
    assert variant.model_wrapper_cfg == base.model_wrapper_cfg  # the rest is inherited
    assert variant.optim_wrapper == base.optim_wrapper


def test_a_config_without_the_hook_is_refused_by_name():
    from deform_plugin.benchmarks.detector.borrow_variant import borrow_variant
    mask2former = os.path.join(REPO_ROOT, "configs", "fast", "mask2former_r50_8xb2-lsj-50e_coco_deform-plugin-fast.py")
    with pytest.raises(ValueError, match="mask2former.*no ShapeBucketsHook"):
        borrow_variant(mask2former, 1, 1.5)
