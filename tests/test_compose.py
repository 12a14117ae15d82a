"""docker/: the compose files' structure, the translation of their commands, and their native twin end to
end (each service's exact command as a local process). The files on a real Docker engine are
`make compose-test` (tools/compose_engine.py); here, compose's own parser is compared with the twin's."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from helpers import compose_cli, needs_nginx

from hybridfl.engine.inprocess import run_inprocess
from hybridfl.launch import flwr_cli, processes
from hybridfl.launch.bundle import PROJECT_DIR
from hybridfl.launch.compose import CONNECTION, demo_run_config, main
from hybridfl.launch.compose_file import (
    COMPOSE_DIR,
    ComposeError,
    _merge,
    compose_files,
    interpolate,
    is_setup,
    load,
    on_demand,
    start_order,
    superlink_port,
    supernodes,
    validate,
)
from tools import compose_engine, intruder
from tools.compose_twin import Twin, twin
from tools.compose_twin import main as twin_main
from tools.probes import acquire_task_anonymously

# The twin stands in for the real engine: it stands down where `make compose-test` passed on this very tree, or where
# the engine test decides CI (.ci/run runs it before this suite and sets HYBRIDFL_ENGINE_TEST)
TWIN = pytest.mark.skipif(compose_engine.passed_here() or bool(os.environ.get("HYBRIDFL_ENGINE_TEST")),
                          reason="make compose-test passed on a real Docker engine for this very tree "
                                 "(outputs/compose-test/passed.json), or decides CI (HYBRIDFL_ENGINE_TEST)")


def secret_of(command: list[str]) -> str:
    return command[command.index("--superexec-auth-secret-file") + 1]


def test_the_compose_files_are_secure_by_default_and_plain_http_only_when_asked() -> None:
    secure, plain = load(compose_files()), load(compose_files(plain_http=True))
    assert start_order(secure["services"])[:3] == ["volume-owner", "link", "superlink"]
    assert supernodes(secure) == ["supernode-0", "supernode-1"]
    services = secure["services"]
    link, link_plain = services["superlink"], plain["services"]["superlink"]
    assert "--insecure" not in link["command"] and "--insecure" in link_plain["command"]
    assert {"--enable-supernode-auth", "--database", "--ssl-certfile"} <= set(link["command"])
    assert "https://localhost:9093/health" in link["healthcheck"]["test"][-1]
    # no port of the SuperLink outside the server's namespace (loopback only), which the ServerApp's SuperExec and
    # the operator's `flwr` share; the edge reaches it by a socket on a volume only the two of them mount; the
    # devices' port is the edge's, Fleet only
    for compose in (secure, plain):
        s = compose["services"]
        assert {n: svc["ports"] for n, svc in s.items() if svc.get("ports")} == {"edge": ["8000:8000"]}
        assert s["link"]["network_mode"] == "none"
        assert {n for n, svc in s.items() if svc.get("network_mode") == "service:link"} == {
            "superlink", "superexec-serverapp", "operator"}
        assert s["superlink"]["command"][s["superlink"]["command"].index("--host") + 1] == "127.0.0.1"
        assert s["operator"]["profiles"] == ["operator"]  # never started by `up`
        assert {n for n, svc in s.items() if any(v.startswith("socket:") for v in svc.get("volumes", []))
                } == {"link", "edge"}
        assert set(s["edge"]["networks"]) == {"devices"}
        for node in supernodes(compose):
            assert set(s[node]["networks"]) == {"devices"}  # no route to the SuperLink but through the edge
            assert s[node]["command"][s[node]["command"].index("--superlink") + 1] == "edge:8000"
    assert "./operator-plain-http.toml:/etc/hybridfl/operator.toml:ro" in plain["services"]["operator"]["volumes"]
    host = load(compose_files(host=True))["services"]
    assert {n for n, svc in host.items() if svc.get("network_mode") == "host"} == {
        "edge", *(f"{k}-{i}" for k in ("supernode", "superexec-clientapp") for i in range(2))}
    assert [v.split(":")[1] for v in services["edge"]["volumes"] if "hybridfl/launch/edge" in v] == [
        "/etc/hybridfl/edge/nginx.conf", "/etc/hybridfl/edge/listen.conf"]
    assert "../hybridfl/launch/edge/tls.conf:/etc/hybridfl/edge/listen.conf:ro" in services["edge"]["volumes"]
    assert ("../hybridfl/launch/edge/plain-http.conf:/etc/hybridfl/edge/listen.conf:ro"
            in plain["services"]["edge"]["volumes"])
    # every Runtime API and its SuperExec share one secret per trust boundary, in TLS and plain HTTP alike
    for compose in (secure, plain):
        s = compose["services"]
        pairs = [("superlink", "superexec-serverapp"), ("supernode-0", "superexec-clientapp-0"),
                 ("supernode-1", "superexec-clientapp-1")]
        assert all(secret_of(s[a]["command"]) == secret_of(s[b]["command"]) for a, b in pairs)
        assert len({secret_of(s[a]["command"]) for a, _ in pairs}) == 3
        assert all(s[a]["command"][s[a]["command"].index("--isolation") + 1] == "process" for a, _ in pairs)
    # a SuperNode's Runtime API is on its own loopback, reached by its SuperExec through its network namespace
    for i in range(2):
        node, executor = services[f"supernode-{i}"], services[f"superexec-clientapp-{i}"]
        assert node["command"][node["command"].index("--host") + 1] == "127.0.0.1"
        assert executor["network_mode"] == f"service:supernode-{i}"
        assert executor["command"][executor["command"].index("--runtime-api-address") + 1].startswith("127.0.0.1:")
    # a secret is mounted read-only, only into the two containers that share it
    mounts = {n: [v for v in svc.get("volumes", []) if v.endswith(".secret:ro")] for n, svc in services.items()}
    assert mounts["superlink"] == mounts["superexec-serverapp"] == [
        "./certs/superlink.secret:/app/certs/superlink.secret:ro"]
    for i in range(2):
        own = [f"./certs/supernode-{i}.secret:/app/certs/supernode-{i}.secret:ro"]
        assert mounts[f"supernode-{i}"] == mounts[f"superexec-clientapp-{i}"] == own
    assert mounts["volume-owner"] == mounts["edge"] == []
    gpu = load(compose_files(gpu=True))["services"]["superexec-serverapp"]
    assert gpu["image"].endswith("-cuda")
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert "--root-certificates" in gpu["command"]  # TLS still applies under the GPU override


def test_merge_replaces_a_volume_at_the_same_container_path() -> None:
    merged = _merge({"services": {"a": {"volumes": ["x:/data", "y:/state"], "command": ["--a"]}}},
                    {"services": {"a": {"volumes": ["./z:/data:ro"], "command": ["--b"]}}})
    assert merged["services"]["a"] == {"volumes": ["y:/state", "./z:/data:ro"], "command": ["--b"]}


def _broken(edit) -> dict:
    compose = interpolate(yaml.safe_load((COMPOSE_DIR / "compose.yml").read_text()))
    edit(compose["services"])
    return compose


@pytest.mark.parametrize("edit, says", [
    (lambda s: s["supernode-0"].update(image="redis:7"), "supernode-0: image 'redis:7'"),
    (lambda s: s["supernode-1"].update(image="flwr/supernode:1.41.0"), "share one version"),
    (lambda s: s["superlink"].update(command="--insecure"), "superlink: command must be a non-empty list"),
    (lambda s: s["superlink"].pop("healthcheck"), "waits for superlink to be healthy"),
    (lambda s: s["superexec-clientapp-0"].update(depends_on={"supernode-9": None}), "'supernode-9', which is not"),
    (lambda s: s["superlink"].update(depends_on={"superexec-serverapp": None}), "depends_on cycle"),
    (lambda s: s["superexec-serverapp"].update(volumes=["results:/app/outputs"]), "'results' is not declared"),
    (lambda s: s["superlink"].update(ports=["8000"]), "port '8000' must be [127.0.0.1:]HOST:CONTAINER"),
    (lambda s: s.pop("superexec-serverapp"), "no 'superexec-serverapp' service"),
])
def test_a_broken_compose_file_is_refused_naming_the_service(edit, says) -> None:
    with pytest.raises(ComposeError, match=re.escape(says)):
        validate(_broken(edit))


def test_the_twin_maps_addresses_ports_and_paths(tmp_path: Path, request) -> None:
    t = Twin(load(compose_files()), tmp_path)
    request.addfinalizer(t.close)
    node = t.command("supernode-1")
    link_port, node_port = t.port("edge", 8000), t.port("supernode-1", 9095)  # the devices reach the edge
    assert node[:2] == [sys.executable, str(PROJECT_DIR / "client_app" / "supernode.py")]  # warm: the mounted file
    assert node[node.index("--superlink") + 1] == f"127.0.0.1:{link_port}"
    assert node[node.index("--host") + 1] == "127.0.0.1" and node[node.index("--port") + 1] == str(node_port)
    assert t.port("supernode-1", 9095) == node_port  # under host networking each SuperNode needs its own port
    assert node[node.index("--auth-supernode-private-key") + 1] == str(tmp_path / "certs" / "supernode-1")
    assert node[node.index("--node-config") + 1] == "partition-id=1 num-partitions=2"
    assert t.port("supernode-0", 9094) not in (link_port, node_port)
    client = t.command("superexec-clientapp-1")  # in supernode-1's network namespace: its loopback port
    assert client[:2] == [sys.executable, str(PROJECT_DIR / "client_app" / "warm_executor.py")]
    assert f"127.0.0.1:{node_port}" in client
    assert secret_of(client) == secret_of(node) == str(tmp_path / "certs" / "supernode-1.secret")
    link = t.command("superlink")
    assert link[link.index("--database") + 1] == str(tmp_path / "volumes" / "superlink-state" / "superlink.db")
    assert link[link.index("--ssl-keyfile") + 1] == str(tmp_path / "certs" / "server.key")
    assert (PROJECT_DIR / "data").as_posix() in t.text("superexec-serverapp", "/app/data/x")
    stock = Twin(load(compose_files(flower_devices=True)), tmp_path)  # Flower's own device processes
    assert [Path(stock.command("supernode-1")[0]).name, stock.command("supernode-1")[1]] == [
        "flower-supernode", "--root-certificates"]
    assert [Path(stock.command("superexec-clientapp-1")[0]).name, stock.command("superexec-clientapp-1")[1]] == [
        "flower-superexec", "--insecure"]
    assert Path(stock.command("superlink")[0]).name == "flower-superlink"
    # the edge runs nginx on its mounted configuration, rendered with this machine's ports and paths
    if shutil.which("nginx", path="/usr/sbin:/usr/bin:/sbin") is not None:
        edge = t.command("edge")
        conf = Path(edge[edge.index("-c") + 1])
        assert conf == tmp_path / "files" / "edge" / "etc" / "hybridfl" / "edge" / "nginx.conf"
        socket = t.runtime / "socket" / "link.sock"
        assert f"server unix:{socket};" in conf.read_text()
        t.render("link")
        link_conf = tmp_path / "files" / "link" / "etc" / "hybridfl" / "link.conf"
        assert f"listen unix:{socket};" in link_conf.read_text()
        assert f"proxy_pass 127.0.0.1:{t.port('superlink', 9093)};" in link_conf.read_text()
        assert t.port("superlink", 9093) == t.port("link", 9093)  # one namespace, one loopback
        listen = (conf.parent / "listen.conf").read_text()
        assert f"listen 127.0.0.1:{link_port} ssl;" in listen and str(tmp_path / "certs" / "edge.key") in listen
        assert edge[edge.index("-p") + 1] == f"{tmp_path / 'volumes' / 'edge-state'}/"


def test_the_app_image_matches_the_compose_flower_version() -> None:
    tags = {s["image"].rsplit(":", 1)[1] for s in load(compose_files())["services"].values()
            if s["image"].startswith("flwr/")}
    text = (COMPOSE_DIR / "Dockerfile").read_text()
    assert re.search(r"^ARG FLWR_VERSION=(\S+)$", text, re.MULTILINE)[1] in tags
    assert 'ENTRYPOINT ["flower-superexec"]' in text and "torch==2.14.1 torchvision==0.29.1" in text
    pinned = [d for d in __import__("tomllib").loads((PROJECT_DIR / "pyproject.toml").read_text())["project"]
              ["dependencies"] if d.startswith("torch")]
    assert sorted(pinned) == ["torch==2.14.1", "torchvision==0.29.1"]


def test_variables_are_interpolated_as_compose_does(monkeypatch) -> None:
    assert interpolate({"a": ["x:${V:-1.0}", "${W}"], "b": 3}, {"V": "2.0"}) == {"a": ["x:2.0", ""], "b": 3}
    assert interpolate("${V:-1.0}", {"V": ""}) == "1.0"  # unset or empty: the default
    monkeypatch.setenv("FLWR_VERSION", "9.9.9")
    images = {s["image"] for s in load(compose_files())["services"].values()}
    assert images == {"flwr/superlink:9.9.9", "flwr/supernode:9.9.9", "hybridfl/app:9.9.9", "nginx:1.28"}


def test_the_volumes_are_handed_to_the_images_user_before_the_superlink_starts() -> None:
    services = load(compose_files())["services"]
    setup = [n for n, s in services.items() if is_setup(s)]
    assert setup == ["volume-owner"]
    owner = services["volume-owner"]
    assert owner["user"] == "root" and owner["entrypoint"][:2] == ["sh", "-c"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in owner["volumes"]}
    assert "chown 49999:49999 /app/state /app/outputs " in owner["entrypoint"][2]  # its mode: tests/test_linkdb.py
    assert set(mounted) == {"/app/state", "/app/outputs"}
    assert services["superlink"]["depends_on"]["volume-owner"] == {"condition": "service_completed_successfully"}
    for name, volume in (("superlink", "superlink-state"), ("superexec-serverapp", "outputs")):
        assert any(v.startswith(f"{volume}:") and v.split(":")[1] in mounted for v in services[name]["volumes"])


@pytest.mark.parametrize("plain, gpu, host, stock", [(False, False, False, False), (True, False, False, False),
                                                     (False, True, False, False), (True, False, True, False),
                                                     (False, False, True, False), (True, False, False, True)])
def test_the_twin_reads_the_files_as_compose_itself_does(plain, gpu, host, stock) -> None:
    """`docker compose config` (compose's own parser and merge, no engine needed) against the twin's load: the
    same services, images, commands, entrypoints, container paths, dependencies and healthchecks."""
    files = compose_files(plain, gpu, host, flower_devices=stock)
    out = subprocess.run([*compose_cli(), *(a for f in files for a in ("-f", str(f))), "--profile", "operator",
                          "config", "--format", "json"],
                         capture_output=True, text=True, check=True, env={**os.environ, "FLWR_VERSION": "1.42.0"})
    theirs = json.loads(out.stdout)["services"]
    ours = load(files)["services"]
    assert set(theirs) == set(ours)
    for name, svc in ours.items():
        their = theirs[name]
        assert their["image"] == svc["image"], name
        assert their.get("command") == svc.get("command"), name
        assert their.get("entrypoint") == svc.get("entrypoint"), name
        assert sorted(v["target"] for v in their.get("volumes", [])) == sorted(v.split(":")[1]
                                                                               for v in svc.get("volumes", [])), name
        assert set(their.get("depends_on", {})) == set(svc.get("depends_on") or {}), name
        assert (their.get("healthcheck") or {}).get("test") == (svc.get("healthcheck") or {}).get("test"), name
        assert len(their.get("ports") or []) == len(svc.get("ports") or []), name  # host-network.yml's !reset
        assert their.get("network_mode") == svc.get("network_mode"), name
        if host and svc.get("network_mode") == "host":
            assert not their.get("ports") and not their.get("networks"), name
            assert {"edge=127.0.0.1", "supernode-0=127.0.0.1", "supernode-1=127.0.0.1"} <= set(
                their["extra_hosts"]), name


def test_a_bad_run_config_fails_before_any_service_starts(tmp_path: Path, capsys) -> None:
    assert twin_main(["--workdir", str(tmp_path / "twin"), "num-rounds=0"]) == 2
    assert "'num-rounds' = 0" in capsys.readouterr().err
    assert not (tmp_path / "twin").exists()
    assert main(["demo", "rounds"]) == 2  # a malformed override, before Docker is asked anything
    assert "bad override 'rounds'" in capsys.readouterr().err
    assert main(["check", "--plain-http", "--gpu"]) == 0
    assert "warning: --plain-http" in capsys.readouterr().err


def test_the_job_fills_every_buffer_only_where_the_strategy_has_one() -> None:
    compose = load(compose_files())
    n = len(supernodes(compose))
    assert demo_run_config(compose, {})["buffer-size"] == n  # the main job (Feddle) steps on every SuperNode's update
    # else refused: FedAvg has no buffer
    assert "buffer-size" not in demo_run_config(compose, {"preset": "fedavg-digits"})
    fedbuff = {"preset": "fedavg-digits", "strategy": "fedbuff", "buffer-size": 1}
    assert demo_run_config(compose, fedbuff)["buffer-size"] == 1


def _summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


@pytest.mark.e2e
@TWIN
def test_the_compose_twin_runs_fedavg_through_a_superlink_restart_then_an_asynchronous_strategy(tmp_path: Path) -> None:
    """compose.yml natively, its secure default (TLS, SuperNode authentication, the Runtime APIs' secrets, the edge
    proxy on the devices' port): a process without the secrets is refused a task by the SuperLink and by a SuperNode
    (Flower's 401); while the FedAvg run runs, a process on the devices' port holding only ca.crt is refused every
    Control and Runtime call by the edge (tools/intruder.py), and its app runs nowhere, while the operator's `flwr` on
    the SuperLink's own port runs it everywhere afterwards. During the FedAvg run the SuperLink is killed after the
    first evaluated round and started again with the same command (its state in SQLite on the volume): the
    SuperNodes and the ServerApp reconnect through the edge and the run finishes with every update. Then a wall-clock
    FedAsync run on the same services."""
    needs_nginx(stream=True)
    restarted: list[float] = []
    anonymous: dict[str, object] = {}
    intrusion: dict[str, dict[str, str]] = {}
    marks = tmp_path / "marks"
    operator = processes.flower_env(tmp_path / "home" / "cli")

    def intrude(t: Twin) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "attempts" not in intrusion:
            listed = subprocess.run(["flwr", "ls", CONNECTION, "--format", "json"], env=operator, capture_output=True,
                                    text=True, check=False).stdout
            try:
                running = [int(r["run-id"]) for r in json.loads(listed)["runs"] if r["status"].startswith("running")]
            except (ValueError, KeyError):
                running = []
            if running:
                intrusion["attempts"] = intruder.attempts(t.port("edge", 8000), t.certs / "ca.crt",
                                                          tmp_path / "intruder", running[0], marks)
            time.sleep(1.0)

    def restart_superlink_mid_run(procs, t: Twin) -> None:
        threading.Thread(target=intrude, args=(t,), daemon=True).start()
        for service, port in (("superlink", 9093), ("supernode-0", 9094)):
            address = f"127.0.0.1:{t.port(service, port)}"
            anonymous[service] = acquire_task_anonymously(address, t.certs / "ca.crt" if service == "superlink"
                                                          else None)

        def watch() -> None:
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                metrics = list((tmp_path / "volumes" / "outputs").glob("*-0/metrics.jsonl"))
                if metrics and len(metrics[0].read_text().splitlines()) >= 2:  # round 0 and round 1 evaluated
                    procs.kill("superlink")
                    time.sleep(2)
                    procs.start("superlink-restarted", t.command("superlink"), t.env("superlink"))
                    restarted.append(time.monotonic())
                    return
                time.sleep(0.5)

        threading.Thread(target=watch, daemon=True).start()

    jobs = [{"preset": "fedavg-digits", "num-rounds": 3},
            {"preset": "fedavg-digits", "num-rounds": 3, "strategy": "fedasync", "clock": "wall", "concurrency": 2}]
    operator_run: list[str] = []

    def operator_starts_the_intruders_app(t: Twin) -> None:
        assert intruder.breaches(intrusion["attempts"], marks) == [], intrusion
        operator_run.append(intruder.operator_runs_it(operator, CONNECTION, marks))

    (sync, asyn), pids = twin(compose_files(), jobs, tmp_path, restart_superlink_mid_run,
                              operator_starts_the_intruders_app)  # raises unless completed
    assert all(got.startswith("refused") and "404" in got for got in intrusion["attempts"].values()), intrusion
    assert operator_run == ["finished:completed"]
    assert len(list(marks.glob("server-run-*"))) == 1 and len(list(marks.glob("node-*"))) == 2
    assert all(r is not None and r.status_code == 401 and "Authentication failed" in r.text
               for r in anonymous.values()) and len(anonymous) == 2, anonymous
    assert restarted, "the SuperLink was not restarted during the first run"
    assert sync.parent == asyn.parent == tmp_path / "volumes" / "outputs"
    assert _summary(sync)["final-version"] == 3 and _summary(sync)["total-accepted"] == 6
    assert [json.loads(line)["round"] for line in (sync / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert _summary(asyn)["strategy"]["strategy"] == "fedasync"
    assert _summary(asyn)["final-version"] == _summary(asyn)["total-accepted"] == 6  # one version per update
    assert (tmp_path / "volumes" / "superlink-state" / "superlink.db").is_file()
    assert "superexec-clientapp-1.log" in {p.name for p in (tmp_path / "logs").iterdir()}
    assert len(pids) >= 7


@pytest.mark.e2e
@TWIN
def test_the_plain_http_compose_twin_runs_the_demo_job_as_in_process(tmp_path: Path) -> None:
    """plain-http.yml natively (the Runtime APIs keep their secrets) on Flower's own device processes
    (flower-devices.yml; the other twin test and the engine test run the warm ones), running the demo's job
    (Feddle-ID, shortened): the virtual clock's run, the same arrivals and versions as in-process."""
    needs_nginx(stream=True)
    (run,), _ = twin(compose_files(plain_http=True, flower_devices=True), [{"num-rounds": 10}], tmp_path)
    reference = run_inprocess({**demo_run_config(load(compose_files()), {"num-rounds": 10}),
                               "output-dir": str(tmp_path / "ref")})
    summary = _summary(run)
    assert summary["strategy"]["strategy"] == "feddle" and summary["final-version"] >= 1
    for key in ("final-version", "total-accepted"):
        assert summary[key] == _summary(reference)[key]
    link_log = (tmp_path / "logs" / "superlink.log").read_text()
    assert "Uvicorn running on http://" in link_log
    assert len(set(re.findall(r"Activated node_id=(\d+)", link_log))) == 2


class FakeLink:
    """`run_status` answers from a script of replies (a status, or None for "unreachable"), on a fake clock;
    `flwr log --stream` lasts `stream_s` (0: it fails at once), and never past `ends_at`, the run's end."""

    def __init__(self, replies: list[str | None], stream_s: float = 0.0, ends_at: float = math.inf) -> None:
        self.replies, self.now, self.stream_s, self.ends_at, self.asked, self.followed = (
            replies, 0.0, stream_s, ends_at, 0, 0)

    def status(self, env, connection, run_id, flwr=None) -> str:
        self.asked += 1
        if self.now >= self.ends_at:
            return "finished:completed"
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if reply is None:
            raise RuntimeError("cannot read the status: Connection to the SuperLink is unavailable")
        return reply

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def follow(self, env, connection, run_id, timeout, flwr=None) -> float:
        self.followed += 1
        took = min(self.stream_s, self.ends_at - self.now, timeout)
        self.now += took
        return took

    def installed(self, monkeypatch) -> FakeLink:
        monkeypatch.setattr(flwr_cli, "run_status", self.status)
        monkeypatch.setattr(flwr_cli, "follow_log", self.follow)
        monkeypatch.setattr(flwr_cli.time, "sleep", self.sleep)
        monkeypatch.setattr(flwr_cli.time, "monotonic", lambda: self.now)
        return self


@pytest.mark.parametrize("replies, expected", [
    (["running", None, None, None, "running", "finished:completed"], "finished:completed"),  # a restart
    (["running", None], "unknown: the SuperLink has not answered for 30s (last status: running)"),  # gone
    (["finished:failed"], "finished:failed"),
    (["running"] * 3000 + ["finished:completed"], "finished:completed"),  # a user's run of 100 minutes: no cap
])
def test_the_final_status_outlives_a_superlink_restart_but_not_its_end(monkeypatch, replies, expected) -> None:
    """(Here the log stream fails at once, as it does while the SuperLink restarts: a status every 2 s.)"""
    FakeLink(replies).installed(monkeypatch)
    assert flwr_cli.final_status({}, "c", 1) == expected


def test_the_final_status_waits_on_the_runs_log_stream_not_a_status_every_two_seconds(monkeypatch) -> None:
    """A run that ends 600 s after its stream dropped: one `flwr log --stream` until its end and two asks, where a
    stream that fails at once leaves a status every 2 s; a stream cut early (a restart) is followed again, and a
    check's timeout bounds it."""
    whole = FakeLink(["running"], stream_s=math.inf, ends_at=600.0).installed(monkeypatch)
    assert flwr_cli.final_status({}, "c", 1) == "finished:completed"
    assert (whole.asked, whole.followed, whole.now) == (2, 1, 600.0)
    cut = FakeLink(["running"], stream_s=100.0, ends_at=600.0).installed(monkeypatch)
    assert flwr_cli.final_status({}, "c", 1) == "finished:completed" and (cut.asked, cut.followed) == (7, 6)
    failing = FakeLink(["running"], ends_at=600.0).installed(monkeypatch)
    assert flwr_cli.final_status({}, "c", 1) == "finished:completed" and failing.asked == 301
    bounded = FakeLink(["running"], stream_s=math.inf).installed(monkeypatch)
    assert flwr_cli.final_status({}, "c", 1, timeout=50) == "running" and 50 <= bounded.now <= 50 + flwr_cli.POLL_S


def test_flwr_run_gives_a_run_up_only_where_a_timeout_is_given(tmp_path, monkeypatch) -> None:
    """A check's bound ends a run that outlasts it; a user's run (no timeout) is waited for to its end."""
    (tmp_path / "bin").mkdir()
    flwr = tmp_path / "bin" / "flwr"  # `flwr run` starts run 7 and streams for 3 s; the Control API says it completed
    flwr.write_text('#!/bin/sh\nif [ "$1" = run ]; then echo "Successfully started run 7"; exec sleep 3; fi\nexit 1\n')
    flwr.chmod(0o755)
    monkeypatch.setattr(flwr_cli.control, "run_status", lambda home, connection, run_id: (
        ("finished:completed", "N/A") if (connection, run_id) == ("c", 7) else ("unknown", "N/A")))
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    with pytest.raises(RuntimeError, match="flwr run did not finish within 1s"):
        flwr_cli.flwr_run(env, "c", {}, timeout=1, app_dir=tmp_path)
    assert flwr_cli.flwr_run(env, "c", {}, app_dir=tmp_path) == (7, "finished:completed")


def test_the_engine_test_skips_where_no_engine_can_start_and_fails_so_under_require(monkeypatch, tmp_path,
                                                                                   capsys) -> None:
    """`make compose-test` on a machine that cannot run dockerd says why and skips; CI's --require fails."""
    from tools import compose_engine

    monkeypatch.setattr(compose_engine.os, "geteuid", lambda: 1000)
    assert compose_engine.main(["--workdir", str(tmp_path / "ct")]) == 0
    assert "SKIPPED: no Docker engine can run here: not root" in capsys.readouterr().out
    assert compose_engine.main(["--workdir", str(tmp_path / "ct"), "--require"]) == 1
    assert not (tmp_path / "ct").exists()  # nothing was started or written


def test_an_image_is_built_again_only_when_one_of_its_inputs_changed() -> None:
    """tools/compose_engine.py `build`: the first build labels the image with its inputs' digest; the same
    Dockerfile, arguments and inputs keep it (no `docker build`, which would hash the whole context); another
    argument, another input (a wheel, a base's key) or another Dockerfile builds it again."""
    labels: dict[str, str] = {}
    builds: list[tuple[str, ...]] = []

    class Engine:
        def docker(self, *args: str, **kw) -> subprocess.CompletedProcess:
            if args[:2] == ("image", "inspect"):
                known = args[-1] in labels
                return subprocess.CompletedProcess(args, 0 if known else 1, labels.get(args[-1], "") + "\n", "")
            builds.append(args)
            labels[args[args.index("-t") + 1]] = args[args.index("--label") + 1].split("=", 1)[1]
            return subprocess.CompletedProcess(args, 0, "", "")

    engine, args, inputs = Engine(), ["--build-arg", "FLWR_VERSION=1.42.0"], ["base-key", [("flwr.whl", 10)]]
    key, built = compose_engine.build(engine, "app:1", "docker/Dockerfile", args, inputs, timeout=1)
    assert built and len(builds) == 1 and labels["app:1"] == key
    assert compose_engine.build(engine, "app:1", "docker/Dockerfile", args, inputs, timeout=1) == (key, False)
    assert len(builds) == 1
    for changed in ((args + ["--target", "x"], inputs), (args, ["base-key", [("flwr.whl", 11)]]),
                    (args, ["another-base", [("flwr.whl", 11)]])):
        assert compose_engine.build(engine, "app:1", "docker/Dockerfile", *changed, timeout=1)[1]
    assert len(builds) == 4
    assert compose_engine.build(engine, "app:1", "docker/Dockerfile.flower", args,
                                ["another-base", [("flwr.whl", 11)]], timeout=1)[1]  # the last inputs, another file
    assert len(builds) == 5 and builds[-1][builds[-1].index("-f") + 1] == "docker/Dockerfile.flower"


def test_a_dockerd_that_dies_fails_the_engine_test_even_without_require(tmp_path, monkeypatch) -> None:
    """Only a machine where no engine can run skips; a dockerd that exits where it could run is a failure."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "dockerd").write_text("#!/bin/sh\necho 'failed to start daemon' >&2\nexit 3\n")
    (tmp_path / "bin" / "dockerd").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setattr(compose_engine, "compose_test", lambda workdir, keep_engine: compose_engine.Engine(
        tmp_path, tmp_path / "data").start(timeout=30))
    assert compose_engine.main(["--workdir", str(tmp_path / "work")]) == 1

    def cannot_run(workdir: Path, keep_engine: bool) -> None:
        raise compose_engine.Skip("not root")

    monkeypatch.setattr(compose_engine, "compose_test", cannot_run)
    assert compose_engine.main(["--workdir", str(tmp_path / "work")]) == 0
    assert compose_engine.main(["--workdir", str(tmp_path / "work"), "--require"]) == 1


def test_the_twin_stands_down_only_for_an_engine_pass_on_this_very_tree(tmp_path) -> None:
    assert not compose_engine.passed_here(tmp_path)  # no passed.json
    (tmp_path / compose_engine.PASSED).write_text(json.dumps({"tree": compose_engine.tree_digest()}))
    assert compose_engine.passed_here(tmp_path)
    (tmp_path / compose_engine.PASSED).write_text(json.dumps({"tree": "0" * 64}))  # another tree
    assert not compose_engine.passed_here(tmp_path)


def test_flower_processes_get_the_superexec_poll_unless_the_environment_sets_one(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", raising=False)
    assert processes.flower_env(tmp_path)["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.2"
    monkeypatch.delenv("TORCH_THREADS", raising=False)
    assert load(compose_files())["services"]["superexec-clientapp-0"]["environment"] == dict(
        [processes.SUPEREXEC_POLL, ("OMP_NUM_THREADS", "1")])
    monkeypatch.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "1.0")
    assert processes.flower_env(tmp_path)["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "1.0"


def test_every_app_container_gets_one_torch_thread_unless_torch_threads_says_else(monkeypatch) -> None:
    """The containers share one host's cores: a thread per core in each would oversubscribe them."""
    monkeypatch.delenv("TORCH_THREADS", raising=False)
    services = load(compose_files())["services"]
    apps = [name for name, svc in services.items() if svc.get("image", "").startswith("hybridfl/app")
            and not on_demand(svc)]  # the operator's `flwr` runs no torch
    assert {"superexec-serverapp", "superexec-clientapp-0", "superexec-clientapp-1"} <= set(apps)
    assert {services[name]["environment"]["OMP_NUM_THREADS"] for name in apps} == {"1"}
    monkeypatch.setenv("TORCH_THREADS", "4")
    assert load(compose_files())["services"]["superexec-clientapp-1"]["environment"]["OMP_NUM_THREADS"] == "4"


def test_the_operators_flwr_runs_in_the_operator_container_on_the_folder_it_is_called_from(monkeypatch, tmp_path):
    """`python -m hybridfl.launch.compose flwr [--plain-http] ARGS`: `docker compose run` of the `operator` service with
    the compose files the flags choose, the current folder mounted at its working directory, flwr's own arguments
    untouched; flwr's exit code is the command's."""
    import hybridfl.launch.compose as compose

    seen: list[list[str]] = []
    monkeypatch.setattr(compose.subprocess, "run", lambda argv, check: seen.append(argv) or
                        subprocess.CompletedProcess(argv, 3))
    monkeypatch.chdir(tmp_path)
    assert main(["flwr", "--plain-http", "run", ".", CONNECTION, "--stream", "--run-config", "num-rounds=2"]) == 3
    argv = seen[0]
    files = [argv[i + 1] for i, a in enumerate(argv) if a == "-f"]
    assert files == [str(COMPOSE_DIR / "compose.yml"), str(COMPOSE_DIR / "plain-http.yml")]
    at = argv.index("run")
    assert argv[at:at + 7] == ["run", "--rm", "-T", "--no-deps", "-v", f"{tmp_path}:/project:ro", "operator"]
    assert argv[at + 7:] == ["run", ".", CONNECTION, "--stream", "--run-config", "num-rounds=2"]
    services = load(compose_files(plain_http=True))["services"]
    assert services["operator"]["working_dir"] == "/project"
    assert "./operator-plain-http.toml:/etc/hybridfl/operator.toml:ro" in services["operator"]["volumes"]
    assert main(["flwr", "ls", CONNECTION]) == 3 and "plain-http.yml" not in " ".join(seen[1])
    assert main(["--plain-http", "flwr", "ls", CONNECTION]) == 3  # a flag before `flwr`: still the operator's flwr
    assert seen[2][-3:] == ["operator", "ls", CONNECTION] and "plain-http.yml" in " ".join(seen[2])
    for name, secure in (("operator.toml", True), ("operator-plain-http.toml", False)):  # the connection flwr uses
        conf = __import__("tomllib").loads((COMPOSE_DIR / name).read_text())["superlink"]
        port = superlink_port(load(compose_files()))
        assert conf["default"] == CONNECTION and conf[CONNECTION]["address"] == f"localhost:{port}"
        assert ("root-certificates" in conf[CONNECTION]) == secure and conf[CONNECTION].get("insecure", False) != secure
