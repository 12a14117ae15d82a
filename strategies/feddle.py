"""Feddle — Federated Dual Learning (Zhu et al., "Guided Model Merging for Hybrid Data Learning",
arXiv 2503.20138; v1 "Unlocking the Value of Decentralized Data", below "004").

The server keeps a *model atlas* of at most M anchors, each a received client update a_m (stale
ones too). At each search it rescales the anchors to their median ℓ2 norm (Eq. 5),

    ā_m = median_j ‖a_j‖ · a_m / ‖a_m‖,

and searches one coefficient per anchor on its own data, starting from FedBuff's step expressed on
the atlas (the *fallback* c′, §4.1.3) and pulled back to it with strength λ (Eq. 11):

    ĉ = argmin_c  ℓ(D_S; ω + Σ_m c_m ā_m) + λ/2 ‖c − c′‖²        (Eq. 6 / 11, in-domain)
    ω ← ω + Σ_m ĉ_m ā_m                                            (Eq. 7)

Out of domain (server data with its own labels), a new linear head θ over the body's features is
fitted first at c′ (Eq. 9) and frozen while c moves (Eq. 10); the found ĉ updates the whole model.
Gradients w.r.t. c use the projection of App. E (Eq. 16–17): one forward/backward at the merged
weights ω′, then ∂ℓ/∂c_m = ⟨∂ℓ/∂ω′, ā_m⟩. After a search each anchor's importance is s_m = |ĉ_m|;
a new update replaces the anchor with the lowest score once the atlas is full.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from strategies.base import AsyncStrategy, Update


def median_normalize(anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5: every row rescaled to the median row norm. Returns (ā, ‖a‖)."""
    norms = anchors.norm(dim=1)
    return anchors * (norms.median() / norms.clamp_min(1e-12)).unsqueeze(1), norms


