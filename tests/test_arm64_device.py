"""benchmarks/arm64_device.py's command without an emulated device (CI runs the device itself, .ci/run): what
--host-only and --skip-unsupported decide."""

from __future__ import annotations

import pytest

from benchmarks import arm64_device


def _unsupported() -> None:
    raise arm64_device.Unsupported("needs qemu-aarch64 registered in binfmt_misc")


def _no_build(*args: object) -> None:
    raise AssertionError("--host-only built the userland")


def test_host_only_checks_the_host_and_builds_nothing(monkeypatch, capsys) -> None:
    monkeypatch.setattr(arm64_device, "check_host", lambda: None)
    monkeypatch.setattr(arm64_device, "rootfs", _no_build)
    assert arm64_device.main(["--host-only"]) == 0
    assert "can emulate an arm64 device" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "code"), [([], 1), (["--skip-unsupported"], 0)])
def test_a_host_that_cannot_emulate_says_why_and_fails_unless_told_to_skip(monkeypatch, capsys, flags, code) -> None:
    monkeypatch.setattr(arm64_device, "check_host", _unsupported)
    monkeypatch.setattr(arm64_device, "rootfs", _no_build)
    assert arm64_device.main(["--host-only", *flags]) == code
    err = capsys.readouterr().err
    assert "needs qemu-aarch64 registered in binfmt_misc" in err and ("SKIPPED" in err) == bool(code == 0)


@pytest.mark.parametrize(("override", "named"), [("data-fraction=1.5", "data-fraction"),
                                                  ("data-fraction", "data-fraction"), ("num-rounds=3", "--rounds")])
def test_a_bad_run_config_override_exits_2_naming_it_before_anything_is_built(monkeypatch, capsys, override,
                                                                              named) -> None:
    """Out of range, not KEY=VALUE, or a key the command sets itself (silently replaced otherwise)."""
    monkeypatch.setattr(arm64_device, "check_host", lambda: None)
    monkeypatch.setattr(arm64_device, "rootfs", _no_build)
    assert arm64_device.main(["--models", "digits", override]) == 2
    assert named in capsys.readouterr().err


def test_the_device_check_runs_again_only_when_the_userlands_venv_is_not_of_these_requirements(monkeypatch,
                                                                                                tmp_path) -> None:
    """Resolving requirements/device.txt for aarch64 again (~45 s against PyPI) changes nothing a run uses once the
    userland's venv was installed from them: it is skipped then, and run for a venv of other requirements or none."""
    made: list[list[str]] = []
    monkeypatch.setattr(arm64_device, "sh", lambda cmd, log, **kw: made.append(cmd) or 1.5)
    root, cache = tmp_path / "rootfs", tmp_path / "cache"
    folder = cache / "wheels" / "aarch64"
    folder.mkdir(parents=True)
    (folder / "device.lock").write_text("torch==2.14.1\n")
    (folder / "torch-2.14.1-cp311-cp311-manylinux_2_28_aarch64.whl").write_bytes(b"x" * 10)
    stamp = arm64_device._arm64_stamp(root)
    stamp.parent.mkdir(parents=True)
    for written, runs in (("another digest", True), (arm64_device.requirements_digest(), False)):
        stamp.write_text(written)
        made.clear()
        assert arm64_device.wheels(cache, tmp_path / "log", root) == (folder, 10, 1.5 if runs else 0.0)
        assert bool(made) == runs and all("device-check" in cmd for cmd in made)
