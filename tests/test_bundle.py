"""The Flower app a launcher hands to ``flwr run`` (hybridfl/launch/bundle.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from flwr.cli.build import build_fab_from_disk

from hybridfl.launch.bundle import PROJECT_DIR, app_files, flower_app, source_checkout


def test_the_checkouts_app_is_a_copy_that_builds_the_very_fab_of_the_checkout():
    """`flwr run` on the copy sends the FAB that `flwr run .` in the checkout would (same bytes), from a folder
    without the checkout's .venv, outputs or site (which Flower would otherwise walk file by file)."""
    assert source_checkout() == PROJECT_DIR
    with flower_app() as folder:
        assert folder != PROJECT_DIR and not (folder / ".venv").exists() and not (folder / "outputs").exists()
        copied = hashlib.sha256(build_fab_from_disk(folder)).hexdigest()
    assert not folder.exists()
    assert copied == hashlib.sha256(build_fab_from_disk(PROJECT_DIR)).hexdigest()


def test_app_files_leave_out_what_the_gitignore_flower_and_git_leave_out_and_symbolic_links(tmp_path: Path):
    (tmp_path / ".gitignore").write_text("outputs/\n*.log\n!keep.log\n")
    for name in ["pyproject.toml", "pkg/a.py", "pkg/sub/b.yaml", "keep.log", "run.log", "outputs/x.json",
                 ".venv/lib/site.py", "pkg/__pycache__/a.pyc", ".flwr/config.toml", ".git/HEAD"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / "linked.py").symlink_to(tmp_path / "pkg" / "a.py")
    (tmp_path / "linked").symlink_to(tmp_path / "pkg")
    assert sorted(p.as_posix() for p in app_files(tmp_path)) == [
        ".gitignore", "keep.log", "pkg/a.py", "pkg/sub/b.yaml", "pyproject.toml"]


def test_a_users_app_folder_is_handed_over_as_it_is(tmp_path: Path):
    with flower_app(tmp_path) as folder:
        assert folder == tmp_path
