"""Device profiles and fleets (common/fleet.py) and the device time the runtime keeps with them: a message's
completion is its profile's arithmetic, offline devices are never dispatched to, a device vanishing mid-message is
counted, and the whole event sequence is fixed by the seed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml
from conftest import SMALL
from helpers import digest, rows

from common.config import ConfigError
from common.fleet import DeviceProfile, load_fleet, make_fleet
from common.models import build_from_config
from common.splits import client_sizes, data_spec, task_data
from server_app.config import load_config


def events(out) -> list[dict]:
    return rows(out, "events.jsonl")


def test_a_message_costs_latency_both_ways_transfers_and_compute():
    device = DeviceProfile(compute_s_per_example=0.01, overhead_s=0.5, down_bytes_per_s=1000.0,
                           up_bytes_per_s=250.0, latency_s=0.1)
    # 0.1 + 2000/1000 + 0.5 + 30·0.01 + 0.1 + 500/250
    assert device.message_s(30, 2000, 500) == pytest.approx(0.2 + 2.0 + 0.5 + 0.3 + 2.0)
    assert DeviceProfile().message_s(10**6, 10**9, 10**9) == 0.0  # the ideal device: no time at all


def test_windows_say_when_a_device_is_online():
    device = DeviceProfile(windows=((0.0, 10.0), (20.0, 30.0)))
    assert [device.online(t) for t in (0.0, 9.9, 10.0, 15.0, 20.0, 30.0)] == [True, True, False, False, True, False]
    assert (device.offline_at(5.0), device.next_online(12.0), device.next_online(25.0)) == (10.0, 20.0, 25.0)
    assert device.next_online(31.0) == math.inf
    assert DeviceProfile().offline_at(1e9) == math.inf


def test_a_fleet_is_drawn_by_seed_and_a_clients_device_does_not_depend_on_the_fleets_size():
    a, b, c = load_fleet("lognormal", 40, seed=0), load_fleet("lognormal", 40, seed=0), load_fleet("lognormal", 40, 1)
    assert a.devices == b.devices != c.devices
    assert load_fleet("lognormal", 10, seed=0).devices == a.devices[:10]
    speeds = np.array([d.compute_s_per_example for d in load_fleet("lognormal", 2000, seed=0).devices])
    # lognormal with median 0.004 and sigma 0.7: the log's mean and spread come back within sampling error
    assert np.median(speeds) == pytest.approx(0.004, rel=0.1)
    assert np.std(np.log(speeds)) == pytest.approx(0.7, rel=0.1)
    assert load_fleet("", 3, 0).ideal and not a.ideal


def test_shares_mix_device_classes():
    spec = {"devices": [{"name": "fast", "share": 3, "compute-s-per-example": 0.001},
                        {"name": "slow", "share": 1, "compute-s-per-example": 0.1}]}
    names = [d.name for d in make_fleet("mix", spec, 4000, seed=0).devices]
    assert names.count("fast") / len(names) == pytest.approx(0.75, abs=0.03)


def test_intermittent_devices_are_online_about_their_share_of_the_time():
    fleet = load_fleet("intermittent", 200, seed=0)
    t = np.linspace(0, 24 * 3600, 97)
    online = np.mean([[d.online(x) for x in t] for d in fleet.devices])
    assert online == pytest.approx(900 / (900 + 300), abs=0.05)  # mean online 900 s, offline 300 s


@pytest.mark.parametrize(("spec", "said"), [
    ({"devices": [{"name": "x", "speed": 1}]}, "unknown key(s) ['speed']"),
    ({"devices": [{"latency-s": -1}]}, "latency-s=-1"),
    ({"devices": [{"up-bytes-per-s": {"lognormal": {"median": 1}}}]}, "up-bytes-per-s"),
    ({"devices": [{"online-s": 10}]}, "'online-s' and 'offline-s' go together"),
    ({"devices": []}, "'devices': a list of device classes"),
    ({"devices": [{"share": 0}]}, "shares sum to 0"),
])
def test_a_bad_fleet_file_fails_at_start_naming_what_is_wrong(tmp_path, spec, said):
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="fleet") as err:
        load_config({**SMALL, "fleet": str(path)})
    assert said in str(err.value)


def test_a_missing_fleet_file_and_the_device_clock_without_a_fleet_are_refused_at_start(tmp_path):
    with pytest.raises(ConfigError, match="no file at"):
        load_config({**SMALL, "fleet": str(tmp_path / "nowhere.yaml")})
    with pytest.raises(ConfigError, match="clock"):
        load_config({**SMALL, "clock": "device"})


def trace_fleet(tmp_path, windows: dict[int, list[tuple[float, float]]], **device) -> str:
    (tmp_path / "windows.csv").write_text("client,start-s,end-s\n" + "".join(
        f"{c},{a},{b}\n" for c, ws in windows.items() for a, b in ws))
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"devices": [{"name": "traced", "trace": "windows.csv", **device}]}))
    return str(path)


CONSTANT = {"compute-s-per-example": 0.01, "overhead-s": 1.0, "down-bytes-per-s": 2.0e4, "up-bytes-per-s": 1.0e4,
            "latency-s": 0.25}
DEVICE = {**SMALL, "strategy": "fedbuff", "buffer-size": 2, "server-lr": 1.0, "clock": "device", "concurrency": 3,
          "clients-per-round": 2, "num-clients": 6, "num-rounds": 6}


def expected_seconds(overrides: dict, fleet) -> dict[int, float]:
    """Each client's message time by hand: its profile's arithmetic on its training size and the model's bytes."""
    cfg = load_config(overrides)
    sizes = client_sizes(data_spec(cfg))
    full = task_data(data_spec(cfg))
    model_bytes = 4 * sum(p.numel() for p in build_from_config(cfg.to_dict(), full.x.shape[1:], full.num_classes,
                                                                 seed=0).parameters())
    return {c: fleet.devices[c].message_s(sizes[c]["train"] * cfg.local_epochs, model_bytes, model_bytes)
            for c in sizes}


