"""Where training runs: one rule for the server (the ``device`` run key) and the clients (the ``device`` node
setting), so that a machine with an accelerator uses it on both sides and one without runs on its CPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device is resolved: the config must load without it
    import torch

DEVICES = ("auto", "cpu", "cuda", "mps")


def mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when torch sees one, else Apple's MPS when present, else the CPU; ``cpu``, ``cuda``,
    ``cuda:N`` and ``mps`` as asked, with a clear error when that accelerator is not there."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps_available() else "cpu")
    kind = name.split(":", 1)[0]
    if kind not in DEVICES[1:]:
        raise ValueError(f"device {name!r}: expected one of {', '.join(DEVICES)} (or cuda:N)")
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but torch sees no CUDA device; use device=\"auto\"")
    if kind == "mps" and not mps_available():
        raise RuntimeError(f"device {name!r} asked for, but torch has no MPS backend here; use device=\"auto\"")
    return torch.device(name)
