"""Memory that grows with what is in the air, not with the number of clients: the end-of-run evaluation sends
every client a model, in waves, so at most a wave of model-carrying messages exists at once."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from flwr.app import Message

from client_app.app import app as client_app
from server_app.config import load_config
from server_app.inprocess import InProcessGrid
from server_app.messaging import client_evaluate
from server_app.run import build_run


class CountingGrid(InProcessGrid):
    """Counts the messages pushed and not yet pulled, and the most of them at once."""

    def __init__(self, num_nodes: int) -> None:
        super().__init__(client_app, num_nodes)
        self.in_air = self.most = 0

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = list(super().push_messages(messages))
        self.in_air += len(ids)
        self.most = max(self.most, self.in_air)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(super().pull_messages(message_ids))
        self.in_air -= len(replies)
        return replies


def test_the_client_evaluation_keeps_at_most_a_wave_of_models_in_the_air(tmp_path: Path) -> None:
    cfg = load_config({"dataset": "synthetic", "num-clients": 7, "clients-per-round": 2, "num-rounds": 1,
                       "output-dir": str(tmp_path)})
    grid = CountingGrid(cfg.num_clients)
    r = build_run(grid, cfg)
    r.runner.directory.wait_for(cfg.num_clients, 10)
    results = {}
    for wave in (3, 100):
        grid.most = 0
        results[wave], asked = client_evaluate(grid, r.runner.directory, r.runner.dispatcher, r.strategy, 30.0, wave)
        assert asked == 7 and grid.in_air == 0
        assert grid.most == min(wave, 7)
    assert sorted(results[3]) == list(range(7))
    assert results[3] == results[100]  # the same metrics for every client, whatever the wave
