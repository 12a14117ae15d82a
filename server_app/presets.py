"""The presets: YAML files of run keys, each optionally built on others (``base``), under ``configs/`` or inside a
user's package (``package:path``), and the ``method-options`` table spread into keys.

Kept apart from the run configuration (server_app/config.py) because a device reads presets too: it checks that a
message names only the code its run declared (client_app/declared.py), and that must not import the server.
"""

from __future__ import annotations

import importlib.resources
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.config import ConfigError, OneOf
from common.user_code import import_user_module

# The presets: package data of this package in an installed wheel (pyproject's force-include); beside it in a
# source checkout and in the FAB built from one
_PACKAGED = Path(str(importlib.resources.files("server_app"))) / "configs"
CONFIG_DIR = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parent.parent / "configs"


def preset_names() -> list[str]:
    """Preset names: paths under configs/ without ``.yaml`` (``feddle-animal/feddle-id-dir0.1-n20``)."""
    return sorted(p.relative_to(CONFIG_DIR).with_suffix("").as_posix() for p in CONFIG_DIR.rglob("*.yaml"))


def preset_path(name: str) -> Path | None:
    """The YAML file of preset `name`: ``configs/<name>.yaml``, or for ``package:path`` (a user's own preset)
    ``<path>.yaml`` inside that installed package; None for a package that cannot be imported."""
    if ":" not in name:
        return CONFIG_DIR / f"{name}.yaml"

    package, _, rel = name.partition(":")
    try:
        return Path(str(importlib.resources.files(import_user_module(package)) / f"{rel}.yaml"))
    except (ModuleNotFoundError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class PresetName(OneOf):
    """A preset under configs/, or a user's ``package:path`` (``mytask:presets/fedavg``)."""

    def ok(self, v: str) -> bool:
        path = preset_path(v)
        return path is not None and path.is_file() and ".." not in Path(v.partition(":")[2] or v).parts

    def describe(self) -> str:
        return ("a file under configs/ without '.yaml' (`hybridfl presets` lists all "
                f"{len(self.allowed())}), or your own 'package:path' (a YAML file inside an installed package)")


def read_preset(name: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The key/value mapping of ``configs/<name>.yaml``.

    A preset may build on others: ``base: <preset>`` or ``base: [<preset>, ...]`` applies those first
    (in order, each with its own bases), then the file's own keys. So a family of presets shares one
    protocol file and each member states only what differs.
    """
    if name in _seen:
        raise ConfigError("base", name, f"a preset that does not include itself (cycle {' -> '.join(_seen + (name,))})")
    bases, data = preset_file(name)
    layered: dict[str, Any] = {}
    for base in bases:
        layered.update(read_preset(base, _seen + (name,)))
    return {**layered, **data}


def preset_file(name: str) -> tuple[list[str], dict[str, Any]]:
    """What the YAML file of preset `name` itself says: the presets it builds on (``base``) and its own keys."""
    check = PresetName(preset_names)
    if not check.ok(name):
        raise ConfigError("preset", name, check.describe())
    path = preset_path(name)
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError("preset", name, f"a YAML mapping in {path}")
    bases = data.pop("base", [])
    return [bases] if isinstance(bases, str) else list(bases), data


def unpack_method_options(overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` with ``method-options``' table spread into keys of their own (a key given both ways is an error)."""
    packed = overrides.pop("method-options", "")
    if not packed:
        return overrides
    try:
        table = tomllib.loads(f"t = {packed}")["t"]
        if not isinstance(table, dict):
            raise TypeError
    except (tomllib.TOMLDecodeError, TypeError):
        raise ConfigError("method-options", packed, "a TOML inline table such as '{ clip-norm = 0.1 }'") from None
    if twice := sorted(set(table) & set(overrides)):
        raise ConfigError("method-options", packed, f"keys not also given on their own ({', '.join(twice)})")
    return {**overrides, **table}
