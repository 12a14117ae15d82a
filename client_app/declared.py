"""Devices run only declared code: a device imports a model factory, a data loader or a method that a message names
by import path (``module:attribute``) only if the run declared it at its start or the node's own settings allow it.

A message's content is not to be trusted: with Flower 1.42 a registered node can push a message whose source claims
to be the SuperLink to another node. What no message changes is the run's configuration fixed at its start, the
Context's ``run_config`` (the app's ``[tool.flwr.app.config]`` fused with ``flwr run -c``'s keys: on a SuperNode
from the run's FAB and the SuperLink's record of the run, in a simulation from the app's folder, in the in-process
engine the keys its run started with), and the node's own ``node_config``. Declared are:

* every import-path value in ``run_config``, in its ``method-options`` table, and in the preset it names (with the
  presets that one builds on), read by server_app/config.py's own functions;
* the names in the node setting ``allow-code`` (comma-separated ``module:attribute``), for code that the run's
  configuration does not name (a ``flwr run -c resume=...`` of a run with one's own code, a ServerApp of one's own
  that names code of its own).

Registered names (hybridfl's strategies, datasets, models) are not import paths: they always pass. Two checks:
:func:`check_message` at the boundary, on the message's configuration before anything in it is used
(client_app/work.py ``load_task``, where train, evaluate and the in-process engine's cohort training start), and
:func:`guard`, under which the ClientApp runs every handler, so that :func:`common.user_code.resolve` refuses an
undeclared name on whatever path a handler takes to it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

from flwr.app import Context

from common.errors import ConfigError
from common.user_code import ALLOW_CODE, UndeclaredCode, declared_only, is_import_path


def node_allowed(node_config: Mapping[str, Any]) -> frozenset[str]:
    """The import paths the node setting ``allow-code`` lists (comma-separated), or a :class:`ConfigError` naming
    it."""
    raw = str(node_config.get(ALLOW_CODE, ""))
    names = [name.strip() for name in raw.split(",") if name.strip()]
    if bad := [name for name in names if not is_import_path(name)]:
        raise ConfigError(ALLOW_CODE, raw, f"comma-separated import paths 'module:attribute' ('{bad[0]}' is not one)")
    return frozenset(names)


def _strings(values: Iterable[Any]) -> Iterator[str]:
    """The strings among `values`, and inside those that are lists (a ConfigRecord's list values)."""
    for value in values:
        if isinstance(value, str):
            yield value
        elif isinstance(value, list | tuple):
            yield from (v for v in value if isinstance(v, str))


@functools.lru_cache(maxsize=4)
def run_declared(run_config: tuple[tuple[str, Any], ...]) -> frozenset[str]:
    """The import paths that the run's configuration at its start names (`run_config`'s items): among its values,
    its ``method-options`` table's and its preset's (with its bases). Kept per run configuration: server_app.presets
    is imported once per process, and only for a message that names code at all."""
    from server_app.presets import read_preset, unpack_method_options

    values = unpack_method_options(dict(run_config))
    preset = values.get("preset")
    named = [*values.values(), *(read_preset(str(preset)).values() if preset else ())]
    return frozenset(v for v in _strings(named) if is_import_path(v))


def _items(run_config: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """`run_config` as a key of :func:`run_declared`'s cache."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in run_config.items()))


def check(context: Context, key: str, value: str) -> None:
    """Raise :class:`UndeclaredCode` naming `key`, `value` and how to declare it unless the node's ``allow-code``
    or the run's configuration at its start (:func:`run_declared`) names `value`."""
    if value in node_allowed(context.node_config):
        return
    try:
        if value in run_declared(_items(context.run_config)):
            return
        unread = ""
    except ConfigError as err:  # a preset this node cannot read declares nothing here: the reply says why
        unread = f"; the run's configuration could not be read on this node ({err})"
    raise UndeclaredCode(key, value, "code declared at the run's start", (
        f"config key '{key}' = '{value}' names code that neither the run's configuration at its start (a key of "
        f"`flwr run -c` or of the app's [tool.flwr.app.config], its method-options or its preset) nor this node's "
        f"'{ALLOW_CODE}' declares: nothing was imported. Give it as the run's '{key}' when the run starts, or list it "
        f"on the node: flower-supernode --node-config '{ALLOW_CODE}=\"{value}\"'{unread}"))


def check_message(config: Mapping[str, Any], context: Context) -> None:
    """Refuse (:func:`check`) a message whose configuration `config` names undeclared code in any value, before
    anything in it is used. ``imagefolder:<folder>`` names a folder of images, not code."""
    from common.splits import IMAGEFOLDER

    for key, value in config.items():
        for name in _strings([value]):
            if is_import_path(name) and not name.startswith(IMAGEFOLDER):
                check(context, key, name)


def guard(context: Context) -> AbstractContextManager[None]:
    """While a handler runs for a message to the node of `context`, :func:`common.user_code.resolve` imports only
    what :func:`check` lets through."""
    return declared_only(functools.partial(check, context))
