"""Sweeps: many runs of presets over a grid of keys and seeds, in parallel (``--jobs`` processes here, or tasks on a
Ray cluster: docs/tutorials/ray.md), resumable, and chosen on validation.

A sweep spec is a YAML file (docs/how-to/sweeps-and-tracking.md; paths are relative to the folder you run from):

    runs:                              # blocks; a sweep's jobs are every block's, in order
      - presets: fedmerge-fmnist/{method}-{setting}   # a preset name, or a template over `vars`
        vars: {method: [fedavg, fedmerge], setting: [cluster, personal]}
        points: [{}, {atlas-size: 40}] # optional: candidates as listed ({} is the preset as it is) ...
        grid: {lr: [0.03, 0.1]}        # ... each through every combination of the grid; simplest first
        seeds: [0, 1]
        select: best                   # optional: this block's own rule
    overrides: {eval-every: 10}        # every run gets these (not part of its name)
    metric: max-last-5-evals           # the summary.json entry that scores a run on test ...
    val-metric: val-max-last-5-evals   # ... and on validation (default: val-<metric>), the only one selection reads
    select: one-se                     # per preset, the candidate the rule takes: one-se, best or none
    validation-samples: 525            # one seed's standard error: the samples behind a validation score where
                                       # the run config's validation-size is 0 (the clients' own splits)
    results: outputs/sweeps/x/runs.jsonl     # one line per finished run (default: outputs/sweeps/<spec name>/)
    report: outputs/sweeps/x/runs.md         # the table (default: beside the results, .md)
    run-dir: outputs/sweeps/x                # the runs' folders (default: the results' folder)
    record: mypkg.sweeps:fields        # optional, `module:function`: (run folder, summary, metrics rows) -> more fields
    table: mypkg.sweeps:table          # optional, `module:function`: (results, sweep) -> the report's markdown

A job is named ``<preset>/s<seed>[/k=v,...]`` (its grid point) and runs in ``<run-dir>/<name with _ for />``. Its
result is appended to `results` when it finishes, with the digest of its resolved configuration
(:func:`config_digest`); a job whose result is there with the same digest is not run again, one whose preset changed
since is, and a job interrupted mid-way (the session ended, the process was killed) resumes at its last checkpoint.
Several processes may share a results file. The one-standard-error rule takes, among a preset's candidates, the
first (in grid order) whose mean validation score is within one standard error of the best candidate's: the spread
of the best's seeds (sample std / √seeds) when it has two or more, else the binomial error √(p(1 − p)/n) of one
accuracy on its ``validation-size`` samples. Test scores are reported, never used to choose.
"""

from __future__ import annotations

from hybridfl.sweep.executors import (
    IMPORTABLE,
    Progress,
    RayPlace,
    RunsFailed,
    finished_run,
    hardware,
    interrupted,
    local_pool,
    plain,
    ray_pool,
    record,
    run_all,
)
from hybridfl.sweep.report import (
    Candidate,
    candidates,
    choices,
    choose,
    mean_std,
    plot,
    report,
    standard_error,
    table,
)
from hybridfl.sweep.spec import BLOCK_KEYS, SELECT_RULES, SPEC_KEYS, Block, Sweep, job, load, parse
from hybridfl.sweep.store import (
    UNDIGESTED,
    Job,
    Results,
    append,
    config_digest,
    current,
    digest,
    load_results,
    pending,
)

__all__ = ["BLOCK_KEYS", "IMPORTABLE", "SELECT_RULES", "SPEC_KEYS", "UNDIGESTED", "Block", "Candidate", "Job",
           "Progress", "RayPlace", "Results", "RunsFailed", "Sweep", "append", "candidates", "choices", "choose",
           "config_digest", "current", "digest", "finished_run", "hardware", "interrupted", "job", "load",
           "load_results", "local_pool", "mean_std", "parse", "pending", "plain", "plot", "ray_pool", "record",
           "report", "run", "run_all", "standard_error", "table"]


def run(sweep: Sweep, workers: int = 1, progress: Progress = plain, ray: RayPlace | None = None) -> str:
    """Run the sweep's jobs that have no current result (`workers` in parallel, or on the Ray cluster `ray`), then
    :func:`report` (also when some failed: then :class:`RunsFailed` follows)."""
    try:
        results = run_all(sweep.jobs(), sweep.results, workers, sweep.worker(), progress, ray)
    except RunsFailed:
        report(sweep)
        raise
    return report(sweep, results)
