"""The strategy interface every hybridfl method implements, and its adapter to Flower's ``Strategy``.

A strategy owns the global model ω (a flat tensor of trainable parameters) and its version,
and does the method's math. It never touches the network or the disk: a runner (server_app/)
decides when to dispatch, collects replies, and calls

    configure(client, version) -> Payload      what to send to `client`
    receive(update)                            one client's update entered the strategy
    close_round()                              no more updates come for this round (or step)
    ready() -> bool                            enough has arrived to make a new global model
    aggregate(server) -> ω                     make it (version + 1); `server` is the server's data
    state_dict() / load_state_dict()           checkpointing

The same object is a Flower ``Strategy``: ``configure_train``/``aggregate_train`` and the
evaluate pair are thin adapters over the methods above, so Flower's own ``start(grid, ...)``
drives it the way Flower users expect.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from common.params import BadArrays, ParamSpec
from common.protocol import ARRAYS, BASE_VERSION, CONFIG, METRICS, NUM_EXAMPLES, PARTITION_ID, REPLY_KEYS, VERSION


@dataclass
class Update:
    """What a client returned: the delta of the trainable parameters and its context."""

    client: int  # the client's partition id: stable across runs and execution modes
    base_version: int  # the global version the client started from
    delta: torch.Tensor  # ω_client − ω_base, flat float32
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)

    def staleness(self, version: int) -> int:
        return version - self.base_version


@dataclass
class Payload:
    """What a strategy sends to one client: the parameters and the config of its local work."""

    params: torch.Tensor
    config: dict[str, Any]


class RejectedReply(ValueError):
    """A reply that cannot enter a strategy; the reason is logged and counted by the runner."""


def parse_reply(msg: Message, spec: ParamSpec) -> Update:
    """The :class:`Update` in a train reply, or :class:`RejectedReply` saying what is wrong."""
    if msg.has_error():
        raise RejectedReply(f"error reply (code {msg.error.code}): {msg.error.reason}")
    content = msg.content
    if ARRAYS not in content.array_records or METRICS not in content.metric_records:
        raise RejectedReply(f"reply lacks '{ARRAYS}' or '{METRICS}' records")
    metrics = content[METRICS]
    for key in REPLY_KEYS:
        if key not in metrics:
            raise RejectedReply(f"reply metrics lack '{key}'")
    if metrics[NUM_EXAMPLES] <= 0:
        raise RejectedReply(f"num-examples = {metrics[NUM_EXAMPLES]} is not positive")
    try:
        delta = spec.from_record(content[ARRAYS])
    except BadArrays as err:
        raise RejectedReply(str(err)) from err
    rest = {k: float(v) for k, v in metrics.items() if k not in REPLY_KEYS and isinstance(v, (int, float))}
    return Update(int(metrics[PARTITION_ID]), int(metrics[BASE_VERSION]), delta, int(metrics[NUM_EXAMPLES]), rest)


class VersionHistory:
    """The global models that in-flight clients started from, kept until their updates are back, so a
    client's model ω^τ + Δ can be rebuilt (FedAsync, FedDF); a version is dropped once nobody needs it."""

    def __init__(self) -> None:
        self._bases: dict[int, int] = {}  # in-flight client -> version it started from
        self._models: dict[int, torch.Tensor] = {}  # version -> ω^version

    def dispatched(self, client: int, version: int, params: torch.Tensor) -> None:
        self._bases[client] = version
        self._models.setdefault(version, params)

    def base_of(self, update: Update, version: int, params: torch.Tensor) -> torch.Tensor:
        """ω^τ of `update` (the current `params` when it started from the current `version`)."""
        base = self._models.get(update.base_version, params if update.base_version == version else None)
        if base is None:
            raise KeyError(f"no global model of version {update.base_version} kept for client {update.client}")
        return base

    def done(self, client: int, base_version: int | None = None) -> None:
        """`client`'s dispatch (from `base_version`, if given) came back or will not."""
        if base_version is None or self._bases.get(client) == base_version:
            self._bases.pop(client, None)
        needed = set(self._bases.values())
        self._models = {v: p for v, p in self._models.items() if v in needed}

    def __len__(self) -> int:
        return len(self._models)


