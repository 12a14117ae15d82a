"""A sweep's runs per hour at several lane counts on one machine (on a GPU machine: lanes sharing its GPU).

    python -m benchmarks.lanes [--lanes 1,4,8] [--ray-lanes 8] [--seconds 75] [--rounds 10] [--out F]

The sweep: ``--template`` (default the Feddle CNN table's protocol, Fashion-MNIST at Dir(0.1)/N(20)) for each of
``--methods`` (FedBuff, FedAsync, Feddle-ID, FedAvg) at more seeds than can finish, ``--rounds`` steps each,
evaluated at the end. For each lane count L, ``hybridfl sweep --jobs L`` runs on a fresh results file for
``--seconds`` and is then stopped (SIGTERM); with ``--ray-lanes N`` the same sweep runs with ``--ray`` on a
one-node Ray cluster of this machine (N CPUs and its GPUs), each run holding 1/N of a GPU (``--run-num-gpus``)
where there is one. A time box loses the runs in progress at its end, so a lane count is credited with every
server step its runs completed in the box (each run's ``metrics.jsonl``), finished or not: runs per hour =
steps × 3600 / (rounds × seconds). A run's start and its end-of-run evaluation take box time and no step, so they
are paid for. Also printed: the runs finished in the box, and the peak GPU memory in use (``nvidia-smi``) over
the lanes. Every line is printed as JSON and appended to ``--out`` as it is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from benchmarks.ray_sweep import cluster


def gpu_memory_mib() -> int:
    """GPU memory in use on this machine, MiB (0 without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(int(v) for v in out.split() if v.isdigit())


@contextlib.contextmanager
def peak_gpu_memory() -> Iterator[list[int]]:
    """Samples the GPU memory in use every second; the list's last item is the peak once the block ends."""
    samples, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            samples.append(max(samples[-1], gpu_memory_mib()))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join()


def steps_done(run_dir: Path) -> int:
    """Server steps completed by every run under `run_dir`, finished or not."""
    steps = 0
    for metrics in run_dir.rglob("metrics.jsonl"):
        steps += sum(1 for line in metrics.read_text().splitlines() if line and json.loads(line)["round"] > 0)
    return steps


def boxed_sweep(folder: Path, flags: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """`hybridfl sweep` with `flags` for `args.seconds`, then stopped: steps, finished runs, runs per hour."""
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "runs": [{"presets": args.template, "vars": {"method": args.methods.split(",")},
                  "seeds": list(range(args.seeds))}],
        "overrides": {"num-rounds": args.rounds, "eval-every": args.rounds, "checkpoint-every": 0},
        "results": str(folder / "runs.jsonl"), "run-dir": str(folder / "runs")}))
    log = (folder / "sweep.log").open("w")
    start = time.perf_counter()
    # `-m hybridfl.cli`, not the console script: a GPU lease runs the checkout from PYTHONPATH, not installed
    proc = subprocess.Popen([sys.executable, "-m", "hybridfl.cli", "sweep", str(spec), *flags],
                            cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    with peak_gpu_memory() as memory:
        try:
            proc.wait(timeout=args.seconds)
        except subprocess.TimeoutExpired:
            pass
        seconds = time.perf_counter() - start
        steps = steps_done(folder / "runs")
    finished = len((folder / "runs.jsonl").read_text().splitlines()) if (folder / "runs.jsonl").exists() else 0
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if proc.returncode not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
        tail = (folder / "sweep.log").read_text().splitlines()[-5:]
        raise SystemExit(f"the sweep {' '.join(flags)} failed (exit {proc.returncode}): {tail}")
    return {"seconds": round(seconds, 1), "steps": steps, "finished-runs": finished,
            "runs-per-hour": round(steps * 3600 / (args.rounds * seconds), 1), "peak-gpu-mib": memory[-1]}


def emit(line: dict[str, Any], out: Path | None) -> None:
    print(json.dumps(line), flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lanes", default="1,4,8", help="comma-separated --jobs counts")
    ap.add_argument("--ray-lanes", type=int, default=0, help="also: --ray on a one-node cluster of this many CPUs")
    ap.add_argument("--seconds", type=float, default=75.0, help="the time box of each lane count")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--template", default="feddle-fmnist/{method}-dir0.1-n20")
    ap.add_argument("--methods", default="fedbuff,fedasync,feddle-id,fedavg")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    base = None
    ways = [(f"--jobs {n}", int(n), ["--jobs", n]) for n in args.lanes.split(",") if n]
    if args.ray_lanes:
        ways.append((f"--ray, {args.ray_lanes} runs on one node", args.ray_lanes, None))
    for name, lanes, flags in ways:
        with tempfile.TemporaryDirectory() as tmp:
            if flags is None:
                gpus = torch.cuda.device_count()
                with cluster([args.ray_lanes], gpus=gpus) as address:
                    result = boxed_sweep(Path(tmp), ["--ray", address, "--run-num-cpus", "1", "--run-num-gpus",
                                                     str(round(1 / lanes, 4) if gpus else 0)], args)
            else:
                result = boxed_sweep(Path(tmp), flags, args)
        base = base or result["runs-per-hour"]
        emit({"kind": "lanes", "device": device, "way": name, "lanes": lanes, "template": args.template,
              "rounds": args.rounds, **result, "vs first": round(result["runs-per-hour"] / base, 2) if base else None,
              "gpu-mib-per-lane": round(result["peak-gpu-mib"] / lanes)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
