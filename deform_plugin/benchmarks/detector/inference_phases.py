"""Where a batch-1 ``inference_detector`` call spends its time: the test pipeline on the host, the data
preprocessor, the detector's forward and its post-processing.

The per-image figures of :mod:`.inference_loop` say how fast a row is; this says why. Each phase is timed with the
device synchronised at its start and end, so a phase's figure is its own host and device time (the
synchronisations cost some overlap the plain loop has, which is why these figures run beside the timed loop and
never replace it). Phases:

- ``pipeline``: the config's test pipeline (decode-free here: images are arrays; resize, packing), host only;
- ``preprocess``: the data preprocessor (copy to the device, colour order, normalisation, padding);
- ``forward``: ``predict`` without its post-processing (a graph replay, or eager launches);
- ``postprocess``: the head's ``predict_by_feat`` (top-k, boxes rescaled to the image) or, for MaskFormer, the
  panoptic fusion head's ``predict``;
- ``other``: what is left of the call (inference_detector's own work: config copy, pipeline build, collation).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator, List, Sequence

import numpy as np
import torch

PHASES = ("pipeline", "preprocess", "forward", "postprocess", "other")


class _PhaseClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.seconds: Dict[str, float] = {}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, phase: str, function: Callable) -> Callable:
        def call(*args, **kwargs):
            self.sync()
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started
        return call


def _postprocess_owner(model):
    """The object and attribute name of the model's post-processing (see the module)."""
    if hasattr(model, "panoptic_fusion_head"):
        return model.panoptic_fusion_head, "predict"
    return model.bbox_head, "predict_by_feat"


@contextlib.contextmanager
def _phase_timers(model, clock: _PhaseClock) -> Iterator[None]:
    """The phases' wrappers in place for the block: instance attributes on the model's parts, and the test
    pipeline's ``Compose.__call__`` (``inference_detector`` builds a new Compose on each call)."""
    from mmcv.transforms import Compose
    owner, name = _postprocess_owner(model)
    patched = [(model.data_preprocessor, "forward", "preprocess"), (model, "predict", "predict"),
               (owner, name, "postprocess")]
    saved = [(obj, attr, obj.__dict__.get(attr)) for obj, attr, _ in patched]
    compose_call = Compose.__call__
    try:
        for obj, attr, phase in patched:
            setattr(obj, attr, clock.timed(phase, getattr(obj, attr)))
        Compose.__call__ = clock.timed("pipeline", compose_call)
        yield
    finally:
        Compose.__call__ = compose_call
        for obj, attr, value in saved:
            if value is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)


def caption_prompt(model) -> dict:
    """``inference_detector``'s text arguments for a grounding detector (one with a language model): its classes as
    the caption, each one entity, as ``CocoDataset(return_classes=True)`` prompts in training and evaluation
    (``custom_entities`` also keeps mmdet from parsing the caption with NLTK, whose data it would download); {} for
    other detectors."""
    if getattr(model, "language_model", None) is None:
        return {}
    return dict(text_prompt=" . ".join(model.dataset_meta["classes"]), custom_entities=True)


def time_phases(model, images: Sequence[np.ndarray]) -> Dict[str, float]:
    """Mean milliseconds per image of each phase (:data:`PHASES`) and of the whole call, over ``images`` (a grounding
    detector prompted as the timed loop prompts it)."""
    from mmdet.apis import inference_detector

    if not images:
        raise ValueError("time_phases needs at least one image")
    prompt = caption_prompt(model)
    clock = _PhaseClock(next(model.parameters()).device)
    totals: List[float] = []
    with _phase_timers(model, clock):
        for image in images:
            clock.sync()
            started = time.perf_counter()
            inference_detector(model, image, **prompt)
            clock.sync()
            totals.append(time.perf_counter() - started)
    seconds = dict(clock.seconds)
    predict = seconds.pop("predict", 0.0)
    seconds["forward"] = predict - seconds.get("postprocess", 0.0)
    seconds["other"] = sum(totals) - predict - seconds.get("pipeline", 0.0) - seconds.get("preprocess", 0.0)
    result = {phase: 1e3 * seconds.get(phase, 0.0) / len(images) for phase in PHASES}
    result["total"] = 1e3 * sum(totals) / len(images)
    return result
