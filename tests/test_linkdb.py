"""The SuperLink's database kept bounded (hybridfl/launch/linkdb.py, ``hybridfl superlink-db prune``): on the file a
real SuperLink writes (``--database``), pruned while it runs; a file that is not such a database is refused
unchanged."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import pytest

from hybridfl.cli import main
from hybridfl.launch.compose_file import compose_files, load
from hybridfl.launch.deploy_local import CONNECTION, deploy_runs
from hybridfl.launch.linkdb import file_size, prune
from hybridfl.launch.processes import flower_env

JOB = {"preset": "fedavg-digits", "num-clients": 1, "clients-per-round": 1, "num-rounds": 1, "cnn-width": 8}
# the tables that hold a run's rows once it has finished (Flower deletes its messages and objects itself)
PER_RUN = ("run", "task", "series_runs", "run_series", "series_context")


def counts(db: Path) -> dict[str, int]:
    """Rows per table of the SQLite file `db`, every table."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}


def logs_of(db: Path, run_id: int) -> int:
    """The task log lines of run `run_id` (Flower's id; stored as the signed integer of the same bits)."""
    stored = run_id - (1 << 64) if run_id >= 1 << 63 else run_id
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        return con.execute("SELECT count(*) FROM task_logs WHERE task_id IN "
                           "(SELECT task_id FROM task WHERE run_id = ?)", (stored,)).fetchone()[0]


def listed_runs(home: Path) -> set[int]:
    """The run ids the SuperLink lists (``flwr ls``)."""
    out = subprocess.run(["flwr", "ls", CONNECTION, "--format", "json"], env=flower_env(home), capture_output=True,
                         text=True, timeout=120)
    return {int(run["run-id"]) for run in json.loads(out.stdout)["runs"]}


@pytest.mark.e2e
def test_prune_while_the_superlink_serves_deletes_a_finished_runs_rows_and_the_next_run_completes(tmp_path: Path,
                                                                                                   capsys) -> None:
    """A finished run on a SuperLink with --database (TLS, node auth), created 0600 under a permissive umask;
    ``prune --keep 0`` while it runs deletes that run's rows (run, task, logs, series) and keeps the node and the app;
    the file shrinks; ``flwr ls`` lists no run, and a further run on the same SuperLink completes. (Which runs
    ``--keep`` keeps, and that an unfinished one is never touched: the next test, on Flower's own state.)"""
    db, home = tmp_path / "state" / "superlink.db", tmp_path / "home"
    db.parent.mkdir()
    runs = [{**JOB, "output-dir": str(tmp_path / "out"), "run-name": f"r{i}"} for i in range(2)]
    ids: list[int] = []
    seen: dict[str, object] = {}

    def prune_after_the_first(run_id: int, run_folder: Path) -> None:
        ids.append(run_id)
        if len(ids) != 1:
            return
        seen["before"], seen["size-before"] = counts(db), file_size(db)
        seen["logs"] = logs_of(db, ids[0])
        capsys.readouterr()
        seen["exit"] = main(["superlink-db", "prune", str(db), "--keep", "0"])
        seen["printed"] = capsys.readouterr().out
        seen["after"], seen["size-after"] = counts(db), file_size(db)
        seen["listed"] = listed_runs(home)

    umask = os.umask(0o022)  # the SuperLink would create its file readable by everyone
    try:
        paths, _ = deploy_runs(runs, home, database=db, after_run=prune_after_the_first)
    finally:
        os.umask(umask)
    assert len(paths) == 2 and len(ids) == 2
    assert seen["exit"] == 0, seen["printed"]
    before, after = seen["before"], seen["after"]
    assert {t: before[t] for t in PER_RUN} == dict.fromkeys(PER_RUN, 1)
    assert {t: after[t] for t in PER_RUN} == dict.fromkeys(PER_RUN, 0)
    assert seen["logs"] > 0 and before["task_logs"] >= seen["logs"] and after["task_logs"] == 0
    assert after["fab"] == before["fab"] == 1  # the app stays while the federation lists it (federation_app)
    assert after["node"] == before["node"] == 1  # registered nodes stay
    assert after["message"] == after["message_ins"] == after["objects"] == 0
    assert seen["size-after"] < seen["size-before"]
    assert f"removed run {ids[0]}" in seen["printed"]
    assert seen["listed"] == set()
    assert stored_runs(db) == {ids[1]}
    for path in (db, db.with_name("superlink.db-wal"), db.with_name("superlink.db-shm")):
        assert not path.exists() or path.stat().st_mode & 0o777 == 0o600, path


def free_pages(db: Path) -> int:
    """The database's pages that hold nothing (``PRAGMA freelist_count``)."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        return con.execute("PRAGMA freelist_count").fetchone()[0]


def stored_runs(db: Path) -> set[int]:
    """The runs in the database file, as Flower numbers them."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        return {run_id & 0xFFFF_FFFF_FFFF_FFFF for (run_id,) in con.execute("SELECT run_id FROM run")}


