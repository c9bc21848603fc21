"""The capture policy's and the inference buckets' rules."""
import pytest

from deform_plugin.cuda_graphs import CapturePolicy, InferenceBuckets, canvases_from_test_pipeline, smallest_covering


@pytest.mark.parametrize("kwargs,match", [
    (dict(capture_after=0), "capture_after must be an int >= 1, got 0"),
    (dict(capture_after=True), "capture_after must be an int >= 1, got True"),
    (dict(max_graphs=2.5), "max_graphs must be an int >= 1, got 2.5"),
    (dict(max_graph_memory_mb=0), "max_graph_memory_mb must be a number > 0 or None, got 0"),
    (dict(max_graph_memory_mb="1G"), "max_graph_memory_mb must be a number > 0 or None, got '1G'"),
])
def test_a_bad_capture_policy_is_refused_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CapturePolicy(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(size_divisor=0), "size_divisor must be an int >= 1, got 0"),
    (dict(borrow_max_pixels=0.9), "borrow_max_pixels must be a number >= 1, got 0.9"),
    (dict(own_graph_after=0), "own_graph_after must be an int >= 1, got 0"),
    (dict(canvases=((800,),)), r"each canvas must be \(height, width\) in positive ints, got \(800,\)"),
    (dict(canvases=((800, -1),)), r"got \(800, -1\)"),
])
def test_bad_inference_buckets_are_refused_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InferenceBuckets(**kwargs)


def test_a_bucket_rounds_both_sides_up_to_the_divisor_and_the_preprocessors():
    buckets = InferenceBuckets(size_divisor=32)
    assert buckets.bucket((800, 1067)) == (800, 1088)
    assert buckets.bucket((750, 1333)) == (768, 1344)
    assert buckets.bucket((800, 1067), divisor=1) == (800, 1088)
    assert buckets.bucket((800, 1067), divisor=3) == (864, 1152)  # multiples of lcm(32, 3) = 96
    assert buckets.bucket((64, 64)) == (64, 64)


def test_canvases_are_rounded_to_the_divisor_and_the_smallest_covering_one_is_chosen():
    buckets = InferenceBuckets(size_divisor=32, canvases=((800, 1333), (1333, 800)))
    assert buckets.canvases == ((800, 1344), (1344, 800))
    assert buckets.canvas_for((800, 1088)) == (800, 1344)
    assert buckets.canvas_for((1088, 800)) == (1344, 800)
    assert buckets.canvas_for((800, 800)) == (800, 1344)  # both cover it with the same pixels: the smaller tuple
    assert buckets.canvas_for((832, 832)) is None


def test_a_borrowed_shape_covers_the_bucket_within_the_pixel_ratio():
    buckets = InferenceBuckets(borrow_max_pixels=1.5)
    captured = [(800, 1216), (800, 1344), (1216, 800), (640, 640)]
    assert buckets.borrowable((800, 1088), captured) == (800, 1216)  # the smallest that covers it
    assert buckets.borrowable((800, 800), captured) is None  # every cover has over 1.5x its pixels (1.52x)
    assert buckets.borrowable((800, 832), captured) == (800, 1216)  # 1.46x
    assert buckets.borrowable((832, 800), captured) == (1216, 800)
    assert buckets.borrowable((544, 544), captured) == (640, 640)  # 1.38x
    assert buckets.borrowable((512, 512), captured) is None  # 1.56x
    assert InferenceBuckets(borrow_max_pixels=1).borrowable((800, 1088), captured) is None


def test_smallest_covering_prefers_fewest_pixels():
    assert smallest_covering((10, 10), [(10, 30), (20, 12), (9, 100)]) == (20, 12)
    assert smallest_covering((10, 10), []) is None


def test_canvases_come_from_the_keep_ratio_resize_of_a_test_pipeline():
    pipeline = [dict(type="LoadImageFromFile"), dict(type="Resize", scale=(1333, 800), keep_ratio=True),
                dict(type="PackDetInputs")]
    assert canvases_from_test_pipeline(pipeline) == ((800, 1333), (1333, 800))
    assert canvases_from_test_pipeline([dict(type="Resize", scale=(640, 640), keep_ratio=False)]) == ()
    assert canvases_from_test_pipeline(None) == ()
