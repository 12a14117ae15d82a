"""hybridfl installed from its wheel, not from this checkout: a fresh virtual environment, an empty folder, the main
job's protocol in all three modes (README "Install from the wheel")."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from hybridfl.launch.bundle import PROJECT_DIR, app_pyproject

PIP_QUIET = ["-q", "--disable-pip-version-check"]
# one worker builds the wheel's venv (a module's fixture is per worker) and runs every mode in it
pytestmark = pytest.mark.xdist_group("wheel")


def test_the_app_an_installed_wheel_submits_is_the_checkouts():
    """The pyproject.toml generated for an installed hybridfl declares the checkout's components and run keys."""
    generated = tomllib.loads(app_pyproject())
    checkout = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())
    for key in ("publisher", "components", "config"):
        assert generated["tool"]["flwr"]["app"][key] == checkout["tool"]["flwr"]["app"][key], key
    assert generated["project"]["description"] == checkout["project"]["description"]


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh venv holding hybridfl's wheel (`pip wheel .` with this environment's hatchling, no package index;
    installed non-editable) and Flower's commands. The other dependencies (torch, Ray, ...: gigabytes) come from this
    environment's site-packages, added as a path only: its .pth files, the editable install of this checkout among
    them, are not read."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", *PIP_QUIET, "--no-deps", "--no-index", "--no-build-isolation",
                    "-w", str(root / "dist"), str(PROJECT_DIR)], check=True, capture_output=True, timeout=600)
    wheel = next((root / "dist").glob("hybridfl-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", *PIP_QUIET, "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=600)
    # Flower's commands (flwr, flower-superlink, ...) in the venv's bin/, where the launchers look for them: written as
    # pip writes a console script, from Flower's entry points, since Flower comes from this environment (pip would
    # fetch its wheel from the package index, and the suite keeps to loopback)
    for command in importlib.metadata.distribution("flwr").entry_points.select(group="console_scripts"):
        script = venv / "bin" / command.name
        script.write_text(f"#!{python}\nimport sys\nfrom {command.module} import {command.attr}\n"
                          f"sys.exit({command.attr}())\n")
        script.chmod(0o755)
    return venv


USER_MODEL = """import math

import torch


def mlp(input_shape, num_classes):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), num_classes))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["in-process", "simulation", "deployment"])
def test_the_installed_wheel_runs_the_main_job_with_the_users_model_from_their_folder(wheel_venv, tmp_path, mode):
    """As a user runs it: the wheel's `hybridfl run` (the main job's protocol, a few rounds) from a folder holding
    their own model factory (no Flower app there, no edit in hybridfl): every process imports the factory from
    that folder, and the run's outputs and Flower's home land under it. The folder is searched last: its own
    `yaml.py` and `common/` (names of an installed package and of hybridfl's own) shadow nothing."""
    where = subprocess.run([str(wheel_venv / "bin" / "python"), "-c",
                            "import hybridfl, server_app.presets as c; print(hybridfl.__file__); print(c.CONFIG_DIR)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(p).is_relative_to(wheel_venv) for p in where), where  # the wheel's code, not this checkout's
    hybridfl = str(wheel_venv / "bin" / "hybridfl")
    if mode == "in-process":  # the presets are the wheel's (listing them is the same in every mode)
        presets = subprocess.run([hybridfl, "presets"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert len(presets.stdout.splitlines()) == len(list((PROJECT_DIR / "configs").rglob("*.yaml")))
    (tmp_path / "mytask.py").write_text(USER_MODEL)
    shadow = "raise ImportError('the user folder shadowed an installed package')\n"
    (tmp_path / "yaml.py").write_text(shadow)
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "__init__.py").write_text(shadow)
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    env.pop("HYBRIDFL_USER_DIR", None)
    done = subprocess.run([hybridfl, "run", "feddle-digits", "model=mytask:mlp", "num-clients=2", "clients-per-round=2",
                           "buffer-size=2", "delay-sigma=0", "num-rounds=2", "run-name=mine", "--mode", mode],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "outputs" / "mine" / "summary.json").read_text())
    assert summary["config"]["preset"] == "feddle-digits" and summary["config"]["model"] == "mytask:mlp"
    assert summary["final-version"] == 2
    assert (tmp_path / ".flwr").is_dir() == (mode != "in-process")  # Flower's home in the folder it ran in
