"""The project's install, pip against uv: seconds and CPU to a venv that imports, side by side in one run.

    python -m benchmarks.install_time [--out outputs/install-time.jsonl]

Each install goes into a new venv from this checkout, as the Makefile's does (``-e '.[test]'`` with bytecode
compiled: processes here run with PYTHONDONTWRITEBYTECODE, so a package left uncompiled is compiled by every process
that imports it): pip with its cache as this machine has it; uv with an empty cache of its own (every wheel
downloaded, what a fresh machine and CI pay), then uv again on that cache (a user's second venv). After each, the
venv must import torch and flwr, and its `pip freeze` must equal pip's: the same packages at the same versions.
The venvs and uv's cache are removed as it goes (about 7 GB each; uv links its venv's files to its cache). Printed:
wall and CPU seconds of each (its processes' and their children's), and pip's over each.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridfl.launch.bundle import PROJECT_DIR

UV = "uv==0.13.9"  # the version measured in BENCHMARKS


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run `argv` in the checkout; its wall seconds and the CPU seconds of it and its children."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    subprocess.run(argv, cwd=PROJECT_DIR, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def freeze(venv: Path) -> list[str]:
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-c", "import torch, flwr"], check=True)
    done = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True,
                          check=True)
    return sorted(line for line in done.stdout.splitlines() if not line.startswith("uv=="))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/install-time.jsonl"))
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="hybridfl-install-"))
    env = {**os.environ, "UV_CACHE_DIR": str(root / "uv-cache")}
    tools = root / "tools"  # uv itself, outside the venvs measured
    installs = {
        "pip": lambda py: [py, "-m", "pip", "install", "--quiet", "-e", ".[test]"],
        "uv, empty cache": lambda py: [str(tools / "bin" / "uv"), "pip", "install", "--quiet", "--python", py,
                                       "--compile-bytecode", "-e", ".[test]"],
    }
    installs["uv, its cache"] = installs["uv, empty cache"]
    rows, reference = [], None
    try:
        subprocess.run([sys.executable, "-m", "venv", str(tools)], check=True)
        subprocess.run([str(tools / "bin" / "pip"), "install", "--quiet", UV], check=True)
        for name, command in installs.items():
            venv = root / "venv"
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            wall, cpu = timed(command(str(venv / "bin" / "python")), env)
            packages = freeze(venv)
            reference = reference or packages
            if packages != reference:
                extra = sorted(set(packages) ^ set(reference))
                raise SystemExit(f"{name} installed other packages than pip: {extra}")
            rows.append({"install": name, "wall-s": round(wall, 1), "cpu-s": round(cpu, 1),
                         "packages": len(packages)})
            shutil.rmtree(venv)
    except subprocess.CalledProcessError as err:
        raise SystemExit(f"install_time: {' '.join(map(str, err.cmd))} exited {err.returncode}") from None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    pip = rows[0]
    print(f"{'install':<16} {'wall s':>7} {'cpu s':>7} {'pip / this (wall)':>18}")
    for row in rows:
        ratio = pip["wall-s"] / row["wall-s"]
        print(f"{row['install']:<16} {row['wall-s']:>7.1f} {row['cpu-s']:>7.1f} {ratio:>17.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "cores": os.cpu_count(), "rows": rows}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
