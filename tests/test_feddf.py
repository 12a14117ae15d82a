"""FedDF: FedAvg start, teachers rebuilt from the model each client was sent, distillation of the ensemble's
averaged logits on server inputs (ID and OOD), config wiring."""

from __future__ import annotations

import pytest
import torch
from helpers import stepped
from torch.nn import functional as F

from common.config import ConfigError
from common.models import build_model
from common.params import ParamSpec
from common.server_data import ServerData
from common.splits import ArrayDataset
from server_app.config import load_config
from strategies import STRATEGIES, FedAvg, FedDF, build_strategy
from strategies.base import Update
from strategies.feddf import distill_loss


def server(x: torch.Tensor, y: torch.Tensor, in_domain: bool = True) -> ServerData:
    return ServerData(ArrayDataset(x.numpy(), y.numpy(), int(y.max()) + 1), in_domain, torch.device("cpu"))


def setup(seed: int = 0, n: int = 48):
    model = build_model("cnn", 1, 8, 4, seed=seed)
    spec = ParamSpec.of(model)
    g = torch.Generator().manual_seed(seed)
    deltas = [0.05 * torch.randn(spec.numel, generator=g) for _ in range(3)]
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return model, spec, deltas, x, y


def feddf_with(model, spec, **kw) -> FedDF:
    """A FedDF at ω^0 = the model's seed-0 initialisation (tests load other weights into `model`)."""
    s = FedDF(**kw)
    s.initialize(spec.flatten(build_model("cnn", 1, 8, 4, seed=0)), spec, model)
    return s


def one_step(s: FedDF, deltas) -> None:
    sent = [s.model_for(i) for i in range(len(deltas))]
    for i, d in enumerate(deltas):
        s.receive(Update(i, s.version, d, 10 * (i + 1), sent=sent[i]))
    s.close_round()


def logits_at(model, spec, flat, x) -> torch.Tensor:
    spec.load_into(model, flat)
    model.eval()
    with torch.no_grad():
        return model(x)


def test_starts_from_fedavg_and_with_no_distillation_is_fedavg():
    model, spec, deltas, x, y = setup()
    omega0 = feddf_with(model, spec).params
    fedavg = FedAvg()
    fedavg.initialize(omega0, spec)
    for i, d in enumerate(deltas):
        fedavg.receive(Update(i, 0, d, 10 * (i + 1)))
    fedavg.close_round()
    fedavg.step()
    s = feddf_with(model, spec, server_train_lr=1e-12)  # a distillation that cannot move: FedAvg's model
    one_step(s, deltas)
    assert s.ready()
    metrics = stepped(s, server(x, y))
    torch.testing.assert_close(s.params, fedavg.params, rtol=0, atol=1e-6)
    assert s.version == 1 and metrics["teachers"] == 3


def test_without_server_data_it_fails_clearly_and_changes_nothing():
    model, spec, deltas, _, _ = setup()
    s = feddf_with(model, spec)
    one_step(s, deltas)
    before = s.params.clone()
    with pytest.raises(ConfigError, match="'central-size' = 0 .*strategy 'feddf'"):
        s.attach(None)
    assert s.version == 0 and torch.equal(s.params, before)


def test_stale_teacher_is_rebuilt_from_the_model_it_was_sent():
    model, spec, deltas, x, y = setup()
    s = feddf_with(model, spec)
    omega0 = s.params.clone()
    sent_to_straggler = s.model_for(0)  # the straggler starts from ω^0 ...
    one_step(s, deltas[1:2])  # ... but only one other client reports in step 0
    stepped(s, server(x, y))
    omega1 = s.params.clone()
    assert not torch.equal(omega1, omega0)
    teachers = []
    s.logits = lambda flat, xx: teachers.append(flat.clone()) or FedDF.logits(s, flat, xx)
    sent_fresh = s.model_for(2)
    s.receive(Update(0, 0, deltas[0], 10, sent=sent_to_straggler))  # stale: started from version 0
    s.receive(Update(2, 1, deltas[2], 10, sent=sent_fresh))  # fresh: started from version 1
    s.close_round()
    stepped(s, server(x, y))
    torch.testing.assert_close(teachers[0], omega0 + deltas[0], rtol=0, atol=0)
    torch.testing.assert_close(teachers[1], omega1 + deltas[2], rtol=0, atol=0)
    stale_wrong = logits_at(model, spec, omega1 + deltas[0], x)  # what ω^current + Δ would have given
    assert not torch.allclose(stale_wrong, logits_at(model, spec, omega0 + deltas[0], x), atol=1e-4)


def test_teacher_logits_are_the_models_outputs_in_the_inputs_order():
    model, spec, deltas, x, _ = setup(n=100)
    s = feddf_with(model, spec, distill_batch_size=16)
    flat = s.params + deltas[0]
    torch.testing.assert_close(s.logits(flat, x), logits_at(model, spec, flat, x), rtol=1e-5, atol=1e-6)


def test_distillation_lowers_the_kl_to_the_ensemble_and_is_deterministic():
    model, spec, deltas, x, y = setup()
    results = []
    for _ in range(2):
        s = feddf_with(model, spec, server_train_epochs=5, server_train_lr=3e-4, seed=3)
        omega0 = s.params.clone()
        one_step(s, deltas)
        m = stepped(s, server(x, y))
        out = s.params
        results.append(out)
        assert m["distill-loss-after"] < m["distill-loss-before"]
        target = (sum(logits_at(model, spec, omega0 + d, x) for d in deltas)) / 3
        kl = float(distill_loss(logits_at(model, spec, out, x), target, 1.0))
        assert abs(kl - m["distill-loss-after"]) < 1e-5
        assert out.device.type == "cpu" and out.shape == omega0.shape
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_out_of_domain_server_data_with_other_labels_and_shape():
    model, spec, deltas, _, _ = setup()
    g = torch.Generator().manual_seed(9)
    x_ood = torch.rand(40, 3, 12, 12, generator=g)  # 3 channels, 12x12: the CNN's adapter maps it to 1x8x8
    y_ood = torch.randint(0, 7, (40,), generator=g)  # its own 7 labels, never used
    s = feddf_with(model, spec, server_train_epochs=5, server_train_lr=3e-4, distill_temperature=2.0)
    one_step(s, deltas)
    m = stepped(s, server(x_ood, y_ood, in_domain=False))
    out = s.params
    assert torch.isfinite(out).all() and m["distill-loss-after"] < m["distill-loss-before"]
    assert logits_at(model, spec, out, x_ood).shape == (40, 4)  # the clients' label space


def test_from_config():
    cfg = load_config({"strategy": "feddf", "server-train-lr": 1e-4, "server-train-epochs": 10,
                       "distill-temperature": 3.0})
    s = build_strategy(cfg.strategy, cfg.options)
    assert STRATEGIES["feddf"] is FedDF and isinstance(s, FedDF)
    c = s.config
    options = (c.server_train_lr, c.server_train_epochs, c.distill_temperature, c.distill_batch_size)
    assert options == (1e-4, 10, 3.0, 64)
    assert s.describe()["server-train-epochs"] == 10


def test_distill_loss_is_kl_of_softened_distributions():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    p, q = F.softmax(t / 2, 1), F.softmax(s / 2, 1)
    by_hand = 4 * (p * (p.log() - q.log())).sum(1).mean()
    torch.testing.assert_close(distill_loss(s, t, 2.0), by_hand)
    assert float(distill_loss(t, t, 1.0)) < 1e-7
