"""Small modules for the edge_export tests, importable as ``edge_export_factories:<name>`` by the CLI."""

import torch
from torch import nn


class MLP(nn.Module):
    """(batch, 16) float32 -> (batch, 4) float32."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """(batch, 3, 32, 32) float32 -> (batch, 10) float32 logits."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class Noise(nn.Module):
    def forward(self, x):
        return x + torch.randn_like(x)


class NoisyNet(nn.Module):
    """Uses aten.randn_like inside a submodule named 'noise': no LiteRT lowering."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.noise = Noise()

    def forward(self, x):
        return self.noise(self.proj(x))


class PositiveOnly(nn.Module):
    """Boolean masking: the output length depends on the values."""

    def forward(self, x):
        return x[x > 0]


class TokenScale(nn.Module):
    """int64 token ids in, int64 out (LiteRT runs them as int32)."""

    def forward(self, ids):
        return ids * 2 + 1


def mlp():
    torch.manual_seed(0)
    return MLP()


def small_cnn():
    torch.manual_seed(0)
    model = SmallCNN()
    model.features[1].running_mean.uniform_(-0.1, 0.1)  # non-trivial BatchNorm statistics to fold
    model.features[1].running_var.uniform_(0.5, 1.5)
    return model


def noisy_net():
    return NoisyNet()


def positive_only():
    return PositiveOnly()


def token_scale():
    return TokenScale()


not_a_module = 42


def linear_4_to_2():
    """nn.Linear(4, 2): an --input of 1x3 does not fit it."""
    torch.manual_seed(0)
    return nn.Linear(4, 2)
