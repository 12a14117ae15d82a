"""Feddle — Federated Dual Learning (Zhu et al., "Guided Model Merging for Hybrid Data Learning",
arXiv 2503.20138v3; v1: "Unlocking the Value of Decentralized Data: A Federated Dual Learning Approach for Model
Aggregation", whose equation numbers this module cites; v3's are one lower).

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

The fallback is FedBuff with the run's own FedBuff keys (buffer-size K, server-lr η_g, weighting,
staleness): the server searches when K updates have arrived since the last search, exactly when FedBuff
would step, and c′ is FedBuff's step over those K anchors. With ``server-epochs = 0`` Feddle is FedBuff.
``search-every = step`` searches instead at the end of every round that brought an update (Alg. 1's
"round k"; spec §1.5 choice A), from FedBuff's step over that round's B arrivals (weights b_m = 1/B, uniform).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from common.config import COUNT, POSITIVE, ConfigError, OneOf, Range, option
from common.figures import Figure, Panel
from common.training import derive_seed, run_epochs, server_seed, train_on_server
from strategies.base import Strategy, Update
from strategies.fedbuff import FedBuffConfig, buffer_weights
from strategies.options import SERVER_TRAIN_LR
from strategies.robust import clip


@dataclass(frozen=True)
class FeddleConfig(FedBuffConfig):
    """Feddle's options, after its fallback's: FedBuff's own keys (buffer-size, server-lr, ...)."""

    atlas_size: int = option(20, COUNT, "M, anchors in the model atlas (papers: 2 × clients per round)")
    search_lr: float = option(1e-3, POSITIVE, "Adam learning rate on the coefficients "
                              "(grid 1e-5, 1e-4, 1e-3)")
    server_epochs: int = option(1, Range(0), "E_g, passes over the server data per search "
                                "(grid 1, 10, 20); 0 = FedBuff's step")
    search_batch_size: int = option(64, COUNT, "mini-batch of the search (and of the OOD head's fit)")
    fallback_lambda: float = option(0.0, Range(0), "λ pulling c back to FedBuff's c′ (papers: 0 "
                                    "in-domain, 0.01 out-of-domain)")
    fallback_init: bool = option(True, None, "start the search at c′ (else 0)")
    anchor_normalization: bool = option(True, None, "rescale anchors to the median norm (Eq. 5)")
    importance_score: bool = option(True, None, "evict the anchor with the smallest |c| "
                                    "(else the oldest)")
    search_diagnostics: bool = option(True, None, "log the server-data loss before and after each "
                                      "search (`loss-before`/`loss-after`; two extra forward passes per step, "
                                      "off on a slow CPU server)")
    head_epochs: int = option(5, Range(0), "out of domain: epochs of the head θ's fit before each search "
                              "(warm-started)")
    head_lr: float = option(1e-2, POSITIVE, "out of domain: Adam learning rate of the head θ's fit")
    server_finetune_epochs: int = option(0, Range(0), "after each search, epochs of Fed+FT's fine-tuning of the "
                                         "merged model on the (in-domain) server data at server-train-lr, with the "
                                         "clients' optimizer and batch size; 0 = off (not in the papers)")
    server_train_lr: float = SERVER_TRAIN_LR.field()
    step_length: str = option("searched", OneOf(("searched", "fallback")), "`fallback`: the found step Σĉ_m ā_m "
                              "rescaled to the ℓ2 length of FedBuff's Σc′_m ā_m, keeping the search's direction "
                              "(not in the papers; c′ itself where the found step is 0)")
    search_every: str = option("buffer", OneOf(("buffer", "step")), "when to search: `buffer` = when FedBuff "
                               "would step (buffer-size arrivals; c′ = its step), `step` = at the end of every "
                               "round with a new update (c′ = FedBuff's weights over that round's arrivals)")

    def __post_init__(self) -> None:
        # The fallback's K updates must all be anchors when it fires.
        if self.buffer_size > self.atlas_size:
            raise ConfigError("buffer-size", self.buffer_size, f"at most atlas-size ({self.atlas_size}): Feddle's "
                              "fallback is FedBuff's step over its last buffer-size updates, all of them anchors")
        if self.aggregation != "mean":
            raise ConfigError("aggregation", self.aggregation, "'mean' with Feddle: its search merges whole anchors, "
                              "which a per-coordinate trimmed mean or median is not; bound the anchors' norm instead "
                              "(update-norm-bound, update-norm-multiple)")


