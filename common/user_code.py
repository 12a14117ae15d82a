"""A user's own model and data, named by import path: ``model = "mypkg.nets:make_net"``,
``dataset = "mypkg.data:load"`` (``module:function``, as Flower names its apps).

The contract, one place for both sides (the server and every node import the same path, so the package must be
installed wherever the run's ServerApp and ClientApps run):

* **model factory** ``factory(input_shape, num_classes) -> torch.nn.Module``: ``input_shape`` is one sample's
  shape (``(C, H, W)`` for images, ``(D,)`` for tabular features, ``(T,)`` for token ids), ``num_classes`` the
  task's. It is called under a seeded generator (the run's seed), so a factory needs no seed of its own. The
  module maps a batch of inputs to logits. What the hybrid methods need beyond that: the **head** is the
  model's last trainable parameter arrays (FedDUAL's ``head-arrays``, FedMerge's ``head``), so register the
  classifier last; and the out-of-domain methods (Feddle-OOD, FedDF-OOD, ...) fit their own head on the server
  data's labels over ``model.features(x)``, the input of the last layer: define ``features`` when you use them.
  Built-in models get the image input adapter (resize, channels, normalisation); a user's model gets the inputs
  as they are.
* **data loader** ``loader(root) -> ArrayDataset | (x, y)``: ``root`` is the run's ``data-root`` (a
  ``pathlib.Path``), ``x`` one float array of all the samples (any shape per sample), ``y`` integer labels
  ``0..K-1``. The whole dataset: the server's test, validation and central splits and the client partitions
  are cut from it by the run's seed, exactly as for the built-in datasets.

A device runs only the code its run declared at its start (client_app/declared.py): while the ClientApp handles a
message, :func:`resolve` imports nothing but what :func:`declared_only`'s check lets through.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from common.datasets import ArrayDataset
from common.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
INSTALL = "installed where the run's ServerApp and ClientApps run (`pip install` it on every SuperNode)"


def is_import_path(value: str) -> bool:
    """``module.path:attribute``."""
    return bool(IMPORT_PATH.match(value))


def import_paths(values: Mapping[str, Any]) -> dict[str, str]:
    """The keys of `values` whose value is an import path (the code a run's configuration names)."""
    return {key: value for key, value in values.items() if isinstance(value, str) and is_import_path(value)}


# hybridfl's top-level packages: a user's own package of one of these names is never imported (ours come first)
OWN_PACKAGES = ("flower_internals", "common", "client_app", "server_app", "strategies", "hybridfl")

# The folder a hybridfl command ran in (its launchers pass it to every Flower process): where a user's own code is
# found when no installed package (and not the run's own app) provides it
USER_DIR = "HYBRIDFL_USER_DIR"


def import_user_module(name: str) -> ModuleType:
    """Import module `name`: from the installed packages and the run's app first; failing that, from the folder the
    command ran in (:data:`USER_DIR`), appended last to ``sys.path`` so that it never shadows an installed package,
    hybridfl's own or the run's FAB."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        folder = os.environ.get(USER_DIR)
        if not folder or folder in sys.path or err.name != name.split(".")[0]:
            raise
        sys.path.append(folder)
        return importlib.import_module(name)


# The node setting (``flower-supernode --node-config``) that lists the code a device runs besides what its runs declare
ALLOW_CODE = "allow-code"


class UndeclaredCode(ConfigError):
    """A message names code (an import path) that neither its run's configuration at the run's start nor the node's
    :data:`ALLOW_CODE` declares: the device imports nothing and answers with an error."""


# Set while a device handles a message: check(key, value) raises UndeclaredCode for a name it may not import
_DEVICE_CHECK: ContextVar[Callable[[str, str], None] | None] = ContextVar("hybridfl_device_check", default=None)


@contextmanager
def declared_only(check: Callable[[str, str], None]) -> Iterator[None]:
    """Inside the block (a device's handling of one message), :func:`resolve` first calls ``check(key, value)``,
    which raises :class:`UndeclaredCode` for a name the run did not declare: whatever path of the device's code
    resolves a name, nothing undeclared is imported."""
    token = _DEVICE_CHECK.set(check)
    try:
        yield
    finally:
        _DEVICE_CHECK.reset(token)


def resolve(key: str, value: str, what: str) -> Callable[..., Any]:
    """The callable `value` names, or a :class:`ConfigError` naming `key`, `value`, `what` was expected and why
    the import failed. On a device (:func:`declared_only`) an undeclared `value` is refused before any import."""
    if (check := _DEVICE_CHECK.get()) is not None:
        check(key, value)
    module, _, attr = value.partition(":")
    top, folder = module.split(".")[0], Path(os.environ.get(USER_DIR) or ".")
    if top in OWN_PACKAGES and ((folder / top).is_dir() or (folder / f"{top}.py").is_file()):
        raise ConfigError(key, value, f"{what} in a package of your own; '{top}' in {folder.resolve()} has the name "
                          f"of hybridfl's package '{top}', which every run imports instead: rename yours (hybridfl's "
                          f"are {', '.join(OWN_PACKAGES)})")
    try:
        found = getattr(import_user_module(module), attr)
    except ImportError as err:
        raise ConfigError(key, value, f"{what}, importable as '{module}' ({err}); the package must be {INSTALL}",
                          ) from err
    except AttributeError as err:
        raise ConfigError(key, value, f"{what}: module '{module}' has no '{attr}'") from err
    if not callable(found):
        raise ConfigError(key, value, f"{what}, a callable; '{value}' is a {type(found).__name__}")
    return found


def load_user_dataset(value: str, root: str) -> ArrayDataset:
    """Call the loader `value` names with ``Path(root)`` and check what it returns."""
    expected = "a data loader 'module:function' returning an ArrayDataset or (x, y) arrays"
    got = resolve("dataset", value, expected)(Path(root).expanduser())
    if isinstance(got, ArrayDataset):
        x, y = got.x, got.y
    elif isinstance(got, tuple) and len(got) == 2:
        x, y = (np.asarray(a) for a in got)
    else:
        raise ConfigError("dataset", value, f"{expected}; it returned a {type(got).__name__}")
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or len(y) == 0:
        raise ConfigError("dataset", value, f"{expected}: x of shape (N, ...) and y of shape (N,), N > 0; got x "
                          f"{tuple(x.shape)} and y {tuple(y.shape)}")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise ConfigError("dataset", value, f"{expected}: integer labels 0..K-1; got {y.dtype} from {y.min()}")
    if not np.issubdtype(x.dtype, np.number) or not np.isfinite(x).all():
        raise ConfigError("dataset", value, f"{expected}: finite numeric x; got {x.dtype}")
    num_classes = max(int(y.max()) + 1, got.num_classes if isinstance(got, ArrayDataset) else 0)
    if isinstance(got, ArrayDataset):
        return ArrayDataset(x.astype(np.float32, copy=False), y.astype(np.int64, copy=False), num_classes,
                            got.groups, got.fine)
    return ArrayDataset(x.astype(np.float32), y.astype(np.int64), num_classes)


def build_user_model(value: str, input_shape: tuple[int, ...], num_classes: int, seed: int) -> nn.Module:
    """Call the factory `value` names under torch's generator seeded with `seed` (the global generator is left
    as it was) and check that it gave a module with trainable parameters."""
    import torch
    from torch import nn

    factory = resolve("model", value, "a model factory 'module:function'")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = factory(tuple(int(d) for d in input_shape), int(num_classes))
        except Exception as err:  # noqa: BLE001 - a class or a function of another signature: the contract
            raise ConfigError("model", value, f"a model factory called as factory(input_shape, num_classes) -> "
                              f"torch.nn.Module; factory({tuple(input_shape)}, {num_classes}) raised "
                              f"{type(err).__name__}: {err}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError("model", value, f"a model factory returning a torch.nn.Module; it returned a "
                          f"{type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("model", value, "a model factory returning a module with trainable parameters")
    return model
