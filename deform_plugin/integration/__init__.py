"""The one layer that knows other packages' private structure, one file per outside concern.

- :mod:`.mmcv_lite`: are mmcv's compiled ops present; the stand-in ``mmcv._ext`` where they are not;
- :mod:`.mmcv_msda_backend`: mmcv's stock MSDA kernel as the op's ``'mmcv'`` backend;
- :mod:`.mmengine_checkpoint`: mmengine checkpoints under torch's weights-only loading;
- :mod:`.mmengine_pinned_samples`: a data loader's ``pin_memory`` also pins mmengine's data samples (the targets);
- :mod:`.mmdet_msda_sites`: our MSDA wherever mmdet builds one;
- :mod:`.mmdet_focal_loss`: bf16 logits through mmcv's compiled focal loss;
- :mod:`.mmdet_fast_paths`: the exact fast paths of a training step (opt-in, per model).
- :mod:`.mmdet_version`: the mmdet release that the copies of mmdet's private methods mirror, checked in one place.
- :mod:`.mmdet_detr_onnx`: ONNX export of the DETR-family detectors and its check in ONNX Runtime (tools only).
- :mod:`.mmdet_inferencer`: mmdet's ``DetInferencer`` with the model's own class names (tools only).
"""
import importlib.util


def openmmlab_installed() -> bool:
    return importlib.util.find_spec("mmcv") is not None and importlib.util.find_spec("mmengine") is not None


def install_openmmlab_integration() -> None:
    """The stand-in, the backend, the checkpoint allow-list and mmdet's patches (call where mmcv and mmengine are
    installed; the mmdet patches wait for mmdet's modules to be imported)."""
    from .mmcv_lite import install_mmcv_ext_standin
    install_mmcv_ext_standin()
    from .mmcv_msda_backend import register_mmcv_msda_backend
    register_mmcv_msda_backend()
    from .mmengine_checkpoint import install_checkpoint_allowlist
    install_checkpoint_allowlist()
    from .mmengine_pinned_samples import install_data_element_pinning
    install_data_element_pinning()
    from .mmdet_focal_loss import install_bf16_focal_loss
    from .mmdet_msda_sites import install_msda_construction_sites
    install_msda_construction_sites()
    install_bf16_focal_loss()
