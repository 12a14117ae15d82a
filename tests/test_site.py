"""The documentation site (mkdocs.yml, `make docs`): it builds with every warning an error, its reference names every
configuration key and every command, and it opens in a real browser (headless Chromium, Debian's package)."""

from __future__ import annotations

import functools
import html
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import typer

from hybridfl.cli import app
from hybridfl.launch.bundle import PROJECT_DIR
from hybridfl.launch.processes import free_port
from server_app.config import RunConfig, option_specs
from strategies import STRATEGIES

ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
pytestmark = pytest.mark.xdist_group("site")  # one worker builds the site (a module's fixture is per worker)


def build(project: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=project,
                          env={**ENV, "PYTHONPATH": str(PROJECT_DIR)}, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site() -> Path:
    """`make docs` as a user runs it (the README's command, the one build of the site in CI), into the checkout's
    site/; its install step taken as done (`-o`: this interpreter's environment is the installed one)."""
    done = subprocess.run(["make", "-o", ".venv/.installed-stamp", "docs", f"PY={sys.executable}"], cwd=PROJECT_DIR,
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return PROJECT_DIR / "site"


def cells(page: str, heading: str, table: int = 0) -> list[list[str]]:
    """The rows of the `table`-th table (from 0) after the heading with id `heading`, as cell texts."""
    found = re.search(rf'id="{heading}"' + r".*?<table>(.*?)</table>" * (table + 1), page, re.S)
    assert found, f"no table {table} after #{heading}"
    cell = re.compile(r"<t[dh][^>]*>(.*?)</t[dh]>", re.S)
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in cell.findall(row)]
            for row in re.findall(r"<tr>(.*?)</tr>", found[table + 1], re.S)]


def test_the_reference_is_generated_from_the_code(site):
    """Every configuration key from its one declaration, every subcommand from the command, every method from the
    registry, and the contracts from their docstrings."""
    config = (site / "reference" / "configuration.html").read_text()
    assert [k for k in [*RunConfig.specs(), *option_specs()] if f"<code>{k}</code>" not in config] == []
    cli = (site / "reference" / "cli.html").read_text()
    commands = typer.main.get_command(app).commands
    # a group's commands (superlink-db prune) under its name
    assert len(commands) == 9 and [c for c in commands if f"hybridfl {c}</code>" not in cli
                                   and f"hybridfl {c} " not in cli] == []
    assert "only presets whose name starts with this" in cli  # an argument's help reaches the page
    methods = (site / "methods" / "index.html").read_text()
    assert [n for n in STRATEGIES if f"<code>{n}</code>" not in methods] == []
    contracts = (site / "reference" / "contracts.html").read_text()
    for name in ("model_for", "receive", "ready", "step", "central_models", "prepare", "LocalTask", "build_user_model"):
        assert name in contracts, name


def test_a_broken_link_fails_the_build(tmp_path):
    """A copy of the site with one link to a page that does not exist fails `mkdocs build --strict`, naming the link
    (the copy as it is builds: the `site` fixture's build of the same files)."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(PROJECT_DIR / "docs", project / "docs")
    shutil.copy(PROJECT_DIR / "mkdocs.yml", project)
    shutil.copy(PROJECT_DIR / "BENCHMARKS.md", project)
    (project / "benchmarks").symlink_to(PROJECT_DIR / "benchmarks")
    page = project / "docs" / "how-to" / "resume.md"
    page.write_text(page.read_text() + "\nSee [the old page](../no-such-page.md).\n")
    done = build(project, tmp_path / "broken")
    assert done.returncode != 0 and "no-such-page.md" in done.stderr


def test_the_site_opens_in_a_browser_with_its_headline_table(site):
    """Served over HTTP on loopback, as a user previews it: Chromium renders the home page and the results page, whose
    headline table holds the main rows against the papers'."""
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("HYBRIDFL_REQUIRE_BROWSER"):
            pytest.fail("no Chromium, and HYBRIDFL_REQUIRE_BROWSER is set (CI): `apt-get install chromium`")
        pytest.skip("no Chromium: `make test` installs Debian's package when run as root (CI does)")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def dom(path: str) -> str:
        done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000",
                               "--dump-dom", base + path], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    try:
        home = dom("/index.html")
        assert "<title>hybridfl</title>" in home and 'href="results.html"' in home
        results = dom("/results.html")
    finally:
        server.shutdown()
    feddle, others = cells(results, "headline"), cells(results, "headline", table=1)
    assert feddle[0] == ["method", "hybridfl, one recipe", "original recipe", "paper"]
    fedft = next(r for r in feddle if r[0].startswith("Fed+FT"))
    assert fedft[2] == "88.2 ± 0.2" and fedft[3] == "84.5"  # the original recipe's column, kept
    assert {"Feddle-ID", "HFCL", "FedAsync (a step along the update Δ)"} <= {r[0] for r in feddle}
    assert others[0] == ["family", "setting", "method", "hybridfl", "paper"]
    assert {"FedMerge", "FedDUAL"} <= {r[2] for r in others}
