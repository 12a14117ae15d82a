"""What tests, tools and benchmarks read of running processes and their logs, and ask of a deployment as a
stranger would: never part of a run, so not in the installed packages (issue 71)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import psutil


def alive(pids: set[int]) -> set[int]:
    """The PIDs in `pids` that still exist as non-zombie processes."""
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return {pid for pid in pids if running(pid)}


DEVICE_TIMING = re.compile(r"device timing (\{.*\})")


def device_timings(logs: list[Path]) -> list[dict[str, Any]]:
    """The ClientApp's ``device timing`` lines (client_app/app.py: where a device's time went per message) found
    in the log files `logs`, in order."""
    return [json.loads(m[1]) for path in logs for line in path.read_text(errors="replace").splitlines()
            if (m := DEVICE_TIMING.search(line))]


def acquire_task_anonymously(address: str, ca: Path | None = None) -> httpx.Response | None:
    """What a process that holds no secret gets when it asks the Runtime API at `address` for a task, as a SuperExec
    does (Flower's own client and request): the HTTP response of the refusal, or None if a task was handed out."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.runtime import RuntimeHttpClient

    client = RuntimeHttpClient.from_server_address(address, insecure=ca is None,
                                                   root_certificates=None if ca is None else str(ca), interceptors=())
    try:
        client.AcquireTask(AcquireTaskRequest(supported_task_types=[t.value for t in TaskType]))
    except httpx.HTTPStatusError as err:
        return err.response
    return None
