"""The SuperLink's database (``flower-superlink --database FILE``, SQLite) kept bounded.

    hybridfl superlink-db prune FILE [--keep N]

Flower 1.42 deletes a finished run's messages, objects and push sessions, but never the run itself, its task rows,
events and logs (every ServerApp line), its series or its FAB (the app's whole archive, once per distinct app): the
file grows with every run for good (and WAL with ``auto_vacuum`` off never gives space back). :func:`prune` deletes
every row of the finished runs beyond the newest N (those, and the FABs, objects and run series no kept run uses),
then VACUUMs. It is safe while the SuperLink runs: the deletions go in short write transactions (SQLite's lock; the
SuperLink waits up to 5 s for it, ``busy_timeout``), a run that has not finished is never touched, and nodes stay
registered. A file that is not a SuperLink database of the schema read here is refused before anything is
written.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from common.errors import ConfigError

# Flower 1.42's tables this command reads or deletes from, with the columns it uses
# (flwr/supercore/state/schema/*_models.py; alembic_version: Flower creates a file's schema with Alembic)
SCHEMA = {
    "alembic_version": {"version_num"},
    "run": {"run_id", "primary_task_id", "fab_hash", "series_id"},
    "task": {"task_id", "run_id", "fab_hash", "pending_at", "finished_at"},
    "task_logs": {"task_id", "log"},
    "task_event": {"run_id", "task_id"},
    "task_usage": {"run_id", "task_id"},
    "task_message": {"run_id", "src_task_id", "dst_task_id"},
    "message": {"message_id", "run_id", "reply_to_message_id"},
    "message_ins": {"run_id"},
    "message_res": {"run_id"},
    "object_push_sessions": {"run_id"},
    "run_objects": {"run_id", "object_id"},
    "objects": {"object_id", "ref_count"},
    "object_children": {"parent_id", "child_id"},
    "run_connector": {"run_id"},
    "series_runs": {"series_id", "run_id"},
    "run_series": {"series_id"},
    "series_context": {"series_id"},
    "compacted_contexts": {"series_id"},
    "automation": {"series_id"},
    "fab": {"fab_hash", "content"},
    "federation_app": {"fab_hash"},
    "node": {"node_id"},
}
RUNS = "(SELECT value FROM json_each(:runs))"
TASKS = "(SELECT value FROM json_each(:tasks))"
# A doomed run's rows, in an order that the foreign keys allow (Flower's connections enforce them, and so does this
# one): whatever refers to a task before the task, a reply before the message it answers. A push session's roots and
# pending objects go with it (ON DELETE CASCADE).
RUN_ROWS = (
    ("task_logs", f"task_id IN {TASKS}"),
    ("task_event", f"task_id IN {TASKS} OR run_id IN {RUNS}"),
    ("task_usage", f"task_id IN {TASKS} OR run_id IN {RUNS}"),
    ("task_message", f"src_task_id IN {TASKS} OR dst_task_id IN {TASKS} OR run_id IN {RUNS}"),
    ("message", f"run_id IN {RUNS} AND reply_to_message_id IS NOT NULL"),
    ("message", f"run_id IN {RUNS}"),
    ("message_res", f"run_id IN {RUNS}"),
    ("message_ins", f"run_id IN {RUNS}"),
    ("object_push_sessions", f"run_id IN {RUNS}"),
    ("run_connector", f"run_id IN {RUNS}"),
    ("series_runs", f"run_id IN {RUNS}"),
    ("task", f"run_id IN {RUNS}"),
    ("run", f"run_id IN {RUNS}"),
)
# A run series goes once no run and no automation is in it
SERIES = ("series_id IN (SELECT value FROM json_each(:series))"
          " AND series_id NOT IN (SELECT series_id FROM series_runs)"
          " AND series_id NOT IN (SELECT series_id FROM automation)")
SERIES_ROWS = tuple((table, SERIES) for table in ("series_context", "compacted_contexts", "run_series"))
# A FAB goes once no run, task or federation app names it. (A run submitted with the same app at the very moment
# its last user is pruned can miss it: Flower stores the FAB and creates the run in two transactions.)
FAB_ROWS = ("fab", "fab_hash IN (SELECT value FROM json_each(:fabs)) AND fab_hash NOT IN (SELECT fab_hash FROM run) "
                   "AND fab_hash NOT IN (SELECT fab_hash FROM task WHERE fab_hash IS NOT NULL) "
                   "AND fab_hash NOT IN (SELECT fab_hash FROM federation_app)")
CHECKPOINT_TRIES = 50
BATCH_ROWS = 2000
BUSY_TIMEOUT_S = 30.0  # how long this command waits for the SuperLink's write to end (it holds the lock briefly)


@dataclass
class Pruned:
    """What :func:`prune` removed: run ids (as Flower prints them), rows per table, the file's size in bytes."""

    path: Path
    removed: list[int]
    kept: list[int]
    unfinished: int
    rows: dict[str, int] = field(default_factory=dict)
    size_before: int = 0
    size_after: int = 0
    lock_s: float = 0.0
    vacuum_s: float = 0.0

    def __str__(self) -> str:
        lines = [f"{self.path}: {len(self.removed)} finished run(s) removed, {len(self.kept)} kept (the newest), "
                 f"{self.unfinished} unfinished left alone"]
        lines += [f"  removed run {run_id}" for run_id in self.removed]
        lines += [f"  kept run {run_id}" for run_id in self.kept]
        width = max(map(len, self.rows), default=0)
        lines += [f"  {table:<{width}}  {n} row(s) deleted" for table, n in self.rows.items() if n]
        lines.append(f"size (the file and its write-ahead log): {mib(self.size_before)} before, "
                     f"{mib(self.size_after)} after")
        lines.append(f"the write lock held {1000 * self.lock_s:.0f} ms at most per deletion, "
                     f"{self.vacuum_s:.2f} s by VACUUM")
        return "\n".join(lines)


