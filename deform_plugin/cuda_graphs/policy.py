"""When a call signature earns a CUDA graph, and how inference inputs are padded so that graphs are reused.

A captured graph replays a whole forward (and backward) in one launch, but only for the exact input shapes it was
captured with, and its capture costs about one eager call of host time plus the graph's instantiation. Two rules
keep that cost paid back:

- a signature is captured only once it recurs (:attr:`CapturePolicy.capture_after`): sizes seen once run eagerly,
  so a stream of ever-new sizes never pays a capture per call;
- no graph is ever dropped to make room for another (the caches stop capturing at ``max_graphs`` or
  ``max_graph_memory_mb``): a working set larger than the cap runs its extra sizes eagerly instead of recapturing
  them in a loop.

Inference also pads each input up to a bucket (:class:`InferenceBuckets`), so that the many sizes of real photos
fall into a few shapes; DETR-family detectors mask the padding, as they do for every image of a batch but the
largest.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple

Shape = Tuple[int, int]


def _positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class CapturePolicy:
    """When a cache of CUDA graphs captures a new call signature, and how many it keeps.

    Args:
        capture_after: a signature is captured at its ``capture_after``-th call; its earlier calls run eagerly
            (>= 1). With 1, a new signature is captured at its first call once a call of the same kind (the same
            dtypes and modes, other shapes) has run eagerly: right where shapes are known to recur, such as training
            batches padded by ``ShapeBucketsHook``.
        max_graphs: signatures captured at most; later new signatures run eagerly (>= 1).
        max_graph_memory_mb: device memory the captures may add to the graphs' pool, in MiB; once over it, new
            signatures run eagerly. None: no cap besides ``max_graphs``.
    """

    capture_after: int = 2
    max_graphs: int = 64
    max_graph_memory_mb: Optional[float] = None

    def __post_init__(self):
        _positive_int("CapturePolicy", "capture_after", self.capture_after)
        _positive_int("CapturePolicy", "max_graphs", self.max_graphs)
        memory = self.max_graph_memory_mb
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory <= 0):
            raise ValueError(f"CapturePolicy: max_graph_memory_mb must be a number > 0 or None, got {memory!r}")


# Feature buckets (Deformable-DETR's and DINO's feature maps padded before the transformer's graphs, in training
# without ShapeBucketsHook and in inference): each side of a level rounded up to this many input pixels' worth of
# cells.
DEFAULT_FEATURE_BUCKET_SIZE = 128


def check_feature_bucket_size(owner: str, name: str, value) -> None:
    """Refuse a feature bucket size that is neither None nor an int >= 1 (pixels), naming ``owner``'s ``name``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{owner}: {name} must be an int >= 1 (pixels) or None, got {value!r}")


def feature_bucket_size_or_alias(owner: str, feature_bucket_size, feature_buckets):
    """``owner``'s ``feature_bucket_size``, or ``feature_buckets`` in its place: the inference entry points' older
    keyword for the same setting, accepted with a ``DeprecationWarning`` and validated under that name. ``...``
    stands for a keyword not passed (and is returned where neither was); both passed is a ValueError."""
    if feature_buckets is ...:
        return feature_bucket_size
    if feature_bucket_size is not ...:
        raise ValueError(f"{owner}: pass feature_bucket_size or feature_buckets (its deprecated name), not both; got "
                         f"feature_bucket_size={feature_bucket_size!r} and feature_buckets={feature_buckets!r}")
    # stacklevel 3: the warning points at the code that called owner.
    warnings.warn(f"{owner}: feature_buckets is deprecated, pass feature_bucket_size={feature_buckets!r} instead",
                  DeprecationWarning, stacklevel=3)
    check_feature_bucket_size(owner, "feature_buckets", feature_buckets)
    return feature_buckets


