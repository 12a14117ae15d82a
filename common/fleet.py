"""Devices as they are: a device's profile (compute speed, link, memory, availability) and a fleet of them.

One declaration serves every mode: the simulation's device clock (server_app/runtime.py) computes each message's
completion from its device's profile, and a real fleet (hybridfl/launch/real_fleet.py) applies the same profile to a
real SuperNode (paced work, a shaped link, a memory limit, a start/stop schedule).

A fleet is a mix of device classes, each with a share of the fleet; every client draws its class and, where a
value is a distribution, its own value, from the run's seed (client c's draws depend on (seed, c) only, so a
client's device does not change when the fleet grows). A fleet is written as a mapping, the same in Python (the
built-ins below) and in a user's YAML file::

    devices:
      - name: phone
        share: 0.7
        compute-s-per-example: {lognormal: {median: 0.004, sigma: 0.7}}
        down-bytes-per-s: {lognormal: {median: 1.5e6, sigma: 0.9}}
        up-bytes-per-s: {lognormal: {median: 5.0e5, sigma: 0.9}}
        latency-s: 0.05
        memory-mb: 2048
        cpus: 1                          # a CPU quota on a real fleet (the simulation's speed is the line above)
        online-s: {exponential: 900}     # availability: online and offline windows, drawn in turn
        offline-s: {exponential: 300}
      - name: board
        share: 0.3
        compute-s-per-example: 0.01
        trace: windows.csv               # or: a file of online windows, `client,start-s,end-s` per line

Where each number of the built-in fleets comes from is in docs/methods.md ("Device time").
"""

from __future__ import annotations

import bisect
import csv
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.config import OneOf
from common.errors import ConfigError

FLEET_STREAM = 3  # the fleet's draws: numpy seed [seed, FLEET_STREAM, client]
NEVER = ((math.inf, math.inf),)  # the windows of a device that is never online


@dataclass(frozen=True)
class DeviceProfile:
    """One device: what a message costs it, and when it is online.

    A message's completion time on it, from its dispatch (:meth:`message_s`), is
    ``latency + down_bytes / down-bytes-per-s + examples · compute-s-per-example + overhead-s + latency +
    up_bytes / up-bytes-per-s`` (a rate of 0 is unlimited). ``windows`` are its online windows ``[start, end)`` in
    seconds from the run's start; empty = always online.
    """

    name: str = "ideal"
    compute_s_per_example: float = 0.0  # one training example, one epoch (forward and backward)
    overhead_s: float = 0.0  # every message's fixed cost on the device (loading the model, the data)
    down_bytes_per_s: float = 0.0
    up_bytes_per_s: float = 0.0
    latency_s: float = 0.0  # one way
    # real fleets: the chance a segment is lost (hybridfl/launch/shaper.py; the simulation ignores it)
    drop: float = 0.0
    memory_mb: int = 0  # the device's memory for the ClientApp (real fleets; 0 = no limit)
    cpus: float = 0.0  # the device's cores for the ClientApp (real fleets: a CPU quota; 0 = none)
    windows: tuple[tuple[float, float], ...] = ()

    def message_s(self, examples: int, down_bytes: int, up_bytes: int) -> float:
        """Seconds from dispatch to the reply's arrival, for a message training on `examples` examples·epochs,
        `down_bytes` sent to the device and `up_bytes` sent back."""
        return (2 * self.latency_s + _transfer_s(down_bytes, self.down_bytes_per_s) + self.overhead_s
                + examples * self.compute_s_per_example + _transfer_s(up_bytes, self.up_bytes_per_s))

    def online(self, t: float) -> bool:
        """Whether the device is online at `t`."""
        return not self.windows or self._window(t) is not None

    def offline_at(self, t: float) -> float:
        """When the device, online at `t`, goes offline (inf: never)."""
        w = self._window(t)
        return math.inf if not self.windows or w is None else self.windows[w][1]

    def next_online(self, t: float) -> float:
        """The first time ≥ `t` the device is online (inf: never again)."""
        if self.online(t):
            return t
        i = bisect.bisect_right([s for s, _ in self.windows], t)
        return self.windows[i][0] if i < len(self.windows) else math.inf

    def _window(self, t: float) -> int | None:
        i = bisect.bisect_right([s for s, _ in self.windows], t) - 1
        return i if i >= 0 and t < self.windows[i][1] else None


