"""CUDA graphs for calls whose input sizes vary: one cache and one capture policy for training and inference."""
from .cache import GraphCache, SharedBuffers
from .policy import (DEFAULT_FEATURE_BUCKET_SIZE, CapturePolicy, InferenceBuckets, canvases_from_test_pipeline,
                     check_feature_bucket_size, smallest_covering)

__all__ = ["CapturePolicy", "DEFAULT_FEATURE_BUCKET_SIZE", "GraphCache", "InferenceBuckets", "SharedBuffers",
           "canvases_from_test_pipeline", "check_feature_bucket_size", "smallest_covering"]
