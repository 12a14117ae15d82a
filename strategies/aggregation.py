"""Arithmetic several strategies share: weighted sums of flat updates and their weights."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from strategies.base import Update
from strategies.robust import NormBoundConfig, clip, robust_mean


def weighted_sum(deltas: Iterable[torch.Tensor], weights: Iterable[float], like: torch.Tensor,
                 robust: Any = None, recent: list[float] | None = None) -> torch.Tensor:
    """Σ_i w_i Δ_i, accumulated in the given order (callers fix the order for reproducible floats). With `robust`
    (a method's options), its defences against hostile devices (strategies/robust.py): the deltas clipped to its
    norm bound (`recent`: the norms seen lately, updated), and with a robust ``aggregation`` (Σ_i w_i) · R(Δ).
    Options of a method without those keys (not a :class:`~strategies.robust.NormBoundConfig`) change nothing."""
    deltas, weights = list(deltas), [float(w) for w in weights]
    if isinstance(robust, NormBoundConfig) and deltas:
        deltas = clip(deltas, robust, recent if recent is not None else [])
        if getattr(robust, "aggregation", "mean") != "mean":
            return robust_mean(deltas, robust) * sum(weights)
    total = torch.zeros_like(like)
    for w, delta in zip(weights, deltas):
        total.add_(delta, alpha=float(w))
    return total


def example_weights(counts: list[int]) -> list[float]:
    """n_j / Σ n_i, computed in float64 then rounded to float32 as FedAvg applies them."""
    n = torch.tensor([float(c) for c in counts], dtype=torch.float64)
    return (n / n.sum()).to(torch.float32).tolist()


def fedavg_step(params: torch.Tensor, updates: list[Update], robust: Any = None,
                recent: list[float] | None = None) -> torch.Tensor:
    """ω + Σ_j (n_j / Σ n_i) Δ_j over `updates` summed in client order, so that the float result does not
    depend on the order replies arrived in (Zhu et al. 2025, "Unlocking the Value of Decentralized Data", arXiv
    2503.20138v1, Eq. 2); `robust` and `recent` as in :func:`weighted_sum`."""
    updates = sorted(updates, key=lambda u: u.client)
    return params + weighted_sum((u.delta for u in updates), example_weights([u.num_examples for u in updates]), params,
                                 robust, recent)


def polynomial_staleness(tau: int, a: float) -> float:
    """s(τ) = (1 + τ)^(−a)."""
    return (1.0 + tau) ** (-a)
