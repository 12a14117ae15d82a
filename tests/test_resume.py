"""Checkpoints and resume beyond the contract battery: what a resumed run keeps and what it may change,
unusable checkpoints, extending a finished run, the wall clock's re-dispatch, Flower's loop, and a real SIGKILL."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import Crash, crashing, digest, rows

from client_app.app import app as client_app
from common.config import ConfigError
from hybridfl.engine.inprocess import InProcessGrid, run_inprocess
from hybridfl.launch.bundle import PROJECT_DIR
from server_app.checkpoint import CHECKPOINT, pack_state, read_checkpoint, unpack_state, write_checkpoint
from server_app.config import MAY_CHANGE_ON_RESUME, load_config

JOB = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 2, "num-rounds": 6, "local-epochs": 1,
       "batch-size": 16, "strategy": "fedbuff", "buffer-size": 2, "delay-sigma": 1.5, "checkpoint-every": 2}


def job(tmp_path, name: str, **kw) -> dict:
    """JOB in folder `name` with `kw`; FedBuff's buffer-size only while the strategy is FedBuff's."""
    base = {k: v for k, v in JOB.items() if k != "buffer-size" or kw.get("strategy", "fedbuff") == "fedbuff"}
    return {**base, "output-dir": str(tmp_path), "run-name": name, **kw}


def test_resume_keeps_the_configuration_and_names_every_key_that_differs(tmp_path):
    out = run_inprocess(job(tmp_path, "a"))
    written = json.loads((out / "summary.json").read_text())["config"]
    cfg = load_config({"resume": str(out), "num-rounds": 9, "eval-every": 3})
    assert (cfg.num_rounds, cfg.eval_every, cfg.resume) == (9, 3, str(out))
    keep = lambda d: {k: v for k, v in d.items() if k not in MAY_CHANGE_ON_RESUME}
    assert keep(cfg.to_dict()) == keep(written)
    with pytest.raises(ConfigError) as info:
        load_config({"resume": str(out), "model": "vit-small", "lr": 0.5, "buffer-size": 2})
    msg = str(info.value)
    assert "'model' = 'vit-small' here but 'cnn' in its checkpoint" in msg and "'lr' = 0.5 here but 0.05" in msg
    assert "buffer-size" not in msg  # given, but equal to the checkpoint's
    with pytest.raises(ConfigError, match="'preset' = 'fedbuff-digits' here but 'fedavg-digits'"):
        load_config({"resume": str(out), "preset": "fedbuff-digits"})


def test_unusable_checkpoints_fail_at_start_with_the_reason(tmp_path):
    out = run_inprocess(job(tmp_path, "a", **{"num-rounds": 2}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no checkpoint.pt"):
        load_config({"resume": str(tmp_path / "empty")})
    good = (out / CHECKPOINT).read_bytes()
    (out / CHECKPOINT).write_bytes(good[: len(good) // 2])
    with pytest.raises(ConfigError, match="unreadable, corrupt or truncated"):
        run_inprocess({"resume": str(out)})
    (out / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="unreadable, corrupt or truncated"):
        run_inprocess({"resume": str(out)})
    state = torch.load(__import__("io").BytesIO(good), weights_only=False)
    state["layout"]["shapes"][0] = [1, 2, 3]  # a checkpoint of another model under this configuration
    torch.save(state, out / CHECKPOINT)
    with pytest.raises(ConfigError, match="its model differs from this run's"):
        run_inprocess({"resume": str(out)})
    torch.save({"format": 99}, out / CHECKPOINT)
    with pytest.raises(ConfigError, match="not a hybridfl checkpoint of format 3 \\(found format 99\\)"):
        load_config({"resume": str(out)})



class Gadget:
    """What a crafted checkpoint holds: unpickling it calls `call` (here: creates the file `marker`)."""

    def __init__(self, call: str, marker: Path) -> None:
        self.call, self.marker = call, marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",)) if self.call == "system" else \
            (eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize("call", ["system", "eval"])
@pytest.mark.parametrize("where", ["runner", "strategy"])
def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path, call, where):
    """A gadget in the checkpoint itself, or in the strategy's state nested in it (loaded with the strategy's declared
    types): refused by name before it runs."""
    out = run_inprocess(job(tmp_path, "a", **{"num-rounds": 2}))
    state, marker = read_checkpoint(out), tmp_path / "ran"
    if where == "runner":
        state["runner"]["extra"] = Gadget(call, marker)
    else:
        inner = torch.load(io.BytesIO(state["strategy"]), weights_only=False)
        state["strategy"] = pickled({**inner, "extra": Gadget(call, marker)})
    write_checkpoint(out, state)
    starts = [lambda: run_inprocess({"resume": str(out)})]
    if where == "runner":  # the configuration is read from the checkpoint's outer level alone
        starts.append(lambda: load_config({"resume": str(out)}))
    for start in starts:
        with pytest.raises(ConfigError, match=f"would load '([a-z]+\\.)?{call}', which no hybridfl checkpoint holds: "
                                              "refused without running anything") as info:
            start()
        assert info.value.key == "resume" and not marker.exists()
    loaded = torch.load(out / CHECKPOINT, weights_only=False)  # the gadget is live: loaded as a pickle, it runs
    if where == "strategy":
        torch.load(io.BytesIO(loaded["strategy"]), weights_only=False)
    assert marker.exists()


def pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


USER_METHOD = """from collections import deque
from dataclasses import dataclass

