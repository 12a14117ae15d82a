"""The reference's key tables (docs/reference/configuration.md) and pyproject's ``[tool.flwr.app.config]``, generated
from the config dataclasses.

    python -m hybridfl.config_table            # print both
    python -m hybridfl.config_table --write    # rewrite them in the reference page and pyproject.toml

The run's keys come from ``server_app.config.RunConfig`` and the parts it inherits (method, data, model,
local recipe, runtime: ``server_app.config.PARTS``); method options from every registered strategy's
and client objective's ``Config`` (``server_app.config``). tests/test_config.py fails when the files
differ from what this prints, so a new option is documented and known to Flower (which only accepts
``-c`` keys that pyproject declares) the moment it is declared.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from common.config import OptionSpec, specs_of
from hybridfl.launch.bundle import PROJECT_DIR, pyproject_table, toml_value
from server_app.config import option_owners, option_specs, run_key_groups
from strategies import strategy_class

REFERENCE = "docs/reference/configuration.md"  # the page the key tables live in
BEGIN, END = "<!-- keys:begin (python -m hybridfl.config_table --write) -->", "<!-- keys:end -->"


def _default(value: Any) -> str:
    return '`""`' if value == "" else f"`{toml_value(value).strip(chr(34))}`"


def _row(spec: OptionSpec, *extra: str) -> str:
    cells = [f"`{spec.key}`", _default(spec.default), spec.allowed_text(), *extra,
             spec.doc.replace("|", "\\|")]
    return "| " + " | ".join(cells) + " |"


def _declared(cls: type) -> str:
    return f"`{cls.__name__}`, `{cls.__module__.replace('.', '/')}.py`"


def key_tables() -> str:
    """The markdown tables: the run's keys, one table per dataclass that declares them, then the method options
    with the methods that use them."""
    owners, lines = option_owners(), []
    for title, cls, specs in run_key_groups():
        lines += [f"{title} ({_declared(cls)}):", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        lines += [_row(spec) for spec in specs] + [""]
    lines += ["Method options (a strategy's or a client objective's own `Config`; a run whose method does not use "
              "one refuses it unless it is at its default):", "",
              "| key | default | allowed | used by | meaning |", "|---|---|---|---|---|"]
    lines += [_row(spec, ", ".join(f"`{o}`" for o in owners[key])) for key, spec in option_specs().items()]
    return "\n".join(lines)


def method_table(strategy: str) -> str:
    """One method's own keys (a registered name, or a user's ``module:Class``): its strategy's options, as the key
    table lists them (``hybridfl options``)."""
    cls = strategy_class(strategy)
    specs = specs_of(cls.Config)
    if not specs:
        return f"{strategy} ({_declared(cls)}) has no options of its own"
    return "\n".join([f"{strategy} ({_declared(cls)}):", "", "| key | default | allowed | meaning |",
                      "|---|---|---|---|", *(_row(spec) for spec in specs.values())])


def page_with_tables(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + key_tables() + "\n" + text[end:]


def pyproject_with_table(text: str) -> str:
    return re.sub(r"\[tool\.flwr\.app\.config\]\n(?:[^\[\n][^\n]*\n)*", lambda _: pyproject_table(), text, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the reference page and pyproject.toml")
    args = parser.parse_args(argv)
    if not args.write:
        print(key_tables() + "\n\n" + pyproject_table())
        return 0
    for name, rewrite in ((REFERENCE, page_with_tables), ("pyproject.toml", pyproject_with_table)):
        path = PROJECT_DIR / name
        path.write_text(rewrite(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
