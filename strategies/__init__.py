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
from strategies.ca2fl import CA2FL
from strategies.client import ClientSide
from strategies.fedasync import FedAsync
from strategies.fedavg import FedAvg
from strategies.fedavg_plus import FedAvgPlus
from strategies.fedbuff import FedBuff
from strategies.feddf import FedDF
from strategies.feddle import Feddle
from strategies.feddual import FedDual
from strategies.fedem import FedEM
from strategies.fedmerge import FedMerge
from strategies.hybrid_baselines import HFCL, Center, FedFT
from strategies.ifca import IFCA
from strategies.local import Local
from strategies.mixing import ExampleTransfer, GeneralizedFedAvg, GradientTransfer, ParallelTraining
from strategies.scaffold import Scaffold

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


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
    return strategy_class(str(config.get(STRATEGY, FedAvg.name))).client_side()


__all__ = ["CA2FL", "HFCL", "IFCA", "STRATEGIES", "Center", "ExampleTransfer", "FedAsync", "FedAvg", "FedAvgPlus",
           "FedBuff", "FedDF", "FedDual", "FedEM", "FedFT", "FedMerge", "Feddle", "GeneralizedFedAvg",
           "GradientTransfer", "Local", "MethodChoice", "ParallelTraining", "Payload", "Scaffold", "Strategy", "Update",
           "build_strategy", "client_side", "strategy_class"]