def median_normalize(anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5: every row rescaled to the median row norm. Returns (ā, ‖a‖)."""
    norms = anchors.norm(dim=1)
    return anchors * (norms.median() / norms.clamp_min(1e-12)).unsqueeze(1), norms


class Feddle(Strategy):
    """Coefficient search over a model atlas of client updates, guided by the server's data (in or out of
    domain), every time FedBuff would step. Options: FeddleConfig."""

    name = "feddle"
    Config = FeddleConfig
    server_data = "any"
    criterion = staticmethod(F.cross_entropy)  # ℓ: the clients' loss

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.anchors: list[torch.Tensor] = []  # raw a_m; normalised on the fly at each search
        self.scores: list[float] = []  # s_m = |ĉ_m| of the last search; +inf until an anchor is searched
        # (examples, staleness on arrival) of the anchors in the fallback's FedBuff buffer, None for the others
        self.fresh: list[tuple[int, int] | None] = []
        self.order: list[int] = []  # arrival order, for FIFO eviction
        self.arrivals = 0
        self.closed = False  # the runner closed a step that brought updates (search-every = step)
        self.theta: nn.Linear | None = None  # the OOD head, kept across searches

    def server_need(self) -> str:
        """Any server data for the search; in-domain with fine-tuning (``server-finetune-epochs``), which trains
        on the server's labels as the clients' classes."""
        return "in-domain" if self.config.server_finetune_epochs else self.server_data

    @classmethod
    def figures(cls, rows: list[dict[str, Any]], client_rows: list[dict[str, Any]]) -> dict[str, Figure]:
        """``search.png``: the coefficients of every search, the fraction negative, the server-data loss before
        and after it (every step's, by the version it made)."""
        searches = [s for r in rows for s in r.get("steps", ()) if "c-mean" in s]
        if not searches:
            return {}
        versions = [s["version"] for s in searches]
        series = lambda *keys: {k.removeprefix("c-"): (versions, [s[k] for s in searches]) for k in keys}
        diagnostics = "loss-before" in searches[0]  # off with search-diagnostics = false
        return {"search.png": Figure("coefficient search", [
            Panel("model version", "coefficient", series("c-min", "c-mean", "c-max")),
            Panel("model version", "fraction negative", series("c-negative")),
            Panel("model version", "server-data loss", series("loss-before", "loss-after") if diagnostics else {})])}

    # -- atlas ------------------------------------------------------------------------------
    def receive(self, update: Update) -> None:
        """Every update becomes an anchor, clipped to the norm bound when one is set (strategies/robust.py); a full
        atlas replaces its least important one (Alg. 1, l. 14–19)."""
        self.arrivals += 1
        buffered = (update.num_examples, update.staleness(self.version))
        delta = clip([update.delta], self.config, self.recent_norms)[0]
        if len(self.anchors) < self.config.atlas_size:
            self.anchors.append(delta)
            self.scores.append(float("inf"))
            self.fresh.append(buffered)
            self.order.append(self.arrivals)
            return
        # Buffered anchors score +inf and are never evicted: the search runs once K <= M of them are in.
        key = self.scores if self.config.importance_score else self.order
        m = min(range(len(self.anchors)), key=lambda i: (key[i], self.order[i]))
        self.anchors[m], self.scores[m], self.fresh[m], self.order[m] = (delta, float("inf"), buffered, self.arrivals)

    def close_round(self) -> None:
        self.closed = any(f is not None for f in self.fresh)

    def ready(self) -> bool:
        """When FedBuff would step (K updates since the last search), or at the end of a step that brought
        an update (``search-every = step``)."""
        if self.config.search_every == "step":
            return self.closed
        return sum(f is not None for f in self.fresh) >= self.config.buffer_size

    # -- search -----------------------------------------------------------------------------
    def fallback(self, norms: torch.Tensor) -> torch.Tensor:
        """c′: FedBuff's step ω + η_g Σ_{buffer} b_m s(τ_m) a_m written on the (normalised) atlas,
        a_m = (‖a_m‖ / median) ā_m; 0 for the anchors outside the buffer."""
        buffer = [m for m, f in enumerate(self.fresh) if f is not None]
        weights = buffer_weights(self.config, *zip(*(self.fresh[m] for m in buffer)))
        c_prime = torch.zeros_like(norms)
        c_prime[buffer] = self.config.server_lr * torch.tensor(weights, dtype=norms.dtype)
        return c_prime * (norms / norms.median()) if self.config.anchor_normalization else c_prime

    def step(self) -> dict[str, float]:
        started = time.perf_counter()
        anchors = torch.stack(self.anchors)
        bar, norms = median_normalize(anchors) if self.config.anchor_normalization else (anchors, anchors.norm(dim=1))
        c_prime = self.fallback(norms)
        c = c_prime.clone() if self.config.fallback_init else torch.zeros_like(c_prime)
        stats: dict[str, float] = {}
        if self.config.server_epochs > 0:
            if self.server is None or len(self.server) == 0:
                raise ValueError("Feddle searches on the server's data, but this run has none: set central-size "
                                 "> 0 (in-domain) or server-dataset (out-of-domain)")
            if self.model is None:
                raise RuntimeError("Feddle needs the model (initialize(..., model)) to search on server data")
            c, stats = self.search(bar, c, c_prime, self.server)
        if self.config.step_length == "fallback":
            # ‖·‖ of the steps in weight space: a ratio of Σĉ to Σc′ explodes where the signs of ĉ cancel.
            found = float((c @ bar).norm())
            c = c * (float((c_prime @ bar).norm()) / found) if found > 0 else c_prime.clone()
        self.params = self.params + c @ bar  # Eq. 7
        if self.config.server_finetune_epochs:
            stats.update(self.finetune(self.server))
        self.scores = c.abs().tolist()
        self.fresh = [None] * len(self.anchors)
        self.closed = False
        self.version += 1
        return {"c-min": float(c.min()), "c-mean": float(c.mean()), "c-max": float(c.max()),
                "c-negative": float((c < 0).float().mean()), "anchors": len(self.anchors),
                "search-seconds": time.perf_counter() - started, **stats}

    def search(self, bar: torch.Tensor, c: torch.Tensor, c_prime: torch.Tensor,
               server: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """Adam on c for E_g epochs over the server data, gradients by projection (Eq. 16–17)."""
        device = server.device
        self.model.to(device)
        x, y = server.tensors()
        bar, c, c_prime, omega = bar.to(device), c.to(device), c_prime.to(device), self.params.to(device)
        ood = not server.in_domain
        seed = server_seed(self.seed, self.version)
        if ood:
            self.fit_head(omega + c @ bar, x, y, seed)  # Eq. 9, at the fallback coefficients
        c = c.clone().requires_grad_(True)
        diagnostics = self.config.search_diagnostics
        stats = {"loss-before": self.loss_at(omega + c.detach() @ bar, x, y, ood)} if diagnostics else {}

        def surrogate(idx: torch.Tensor) -> torch.Tensor:
            idx = idx.to(device)
            grad = self.projected_grad(omega + c.detach() @ bar, bar, x[idx], y[idx], ood)
            # Linear in c, so its gradient is Eq. 17's projected gradient, plus Eq. 11's pull to c′.
            return grad @ c + 0.5 * self.config.fallback_lambda * ((c - c_prime) ** 2).sum()

        run_epochs(torch.optim.Adam([c], lr=self.config.search_lr), len(y), self.config.search_batch_size,
                   self.config.server_epochs, seed, surrogate)
        if diagnostics:
            stats["loss-after"] = self.loss_at(omega + c.detach() @ bar, x, y, ood)
        self.spec.load_into(self.model, self.params.to(device))
        return c.detach().cpu(), stats

    def finetune(self, server: Any) -> dict[str, float]:
        """Fed+FT's server pass on ω after Eq. 7: ``server-finetune-epochs`` of the clients' recipe at
        ``server-train-lr`` on the in-domain server data, seeded apart from the search."""
        recipe = dataclasses.replace(self.recipe, local_epochs=self.config.server_finetune_epochs,
                                     lr=self.config.server_train_lr)
        self.params, trained = train_on_server(self.model, self.spec, self.params, server, recipe,
                                               derive_seed(server_seed(self.seed, self.version), 1))
        return {"server-train-loss": trained["train-loss"], "server-train-accuracy": trained["train-accuracy"]}

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

    def fit_head(self, merged: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
        """Eq. 9: θ* = argmin_θ h(D′_S; [ω_bo + Σ c′ ā_bo; θ]); warm-started across searches, then frozen."""
        self.spec.load_into(self.model, merged)
        self.model.eval()
        with torch.no_grad():
            feats = self.model.features(x)
        classes = int(y.max()) + 1
        if self.theta is None or self.theta.out_features < classes:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                self.theta = nn.Linear(feats.shape[1], classes)
        self.theta.to(x.device)  # in place; a head restored from a checkpoint comes back on the CPU
        self.theta.requires_grad_(True)
        run_epochs(torch.optim.Adam(self.theta.parameters(), lr=self.config.head_lr), len(y),
                   self.config.search_batch_size, self.config.head_epochs, seed,
                   lambda idx: F.cross_entropy(self.theta(feats[idx.to(x.device)]), y[idx.to(x.device)]))
        self.theta.requires_grad_(False)
