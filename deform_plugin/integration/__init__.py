"""The one layer that knows mmcv's and mmdet's private structure (construction sites, compiled extension)."""
