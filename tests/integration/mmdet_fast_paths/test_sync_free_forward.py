"""sync_free_forward: the DETRs' and Mask2Former's forward without host syncs gives bitwise the stock outputs, and
the data preprocessor flips channels on the device."""
import copy

import pytest
import stock_worker
import torch
from small_detectors import small_detector

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths


# Both branches of the stock code (padding masks or none), each on one of the two families it serves. The detectors
# shrunk as tests/helpers/small_detectors.py does (two layers of each kind are enough for a layer to take another's
# output); the sync-free pieces are the same at any size.
@pytest.mark.parametrize("name, padded", [("deformable-detr-two-stage", False), ("dino", True), ("mask2former", True)],
                         ids=["deformable-detr-two-stage-same-size", "dino-padded", "mask2former"])
def test_sync_free_forward_gives_the_stock_outputs_bitwise_and_reads_no_table(name, padded):
    from deform_plugin.ops.msda.level_tables import level_table_host_reads
    stock = small_detector(name, layers=2).eval()
    fast = copy.deepcopy(stock)
    assert apply_fast_paths(fast, sync_free_forward=True) == {"sync_free_forward": 1}  # the detector or decoder
    # Their configs convert BGR to RGB: the data preprocessor flips on the device (see the preprocessor's test).
    assert fast.data_preprocessor._deform_plugin_flips_channels
    assert not getattr(stock.data_preprocessor, "_deform_plugin_flips_channels", False)
    # The two-stage DETRs select their num_queries (100 here) proposals: the input must give at least that many keys
    # (426 at 128 x 160).
    inputs, samples = stock_worker.detection_inputs(batch=2 if padded else 1, height=128, width=160)
    with torch.no_grad():
        expected = stock(inputs, samples, mode="tensor")
        reads = level_table_host_reads()
        got = fast(inputs, samples, mode="tensor")
        assert level_table_host_reads() == reads  # the tables are made on the host: nothing is read back
        got_again = fast(inputs, samples, mode="tensor")
    for ours, theirs, again in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected),
                                   torch.utils._pytree.tree_leaves(got_again)):
        assert torch.equal(ours, theirs) and torch.equal(again, theirs)


def test_mask_boxes_are_mmdets_mask2bbox():
    from mmdet.structures.mask import mask2bbox

    from deform_plugin.integration.mmdet_fast_paths.sync_free_forward import mask_boxes
    generator = torch.Generator().manual_seed(0)
    masks = torch.rand(12, 17, 23, generator=generator) > 0.97
    masks[0] = False  # empty
    masks[1] = True  # full
    masks[2] = False
    masks[2, 16, 22] = True  # one corner pixel
    masks[3] = False
    masks[3, 0, 0] = True
    masks[4] = False
    masks[4, 5, 3:9] = True  # one row
    masks[5] = False
    masks[5, 2:11, 7] = True  # one column
    ours = mask_boxes(masks)
    assert ours.dtype == torch.float32 and torch.equal(ours, mask2bbox(masks))
    assert torch.equal(mask_boxes(masks[:0]), mask2bbox(masks[:0]))


@pytest.mark.parametrize("num_stuff_classes", [0, 5])
def test_sync_free_instance_postprocess_is_stock(num_stuff_classes):
    from mmdet.models.seg_heads.panoptic_fusion_heads import MaskFormerFusionHead

    from deform_plugin.integration.mmdet_fast_paths.sync_free_forward import enable_sync_free_forward
    head = MaskFormerFusionHead(num_things_classes=8, num_stuff_classes=num_stuff_classes,
                                test_cfg=dict(max_per_image=30))
    fast = copy.deepcopy(head)
    model = torch.nn.Sequential(fast)
    enable_sync_free_forward(model)
    assert "instance_postprocess" in vars(fast)
    generator = torch.Generator().manual_seed(1)
    mask_cls = torch.randn(12, 8 + num_stuff_classes + 1, generator=generator, dtype=torch.float64)
    mask_pred = torch.randn(12, 19, 21, generator=generator, dtype=torch.float64) - 1.5
    mask_pred[3] = -1.0  # a query with an empty mask
    expected = head.instance_postprocess(mask_cls, mask_pred)
    got = fast.instance_postprocess(mask_cls, mask_pred)
    assert set(got.keys()) == set(expected.keys())
    for key in expected.keys():
        assert torch.equal(got[key], expected[key]), key
    assert len(expected) < 30 if num_stuff_classes else len(expected) == 30


def _bgr_preprocessor():
    from mmdet.models.data_preprocessors import DetDataPreprocessor
    return DetDataPreprocessor(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], bgr_to_rgb=True,
                               pad_size_divisor=32)


def _image_batch(stacked: bool):
    from mmdet.structures import DetDataSample
    generator = torch.Generator().manual_seed(0)
    sizes = [(3, 40, 52), (3, 40, 52)] if stacked else [(3, 37, 50), (3, 45, 41)]
    images = [torch.randint(0, 256, size, generator=generator, dtype=torch.uint8) for size in sizes]
    samples = [DetDataSample(metainfo=dict(img_shape=size[1:], ori_shape=size[1:])) for size in sizes]
    return dict(inputs=torch.stack(images) if stacked else images, data_samples=samples)


@pytest.mark.parametrize("stacked", [False, True], ids=["image-list", "stacked-batch"])
def test_sync_free_forward_flips_the_preprocessors_channels_as_stock_without_a_host_copy(stacked):
    """mmengine's BGR-to-RGB conversion indexes each image with a Python list (a blocking copy of the index on a
    GPU); the fast path flips on the device, and the preprocessed batch is bitwise stock's."""
    from host_transfers import HostTransferSpy

    from deform_plugin.integration.mmdet_fast_paths.sync_free_forward import flip_channels_without_sync
    stock, fast = _bgr_preprocessor(), _bgr_preprocessor()
    assert flip_channels_without_sync(fast) and not flip_channels_without_sync(fast)  # once
    assert not flip_channels_without_sync(_bgr_preprocessor().__class__(bgr_to_rgb=False))
    recorded, outputs = [], []
    for preprocessor in (stock, fast):
        for training in (True, False):
            with HostTransferSpy() as spy:
                outputs.append(preprocessor(_image_batch(stacked), training))
            recorded.append(spy.calls)
    assert all(("list_index", "forward") in calls for calls in recorded[:2]), recorded  # the spy sees stock's
    # The rest (mmengine's stack_batch reading the images' sizes from a tensor it builds on the host) stays.
    assert recorded[2:] == [[call for call in calls if call[0] != "list_index"] for calls in recorded[:2]], recorded
    for ours, theirs in zip(outputs[2:], outputs[:2]):
        assert torch.equal(ours["inputs"], theirs["inputs"])
        assert ([s.metainfo for s in ours["data_samples"]] == [s.metainfo for s in theirs["data_samples"]])
    assert fast._channel_conversion  # left as it was
