"""The commands a page of docs/ gives a user, for the tests and the engine test that run them as written."""

from __future__ import annotations

from pathlib import Path


def bash_blocks(page: Path, section: str) -> list[str]:
    """The bash blocks, whole (heredocs and continuation lines as written), of `page`'s section whose heading
    starts with ``## `` + `section` (e.g. ``"3."``)."""
    part = page.read_text().split(f"\n## {section}")[1].split("\n## ")[0]
    return [block.split("```")[0].split("\n", 1)[1] for block in part.split("```bash")[1:]]
