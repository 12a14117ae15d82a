"""The one place where trainable parameters become a flat tensor and an ``ArrayRecord``, and back.

Only trainable parameters travel and are aggregated (with LoRA: the adapters and the head).
Strategies, atlases and buffers work on flat float32 tensors; the wire format is an
``ArrayRecord`` keyed by parameter name, so Flower's own strategies can read it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn


class BadArrays(ValueError):
    """Arrays that do not fit the model (wrong names, shapes, dtype) or are not finite."""


@dataclass(frozen=True)
class ParamSpec:
    """Names and shapes of a model's trainable parameters, in ``named_parameters()`` order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(model: nn.Module) -> ParamSpec:
        named = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
        return ParamSpec(tuple(n for n, _ in named), tuple(s for _, s in named))

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(s)) for s in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def flatten(self, model: nn.Module) -> torch.Tensor:
        """A detached float32 copy of the model's trainable parameters."""
        params = dict(model.named_parameters())
        return torch.cat([params[n].detach().reshape(-1) for n in self.names]).float().clone()

    def load_into(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Write `flat` into the model's trainable parameters (in place)."""
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, chunk, shape in zip(self.names, torch.split(flat, self.sizes), self.shapes):
                params[n].copy_(chunk.reshape(shape))

    def to_record(self, flat: torch.Tensor) -> ArrayRecord:
        chunks = torch.split(flat.detach().cpu(), self.sizes)
        return ArrayRecord({n: c.reshape(s).contiguous() for n, c, s in zip(self.names, chunks, self.shapes)})

    def from_record(self, record: ArrayRecord) -> torch.Tensor:
        """The flat tensor in `record`, or :class:`BadArrays` naming what does not fit."""
        if list(record.keys()) != list(self.names):
            missing = sorted(set(self.names) - set(record.keys()))
            extra = sorted(set(record.keys()) - set(self.names))
            raise BadArrays(f"parameter names differ (missing {missing[:3]}, unexpected {extra[:3]})")
        chunks = []
        for name, shape in zip(self.names, self.shapes):
            arr = record[name].numpy()
            if tuple(arr.shape) != shape:
                raise BadArrays(f"'{name}' has shape {tuple(arr.shape)}, expected {shape}")
            if not np.issubdtype(arr.dtype, np.floating):
                raise BadArrays(f"'{name}' has dtype {arr.dtype}, expected a float dtype")
            chunks.append(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(-1))
        flat = torch.cat(chunks)
        if not torch.isfinite(flat).all():
            raise BadArrays(f"{int((~torch.isfinite(flat)).sum())} non-finite values")
        return flat
