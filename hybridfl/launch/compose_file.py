"""docker/compose.yml's files read as Compose reads them: merged (``!reset`` included), interpolated, checked (every
service runnable: its image's entrypoint, its ports on loopback or the devices' network, its volumes), and the
facts the demo, its native twin (tools/compose_twin.py) and the real-engine test (tools/compose_engine.py) take
from them (the SuperLink's port, the SuperNodes, the start order). Running them: hybridfl/launch/compose.py."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from hybridfl.launch.bundle import PROJECT_DIR

COMPOSE_DIR = PROJECT_DIR / "docker"
# The entrypoint of each image (hybridfl/app is built FROM flwr/superexec and keeps its entrypoint)
ENTRYPOINTS = {"flwr/superlink": "flower-superlink", "flwr/supernode": "flower-supernode",
               "flwr/superexec": "flower-superexec", "hybridfl/app": "flower-superexec", "nginx": "nginx"}
SUPERLINK, SERVERAPP, OUTPUTS = "superlink", "superexec-serverapp", "outputs"


class ComposeError(ValueError):
    """A compose file that cannot be run; the message names the service and what is wrong."""


def compose_files(plain_http: bool = False, gpu: bool = False, host: bool = False,
                  flower_devices: bool = False) -> list[Path]:
    return [COMPOSE_DIR / "compose.yml", *([COMPOSE_DIR / "plain-http.yml"] if plain_http else []),
            *([COMPOSE_DIR / "compose.gpu.yml"] if gpu else []), *([COMPOSE_DIR / "host-network.yml"] if host else []),
            *([COMPOSE_DIR / "flower-devices.yml"] if flower_devices else [])]


class Reset(list):
    """A value tagged ``!reset`` (compose ≥ 2.24): it replaces what the files before set instead of adding to it."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!reset", lambda loader, node: Reset(loader.construct_sequence(node)))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Compose's merge of an override file: mappings merge key by key, ``ports`` and ``volumes`` add up
    (a volume replaces the one at the same container path), everything else (command, healthcheck test,
    image) is replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Reset):
            out[key] = list(value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        elif key == "volumes" and isinstance(value, list) and isinstance(out.get(key), list):
            targets = {volume_spec(v)[1] for v in value}
            out[key] = [v for v in out[key] if volume_spec(v)[1] not in targets] + value
        elif key == "ports" and isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = out[key] + [p for p in value if p not in out[key]]
        else:
            out[key] = value
    return out


def interpolate(value: Any, env: dict[str, str] | None = None) -> Any:
    """Compose's variable interpolation, ``${NAME}`` and ``${NAME:-default}``, in every string of `value`."""
    env = os.environ if env is None else env
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m[1]) or (m[2] or ""), value)
    return value


def load(files: list[Path]) -> dict[str, Any]:
    """The compose files merged in order, variables interpolated, then checked (:func:`validate`)."""
    merged: dict[str, Any] = {}
    for path in files:
        data = yaml.load(path.read_text(), Loader=_Loader)
        if not isinstance(data, dict):
            raise ComposeError(f"{path}: not a mapping")
        merged = _merge(merged, data)
    merged = interpolate(merged)
    validate(merged)
    return merged


def is_setup(service: dict[str, Any]) -> bool:
    """A one-shot setup step (its own ``entrypoint``, never restarted), such as handing the volumes to the
    images' user. The twin skips it: its folders already belong to the user who runs it."""
    return "entrypoint" in service and service.get("restart") == "no" and not on_demand(service)


def on_demand(service: dict[str, Any]) -> bool:
    """A service that `up` never starts (it has ``profiles``): the operator's `flwr`, run when asked."""
    return bool(service.get("profiles"))


def volume_spec(spec: str) -> tuple[str, str, bool]:
    """``source:target[:ro]`` -> (source, target, read-only)."""
    parts = str(spec).split(":")
    if len(parts) not in (2, 3) or not parts[1].startswith("/") or parts[2:] not in ([], ["ro"], ["rw"]):
        raise ComposeError(f"volume {spec!r}: expected source:/container/path[:ro]")
    return parts[0], parts[1], parts[2:] == ["ro"]


def image_of(name: str, service: dict[str, Any]) -> str:
    image = service.get("image")
    if not isinstance(image, str) or ":" not in image:
        raise ComposeError(f"service {name}: image {image!r} must be repository:tag")
    repository = image.rsplit(":", 1)[0]
    if repository not in ENTRYPOINTS:
        raise ComposeError(f"service {name}: image {image!r} is none of {sorted(ENTRYPOINTS)}")
    return repository


