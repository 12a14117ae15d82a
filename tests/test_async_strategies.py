"""FedBuff, FedAsync and CA2FL against their papers' update rules, written out by hand."""

from __future__ import annotations

import pytest
import torch

from common.params import ParamSpec
from strategies import CA2FL, FedAsync, FedBuff
from strategies.base import Update, deliver

SPEC = ParamSpec(("w",), ((6,),))


def vec(seed: int) -> torch.Tensor:
    return torch.randn(6, generator=torch.Generator().manual_seed(seed))


def init(strategy, seed: int = 0):
    strategy.initialize(vec(seed), SPEC)
    return strategy


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("weighting", ["uniform", "examples"])
@pytest.mark.parametrize("staleness_weight", ["none", "polynomial"])
def test_fedbuff_step_after_k_updates(weighting, staleness_weight):
    s = init(FedBuff(buffer_size=3, server_lr=0.5, staleness_weight=staleness_weight, staleness_exponent=0.5,
                     weighting=weighting))
    s.version = 4
    omega = s.params.clone()
    updates = [Update(c, base, vec(10 + c), n) for c, base, n in [(0, 4, 10), (1, 2, 30), (2, 1, 60)]]
    for u in updates[:2]:
        s.receive(u)
        assert not s.ready()
    s.receive(updates[2])
    assert s.ready()
    b = [1 / 3] * 3 if weighting == "uniform" else [0.1, 0.3, 0.6]
    st = [1.0, 3 ** -0.5, 4 ** -0.5] if staleness_weight == "polynomial" else [1.0] * 3
    expected = omega + 0.5 * sum(bi * si * u.delta for bi, si, u in zip(b, st, updates))
    s.step()
    close(s.params, expected)
    assert s.version == 5 and not s.ready() and s.buffer == []


def test_fedasync_mixes_the_stale_client_model_with_polynomial_weight():
    s = init(FedAsync(mixing_alpha=0.6, staleness_exponent=0.5))
    omega0 = s.params.clone()
    sent7, sent8 = s.model_for(7), s.model_for(8)  # both start from version 0
    d8 = vec(8)
    s.receive(Update(8, 0, d8, 5, sent=sent8))
    s.step()
    omega1 = (1 - 0.6) * omega0 + 0.6 * (omega0 + d8)
    close(s.params, omega1)
    d7 = vec(7)
    s.receive(Update(7, 0, d7, 5, sent=sent7))  # staleness 1: α_t = 0.6 · 2^-0.5, ω_new = ω^0 + Δ (what it was sent)
    metrics = s.step()
    a = 0.6 * 2 ** -0.5
    close(s.params, (1 - a) * omega1 + a * (omega0 + d7))
    assert s.version == 2 and metrics["alpha-t"] == pytest.approx(a)


def test_an_update_without_its_payload_cannot_be_rebuilt():
    s = init(FedAsync())
    s.receive(Update(0, 0, vec(1), 1))
    with pytest.raises(ValueError, match="does not carry the payload"):
        s.step()
    assert s.version == 0


def test_ca2fl_calibrates_with_cached_updates():
    n_clients = 4
    s = init(CA2FL(num_clients=n_clients, buffer_size=2, server_lr=0.5))
    omega = s.params.clone()
    d = {k: vec(20 + k) for k in range(6)}
    # Step 1: clients 0 and 1, no cache yet: v = 0 + mean(Δ).
    s.receive(Update(0, 0, d[0], 1))
    s.receive(Update(1, 0, d[1], 1))
    assert s.ready()
    omega = omega + 0.5 * (d[0] + d[1]) / 2
    s.step()
    close(s.params, omega)
    # Step 2: client 0 again (cached d0) and client 2 (new): h̄ = (d0 + d1) / N.
    s.receive(Update(0, 1, d[3], 1))
    s.receive(Update(2, 1, d[4], 1))
    h_bar = (d[0] + d[1]) / n_clients
    omega = omega + 0.5 * (h_bar + ((d[3] - d[0]) + d[4]) / 2)
    s.step()
    close(s.params, omega)
    close(s.cache[0], d[3])
    close(s.cache_sum, d[3] + d[1] + d[4])


def test_state_dict_round_trip_keeps_the_global_model_and_version():
    s = init(FedBuff(buffer_size=1))
    s.receive(Update(0, 0, vec(3), 1))
    s.step()
    other = init(FedBuff(buffer_size=1), seed=9)
    other.load_state_dict(s.state_dict())
    assert other.version == 1 and torch.equal(other.params, s.params)
    s.params += 1  # a copy, not a shared tensor
    assert not torch.equal(other.params, s.params)


class _Recorder:
    """Ready at two pending updates, or at the round's close with any pending (FedBuff's rule, a Feddle search)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.pending, self.closed = 0, False

    def receive(self, update: Update) -> None:
        self.calls.append(f"receive {update.client}")
        self.pending += 1

    def ready(self) -> bool:
        return self.pending >= 2 or (self.closed and self.pending > 0)

    def step(self) -> None:
        self.calls.append("step")
        self.pending, self.closed = 0, False

    def close_round(self) -> None:
        self.calls.append("close")
        self.closed = True


def test_deliver_steps_whenever_ready_then_closes_the_round_and_steps_on_what_is_left():
    s = _Recorder()
    deliver(s, (Update(c, 0, vec(c), 1) for c in range(5)))
    assert s.calls == ["receive 0", "receive 1", "step", "receive 2", "receive 3", "step", "receive 4",
                       "close", "step"]
