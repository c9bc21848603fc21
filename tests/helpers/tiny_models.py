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