def _error(message: str) -> ConfigError:
    return ConfigError("fleet", "", "a built-in fleet or a fleet file as docs/tutorials/fleet.md writes it", message)


def _transfer_s(nbytes: int, rate: float) -> float:
    return nbytes / rate if rate > 0 else 0.0


# -- fleets as data --------------------------------------------------------------------------------
_VALUE_KEYS = ("compute-s-per-example", "overhead-s", "down-bytes-per-s", "up-bytes-per-s", "latency-s", "drop",
               "memory-mb", "cpus")
_CLASS_KEYS = {"name", "share", "online-s", "offline-s", "trace", *_VALUE_KEYS}
HORIZON_S = 30 * 24 * 3600.0  # windows are drawn this far ahead (a month of device time)

# FedScale-like devices (Lai et al., 2022, "FedScale: Benchmarking Model and System Performance of Federated Learning
# at Scale"): compute speed and bandwidth spread lognormally across devices. docs/methods.md "Device time" says why
# each number (our choices: FedScale's traces cannot be downloaded here).
_LOGNORMAL = {
    "compute-s-per-example": {"lognormal": {"median": 0.004, "sigma": 0.7}},
    "overhead-s": 0.5,
    "down-bytes-per-s": {"lognormal": {"median": 1.5e6, "sigma": 0.9}},
    "up-bytes-per-s": {"lognormal": {"median": 5.0e5, "sigma": 0.9}},
    "latency-s": 0.05,
}
FLEETS: dict[str, dict[str, Any]] = {
    # today's devices: full speed, a perfect link, always online
    "ideal": {"devices": [{"name": "ideal"}]},
    "lognormal": {"devices": [{"name": "lognormal", **_LOGNORMAL}]},  # always online
    # ... each online and offline in turn (exponential windows: on 15 min, off 5 min on average)
    "intermittent": {"devices": [{"name": "intermittent", **_LOGNORMAL, "online-s": {"exponential": 900.0},
                                  "offline-s": {"exponential": 300.0}}]},
}


@dataclass(frozen=True)
class Fleet:
    """Every client's :class:`DeviceProfile` (``devices[c]``), the fleet's name and the seed it was drawn with."""

    name: str
    devices: tuple[DeviceProfile, ...] = field(repr=False)
    seed: int = 0

    def __len__(self) -> int:
        return len(self.devices)

    @property
    def ideal(self) -> bool:
        """True when no device costs time or goes offline: today's fleet."""
        return all(d == DeviceProfile(name=d.name, memory_mb=d.memory_mb, cpus=d.cpus) for d in self.devices)

    @property
    def limited(self) -> bool:
        """True when a real fleet has something to apply: a device costs time, goes offline, or has a memory limit
        or a CPU quota."""
        return not self.ideal or any(d.memory_mb or d.cpus for d in self.devices)


def fleet_names() -> list[str]:
    return sorted(FLEETS)


@dataclass(frozen=True)
class FleetName(OneOf):
    """A built-in fleet, or a fleet YAML file (common/fleet.py)."""

    def ok(self, v: str) -> bool:
        return v == "" or super().ok(v) or v.endswith((".yaml", ".yml"))

    def describe(self) -> str:
        return f"'' (ideal), one of {', '.join(map(repr, self.allowed()))}, or a fleet YAML file (.yaml)"


