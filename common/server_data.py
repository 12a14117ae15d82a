"""The server's own data (the hybrid regime's small central dataset) and the device it lives on.

In-domain (ID): the central split of the clients' dataset (``central-size`` samples taken from the
test split, as the Feddle papers take their 1000). Out-of-domain (OOD): another dataset with its own
label space (``server-dataset``, ``server-dataset-size`` of its samples, e.g. digits next to
Animal-MNIST clients); the model's input adapter resizes and re-channels it, and the OOD methods fit
their own head on its labels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from common.data import ArrayDataset, Splits, load_dataset
from common.devices import resolve_device


@dataclass
class ServerData:
    """The central dataset, whether it is in-domain, and the device server-side training runs on."""

    data: ArrayDataset
    in_domain: bool
    device: torch.device
    _tensors: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.data)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) on the device, moved once."""
        if self._tensors is None:
            self._tensors = (torch.from_numpy(self.data.x).to(self.device),
                             torch.from_numpy(self.data.y).to(self.device))
        return self._tensors


def require_in_domain(server: ServerData | None, method: str) -> None:
    """Raise a clear error unless `server` is in-domain server data (labels in the clients' label space)."""
    if server is None or len(server) == 0:
        raise ValueError(f"{method} trains on the server's data, but this run has none: set central-size > 0 "
                         "(the in-domain central split) and leave server-dataset empty")
    if not server.in_domain:
        raise ValueError(f"{method} needs in-domain server data (the clients' label space), but the server holds "
                         "out-of-domain data (server-dataset is set); leave server-dataset empty")


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
    return ServerData(ood, False, device)
