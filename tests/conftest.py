"""Shared fixtures: small, fast in-process runs."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from flwr.common.logger import FLOWER_LOGGER
from netns import enter_loopback_only, loopback_only

# One torch thread per test process (set before any test imports torch; the Flower processes a test starts inherit
# it): `make test` runs the suite on a worker per core (pytest-xdist), where several OpenMP threads per worker
# would contend for the same cores, and one thread gives every float comparison with a Flower run the same order of
# summation on both sides.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every Ray a test starts is its own: without it, ray.init() (a plain `flwr run .` simulation's) joins the cluster that
# tests/test_ray_cluster.py runs meanwhile on this machine; those tests name their cluster's address themselves
os.environ["RAY_ADDRESS"] = "local"


# Set in CI: a suite that cannot keep to loopback fails at its start rather than warning
REQUIRE_LOOPBACK = "HYBRIDFL_REQUIRE_LOOPBACK"


def pytest_configure(config: pytest.Config) -> None:
    """The whole suite in a network namespace whose one interface is loopback (tests/netns.py), made by the session's
    first process before it starts any other (pytest-xdist's workers share it): no test can send traffic to any
    address but loopback, and the Ray of every Flower simulation binds 127.0.0.1, as it does not outside one."""
    if hasattr(config, "workerinput") or loopback_only():
        return
    why = enter_loopback_only()
    if why is None:
        return
    message = f"the suite runs outside a loopback-only network namespace (root makes one): {why}"
    if os.environ.get(REQUIRE_LOOPBACK):
        raise pytest.UsageError(f"{message}, and {REQUIRE_LOOPBACK} is set (CI)")
    config.issue_config_time_warning(pytest.PytestConfigWarning(message), stacklevel=2)


@pytest.fixture(autouse=True)
def _quiet_flower():
    FLOWER_LOGGER.setLevel(logging.WARNING)
    yield
    FLOWER_LOGGER.setLevel(logging.INFO)


@pytest.fixture
def flower_log():
    """The messages Flower's logger takes during the test, INFO and up."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    FLOWER_LOGGER.addHandler(handler)
    FLOWER_LOGGER.setLevel(logging.INFO)
    yield seen
    FLOWER_LOGGER.removeHandler(handler)


SMALL = {"dataset": "synthetic", "num-clients": 4, "clients-per-round": 4, "num-rounds": 3, "local-epochs": 1,
         "batch-size": 16, "eval-every": 1}


@pytest.fixture
def small_run(tmp_path: Path):
    """Run the in-process engine on the synthetic set; returns (output folder, summary)."""
    from hybridfl.engine.inprocess import run_inprocess

    def run(name: str = "run", client_app=None, grid=None, **overrides: Any) -> tuple[Path, dict]:
        out = run_inprocess({**SMALL, "output-dir": str(tmp_path), "run-name": name, **overrides},
                            client_app=client_app, grid=grid)
        return out, json.loads((out / "summary.json").read_text())

    return run


@pytest.hookimpl(trylast=True)  # after pytest-xdist's, which gives a grouped test's id its group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """End-to-end tests first (a stable sort): they are the suite's long ones, and `make test`'s workers
    (pytest-xdist) take tests in this order, so one started near the end would keep the whole suite waiting on it.
    Those marked `late` last among them: in CI the suite starts beside the engine test's Docker fleet, at an eighth
    of the CPU (.ci/run), where a test bound by the wall clock gets too little of it (the fleet-load test's first
    update 80 s into its 60 s run, once)."""
    items.sort(key=lambda item: (item.get_closest_marker("e2e") is None, item.get_closest_marker("late") is not None))
    # A worker of `--dist loadgroup` (`make test`): the tests of one `xdist_group` must reach one worker, or each
    # worker that gets one builds the module's fixture again (the Ray cluster, the site, the wheel). pytest 9.2 with
    # pytest-xdist 3.8 drops the groups silently (pytest-dev/pytest-xdist#1386): said here instead
    if getattr(config.option, "loadgroup", False):
        lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if lost:
            why = (f"pytest-xdist lost the `xdist_group` of {len(lost)} tests (e.g. {lost[0]}), so each worker would "
                   "make their module's fixture again: this pytest and pytest-xdist do not keep a group on one worker "
                   "(pytest-dev/pytest-xdist#1386); install the versions of pyproject.toml's `test` extra")
            print(f"ERROR: {why}", file=sys.stderr, flush=True)  # the worker's error alone ends as an INTERNALERROR
            raise pytest.UsageError(why)


# CPU seconds per test: on 2 cores the suite is CPU-bound, so pytest's wall-clock --durations rank a test by the load
# beside it; these rank it by what it costs CI. Where this host lets a test process make a cgroup (root: cgroup v1's
# cpuacct or v2), each test runs in one of its own, and its figure is all that ran there: the test, the Flower
# processes it started and theirs, orphans included (a SuperExec's app processes, reparented to init when it is
# killed). Elsewhere it is the test's own and its reaped subprocesses' (os.times), a lower bound.
_CPU_KEY = "cpu_s"


def _own_cgroup() -> tuple[Path, str] | None:
    """This process's cpuacct (v1) or unified (v2) cgroup, and its CPU figure's file; None where none is writable."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            root, stat = Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage"
        elif controllers == "" and not Path("/sys/fs/cgroup/cpuacct").exists():
            root, stat = Path("/sys/fs/cgroup"), "cpu.stat"
        else:
            continue
        here = root / path.lstrip("/")
        if os.access(here, os.W_OK) and (here / stat).exists():
            return here, stat
    return None


def _cgroup_cpu_s(group: Path, stat: str) -> float:
    text = (group / stat).read_text()
    if stat == "cpuacct.usage":
        return int(text) / 1e9
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("usage_usec"))) / 1e6