def weighted_sum(deltas: Iterable[torch.Tensor], weights: Iterable[float], like: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i Δ_i, accumulated in the given order (callers fix the order for reproducible floats)."""
    total = torch.zeros_like(like)
    for w, delta in zip(weights, deltas):
        total.add_(delta, alpha=float(w))
    return total


def example_weights(updates: list[Update]) -> list[float]:
    """n_j / Σ n_i, computed in float64 then rounded to float32 as FedAvg applies them."""
    n = torch.tensor([float(u.num_examples) for u in updates], dtype=torch.float64)
    return (n / n.sum()).to(torch.float32).tolist()


def weighted_mean(values: Iterable[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Example-weighted mean of metric dicts: ``[(weight, {name: value})]`` -> ``{name: mean}``."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for w, metrics in values:
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + w * v
            weights[k] = weights.get(k, 0.0) + w
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


class HybridStrategy(FlowerStrategy):
    """Base of every hybridfl strategy (see the module docstring for the interface).

    Args:
        train_config: the local recipe sent with every train message (``local-epochs``,
            ``batch-size``, ``lr``, ...); the runner adds the data spec and the version.
        clients_per_round: how many clients ``configure_train`` samples when Flower drives it.
        seed: seeds the node sampling of ``configure_train``.
    """

    def __init__(self, train_config: dict[str, Any] | None = None, clients_per_round: int = 10, seed: int = 0) -> None:
        self.train_config = dict(train_config or {})
        self.clients_per_round = clients_per_round
        self.evaluate_clients = clients_per_round  # nodes configure_evaluate asks (0: no federated evaluation)
        self.params: torch.Tensor | None = None  # ω
        self.version = 0
        self.spec: ParamSpec | None = None
        self.seed = seed
        self._rng = random.Random(seed)
        self.accepted_replies = self.rejected_replies = 0  # counted by aggregate_train (Flower-driven runs)

    @classmethod
    def from_config(cls, cfg: Any, **common: Any) -> HybridStrategy:
        """The strategy with its hyperparameters read from a RunConfig (same names, hyphens as underscores)."""
        return cls(**common)

    # -- the hybridfl interface ------------------------------------------------------------
    def initialize(self, params: torch.Tensor, spec: ParamSpec) -> None:
        """Start from global parameters `params` (version 0)."""
        self.params, self.spec, self.version = params.clone(), spec, 0

    def attach(self, model: Any) -> None:
        """The model architecture (a torch module whose trainable parameters are ω's layout), for
        strategies that train or evaluate on the server's data; others ignore it."""

    def configure(self, client: int, version: int) -> Payload:
        """What `client` gets for a train dispatch at `version` (default: ω and the recipe)."""
        return Payload(self.params, dict(self.train_config))

    @abstractmethod
    def receive(self, update: Update) -> None:
        """Take one client's update."""

    def close_round(self) -> None:
        """The runner's signal that no more updates arrive for the current round (or step)."""

    def forget(self, client: int) -> None:
        """The runner's signal that `client`'s dispatch will not come back (error, timeout, lost node)."""

    @abstractmethod
    def ready(self) -> bool:
        """Whether `aggregate` would make a new global model now."""

    @abstractmethod
    def aggregate(self, server: Any = None) -> torch.Tensor:
        """Make the next global model (increments `version`) and return it."""

    def metrics(self) -> dict[str, float]:
        """What the strategy's last aggregation measured (e.g. Feddle's search), for metrics.jsonl."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """ω and its version. Method state (FedBuff's buffer, CA2FL's caches, Feddle's atlas) is not
        included yet: a run cannot be resumed mid-way (docs/methods.md)."""
        return {"params": self.params, "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.params, self.version = state["params"].clone(), int(state["version"])

    # -- Flower Strategy adapter -------------------------------------------------------------
    def _sync_from(self, arrays: ArrayRecord) -> None:
        if self.spec is None:
            self.spec = ParamSpec.of_record(arrays)
        self.params = self.spec.from_record(arrays)

    def _messages(self, grid: Grid, arrays: ArrayRecord, config: ConfigRecord, message_type: str,
                  count: int, per_client: bool) -> list[Message]:
        self._sync_from(arrays)
        nodes = sorted(grid.get_node_ids())
        chosen = sorted(self._rng.sample(nodes, min(count, len(nodes))))
        messages = []
        for node in chosen:
            payload = self.configure(node, self.version) if per_client else Payload(self.params, {})
            cfg = ConfigRecord({**payload.config, **dict(config), VERSION: self.version})
            content = RecordDict({ARRAYS: self.spec.to_record(payload.params), CONFIG: cfg})
            messages.append(Message(content, dst_node_id=node, message_type=message_type, group_id=str(self.version)))
        return messages

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self._messages(grid, arrays, config, MessageType.TRAIN, self.clients_per_round, per_client=True)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        accepted = []
        for msg in replies:
            try:
                update = parse_reply(msg, self.spec)
            except RejectedReply as err:
                self.rejected_replies += 1
                log(WARNING, "round %d: rejected reply from node %s: %s", server_round, msg.metadata.src_node_id, err)
                continue
            self.receive(update)
            accepted.append(update)
        self.accepted_replies += len(accepted)
        self.close_round()
        if not self.ready():
            return None, None
        self.params = self.aggregate()
        metrics = weighted_mean((u.num_examples, u.metrics) for u in accepted)
        log(INFO, "round %d: aggregated %d updates -> version %d", server_round, len(accepted), self.version)
        return self.spec.to_record(self.params), MetricRecord(metrics)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self._messages(grid, arrays, config, MessageType.EVALUATE, self.evaluate_clients, per_client=False)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        ok = [m.content[METRICS] for m in replies if not m.has_error() and METRICS in m.content.metric_records]
        if not ok:
            return None
        return MetricRecord(weighted_mean(
            (float(r[NUM_EXAMPLES]), {k: float(v) for k, v in r.items() if k not in (NUM_EXAMPLES, PARTITION_ID)})
            for r in ok))

    def summary(self) -> None:
        log(INFO, "%s: %s", type(self).__name__, self.describe())

    def describe(self) -> dict[str, Any]:
        """The strategy's hyperparameters, for logs and summary.json."""
        return {"clients-per-round": self.clients_per_round, **self.train_config}


class AsyncStrategy(HybridStrategy):
    """A strategy for the asynchronous runtime: Flower's ``start()`` runs hybridfl's loop over the grid
    (push/pull, at most one message per node, updates handed over as they arrive) instead of
    Flower's round barrier. The extra keyword arguments choose the clock (see server_app/runtime.py).
    """

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Any = None, *, clock: str = "wall", delay_sigma: float = 0.0,
              concurrency: int | None = None) -> Any:
        from server_app.runtime import flower_start  # the runner lives with the other runners, not here

        return flower_start(self, grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                            evaluate_fn, clock=clock, delay_sigma=delay_sigma,
                            concurrency=concurrency or self.clients_per_round)