def load_fleet(fleet: str, num_clients: int, seed: int, base: Path | None = None) -> Fleet:
    """The fleet `fleet` (a built-in name, or a YAML file's path, relative to `base` when not absolute) for
    `num_clients` clients, drawn with `seed`. Raises :class:`ConfigError` naming the bad key or value."""
    name = fleet or "ideal"
    if name in FLEETS:
        return make_fleet(name, FLEETS[name], num_clients, seed)
    path = Path(name) if base is None or Path(name).is_absolute() else base / name
    if not path.is_file():
        raise _error(f"fleet={fleet!r}: expected one of {', '.join(map(repr, fleet_names()))} or a fleet "
                          f"YAML file (no file at {path})")
    import yaml

    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise _error(f"fleet={fleet!r}: not YAML: {err}") from None
    return make_fleet(str(path), spec, num_clients, seed, base=path.parent)


def make_fleet(name: str, spec: Any, num_clients: int, seed: int, base: Path | None = None) -> Fleet:
    """A :class:`Fleet` of `num_clients` from a fleet mapping (the module docstring's form)."""
    classes = spec.get("devices") if isinstance(spec, Mapping) else None
    if not isinstance(classes, list) or not classes or not all(isinstance(c, Mapping) for c in classes):
        raise _error(f"fleet {name!r}: expected a mapping with 'devices': a list of device classes")
    for i, cls in enumerate(classes):
        if unknown := sorted(set(cls) - _CLASS_KEYS):
            raise _error(f"fleet {name!r}, device class {i}: unknown key(s) {unknown}; known: "
                              f"{sorted(_CLASS_KEYS)}")
    shares = np.array([_number(name, i, "share", c.get("share", 1.0), low=0.0) for i, c in enumerate(classes)])
    if shares.sum() <= 0:
        raise _error(f"fleet {name!r}: the classes' shares sum to 0")
    traces = {i: _read_trace(name, i, c["trace"], base) for i, c in enumerate(classes) if "trace" in c}
    devices = []
    for client in range(num_clients):
        rng = np.random.default_rng([seed, FLEET_STREAM, client])
        i = int(rng.choice(len(classes), p=shares / shares.sum()))
        cls = classes[i]
        values = {k.replace("-", "_"): _draw(name, i, k, cls.get(k, 0.0), rng) for k in _VALUE_KEYS}
        values["memory_mb"] = int(values["memory_mb"])
        if values["drop"] >= 1:
            raise _error(f"fleet {name!r}, device class {i}: drop={values['drop']!r}: expected a chance in [0, 1)")
        if i in traces:  # a client the trace does not name is never online
            windows = traces[i].get(client, NEVER)
        elif "online-s" in cls or "offline-s" in cls:
            windows = _windows(name, i, cls.get("online-s"), cls.get("offline-s"), rng)
        else:
            windows = ()
        devices.append(DeviceProfile(name=str(cls.get("name", f"class-{i}")), windows=windows, **values))
    return Fleet(name, tuple(devices), seed)


