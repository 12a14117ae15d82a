"""client_app/node_cache.py: a node's partition kept on disk for the run (one ClientApp process per message in
deployment), and the ClientApp's query handler that needs no torch."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from client_app import node_cache
from client_app.node_cache import cache_dir, client_parts
from common.splits import CLIENT_PARTS, DataSpec, client_partition
from hybridfl.launch.bundle import PROJECT_DIR

SPEC = DataSpec(dataset="synthetic", seed=3, partitioner="dirichlet", dirichlet_alpha=0.5, num_clients=4,
                test_fraction=0.2, central_size=10, client_test_fraction=0.2, client_validation_fraction=0.1,
                label_noise=0.2)


def _same(a, b) -> None:
    assert a.num_classes == b.num_classes
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)


def test_the_cached_parts_are_the_partition_and_a_second_read_comes_from_the_file(tmp_path: Path, monkeypatch) -> None:
    first = client_parts(SPEC, 2, run_id=7, directory=tmp_path)
    for part in CLIENT_PARTS:  # label noise on train only, held-out parts: exactly common.splits's
        _same(first[part], client_partition(SPEC, 2, part))
    files = list((tmp_path / "run-7").glob("partition-2-*.npz"))
    assert len(files) == 1

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt although the file was there")

    monkeypatch.setattr(node_cache, "client_partition", no_rebuild)
    second = client_parts(SPEC, 2, run_id=7, directory=tmp_path)
    for part in CLIENT_PARTS:
        _same(second[part], first[part])


def test_another_spec_partition_or_run_never_reads_the_file(tmp_path: Path) -> None:
    client_parts(SPEC, 2, run_id=7, directory=tmp_path)
    other = dataclasses.replace(SPEC, seed=4)
    _same(client_parts(other, 2, run_id=7, directory=tmp_path)["train"], client_partition(other, 2))
    _same(client_parts(SPEC, 1, run_id=7, directory=tmp_path)["train"], client_partition(SPEC, 1))
    client_parts(SPEC, 2, run_id=8, directory=tmp_path)
    assert len(list((tmp_path / "run-7").glob("*.npz"))) == 3 and len(list((tmp_path / "run-8").glob("*.npz"))) == 1


def test_a_broken_file_is_rebuilt_and_an_unwritable_cache_is_skipped(tmp_path: Path) -> None:
    client_parts(SPEC, 0, run_id=1, directory=tmp_path)
    (path,) = (tmp_path / "run-1").glob("*.npz")
    path.write_bytes(b"not a zip")
    _same(client_parts(SPEC, 0, run_id=1, directory=tmp_path)["train"], client_partition(SPEC, 0))
    assert np.load(path)["train-y"].shape == client_partition(SPEC, 0).y.shape  # written again
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder should be")
    _same(client_parts(SPEC, 0, run_id=1, directory=blocked)["test"], client_partition(SPEC, 0, "test"))


def test_folders_of_old_runs_go_when_a_new_run_writes(tmp_path: Path) -> None:
    for run in (1, 2):
        client_parts(SPEC, 0, run_id=run, directory=tmp_path)
    day_old = time.time() - node_cache.STALE_S - 60
    os.utime(tmp_path / "run-1", (day_old, day_old))
    client_parts(SPEC, 0, run_id=3, directory=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-2", "run-3"]


def test_cache_dir_comes_from_the_node_config_or_the_users_cache(monkeypatch, tmp_path: Path) -> None:
    assert cache_dir({"cache-dir": ""}) is None
    assert cache_dir({"cache-dir": str(tmp_path)}) == tmp_path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir({}) == tmp_path / "xdg" / "hybridfl"


def test_the_query_handler_runs_without_importing_torch() -> None:
    """A fresh process (as Flower starts one per message) answers ``query`` with torch never imported."""
    code = """
import sys
from flwr.app import Context, Message, RecordDict
from flower_internals.engine import act_as_serverapp
from client_app.app import app
act_as_serverapp(1)
ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 3, "num-partitions": 4}, state=RecordDict(),
              run_config={})
msg = Message(RecordDict(), dst_node_id=1, message_type="query")
reply = app(msg, ctx)
print(dict(reply.content["metrics"]), "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_DIR, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("}")[-1].strip() == "False"
    assert json.loads(out.stdout.split("}")[0].replace("'", '"') + "}") == {"partition-id": 3, "num-partitions": 4}
