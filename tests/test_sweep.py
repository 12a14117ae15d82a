"""Sweeps (hybridfl/sweep/, ``hybridfl sweep`` / ``hybridfl report``): the spec's checks, the jobs it names, the
one-standard-error rule on validation, and a real two-point sweep over two seeds killed mid-run and resumed."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from benchmarks.reproduce_feddle import HEADLINE, RETUNED
from common.errors import ConfigError
from hybridfl import sweep as sweeps
from hybridfl.cli import main
from hybridfl.engine.inprocess import run_inprocess

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"runs": [{"presets": "fedavg-digits", "grid": {"lr": [0.05, 0.1]}, "seeds": [0, 1]}],
        "overrides": {"num-rounds": 4, "eval-every": 1, "checkpoint-every": 1, "validation-size": 100}}


def _spec(tmp_path: Path, spec: dict, name: str = "s") -> Path:
    spec = {**spec, "results": str(tmp_path / "out" / "runs.jsonl")}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize(("change", "key", "allowed"), [
    ({"colour": 1}, "colour", "a sweep spec key"),
    ({"select": "median"}, "select", "'one-se', 'best', 'none'"),
    ({"runs": [{"presets": "fedavg-digits", "select": "worst"}]}, "runs[0].select", "'one-se', 'best', 'none'"),
    ({"runs": []}, "runs", "a non-empty list"),
    ({"runs": [{"presets": "fedavg-digits", "seeds": [-1]}]}, "runs[0].seeds", "integers ≥ 0"),
    ({"runs": [{"presets": "x/{method}"}]}, "runs[0].presets", "keys of `vars`"),
    ({"runs": [{"presets": "fedavg-digits", "gird": {}}]}, "runs[0].gird", "a block key"),
    ({"record": "no.such.module:f"}, "record", "`module:function`"),
    ({"runs": [{"presets": "no-such-preset"}]}, "preset", "hybridfl presets"),
    ({"runs": [{"presets": "fedavg-digits", "grid": {"lr": [0.1, -1]}}]}, "lr", "a value in"),
    ({"runs": [{"presets": "fedavg-digits", "grid": {"search-lr": [0.1]}}]}, "search-lr", "a key the run uses"),
])
def test_a_bad_spec_fails_before_anything_runs_naming_the_key(tmp_path: Path, change, key, allowed):
    with pytest.raises(ConfigError) as err:
        sweeps.parse({**SPEC, **change}, "bad")
    assert err.value.key == key and allowed in str(err.value)
    assert not (tmp_path / "out").exists()


def test_the_jobs_are_presets_by_grid_points_by_seeds_named_as_the_reproductions_name_them():
    sweep = sweeps.parse({"runs": [{"presets": "fedmerge-fmnist/{method}-{setting}",
                                    "vars": {"method": ["fedavg", "ifca"], "setting": ["cluster"]}, "seeds": [0, 2]},
                                   {"presets": "fedmerge-fmnist/fedmerge-cluster", "grid": {"global-models": [1, 10]}}],
                          "overrides": {"eval-every": 10}, "run-dir": "outputs/x"}, "s")
    keys = [k for k, _ in sweep.jobs()]
    assert keys == ["fedmerge-fmnist/fedavg-cluster/s0", "fedmerge-fmnist/ifca-cluster/s0",  # seed by seed
                    "fedmerge-fmnist/fedavg-cluster/s2", "fedmerge-fmnist/ifca-cluster/s2",
                    "fedmerge-fmnist/fedmerge-cluster/s0/global-models=1",
                    "fedmerge-fmnist/fedmerge-cluster/s0/global-models=10"]
    overrides = dict(sweep.jobs())["fedmerge-fmnist/fedmerge-cluster/s0/global-models=10"]
    assert overrides["global-models"] == 10 and overrides["eval-every"] == 10 and overrides["seed"] == 0
    assert overrides["run-name"] == "fedmerge-fmnist_fedmerge-cluster_s0_global-models=10"
    assert Path(overrides["output-dir"]) == Path("outputs/x").resolve()


def _candidate(val: list[float], test: list[float], lr: float) -> sweeps.Candidate:
    runs = [{"val": v, "test": t} for v, t in zip(val, test)]
    return sweeps.Candidate("fedavg-digits", {"lr": lr}, runs, len(runs))


def test_one_standard_error_takes_the_first_candidate_near_the_best_on_validation_never_on_test():
    # seeds' spread: the best (0.80, 0.84) has SE 0.02; the first at or above 0.80 is the second candidate
    group = [_candidate([0.70, 0.74], [0.99, 0.99], 0.01), _candidate([0.81, 0.81], [0.10, 0.10], 0.03),
             _candidate([0.80, 0.84], [0.20, 0.20], 0.1)]
    assert sweeps.choose(group, "one-se").point == {"lr": 0.03}
    assert sweeps.choose(group, "best").point == {"lr": 0.1}  # the first candidate's best test never counts
    assert sweeps.choose(group, "none") is None
    # one seed: the binomial SE on fedavg-digits' validation-size (0 there: an error, not a silent pick)
    single = [_candidate([0.80], [0.5], 0.01), _candidate([0.81], [0.5], 0.1)]
    with pytest.raises(ValueError, match="no validation-size"):
        sweeps.choose(single, "one-se")
    assert sweeps.standard_error([0.81], 1000) == pytest.approx((0.81 * 0.19 / 1000) ** 0.5)
    # nothing is chosen until every candidate has all its seeds
    assert sweeps.choose([*group, sweeps.Candidate("fedavg-digits", {"lr": 1}, [], 2)], "one-se") is None


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.e2e
def test_a_sweep_sent_sigterm_stops_its_runs_at_once_and_exits_143(tmp_path: Path):
    """`kill` of the driver alone (not its process group): its workers stop mid-run and the queued runs are dropped,
    where the pool's own exit waited for every run submitted (the driver went on for hours)."""
    spec = _spec(tmp_path, {**SPEC, "overrides": {**SPEC["overrides"], "num-rounds": 400, "eval-every": 100}})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "hybridfl.cli", "sweep", str(spec), "--jobs", "2"], env=env,
                            cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while len(list((tmp_path / "out").glob("*/metrics.jsonl"))) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, "the sweep ended before it could be stopped"
            time.sleep(0.2)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the workers, and the pool's resource tracker after them
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("a process of the sweep outlived it")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (tmp_path / "out" / "runs.jsonl").exists() or not _lines(tmp_path / "out" / "runs.jsonl")
    assert not list((tmp_path / "out").glob("*/summary.json"))  # no run went on to its end


