"""Model sizes, update payloads and local training speed on this machine's CPU.

    python -m benchmarks.models [--threads N] [--skip-224] [--steps 8]

Per model (10 classes, built with ``common.models.build_model``): total parameters, trainable
parameters (those that travel: :class:`common.params.ParamSpec`), bytes per update on the wire
(4 x trainable: one flat float32 array) and that payload as a percentage of the full model (all
parameters in float32), then local training throughput: ``common.training.train`` (SGD, momentum
0.9, batch 32, one epoch) on random data of the listed shape, in samples per second.
Timing: one untimed warm-up step (batch 32), then ``--steps`` timed steps (perf_counter around
``train`` on steps x 32 samples). The 224x224 models are slow on a CPU: they run 4 timed steps
(ResNet-18) and 2 (ViT-B/16), or none with ``--skip-224``.
``--threads`` sets ``torch.set_num_threads`` (default: torch's own choice). The data is 3x32x32
(or 1x28x28) and the model's input adapter resizes it to its input size, as in a real run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from common.models import build_model
from common.params import ParamSpec
from common.splits import ArrayDataset
from common.training import LocalRecipe, train

BATCH = 32
NUM_CLASSES = 10
# label, model name, data shape (C, H, W), build options, timed steps (None: --steps)
CASES = [
    ("cnn 1x28x28", "cnn", (1, 28, 28), {}, None),
    ("cnn 3x32x32", "cnn", (3, 32, 32), {}, None),
    ("resnet18 @32", "resnet18", (3, 32, 32), {"input_size": 32}, None),
    ("resnet18 @224", "resnet18", (3, 32, 32), {}, 4),
    ("vit-small LoRA @32", "vit-small", (3, 32, 32), {}, None),
    ("vit-b16 LoRA @224", "vit-b16", (3, 32, 32), {}, 2),
]


def random_data(shape: tuple[int, int, int], n: int, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    x = rng.random((n, *shape), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, n).astype(np.int64)
    return ArrayDataset(x, y, NUM_CLASSES)


def samples_per_second(model: torch.nn.Module, shape: tuple[int, int, int], steps: int) -> float:
    recipe = LocalRecipe(local_epochs=1, batch_size=BATCH, lr=0.01)
    train(model, random_data(shape, BATCH, seed=1), recipe, seed=0)  # warm-up
    data = random_data(shape, steps * BATCH)
    start = time.perf_counter()
    train(model, data, recipe, seed=0)
    return len(data) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps of batch 32 for the small models")
    parser.add_argument("--skip-224", action="store_true", help="do not time the 224x224 models")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {BATCH}, {NUM_CLASSES} classes")
    header = (f"{'model':<20} {'data':>8} {'input':>5} {'total params':>13} {'trainable':>11} "
              f"{'bytes/update':>13} {'% of model':>10} {'samples/s':>10} {'timed':>6}")
    print(header)
    print("-" * len(header))
    for label, name, shape, options, steps in CASES:
        model = build_model(name, shape[0], shape[1], NUM_CLASSES, seed=0, **options)
        total = sum(p.numel() for p in model.parameters())
        trainable = ParamSpec.of(model).numel
        steps = args.steps if steps is None else steps
        if args.skip_224 and model.adapt.size >= 224:
            steps = 0
        speed = f"{samples_per_second(model, shape, steps):10.1f}" if steps else f"{'skipped':>10}"
        data = "x".join(map(str, shape))
        print(f"{label:<20} {data:>8} {model.adapt.size:>5} {total:>13,} {trainable:>11,} {4 * trainable:>13,} "
              f"{100 * trainable / total:>9.2f}% {speed} {steps * BATCH:>6}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
