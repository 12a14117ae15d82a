"""Aggregation strategies, one module per method, all on the interface of ``strategies.base``."""

from common.config import RunConfig
from common.training import LocalRecipe
from strategies.base import HybridStrategy, Payload, Update
from strategies.fedavg import FedAvg

STRATEGIES: dict[str, type[HybridStrategy]] = {"fedavg": FedAvg}


def build_strategy(cfg: RunConfig) -> HybridStrategy:
    """The strategy named by ``cfg.strategy`` with the run's local recipe."""
    return STRATEGIES[cfg.strategy](train_config=LocalRecipe.from_config(cfg.to_dict()).to_config(),
                                    clients_per_round=cfg.clients_per_round, seed=cfg.seed)


__all__ = ["STRATEGIES", "FedAvg", "HybridStrategy", "Payload", "Update", "build_strategy"]