import numpy as np

from strategies.fedavg import FedAvg


@dataclass
class Tally:
    steps: int = 0


class Keeps(FedAvg):
    \"\"\"A user's method whose state holds a deque, a numpy array and a dataclass of its own.\"\"\"

    def initialize(self, params, spec, model=None):
        super().initialize(params, spec, model)
        self.recent, self.norms, self.tally = deque(maxlen=3), np.zeros(2), Tally()

    def step(self):
        metrics = super().step()
        self.recent.append(self.version)
        self.norms = self.norms + float(self.params.norm())
        self.tally.steps += 1
        return metrics


class Declares(Keeps):
    # the same state, made checkpointable: its own class and numpy's arrays declared (rebuilt by name), the deque
    # (which torch's weights-only loader cannot rebuild) saved as a list
    checkpoint_types = (Tally, np.ndarray, np.dtype, type(np.dtype(np.float64)), np._core.multiarray._reconstruct)

    def state_dict(self):
        return {**super().state_dict(), "recent": list(self.recent)}

    def load_state_dict(self, state):
        super().load_state_dict({**state, "recent": deque(state["recent"], maxlen=3)})
"""


def test_a_users_state_that_a_checkpoint_cannot_load_is_refused_at_start_naming_the_field(tmp_path, monkeypatch):
    """Refused when first saved (at the start), naming the field and its type, not at the resume; declared in
    ``checkpoint_types``, the same state resumes to the uninterrupted run's model and state."""
    (tmp_path / "mymethod.py").write_text(USER_METHOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match=r"Keeps's state cannot round-trip through a checkpoint: its field 'recent' "
                                        r"\(collections.deque\) holds collections.deque, which a checkpoint loads "
                                        "only if checkpoint_types declares it; declare the class in "
                                        "Keeps.checkpoint_types"):
        run_inprocess(job(tmp_path, "refused", strategy="mymethod:Keeps"))
    assert not (tmp_path / "refused").exists()  # refused at the start: no run folder
    short = run_inprocess(job(tmp_path, "short", strategy="mymethod:Declares", **{"num-rounds": 3}))
    extended = run_inprocess({"resume": str(short), "num-rounds": 6})
    whole = run_inprocess(job(tmp_path, "whole", strategy="mymethod:Declares"))
    assert digest(extended / "model.pt") == digest(whole / "model.pt")
    from mymethod import Declares, Tally

    kept = [unpack_state(read_checkpoint(out)["strategy"], Declares, out) for out in (extended, whole)]
    seen = [(s["recent"], s["tally"], s["norms"].tolist()) for s in kept]
    steps = json.loads((whole / "summary.json").read_text())["final-version"]  # FedAvg: a version per step
    assert seen[0] == seen[1] and seen[0][:2] == (list(range(steps - 2, steps + 1)), Tally(steps)) and steps >= 3


