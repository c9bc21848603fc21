"""The inference benchmark's shared weights: every parameter defined, whatever memory the process held before."""
from pathlib import Path

import torch

from deform_plugin.benchmarks.detector.inference import save_random_weights

TINY_DINO = Path(__file__).resolve().parent / "configs" / "dino-4scale_r18_tiny_coco.py"


def test_saved_random_weights_leave_no_parameter_uninitialised(tmp_path):
    """mmdet's ``init_detector(config, None)`` builds the model without ``init_weights()``: DINO's and
    Deformable-DETR's ``level_embed`` is then ``torch.Tensor(L, C)``, whatever the heap held (often zeros, sometimes
    garbage: NaN in one run's detections and not in the next). PyTorch's fill of uninitialised memory turns any such
    parameter into NaN here, in every run."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        save_random_weights(str(TINY_DINO), tmp_path / "weights.pth", seed=0)
    finally:
        torch.use_deterministic_algorithms(previous[0])
        torch.utils.deterministic.fill_uninitialized_memory = previous[1]
    state = torch.load(tmp_path / "weights.pth", map_location="cpu")["state_dict"]
    undefined = sorted(name for name, tensor in state.items()
                       if tensor.is_floating_point() and not torch.isfinite(tensor).all())
    assert not undefined, f"parameters left uninitialised: {undefined}"
    assert state["level_embed"].std() > 0  # initialised by DINO's init_weights (normal), not zeros
