"""The example's own method, tested as its author would: FedAvgM's step against Hsu et al.'s Alg. 1, and a run of it
in which its client side clips every update."""

from __future__ import annotations

import json

import pytest
import torch

from hybridfl.engine.inprocess import run_inprocess
from strategies.base import Payload, Update, deliver
from tabular_task.fedavgm import FedAvgM


def _update(client: int, delta: list[float], n: int, sent: torch.Tensor) -> Update:
    return Update(client, 0, torch.tensor(delta), n, sent=Payload(sent))


def test_the_step_is_fedavg_with_server_momentum():
    beta = 0.5
    s = FedAvgM(server_momentum=beta, clip_norm=1.0)
    w0 = torch.zeros(2)
    s.initialize(w0, spec=None)
    assert s.client_options() == {"clip-norm": 1.0}  # what every message tells the clients to clip to
    deliver(s, [_update(0, [1.0, 0.0], 1, w0), _update(1, [0.0, 3.0], 3, w0)])
    mean1 = torch.tensor([0.25, 2.25])  # Δ̄, weighted by examples
    torch.testing.assert_close(s.params, w0 + mean1)  # v1 = Δ̄1
    w1 = s.params.clone()
    deliver(s, [_update(2, [2.0, 2.0], 1, w1)])
    v2 = beta * mean1 + torch.tensor([2.0, 2.0])
    torch.testing.assert_close(s.params, w1 + v2)
    assert s.version == 2
    restored = FedAvgM(server_momentum=beta)
    restored.initialize(w0, spec=None)
    restored.load_state_dict(s.state_dict())  # the momentum is state: a resumed run keeps it
    torch.testing.assert_close(restored.momentum, v2)


def test_a_run_clips_every_update_on_the_clients(tmp_path):
    """Each step's Δ̄ is a mean of updates of norm ≤ C, so ‖v‖ ≤ C / (1 − β) at every step; the clients' own
    reported norms show the clipping was needed."""
    clip, beta = 0.02, 0.5
    out = run_inprocess({"preset": "tabular_task:presets/fedavgm", "clip-norm": clip, "server-momentum": beta,
                         "num-rounds": 6, "output-dir": str(tmp_path), "run-name": "clipped"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "momentum-norm" in r]
    assert len(steps) == 6
    assert all(r["momentum-norm"] <= clip / (1 - beta) + 1e-6 for r in steps)
    assert all(r["train-delta-norm"] > clip for r in steps)  # the ClippingClient ran, and had to clip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == {"strategy": "tabular_task.fedavgm:FedAvgM", "server-momentum": beta,
                                   "clip-norm": clip}
    assert summary["total-failures"] == 0


def test_its_keys_are_checked_like_hybridfls_own():
    from common.errors import ConfigError
    from server_app.config import load_config

    with pytest.raises(ConfigError, match=r"'server-momentum' = 1.5.*\[0, 1\]"):
        load_config({"preset": "tabular_task:presets/fedavgm", "server-momentum": 1.5})
    with pytest.raises(ConfigError, match=r"'buffer-size'.*an option of .*fedbuff.*not of strategy "
                                          r"'tabular_task.fedavgm:FedAvgM'"):
        load_config({"preset": "tabular_task:presets/fedavgm", "buffer-size": 3})
    with pytest.raises(ConfigError, match=r"'clip-norm' = 1.*a known key"):  # not an option of a built-in
        load_config({"preset": "tabular_task:presets/fedavg", "clip-norm": 1.0})
