"""CUDA graphs for calls whose input sizes vary: one cache and one capture policy for training and inference."""
from .cache import GraphCache, SharedBuffers
from .policy import CapturePolicy, InferenceBuckets, canvases_from_test_pipeline, smallest_covering

__all__ = ["CapturePolicy", "GraphCache", "InferenceBuckets", "SharedBuffers", "canvases_from_test_pipeline",
           "smallest_covering"]
