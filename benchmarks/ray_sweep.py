"""One sweep three ways, side by side on this machine: ``--jobs N`` processes, a Ray cluster of one node with N CPUs,
and a cluster of N nodes of one CPU each (``--ray``): runs per hour of each, and their ratios.

    python -m benchmarks.ray_sweep [--cpus 2] [--seeds 4] [--rounds 8]

The sweep: fedavg-digits at `seeds` seeds, `rounds` rounds each, one run per CPU at a time. The clusters are real
(``ray.cluster_utils.Cluster``, raylets at this machine's address: docs/tutorials/ray.md), started before the clock
starts and stopped by the PIDs they started. On one machine the clusters' nodes share its cores, so the ratios
measure what Ray's tasks cost against a process pool (scheduling, a task's start, its worker's import of torch),
not the gain of more machines.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import yaml


def sweep_seconds(folder: Path, flags: list[str], seeds: int, rounds: int) -> float:
    """Wall seconds of `hybridfl sweep` with `flags` on a fresh results file in `folder`."""
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump({"runs": [{"presets": "fedavg-digits", "seeds": list(range(seeds))}],
                                    "overrides": {"num-rounds": rounds, "eval-every": rounds},
                                    "results": str(folder / "runs.jsonl")}))
    start = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "hybridfl"), "sweep", str(spec), *flags], check=True,
                   capture_output=True, cwd=folder)
    return time.perf_counter() - start


@contextlib.contextmanager
def cluster(nodes: list[int], gpus: int = 0) -> Iterator[str]:
    """A real Ray cluster on this machine whose nodes have `nodes` CPUs each (the head `gpus` GPUs); its address."""
    import ray
    from ray.cluster_utils import Cluster

    here = ray.util.get_node_ip_address()
    started = Cluster(initialize_head=True, shutdown_at_exit=False,
                      head_node_args={"num_cpus": nodes[0], "num_gpus": gpus, "node_ip_address": here,
                                      "include_dashboard": False})
    try:
        for cpus in nodes[1:]:
            started.add_node(num_cpus=cpus, node_ip_address=here)
        started.wait_for_nodes()
        yield started.address
    finally:
        started.shutdown()


def on_cluster(nodes: list[int], folder: Path, seeds: int, rounds: int) -> float:
    """Seconds of the sweep on a cluster whose nodes have `nodes` CPUs each."""
    with cluster(nodes) as address:
        return sweep_seconds(folder, ["--ray", address], seeds, rounds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    ways = {f"--jobs {args.cpus} (processes)": lambda d: sweep_seconds(d, ["--jobs", str(args.cpus)], args.seeds,
                                                                        args.rounds),
            f"--ray, 1 node of {args.cpus} CPUs": lambda d: on_cluster([args.cpus], d, args.seeds, args.rounds),
            f"--ray, {args.cpus} nodes of 1 CPU": lambda d: on_cluster([1] * args.cpus, d, args.seeds, args.rounds)}
    seconds = {}
    for name, way in ways.items():
        with tempfile.TemporaryDirectory() as tmp:
            seconds[name] = way(Path(tmp))
    base = next(iter(seconds.values()))
    print(f"| {args.seeds} runs of fedavg-digits, {args.rounds} rounds | seconds | runs per hour | vs --jobs |")
    print("|---|---:|---:|---:|")
    for name, sec in seconds.items():
        print(f"| {name} | {sec:.1f} | {3600 * args.seeds / sec:.0f} | {base / sec:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