def validate(compose: dict[str, Any]) -> None:
    """Raise ComposeError naming every problem: images and their tags, commands as lists of strings,
    ports, volumes declared, ``depends_on`` targets that exist (with a healthcheck where the condition is
    service_healthy) and no cycle, a healthcheck on the SuperLink and every SuperNode, one SuperLink."""
    services = compose.get("services")
    if not isinstance(services, dict) or not services:
        raise ComposeError("no services")
    problems: list[str] = []
    named = set(compose.get("volumes") or {})
    tags: dict[str, str] = {}
    for name, svc in services.items():
        try:
            repository = image_of(name, svc)
        except ComposeError as err:
            problems.append(str(err))
            continue
        if repository.startswith("flwr/"):
            tags[name] = svc["image"].rsplit(":", 1)[1]
        cmd = svc.get("entrypoint" if is_setup(svc) or on_demand(svc) else "command")
        if not (isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd)):
            problems.append(f"service {name}: command must be a non-empty list of strings, got {cmd!r}")
        for port in svc.get("ports") or []:
            if not re.fullmatch(r"(127\.0\.0\.1:)?\d+:\d+", str(port)):
                problems.append(f"service {name}: port {port!r} must be [127.0.0.1:]HOST:CONTAINER")
        for spec in svc.get("volumes") or []:
            try:
                source = volume_spec(spec)[0]
            except ComposeError as err:
                problems.append(f"service {name}: {err}")
                continue
            if not source.startswith((".", "/", "$")) and source not in named:
                problems.append(f"service {name}: volume {source!r} is not declared under volumes:")
        for dep, cond in (svc.get("depends_on") or {}).items():
            if dep not in services:
                problems.append(f"service {name}: depends_on {dep!r}, which is not a service")
            elif (cond or {}).get("condition") == "service_healthy" and "healthcheck" not in services[dep]:
                problems.append(f"service {name}: waits for {dep} to be healthy, but {dep} has no healthcheck")
        needs_health = repository in ("flwr/superlink", "flwr/supernode") and not is_setup(svc)
        test = (svc.get("healthcheck") or {}).get("test")
        if needs_health and not (isinstance(test, list) and test[:1] in (["CMD"], ["CMD-SHELL"])):
            problems.append(f"service {name}: needs a healthcheck test [CMD, ...]")
    if len(set(tags.values())) > 1:
        problems.append(f"Flower images must share one version, got {tags}")
    links = [n for n, s in services.items() if s.get("image", "").startswith("flwr/superlink:") and not is_setup(s)]
    if links != [SUPERLINK]:
        problems.append(f"expected one SuperLink service named {SUPERLINK!r}, got {links}")
    if SERVERAPP not in services:
        problems.append(f"no {SERVERAPP!r} service (the ServerApp's SuperExec)")
    if not problems:
        try:
            start_order(services)
        except ComposeError as err:
            problems.append(str(err))
    if problems:
        raise ComposeError("; ".join(problems))


def start_order(services: dict[str, Any]) -> list[str]:
    """Services in an order that starts each after everything it depends on."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ComposeError(f"depends_on cycle through {name}")
        visiting.add(name)
        for dep in services[name].get("depends_on") or {}:
            visit(dep)
        order.append(name)

    for name in services:
        visit(name)
    return order


def missing_modules(conf: str) -> list[str]:
    """The nginx modules an nginx configuration loads (``load_module``) that this machine lacks (docker/link.conf's
    stream module: Debian's libnginx-mod-stream)."""
    return [m for m in re.findall(r"^load_module (\S+);", conf, re.MULTILINE) if not Path(m).exists()]


def auth_key(command: list[str]) -> str | None:
    """The private key a SuperNode command authenticates with (``--auth-supernode-private-key``), if any: its
    public half must be registered before the SuperNode starts."""
    flag = "--auth-supernode-private-key"
    return command[command.index(flag) + 1] if flag in command else None


def superlink_port(compose: dict[str, Any]) -> int:
    """The SuperLink's own port (Fleet, Control and Runtime: the operator's `flwr` talks to it), as its command
    sets it; the devices reach the edge instead."""
    command = compose["services"][SUPERLINK]["command"]
    return int(command[command.index("--port") + 1])


def supernodes(compose: dict[str, Any]) -> list[str]:
    return [n for n, s in compose["services"].items() if s["image"].startswith("flwr/supernode:")]