_GROUP = "hybridfl-test"  # a test's cgroup: <_GROUP>-<the session process's pid>-<n>
_numbers = itertools.count()
_groups_left: list[Path] = []


class _TestCPU:
    """One test's CPU seconds: its own cgroup's, where one can be made, else os.times()'."""

    def __init__(self) -> None:
        self.group = self.home = None
        own = _own_cgroup()
        if own is not None:
            home, self.stat = own
            group = home / f"{_GROUP}-{os.getpid()}-{next(_numbers)}"
            try:
                group.mkdir()
                (group / "cgroup.procs").write_text(str(os.getpid()))
                self.group, self.home = group, home
            except OSError:  # e.g. v2's "no internal processes": fall back
                if group.exists():
                    group.rmdir()
        self.started = self._times()

    @staticmethod
    def _times() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def stop(self) -> tuple[float, str]:
        if self.group is None:
            return self._times() - self.started, "os.times, a lower bound"
        try:  # a measure never fails the suite: a cgroup gone or unreadable falls back
            seconds = _cgroup_cpu_s(self.group, self.stat)
            (self.home / "cgroup.procs").write_text(str(os.getpid()))
        except (OSError, ValueError, StopIteration):
            return self._times() - self.started, "os.times, a lower bound"
        try:
            self.group.rmdir()
        except OSError:  # a process the test left still ending: removed at the session's end
            _groups_left.append(self.group)
        return seconds, "cgroups"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    item.stash[_cpu_started] = _TestCPU()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    if call.when == "teardown" and _cpu_started in item.stash:
        outcome.get_result().user_properties.append((_CPU_KEY, item.stash[_cpu_started].stop()))


_cpu_started = pytest.StashKey[_TestCPU]()
_cpu_seen: dict[str, float] = {}
_cpu_measures: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == _CPU_KEY:
            _cpu_seen[report.nodeid], measure = value
            _cpu_measures.add(measure)


def pytest_sessionstart(session: pytest.Session) -> None:
    # groups an earlier session could not remove at its end (a process a test killed still ending there, or its
    # zombie, which this host's init may reap seconds later): removed once the session that made them is gone, with
    # the groups nested in them (a test that measures itself, as tests/test_suite_cpu.py's, makes one inside its
    # own), deepest first
    own = _own_cgroup()
    for group in own[0].glob(f"{_GROUP}-*-*") if own else ():
        try:
            os.kill(int(group.name.rsplit("-", 2)[1]), 0)
        except ProcessLookupError:
            for inner in [*sorted(group.rglob(f"{_GROUP}-*-*"), key=lambda g: -len(g.parts)), group]:
                with contextlib.suppress(OSError):
                    inner.rmdir()
        except (OSError, ValueError):
            pass


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for group in _groups_left:
        try:
            group.rmdir()
        except OSError:  # still holds a process: left for whoever looks, named, and for the next session
            print(f"conftest: {group} still holds {(group / 'cgroup.procs').read_text().split()}")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _cpu_seen:
        return
    slowest = sorted(_cpu_seen.items(), key=lambda kv: -kv[1])[:30]
    terminalreporter.write_sep("=", f"most CPU seconds (of {sum(_cpu_seen.values()):.0f} s in {len(_cpu_seen)} tests; "
                                  f"{' and '.join(sorted(_cpu_measures))})")
    for nodeid, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")
    by_file: dict[str, list[float]] = {}
    for nodeid, seconds in _cpu_seen.items():
        by_file.setdefault(nodeid.split("::")[0], []).append(seconds)
    terminalreporter.write_sep("-", "by file")
    for path, seconds in sorted(by_file.items(), key=lambda kv: -sum(kv[1]))[:15]:
        terminalreporter.write_line(f"{sum(seconds):8.1f}s cpu  {path} ({len(seconds)} tests)")