def test_a_sweep_killed_mid_run_resumes_then_reports_its_choice(tmp_path: Path, capsys):
    spec = _spec(tmp_path, SPEC)
    results, folders = tmp_path / "out" / "runs.jsonl", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "hybridfl.cli", "sweep", str(spec)], env=env, cwd=tmp_path,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # kill it once the first run is recorded and the second has checkpointed past its first step
        second = folders / "fedavg-digits_s0_lr=0.1" / "metrics.jsonl"  # seed by seed: s0 lr 0.1 runs second
        deadline = time.monotonic() + 600
        while not (len(_lines(results)) == 1 and len(_lines(second)) >= 3) and time.monotonic() < deadline:
            assert proc.poll() is None, "the sweep ended before it could be interrupted"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert [r["key"] for r in _lines(results)] == ["fedavg-digits/s0/lr=0.05"]
    assert not (second.parent / "summary.json").exists()

    assert main(["sweep", str(spec), "--jobs", "2"]) == 0
    done = _lines(results)
    assert sorted(r["key"] for r in done) == sorted(k for k, _ in sweeps.load(spec).jobs())  # each once
    resumed = json.loads((second.parent / "summary.json").read_text())
    assert resumed["resumed-after-round"] >= 1  # picked up at its checkpoint, not started afresh
    # its seconds count the killed process too, not the resumed one's alone
    second_result = next(r for r in done if r["key"] == "fedavg-digits/s0/lr=0.1")
    assert second_result["seconds"] == resumed["run-wall-seconds"] > resumed["wall-seconds"]
    out = capsys.readouterr().out
    assert "3 runs to do (1 already in" in out

    # the choice is the rule's on the recorded validation scores
    sweep = sweeps.load(spec)
    chosen = sweeps.choices(sweep, sweeps.load_results(results))["fedavg-digits"]
    group = sweeps.candidates(sweep, sweeps.load_results(results))
    assert chosen == sweeps.choose(group, "one-se") and chosen is not None
    report = (tmp_path / "out" / "runs.md").read_text()
    assert f"| {chosen.label} * | 2/2 |" in report and (tmp_path / "out" / "runs.png").is_file()
    # running it again runs nothing; report alone prints the same table
    assert main(["sweep", str(spec)]) == 0
    assert "0 runs to do (4 already in" in capsys.readouterr().out
    assert len(_lines(results)) == 4
    assert main(["report", str(spec)]) == 0
    assert capsys.readouterr().out.strip() == report.strip()


