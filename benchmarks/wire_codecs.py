"""The wire's codecs side by side (issue 70, BENCHMARKS "Narrow links"): bytes per message on the wire, encode and
decode time on this CPU, the error each makes, and the seconds an update takes through a shaped 1 Mbit/s link.

    python -m benchmarks.wire_codecs [--preset feddle-fmnist/fedbuff-dir0.1-n20] [--client 0] [--repeats 20]
                                     [--link-mbit 1.0] [--no-link]

The model and the update are real: the preset's model (the papers' Fashion-MNIST CNN, 1.67 M parameters) and one
client's update from its local training on its own partition with the preset's recipe (lr 3e-3 x 5 epochs, the
headline's). Each codec encodes that update (``update-codec``) and the model (``model-codec``), and, for
``model-difference``, the move from the model to the model plus that update, as a device holding the first gets the
second (errors against the second model); bytes are what
Flower's transport pushes (every object of the record, deflated: ``flower_internals.wire.wire_bytes``), times are
medians over ``--repeats`` runs with one torch thread, and the link time is the update's serialised bytes pushed through
hybridfl's user-space link shaper (hybridfl/launch/shaper.py) at ``--link-mbit`` to a sink on loopback, until the sink
has them all. Ratios are against ``none``, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.runs import median_seconds
from common.codecs import UPDATE_CODECS, WireCodecs, apply_difference, decode, encode, encode_model
from common.config import part_of
from common.models import build_from_config
from common.params import ParamSpec
from common.splits import client_partition, data_spec, task_data
from common.training import LocalRecipe, train
from flower_internals.wire import wire_bytes
from hybridfl.launch.shaper import Link, Route, Shaper
from server_app.config import load_config

RECIPE = {"lr": 0.003, "local-epochs": 5}  # the headline's (BENCHMARKS "Headline")


def real_update(preset: str, client: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(the model's flat parameters at initialisation, one client's update from them, a description)."""
    cfg = load_config({"preset": preset, **RECIPE})
    spec = data_spec(cfg)
    full = task_data(spec)
    model = build_from_config(cfg.to_dict(), full.x.shape[1:], full.num_classes, seed=cfg.seed)
    params = ParamSpec.of(model)
    start = params.flatten(model)
    data = client_partition(spec, client)
    train(model, data, part_of(LocalRecipe, cfg), seed=cfg.seed)
    update = params.flatten(model) - start
    return start.numpy(), update.numpy(), (f"{preset}: {cfg.model} with {params.numel} trainable parameters; client "
                                           f"{client}'s update ({len(data)} examples, lr {cfg.lr} x "
                                           f"{cfg.local_epochs} epochs)")


def through_link(nbytes: int, mbit: float) -> float:
    """Seconds for `nbytes` pushed through the shaper at `mbit` Mbit/s up to a sink on loopback, until it has them."""
    sink = socket.create_server(("127.0.0.1", 0))
    got = threading.Event()

    def drain() -> None:
        conn, _ = sink.accept()
        with conn:
            left = nbytes
            while left > 0:
                left -= len(conn.recv(1 << 20)) or left
            got.set()

    threading.Thread(target=drain, daemon=True).start()
    rate = int(mbit * 1e6 / 8)
    with Shaper([Route(sink.getsockname()[1], Link(up_bytes_per_s=rate, down_bytes_per_s=rate))]) as shaper:
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", shaper.ports[0])) as conn:
            conn.sendall(b"\0" * nbytes)
            got.wait(10 * nbytes / rate + 30)
        elapsed = time.perf_counter() - started
    sink.close()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="feddle-fmnist/fedbuff-dir0.1-n20")
    parser.add_argument("--client", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--link-mbit", type=float, default=1.0)
    parser.add_argument("--no-link", action="store_true", help="skip the shaped link's timing (a minute for none)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/narrow-links/wire.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, update, what = real_update(args.preset, args.client)
    wire, n = WireCodecs(), update.size
    print(what)
    # (direction, the codec's label, its encoding, its decoding of a record: what the other end holds, the value
    # that stands for)
    cases = [(direction, c, lambda x=x, c=c: encode(x, c, wire)[0], lambda r, c=c: decode(r, c, n, wire), x)
             for direction, x, codecs in (("update", update, UPDATE_CODECS), ("model", model, ("none", "fp16", "int8")))
             for c in codecs]
    moved = model + update
    for c in ("int8", "topk", "topk16"):
        diff = WireCodecs(model_codec=c, model_difference=True)
        cases.append(("model", f"{c} difference", lambda d=diff: encode_model(moved, d, model),
                      lambda r, d=diff: apply_difference(model, r, d), moved))
    rows = []
    for direction, codec, encoding, decoding, x in cases:
        record = encoding()
        back, size = decoding(record), wire_bytes(record)
        row = {"direction": direction, "codec": codec, "bytes": size,
               "encode-ms": 1e3 * median_seconds(encoding, args.repeats),
               "decode-ms": 1e3 * median_seconds(lambda: decoding(record), args.repeats),
               "max-abs-error": float(np.abs(back - x).max()),
               "relative-l2-error": float(np.linalg.norm(back - x) / np.linalg.norm(x))}
        if direction == "update" and not args.no_link:
            row["link-s"] = through_link(size, args.link_mbit)
        rows.append(row)
    for direction in ("update", "model"):
        plain = next(r for r in rows if r["direction"] == direction and r["codec"] == "none")
        for r in rows:
            if r["direction"] == direction:
                r["bytes-ratio"] = r["bytes"] / plain["bytes"]
                r["fewer-bytes-x"] = plain["bytes"] / r["bytes"]
    header = (f"| direction | codec | bytes on the wire | ratio | fewer × | encode ms | decode ms | rel. L2 error "
              f"| max abs error |{' ' + str(args.link_mbit) + ' Mbit/s s |' if not args.no_link else ''}")
    print(header)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("" if args.no_link else "---:|"))
    for r in rows:
        link = f" {r['link-s']:.1f} |" if "link-s" in r else (" — |" if not args.no_link else "")
        print(f"| {r['direction']} | {r['codec']} | {r['bytes']:,} | {r['bytes-ratio']:.4f} | {r['fewer-bytes-x']:.1f} "
              f"| {r['encode-ms']:.1f} | {r['decode-ms']:.1f} | {r['relative-l2-error']:.2e} | "
              f"{r['max-abs-error']:.2e} |{link}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"what": what, "repeats": args.repeats, "link-mbit": args.link_mbit,
                                    "rows": rows}, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
