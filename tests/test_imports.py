"""The packages' imports, walked from the source (every import statement, also inside functions): no cycle
between modules, and each layer imports only the layers below it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hybridfl.launch.bundle import PROJECT_DIR

PACKAGES = ("flower_internals", "common", "strategies", "server_app", "client_app", "hybridfl")
# What each package may import from the others: what hybridfl changes in Flower (flower_internals/) is the bottom,
# then common; a method's client side lives with its strategy, so the ClientApp imports strategies; the ServerApp
# never imports the ClientApp (they meet only through messages); the command, its launchers and the in-process
# engine, which runs both apps (hybridfl/), are the top.
ALLOWED = {"flower_internals": set(), "common": {"flower_internals"}, "strategies": {"flower_internals", "common"},
           "client_app": {"flower_internals", "common", "strategies"},
           "server_app": {"flower_internals", "common", "strategies"},
           "hybridfl": {"flower_internals", "common", "strategies", "client_app", "server_app"}}
# The one crossing: a device reads the preset its run names as the ServerApp reads it, to know which code the run
# declared (client_app/declared.py; imported only for a message that names code). server_app/presets.py imports
# nothing of the server (test below)
CROSSINGS = {("client_app.declared", "server_app.presets")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PROJECT_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports (``from pkg import name`` counts as ``pkg.name`` when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in PACKAGES}
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (PROJECT_DIR / pkg).rglob("*.py")}
    return {m: imports_of(p, set(files)) - {m} for m, p in files.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_the_packages():
    g = graph()
    assert "strategies.base" in g and "common.training" in g["strategies.base"]  # the walk sees real imports
    assert cycles(g) == []


MAX_MODULE_LINES = 450  # issue 71: a module past it holds more than one job


def test_no_module_of_the_installed_packages_is_over_450_lines():
    """A module that grows past MAX_MODULE_LINES is split by its jobs (docs/design/layout.md), not let grow."""
    lines = {module_name(p): len(p.read_text().splitlines())
             for pkg in PACKAGES for p in (PROJECT_DIR / pkg).rglob("*.py")}
    assert len(lines) > 50 and lines["server_app.runtime"] > 300  # the walk sees the real modules
    assert {m: n for m, n in lines.items() if n > MAX_MODULE_LINES} == {}


def test_the_installed_packages_are_the_layers_and_none_has_a_generic_name():
    """What the wheel installs at the top of site-packages: the four layers and the command's own package, which
    carries the project's name (a top-level `scripts` would collide with other projects' in a user's environment)."""
    wheel = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert sorted(wheel["packages"]) == sorted(PACKAGES)
    assert not (PROJECT_DIR / "scripts").exists()


def test_the_installed_packages_never_import_the_test_rig():
    """tools/ (the compose twin, the real-engine test, the intruder) is the checkout's, not the wheel's."""
    rig = {path.relative_to(PROJECT_DIR).as_posix() for pkg in PACKAGES for path in (PROJECT_DIR / pkg).rglob("*.py")
           if any(name == "tools" or name.startswith("tools.") for name in _imported_names(path))}
    assert rig == set()
    assert "tools.compose_twin" in {n for p in (PROJECT_DIR / "tests").glob("test_compose.py")
                                    for n in _imported_names(p)}  # the walk sees such imports


def _imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_each_package_imports_only_the_layers_below_it():
    wrong = sorted((m, i) for m, deps in graph().items() for i in deps
                   if i.split(".")[0] != m.split(".")[0] and i.split(".")[0] not in ALLOWED[m.split(".")[0]])
    assert set(wrong) <= CROSSINGS


def test_hybridfl_is_the_command_over_its_engine_launchers_and_sweeps():
    """hybridfl/'s own modules are the command (cli.py, its progress lines, its reference tables); its folders hold
    what the command drives (engine/, launch/, sweep/), and none of them imports the command: each is usable alone."""
    g = graph()
    top = {f"hybridfl.{p.stem}" for p in (PROJECT_DIR / "hybridfl").glob("*.py") if p.stem != "__init__"}
    assert top == {"hybridfl.cli", "hybridfl.progress", "hybridfl.config_table"}
    folders = {p.name for p in (PROJECT_DIR / "hybridfl").iterdir() if (p / "__init__.py").exists()}
    assert folders == {"engine", "launch", "sweep"}
    upward = sorted((m, i) for m, deps in g.items() if m.split(".")[:2] in (["hybridfl", f] for f in folders)
                    for i in deps if i in top)
    assert upward == []
    assert "hybridfl.launch.job" in g["hybridfl.cli"]  # the walk sees the command's imports


