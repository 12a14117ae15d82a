"""What checkpoints cost: the same in-process run with a checkpoint every step and with none, side by side.

    python -m benchmarks.checkpoint_cost [--preset feddle-digits] [--rounds 20] [--repeats 3]

Both paths run the preset for ``--rounds`` steps through the in-process engine, alternating
(with, without, without, with, ...) after an untimed warm-up of each. It prints the median wall time
of each, their ratio, the size of ``checkpoint.pt`` and the median seconds one write takes (timed
around ``write_checkpoint`` in the run with checkpoints), and checks that both end with the same model
bytes (a checkpoint must not change the run).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hybridfl.engine.inprocess import run_inprocess
from server_app import run as run_module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="feddle-digits")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    writes: list[float] = []
    original = run_module.write_checkpoint

    def timed_write(folder: Path, state: dict) -> Path:
        started = time.perf_counter()
        path = original(folder, state)
        writes.append(time.perf_counter() - started)
        return path

    run_module.write_checkpoint = timed_write
    with tempfile.TemporaryDirectory() as tmp:
        def one(every: int, name: str) -> tuple[float, Path]:
            started = time.perf_counter()
            out = run_inprocess({"preset": args.preset, "num-rounds": args.rounds, "checkpoint-every": every,
                                 "output-dir": tmp, "run-name": name})
            return time.perf_counter() - started, out

        one(1, "warm-with"), one(0, "warm-without")
        seconds: dict[int, list[float]] = {1: [], 0: []}
        digests: set[str] = set()
        for i in range(args.repeats):
            for every in (1, 0) if i % 2 == 0 else (0, 1):
                took, out = one(every, f"{every}-{i}")
                seconds[every].append(took)
                digests.add(hashlib.sha256((out / "model.pt").read_bytes()).hexdigest())
        size = (Path(tmp) / f"1-{args.repeats - 1}" / "checkpoint.pt").stat().st_size
    with_, without = statistics.median(seconds[1]), statistics.median(seconds[0])
    print(f"{args.preset}, {args.rounds} steps, {args.repeats} repeats: with a checkpoint every step {with_:.2f} s, "
          f"without {without:.2f} s (medians) -> ratio {with_ / without:.3f}; checkpoint.pt {size / 1e6:.2f} MB, "
          f"one write {statistics.median(writes) * 1000:.1f} ms (median of {len(writes)}); "
          f"{'same' if len(digests) == 1 else 'DIFFERENT'} final model bytes")
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