def _round_up(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


@dataclass(frozen=True)
class InferenceBuckets:
    """How graph inference pads an input so that graphs are reused across image sizes.

    An input of ``height`` x ``width`` pixels runs at its *bucket*: both sides rounded up to a multiple of
    ``size_divisor``. A bucket without a graph of its own may *borrow* a captured graph of a larger shape (at most
    ``borrow_max_pixels`` times its pixels): the input is padded further and that graph replays, which costs the
    extra pixels' GPU time instead of an eager call's host time. A bucket that borrows earns a graph of its own at
    its ``own_graph_after``-th call (padding it less).

    ``canvases`` trade accuracy for throughput where sizes rarely repeat: given the largest image the model's test
    pipeline makes (for example ``(800, 1344)`` and ``(1344, 800)``; :func:`canvases_from_test_pipeline`), a bucket
    that can borrow nothing runs on the smallest canvas that covers it, captured at its first call (every input of
    its orientation fits it, so it recurs by construction), and a stream of sizes that never repeat replays graphs.
    A canvas pads an input by up to 1.7 times its pixels.

    Padding is not free for accuracy: DETR-family detectors mask padded pixels out of attention, but convolutions
    still see them as zeros, which changes the features near the image border. The defaults keep the padding near
    what mmdet's own batching adds (32 px steps, borrowing at most 15% more pixels, no canvases); docs/results.md
    gives the measured effect on mAP of heavier padding.

    Args:
        size_divisor: both sides of an input are padded up to a multiple of this (>= 1).
        canvases: shapes (height, width) that inputs may be padded into when their bucket has no graph.
        borrow_max_pixels: the largest pixel ratio of a borrowed graph's shape to the bucket's (>= 1; 1: never
            borrow a larger graph).
        own_graph_after: the call at which a bucket that can borrow or use a canvas is captured itself (>= 1).
    """

    size_divisor: int = 32
    canvases: Tuple[Shape, ...] = ()
    borrow_max_pixels: float = 1.15
    own_graph_after: int = 2

    def __post_init__(self):
        _positive_int("InferenceBuckets", "size_divisor", self.size_divisor)
        _positive_int("InferenceBuckets", "own_graph_after", self.own_graph_after)
        ratio = self.borrow_max_pixels
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio >= 1:
            raise ValueError(f"InferenceBuckets: borrow_max_pixels must be a number >= 1, got {ratio!r}")
        canvases = tuple(tuple(canvas) for canvas in self.canvases)
        for canvas in canvases:
            if len(canvas) != 2 or any(isinstance(side, bool) or not isinstance(side, int) or side < 1
                                       for side in canvas):
                raise ValueError(f"InferenceBuckets: each canvas must be (height, width) in positive ints, got "
                                 f"{canvas!r}")
        object.__setattr__(self, "canvases", tuple(self.padded(canvas) for canvas in canvases))

    def padded(self, shape: Shape) -> Shape:
        """``shape`` with both sides rounded up to the bucket divisor."""
        return _round_up(int(shape[0]), self.size_divisor), _round_up(int(shape[1]), self.size_divisor)

    def bucket(self, shape: Shape, divisor: int = 1) -> Shape:
        """The bucket of an input of ``shape``, also a multiple of the data preprocessor's own ``divisor``."""
        step = math.lcm(self.size_divisor, max(int(divisor), 1))
        return _round_up(int(shape[0]), step), _round_up(int(shape[1]), step)

    def canvas_for(self, shape: Shape) -> Optional[Shape]:
        """The smallest canvas that covers ``shape`` (None where none does)."""
        return smallest_covering(shape, self.canvases)

    def borrowable(self, shape: Shape, captured: Iterable[Shape]) -> Optional[Shape]:
        """The smallest captured shape that covers ``shape`` within ``borrow_max_pixels`` (None where none does)."""
        limit = self.borrow_max_pixels * shape[0] * shape[1]
        return smallest_covering(shape, [other for other in captured if other[0] * other[1] <= limit])


def smallest_covering(shape: Shape, candidates: Iterable[Shape]) -> Optional[Shape]:
    """The candidate with the fewest pixels (then the smallest) that is at least ``shape`` on both sides."""
    covering = [tuple(other) for other in candidates if other[0] >= shape[0] and other[1] >= shape[1]]
    return min(covering, key=lambda other: (other[0] * other[1], other)) if covering else None


def canvases_from_test_pipeline(pipeline: Optional[Sequence[dict]]) -> Tuple[Shape, ...]:
    """Both orientations of the largest image a test pipeline's keep-ratio ``Resize`` gives, e.g. ``(800, 1333)``
    and ``(1333, 800)`` for mmdet's ``Resize(scale=(1333, 800), keep_ratio=True)``; () where it has none."""
    for step in pipeline or ():
        if not isinstance(step, dict) or step.get("type") not in ("Resize", "mmdet.Resize"):
            continue
        scale = step.get("scale")
        if not step.get("keep_ratio", False) or not isinstance(scale, (tuple, list)) or len(scale) != 2:
            continue
        long_side, short_side = max(scale), min(scale)
        return (short_side, long_side), (long_side, short_side)
    return ()
