"""bf16 logits reach mmcv's compiled focal loss (which has no bf16 kernel) as float32; other dtypes untouched."""
import torch

import deform_plugin  # noqa: F401  (installs the integration)


def test_focal_loss_receives_bf16_logits_in_float32():
    # mmcv's compiled sigmoid focal loss (mmdet's FocalLoss path for CUDA tensors) has no bf16 kernel.
    import mmdet.models.losses.focal_loss as focal
    from mmcv.ops import sigmoid_focal_loss as compiled
    from deform_plugin.integration.mmdet_focal_loss import sigmoid_focal_loss_accepting_bf16
    assert focal._sigmoid_focal_loss.wrapped_by_deform_plugin is compiled
    seen = []
    spy = sigmoid_focal_loss_accepting_bf16(lambda input, *args: seen.append((input.dtype, args)) or input)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        spy(torch.zeros(2, 3, dtype=dtype), torch.zeros(2, dtype=torch.long), 2.0, 0.25, None, "none")
    assert [d for d, _ in seen] == [torch.float32, torch.float16, torch.float32]
    assert all(args[1:] == (2.0, 0.25, None, "none") for _, args in seen)
    logits = torch.randn(6, 4, dtype=torch.bfloat16)
    labels = torch.randint(0, 5, (6,))
    torch.testing.assert_close(focal.sigmoid_focal_loss(logits, labels),
                               focal.sigmoid_focal_loss(logits.float(), labels))
