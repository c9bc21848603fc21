"""Whole-detector benchmarks (training and inference of mmdet configs)."""
