"""Aggregation strategies, one module per method, on the contract of ``strategies.base``.

Importing this package imports every module in it, which registers each strategy in :data:`STRATEGIES`
(name -> class) and its client objective: a new method of hybridfl's is one new file here. A user's own method
lives in their own package and is named by its import path (``strategy = "mypkg.methods:FedAvgM"``).
"""

import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.config import make_options, option
from common.protocol import STRATEGY
from common.training import LocalRecipe
from strategies.base import STRATEGIES, Payload, Strategy, StrategyName, Update, strategy_class
from strategies.client import ClientSide

for _module in pkgutil.iter_modules(__path__):  # each method's module registers its class as it is imported
    importlib.import_module(f"{__name__}.{_module.name}")


def __getattr__(name: str) -> type[Strategy]:
    """A registered strategy by its class name: ``from strategies import FedBuff``."""
    for cls in STRATEGIES.values():
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True, kw_only=True)
class MethodChoice:
    """The method key: which strategy runs (its own options are its ``Config``)."""

    strategy: str = option("fedavg", StrategyName(lambda: STRATEGIES),
                           "the method: a registered strategy (strategies/), or your own by import path "
                           "(docs/adding-a-method.md)")


def build_strategy(name: str, options: dict[str, Any], *, seed: int = 0, num_clients: int = 0,
                   recipe: LocalRecipe | None = None) -> Strategy:
    """Strategy `name` (a registered name or ``module:Class``) with its options read from `options` (hyphenated
    keys; others are ignored)."""
    cls = strategy_class(name)
    return cls(make_options(cls.Config, options), seed=seed, num_clients=num_clients, recipe=recipe)


def client_side(config: Mapping[str, Any]) -> ClientSide:
    """A fresh instance of the client side of the strategy a message names (``Strategy.reference``; FedAvg's when it
    names none, as a user's own ServerApp's messages may not)."""
    return strategy_class(str(config.get(STRATEGY, "fedavg"))).client_side()


__all__ = ["STRATEGIES", "ClientSide", "MethodChoice", "Payload", "Strategy", "Update", "build_strategy", "client_side",
           "strategy_class", *sorted(cls.__name__ for cls in STRATEGIES.values())]
