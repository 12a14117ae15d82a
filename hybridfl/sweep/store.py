"""A sweep's results file and the digests of its runs' configurations: what has a current result, what runs
again."""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

Job = tuple[str, dict[str, Any]]  # (its name, its run-config overrides)
Results = dict[str, dict[str, Any]]  # by job name

# where a run writes and what else watches it: never a different result
UNDIGESTED = frozenset({"output-dir", "run-name", "resume", "tracking", "experiment", "tracking-uri"})


def digest(config: Mapping[str, Any]) -> str:
    """A digest of the keys that differ from their defaults (:data:`UNDIGESTED` aside): an option added later, at
    a default that reproduces the old behaviour, leaves the digests of finished runs as they were."""
    from server_app.config import RunConfig, option_specs

    defaults = {k: spec.default for k, spec in {**RunConfig.specs(), **option_specs()}.items()}
    kept = {k: v for k, v in config.items()
            if k not in UNDIGESTED and (k not in defaults or v != defaults[k])}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_digest(overrides: Mapping[str, Any]) -> str:
    """A digest of the run's resolved configuration (presets applied), output folder aside."""
    from server_app.config import load_config

    return digest(load_config(overrides).to_dict())


def load_results(path: Path) -> Results:
    """Every result in `path` by job name (a later line of the same job wins)."""
    if not path.is_file():
        return {}
    return {r["key"]: r for r in map(json.loads, path.read_text().splitlines())}


def append(path: Path, result: dict[str, Any]) -> None:
    """One result line, appended under an exclusive lock: several invocations may share a results file."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(result) + "\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def current(result: dict[str, Any] | None, overrides: Mapping[str, Any]) -> bool:
    """Whether `result` was made with the configuration `overrides` resolve to now (a record made before digests
    were kept, without "config", is taken as it is)."""
    return result is not None and result.get("config", "") in ("", config_digest(overrides))


def pending(jobs: Iterable[Job], done: Results) -> list[Job]:
    """The jobs without a current result."""
    todo, stale = [], []
    for key, overrides in jobs:
        if not current(done.get(key), overrides):
            todo.append((key, overrides))
            if key in done:
                stale.append(key)
    if stale:
        print(f"{len(stale)} runs again: their presets changed since they ran ({', '.join(stale)})", flush=True)
    return todo
