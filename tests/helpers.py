"""Helpers shared by the tests of runs: reading outputs without their timing, and a client that kills its run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from PIL import Image

from client_app.app import app as client_app
from common.protocol import ARRAYS
from hybridfl.launch.compose_file import COMPOSE_DIR, missing_modules


def readme_commands(page: Path) -> list[str]:
    """The commands of a Markdown page's bash blocks as a user types them: continuation lines joined, comments
    (whole lines, or after two spaces) dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [re.sub(r"\s+", " ", line) for line in lines if line and not line.startswith("#")]


def needs_nginx(stream: bool = False) -> None:
    """Skip where nginx (the edge proxy, run natively) is missing, or with `stream` its stream module (the compose
    files' `link`, docker/link.conf); fail instead under HYBRIDFL_REQUIRE_NGINX=1 (CI, whose `make test` installs
    them)."""
    reason = None
    if shutil.which("nginx", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin") is None:
        reason = "no nginx here (Debian: apt-get install nginx; `make test` installs it as root)"
    elif stream and (missing := missing_modules((COMPOSE_DIR / "link.conf").read_text())):
        reason = (f"no {', '.join(missing)} here (Debian: apt-get install libnginx-mod-stream; `make test` "
                  "installs it as root)")
    if reason and os.environ.get("HYBRIDFL_REQUIRE_NGINX"):
        pytest.fail(reason)
    if reason:
        pytest.skip(reason)


def rows(out: Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """Lines of a run's jsonl file without what depends on timing (seconds, event times) or on Flower's ids (nodes,
    messages), also in the strategy steps of a round (``steps``)."""
    drop = lambda k: "seconds" in k or k in ("t", "node", "message")
    kept = lambda d: {k: [kept(s) for s in v] if k == "steps" else v for k, v in d.items() if not drop(k)}
    return [kept(json.loads(line)) for line in (out / name).read_text().splitlines()]


# Ditto on two nodes for two rounds, evaluated at the start and the end: the personal accuracies at the end come
# from a model the node kept from round 1 and trained on in round 2, so a node state lost between rounds changes
# them (the Flower runtimes' runs compare them with the in-process run's)
DITTO_TWO_NODES = {"preset": "ditto-digits", "num-clients": 2, "clients-per-round": 2, "num-clusters": 2,
                   "num-rounds": 2, "eval-every": 2}


def personal_accuracies(out: Path) -> list[float]:
    return [r["personal-accuracy"] for r in rows(out) if "personal-accuracy" in r]


@contextmanager
def flower_threads() -> Iterator[None]:
    """Torch as Flower's workers run it, for a float comparison with their run: one thread. Ray's actors (1 CPU
    each) get OMP_NUM_THREADS=1; a local deployment's processes inherit it from here. The number of threads decides
    how float sums are split, so a reference run with this process's default (the cores) may differ in the last
    bits on one CPU and not on another."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


def simulated(overrides: dict[str, Any], flwr_home: Path, **kw: Any) -> Path:
    """:func:`hybridfl.launch.simulate.simulate` with one Ray actor (each client holds all of the Ray's CPUs): what the
    tests compare is decided by the seed and the virtual clock, not by how many clients train at once, and each
    actor costs about 10 s of CPU to start."""
    from hybridfl.launch import simulate

    return simulate.simulate(overrides, flwr_home, client_cpus=simulate.local_cpus(), **kw)


def stepped(strategy: Any, server: Any) -> dict[str, float]:
    """`strategy`'s step on server data `server`, attached first (its one hand-over): a test's way to give a
    strategy other server data between steps."""
    strategy.attach(server)
    return strategy.step()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Crash(BaseException):
    """A process death: no handler on the way catches it."""


def crashing(after_rows: int, out: Path) -> ClientApp:
    """The real ClientApp until `out`/metrics.jsonl has `after_rows` rows; then the second train message kills
    the run (mid-step: after the checkpoint of the step before, some of the step's events already written)."""
    app, seen = ClientApp(), []

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if len((out / "metrics.jsonl").read_text().splitlines()) >= after_rows:
            seen.append(1)
            if len(seen) == 2:
                raise Crash
        return client_app(msg, context)

    for kind in ("evaluate", "query"):
        getattr(app, kind)()(lambda msg, context: client_app(msg, context))
    return app


def faulty_client_app() -> ClientApp:
    """Partition 1 raises on the device; partition 2 sends NaN; partition 3 sends a wrong shape."""
    faulty = ClientApp()

    @faulty.train()
    def train(msg: Message, context: Context) -> Message:
        pid = context.node_config["partition-id"]
        if pid == 1:
            raise RuntimeError("device out of memory")
        reply = client_app(msg, context)
        if pid in (2, 3) and not reply.has_error():
            (name, array), = reply.content[ARRAYS].items()
            flat = torch.from_numpy(array.numpy().copy())
            reply.content[ARRAYS] = ArrayRecord({name: flat * float("nan") if pid == 2 else flat[:1]})
        return reply

    for kind in ("evaluate", "query"):
        getattr(faulty, kind)()(lambda msg, context: client_app(msg, context))
    return faulty


def write_leaf(path: Path, users: dict[str, tuple[list, list]]) -> None:
    """A LEAF JSON file: {user: (x, y)}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"users": list(users), "num_samples": [len(y) for _, y in users.values()],
                                "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}))


def write_jpg(path: Path, rgb: tuple[int, int, int], size: tuple[int, int] = (178, 218), mode: str = "RGB") -> None:
    """A one-colour JPEG of `size`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, rgb if mode == "RGB" else rgb[0]).save(path)


def compose_cli() -> list[str]:
    """`docker compose` (the Compose v2 plugin); skipped where it is missing, failed so under CI."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose"]
    reason = "no Docker Compose v2 plugin here (make compose-test installs it)"
    if os.environ.get("CI"):
        pytest.fail(reason + "; CI runs make compose-test first")
    pytest.skip(reason)
