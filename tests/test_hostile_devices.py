"""A registered device turned hostile: tools/rogue_device.py's bad replies, each in its own round, against the
ServerApp. Every row of its table in-process (seconds), and a row of each kind end to end: a real local deployment
(TLS, SuperNode authentication) where the rogue holds a registered key and speaks Flower's Fleet API itself."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from client_app.app import app as client_app
from hybridfl.engine.inprocess import run_inprocess
from hybridfl.launch.deploy_local import CONNECTION, deploy
from hybridfl.launch.flwr_cli import register_supernode
from hybridfl.launch.pki import node_key
from hybridfl.launch.processes import ProcessGroup, flower_env
from tools.rogue_device import BAD_EVALUATIONS, BAD_REPLIES, BadReply, bad_reply, hostile_content

REPO = Path(__file__).resolve().parent.parent
ROGUE = 2  # the partition the rogue claims (in deployment: SuperNode 2's, whose processes it replaces)
# Partitions 0 and 1 honest, 2 the rogue, every client in every round (virtual clock, synchronous): the rogue gets
# one train message per round. The run's defaults hold: no robust option is needed to refuse these rows (the
# well-formed huge updates are over max-update-ratio).
RUN = {"dataset": "digits", "partitioner": "iid", "num-clients": 3, "clients-per-round": 3, "local-epochs": 1,
       "cnn-width": 8, "max-failed-fraction": 1.0, "checkpoint-every": 0}
# One row of each kind for the deployment, where a round costs seconds: the num-examples that crashed the ServerApp
# (NaN, inf, a list, 1e300), a non-finite delta, bytes that are no numpy array, a forged partition, huge updates
E2E_ROWS = ("examples-nan", "examples-inf", "examples-list", "examples-1e300", "delta-nonfinite", "delta-not-numpy",
            "forged-partition", "delta-1e30", "delta-scaled-1e6")


def check_rogue_run(run_path: Path, sent: Sequence[BadReply]) -> None:
    """Each of `sent` (the rogue's replies, a round each from round 1) rejected and counted with a reason naming what
    was wrong (a well-formed huge update: over max-update-ratio); every honest update accepted, no step refused; the
    final model finite and well above chance."""
    events = [json.loads(line) for line in (run_path / "events.jsonl").read_text().splitlines()]
    rogue = sorted((e for e in events if e.get("client") == ROGUE), key=lambda e: e["round"])
    assert [e["round"] for e in rogue] == list(range(1, len(sent) + 1))
    for row, event in zip(sent, rogue):
        assert event["outcome"] == "rejected", (row.name, event)
        about = ("max-update-ratio",) if row.well_formed else row.about
        assert any(word in event["reason"] for word in about), (row.name, event["reason"])
    metrics = [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(m.get("rejected", 0) for m in metrics) == len(sent)
    assert sum(m.get("refused-steps", 0) for m in metrics) == 0
    honest = [e for e in events if e.get("client") in (0, 1)]
    assert len(honest) == 2 * len(sent) and all(e["outcome"] == "accepted" for e in honest)
    summary = json.loads((run_path / "summary.json").read_text())
    assert summary["final-version"] == len(sent)
    assert summary["final-test-accuracy"] > 0.8  # chance is 0.1: the honest nodes trained, the rogue steered nothing
    model = torch.load(run_path / "model.pt", map_location="cpu", weights_only=True)
    assert all(torch.isfinite(t).all() for t in model.values())


def rogue_client_app(replies: Sequence[BadReply] = (), evaluations: Sequence[BadReply] = ()) -> ClientApp:
    """hybridfl's ClientApp, except that partition :data:`ROGUE` answers its train and evaluate messages with
    `replies` and `evaluations` in turn (honestly once they run out)."""
    app, left = ClientApp(), {"train": list(replies), "evaluate": list(evaluations)}

    def handler(kind: str) -> Callable[[Message, Context], Message]:
        def handle(msg: Message, context: Context) -> Message:
            if context.node_config["partition-id"] != ROGUE or not left[kind]:
                return client_app(msg, context)
            return Message(hostile_content(msg, left[kind].pop(0), ROGUE), reply_to=msg)

        return handle

    app.train()(handler("train"))
    app.evaluate()(handler("evaluate"))
    app.query()(lambda msg, context: client_app(msg, context))
    return app


@pytest.mark.e2e
def test_every_hostile_reply_is_rejected_and_the_run_goes_on(tmp_path: Path) -> None:
    out = run_inprocess({**RUN, "num-rounds": len(BAD_REPLIES), "eval-every": len(BAD_REPLIES),
                         "output-dir": str(tmp_path), "run-name": "rogue"}, client_app=rogue_client_app(BAD_REPLIES))
    check_rogue_run(out, BAD_REPLIES)


@pytest.mark.e2e
def test_hostile_evaluations_are_left_out_and_the_run_goes_on(tmp_path: Path) -> None:
    """The rogue trains honestly but answers each evaluation with the next of :data:`BAD_EVALUATIONS`: the personal
    evaluations of rounds 0-2 (``client-test-fraction``) and the federated one at the end (its example-weighted mean,
    the last row's target) each leave it out; the run completes."""
    out = run_inprocess({**RUN, "num-rounds": 2, "client-test-fraction": 0.2, "output-dir": str(tmp_path),
                         "run-name": "rogue"}, client_app=rogue_client_app(evaluations=BAD_EVALUATIONS))
    personal = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines()]
    assert [p["clients"] for p in personal] == [[0, 1]] * (len(BAD_EVALUATIONS) - 1)
    client_eval = json.loads((out / "summary.json").read_text())["client-eval"]
    # counted, the last row's 2^53 examples at accuracy 0 would take the mean to ~1e-14; the honest nodes' is ~0.1
    assert client_eval["replies"] == 2 and client_eval["eval-accuracy"] > 0.05, client_eval


@pytest.mark.e2e
def test_a_registered_rogue_device_neither_crashes_nor_takes_over_a_deployed_run(tmp_path: Path) -> None:
    """The rogue (its own key, registered as the launcher registers its SuperNodes) replaces SuperNode 2 before the
    run starts and sends :data:`E2E_ROWS` over Flower's Fleet API: the run completes (``finished:completed``,
    summary.json), and each row is handled as in-process. It also pushes SuperNode 0 a train message as if from the
    SuperLink, naming ``shutil:rmtree`` as the data loader: that device refuses it, naming the key."""
    sent_log = tmp_path / "rogue-sent.jsonl"
    home = tmp_path / "flwr-home"
    logs: list[Path] = []

    def swap_in_the_rogue(procs: ProcessGroup, run_path: Path) -> None:
        procs.kill("superexec-clientapp-2")
        procs.kill("supernode-2")
        key = node_key(tmp_path, "rogue")
        register_supernode(flower_env(home), CONNECTION, Path(f"{key}.pub"))
        link = next(p for name, p in procs.procs if name == "superlink")
        port = link.args[link.args.index("--port") + 1]
        # the node to forge a message to, once it has said its id (it registered before it started: no wait for it)
        node_log, deadline = procs.log_dir / "supernode-0.log", time.monotonic() + 120
        while not (victim := re.search(r"SuperNode ID: (\d+)", node_log.read_text())) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert victim is not None, node_log.read_text()[-2000:]
        procs.start("rogue", [sys.executable, "-m", "tools.rogue_device", "--superlink", f"127.0.0.1:{port}",
                              "--root-certificates", str(home / "pki" / "ca.crt"), "--auth-key", str(key),
                              "--partition-id", str(ROGUE), "--num-partitions", "3", "--log", str(sent_log),
                              "--only", *E2E_ROWS, "--forge-to", victim[1]], cwd=REPO)
        logs.append(procs.log_dir)

    # two local epochs: the honest nodes' model is past 0.8 in these few rounds. The rogue stays until the final
    # evaluation shows its last train reply was taken (it answers that, badly); a missing answer would cost 120 s
    overrides: dict[str, Any] = {**RUN, "local-epochs": 2, "reply-timeout-s": 120.0,
                                 "num-rounds": len(E2E_ROWS), "eval-every": len(E2E_ROWS),
                                 "output-dir": str(tmp_path / "out"), "run-name": "rogue"}
    run_path, _ = deploy(overrides, home, on_started=swap_in_the_rogue,  # raises unless finished:completed
                         node_config=f'cache-dir="{tmp_path / "cache"}"')
    sent = [json.loads(line) for line in sent_log.read_text().splitlines()]
    assert [s["reply"] for s in sent if "reply" in s] == list(E2E_ROWS)
    assert [s["name"] for s in sent if "forged" in s] == ["shutil:rmtree"]
    check_rogue_run(run_path, [bad_reply(name) for name in E2E_ROWS])
    device = "".join(p.read_text() for p in [*logs[0].glob("*clientapp-0*.log"), *run_path.glob("flower-logs/*")]
                     if p.is_file())
    assert "train refused: config key 'dataset' = 'shutil:rmtree'" in device
