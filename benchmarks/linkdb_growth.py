"""The SuperLink's database over many runs, and what ``hybridfl superlink-db prune`` gives back.

    python -m benchmarks.linkdb_growth [--runs 5] [--rounds 1] [--keep 1] [--log-lines 100000]

Starts a local deployment (hybridfl/launch/deploy_local.py: TLS, node authentication, one SuperNode) whose SuperLink
keeps its state in a file (``--database``, as compose's does), runs FedAvg on digits ``--runs`` times in a row on it,
and records after each run the bytes on disk (the file and its write-ahead log) and the rows Flower never deletes (runs,
task log lines, FABs); then prunes to the newest ``--keep`` finished runs while the SuperLink still runs and records
again. Long runs, on a copy of the file taken before the prune: ``--log-lines`` lines of 500 bytes added to each
finished run's log (a long run's ServerApp log), pruned the same way, with how long each write transaction held
SQLite's lock (the SuperLink waits 5 s for it) and how long VACUUM did. Prints Markdown tables (BENCHMARKS, "The
SuperLink's database").
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

from hybridfl.launch.deploy_local import deploy_runs
from hybridfl.launch.linkdb import Pruned, file_size, mib, prune, row_counts

COUNTED = ("run", "task_logs", "fab", "message_ins", "objects")


def measure(runs: int, rounds: int, keep: int, workdir: Path) -> list[dict[str, str]]:
    """One row per run, then one for the prune, with the sizes and row counts of :data:`COUNTED`."""
    db = workdir / "superlink.db"
    rows: list[dict[str, str]] = []

    def record(label: str) -> None:
        wal = db.with_name(db.name + "-wal")
        rows.append({"after": label, "file + WAL": mib(file_size(db)), "file": mib(db.stat().st_size),
                     "WAL": mib(wal.stat().st_size if wal.exists() else 0),
                     **{k: str(v) for k, v in row_counts(db, COUNTED).items()}})

    def after_run(run_id: int, run_folder: Path) -> None:
        record(f"run {len(rows) + 1}")
        if len(rows) == runs:
            with closing(sqlite3.connect(db)) as live, closing(sqlite3.connect(workdir / "long.db")) as copy:
                live.backup(copy)
            start = time.monotonic()
            pruned = prune(db, keep)
            print(pruned, flush=True)
            record(f"prune --keep {keep} ({time.monotonic() - start:.2f} s)")

    job = {"preset": "fedavg-digits", "num-clients": 1, "clients-per-round": 1, "num-rounds": rounds,
           "output-dir": str(workdir / "out")}
    deploy_runs([{**job, "run-name": f"run-{i}"} for i in range(runs)], workdir / "home", database=db,
                after_run=after_run)
    return rows


def long_runs(db: Path, lines: int, keep: int) -> Pruned:
    """`lines` log lines of 500 bytes added to each finished run of the database `db`, then :func:`prune`."""
    with closing(sqlite3.connect(db)) as con, con:
        tasks = [t for (t,) in con.execute("SELECT t.task_id FROM run r JOIN task t ON t.task_id = r.primary_task_id "
                                           "WHERE t.finished_at IS NOT NULL")]
        for task in tasks:
            con.executemany("INSERT INTO task_logs (timestamp, task_id, log) VALUES (?, ?, ?)",
                            ((float(i), task, "x" * 500) for i in range(lines)))
    return prune(db, keep)


def table(rows: list[dict[str, str]]) -> str:
    """`rows` as a Markdown table."""
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    return "\n".join([*lines, *("| " + " | ".join(row[k] for k in head) + " |" for row in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs in a row on one SuperLink")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of each run")
    parser.add_argument("--keep", type=int, default=1, help="finished runs the prune keeps")
    parser.add_argument("--log-lines", type=int, default=100_000, help="log lines added to each run of the copy")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        print(table(measure(args.runs, args.rounds, args.keep, Path(tmp))))
        pruned = long_runs(Path(tmp) / "long.db", args.log_lines, args.keep)
        print(f"\nlong runs ({args.log_lines} more log lines each):\n{pruned}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
