"""The sha256 of ``model.pt`` after a short in-process run of every preset: run it at two commits and compare, to
show a restructuring changed no result.

    python -m tools.model_digests > after.json                       # every preset (or name some), 3 rounds
    python -m tools.model_digests --compare before.json after.json   # exit 1 if a digest differs

A preset whose data this machine lacks (CelebA) is recorded as skipped, with why, and a run that fails (an
asynchronous preset whose first reply is due after these few rounds has learned nothing) as failed, with what it
said: neither is left out silently.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import tempfile
from pathlib import Path


def digests(presets: list[str], rounds: int) -> dict[str, str]:
    """{preset: sha256 of its model.pt, or "skipped: <why>" when its data cannot be loaded here}."""
    from common.datasets import DatasetNotFound
    from hybridfl.engine.inprocess import run_inprocess

    logging.getLogger("flwr").setLevel(logging.WARNING)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            try:
                run = run_inprocess({"preset": preset, "num-rounds": rounds, "eval-every": rounds,
                                     "output-dir": tmp, "run-name": preset.replace("/", "_")})
                out[preset] = hashlib.sha256((run / "model.pt").read_bytes()).hexdigest()
            except DatasetNotFound as err:  # data not on this machine
                out[preset] = f"skipped: {err}".splitlines()[0]
            except RuntimeError as err:  # the run failed (e.g. no update arrived in so few rounds): what it said
                out[preset] = f"failed: {err}".splitlines()[0]
            print(json.dumps({preset: out[preset]}), file=sys.stderr, flush=True)
    return out


def compare(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The presets whose digests differ, or that one side lacks."""
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    ap.add_argument("presets", nargs="*", help="default: every preset")
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        differ = compare(before, after)
        ran = [p for p, d in before.items() if p not in differ and not d.startswith("skipped")]
        print(f"{len(before) - len(differ)} presets alike ({len(ran)} with the same model.pt, the rest skipped on "
              f"both sides); {len(differ)} differ" + "".join(f"\n  {p}" for p in differ))
        return 1 if differ else 0
    import torch

    from server_app.presets import preset_names

    torch.set_num_threads(1)  # the digests of two commits compare only on the same threads
    print(json.dumps(digests(args.presets or preset_names(), args.rounds), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
