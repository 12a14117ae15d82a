"""The sha256 of ``model.pt`` after a short in-process run of each preset: run at two commits and compare, to show a
restructuring changed no result (``python -m hybridfl.model_digests --rounds 3 > digests.json``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import tempfile

PRESETS = ("fedavg-digits", "fedbuff-digits", "feddle-digits", "fedmerge-digits", "feddual-digits", "scaffold-digits",
           "fedasync-digits", "ca2fl-digits", "fedmerge-fmnist/fedem-personal", "fedmerge-fmnist/ifca-personal",
           "fedmerge-fmnist/fedavg-plus-personal", "fedmerge-fmnist/local-personal", "mixing-fmnist/example-binary",
           "mixing-fmnist/gradient-binary", "feddual-fmnist/feddual-code", "feddle-animal/feddle-ood-dir0.1-n20",
           "feddle-animal/fedft-dir0.1-n20")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("presets", nargs="*", default=PRESETS)
    args = ap.parse_args(argv)
    import torch

    from hybridfl.inprocess import run_inprocess

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            out = run_inprocess({"preset": preset, "num-rounds": args.rounds, "eval-every": args.rounds,
                                 "output-dir": tmp, "run-name": preset.replace("/", "_")})
            digests[preset] = hashlib.sha256((out / "model.pt").read_bytes()).hexdigest()
            print(json.dumps({preset: digests[preset]}), flush=True)
    print(json.dumps(digests, indent=1))


if __name__ == "__main__":
    main()
