"""What a deployment costs while it waits: each process's CPU while the ServerApp waits for a slow device.

    python -m benchmarks.idle_deployment [--window-s 20] [--latency-s 60]

Runs FedAvg on digits, one round, on a local deployment of 2 SuperNodes (``hybridfl run --mode deployment``: TLS,
the warm devices), node 1 answering `--latency-s` late, twice side by side: with the ServerApp's pulls for replies
at a steady ``poll-interval-s`` (``poll-max-interval-s`` set to it: 20 pulls a second, as before it was paced) and
at its default pace (each pull that brings nothing doubles the wait, up to ``poll-max-interval-s``;
server_app/wire.py ``Pace``). Once node 0 has answered, it samples the CPU seconds of every process of the
deployment over `--window-s` seconds and prints each role's share of a core and the ratio of the two totals.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

ROLES = ("flower-superlink", "flwr-serverapp", "client_app.supernode", "client_app.warm_executor", "fork_server",
         "server_app.superexec", "flwr run", "hybridfl")
STEADY = "poll-max-interval-s=0.05"  # = poll-interval-s's default: a pull every 0.05 s


def role(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    return next((r for r in ROLES if r in cmd), "other")


def cpu_by_role(root: psutil.Process) -> Counter[str]:
    seconds: Counter[str] = Counter()
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            seconds[f"{proc.pid} {role(proc)}"] = t.user + t.system
        except psutil.Error:
            pass
    return seconds


def measure(extra: list[str], window_s: float, latency_s: float, workdir: Path) -> Counter[str]:
    """Each role's share of a core over `window_s`, while node 1 is `latency_s` late and node 0 has answered."""
    cmd = [sys.executable, "-m", "hybridfl.cli", "run", "fedavg-digits", "--mode", "deployment", "--supernodes", "2",
           "--latency", f"1={latency_s:g}", "--flwr-home", str(workdir / "home"), "num-rounds=1", "num-clients=2",
           "clients-per-round=2", f"output-dir={workdir / 'runs'}", *extra]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    log = workdir / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while "clients connected" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the deployment did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        time.sleep(5.0)  # node 0's message trained and answered; node 1's sleeps
        root = psutil.Process(proc.pid)
        before = cpu_by_role(root)
        time.sleep(window_s)
        after = cpu_by_role(root)
        if proc.poll() is not None:
            raise RuntimeError("the run ended inside the window: raise --latency-s")
        shares: Counter[str] = Counter()
        for key, seconds in after.items():
            shares[key.split(" ", 1)[1]] += (seconds - before.get(key, seconds)) / window_s
        return shares
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--latency-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    columns = {}
    with tempfile.TemporaryDirectory(prefix="idle-deployment-") as tmp:
        for folder, name, extra in (("steady", "steady 0.05 s", [STEADY]), ("paced", "paced (default)", [])):
            (Path(tmp) / folder).mkdir()
            columns[name] = measure(extra, args.window_s, args.latency_s, Path(tmp) / folder)
    roles = sorted({r for c in columns.values() for r in c}, key=lambda r: -max(c[r] for c in columns.values()))
    print(f"| process (share of a core over {args.window_s:g} s, waiting) | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for r in roles:
        print(f"| {r} | " + " | ".join(f"{100 * c[r]:.1f} %" for c in columns.values()) + " |")
    totals = [sum(c.values()) for c in columns.values()]
    print("| all | " + " | ".join(f"**{100 * t:.1f} %**" for t in totals) + " |")
    print(f"paced / steady: {totals[1] / totals[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