class Feddle(AsyncStrategy):
    """Coefficient search over a model atlas of client updates, guided by the server's data.

    Args:
        atlas_size: M, the most anchors kept (papers: 2 × clients per step).
        search_lr: learning rate of the optimiser on c (papers' grid 1e-5, 1e-4, 1e-3).
        server_epochs: E_g, passes over the server data per search (grid 1, 10, 20); 0 = no search.
        batch_size: mini-batch of the search.
        fallback_lambda: λ of Eq. 11 (papers: 0 in-domain, 0.01 out-of-domain).
        fallback_lr, fallback_buffer: FedBuff's η_g and the update count it divides by; c′ puts
            η_g / B on the anchors that arrived since the last search, B = their count, or
            ``fallback_buffer`` when set (docs/methods.md).
        fallback_init: start the search at c′ (else at 0, the ablation "base").
        normalize: Eq. 5 on (else raw anchors).
        importance: evict the lowest |ĉ| (else the oldest anchor, FIFO).
        head_epochs, head_lr: out-of-domain only, the fit of θ before each search (warm-started).
        diagnostics: report the server-data loss before and after each search (two extra forward
            passes over the server data; off saves them on a CPU-only server).
        criterion: the loss ℓ (cross-entropy, as the clients').
        train_config, clients_per_round, seed: as in :class:`HybridStrategy`.
    """

    def __init__(self, atlas_size: int = 20, search_lr: float = 1e-3, server_epochs: int = 1, batch_size: int = 64,
                 fallback_lambda: float = 0.0, fallback_lr: float = 1.0, fallback_buffer: int = 0,
                 fallback_init: bool = True, normalize: bool = True, importance: bool = True,
                 head_epochs: int = 5, head_lr: float = 1e-2, diagnostics: bool = True,
                 criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy, *,
                 train_config: dict[str, Any] | None = None, clients_per_round: int = 10, seed: int = 0) -> None:
        super().__init__(train_config, clients_per_round, seed)
        self.atlas_size, self.search_lr, self.server_epochs, self.batch_size = (atlas_size, search_lr,
                                                                                server_epochs, batch_size)
        self.fallback_lambda, self.fallback_lr, self.fallback_buffer = fallback_lambda, fallback_lr, fallback_buffer
        self.fallback_init, self.normalize, self.importance = fallback_init, normalize, importance
        self.head_epochs, self.head_lr, self.criterion = head_epochs, head_lr, criterion
        self.diagnostics = diagnostics
        self.anchors: list[torch.Tensor] = []  # raw a_m; normalised on the fly at each search
        self.scores: list[float] = []  # s_m = |ĉ_m| of the last search; +inf until an anchor is searched
        self.fresh: list[bool] = []  # arrived since the last search (the FedBuff buffer of the fallback)
        self._order: list[int] = []  # arrival order, for FIFO eviction
        self._arrivals = 0
        self._closed = False
        self.model: nn.Module | None = None
        self.theta: nn.Linear | None = None  # the OOD head, kept across searches
        self.last_search: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg: Any, **common: Any) -> Feddle:
        return cls(cfg.atlas_size, cfg.search_lr, cfg.server_epochs, cfg.search_batch_size, cfg.fallback_lambda,
                   cfg.server_lr, 0, cfg.fallback_init, cfg.anchor_normalization, cfg.importance_score,
                   diagnostics=cfg.search_diagnostics, **common)

    def attach(self, model: nn.Module) -> None:
        """The model architecture the search evaluates (its trainable parameters are ω's layout)."""
        self.model = model

    # -- atlas ------------------------------------------------------------------------------
    def receive(self, update: Update) -> None:
        """Every update becomes an anchor; a full atlas replaces its least important one (Alg. 1, l. 14–19)."""
        self._arrivals += 1
        if len(self.anchors) < self.atlas_size:
            self.anchors.append(update.delta)
            self.scores.append(float("inf"))
            self.fresh.append(True)
            self._order.append(self._arrivals)
            return
        key = self.scores if self.importance else self._order
        m = min(range(len(self.anchors)), key=lambda i: (key[i], self._order[i]))
        self.anchors[m], self.scores[m], self.fresh[m], self._order[m] = update.delta, float("inf"), True, self._arrivals

    def close_round(self) -> None:
        self._closed = any(self.fresh)

    def ready(self) -> bool:
        return self._closed

    # -- search -----------------------------------------------------------------------------
    def fallback(self, norms: torch.Tensor) -> torch.Tensor:
        """c′: FedBuff's step ω + η_g/B Σ_{fresh} a_m written on the (normalised) atlas."""
        fresh = torch.tensor(self.fresh)
        count = self.fallback_buffer or int(fresh.sum())
        scale = norms / norms.median() if self.normalize else torch.ones_like(norms)
        return torch.where(fresh, self.fallback_lr / count * scale, torch.zeros_like(norms))

    def aggregate(self, server: Any = None) -> torch.Tensor:
        started = time.perf_counter()
        anchors = torch.stack(self.anchors)
        bar, norms = median_normalize(anchors) if self.normalize else (anchors, anchors.norm(dim=1))
        c_prime = self.fallback(norms)
        c = c_prime.clone() if self.fallback_init else torch.zeros_like(c_prime)
        stats: dict[str, float] = {}
        if server is not None and self.server_epochs > 0:
            if self.model is None:
                raise RuntimeError("Feddle needs attach(model) before it can search on server data")
            c, stats = self.search(bar, c, c_prime, server)
        self.params = self.params + c @ bar  # Eq. 7
        self.scores = c.abs().tolist()
        self.fresh = [False] * len(self.anchors)
        self._closed = False
        self.version += 1
        self.last_search = {"c-min": float(c.min()), "c-mean": float(c.mean()), "c-max": float(c.max()),
                            "c-negative": float((c < 0).float().mean()), "anchors": len(self.anchors),
                            "search-seconds": time.perf_counter() - started, **stats}
        return self.params

    def search(self, bar: torch.Tensor, c: torch.Tensor, c_prime: torch.Tensor,
               server: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """Adam on c for E_g epochs over the server data, gradients by projection (Eq. 16–17)."""
        device = server.device
        model, spec = self.model.to(device), self.spec
        x, y = server.tensors()
        bar, c, c_prime, omega = bar.to(device), c.to(device), c_prime.to(device), self.params.to(device)
        ood = not server.in_domain
        if ood:
            self.fit_head(omega + c @ bar, x, y)  # Eq. 9, at the fallback coefficients
        c = c.clone().requires_grad_(True)
        opt = torch.optim.Adam([c], lr=self.search_lr)
        gen = torch.Generator().manual_seed(self.seed + self.version)
        stats = {"loss-before": self.loss_at(omega + c.detach() @ bar, x, y, ood)} if self.diagnostics else {}
        for _ in range(self.server_epochs):
            for idx in torch.randperm(len(y), generator=gen).split(self.batch_size):
                grad = self.projected_grad(omega + c.detach() @ bar, bar, x[idx.to(device)], y[idx.to(device)], ood)
                opt.zero_grad()
                c.grad = grad + self.fallback_lambda * (c.detach() - c_prime)  # Eq. 11's pull
                opt.step()
        if self.diagnostics:
            stats["loss-after"] = self.loss_at(omega + c.detach() @ bar, x, y, ood)
        spec.load_into(model, self.params.to(device))
        return c.detach().cpu(), stats

    def _loss(self, merged: torch.Tensor, x: torch.Tensor, y: torch.Tensor, ood: bool) -> torch.Tensor:
        self.spec.load_into(self.model, merged)
        logits = self.theta(self.model.features(x)) if ood else self.model(x)
        return self.criterion(logits, y)

    def projected_grad(self, merged: torch.Tensor, bar: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                       ood: bool) -> torch.Tensor:
        """∂ℓ/∂c_m = ⟨∂ℓ/∂ω′, ā_m⟩ with ω′ = stop_grad(ω + Σ c_m ā_m) (Eq. 16–17)."""
        self.model.eval()
        self.model.zero_grad(set_to_none=True)
        self._loss(merged, x, y, ood).backward()
        params = dict(self.model.named_parameters())
        g = torch.cat([(params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])).reshape(-1)
                       for n in self.spec.names])
        return bar @ g

    @torch.no_grad()
    def loss_at(self, merged: torch.Tensor, x: torch.Tensor, y: torch.Tensor, ood: bool) -> float:
        self.model.eval()
        return float(self._loss(merged, x, y, ood))

    def fit_head(self, merged: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        """Eq. 9: θ* = argmin_θ h(D′_S; [ω_bo + Σ c′ ā_bo; θ]); warm-started across searches, then frozen."""
        self.spec.load_into(self.model, merged)
        self.model.eval()
        with torch.no_grad():
            feats = self.model.features(x)
        classes = int(y.max()) + 1
        if self.theta is None or self.theta.out_features < classes:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                self.theta = nn.Linear(feats.shape[1], classes).to(x.device)
        self.theta.requires_grad_(True)
        opt = torch.optim.Adam(self.theta.parameters(), lr=self.head_lr)
        gen = torch.Generator().manual_seed(self.seed + self.version)
        for _ in range(self.head_epochs):
            for idx in torch.randperm(len(y), generator=gen).split(self.batch_size):
                opt.zero_grad()
                F.cross_entropy(self.theta(feats[idx.to(x.device)]), y[idx.to(x.device)]).backward()
                opt.step()
        self.theta.requires_grad_(False)

    def metrics(self) -> dict[str, float]:
        return dict(self.last_search)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "atlas-size": self.atlas_size, "search-lr": self.search_lr,
                "server-epochs": self.server_epochs, "fallback-lambda": self.fallback_lambda,
                "fallback-init": self.fallback_init, "anchor-normalization": self.normalize,
                "importance-score": self.importance, "search-diagnostics": self.diagnostics}
