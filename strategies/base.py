"""The strategy contract every hybridfl method implements.

A strategy owns the method's models and math. It never touches the network or the disk: a runner
(``server_app/``) decides when to dispatch and collects replies, then calls

    model_for(client) -> Payload     what `client` gets for a train or an evaluation dispatch
    check(update)                    raise Unusable if a parsed update cannot be used (optional)
    receive(update)                  one client's update (it carries the Payload it answers: ``sent``)
    close_round()                    no more updates come for this round (or step)
    ready() -> bool                  enough has arrived for a step
    step() -> metrics                the server's step: may change several models; the server's own data
                                     (``common.server_data.ServerData``) or None is ``self.server``,
                                     attached once before the first dispatch (``attach``)
    central_models() -> {name: ω}    the model(s) the server evaluates on its test split and saves
    client_report() -> {name: list}  per-client state recorded beside the personalised evaluation (optional)
    state_dict() / load_state_dict() everything a resumed run needs

One global model ω is the default case: ``model_for`` sends it to everybody and ``central_models``
is ``{"global": ω}``; a method with per-client models (FedMerge) overrides the two. A method's
hyperparameters are a dataclass of options (``Config``) next to its class; the keys are the same
in YAML, ``flwr run -c``, the dataclass and ``describe()``. A subclass with a ``name`` is
registered in :data:`STRATEGIES` under it; a user's own strategy, in their own package, is named by its import path
(``strategy = "mypkg.methods:FedAvgM"``, :func:`strategy_class`). The method's client side, if it needs more than
local training with the run's objective, is a :class:`~strategies.client.ClientSide` in the same file, named by the
class attribute ``client_side`` (every message names the strategy, :meth:`Strategy.reference`, and a node runs its
client side); a client objective of its own is registered there too (``common.objectives.objective``) and named by
the client side's ``objective``, the strategy options it reads by its ``keys``: one channel, declared in one place.
"""

from __future__ import annotations

import copy
import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from common.codecs import WireCodecs
from common.config import NoOptions, OneOf, check_options, options_dict, specs_of
from common.errors import ConfigError
from common.figures import Figure
from common.params import ParamSpec
from common.server_data import ServerData, check_server_data
from common.training import LocalRecipe
from common.user_code import is_import_path, resolve
from strategies.client import ClientSide


@dataclass
class Payload:
    """What a strategy sends to one client."""

    params: torch.Tensor  # the model the client starts from (flat trainable parameters)
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)  # extra tensors (a server gradient, examples)
    memo: dict[str, torch.Tensor] = field(default_factory=dict)  # kept with the flight on the server, never sent

    @property
    def nbytes(self) -> int:
        """What travels to the client: the model and the extra arrays, as float32 (the config aside)."""
        return 4 * self.params.numel() + self.extra_nbytes

    @property
    def extra_nbytes(self) -> int:
        """What travels besides the model: the extra arrays, as float32 (transferred examples, a gradient)."""
        return 4 * sum(a.numel() for a in self.arrays.values())


@dataclass
class Update:
    """What a client returned, and what it answers."""

    client: int  # the client's partition id: stable across runs and execution modes
    base_version: int  # the version of the model it started from
    delta: torch.Tensor  # ω_client − ω_sent, flat float32
    num_examples: int
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)  # extra tensors the client sent back
    metrics: dict[str, float] = field(default_factory=dict)
    sent: Payload | None = None  # the payload this update answers (its model: ω^τ, for stale updates too)

    @property
    def nbytes(self) -> int:
        """What the client sent: the delta and the extra arrays, as float32 (the metrics aside)."""
        return 4 * self.delta.numel() + self.extra_nbytes

    @property
    def extra_nbytes(self) -> int:
        """What the client sent besides the delta: the extra arrays, as float32."""
        return 4 * sum(a.numel() for a in self.arrays.values())

    def staleness(self, version: int) -> int:
        return version - self.base_version

    @property
    def start(self) -> torch.Tensor:
        """ω^τ, the model the client started from (stale updates are rebuilt as ``start + delta``)."""
        if self.sent is None:
            raise ValueError(f"the update of client {self.client} does not carry the payload it answers")
        return self.sent.params


class Unusable(ValueError):
    """An update that parsed but that this strategy cannot use (:meth:`Strategy.check`): the runner rejects,
    counts and logs it, and the run goes on."""


STRATEGIES: dict[str, type[Strategy]] = {}  # hybridfl's own, by name: every node has them
_BY_PATH: dict[str, type[Strategy]] = {}  # the others this process has met, by import path


def register(cls: type[Strategy]) -> None:
    """Register `cls` in :data:`STRATEGIES` under its own ``name`` (a subclass that declares one); a name taken by
    another class is an error (the same class, re-imported, may register again)."""
    if cls.__dict__.get("name"):
        if cls.name in STRATEGIES and STRATEGIES[cls.name].__qualname__ != cls.__qualname__:
            raise ValueError(f"strategy name {cls.name!r} is taken by {STRATEGIES[cls.name].__qualname__}")
        STRATEGIES[cls.name] = cls