def test_the_device_clock_hands_updates_over_in_device_time_each_after_its_profiles_arithmetic(small_run, tmp_path):
    spec = {"devices": [{"name": "fast", **CONSTANT},
                        {"name": "slow", **CONSTANT, "compute-s-per-example": {"uniform": [0.05, 0.2]}}]}
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(spec))
    overrides = {**DEVICE, "fleet": str(tmp_path / "mix.yaml")}
    out, summary = small_run("a", **overrides)
    fleet = load_fleet(overrides["fleet"], 6, seed=0)
    seconds = expected_seconds(overrides, fleet)
    ev = events(out)
    assert {e["outcome"] for e in ev} == {"accepted"} and len(ev) >= 12
    for e in ev:
        assert e["device-t"] - e["device-start"] == pytest.approx(seconds[e["client"]], abs=1e-3)
    assert [e["device-t"] for e in ev] == sorted(e["device-t"] for e in ev)  # arrival order = device time order
    assert summary["device-time-s"] == rows(out)[-1]["device-t"] == pytest.approx(ev[-1]["device-t"], abs=1e-3)
    # a slot is refilled when it frees: every dispatch after the first three starts when an earlier message ended
    ends = {round(e["device-t"], 3) for e in ev}
    assert all(round(e["device-start"], 3) in ends for e in ev if e["device-start"] > 0)
    again, _ = small_run("b", **overrides)
    other, _ = small_run("c", **{**overrides, "seed": 1})
    assert events(again) == ev  # (the host's own times and node ids aside: helpers.rows)
    assert digest(out / "model.pt") == digest(again / "model.pt") != digest(other / "model.pt")


def test_synchronous_rounds_last_as_long_as_their_slowest_device(small_run, tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"devices": [{**CONSTANT, "compute-s-per-example": {"uniform": [0.01, 0.1]}}]}))
    overrides = {**SMALL, "strategy": "fedavg", "num-clients": 6, "clients-per-round": 3, "num-rounds": 4,
                 "fleet": str(path)}
    out, _ = small_run("sync", **overrides)
    seconds = expected_seconds(overrides, load_fleet(str(path), 6, seed=0))
    before = 0.0
    for row in rows(out)[1:]:  # (round 0: the first model's evaluation)
        clients = [e["client"] for e in events(out) if e["round"] == row["round"]]
        assert row["device-t"] == pytest.approx(before + max(seconds[c] for c in clients), abs=1e-3)
        before = row["device-t"]


def test_an_offline_device_is_never_dispatched_to_and_one_vanishing_mid_message_is_counted(small_run, tmp_path):
    # client 0 goes offline 1 s into the run (every message takes longer): its first message vanishes; clients 1–5
    # come and go; device time jumps over a moment when nobody idle is online
    windows = {0: [(0.0, 1.0)], 1: [(0.0, 50.0), (400.0, 1e6)], 2: [(0.0, 30.0), (200.0, 1e6)],
               3: [(100.0, 1e6)], 4: [(0.0, 1e6)], 5: [(0.0, 20.0), (60.0, 1e6)]}
    path = trace_fleet(tmp_path, windows, **CONSTANT)
    out, summary = small_run("intermittent", **{**DEVICE, "fleet": path, "num-rounds": 8})
    fleet = load_fleet(path, 6, seed=0)
    ev = events(out)
    for e in ev:
        assert fleet.devices[e["client"]].online(e["device-start"]), e  # dispatched only while online
    vanished = [e for e in ev if e["outcome"] == "vanished"]
    assert vanished and summary["total-vanished"] == len(vanished) == sum(r["vanished"] for r in rows(out))
    for e in vanished:  # lost the moment its device went offline, which was before the message could complete
        assert e["device-t"] == pytest.approx(fleet.devices[e["client"]].offline_at(e["device-start"]))
    assert any(e["client"] == 0 for e in vanished) and not any(
        e["client"] == 0 and e["outcome"] == "accepted" for e in ev)
    assert summary["total-accepted"] + len(vanished) == 8 * 2 and summary["total-failures"] == 0  # 8 rounds of 2


def test_the_virtual_clocks_device_time_never_goes_back_when_it_waits_for_a_device(small_run, tmp_path):
    # nobody is online from 10 s to 500 s: a round that finds no idle device online waits for the first to return
    windows = {c: [(0.0, 10.0), (500.0 + 10 * c, 1e6)] for c in range(4)}
    path = trace_fleet(tmp_path, windows, **{**CONSTANT, "down-bytes-per-s": 0, "up-bytes-per-s": 0})  # ~5 s each
    out, _ = small_run("waits", **{**SMALL, "strategy": "fedbuff", "buffer-size": 2, "server-lr": 1.0,
                                   "clients-per-round": 2, "delay-sigma": 2.0, "num-rounds": 24, "fleet": path})
    times = [r["device-t"] for r in rows(out)]
    assert times == sorted(times) and times[-1] > 500
    assert any(r["device-t"] < 10 for r in rows(out)[1:]) and any(e["outcome"] == "vanished" for e in events(out))
    fleet = load_fleet(path, 4, seed=0)
    for e in events(out):
        assert fleet.devices[e["client"]].online(e["device-start"]), e
