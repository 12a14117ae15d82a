"""The suite's own machinery (tests/conftest.py): the CPU figure per test (where a cgroup can be made, it counts a
process the test started and orphaned, which os.times never sees), and the order the workers take tests in."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
from conftest import _GROUP, _own_cgroup, _TestCPU, pytest_collection_modifyitems, pytest_sessionstart

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"


def test_an_orphan_s_cpu_counts_in_the_tests_cgroup_and_not_in_os_times() -> None:
    if _own_cgroup() is None:
        pytest.skip("this host lets no test process make a cgroup (root, cgroup v1's cpuacct or v2)")
    cpu = _TestCPU()
    assert cpu.group is not None
    # the shell exits at once: its child, reparented to init, is never reaped by this process
    pid = int(subprocess.run(["sh", "-c", f'{sys.executable} -c "$0" > /dev/null 2>&1 & echo $!', BURN],
                             capture_output=True, text=True, check=True).stdout)
    deadline = time.monotonic() + 60
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    group = cpu.group
    seconds, measure = cpu.stop()
    assert measure == "cgroups" and seconds >= 0.5, seconds
    assert cpu._times() - cpu.started < 0.5  # what os.times saw: not the orphan
    assert not group.exists()  # removed once the test's processes are gone


def test_a_session_removes_the_groups_of_ended_sessions_and_keeps_a_live_ones() -> None:
    """A group an earlier session left (its process gone) is removed at a session's start, with a group nested in
    it; one whose session's process is alive (this one's) is kept."""
    own = _own_cgroup()
    if own is None:
        pytest.skip("this host lets no test process make a cgroup (root, cgroup v1's cpuacct or v2)")
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    gone, live = own[0] / f"{_GROUP}-{ended.pid}-0", own[0] / f"{_GROUP}-{os.getpid()}-999999"
    inner = gone / f"{_GROUP}-{ended.pid + 1}-0"
    for group in (gone, inner, live):
        group.mkdir()
    try:
        pytest_sessionstart(None)
        assert not gone.exists() and live.exists()
    finally:
        for group in (inner, gone, live):
            if group.exists():
                group.rmdir()


class _Item:
    """What the collection hook reads of a test: its id and its marks."""

    def __init__(self, nodeid: str, *marks: str) -> None:
        self.nodeid, self.marks = nodeid, marks

    def get_closest_marker(self, mark: str) -> object | None:
        return mark if mark in self.marks else None


def _config(**option: bool) -> SimpleNamespace:
    """A pytest config as the hook reads it: its options (``loadgroup`` set only on a `--dist loadgroup` worker)."""
    return SimpleNamespace(option=SimpleNamespace(**option))


def test_end_to_end_tests_go_first_and_the_late_ones_last_among_them() -> None:
    """A stable sort: end-to-end tests in their collected order, then those marked `late`, then the rest."""
    items = [_Item("unit-1"), _Item("load", "e2e", "late"), _Item("deploy", "e2e"), _Item("unit-2"),
             _Item("sim", "e2e")]
    pytest_collection_modifyitems(_config(), items)
    assert [i.nodeid for i in items] == ["deploy", "sim", "load", "unit-1", "unit-2"]


def test_a_worker_of_loadgroup_that_finds_a_grouped_test_without_its_group_stops_the_suite(capsys) -> None:
    """pytest-xdist gives a grouped test's id its group (``@name``) on each worker; where it did not (pytest 9.2 with
    xdist 3.8), each worker would make the group's module fixture again: the worker stops, naming a test. Outside a
    `--dist loadgroup` worker nothing is checked."""
    kept = [_Item("t.py::a@ray-cluster", "xdist_group"), _Item("t.py::b")]
    pytest_collection_modifyitems(_config(loadgroup=True), kept)
    lost = [_Item("t.py::b"), _Item("t.py::a", "xdist_group")]
    pytest_collection_modifyitems(_config(), list(lost))
    with pytest.raises(pytest.UsageError, match=r"lost the `xdist_group` of 1 tests \(e.g. t.py::a\)"):
        pytest_collection_modifyitems(_config(loadgroup=True), lost)
    assert "pytest-dev/pytest-xdist#1386" in capsys.readouterr().err
