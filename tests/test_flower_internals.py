"""What hybridfl relies on under Flower's public API (flower_internals/): every internal each module names is in the
installed Flower, and nothing outside the package reaches under that API. A Flower that moves one fails here, naming
the module that relies on it and what moved."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
from pathlib import Path

import flwr
import pytest

import flower_internals
from hybridfl.launch.bundle import PROJECT_DIR

HERE = PROJECT_DIR / "flower_internals"
# Flower's public API (its API reference): what the rest of hybridfl may import
PUBLIC = ("flwr.app", "flwr.clientapp", "flwr.serverapp", "flwr.common")
PRODUCT = ("common", "strategies", "server_app", "client_app", "hybridfl")


def relies_on(path: Path) -> tuple[str, ...]:
    """The module's ``RELIES_ON``, read from its source (a module that no longer imports is still checked)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "RELIES_ON" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return ()


def missing(ref: str) -> str | None:
    """Why ``"module:attr.attr"`` does not resolve in this Flower, or None."""
    module, _, attrs = ref.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        return f"no module {module} ({err})"
    for name in attrs.split("."):
        try:  # statically: a class's property (TaskIdentity's) raises until set
            obj = inspect.getattr_static(obj, name)
        except AttributeError:
            return f"{module} has no {attrs}"
    return None


def flwr_imports(path: Path) -> set[str]:
    """``module:name`` of every ``from flwr... import name`` in `path` (``module`` for ``import flwr...``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flwr":
            found |= {f"{node.module}:{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "flwr"}
    return found


def public(ref: str) -> bool:
    module = ref.partition(":")[0]
    return module == "flwr" or any(module == p or module.startswith(p + ".") for p in PUBLIC)


@pytest.mark.parametrize("name", flower_internals.MODULES)
def test_every_internal_a_module_relies_on_is_in_this_flower(name: str) -> None:
    path = HERE / f"{name}.py"
    refs = relies_on(path)
    assert refs, f"flower_internals/{name}.py names no RELIES_ON"
    moved = [f"{ref}: {why}" for ref in refs if (why := missing(ref))]
    module = importlib.import_module(f"flower_internals.{name}")
    moved += getattr(module, "check", list)()
    assert not moved, (f"flwr {flwr.__version__} moved what flower_internals/{name}.py relies on:\n  "
                       + "\n  ".join(moved))


@pytest.mark.parametrize("name", flower_internals.MODULES)
def test_a_module_names_every_internal_it_imports(name: str) -> None:
    """An import from under Flower's public API is named in ``RELIES_ON`` (itself or an attribute of it)."""
    path = HERE / f"{name}.py"
    refs = relies_on(path)
    unnamed = sorted(ref for ref in flwr_imports(path) if not public(ref) and not any(
        r == ref or r.startswith((ref + ".", ref.replace(":", ".") + ":")) for r in refs))  # a module imported whole
    assert not unnamed, f"flower_internals/{name}.py imports {unnamed} without naming them in RELIES_ON"


def test_every_module_of_the_package_is_listed_and_nothing_else_reaches_under_flowers_api() -> None:
    assert sorted(p.stem for p in HERE.glob("*.py") if p.stem != "__init__") == sorted(flower_internals.MODULES)
    under = sorted(f"{p.relative_to(PROJECT_DIR)}: {ref}" for pkg in PRODUCT for p in (PROJECT_DIR / pkg).rglob("*.py")
                   for ref in flwr_imports(p) if not public(ref))
    assert not under, "outside flower_internals/, imports from under Flower's public API:\n  " + "\n  ".join(under)


def test_a_flower_that_moved_an_internal_is_named() -> None:
    """The check itself: an internal that is not there, and a module that is not, each say what is missing."""
    assert missing("flwr.supercore.superexec.run_superexec:get_executor") is None
    assert missing("flwr.supercore.superexec.run_superexec:no_such_thing") == (
        "flwr.supercore.superexec.run_superexec has no no_such_thing")
    assert missing("flwr.no_such_module:x").startswith("no module flwr.no_such_module")
    assert not public("flwr.supercore.run:Run") and public("flwr.common.constant:ErrorCode")