def test_a_deque_in_the_state_is_named_as_what_the_loader_cannot_rebuild() -> None:
    from collections import deque

    from strategies.fedavg import FedAvg

    with pytest.raises(TypeError, match=r"its field 'recent' \(collections.deque\) does not load back under torch's "
                                        r"weights-only loader .*Can only append to lists"):
        pack_state({"params": torch.zeros(2), "recent": deque([1, 2])}, type("WithDeque", (FedAvg,), {
            "checkpoint_types": (deque,)}))


def test_truncated_and_foreign_checkpoints_are_refused_saying_what_they_are(tmp_path):
    out = run_inprocess(job(tmp_path, "a", **{"num-rounds": 2}))
    good = (out / CHECKPOINT).read_bytes()
    cut, foreign = "unreadable, corrupt or truncated", r"not a hybridfl checkpoint of format 3 \(found a "
    files = [(good[:-1], cut), (good[:200], cut), (b"", cut),
             ((out / "model.pt").read_bytes(), foreign + "dict without a format tag"), ([1, 2], foreign + r"list\)")]
    for content, why in files:
        if isinstance(content, bytes):
            (out / CHECKPOINT).write_bytes(content)
        else:
            torch.save(content, out / CHECKPOINT)
        with pytest.raises(ConfigError, match=why) as info:
            load_config({"resume": str(out)})
        assert info.value.key == "resume"
    (out / CHECKPOINT).write_bytes(good)  # the file it was: resumable
    assert load_config({"resume": str(out)}).resume == str(out)


def test_a_finished_run_extended_equals_the_longer_run(tmp_path):
    short = run_inprocess(job(tmp_path, "short", **{"num-rounds": 4}))
    longer = run_inprocess(job(tmp_path, "long", **{"num-rounds": 7}))
    extended = run_inprocess({"resume": str(short), "num-rounds": 7})
    assert digest(extended / "model.pt") == digest(longer / "model.pt")
    # The rows of step 4 differ only because the short run evaluated there as its last step.
    assert [r for r in rows(extended) if r["round"] != 4] == [r for r in rows(longer) if r["round"] != 4]


def test_wall_clock_resume_sends_again_what_was_in_flight(tmp_path):
    wall = job(tmp_path, "wall", clock="wall", concurrency=3, **{"delay-sigma": 0.0, "num-rounds": 5})
    with pytest.raises(Crash):
        run_inprocess(wall, client_app=crashing(3, tmp_path / "wall"))  # killed in step 3
    checkpoint = read_checkpoint(tmp_path / "wall")
    in_flight = {(f["client"], f["version"]) for f in checkpoint["runner"]["flights"]}
    assert len(in_flight) == 3  # concurrency: three clients were busy when step 2's checkpoint was written
    kept = checkpoint["recorder"]["events"]
    assert len(rows(tmp_path / "wall", "events.jsonl")) > kept  # the killed run got further than its checkpoint
    out = run_inprocess({"resume": str(tmp_path / "wall")})
    first_back = {(e["client"], e["base-version"]) for e in rows(out, "events.jsonl")[kept:kept + 3]}
    assert first_back == in_flight
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in rows(out)] == [0, 1, 2, 3, 4, 5] and summary["total-accepted"] >= 10


def test_a_resumed_run_goes_on_without_a_device_gone_for_good_and_counts_its_lost_update(tmp_path):
    """A new run waits for every device; a resumed one, after ``wait-nodes-s``, goes on with those that came back
    (a running one does too); the update that was in flight to the device that is gone is counted, not sent."""
    wall = job(tmp_path, "wall", clock="wall", concurrency=3, **{"delay-sigma": 0.0, "num-rounds": 5})
    with pytest.raises(Crash):
        run_inprocess(wall, client_app=crashing(3, tmp_path / "wall"))
    checkpoint = read_checkpoint(tmp_path / "wall")
    busy, kept = sorted(f["client"] for f in checkpoint["runner"]["flights"]), checkpoint["recorder"]["events"]
    lost = busy[0]

    def fleet() -> InProcessGrid:  # every partition's device but `lost`'s
        grid = InProcessGrid(client_app, JOB["num-clients"])
        grid.disconnect(next(n for n, c in grid.contexts.items() if c.node_config["partition-id"] == lost))
        return grid

    with pytest.raises(RuntimeError, match=r"only 3 of 4 clients connected within 1s"):
        run_inprocess(job(tmp_path, "new", **{"wait-nodes-s": 1.0}), grid=fleet())
    out = run_inprocess({"resume": str(tmp_path / "wall"), "wait-nodes-s": 1.0}, grid=fleet())
    summary = json.loads((out / "summary.json").read_text())
    after = rows(out, "events.jsonl")[kept:]
    assert summary["lost-at-resume"] == [lost] and lost not in {e["client"] for e in after}
    assert {e["client"] for e in after[:2]} == set(busy[1:])  # the others' flights sent again first
    assert [r["round"] for r in rows(out)][-1] == 5 and all(e["outcome"] == "accepted" for e in after)


