"""The mmdet release whose private code deform_plugin's copies mirror line for line, and the one check of it.

The fast paths (:mod:`.mmdet_fast_paths`) and the graphed inference (:mod:`.mmdet_graph_inference`) replace or
repeat private methods of mmdet; they are exact only on the release those copies were taken from.
"""
MIRRORED_MMDET_VERSION = "3.3.0"

__all__ = ["MIRRORED_MMDET_VERSION", "check_mirrored_mmdet_version"]


def check_mirrored_mmdet_version(feature: str) -> None:
    """Refuse ``feature`` (a copy of mmdet-private code, named as its user turns it on) on another mmdet release."""
    import mmdet
    if mmdet.__version__ != MIRRORED_MMDET_VERSION:
        raise RuntimeError(
            f"deform_plugin's {feature} mirrors private methods of mmdet {MIRRORED_MMDET_VERSION}, but mmdet "
            f"{mmdet.__version__} is installed: turn it off or install mmdet=={MIRRORED_MMDET_VERSION}")
