"""An existing Ray cluster, joined rather than started: its address (``--ray`` or Ray's own ``RAY_ADDRESS``) and a
check, before anything starts, that one of its nodes can host one client (or one sweep run) with the resources
asked for. Flower's Ray simulation joins the cluster through ``RAY_ADDRESS`` (its backend calls ``ray.init`` with the
run's init args, and Ray refuses ``num_cpus`` when it joins a cluster: hybridfl then passes none)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

from common.errors import ConfigError

# RAY_ADDRESS for a Ray of a process's own: without it, ray.init() joins the cluster `ray start` last started on
# this machine, and then refuses the num_cpus that a local simulation passes
LOCAL = "local"


def address(flag: str | None) -> str | None:
    """The cluster to join: the flag's address, else ``RAY_ADDRESS`` (as Ray reads it), else None: a Ray of one's
    own (also for Ray's own word for it, ``local``)."""
    found = flag or os.environ.get("RAY_ADDRESS")
    return None if found in (None, "", LOCAL) else found


@contextlib.contextmanager
def joined(ray_address: str, env_vars: dict[str, str] | None = None) -> Iterator[Any]:
    """This process connected to the cluster at `ray_address` as a Ray driver (the ``ray`` module), its tasks run
    with `env_vars`, disconnected after; a ConfigError naming ``--ray`` when nothing answers there."""
    import ray

    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = ray_address  # Ray reads it before its `address` argument
    try:
        _answers(ray_address)
        # ray.init makes a driver's SIGTERM exit(15) (and its core worker logs a stack): the command's own handler,
        # which stops what it started and exits 143, is put back
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            ray.init(address=ray_address, logging_level=logging.WARNING, log_to_driver=False,
                     runtime_env={"env_vars": env_vars} if env_vars else None)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise ConfigError("--ray", ray_address, "the address of a running Ray cluster (`ray start --head` prints "
                              f"it; RAY_ADDRESS too): {str(err).splitlines()[0]}") from None
        finally:
            if threading.current_thread() is threading.main_thread():  # where either can install one
                for sig, handler in handlers.items():
                    if handler is not None:
                        signal.signal(sig, handler)
        try:
            yield ray
        finally:
            ray.shutdown()
    finally:
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous


def _answers(ray_address: str, timeout: float = 10.0) -> None:
    """A ConfigError naming ``--ray`` unless the cluster's GCS accepts a connection where Ray will connect: Ray
    retries an address nothing answers at for minutes, and it replaces a loopback host by this machine's address
    (ray-project/ray#59110: a cluster started with ``--node-ip-address 127.0.0.1`` cannot be joined)."""
    from ray._private.services import canonicalize_bootstrap_address  # the rewrite ray.init makes

    target = ""
    try:
        target = canonicalize_bootstrap_address(ray_address) or ""
        host, port = target.rsplit(":", 1)
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError) as err:
        raise ConfigError("--ray", ray_address, "the address of a running Ray cluster (`ray start --head` prints "
                          f"it; RAY_ADDRESS too): Ray connects to {target or ray_address!r} for it, which did not "
                          f"answer ({err}); start the head without --node-ip-address 127.0.0.1") from None


def nodes(ray: Any) -> list[dict[str, float]]:
    """The resources (``CPU``, ``GPU``, ...) of each live node of the cluster `ray` is connected to."""
    return [dict(node["Resources"]) for node in ray.nodes() if node["Alive"]]


def check_fits(resources: list[dict[str, float]], cpus: float, gpus: float, where: str,
               keys: tuple[str, str] = ("--client-num-cpus", "--client-num-gpus")) -> None:
    """A ConfigError naming the key unless one node in `resources` has `cpus` CPUs and `gpus` GPUs free to give one
    task: Ray would otherwise queue that task for ever."""
    if cpus <= 0 and gpus <= 0:
        raise ConfigError(keys[0], cpus, "more than 0 CPUs or GPUs per task (Ray would run them all at once)")
    if cpus < 0 or gpus < 0:
        bad = (keys[0], cpus) if cpus < 0 else (keys[1], gpus)
        raise ConfigError(*bad, "0 or more")
    if any(node.get("CPU", 0) >= cpus and node.get("GPU", 0) >= gpus for node in resources):
        return
    most_cpus = max((node.get("CPU", 0) for node in resources), default=0)
    most_gpus = max((node.get("GPU", 0) for node in resources if node.get("CPU", 0) >= cpus), default=0)
    if most_cpus < cpus:
        raise ConfigError(keys[0], cpus, f"at most {most_cpus:g}: no node of {where} has more CPUs")
    raise ConfigError(keys[1], gpus, f"at most {most_gpus:g}: no node of {where} with {cpus:g} CPUs has more GPUs")
