"""Task 2: a small Vision Transformer trained from scratch on scikit-learn's bundled digits.

``sklearn.datasets.load_digits``: 1,797 greyscale 8×8 images of handwritten digits (shipped inside
scikit-learn, no download), split 80/20 stratified with a fixed seed, and 10% of the training
images held out (stratified) as the validation split. Each image is cut into 16
patches of 2×2 pixels; the classifier averages the 16 token outputs (no class token), so every
image is exactly one 16-token block of HLA's Walsh transform and the low-pass rows run over the
4×4 patch grid of one image, never across two images.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import Batch, Schedule, classification_metrics
from ..models import Block, init_weights

IMAGE = 8
PATCH = 2
CLASSES = 10
TEST_FRACTION = 0.2
# Of the images left for training, the part held out to choose settings on.
VALIDATION_FRACTION = 0.1
SPLIT_SEED = 0


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """Images as float32 ``[n, 8, 8]`` in [0, 1] and labels ``[n]`` (raises ImportError without scikit-learn)."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    return images, torch.tensor(digits.target, dtype=torch.long)


def stratified_split(labels: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (train, test): ``fraction`` of every class, chosen by a seeded permutation, goes to test."""
    generator = torch.Generator().manual_seed(seed)
    train, test = [], []
    for c in labels.unique().tolist():
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=generator)]
        cut = round(len(idx) * fraction)
        test.append(idx[:cut])
        train.append(idx[cut:])
    return torch.cat(train).sort().values, torch.cat(test).sort().values


@dataclasses.dataclass(frozen=True)
class ViTSize:
    dim: int = 64
    layers: int = 4
    heads: int = 4
    batch: int = 64


def patchify(images: torch.Tensor) -> torch.Tensor:
    """``[n, 8, 8]`` → ``[n, 16, 4]``: 2×2 patches in raster order."""
    n = images.shape[0]
    grid = IMAGE // PATCH
    return images.view(n, grid, PATCH, grid, PATCH).permute(0, 1, 3, 2, 4).reshape(n, grid * grid, PATCH * PATCH)


class ViT(nn.Module):
    def __init__(self, size: ViTSize):
        super().__init__()
        tokens = (IMAGE // PATCH) ** 2
        self.embed = nn.Linear(PATCH * PATCH, size.dim)
        self.pos = nn.Parameter(torch.zeros(1, tokens, size.dim))
        self.blocks = nn.ModuleList(Block(size.dim, size.heads, causal=False) for _ in range(size.layers))
        self.ln = nn.LayerNorm(size.dim)
        self.head = nn.Linear(size.dim, CLASSES)
        self.apply(init_weights)
        nn.init.normal_(self.pos, std=0.02)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(patchify(images)) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).mean(1))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(images), labels)


class DigitsTask:
    name = "vit"
    metric = "accuracy"
    higher_is_better = True

    def __init__(self, size: ViTSize = ViTSize(), limit: int | None = None):
        self.size = size
        images, labels = load_digits()
        train, test = stratified_split(labels, TEST_FRACTION, SPLIT_SEED)
        fit, validation = stratified_split(labels[train], VALIDATION_FRACTION, SPLIT_SEED)
        train, validation = train[fit], train[validation]
        if limit is not None:
            train, validation, test = train[:limit], validation[:limit], test[:limit]
        self.train_images, self.train_labels = images[train], labels[train]
        self.validation_images, self.validation_labels = images[validation], labels[validation]
        self.test_images, self.test_labels = images[test], labels[test]

    def build_model(self) -> nn.Module:
        return ViT(self.size)

    def batches(self, generator: torch.Generator) -> Iterator[Batch]:
        # Epochs of a seeded permutation; the ragged tail is dropped so every step has one shape.
        n, b = len(self.train_labels), min(self.size.batch, len(self.train_labels))
        while True:
            order = torch.randperm(n, generator=generator)
            for start in range(0, n - b + 1, b):
                idx = order[start : start + b]
                yield self.train_images[idx], self.train_labels[idx]

    def draw(self, count: int, generator: torch.Generator) -> Batch:
        """``count`` distinct training images."""
        idx = torch.randperm(len(self.train_labels), generator=generator)[:count]
        return self.train_images[idx], self.train_labels[idx]

    def calibration_batches(self, count: int = 4) -> list[Batch]:
        data = self.batches(torch.Generator().manual_seed(0x5EED))
        return [next(data) for _ in range(count)]

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {
            **classification_metrics(model.logits(self.validation_images), self.validation_labels, "val_"),
            **classification_metrics(model.logits(self.test_images), self.test_labels),
        }


TINY = ViTSize(dim=16, layers=1, heads=2, batch=8)
DEFAULT_SCHEDULE = Schedule(steps=1000, lr=2e-3, warmup=50, weight_decay=0.05, eval_every=200)
TINY_SCHEDULE = Schedule(steps=3, lr=2e-3)