def mib(size: int) -> str:
    """`size` bytes in MiB, two decimals."""
    return f"{size / 2**20:.2f} MiB"


def file_size(path: Path) -> int:
    """The database's bytes on disk: the file and its write-ahead log (``-wal``), where Flower's writes go first."""
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())


def uint64(value: int) -> int:
    """A run id as Flower shows it (stored as the signed 64-bit integer of the same bits)."""
    return value & 0xFFFF_FFFF_FFFF_FFFF


def connect(path: Path) -> sqlite3.Connection:
    """An autocommit connection to the existing file `path` (never created), with the SuperLink's own settings that
    matter here: foreign keys enforced, and a wait for the lock instead of an error."""
    if not path.is_file():
        raise ConfigError("DB", str(path), "a file", f"{path}: no such file (the SuperLink's --database FILE)")
    con = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=rw", uri=True, timeout=BUSY_TIMEOUT_S,
                          isolation_level=None)
    con.execute("PRAGMA foreign_keys = ON")
    return con


def check_schema(con: sqlite3.Connection, path: Path) -> None:
    """Raise ConfigError unless `con` holds Flower 1.42's SuperLink schema (:data:`SCHEMA`), with no other table
    that keeps rows per run or task (a newer Flower's: pruning would leave them behind). Reads only."""
    def columns(table: str) -> set[str]:
        return {row[1] for row in con.execute(f"PRAGMA table_info({json.dumps(table)})")}

    allowed = "a Flower 1.42 SuperLink database (`flower-superlink --database FILE`)"
    try:
        tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as err:  # not SQLite at all: "file is not a database"
        raise ConfigError("DB", str(path), allowed, f"{path} is not {allowed}: {err}") from None
    missing = [t for t, cols in SCHEMA.items() if t not in tables or not cols <= columns(t)]
    if missing:
        raise ConfigError("DB", str(path), allowed, f"{path} is not {allowed}: it lacks {len(missing)} of its tables "
                          f"or their columns ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); "
                          "nothing was changed")
    unknown = sorted(t for t in tables - set(SCHEMA) if columns(t) & {"run_id", "task_id"})
    if unknown:
        raise ConfigError("DB", str(path), allowed, f"{path} has per-run table(s) this command does not know "
                          f"({', '.join(unknown)}: a newer Flower's schema?); nothing was changed")


def prune(path: Path, keep: int, vacuum: bool = True) -> Pruned:
    """Delete every row of the finished runs of the SuperLink database `path` but the newest `keep` (newest by
    submission), and what only they used; VACUUM if `vacuum` and pages are free; return what went. Unfinished runs
    are never touched. Raises ConfigError (nothing written) for a file that is not such a database."""
    if keep < 0:
        raise ConfigError("--keep", keep, "a number of finished runs to keep, 0 or more")
    size_before = file_size(path) if path.is_file() else 0
    con, held = connect(path), [0.0]  # the seconds each write transaction held the lock
    try:
        check_schema(con, path)
        with transaction(con, held):
            pruned, ids, objects = _doomed(con, path, keep)
        if pruned.removed:
            rows = pruned.rows
            for table, where in (*RUN_ROWS, ("run_objects", f"run_id IN {RUNS}"), *SERIES_ROWS, FAB_ROWS):
                rows[table] = rows.get(table, 0) + _delete_in_batches(con, table, where, ids, held)
            with transaction(con, held):
                rows["objects"] = _delete_objects(con, objects)
        start = time.monotonic()
        # the freed pages back to the file system: VACUUM rewrites the file (through the WAL, which the checkpoint
        # then empties) under the write lock, for as long as copying what is kept takes (3.0 s for 59 MiB, BENCHMARKS).
        # Without it SQLite reuses the freed pages: the file stops growing but does not shrink
        if vacuum and con.execute("PRAGMA freelist_count").fetchone()[0]:
            con.execute("VACUUM")
        pruned.lock_s, pruned.vacuum_s = max(held), time.monotonic() - start
        for _ in range(CHECKPOINT_TRIES):  # busy while a SuperLink's read holds the log's end: short, so again
            if con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0:
                break
            time.sleep(0.2)
    finally:
        con.close()
    pruned.size_before, pruned.size_after = size_before, file_size(path)
    return pruned


