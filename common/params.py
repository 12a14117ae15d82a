"""The one place where trainable parameters become a flat tensor and an ``ArrayRecord``, and back.

Only trainable parameters travel and are aggregated (with LoRA: the adapters and the head).
Strategies, atlases and buffers work on flat float32 tensors, and so does the wire: an
``ArrayRecord`` with the one array ``"params"``. One array instead of one per tensor cuts what
Flower pushes per message to a handful of objects: a dispatch on a local deployment took 20-30 ms
instead of 55-160 ms for the 10-tensor CNN (BENCHMARKS.md). Flower's own strategies average it
like any other array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from common.codecs import PLAIN, WIRE_KEY, BadArrays, decode, finite_float32


def extras_to_record(arrays: dict[str, torch.Tensor]) -> ArrayRecord:
    """A strategy's extra tensors (any names and shapes) as an ``ArrayRecord``."""
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in arrays.items()})


def extras_from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The extra tensors in `record` (float32), or :class:`BadArrays` naming one that is not finite floats."""
    return {k: torch.from_numpy(finite_float32(k, record[k].numpy())) for k in record}


@dataclass(frozen=True)
class ParamSpec:
    """Names and shapes of a model's trainable parameters, in ``named_parameters()`` order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(model: nn.Module) -> ParamSpec:
        named = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
        return ParamSpec(tuple(n for n, _ in named), tuple(s for _, s in named))

    @staticmethod
    def of_record(record: ArrayRecord) -> ParamSpec:
        """A spec for the flat parameters in `record` when the model is not at hand (Flower's ``start``)."""
        if list(record.keys()) != [WIRE_KEY]:
            raise BadArrays(f"expected one array '{WIRE_KEY}', got {sorted(record.keys())[:4]}")
        return ParamSpec((WIRE_KEY,), (tuple(record[WIRE_KEY].shape),))

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
        return ArrayRecord({WIRE_KEY: flat.detach().cpu().float().contiguous()})

    def from_record(self, record: ArrayRecord) -> torch.Tensor:
        """The flat tensor in `record`, or :class:`BadArrays` naming what does not fit."""
        return torch.from_numpy(decode(record, "none", self.numel, PLAIN))