STRATEGY_PATH = "your own 'module:Class' (a subclass of strategies.base.Strategy)"


@dataclass(frozen=True)
class StrategyName(OneOf):
    """A registered strategy, or a user's own class by import path (imported and checked by
    :func:`strategy_class`)."""

    def ok(self, v: str) -> bool:
        return v in set(self.allowed()) or is_import_path(v)

    def describe(self) -> str:
        return f"{super().describe()}, or {STRATEGY_PATH}"

    def short(self) -> str:
        return super().short() + ", or `module:Class` (your own)"


def strategy_class(value: str) -> type[Strategy]:
    """The strategy class `value` names: a registered name, or ``module:Class`` (imported here, as a node imports it;
    importing it registers the client objectives its module declares). A :class:`ConfigError` naming the key
    ``strategy`` says why it is not one."""
    if value in STRATEGIES or value in _BY_PATH:
        return STRATEGIES.get(value) or _BY_PATH[value]
    if not is_import_path(value):
        raise ConfigError("strategy", value, StrategyName(lambda: STRATEGIES).describe())
    found = resolve("strategy", value, f"a strategy class: {STRATEGY_PATH}")
    if not (isinstance(found, type) and issubclass(found, Strategy)):
        raise ConfigError("strategy", value, f"{STRATEGY_PATH}; '{value}' is a {type(found).__name__}")
    if inspect.isabstract(found):
        raise ConfigError("strategy", value, f"{STRATEGY_PATH} that implements the contract; it does not define "
                          + ", ".join(sorted(found.__abstractmethods__)))
    _BY_PATH[value] = found
    return found


