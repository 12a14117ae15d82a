"""The server's own data (the hybrid regime's small central dataset) and the device it lives on.

In-domain (ID): the central split of the clients' dataset (``central-size`` samples taken from the
test split, as the Feddle papers take their 1000). Out-of-domain (OOD): another dataset with its own
label space (``server-dataset``, ``server-dataset-size`` of its samples, e.g. digits next to
Animal-MNIST clients); the model's input adapter resizes and re-channels it, and the OOD methods fit
their own head on its labels. A strategy states what it needs (``Strategy.server_need``), and
:func:`check_server_data` holds the run's server data to it when the strategy is attached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from common.devices import resolve_device
from common.errors import ConfigError
from common.splits import ArrayDataset, Splits, load_dataset

SERVER_NEEDS = ("none", "in-domain", "any")  # what a strategy needs of the server's data (Strategy.server_need)


@dataclass
class ServerData:
    """The central dataset, whether it is in-domain, the device server-side training runs on, and where it came
    from (the ``server-dataset`` name of out-of-domain data, for errors that name it)."""

    data: ArrayDataset
    in_domain: bool
    device: torch.device
    source: str = ""
    _tensors: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.data)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) on the device, moved once."""
        if self._tensors is None:
            self._tensors = (torch.from_numpy(self.data.x).to(self.device),
                             torch.from_numpy(self.data.y).to(self.device))
        return self._tensors


def check_server_data(server: ServerData | None, need: str, strategy: str) -> None:
    """Raise :class:`ConfigError`, naming the key to change and `strategy`, unless `server` meets `need`: "none"
    (anything), "any" (some server data) or "in-domain" (the central split: labels in the clients' label space)."""
    if need not in SERVER_NEEDS:
        raise ValueError(f"strategy '{strategy}' needs server data {need!r}: expected one of {SERVER_NEEDS}")
    if need == "none":
        return
    if server is None or len(server) == 0:
        alternative = "" if need == "in-domain" else " (or set server-dataset)"
        raise ConfigError("central-size", 0, f"> 0{alternative}: strategy '{strategy}' uses the server's own data")
    if need == "in-domain" and not server.in_domain:
        raise ConfigError("server-dataset", server.source, f"'' (the in-domain central split, central-size > 0): "
                          f"strategy '{strategy}' trains on labels of the clients' label space")


def build_server_data(cfg, splits: Splits) -> ServerData | None:
    """The run's server data: the ID central split, or `server-dataset` (OOD); None when there is none."""
    device = resolve_device(cfg.device)
    if not cfg.server_dataset:
        return ServerData(splits.central, True, device) if len(splits.central) else None
    ood = load_dataset(cfg.server_dataset, cfg.data_root)
    if cfg.server_dataset_size and cfg.server_dataset_size < len(ood):
        # A fixed-size sample of the OOD set, the same for a given seed.
        idx = np.sort(np.random.default_rng([cfg.seed, 3]).permutation(len(ood))[: cfg.server_dataset_size])
        ood = ood.subset(idx)
    return ServerData(ood, False, device, cfg.server_dataset)
