"""A Flower ServerApp of the user's own that trains with a hybridfl strategy through ``FlowerStrategy``.

hybridfl's ServerApp is not used: this app builds its own model, evaluates on its own test split and calls
Flower's ``Strategy.start``; the clients run hybridfl's ClientApp, which needs the data spec, model and local
recipe in every message (``client_config``). ``clock="virtual"`` runs hybridfl's asynchronous runtime behind the
same call (seeded delays, FedBuff's buffer); leave it out for Flower's own round loop.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from common.models import build_from_config
from common.params import ParamSpec
from common.splits import data_spec, make_splits, task_data
from common.training import evaluate
from server_app.config import client_config, load_config
from server_app.flower import FlowerStrategy
from strategies import FedBuff

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = load_config({"preset": "tabular_task:presets/fedbuff"})
    spec = data_spec(cfg)
    full, test = task_data(spec), make_splits(spec).test
    model = build_from_config(cfg.to_dict(), full.x.shape[1:], full.num_classes, seed=cfg.seed)
    pspec = ParamSpec.of(model)

    def evaluate_fn(server_round: int, arrays) -> MetricRecord:
        pspec.load_into(model, pspec.from_record(arrays))
        return MetricRecord(evaluate(model, test))

    strategy = FlowerStrategy(FedBuff(buffer_size=3, server_lr=1.0), clients_per_round=cfg.clients_per_round,
                              seed=cfg.seed)
    result = strategy.start(grid, pspec.to_record(pspec.flatten(model)), num_rounds=cfg.num_rounds,
                            train_config=ConfigRecord(client_config(cfg)), evaluate_fn=evaluate_fn,
                            clock="virtual", delay_sigma=cfg.delay_sigma)
    last = max(result.evaluate_metrics_serverapp)
    context.state["result"] = MetricRecord({"accuracy": result.evaluate_metrics_serverapp[last]["accuracy"],
                                            "rounds": last})
