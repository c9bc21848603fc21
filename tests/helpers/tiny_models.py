"""Small models for the engine's tests."""
from torch import nn


class TwoLossModel(nn.Module):
    """One linear layer with two losses, as a detector's ``loss`` returns several."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def losses(self, x):
        out = self.linear(x)
        return dict(loss_a=(out ** 2).mean(), loss_b=out.abs().mean())


class SmallDetector(nn.Module):
    """Every trainable tensor has a gradient well away from zero.

    Adam divides each gradient by its own running magnitude: a tensor whose true gradient is zero (a conv bias
    right before a BatchNorm) gets full-size updates from rounding noise, which no tolerance can compare. So the
    conv before the BatchNorm has no bias, as in ResNets.
    """

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1))
        self.backbone[1].weight.requires_grad_(False)  # a frozen tensor, as frozen stages have
        self.neck = nn.Sequential(nn.Conv2d(8, 16, 1), nn.GroupNorm(4, 16))
        self.sampling_offsets = nn.Linear(16, 8)
        self.query_embed = nn.Embedding(5, 16)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))

    def forward(self, x):
        feat = self.neck(self.backbone(x)).mean((2, 3))
        return (self.head(feat + self.query_embed.weight.sum(0)) ** 2).sum() + self.sampling_offsets(feat).sum()