@contextlib.contextmanager
def transaction(con: sqlite3.Connection, held: list[float]) -> Iterator[None]:
    """A write transaction on the autocommit connection `con`: SQLite's write lock taken at once (waiting for the
    SuperLink's to end), committed at the end, rolled back on an exception; the seconds it held the lock appended to
    `held`."""
    con.execute("BEGIN IMMEDIATE")
    start = time.monotonic()
    try:
        yield
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")
    held.append(time.monotonic() - start)


def _doomed(con: sqlite3.Connection, path: Path, keep: int) -> tuple[Pruned, dict[str, str], list[str]]:
    """The finished runs beyond the newest `keep`, as a :class:`Pruned` with no rows yet; the ids that the deletions
    name (JSON arrays: runs, their tasks, apps, series) and the runs' objects. A finished run stays finished, so these
    hold while the deletions go on in later transactions."""
    runs = con.execute("SELECT r.run_id, t.finished_at IS NOT NULL FROM run r JOIN task t "
                       "ON t.task_id = r.primary_task_id ORDER BY t.pending_at DESC, r.rowid DESC").fetchall()
    finished = [run_id for run_id, done in runs if done]
    doomed, kept = finished[keep:], finished[:keep]
    pruned = Pruned(path, [uint64(r) for r in doomed], [uint64(r) for r in kept], len(runs) - len(finished))
    ids = {"runs": json.dumps(doomed)}
    ids["tasks"] = _json(con, f"SELECT task_id FROM task WHERE run_id IN {RUNS}", ids)
    ids["fabs"] = _json(con, f"SELECT fab_hash FROM run WHERE run_id IN {RUNS} UNION "
                             f"SELECT fab_hash FROM task WHERE run_id IN {RUNS} AND fab_hash IS NOT NULL", ids)
    ids["series"] = _json(con, f"SELECT series_id FROM series_runs WHERE run_id IN {RUNS} UNION "
                               f"SELECT series_id FROM run WHERE run_id IN {RUNS} AND series_id IS NOT NULL", ids)
    objects = [oid for (oid,) in con.execute(f"SELECT object_id FROM run_objects WHERE run_id IN {RUNS}", ids)]
    return pruned, ids, objects


def _delete_in_batches(con: sqlite3.Connection, table: str, where: str, ids: dict[str, str], held: list[float]
                       ) -> int:
    """Delete `table`'s rows that match `where`, :data:`BATCH_ROWS` per transaction (each one's seconds appended to
    `held`); return how many. A long run's 200,000 log lines in one transaction held the lock for 6.5 s, longer than
    the SuperLink waits; a batch takes milliseconds. Between batches the file is consistent (a doomed run that has
    lost some rows, which the next prune finishes)."""
    deleted = 0
    while True:
        with transaction(con, held):
            n = con.execute(f"DELETE FROM {table} WHERE rowid IN "
                            f"(SELECT rowid FROM {table} WHERE {where} LIMIT {BATCH_ROWS})", ids).rowcount
        deleted += n
        if n < BATCH_ROWS:
            return deleted


def _json(con: sqlite3.Connection, query: str, params: dict[str, str]) -> str:
    """The first column of `query`'s rows as a JSON array (a parameter for ``json_each``)."""
    return json.dumps([value for (value,) in con.execute(query, params)])


def _delete_objects(con: sqlite3.Connection, object_ids: Iterable[str]) -> int:
    """Flower's own deletion of a run's objects (``SqlObjectStore.delete``): an object no other object refers to
    (``ref_count`` 0) goes, its children lose one reference each and go too once at 0. Returns the objects deleted;
    their child links go with them (ON DELETE CASCADE)."""
    todo, deleted = list(object_ids), 0
    while todo:
        object_id = todo.pop()
        children = [c for (c,) in con.execute("SELECT child_id FROM object_children WHERE parent_id = ?", (object_id,))]
        if not con.execute("DELETE FROM objects WHERE object_id = ? AND ref_count = 0", (object_id,)).rowcount:
            continue
        deleted += 1
        con.execute("UPDATE objects SET ref_count = ref_count - 1 WHERE ref_count > 0 AND object_id IN "
                    "(SELECT value FROM json_each(?))", (json.dumps(children),))
        todo += children
    return deleted


def row_counts(path: Path, tables: Sequence[str]) -> dict[str, int]:
    """Rows per table of the database `path` (read only)."""
    con = connect(path)
    try:
        return {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables}
    finally:
        con.close()


def private_file(path: Path) -> Path:
    """`path`, created empty if missing (SQLite takes an empty file for an empty database), readable and writable by
    its owner only (0600, whatever the umask): the SuperLink would create its database with the umask's mode, and
    SQLite gives its write-ahead log and shared-memory files the database file's mode."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    path.chmod(0o600)
    return path