def _number(fleet: str, i: int, key: str, v: Any, low: float = 0.0) -> float:
    if isinstance(v, str):  # YAML 1.1 reads 2.0e5 (no exponent sign) as a string
        try:
            v = float(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < low:
        raise _error(f"fleet {fleet!r}, device class {i}: {key}={v!r}: expected a finite number ≥ {low:g} or "
                          "a distribution ({lognormal: {median: M, sigma: S}}, {uniform: [LOW, HIGH]}, "
                          "{exponential: MEAN})")
    return float(v)


def _draw(fleet: str, i: int, key: str, v: Any, rng: np.random.Generator) -> float:
    """A value from a number or a one-key distribution mapping."""
    if not isinstance(v, Mapping):
        return _number(fleet, i, key, v)
    if len(v) != 1:
        raise _error(f"fleet {fleet!r}, device class {i}: {key}={v!r}: a distribution is one of lognormal, "
                          "uniform, exponential")
    (kind, p), = v.items()
    if kind == "lognormal" and isinstance(p, Mapping) and set(p) == {"median", "sigma"}:
        median, sigma = (_number(fleet, i, f"{key}.lognormal.{k}", p[k]) for k in ("median", "sigma"))
        return float(median * math.exp(sigma * rng.standard_normal()))
    if kind == "uniform" and isinstance(p, Sequence) and len(p) == 2:
        lo, hi = (_number(fleet, i, f"{key}.uniform", x) for x in p)
        if hi < lo:
            raise _error(f"fleet {fleet!r}, device class {i}: {key}.uniform={list(p)}: expected [low, high]")
        return float(rng.uniform(lo, hi))
    if kind == "exponential":
        return float(rng.exponential(_number(fleet, i, f"{key}.exponential", p)))
    raise _error(f"fleet {fleet!r}, device class {i}: {key}={v!r}: expected a number, "
                      "{lognormal: {median: M, sigma: S}}, {uniform: [LOW, HIGH]} or {exponential: MEAN}")


def _windows(fleet: str, i: int, online: Any, offline: Any, rng: np.random.Generator
             ) -> tuple[tuple[float, float], ...]:
    """Online windows drawn in turn with offline ones up to :data:`HORIZON_S`; a device starts online with the
    chance its windows give (mean online / (mean online + mean offline)), so a fleet is in its steady state at 0."""
    if online is None or offline is None:
        raise _error(f"fleet {fleet!r}, device class {i}: 'online-s' and 'offline-s' go together")
    mean_on = _mean(fleet, i, "online-s", online)
    mean_off = _mean(fleet, i, "offline-s", offline)
    if mean_on <= 0:
        raise _error(f"fleet {fleet!r}, device class {i}: online-s={online!r}: a device must be online some time")
    t = 0.0 if rng.random() < mean_on / (mean_on + mean_off) else _draw(fleet, i, "offline-s", offline, rng)
    windows = []
    while t < HORIZON_S:
        end = t + max(_draw(fleet, i, "online-s", online, rng), 1.0)
        windows.append((t, end))
        t = end + _draw(fleet, i, "offline-s", offline, rng)
    return tuple(windows)


def _mean(fleet: str, i: int, key: str, v: Any) -> float:
    """The mean of a window distribution (for the starting state)."""
    if not isinstance(v, Mapping):
        return _number(fleet, i, key, v)
    kind, p = next(iter(v.items()))
    if kind == "exponential":
        return _number(fleet, i, key, p)
    if kind == "uniform" and isinstance(p, Sequence) and len(p) == 2:
        return sum(_number(fleet, i, key, x) for x in p) / 2
    if kind == "lognormal" and isinstance(p, Mapping) and set(p) == {"median", "sigma"}:
        return _number(fleet, i, key, p["median"]) * math.exp(_number(fleet, i, key, p["sigma"]) ** 2 / 2)
    return _draw(fleet, i, key, v, np.random.default_rng(0))  # raises the distribution's error


def _read_trace(fleet: str, i: int, trace: Any, base: Path | None) -> dict[int, tuple[tuple[float, float], ...]]:
    """A trace file's online windows by client: CSV lines ``client,start-s,end-s`` (a header line allowed)."""
    path = Path(str(trace))
    path = path if path.is_absolute() or base is None else base / path
    if not path.is_file():
        raise _error(f"fleet {fleet!r}, device class {i}: trace={trace!r}: no file at {path}")
    by_client: dict[int, list[tuple[float, float]]] = {}
    with path.open(newline="") as f:
        for n, row in enumerate(csv.reader(f), 1):
            if not row or (n == 1 and not row[0].strip().lstrip("-").isdigit()):
                continue
            try:
                client, start, end = int(row[0]), float(row[1]), float(row[2])
            except (ValueError, IndexError):
                raise _error(f"fleet {fleet!r}: trace {path}, line {n}: {row!r}: expected client,start-s,end-s"
                             ) from None
            if not (client >= 0 and 0 <= start < end):
                raise _error(f"fleet {fleet!r}: trace {path}, line {n}: {row!r}: expected client ≥ 0 and "
                                  "0 ≤ start-s < end-s")
            by_client.setdefault(client, []).append((start, end))
    out = {}
    for client, ws in by_client.items():
        ws.sort()
        if any(a[1] > b[0] for a, b in itertools.pairwise(ws)):
            raise _error(f"fleet {fleet!r}: trace {path}: client {client}'s windows overlap")
        out[client] = tuple(ws)
    return out