def test_a_topk_run_resumes_identically_with_its_devices_residuals(tmp_path, caplog):
    """topk's residuals are the in-process nodes' states: the checkpoint keeps them (each node's latest file,
    <run>/nodes/), so the resumed run is the uninterrupted one, no device's residual lost; a node whose file is gone
    starts afresh, named in a warning, and says it lost its residual. (Models as differences resume as documented
    instead: the server's copies of the devices' models are not in the checkpoint, so each device gets a whole model
    first.)"""
    codec = {"update-codec": "topk", "topk-fraction": 0.05}
    whole = run_inprocess(job(tmp_path, "whole", **codec))
    with pytest.raises(Crash):
        run_inprocess(job(tmp_path, "killed", **codec), client_app=crashing(5, tmp_path / "killed"))
    named = read_checkpoint(tmp_path / "killed")["nodes"]
    assert sorted(p.name for p in (tmp_path / "killed" / "nodes").iterdir()) == sorted(
        f"{p}-{r}.pt" for p, r in named.items()) and named  # the older files pruned
    kept = tmp_path / "killed" / "nodes" / f"{min(named)}-{named[min(named)]}.pt"
    values = sum(np.dtype(dtype).itemsize * int(np.prod(shape)) for kind, items in torch.load(kept).values()
                 if kind == "array" for dtype, shape, *_ in items.values())
    assert kept.stat().st_size < 1.05 * values + 4096  # the residual's bytes as they are, not a pickle of them
    shutil.copytree(tmp_path / "killed", tmp_path / "bereft")
    (tmp_path / "bereft" / "nodes" / kept.name).unlink()
    with caplog.at_level(logging.WARNING):
        bereft = run_inprocess({"resume": str(tmp_path / "bereft")})
    assert f"node {min(named)}'s state" in caplog.text and "starts afresh" in caplog.text
    assert any(r.get("train-residual-lost") for r in rows(bereft)) and digest(bereft / "model.pt") != digest(
        whole / "model.pt")
    resumed = run_inprocess({"resume": str(tmp_path / "killed")})
    assert digest(resumed / "model.pt") == digest(whole / "model.pt")
    assert rows(resumed) == rows(whole) and rows(resumed, "events.jsonl") == rows(whole, "events.jsonl")
    assert not any(r.get("train-residual-lost") for r in rows(resumed))


def test_a_node_file_that_does_not_load_starts_that_node_afresh_and_the_others_get_theirs(tmp_path, caplog):
    """server_app/node_state.py's load: a file of another shape (a list where pack's dict was, an array's item of the
    wrong arity) or damaged bytes is a warning naming the node, and that node gets no state; the good file's node gets
    its state back, bytes for bytes."""
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

    from server_app import node_state
    from server_app.checkpoint import save_whole

    class Grid:
        def __init__(self) -> None:
            self.restored: dict = {}

        def changed_node_states(self) -> dict:
            return {}

        def restore_node_states(self, states) -> None:
            self.restored = dict(states)

    residual = np.arange(6, dtype=np.float32)
    good = RecordDict({"r": ArrayRecord({"w": Array(residual)}), "m": MetricRecord({"n": 3})})
    folder = tmp_path / node_state.FOLDER
    folder.mkdir()
    save_whole(folder / "0-4.pt", node_state.pack(good))
    save_whole(folder / "1-4.pt", [1, 2])
    save_whole(folder / "2-4.pt", {"r": ("array", {"w": ("float32", [6])})})
    (folder / "3-4.pt").write_bytes(b"not a torch file")
    grid = Grid()
    assert isinstance(grid, node_state.HoldsNodes)
    with caplog.at_level(logging.WARNING):
        node_state.load(grid, tmp_path, {0: 4, 1: 4, 2: 4, 3: 4, 4: 4})
    assert sorted(grid.restored) == [0]
    assert grid.restored[0]["r"]["w"].numpy().tobytes() == residual.tobytes() and grid.restored[0]["m"]["n"] == 3
    for partition, error in ((1, "AttributeError"), (2, "ValueError"), (3, ""), (4, "FileNotFoundError")):
        said = [r.getMessage() for r in caplog.records if f"node {partition}'s state" in r.getMessage()]
        assert len(said) == 1 and "starts afresh" in said[0] and error in said[0], said


