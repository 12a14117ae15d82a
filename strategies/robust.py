"""Defences against hostile devices for the methods that average updates, one option away.

Two steps, each off by default (the papers' methods as published):

* **Norm bound** (Sun et al., "Can You Really Backdoor Federated Learning?", 2019; the clipping of McMahan et al.,
  "Learning Differentially Private Recurrent Language Models", ICLR 2018): every update is scaled to at most a
  bound B before it counts, Δ ← Δ · min(1, B / ‖Δ‖₂). B is ``update-norm-bound`` (absolute), or
  ``update-norm-multiple`` × the median norm of the last :data:`NORM_WINDOW` updates and the step's own (relative:
  no scale to guess; honest updates shrink as training converges and the bound follows), or the smaller of the two.
* **Coordinate-wise robust mean** (Yin et al., "Byzantine-Robust Distributed Learning: Towards Optimal Statistical
  Rates", ICML 2018): Σ_i w_i Δ_i becomes (Σ_i w_i) · R(Δ_1 … Δ_n), with R, per coordinate, the mean of the values
  left after cutting the ⌊β n⌋ largest and smallest (``trimmed-mean``, β = ``trim-fraction``) or the median
  (``median``). R weighs every update alike: a lie about ``num-examples`` gains nothing, and the example weights only
  set the step's length (Σ w_i: 1 for an example-weighted mean, less where stale updates are weighted down).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from common.config import OneOf, Range, option

NORM_WINDOW = 100  # the recent update norms the relative bound takes its median over
AGGREGATIONS = ("mean", "trimmed-mean", "median")


@dataclass(frozen=True)
class NormBoundConfig:
    """The norm bound's keys: every method whose updates are model deltas can clip them."""

    update_norm_bound: float = option(0.0, Range(0), "clip every update to this ℓ2 norm, Δ · min(1, B/‖Δ‖) "
                                      "(0 = off)")
    update_norm_multiple: float = option(0.0, Range(0), "clip every update to this multiple of the median norm of "
                                         "the last 100 updates and the step's own (0 = off; e.g. 3)")


@dataclass(frozen=True)
class RobustConfig(NormBoundConfig):
    """The norm bound, and a robust mean in place of the weighted one, for methods that average several updates."""

    aggregation: str = option("mean", OneOf(AGGREGATIONS), "how a step averages its updates: the method's weighted "
                              "`mean`, or per coordinate the `trimmed-mean` or the `median` (unweighted; the weights "
                              "keep only the step's length)")
    trim_fraction: float = option(0.1, Range(0, 0.49), "β: with `trimmed-mean`, the fraction of the updates cut at "
                                  "each end of every coordinate (⌊β n⌋ each side)")


def clip(deltas: list[torch.Tensor], config: NormBoundConfig, recent: list[float]) -> list[torch.Tensor]:
    """`deltas` scaled to the norm bound (none when both keys are 0). `recent` holds the last norms seen: this step's
    join it. Norms are taken in float64, where a finite float32 update's norm cannot overflow."""
    norms = [float(torch.linalg.vector_norm(d, dtype=torch.float64)) for d in deltas]
    bound = config.update_norm_bound or float("inf")
    if config.update_norm_multiple:
        bound = min(bound, config.update_norm_multiple * statistics.median([*recent, *norms]))
    recent.extend(norms)
    del recent[:-NORM_WINDOW]
    return [d * (bound / n) if n > bound else d for d, n in zip(deltas, norms)]


def robust_mean(deltas: list[torch.Tensor], config: RobustConfig) -> torch.Tensor:
    """R(Δ_1 … Δ_n) per coordinate: the mean of the values left after cutting the ⌊β n⌋ largest and smallest
    (``trimmed-mean``), or the median (``median``; of an even n, its two middle values' mean)."""
    n = len(deltas)
    cut = (n - 1) // 2 if config.aggregation == "median" else int(config.trim_fraction * n)
    return torch.stack(deltas).sort(dim=0).values[cut:n - cut].mean(dim=0)