class Strategy(ABC):
    """Base of every hybridfl strategy (the module docstring has the contract).

    Args:
        config: the method's hyperparameters (an instance of ``Config``); or give them as keywords,
            ``FedBuff(buffer_size=20)``. Bad values raise ``ConfigError`` naming the key.
        seed: the run's seed (server-side work is seeded from it and the model version).
        num_clients: N, the clients of the run (CA2FL's cache mean needs it).
        recipe: the clients' local recipe (server-side training reuses it).

    Every instance attribute except the ones in ``_structure`` (configuration, layout, the server's
    model object) is state: :meth:`state_dict` saves all of it, so a method cannot forget a field.
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type] = NoOptions
    server_data: ClassVar[str] = "none"  # server_need()'s default: "none", "in-domain" (the clients' labels) or "any"
    client_side: ClassVar[type[ClientSide]] = ClientSide  # what the clients do (strategies/client.py)
    # What the state may hold besides tensors and plain data (dicts, lists, tuples, sets, strings, numbers, None),
    # hybridfl's Payload and Update, and nn.Linear: the classes (and functions, e.g. numpy's array reconstructor)
    # a checkpoint rebuilds by name for this strategy. A state holding anything else is refused when first saved,
    # naming the field (server_app/checkpoint.py; docs/adding-a-method.md, "State and checkpoints").
    checkpoint_types: ClassVar[tuple[Any, ...]] = ()
    _structure: ClassVar[frozenset[str]] = frozenset({"config", "seed", "num_clients", "recipe", "spec", "model",
                                                      "server"})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if unknown := sorted(set(cls.client_side.keys) - set(specs_of(cls.Config))):
            raise TypeError(f"{cls.__qualname__}.client_side ({cls.client_side.__qualname__}) reads keys its "
                            f"Config does not declare: {', '.join(unknown)}")
        register(cls)

    def __init__(self, config: Any = None, *, seed: int = 0, num_clients: int = 0,
                 recipe: LocalRecipe | None = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError(f"give {type(self).__name__} a Config or keyword options, not both")
        self.config = config if config is not None else self.Config(**options)
        check_options(self.config)
        self.seed, self.num_clients, self.recipe = seed, num_clients, recipe
        self.spec: ParamSpec | None = None
        self.model: nn.Module | None = None
        self.params: torch.Tensor | None = None  # ω
        self.version = 0
        self.server: ServerData | None = None  # the server's own data, attached by the runner
        self.recent_norms: list[float] = []  # update norms of late, for a relative norm bound (strategies/robust.py)

    def initialize(self, params: torch.Tensor, spec: ParamSpec, model: nn.Module | None = None) -> None:
        """Start from global parameters `params` (version 0). `model` is the architecture (its trainable
        parameters are `spec`'s layout), for strategies that train or evaluate on the server's data."""
        self.params, self.spec, self.model, self.version = params.clone(), spec, model, 0

    @classmethod
    def codec_refusal(cls, config: Any, codecs: WireCodecs) -> tuple[str, str] | None:
        """(the key to change, why) when this method with its options `config` cannot work on what the wire's
        `codecs` deliver (common/codecs.py); None for most, which work on the decoded float32 updates and models
        as on any others. Checked at the run's start."""
        return None

    def server_need(self) -> str:
        """What this strategy needs of the server's data with its options: "none", "in-domain" or "any"; the class
        attribute ``server_data`` unless an option changes it (Feddle's fine-tuning)."""
        return self.server_data

    def attach(self, server: ServerData | None) -> None:
        """The server's own data (or None), attached by every runner before the first dispatch, for payloads that
        carry some of it (example transfer, a central gradient) and for ``step``: the one hand-over. Raises
        ``ConfigError``, naming the key to change, when it does not meet :meth:`server_need`: the one check of
        server data, so every path (the runtime, Flower's loop, a user's own ServerApp) fails before anything runs."""
        check_server_data(server, self.server_need(), self.reference())
        self.server = server

    # -- the contract -------------------------------------------------------------------------
    def model_for(self, client: int) -> Payload:
        """What `client` gets now, for a train or an evaluation dispatch (default: ω to everybody)."""
        return Payload(self.params)

    def check(self, update: Update) -> None:
        """Raise :class:`Unusable`, saying why, if `update` (with ``sent`` set) cannot enter :meth:`receive`
        (IFCA: a model index out of range). Default: every well-formed update can."""

    @abstractmethod
    def receive(self, update: Update) -> None:
        """Take one client's update."""

    def close_round(self) -> None:
        """The runner's signal that no more updates arrive for the current round (or step)."""

    @abstractmethod
    def ready(self) -> bool:
        """Whether :meth:`step` would make new model(s) now."""

    @abstractmethod
    def step(self) -> dict[str, float]:
        """The server's step: make the next version of the model(s) (increments ``version``). Returns what
        it measured (e.g. Feddle's search), for metrics.jsonl."""

    def central_models(self) -> dict[str, torch.Tensor]:
        """The model(s) the server evaluates on its test split and saves; the first is the headline."""
        return {"global": self.params}

    def client_report(self) -> dict[str, list]:
        """Per-client state recorded with every personalised evaluation (``clients.jsonl``), one entry per
        client id (FedMerge: each client's merging weights); default none."""
        return {}

    @classmethod
    def figures(cls, rows: list[dict[str, Any]], client_rows: list[dict[str, Any]]) -> dict[str, Figure]:
        """The method's own plots of a run, from its ``metrics.jsonl`` rows and ``clients.jsonl`` rows, as data
        (:class:`common.figures.Figure`) by file name; the outputs draw them. Default none."""
        return {}

    @classmethod
    def reference(cls) -> str:
        """How a run and its messages name this class: hybridfl's own by name (every node has them), any other by its
        import path ``module:Class``, which a node imports (even one that registered a name: only the process that
        imported it knows that name). This process remembers the path, so a class no node could import, a test's
        own, still runs in-process."""
        if STRATEGIES.get(cls.name) is cls and cls.__module__.partition(".")[0] == __name__.partition(".")[0]:
            return cls.name
        path = f"{cls.__module__}:{cls.__qualname__}"
        _BY_PATH.setdefault(path, cls)
        return path

    def client_options(self) -> dict[str, Any]:
        """The option values the client side reads (``client_side.keys``): every message carries them."""
        options = options_dict(self.config)
        return {key: options[key] for key in self.client_side.keys}

    def describe(self) -> dict[str, Any]:
        """The strategy's hyperparameters by key, for logs and summary.json."""
        return {"strategy": self.reference(), **options_dict(self.config)}

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every attribute but the structure, and the server model's buffers (BatchNorm running statistics
        evolve during server-side training)."""
        state = {k: v for k, v in vars(self).items() if k not in self._structure}
        if self.model is not None:
            state["model-buffers"] = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        return copy.deepcopy(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)
        buffers = state.pop("model-buffers", {})
        expected = set(vars(self)) - self._structure
        missing, unknown = expected - set(state), set(state) - expected
        if missing or unknown:
            raise ValueError(f"{type(self).__name__} state: missing {sorted(missing)}, unknown {sorted(unknown)}")
        vars(self).update(state)
        if self.model is not None:
            own = dict(self.model.named_buffers())
            with torch.no_grad():
                for n, b in buffers.items():
                    own[n].copy_(b)


def deliver(strategy: Strategy, updates: Iterable[Update]) -> None:
    """Hand one round's updates to ``strategy`` in the runtime's order (server_app/runtime.py): receive each and
    step whenever it is ready, then close the round and step if that made it ready. For code that drives a
    strategy without the runtime (benchmarks)."""
    for update in updates:
        strategy.receive(update)
        if strategy.ready():
            strategy.step()
    strategy.close_round()
    if strategy.ready():
        strategy.step()
