"""Models. Every model exposes ``body`` (feature extractor) and ``head`` (final linear classifier)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class CNN(nn.Module):
    """The papers' CNN: three convolutions, one pooling layer, two fully connected layers.

    Feddle (App. D) states only the layer counts; widths (32, 64, 64, 128) and 3x3 kernels are
    our choice (docs/methods.md). The input size is free: the flattened size follows it.
    """

    def __init__(self, in_channels: int, image_size: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        pooled = image_size // 2
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * pooled * pooled, 4 * width),
            nn.ReLU(),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


MODELS: dict[str, Callable[[int, int, int], nn.Module]] = {"cnn": CNN}


def build_model(name: str, in_channels: int, image_size: int, num_classes: int, seed: int) -> nn.Module:
    """Model `name`, initialised deterministically from `seed`."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](in_channels, image_size, num_classes)