def test_an_interrupted_run_that_cannot_be_resumed_is_run_again_saying_so(tmp_path: Path, capsys):
    """A run folder left with a damaged checkpoint, or one of another configuration: the job runs from its start,
    and stderr says why, naming the folder."""
    (_, overrides), *_ = sweeps.load(_spec(tmp_path, SPEC)).jobs()
    folder = Path(overrides["output-dir"]) / overrides["run-name"]
    folder.mkdir(parents=True)
    (folder / "checkpoint.pt").write_bytes(b"half a checkpoint")
    assert sweeps.interrupted(overrides) is None
    err = capsys.readouterr().err
    assert f"warning: {folder}: an interrupted run's checkpoint that this job cannot resume" in err
    assert "corrupt or truncated" in err and "running the job again from its start" in err
    run_inprocess({**overrides, "num-rounds": 2})  # another configuration's checkpoint, left by a kill
    (folder / "summary.json").unlink()
    assert sweeps.interrupted(overrides) is None
    assert "its configuration is not this job's" in capsys.readouterr().err
    assert sweeps.interrupted({**overrides, "num-rounds": 2}) == folder  # its own: resumed, nothing said
    assert capsys.readouterr().err == ""


def _no_device(key, overrides):
    raise RuntimeError("device 'cuda' asked for, but torch sees no CUDA device")


def test_the_cli_exits_1_naming_each_failed_run_after_writing_the_report(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setattr(sweeps.Sweep, "worker", lambda self: _no_device)
    assert main(["sweep", str(_spec(tmp_path, SPEC))]) == 1
    err = capsys.readouterr().err
    assert "4 run(s) failed" in err and "fedavg-digits/s1/lr=0.1: RuntimeError: device 'cuda' asked for" in err
    assert (tmp_path / "out" / "runs.md").is_file() and not (tmp_path / "out" / "runs.jsonl").exists()


def test_the_cli_refuses_a_bad_spec_with_exit_2(tmp_path: Path, capsys):
    assert main(["sweep", str(_spec(tmp_path, {**SPEC, "select": "median"}))]) == 2
    assert "'select' = 'median'" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.yaml")]) == 2
    assert "'spec'" in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "table"), [
    ("feddle-fmnist", "feddle-fmnist/table.md"), ("feddle-animal", "feddle-animal/table.md"),
    ("feddle-animal-ablation", "feddle-animal/ablation.md"), ("feddle-fmnist-analysis", "feddle-fmnist/analysis.md"),
    ("fedmerge-fmnist", "fedmerge-fmnist/table.md"), ("feddual-fmnist", "feddual-fmnist/table.md"),
    ("mixing-fmnist", "mixing-fmnist/table.md"),
    ("feddle-fmnist-async-corrected", "feddle-fmnist/async-corrected.md"),
    ("feddle-fmnist-retune-corrected", "feddle-fmnist/retune-corrected.md")])