def test_prune_never_touches_an_unfinished_run_and_keeps_the_apps_in_use(tmp_path: Path) -> None:
    """On Flower's own state (its SqlLinkState, open on the file as a SuperLink's is): four runs, the third not
    finished. ``--keep 1`` deletes the two oldest (their runs, tasks, log lines, series) and the app only the first
    used; the unfinished run, the newest finished one and their apps stay, and Flower still reads them."""
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.supercore.constant import TaskType
    from flwr.supercore.fab import Fab
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation import NoOpFederationManager

    db = tmp_path / "superlink.db"
    state = LinkStateFactory(str(db), NoOpFederationManager(), ObjectStoreFactory(str(db))).state()
    apps = [state.store_fab(Fab("", f"app {name}".encode(), {})) for name in "ABBC"]
    runs = [state.create_run(None, None, app, {}, "default", None, "me", TaskType.SERVER_APP) for app in apps]
    tasks = {r.run_id: r.primary_task_id for r in state.get_run_info(run_ids=runs)}
    for i, run_id in enumerate(runs):
        state.add_task_log(tasks[run_id], f"run {i} says hello")
        if i != 2:
            assert state.claim_task(tasks[run_id]) and state.activate_task(tasks[run_id])
            assert state.finish_task(tasks[run_id], "completed", "")
    before = counts(db)

    pruned = prune(db, 1, vacuum=False)

    assert free_pages(db) > 0  # deleted, the space kept for SQLite to reuse
    assert (pruned.removed, pruned.kept, pruned.unfinished) == ([runs[1], runs[0]], [runs[3]], 1)
    after = counts(db)
    assert {t: (before[t], after[t]) for t in (*PER_RUN, "task_logs", "fab")} == {
        **dict.fromkeys(PER_RUN, (4, 2)), "task_logs": (4, 2), "fab": (3, 2)}
    assert stored_runs(db) == {runs[2], runs[3]}
    statuses = {r.run_id: r.status.status for r in state.get_run_info()}
    assert statuses == {runs[2]: "pending", runs[3]: "finished"}
    assert state.get_task_log(tasks[runs[2]], None)[0] == "run 2 says hello"
    assert state.get_fab(apps[0]) is None and state.get_fab(apps[1]) and state.get_fab(apps[3])
    assert prune(db, 1).removed == [] and free_pages(db) == 0  # VACUUMed


@pytest.mark.parametrize("content", [b"not a database\n", b""])
def test_a_file_that_is_no_superlink_database_is_refused_unchanged(tmp_path: Path, capsys, content: bytes) -> None:
    """Text, an empty file (what compose creates before the SuperLink's first start) and another SQLite database
    are refused with exit 2 and left byte for byte as they were; so is a missing file, which is not created."""
    other = tmp_path / "other.db"
    with closing(sqlite3.connect(other)) as con, con:
        con.execute("CREATE TABLE run (run_id INTEGER)")
        con.execute("INSERT INTO run VALUES (1)")
    plain = tmp_path / "plain"
    plain.write_bytes(content)
    for path in (plain, other):
        original = path.read_bytes()
        assert main(["superlink-db", "prune", str(path), "--keep", "0"]) == 2
        assert "is not a Flower 1.42 SuperLink database" in capsys.readouterr().err
        assert path.read_bytes() == original
        assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db", "plain"]
    assert main(["superlink-db", "prune", str(tmp_path / "missing.db")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()


def test_the_compose_volume_owner_step_makes_the_database_private(tmp_path: Path) -> None:
    """docker/compose.yml's volume-owner step, run by ``sh`` with the volume's paths in `tmp_path` under a permissive
    umask (``chown`` a no-op unless root): the database file 0600 in a folder 0700, created empty where missing, and an
    existing database kept byte for byte, made 0600."""
    script = load(compose_files())["services"]["volume-owner"]["entrypoint"][2].replace("/app/", f"{tmp_path}/")
    script = script if os.geteuid() == 0 else f"chown() {{ :; }}; {script}"
    state, db = tmp_path / "state", tmp_path / "state" / "superlink.db"
    for existing in (None, b"SQLite format 3\0 and the rest"):
        for folder in (state, tmp_path / "outputs"):
            folder.mkdir(exist_ok=True)
            folder.chmod(0o755)
        if existing is not None:
            db.write_bytes(existing)
            db.chmod(0o644)
        subprocess.run(["sh", "-c", f"umask 022; {script}"], check=True, timeout=30)
        assert db.read_bytes() == (existing or b"")
        assert (db.stat().st_mode & 0o777, state.stat().st_mode & 0o777) == (0o600, 0o700)
