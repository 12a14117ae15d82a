"""The Flower app a launcher submits with ``flwr run``: hybridfl's ServerApp and ClientApp, with their packages.

From a source checkout it is a copy of the checkout's app files (its pyproject.toml declares the app; the copy
builds the very FAB that ``flwr run .`` there would, without Flower reading the .venv's files). An installed wheel
has no such folder: the app is assembled from the installed packages and a pyproject.toml generated from the code
(``hybridfl.config_table``, the table tests/test_config.py keeps the checkout's equal to). Either way the folder is
temporary, and the FAB carries what a node needs: the app's packages and the presets.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import tempfile
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pathspec
import tomli_w

from common.user_code import OWN_PACKAGES

# The folder above the package: a source checkout's root, or an installed wheel's site-packages
PROJECT_DIR = Path(__file__).resolve().parents[2]
APP_PACKAGES = tuple(p for p in OWN_PACKAGES if p != "hybridfl")  # what the FAB carries
PUBLISHER = "hybridfl"


def source_checkout() -> Path | None:
    """The checkout this code runs from, when it is one (its pyproject.toml declares hybridfl's Flower app)."""
    try:
        with open(PROJECT_DIR / "pyproject.toml", "rb") as f:
            app = tomllib.load(f)["tool"]["flwr"]["app"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None
    return PROJECT_DIR if app.get("publisher") == PUBLISHER else None


def toml_value(value: Any) -> str:
    """A Python value as a TOML literal, as ``flwr run -c`` reads it."""
    return tomli_w.dumps({"v": value})[len("v = "):].rstrip("\n")


def pyproject_table() -> str:
    """``[tool.flwr.app.config]``: every key with its default (Flower fuses only keys declared there)."""
    from server_app.config import run_key_defaults

    return tomli_w.dumps({"tool": {"flwr": {"app": {"config": run_key_defaults()}}}})


def app_pyproject() -> str:
    """The app's pyproject.toml for an installed hybridfl: its components and every run key at its default."""
    meta = importlib.metadata.metadata("hybridfl")
    project = {"name": "hybridfl", "version": meta["Version"], "description": meta["Summary"],
               "license": meta["License-Expression"]}
    app = {"publisher": PUBLISHER, "components": {"serverapp": "server_app.app:app",
                                                  "clientapp": "client_app.app:app"}}
    return tomli_w.dumps({"project": project, "tool": {"flwr": {"app": app}}}) + "\n" + pyproject_table()


def app_config(app_dir: Path | None = None) -> dict[str, Any]:
    """A Flower app's own config table (``[tool.flwr.app.config]`` of `app_dir`'s pyproject.toml); hybridfl's own
    app's when `app_dir` is None (every key at its default)."""
    if app_dir is None and (app_dir := source_checkout()) is None:
        return tomllib.loads(app_pyproject())["tool"]["flwr"]["app"]["config"]
    with open(app_dir / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["flwr"]["app"].get("config", {})


def app_files(folder: Path) -> Iterator[Path]:
    """The files under `folder` that ``flwr run`` could put in its FAB, relative: all but symbolic links and what
    its .gitignore, Flower (``.venv``, ``.flwr``, ``__pycache__``) or git (``.git``) leave out, whose folders are not
    entered. Flower 1.42's ``flwr run .`` resolves every file under the folder before filtering: in a checkout with
    its .venv, 79 000 files and 9 s of CPU per run."""
    ignore = pathspec.GitIgnoreSpec.from_lines([*IGNORED_BY_FLOWER, *_lines(folder / ".gitignore")])
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath).relative_to(folder)
        dirnames[:] = [d for d in dirnames if not (Path(dirpath, d).is_symlink()
                                                    or ignore.match_file(f"{(here / d).as_posix()}/"))]
        for name in filenames:
            if not Path(dirpath, name).is_symlink() and not ignore.match_file((here / name).as_posix()):
                yield here / name


# flwr.supercore.constant.APP_PUBLISH_EXCLUDE_PATTERNS, and git's own folder (whose files no FAB takes)
IGNORED_BY_FLOWER = (".venv/", ".flwr/", "__pycache__/", ".git/")


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


@contextmanager
def flower_app(app_dir: Path | None = None) -> Iterator[Path]:
    """The folder of the Flower app `app_dir` (a user's) or, when None, of hybridfl's own, for as long as the block
    runs. hybridfl's checkout is handed over as a copy of its :func:`app_files` (the same FAB, without Flower reading
    its .venv); an installed hybridfl as its packages and a generated pyproject.toml."""
    if app_dir is not None:
        yield app_dir
        return
    with tempfile.TemporaryDirectory(prefix="hybridfl-app-") as folder:
        root = Path(folder)
        if (checkout := source_checkout()) is not None:
            for path in app_files(checkout):
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(checkout / path, root / path)
            yield root
            return
        for package in APP_PACKAGES:
            source = Path(importlib.import_module(package).__file__).parent
            shutil.copytree(source, root / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (root / "pyproject.toml").write_text(app_pyproject())
        yield root
