"""Where training runs: common/devices.py's rule, the server's `device` key and the clients' `device` node setting."""

from __future__ import annotations

import pytest
import torch

from client_app.app import app as client_app
from common.devices import resolve_device
from hybridfl.engine.inprocess import InProcessGrid
from tests.helpers import digest, rows

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


def test_auto_takes_an_accelerator_when_present_and_names_are_checked():
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device 'tpu': expected one of auto, cpu, cuda, mps"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the missing-device error cannot show")
def test_asking_for_cuda_without_one_says_so():
    with pytest.raises(RuntimeError, match="device 'cuda:0' asked for, but torch sees no CUDA device"):
        resolve_device("cuda:0")


def _grid(device: str | None) -> InProcessGrid:
    return InProcessGrid(client_app, 4, node_config={} if device is None else {"device": device})


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold", "fedem"])
def test_clients_on_the_cpu_setting_train_the_same_bytes_as_auto_here(small_run, strategy):
    """On this CPU-only machine ``device = cpu`` is what ``auto`` resolves to: the same final model, for plain
    training, a method with extra arrays (SCAFFOLD's control variates) and one with a mixture (FedEM)."""
    if torch.cuda.is_available():
        pytest.skip("auto is CUDA here: the two runs differ in floating point")
    auto, _ = small_run("auto", grid=_grid(None), strategy=strategy)
    cpu, _ = small_run("cpu", grid=_grid("cpu"), strategy=strategy)
    assert digest(auto / "model.pt") == digest(cpu / "model.pt")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the node's device is there")
def test_a_node_asking_for_a_missing_accelerator_fails_its_replies_with_the_reason(small_run, tmp_path):
    """Every node fails its replies saying why, and the run stops quoting it (max-failed-fraction)."""
    with pytest.raises(RuntimeError, match="the first: round 1, client 0: error reply .*device 'cuda' asked for, but "
                                           "torch sees no CUDA device"):
        small_run("missing", grid=_grid("cuda"), **{"num-rounds": 1})
    assert any("device 'cuda' asked for, but torch sees no CUDA device" in line
               for line in (tmp_path / "missing" / "events.jsonl").read_text().splitlines())


@CUDA
@pytest.mark.parametrize("strategy", ["fedavg", "scaffold", "fedem"])
def test_clients_train_on_cuda_and_send_cpu_tensors(small_run, strategy):
    out, summary = small_run("cuda", grid=_grid("cuda"), strategy=strategy)
    assert summary["total-accepted"] > 0 and summary["total-failures"] == 0
    assert rows(out)[-1]["test-accuracy"] > 0
