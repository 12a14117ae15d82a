"""Aggregation strategies, one module per method, all on the interface of ``strategies.base``."""

from common.config import RunConfig
from common.training import LocalRecipe
from strategies.base import HybridStrategy, Payload, Update
from strategies.ca2fl import CA2FL
from strategies.fedasync import FedAsync
from strategies.fedavg import FedAvg
from strategies.fedbuff import FedBuff
from strategies.feddf import FedDF
from strategies.feddle import Feddle
from strategies.hybrid_baselines import HFCL, Center, FedFT

STRATEGIES: dict[str, type[HybridStrategy]] = {"fedavg": FedAvg, "fedbuff": FedBuff, "fedasync": FedAsync,
                                               "ca2fl": CA2FL, "feddle": Feddle, "feddf": FedDF,
                                               "center": Center, "fedft": FedFT, "hfcl": HFCL}


def build_strategy(cfg: RunConfig) -> HybridStrategy:
    """The strategy named by ``cfg.strategy``, with its hyperparameters and the run's local recipe."""
    return STRATEGIES[cfg.strategy].from_config(
        cfg, train_config=LocalRecipe.from_config(cfg.to_dict()).to_config(),
        clients_per_round=cfg.clients_per_round, seed=cfg.seed)


__all__ = ["CA2FL", "HFCL", "STRATEGIES", "Center", "FedAsync", "FedAvg", "FedBuff", "FedDF", "FedFT", "Feddle",
           "HybridStrategy", "Payload", "Update", "build_strategy"]
