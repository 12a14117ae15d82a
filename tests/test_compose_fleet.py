"""A fleet on the compose files (hybridfl/launch/compose_fleet.py): the generated file, as hybridfl and as Compose
itself read it, and the schedule's docker compose commands. The fleet on a real engine is `make compose-test`'s part
(f)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import compose_cli

from common.fleet import DeviceProfile, Fleet
from hybridfl.launch.compose import main
from hybridfl.launch.compose_file import compose_files, load, supernodes
from hybridfl.launch.compose_fleet import SHAPER_PORT, ComposeSchedule, fleet_services, write_fleet_file
from hybridfl.launch.shaper import parse_route

PHONE = DeviceProfile(name="phone", compute_s_per_example=0.004, overhead_s=0.5, down_bytes_per_s=1.5e6,
                      up_bytes_per_s=5e5, latency_s=0.05, drop=0.01, memory_mb=1500, cpus=0.5)
BOARD = DeviceProfile(name="board", compute_s_per_example=0.01, latency_s=0.2, windows=((0.0, 0.6), (1.2, 1e9)))
FLEET = Fleet("test", (PHONE, BOARD, PHONE), seed=7)


@pytest.mark.parametrize("host", [False, True])
def test_every_supernode_is_its_devices_reached_through_its_shaper_with_its_limits(host, tmp_path) -> None:
    files = compose_files(host=host)
    compose = load([*files, write_fleet_file(tmp_path / "fleet.yml", load(files), FLEET)])
    services = compose["services"]
    assert supernodes(compose) == ["supernode-0", "supernode-1", "supernode-2"]
    for i, device in enumerate(FLEET.devices):
        node, executor, shaper = (services[f"{s}-{i}"] for s in ("supernode", "superexec-clientapp", "shaper"))
        route = parse_route(shaper["command"][1])
        assert (route.listen_host, route.listen_port, route.target_port) == ("127.0.0.1", SHAPER_PORT + i, 8000)
        assert (route.link.latency_s, route.link.up_bytes_per_s, route.link.drop, route.link.seed) == (
            device.latency_s, device.up_bytes_per_s, device.drop, 7000 + i)
        command = node["command"]
        assert command[command.index("--superlink") + 1] == f"127.0.0.1:{SHAPER_PORT + i}"
        assert command[command.index("--auth-supernode-private-key") + 1] == f"/app/certs/supernode-{i}"
        assert command[command.index("--node-config") + 1] == (
            f"partition-id={i} num-partitions=3 compute-s-per-example={device.compute_s_per_example!r} "
            f"overhead-s={device.overhead_s!r}")
        port = command[command.index("--port") + 1]
        assert port == str(9094 + i) and f":{port}/health" in node["healthcheck"]["test"][-1]
        assert executor["command"][executor["command"].index("--runtime-api-address") + 1] == f"127.0.0.1:{port}"
        assert f"./certs/supernode-{i}.secret:/app/certs/supernode-{i}.secret:ro" in executor["volumes"]
        assert (executor.get("mem_limit"), executor.get("cpus")) == (
            (f"{device.memory_mb}m", device.cpus) if device.memory_mb else (None, None))
        namespace = "host" if host else f"service:shaper-{i}"
        assert node["network_mode"] == executor["network_mode"] == namespace and not node["networks"]
        assert set(executor["depends_on"]) == {f"shaper-{i}", f"supernode-{i}"}
    assert {f"./certs/supernode-{i}.pub:/app/certs/supernode-{i}.pub:ro" for i in range(3)} <= set(
        services["operator"]["volumes"])


def test_compose_itself_reads_the_fleet_file_as_hybridfl_does(tmp_path) -> None:
    files = compose_files()
    fleet_file = write_fleet_file(tmp_path / "fleet.yml", load(files), FLEET)
    out = subprocess.run([*compose_cli(), *(a for f in [*files, fleet_file] for a in ("-f", str(f))), "--profile",
                          "operator", "config", "--format", "json"], capture_output=True, text=True, check=True,
                         env={**os.environ, "FLWR_VERSION": "1.42.0"})
    theirs, ours = json.loads(out.stdout)["services"], load([*files, fleet_file])["services"]
    assert set(theirs) == set(ours)
    for name, svc in ours.items():
        assert theirs[name].get("command") == svc.get("command"), name
        assert theirs[name].get("network_mode") == svc.get("network_mode"), name
        assert not (svc.get("network_mode") and theirs[name].get("networks")), name
    assert int(theirs["superexec-clientapp-0"]["mem_limit"]) == PHONE.memory_mb * 2**20
    assert theirs["superexec-clientapp-0"]["cpus"] == PHONE.cpus and "mem_limit" not in theirs["superexec-clientapp-1"]


def test_a_users_fleet_file_is_mounted_where_the_run_names_it(tmp_path) -> None:
    user = tmp_path / "mine" / "fleet.yaml"
    user.parent.mkdir()
    out = fleet_services(load(compose_files()), FLEET, user)
    assert out["services"]["superexec-serverapp"]["volumes"] == [f"{user.parent}:{user.parent}:ro"]


@pytest.mark.parametrize("argv, says", [(["--fleet", "nope"], "fleet='nope'"), (["--fleet", "lognormal", "--nodes",
                                                                                   "0"], "'--nodes' = 0")])
def test_a_bad_fleet_fails_before_docker_is_asked_anything(argv, says, capsys) -> None:
    assert main(["check", *argv]) == 2
    assert says in capsys.readouterr().err


def test_the_schedule_stops_and_starts_both_of_a_devices_containers_by_its_windows(tmp_path) -> None:
    calls = tmp_path / "calls"
    fake_compose = [sys.executable, "-c", f"import sys; open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + "
                                          "'\\n')"]
    schedule = ComposeSchedule(FLEET, fake_compose, dict(os.environ))
    schedule.follow(lambda: True)
    time.sleep(2.0)  # device 1 offline from 0.6 s to 1.2 s
    schedule.halt()
    assert calls.read_text().splitlines() == ["stop --timeout 10 superexec-clientapp-1 supernode-1",
                                              "start supernode-1 superexec-clientapp-1"]
    run = tmp_path / "run"
    run.mkdir()
    report = schedule.close(run, {"supernode-1": 2})
    assert json.loads((run / "fleet.json").read_text()) == report
    assert [(d["starts"], d["stops"], d["docker-restarts"]) for d in report["devices"]] == [(1, 0, 0), (2, 1, 2),
                                                                                             (1, 0, 0)]
    assert report["total"]["stops"] == 1 and report["devices"][0]["profile"]["memory_mb"] == 1500