def test_a_key_that_cannot_be_registered_is_named_before_anything_is_sent(tmp_path: Path, monkeypatch) -> None:
    """flower_internals.control.register_keys reads every key first: a missing file, an RSA key and a file that is
    no key are each named, with why, before a connection is read (there is none here), and FLWR_HOME is left as it
    was."""
    from flower_internals.control import register_keys

    monkeypatch.setenv("FLWR_HOME", "/before")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    not_ec, broken = tmp_path / "rsa.pub", tmp_path / "broken.pub"
    not_ec.write_bytes(rsa.generate_private_key(65537, 1024).public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    broken.write_text("ecdsa-sha2-nistp384 AAAA-not-base64\n")
    for key, why in ((tmp_path / "absent.pub", "No such file"), (not_ec, "not an EC public key on a NIST curve"),
                     (broken, "")):
        with pytest.raises(RuntimeError, match=f"cannot register {key}: .*{why}"):
            register_keys(tmp_path / "home", "nowhere", [key])
    assert os.environ["FLWR_HOME"] == "/before"
    from hybridfl.launch.pki import node_key  # a good key: a home without the connection is named too

    good = Path(f"{node_key(tmp_path, 'good')}.pub")
    with pytest.raises(RuntimeError, match=f"cannot register {good}: .*nowhere"):
        register_keys(tmp_path / "home", "nowhere", [good])
    assert os.environ["FLWR_HOME"] == "/before"


def test_a_runs_status_is_flwr_ls_s_text_read_from_the_control_api(tmp_path: Path, monkeypatch, capsys) -> None:
    """flower_internals.control.run_status: Flower's ListRuns answer as `flwr ls --format json` words it (status and
    sub-status joined, details or N/A), from the connection of the given home; a missing connection, a SuperLink
    that does not answer and a run it does not know are RuntimeErrors naming the run; FLWR_HOME is left as it was,
    and Flower's "Using SuperLink" line is not printed (a launcher may ask more than once)."""
    from flwr.cli import utils as cli_utils
    from flwr.proto.control_pb2 import ListRunsResponse  # pylint: disable=E0611
    from flwr.proto.run_pb2 import Run, RunStatus  # pylint: disable=E0611

    from flower_internals import control
    from hybridfl.launch.flwr_cli import write_connection
    from hybridfl.launch.processes import free_port

    monkeypatch.setenv("FLWR_HOME", "/before")
    with pytest.raises(RuntimeError, match="cannot read the status of run 7: .*nowhere"):
        control.run_status(tmp_path / "home", "nowhere", 7)
    write_connection(tmp_path / "home", "closed", free_port())  # nothing listens there
    said = cli_utils.log_superlink_connection
    with pytest.raises(RuntimeError, match="cannot read the status of run 7: Connection to the SuperLink is unavail"):
        control.run_status(tmp_path / "home", "closed", 7)
    assert "Using SuperLink" not in capsys.readouterr().out and cli_utils.log_superlink_connection is said
    assert os.environ["FLWR_HOME"] == "/before"

    at = "2026-12-06T10:00:0{}.000000+00:00"
    runs = {7: Run(run_id=7, pending_at=at.format(0), running_at=at.format(1), finished_at=at.format(5),
                   status=RunStatus(status="finished", sub_status="failed", details="ServerApp exited"))}
    asked: list[tuple[str | None, int]] = []

    class Client:
        def ListRuns(self, request):  # Flower's name
            asked.append((os.environ.get("FLWR_HOME"), request.run_id))
            return ListRunsResponse(run_dict={k: v for k, v in runs.items() if k == request.run_id},
                                    now=at.format(6))

        def close(self) -> None:
            pass

    monkeypatch.setattr(control, "read_superlink_connection", lambda name: name)
    monkeypatch.setattr(control, "init_http_client_from_connection",
                        lambda connection: asked.append((os.environ["FLWR_HOME"], connection)) or Client())
    assert control.run_status(tmp_path / "home", "mine", 7) == ("finished:failed", "ServerApp exited")
    assert asked == [(str(tmp_path / "home"), "mine"), ("/before", 7)]  # the home for the connection only
    runs[7].status.CopyFrom(RunStatus(status="running"))
    assert control.run_status(None, "mine", 7) == ("running", "N/A")
    with pytest.raises(RuntimeError, match="cannot read the status of run 8: the SuperLink knows no such run"):
        control.run_status(None, "mine", 8)