def test_a_device_checking_a_messages_code_imports_nothing_of_the_server():
    """A device reads its run's preset for every message that names code (client_app/declared.py): through the
    crossing it imports the presets alone, not the server's runtime and Flower's SuperLink (about 1 s a message on
    a device, where Flower starts a process per message)."""
    script = ("import sys; from client_app.declared import run_declared; "
              "names = run_declared((('preset', 'feddle-digits'), ('model', 'my_pkg.nets:mlp'))); "
              "print(sorted(names)); "
              "print(sorted(m for m in sys.modules if m.startswith(('server_app', 'flwr.superlink', 'sqlalchemy'))))")
    done = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    declared, server = (ast.literal_eval(line) for line in done.stdout.splitlines())
    assert declared == ["my_pkg.nets:mlp"]
    assert server == ["server_app", "server_app.presets"]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _code_words(path: Path, names: bool = True) -> set[str]:
    """The string constants of `path`'s code (docstrings and comments aside), and its identifiers unless `names` is
    false."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and names:
            words.add(node.id)
        elif isinstance(node, ast.Attribute) and names:
            words.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.add(node.value)
    return words


SHARED = ("__init__.py", "base.py", "client.py", "aggregation.py", "options.py", "robust.py")  # the shared base


def test_the_clientapp_and_the_serverapp_never_name_a_method_or_its_keys():
    """A method lives in its own file: no strategy or client-side name, strategy class, method option key or
    method-specific string (the string constants of a method's file that common/ does not use too) in the code of
    client_app/ or server_app/."""
    from common.config import specs_of
    from server_app.config import RunConfig
    from strategies import STRATEGIES

    names = {cls.__name__ for cls in STRATEGIES.values()} | {cls.client_side.__name__ for cls in STRATEGIES.values()}
    names -= {"ClientSide"}  # the contract's base
    method = {*STRATEGIES, *(key for cls in STRATEGIES.values() for key in specs_of(cls.Config))}
    method |= {w for p in (PROJECT_DIR / "strategies").glob("*.py") if p.name not in SHARED
               for w in _code_words(p, names=False) if re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", w)}
    common = {w for p in (PROJECT_DIR / "common").rglob("*.py") for w in _code_words(p)}
    contract = {"in-domain", "any", "none"}  # the server-data kinds
    method -= common | set(RunConfig.specs()) | contract
    found = {(str(p.relative_to(PROJECT_DIR)), w) for pkg in ("client_app", "server_app")
             for p in (PROJECT_DIR / pkg).rglob("*.py")
             for w in (_code_words(p, names=False) & method) | (_code_words(p) & names)}
    assert found == set()


def test_strategies_return_their_figures_as_data_and_never_draw():
    """A method's plots are data (common/figures.py); server_app/plots.py draws them."""
    drawing = sorted(str(p.relative_to(PROJECT_DIR)) for pkg in ("strategies", "common", "client_app")
                     for p in (PROJECT_DIR / pkg).rglob("*.py") if "matplotlib" in imports_anywhere(p))
    assert drawing == []
    assert "matplotlib" in imports_anywhere(PROJECT_DIR / "server_app" / "plots.py")  # the check sees real imports


def imports_anywhere(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, also inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_every_registered_strategy_is_importable_by_its_class_name_and_nothing_else_is():
    """strategies/ registers each method once, as its module is imported; the package hands out a registered class by
    its name (`from strategies import FedBuff`) and lists them all in __all__."""
    import strategies
    from strategies import STRATEGIES

    for cls in STRATEGIES.values():
        assert getattr(strategies, cls.__name__) is cls and cls.__name__ in strategies.__all__
    assert strategies.Ditto.name == "ditto"  # registered by the folder's import alone, never named in the package
    with pytest.raises(AttributeError, match="no attribute 'FedNope'"):
        strategies.FedNope  # noqa: B018
