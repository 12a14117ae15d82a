"""The input adapter and the ``adapt -> body -> head`` composition every built-in model is (the package's
docstring), and the seeded construction they share."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# normalize option -> (mean, std) per channel, or None
NORMALIZATIONS: dict[str, tuple[tuple[float, ...], tuple[float, ...]] | None] = {
    "none": None,
    "imagenet": (IMAGENET_MEAN, IMAGENET_STD),  # torchvision's ImageNet checkpoints
    "half": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),  # Google's / VPT's ImageNet-21k ViT checkpoints
}


class InputAdapter(nn.Module):
    """Maps (N, C, H, W) images in [0, 1] to the network's channels, size and normalisation.

    Channels: 1 -> C by repetition, C -> 1 by the mean, equal counts unchanged (others: error).
    Size: bilinear ``F.interpolate`` (``align_corners=False``, no antialias) to ``size`` x ``size``
    when the input is not that size already. Normalisation: ``(x - mean) / std`` per channel.
    Parameter-free; mean/std are non-persistent buffers (they move with ``.to()`` but are not in
    ``state_dict()``). Channel reduction runs before the resize and repetition after it.
    """

    def __init__(self, channels: int, size: int, normalize: str = "none") -> None:
        super().__init__()
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"unknown normalize {normalize!r}; known: {sorted(NORMALIZATIONS)}")
        self.channels, self.size, self.normalize = int(channels), int(size), normalize
        stats = NORMALIZATIONS[normalize]
        if stats is not None and channels != len(stats[0]):
            if channels != 1:
                raise ValueError(f"normalize={normalize!r} has {len(stats[0])} channels, the network {channels}")
            stats = ((sum(stats[0]) / 3,), (sum(stats[1]) / 3,))
        self.register_buffer("mean", None if stats is None else torch.tensor(stats[0]).view(1, -1, 1, 1),
                             persistent=False)
        self.register_buffer("std", None if stats is None else torch.tensor(stats[1]).view(1, -1, 1, 1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"expected images (N, C, H, W), got shape {tuple(x.shape)}")
        c = x.shape[1]
        if c != self.channels:
            if self.channels == 1:
                x = x.mean(dim=1, keepdim=True)
            elif c != 1:
                raise ValueError(f"cannot map {c} input channels to the network's {self.channels}")
        if x.shape[-2:] != (self.size, self.size):
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False, antialias=False)
        if x.shape[1] != self.channels:
            x = x.expand(-1, self.channels, -1, -1)
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return x

    def extra_repr(self) -> str:
        return f"channels={self.channels}, size={self.size}, normalize={self.normalize!r}"


class AdaptedNet(nn.Module):
    """``head(body(adapt(x)))``. ``adapt`` is registered first and has no parameters, so the
    parameter names are ``body.*`` then ``head.*``."""

    adapt: InputAdapter
    body: nn.Module
    head: nn.Linear

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """What the head sees, from raw images (any channels and size)."""
        return self.body(self.adapt(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.adapt(x)))


@contextmanager
def seeded(seed: int):
    """Run the block with torch's CPU generator seeded with `seed`; restore it afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield

