"""docs/adding-a-method.md: its code is the real code, and its commands name a configuration that loads."""

from __future__ import annotations

import re
import shlex

from hybridfl.launch.bundle import PROJECT_DIR
from hybridfl.launch.job import parse_overrides
from server_app.config import load_config

GUIDE = PROJECT_DIR / "docs" / "adding-a-method.md"
SOURCES = [PROJECT_DIR / "strategies" / "scaffold.py", PROJECT_DIR / "strategies" / "ditto.py",
           PROJECT_DIR / "common" / "objectives.py", PROJECT_DIR / "tests" / "test_resume.py"]


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_every_code_excerpt_is_verbatim_in_the_source():
    sources = "\n".join(p.read_text() for p in SOURCES)
    excerpts = blocks("python")
    assert len(excerpts) == 12
    assert [e for e in excerpts if e not in sources] == []


def test_every_command_loads_a_valid_configuration():
    commands = [line.split("#")[0].strip() for b in blocks("bash") for line in b.splitlines() if "ARGS=" in line]
    assert len(commands) == 3
    for command in commands:
        args = shlex.split(command.split("ARGS=", 1)[1])[0]  # what make puts on the command line...
        cfg = load_config(parse_overrides(shlex.split(args)))  # ...and what its shell passes on
        assert cfg.strategy == "scaffold" and cfg.momentum == 0.0
