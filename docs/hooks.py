"""MkDocs hooks: the reference pages generated from the code at build time (mkdocs.yml ``hooks``), and the
measurements (BENCHMARKS.md, at the repository's root beside the code that made them) with their figures.

A page's ``<!-- generated: NAME -->`` line becomes what :data:`GENERATORS` makes of NAME: the command line from the
``hybridfl`` command itself, the methods from the strategy registry. An unknown NAME fails the build.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent

MARK = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.M)


def cli_reference() -> str:
    """Every ``hybridfl`` subcommand: its help, usage, arguments and options, read from the command's click tree."""
    import click
    import typer

    from hybridfl.cli import app

    def leaves(group: click.Group, ctx: click.Context, prefix: str = "") -> Any:
        """(name, command, context) of every command under `group`, a group's own (`superlink-db prune`) included."""
        for name, cmd in sorted(group.commands.items()):
            sub = click.Context(cmd, info_name=name, parent=ctx)
            if isinstance(cmd, click.Group):
                yield from leaves(cmd, sub, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}", cmd, sub

    root = typer.main.get_command(app)
    out = []
    with click.Context(root, info_name="hybridfl") as ctx:
        for name, cmd, sub in leaves(root, ctx):
            usage = " ".join(["hybridfl", name, *cmd.collect_usage_pieces(sub)])
            out += [f"## `hybridfl {name}`", "", (cmd.help or "").strip(), "", "```text", usage, "```", ""]
            rows = []
            for p in cmd.params:
                if p.name == "help":
                    continue
                kind = "argument" if isinstance(p, click.Argument) else "option"
                names = (", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts]) if kind == "option"
                         else f"`{p.human_readable_name}`")
                default = "" if p.required or p.default is None or p.default is False or p.default in ((), "") \
                    else f"`{p.default}`"
                text = (getattr(p, "help", None) or "").replace("|", "\\|").replace("\n", " ")
                rows.append(f"| {names} | {kind} | {default} | {text} |")
            if rows:
                out += ["| name | kind | default | meaning |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out)


def methods_reference() -> str:
    """Every registered strategy: its name, class and file, what its docstring says first, and its own keys."""
    from common.config import specs_of
    from strategies import STRATEGIES

    rows = ["| `strategy` | class | what it does | its keys |", "|---|---|---|---|"]
    for name, cls in sorted(STRATEGIES.items()):
        summary = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        keys = ", ".join(f"`{k}`" for k in specs_of(cls.Config)) or "none"
        rows.append(f"| `{name}` | `{cls.__name__}` (`{cls.__module__.replace('.', '/')}.py`) | "
                    f"{summary.replace('|', '/')} | {keys} |")
    return "\n".join(rows)


GENERATORS: dict[str, Callable[[], str]] = {"cli": cli_reference, "methods": methods_reference}


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    def fill(match: re.Match[str]) -> str:
        if match[1] not in GENERATORS:
            raise ValueError(f"{page.file.src_path}: no generator {match[1]!r} (known: {sorted(GENERATORS)})")
        return GENERATORS[match[1]]()

    return MARK.sub(fill, markdown)


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """BENCHMARKS.md as the page ``benchmarks.md``, and the figures it shows at the paths it names them by."""
    files.append(File.generated(config, "benchmarks.md", abs_src_path=str(ROOT / "BENCHMARKS.md")))
    for png in sorted((ROOT / "benchmarks" / "results").rglob("*.png")):
        files.append(File.generated(config, png.relative_to(ROOT).as_posix(), abs_src_path=str(png)))
    return files
