"""device = "auto" on a machine with CUDA: every server-side computation that trains or searches (Feddle's
search, FedDF's distillation, Fed+FT/HFCL/Center training, the mixing variants' central steps) runs on the
GPU and agrees with the CPU run. Skipped without CUDA (the project's own machines have none)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridfl.engine.inprocess import run_inprocess

SERVER_SIDE = ["feddle", "feddf", "fedft", "hfcl", "center", "parallel-training", "example-transfer",
               "gradient-transfer"]
# Feddle's buffer (10 by default) would never fill from these 6 updates: one search per round instead
OPTIONS = {"feddle": {"buffer-size": 2}}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on the project's machines)")
@pytest.mark.parametrize("strategy", SERVER_SIDE)
def test_server_side_work_runs_on_cuda_and_agrees_with_the_cpu(tmp_path: Path, strategy: str) -> None:
    job = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 2, "num-rounds": 3, "local-epochs": 1,
           "batch-size": 16, "central-size": 40, "strategy": strategy, "output-dir": str(tmp_path),
           **OPTIONS.get(strategy, {})}
    cpu, gpu = (json.loads((run_inprocess({**job, "device": d, "run-name": d}) / "summary.json").read_text())
                for d in ("cpu", "auto"))
    assert " on cuda" in gpu["server-data"] and cpu["server-data"].endswith(" on cpu")
    assert gpu["final-version"] == cpu["final-version"] == 3
    assert abs(gpu["final-test-accuracy"] - cpu["final-test-accuracy"]) <= 0.05
