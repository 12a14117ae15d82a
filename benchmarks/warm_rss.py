"""Memory of warm devices over many messages: the resident set of each long-lived process, sampled while they work.

    python -m benchmarks.warm_rss [--messages 1000] [--supernodes 2] [--out outputs/warm-rss.jsonl]

A local deployment (hybridfl/launch/deploy_local.py, ``--executor warm``) runs FedBuff on digits on the wall clock, one
local epoch on a tenth of each node's data per update (the messages, not the training, are measured), until
`messages` updates have arrived. Every 2 s it records the RSS (``VmRSS``) of each node's
long-lived processes: the SuperNode (client_app/supernode.py), the warm executor and its fork server
(client_app/warm_executor.py); the children forked per message exit with their message and are not counted. Printed:
each process's RSS after the first 10 % of the messages and at the end, and the largest. A leak shows as growth
with the message count; a bounded process levels off after its first messages.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

from hybridfl.launch.deploy_local import deploy
from hybridfl.launch.processes import children


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def long_lived(procs) -> dict[str, int]:
    """{role-i: pid} of each node's SuperNode, executor and fork server (the executor's own child)."""
    found: dict[str, int] = {}
    for name, proc in procs.procs:
        if name.startswith("supernode-"):
            found[name] = proc.pid
        elif name.startswith("superexec-clientapp-"):
            found[name] = proc.pid
            for pid in children({proc.pid}):
                found[name.replace("superexec-clientapp", "fork-server")] = pid
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--supernodes", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("outputs/warm-rss.jsonl"))
    args = parser.parse_args(argv)
    n = args.supernodes
    samples: list[dict] = []
    stop = threading.Event()

    def sample(procs, run: Path) -> None:
        def loop() -> None:
            while not stop.wait(2.0):
                events = run / "events.jsonl"
                done = len(events.read_text().splitlines()) if events.exists() else 0
                rss = {role: rss_mib(pid) for role, pid in long_lived(procs).items()}
                samples.append({"t": time.monotonic(), "messages": done, **{k: v for k, v in rss.items() if v}})

        threading.Thread(target=loop, daemon=True).start()

    with tempfile.TemporaryDirectory() as tmp:
        job = {"preset": "fedavg-digits", "strategy": "fedbuff", "clock": "wall", "concurrency": n, "buffer-size": n,
               "num-clients": n, "clients-per-round": n, "num-rounds": -(-args.messages // n), "local-epochs": 1,
               "data-fraction": 0.1,
               "eval-every": 1000000, "output-dir": str(Path(tmp) / "out"), "run-name": "rss"}
        deploy(job, Path(tmp) / "home", executor="warm", on_started=sample)
        stop.set()
    samples = [s for s in samples if len(s) > 2]  # the ones taken while the processes ran
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(s) + "\n" for s in samples))
    roles = sorted({k for s in samples for k in s} - {"t", "messages"})
    early = args.messages // 10
    print(f"RSS (MiB) of warm devices' long-lived processes over {samples[-1]['messages']} messages "
          f"({len(samples)} samples, {args.out}): after {early} messages, at the last sample, the largest")
    for role in roles:
        seen = [(s["messages"], s[role]) for s in samples if role in s]
        first = next((v for m, v in seen if m >= early), seen[0][1])
        print(f"{role:<24} {first:>8.1f} {seen[-1][1]:>8.1f} (at {seen[-1][0]}) {max(v for _, v in seen):>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