def test_the_reproduction_sweeps_regenerate_their_committed_tables_running_nothing(tmp_path: Path, spec, table):
    """Each family's spec reads its committed results (the digests of the runs as they were made: nothing is
    pending but what never ran) and writes its table as BENCHMARKS.md has it."""
    sweep = sweeps.load(ROOT / "benchmarks" / "sweeps" / f"{spec}.yaml")
    sweep = dataclasses.replace(sweep, report=tmp_path / "table.md",
                                results=ROOT / sweep.results if not sweep.results.is_absolute() else sweep.results)
    results = sweeps.load_results(sweep.results)
    assert results and not [key for key, _ in sweeps.pending(sweep.jobs(), results) if key in results]  # no re-run
    assert sweeps.report(sweep) + "\n" == (ROOT / "benchmarks" / "results" / table).read_text()


def test_the_report_says_where_each_candidates_runs_ran():
    """A results file may hold runs made here and on a lent GPU: their seconds are only comparable beside where."""
    sweep = sweeps.parse(SPEC, "s")
    (k1, _), (k2, _), (k3, _), (k4, _) = sweep.jobs()  # lr 0.05 / 0.1 at seed 0, then at seed 1
    run = lambda key, where, s: {"key": key, "test": 0.8, "val": 0.8, "seconds": s, **where}
    results = {k1: run(k1, {"hardware": "cpu"}, 100.0), k3: run(k3, {"hardware": "NVIDIA H200"}, 20.0),
               k2: run(k2, {}, 30.0), k4: run(k4, {}, 50.0)}
    rows = sweeps.table(results, sweep).splitlines()[4:]
    assert [r.split("|")[-2].strip() for r in rows] == ["60 (NVIDIA H200, cpu)", "40"]


def _md_tables(text: str, heading: str | None = None) -> list[list[list[str]]]:
    """The Markdown tables of `text` (of its section under `heading` where given) as rows of cell texts, without
    their bold marks."""
    if heading is not None:
        text = text.split(f"\n{heading}\n", 1)[1].split("\n" + heading.split(" ")[0] + " ", 1)[0]
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                rows.append([c.strip().strip("*") for c in line.strip().strip("|").split("|")])
        elif rows:
            tables, rows = [*tables, rows], []
    return tables


def _label(point: dict) -> str:
    """A candidate's label in a report."""
    return sweeps.Candidate(preset="", point=point, runs=[], seeds=0).label


@pytest.mark.parametrize("page", ["BENCHMARKS.md", "docs/results.md"])
def test_the_headline_is_the_reports_of_its_sweeps(page):
    """Every number of the headline's one-recipe column is the corrected sweep's committed report (which regenerates
    from its committed results, above), and the original recipe's column is the table's: a number copied by hand
    that differs from its report fails here."""
    results = ROOT / "benchmarks" / "results" / "feddle-fmnist"
    report, preset = {}, ""
    for row in _md_tables((results / "async-corrected.md").read_text())[0][1:]:
        preset = row[0] or preset
        report[preset.split("/")[1].removesuffix("-dir0.1-n20"), row[1]] = row[4]  # its test % column
    table = {row[0]: row[2] for row in _md_tables((results / "table.md").read_text())[0][1:]}  # Dir(0.1),N(20)
    headline = _md_tables("\n" + (ROOT / page).read_text(), "## Headline")[0]
    assert headline[0] == ["method", "hybridfl, one recipe", "original recipe", "paper"]
    rows = {row[0].split(" (")[0]: row for row in headline[1:]}
    assert sorted(rows) == sorted([*HEADLINE, "Center"])
    assert rows["Center"][1] == rows["Center"][2] == table["Center"]  # no client training: one number for both
    for label, (method, point) in HEADLINE.items():
        assert rows[label][1] == report[method, _label(point)], label
        # the original recipe: the table's row, or (FedAsync as a step along the update) its candidate without the
        # one recipe
        original = {k: v for k, v in point.items() if k not in RETUNED}
        assert rows[label][2] == (report[method, _label(original)] if original else table[label]), label
