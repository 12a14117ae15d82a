"""The option machinery: how a configuration key is declared, checked and documented.

A key is declared once, as an :func:`option` field of the frozen dataclass that carries it to where it
is used: the data spec (``common.splits.DataSpec``), the model (``common.models.ModelSpec``), the clients'
local recipe (``common.training.LocalRecipe``), the runtime (``server_app.runtime.RuntimeConfig``), the
method's name (``strategies.MethodChoice``), each method's options (a strategy's or a client objective's
``Config``), and the run itself (``server_app.config.RunConfig``, which inherits the first five). A key is
spelled the same everywhere: YAML, pyproject, ``-c``, messages and the docs use ``num-rounds``, the dataclass
field is ``num_rounds`` (hyphens become underscores, nothing else changes). Every value is checked at
start-up; a bad one raises :class:`ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from common.datasets import class_ids
from common.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """A numeric interval; `low_open` excludes the lower bound."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False

    def ok(self, v: float) -> bool:
        return (v > self.low if self.low_open else v >= self.low) and v <= self.high

    def describe(self) -> str:
        lo = "(" if self.low_open else "["
        return f"a value in {lo}{self.low}, {self.high}]"

    def short(self) -> str:
        """The key table's spelling: ``> 0``, ``≥ 1``, ``[0, 1]``."""
        low = int(self.low) if float(self.low).is_integer() else self.low
        if self.high == math.inf:
            return f"{'>' if self.low_open else '≥'} {low}"
        high = int(self.high) if float(self.high).is_integer() else self.high
        return f"{'(' if self.low_open else '['}{low}, {high}]"


@dataclass(frozen=True)
class OneOf:
    """A name from a fixed tuple or a registry (`names` called lazily, so registries load late)."""

    names: Callable[[], Iterable[str]] | tuple[str, ...]

    def allowed(self) -> list[str]:
        return sorted(self.names() if callable(self.names) else self.names)

    def ok(self, v: str) -> bool:
        return v in set(self.allowed())

    def describe(self) -> str:
        return "one of " + ", ".join(repr(n) for n in self.allowed())

    def short(self) -> str:
        return ", ".join(f"`{n}`" if n else '`""`' for n in self.allowed())


@dataclass(frozen=True)
class ClassList:
    """Comma-separated class ids (``"7,8,9"``), each at most once; ``""`` = none."""

    def ok(self, v: str) -> bool:
        try:
            ids = class_ids(v)
        except ValueError:
            return False
        return len(set(ids)) == len(ids)

    def describe(self) -> str:
        return "comma-separated distinct class ids such as '7,8,9', or '' for none"

    def short(self) -> str:
        return "class ids `7,8,9`; `\"\"` = none"


Check = Range | OneOf | ClassList | None


def option(default: Any, check: Check = None, doc: str = "", allowed: str = "") -> Any:
    """A configuration field: its default, the check its values must pass, one line of documentation, and
    (where the check does not say it well) how the reference's key table states what is allowed."""
    return field(default=default, metadata={"check": check, "doc": doc, "allowed": allowed})


@dataclass(frozen=True)
class Option:
    """An option defined once and declared by several configs (FedBuff's and CA2FL's ``buffer-size``),
    so that the key has one default, one check and one meaning everywhere."""

    default: Any
    check: Check = None
    doc: str = ""

    def field(self) -> Any:
        return option(self.default, self.check, self.doc)


@dataclass(frozen=True)
class OptionSpec:
    """One key of a config dataclass: what :func:`validate` and the reference's key table need."""

    key: str
    name: str
    type: type
    default: Any
    check: Check
    doc: str
    allowed: str = ""

    def same_as(self, other: OptionSpec) -> bool:
        return (self.type, self.default, self.check, self.doc) == (other.type, other.default, other.check, other.doc)

    def allowed_text(self) -> str:
        """What the reference's key table says is allowed."""
        return self.allowed or (self.check.short() if self.check else {bool: "bool", str: "text"}.get(self.type, ""))


def to_key(name: str) -> str:
    return name.replace("_", "-")


@functools.cache  # read for every message a node handles: resolving the type hints each time costs milliseconds
def specs_of(cls: type) -> Mapping[str, OptionSpec]:
    """The options of config dataclass `cls`, by key (types resolved even under postponed annotations); read-only."""
    hints = typing.get_type_hints(cls)
    return types.MappingProxyType({
        to_key(f.name): OptionSpec(to_key(f.name), f.name, hints[f.name], f.default, f.metadata["check"],
                                   f.metadata["doc"], f.metadata["allowed"])
        for f in dataclasses.fields(cls) if "check" in f.metadata})


_KIND = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def validate(spec: OptionSpec, value: Any) -> Any:
    """`value` coerced to the key's type (an int is a float) and checked, or :class:`ConfigError`."""
    kind = spec.type
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not kind:  # bool is not an int here, and "3" is not 3
        raise ConfigError(spec.key, value, _KIND[kind])
    if kind is float and not math.isfinite(value):
        raise ConfigError(spec.key, value, "a finite number")
    if spec.check is not None and not spec.check.ok(value):
        raise ConfigError(spec.key, value, spec.check.describe())
    return value


def make_options(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of config dataclass `cls` from hyphenated `values` (keys it does not own are ignored),
    every value validated."""
    specs = specs_of(cls)
    return cls(**{spec.name: validate(spec, values[key]) for key, spec in specs.items() if key in values})


def from_keys(cls: type, values: Mapping[str, Any]) -> Any:
    """:func:`make_options` for a part that must come whole (a message's data spec, model or recipe): a key of
    `cls` missing from `values` is a malformed message, a KeyError naming every one missing."""
    missing = sorted(specs_of(cls).keys() - values.keys())
    if missing:
        raise KeyError(f"{cls.__name__} keys missing: {', '.join(missing)}")
    return make_options(cls, values)


def check_options(instance: Any) -> None:
    """Validate a config dataclass built in code (``FedBuff(buffer_size=0)``): :class:`ConfigError` if bad."""
    for spec in specs_of(type(instance)).values():
        validate(spec, getattr(instance, spec.name))


def options_dict(instance: Any) -> dict[str, Any]:
    """A config dataclass as ``{key: value}`` with hyphenated keys (logs, summary.json, messages)."""
    return {key: getattr(instance, spec.name) for key, spec in specs_of(type(instance)).items()}


def part_of(cls: type, whole: Any) -> Any:
    """The `cls` part of a config that holds its fields (a ``RunConfig`` holds a ``DataSpec``'s)."""
    return cls(**{spec.name: getattr(whole, spec.name) for spec in specs_of(cls).values()})


@dataclass(frozen=True)
class NoOptions:
    """The options of a method that has none."""


POSITIVE = Range(0, math.inf, low_open=True)
COUNT = Range(1)
