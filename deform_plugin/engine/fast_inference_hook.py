"""Validation and testing through graph inference: ``custom_hooks = [dict(type='FastInferenceHook')]``."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS

from deform_plugin.cuda_graphs import DEFAULT_FEATURE_BUCKET_SIZE


@HOOKS.register_module()
class FastInferenceHook(Hook):
    """Run the model's validation and test forwards through :func:`deform_plugin.apis.enable_fast_inference`.

    Inputs are padded to buckets (``size_divisor`` px steps; optionally canvases, see
    :class:`deform_plugin.cuda_graphs.InferenceBuckets`) and each bucket's forward is replayed from a CUDA graph once
    it recurs; on a CPU the inputs are padded all the same and run eagerly. Training is untouched.

    Args:
        size_divisor (int): bucket step in pixels (>= 1).
        buckets (bool): pad inputs to buckets (default True); False: a graph per exact input shape, mmdet's
            padding.
        canvases (str or sequence of (height, width), optional): None (the default): no canvases; ``'auto'``: the
            largest image of the config's test pipeline, per orientation; or the canvases themselves. Canvases pad
            more (up to 1.7x the pixels): faster where sizes rarely repeat, with an effect on accuracy
            (docs/results.md).
        borrow_max_pixels (float): the largest pixel ratio of a borrowed graph's shape to a bucket's.
        capture_after (int): a bucket is captured at its ``capture_after``-th call.
        max_graphs (int): graphs kept at most; later new shapes run eagerly or borrow a larger graph.
        max_graph_memory_mb (float, optional): the device memory the captures may add, MiB.
        feature_bucket_size (int, optional): Deformable-DETR and DINO pad their feature maps instead of the image,
            to buckets of this many pixels (exact detections; see ``enable_fast_inference``); default 128, None:
            they pad the image as the others do.
        feature_buckets (int, optional): the deprecated name of ``feature_bucket_size`` (a ``DeprecationWarning``;
            passing both is a ValueError).
    """

    priority = "LOW"

    def __init__(self, size_divisor: int = 32, buckets: bool = True,
                 canvases: Union[None, str, Sequence[Sequence[int]]] = None, borrow_max_pixels: float = 1.15,
                 capture_after: int = 2, max_graphs: int = 16, max_graph_memory_mb: Optional[float] = None,
                 feature_bucket_size: Optional[int] = ..., feature_buckets: Optional[int] = ...):
        from deform_plugin.cuda_graphs import CapturePolicy, InferenceBuckets, check_feature_bucket_size
        from deform_plugin.cuda_graphs.policy import feature_bucket_size_or_alias
        # ``...``: not passed, so that the deprecated alias and the new name given together can be told apart.
        feature_bucket_size = feature_bucket_size_or_alias("FastInferenceHook", feature_bucket_size, feature_buckets)
        if feature_bucket_size is ...:
            feature_bucket_size = DEFAULT_FEATURE_BUCKET_SIZE
        self.policy = CapturePolicy(capture_after=capture_after, max_graphs=max_graphs,
                                    max_graph_memory_mb=max_graph_memory_mb)
        self.bucketing = bool(buckets)
        self.size_divisor = size_divisor
        if isinstance(canvases, str) and canvases != "auto":
            raise ValueError(f"FastInferenceHook: canvases must be None, 'auto' or (height, width) pairs, got "
                             f"{canvases!r}")
        self.canvases = canvases if canvases is None or isinstance(canvases, str) else tuple(
            tuple(canvas) for canvas in canvases)
        self.borrow_max_pixels = borrow_max_pixels
        check_feature_bucket_size("FastInferenceHook", "feature_bucket_size", feature_bucket_size)
        self.feature_bucket_size = feature_bucket_size
        # Bad values fail when the config is built.
        InferenceBuckets(size_divisor=size_divisor, borrow_max_pixels=borrow_max_pixels,
                         canvases=self.canvases if isinstance(self.canvases, tuple) else ())
        self.graph_inference = None

    def _buckets(self, runner):
        from deform_plugin.cuda_graphs import InferenceBuckets, canvases_from_test_pipeline
        if not self.bucketing:
            return None
        canvases = self.canvases or ()
        if canvases == "auto":
            loader = runner.cfg.get("test_dataloader") or runner.cfg.get("val_dataloader") or {}
            canvases = canvases_from_test_pipeline((loader.get("dataset") or {}).get("pipeline"))
        return InferenceBuckets(size_divisor=self.size_divisor, canvases=canvases,
                                borrow_max_pixels=self.borrow_max_pixels)

    def _enable(self, runner) -> None:
        if self.graph_inference is not None:
            return
        from deform_plugin.apis import enable_fast_inference
        model = getattr(runner.model, "module", runner.model)
        training = model.training
        try:
            changed = enable_fast_inference(model, policy=self.policy, buckets=self._buckets(runner),
                                            feature_bucket_size=self.feature_bucket_size)
        except TypeError as error:  # a detector without graph inference: evaluated as it is
            print_log(f"FastInferenceHook: {error}; evaluating with mmdet's own predict", logger="current")
            self.graph_inference = False
            return
        finally:
            model.train(training)
        self.graph_inference = changed["graph_inference"]
        buckets = self.graph_inference.buckets
        print_log(f"FastInferenceHook: {self.policy}; inputs padded to "
                  f"{buckets if buckets is not None else 'nothing (exact shapes)'}", logger="current")

    def before_val(self, runner) -> None:
        self._enable(runner)

    def before_test(self, runner) -> None:
        self._enable(runner)

    def _report(self, stage: str) -> None:
        if self.graph_inference:
            print_log(f"FastInferenceHook ({stage}): {self.graph_inference.stats()}", logger="current")

    def after_val(self, runner) -> None:
        self._report("validation")

    def after_test(self, runner) -> None:
        self._report("test")