def test_a_run_under_flowers_loop_resumes_identically(tmp_path):
    flower = {"strategy": "fedavg", "loop": "flower", "delay-sigma": 0.0, "clients-per-round": 3}
    whole = run_inprocess(job(tmp_path, "whole", **flower))
    with pytest.raises(Crash):
        run_inprocess(job(tmp_path, "killed", **flower), client_app=crashing(5, tmp_path / "killed"))
    resumed = run_inprocess({"resume": str(tmp_path / "killed")})
    assert digest(resumed / "model.pt") == digest(whole / "model.pt") and rows(resumed) == rows(whole)


def test_a_resumed_runs_wall_time_counts_every_process_that_worked_on_it(tmp_path):
    """summary.json's run-wall-seconds adds the checkpoint's time to the resumed process's wall-seconds; a
    checkpoint written before the field existed gives null, not this process's time alone."""
    for name in ("killed", "old"):
        with pytest.raises(Crash):
            run_inprocess(job(tmp_path, name), client_app=crashing(5, tmp_path / name))
    before = read_checkpoint(tmp_path / "killed")["run-seconds"]
    assert before > 0
    summary = json.loads((run_inprocess({"resume": str(tmp_path / "killed")}) / "summary.json").read_text())
    assert summary["run-wall-seconds"] >= before + summary["wall-seconds"]
    old = read_checkpoint(tmp_path / "old")
    del old["run-seconds"]
    write_checkpoint(tmp_path / "old", old)
    assert json.loads((run_inprocess({"resume": str(tmp_path / "old")}) / "summary.json").read_text())[
        "run-wall-seconds"] is None


def test_sigkill_of_the_serverapp_process_then_resume_is_byte_identical(tmp_path):
    """The in-process engine in its own process, killed with SIGKILL mid-run; resumed here."""
    overrides = job(tmp_path, "killed", **{"num-rounds": 10, "strategy": "feddle", "central-size": 40})
    # the killed process computes with this one's torch threads: they decide the float sums compared below
    code = (f"import torch\ntorch.set_num_threads({torch.get_num_threads()})\n"
            "from client_app.app import app\nfrom hybridfl.engine.inprocess import InProcessGrid, run_inprocess\n"
            f"run_inprocess({overrides!r}, grid=InProcessGrid(app, 4, node_config={{'latency-s': 0.1}}))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=PROJECT_DIR, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics, deadline = tmp_path / "killed" / "metrics.jsonl", time.monotonic() + 300
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 6):  # steps 0-5 recorded
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (tmp_path / "killed" / "summary.json").exists()
    step = read_checkpoint(tmp_path / "killed")["round"]
    assert 4 <= step < 10
    resumed = run_inprocess({"resume": str(tmp_path / "killed")})
    whole = run_inprocess({**overrides, "run-name": "whole"})
    assert digest(resumed / "model.pt") == digest(whole / "model.pt")
    assert rows(resumed) == rows(whole) and rows(resumed, "events.jsonl") == rows(whole, "events.jsonl")
    assert json.loads((resumed / "summary.json").read_text())["resumed-after-round"] == step


def test_a_new_run_in_a_used_folder_drops_the_old_checkpoint(tmp_path):
    """Killed before its first checkpoint, a new run must not be resumable as the run that used the folder."""
    run_inprocess(job(tmp_path, "reused", **{"num-rounds": 2}))
    assert (tmp_path / "reused" / CHECKPOINT).exists()
    with pytest.raises(Crash):
        run_inprocess(job(tmp_path, "reused", strategy="fedavg"), client_app=crashing(1, tmp_path / "reused"))
    with pytest.raises(ConfigError, match="has no checkpoint.pt"):
        load_config({"resume": str(tmp_path / "reused")})
