"""Task 4: a small residual CNN trained from scratch on scikit-learn's bundled digits.

The images, splits and evaluation are task 2's (:class:`~hot_compile.harness.tasks.vit.DigitsTask`):
1,797 greyscale 8×8 digits, 20% test, 10% of the rest for validation. The network is ResNet's pattern
at digit size: a 3×3 stem, two residual blocks of 3×3 convolutions (the second halving the grid
with a 1×1 strided shortcut), global average pooling and a linear classifier. Its convolutions are
HOT's conv sites; the classifier is the loss head.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import Schedule
from .vit import CLASSES, DigitsTask


@dataclasses.dataclass(frozen=True)
class CNNSize:
    channels: int = 32
    batch: int = 64


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))) + self.shortcut(x))


class CNN(nn.Module):
    def __init__(self, size: CNNSize):
        super().__init__()
        c = size.channels
        self.stem = nn.Conv2d(1, c, 3, 1, 1)
        self.blocks = nn.Sequential(ResidualBlock(c, c, 1), ResidualBlock(c, 2 * c, 2))
        self.head = nn.Linear(2 * c, CLASSES)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(images.unsqueeze(1))))
        return self.head(x.mean((2, 3)))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(images), labels)


class DigitsCNNTask(DigitsTask):
    name = "cnn"

    def build_model(self) -> nn.Module:
        return CNN(self.size)


TINY = CNNSize(channels=8, batch=8)
DEFAULT_SCHEDULE = Schedule(steps=600, lr=8e-3, warmup=30, weight_decay=0.05, eval_every=200)
TINY_SCHEDULE = Schedule(steps=3, lr=2e-3)
