"""A node's partition kept on its disk for the run.

In deployment Flower starts a fresh ClientApp process for every message, so without this every message
reloads the whole dataset and redoes the run's splits (BENCHMARKS "Seconds per update in deployment": 3.5 s
for digits, most of it importing scikit-learn, which digits no longer needs; 1.1 s for Fashion-MNIST). The first
message of a run builds the node's train / validation / test parts and writes them to
``<cache-dir>/run-<run id>/``; later messages of the run read that file. Files are named by the run id and a
digest of the whole data spec and partition id, so nothing carries over between runs (Flower's run ids are
random) and a changed spec never reads an old file.
Folders of runs not touched for a day are removed when a new run starts writing.

``cache-dir`` in the node config moves it (default ``$XDG_CACHE_HOME/hybridfl``, else ``~/.cache/hybridfl``);
``cache-dir=""`` turns it off (the in-process engine does: its processes keep every partition in memory).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from common.config import options_dict
from common.datasets import ArrayDataset
from common.splits import CLIENT_PARTS, DataSpec, client_partition

CACHE_DIR = "cache-dir"
STALE_S = 24 * 3600.0


def cache_dir(node_config: Mapping[str, Any]) -> Path | None:
    """The node's cache folder from its ``cache-dir`` (None: off)."""
    if CACHE_DIR in node_config:
        value = str(node_config[CACHE_DIR])
        return Path(value).expanduser() if value else None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridfl"


def client_parts(spec: DataSpec, partition_id: int, run_id: int, directory: Path | None) -> dict[str, ArrayDataset]:
    """Client `partition_id`'s ``train`` / ``validation`` / ``test`` parts (common.splits.client_partition), read
    from `directory`'s file for this run when there is one, else built and written there (atomically: messages
    of other nodes on the same disk may read it at the same time). An unreadable cache is rebuilt; an unwritable
    one is skipped."""
    if directory is None:
        return {part: client_partition(spec, partition_id, part) for part in CLIENT_PARTS}
    digest = hashlib.sha256(json.dumps([partition_id, options_dict(spec)], sort_keys=True).encode()).hexdigest()[:24]
    run_dir = directory / f"run-{run_id}"
    path = run_dir / f"partition-{partition_id}-{digest}.npz"
    try:
        with np.load(path) as f:
            return {part: ArrayDataset(f[f"{part}-x"], f[f"{part}-y"], int(f["num-classes"])) for part in CLIENT_PARTS}
    except (OSError, KeyError, ValueError):
        pass
    parts = {part: client_partition(spec, partition_id, part) for part in CLIENT_PARTS}
    arrays = {f"{p}-{k}": getattr(d, k) for p, d in parts.items() for k in ("x", "y")}
    try:
        _remove_stale(directory, keep=run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{path.stem}.{os.getpid()}.npz"
        np.savez(tmp, **arrays, **{"num-classes": np.int64(parts["train"].num_classes)})
        os.replace(tmp, path)
    except OSError:
        pass
    return parts


def _remove_stale(directory: Path, keep: Path) -> None:
    if keep.exists() or not directory.is_dir():
        return
    for old in directory.glob("run-*"):
        try:
            if time.time() - old.stat().st_mtime > STALE_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
