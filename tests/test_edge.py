"""The edge (hybridfl/launch/edge, real nginx) in front of a real SuperLink started with the compose file's security
flags, on loopback, against a stranger holding only ca.crt (tools/hostile_client.py): oversized uploads are refused at
the edge and the SuperLink's memory stays where it was; stalled uploads from one address are capped per client and
timed out, while a registered device behind the edge trains through a run; the edge's TLS and banner."""

from __future__ import annotations

import json
import re
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from helpers import needs_nginx

from hybridfl.cli import main
from hybridfl.launch import edge
from hybridfl.launch.deploy_local import EXECUTORS, runtime_api, superexec
from hybridfl.launch.flwr_cli import flwr_run, register_supernode, write_connection
from hybridfl.launch.pki import make_pki
from hybridfl.launch.processes import ProcessGroup, flower_env, free_port, wait_healthy
from tools import hostile_client as attacker

FLEET = 4  # devices per address the test's edge is sized for: its per-client cap is 3 x 4 connections
CAP = edge.CONNS_PER_DEVICE * FLEET
STALLS = 60  # stalled uploads the attacker opens at once, five times the cap
RUN = {"dataset": "synthetic", "num-clients": 1, "clients-per-round": 1, "num-rounds": 2, "local-epochs": 1,
       "batch-size": 16, "eval-every": 1, "run-name": "edge"}


def test_the_rendered_limits_follow_the_fleet_and_the_body_limit_and_the_shipped_copy_is_the_default(tmp_path: Path
                                                                                                   ) -> None:
    shipped = (Path(edge.__file__).parent / "nginx.conf").read_text()
    default = edge.write(tmp_path / "default", Path("/app/certs"), edge.SUPERLINK).read_text()
    assert default == shipped  # the compose file's copy holds `hybridfl edge`'s defaults
    text = edge.write(tmp_path / "sized", tmp_path, fleet_size=50, max_body_mib=20).read_text()
    for line in ("worker_connections 1024;", "worker_rlimit_nofile 2048;", "rate=100r/s;",
                 "limit_conn per_client_conns 150;", "burst=3200 nodelay;", "client_max_body_size 20m;",
                 "client_max_body_size 1m;", "server_tokens off;", "proxy_request_buffering on;"):
        assert line in text, line
    assert "rate=60r/s;" in shipped and shipped.count("zone=link_rate burst=60;") == 2
    text = edge.write(tmp_path / "link", tmp_path, link_rate=7).read_text()
    assert "zone=link_rate:1m rate=7r/s;" in text and text.count("zone=link_rate burst=7;") == 2
    for bad, says in (({"fleet_size": 0}, "--fleet-size 0"), ({"max_body_mib": 5}, "--max-body-mib 5"),
                      ({"link_rate": 0}, "--link-rate 0")):
        with pytest.raises(ValueError, match=says):
            edge.write(tmp_path / "bad", tmp_path, **bad)


def test_every_route_that_sets_the_link_rate_keeps_the_per_address_rate(tmp_path: Path) -> None:
    """nginx replaces an inherited ``limit_req`` wherever a location sets its own: each location limited by the
    link rate restates the per-address rate, and only the asks for work (pulls, activations) are limited by it."""
    text = edge.write(tmp_path / "edge", tmp_path, fleet_size=50).read_text()
    limited = []
    for route, body in re.findall(r"location = (\S+) \{(.*?)\n        \}", text, re.S):
        if "zone=link_rate" in body:
            limited.append(route)
            assert "limit_req zone=per_client_rate burst=3200 nodelay;" in body, route
    assert limited == ["/v1/fleet/pull-messages", "/v1/fleet/activate-node"]


class _Upstream(BaseHTTPRequestHandler):
    """A SuperLink's stand-in: answers every request at once."""

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    do_GET = do_POST = _answer

    def log_message(self, *_: object) -> None:
        pass


class _SlowUpstream(_Upstream):
    """A saturated SuperLink's stand-in: each answer takes 0.5 s; counts the requests other than heartbeats it holds
    at once."""

    lock, now, most = threading.Lock(), 0, 0

    def _answer(self) -> None:
        cls, counted = type(self), not self.path.endswith("heartbeat")
        with cls.lock:
            cls.now += counted
            cls.most = max(cls.most, cls.now)
        time.sleep(0.5)
        with cls.lock:
            cls.now -= counted
        super()._answer()

    do_GET = do_POST = _answer


def test_the_edge_holds_at_most_48_of_the_devices_requests_in_the_superlink_and_never_refuses_a_heartbeat(
        tmp_path: Path) -> None:
    """150 requests at once that complete work under way (no rate applies to them), against a SuperLink that takes
    0.5 s each: the SuperLink holds at most 48 at once (every further one would be a connection of its own: a TLS
    handshake in its one loop), the rest are answered 502 at once, which Flower's client retries; 40 heartbeats sent
    meanwhile all pass, on connections of their own."""
    needs_nginx()
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _SlowUpstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    conf = edge.write(tmp_path / "edge", tmp_path, f"127.0.0.1:{upstream.server_port}", f"127.0.0.1:{port}",
                      plain_http=True, fleet_size=100)
    try:
        env = flower_env(tmp_path / "home")
        with ProcessGroup(tmp_path / "logs", env) as procs:
            nginx = procs.start("edge", edge.command(conf), {**env, "PATH": f"{env['PATH']}:/usr/sbin:/sbin"})
            wait_healthy(port, nginx, 30)

            def fates(route: str, count: int) -> list[int]:
                with httpx.Client(timeout=30, limits=httpx.Limits(max_connections=count)) as client, \
                        ThreadPoolExecutor(count) as pool:
                    return list(pool.map(lambda _: client.post(f"http://127.0.0.1:{port}{route}",
                                                               content=b"x").status_code, range(count)))

            with ThreadPoolExecutor(1) as meanwhile:
                work = meanwhile.submit(fates, "/v1/fleet/pull-object", 150)
                time.sleep(0.2)
                beats = fates("/v1/fleet/send-node-heartbeat", 40)
                work = work.result()
    finally:
        upstream.shutdown()
    print(f"150 requests at once: {work.count(200)} passed, {work.count(502)} answered 502; the SuperLink held "
          f"{_SlowUpstream.most} at most; heartbeats: {sorted(set(beats))}")
    assert set(work) == {200, 502} and _SlowUpstream.most <= 48  # a 502 only once nginx held 48
    assert beats == [200] * 40


def test_past_the_link_rate_the_edge_answers_503_to_asks_for_work_but_passes_work_under_way(tmp_path: Path
                                                                                            ) -> None:
    """The SuperLink's rate in all (--link-rate): 40 asks for a message at once, from many devices' worth of
    address, pass at most the rate's burst (a second's worth, queued) and the rest are refused with 503, which
    Flower's client retries; right after, with the rate spent, 40 of each request that completes work under way
    (an object's upload or download, a receipt, a reply) and 40 heartbeats all pass, and an arrival is counted."""
    needs_nginx()
    rate, at_once = 5, 40
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    conf = edge.write(tmp_path / "edge", tmp_path, f"127.0.0.1:{upstream.server_port}", f"127.0.0.1:{port}",
                      plain_http=True, fleet_size=50, link_rate=rate)
    try:
        env = flower_env(tmp_path / "home")
        with ProcessGroup(tmp_path / "logs", env) as procs:
            nginx = procs.start("edge", edge.command(conf), {**env, "PATH": f"{env['PATH']}:/usr/sbin:/sbin"})
            wait_healthy(port, nginx, 30)  # /health is not counted in the rate

            def fates(route: str) -> list[int]:
                with httpx.Client(timeout=30, limits=httpx.Limits(max_connections=at_once)) as client, \
                        ThreadPoolExecutor(at_once) as pool:
                    return list(pool.map(lambda _: client.post(f"http://127.0.0.1:{port}{route}",
                                                               content=b"x").status_code, range(at_once)))

            started = time.monotonic()
            pulls = fates("/v1/fleet/pull-messages")
            elapsed = time.monotonic() - started
            under_way = {route: fates(f"/v1/fleet/{route}") for route in (
                "push-object", "pull-object", "confirm-message-received", "push-messages", "send-node-heartbeat")}
            arrivals = fates("/v1/fleet/activate-node")
    finally:
        upstream.shutdown()
    print(f"{at_once} pulls at once at --link-rate {rate}: {sorted(pulls)} in {elapsed:.2f} s; under way: "
          f"{ {k: sorted(set(v)) for k, v in under_way.items()} }; arrivals: {sorted(arrivals)}")
    assert set(pulls) == {200, 503}
    # the first, a second's worth queued (the burst), and what the rate adds while they wait
    assert rate <= pulls.count(200) <= 1 + rate + rate * elapsed + 1
    assert all(codes == [200] * at_once for codes in under_way.values()), under_way
    assert 503 in arrivals


def test_the_edge_has_a_certificate_and_key_of_its_own_from_the_same_ca(tmp_path: Path) -> None:
    """Devices verify the edge against ca.crt with the name they dial; the edge's host never holds the SuperLink's
    key. `hybridfl edge` asks for the edge's files, not the SuperLink's."""
    make_pki(tmp_path / "certs", ("edge", "devices.example"))
    ca = x509.load_pem_x509_certificate((tmp_path / "certs" / "ca.crt").read_bytes())
    own = x509.load_pem_x509_certificate((tmp_path / "certs" / "edge.crt").read_bytes())
    own.verify_directly_issued_by(ca)
    san = own.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["edge", "devices.example", "localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert (tmp_path / "certs" / "edge.key").read_bytes() != (tmp_path / "certs" / "server.key").read_bytes()
    assert (tmp_path / "certs" / "edge.key").stat().st_mode & 0o077 == 0
    (tmp_path / "certs" / "edge.key").unlink()
    assert main(["edge", str(tmp_path / "edge"), "--certs", str(tmp_path / "certs")]) == 2
    assert not (tmp_path / "edge" / "nginx.conf").exists()


@pytest.mark.e2e
def test_the_edge_refuses_oversized_and_stalled_uploads_while_a_registered_device_trains(tmp_path: Path) -> None:
    needs_nginx()
    started = time.monotonic()
    with attacker.server(tmp_path, nodes=1, fleet_size=FLEET) as server:
        # (a) unauthenticated uploads far over the limit, announced or chunked, on both routes that take bodies
        before = attacker.rss_mib(server.link_pid)
        got = {(route, mib, chunked): attacker.upload(server.edge_port, server.ca, f"/v1/fleet/{route}", mib, chunked)
               for route in ("push-messages", "push-object") for mib in (64, 256) for chunked in (False, True)}
        after = attacker.rss_mib(server.link_pid)
        print(f"SuperLink RSS before/after 8 oversized uploads through the edge: {before} -> {after} MiB; {got}")
        assert set(got.values()) <= {"413", "closed"}, got
        assert after["VmHWM"] - before["VmHWM"] < 64 and after["VmRSS"] - before["VmRSS"] < 64
        # ... while a device's largest request (one 5 MiB array chunk) passes the edge: the SuperLink answers it
        assert attacker.upload(server.edge_port, server.ca, "/v1/fleet/push-object", 5, False) == "401"

        # the edge speaks TLS 1.3 (1.2 allowed) with its own certificate, and names no version
        with attacker.connect(server.edge_port, server.ca, source="127.0.0.1") as sock:
            assert sock.version() == "TLSv1.3"
            assert sock.getpeercert(binary_form=True) == ssl.PEM_cert_to_DER_cert(
                (server.certs / "edge.crt").read_text())
        tls = ssl.create_default_context(cafile=str(server.ca))
        health = httpx.get(f"https://127.0.0.1:{server.edge_port}/health", verify=tls, timeout=10)
        assert health.headers["server"] == "nginx"

        print(f"{time.monotonic() - started:.0f} s in: the device starts")
        # (b) a registered device trains through the edge while one address keeps opening stalled uploads
        env = flower_env(tmp_path / "home")
        write_connection(tmp_path / "home", "operator", server.link_port, server.ca)
        register_supernode(env, "operator", server.certs / "supernode-0.pub")
        procs, certs = server.procs, server.certs
        procs.start("superexec-serverapp", superexec(["--root-certificates", str(server.ca)],
                                                     f"127.0.0.1:{server.link_port}", certs / "superlink.secret"))
        node, executor = EXECUTORS["warm"]
        node_port = free_port()
        procs.start("supernode-0", [*node, "--root-certificates", str(server.ca), "--auth-supernode-private-key",
                                    str(certs / "supernode-0"), "--superlink", f"127.0.0.1:{server.edge_port}",
                                    *runtime_api(certs / "supernode-0.secret"), "--host", "127.0.0.1",
                                    "--port", str(node_port), "--node-config", "partition-id=0 num-partitions=1"])
        procs.start("superexec-clientapp-0", superexec(["--insecure"], f"127.0.0.1:{node_port}",
                                                       certs / "supernode-0.secret", executor))
        slow_headers = attacker.stall(server.edge_port, server.ca, 50, headers=False)
        rounds: list[dict[str, int]] = []
        legit: list[int | str] = []
        done = threading.Event()

        def attack() -> None:
            deadline = time.monotonic() + 300
            while not done.is_set() and time.monotonic() < deadline:
                socks = attacker.stall(server.edge_port, server.ca, STALLS)
                rounds.append(attacker.fates(socks, 2.0))
                try:
                    legit.append(httpx.get(f"https://127.0.0.1:{server.edge_port}/health", verify=tls,
                                           timeout=10).status_code)
                except httpx.HTTPError as err:  # a device refused: recorded, asserted below
                    legit.append(type(err).__name__)
                attacker.close(socks)
                done.wait(1.0)  # the test's machine is small: the run needs its cores too

        thread = threading.Thread(target=attack, daemon=True)
        thread.start()
        try:
            _, status = flwr_run(env, "operator", {**RUN, "output-dir": str(tmp_path / "out")}, timeout=300)
        finally:
            done.set()
            thread.join(60)
        print(f"{time.monotonic() - started:.0f} s in; stalled uploads per round of {STALLS} from "
              f"{attacker.ATTACKER}: {rounds}; /health from a device: {legit}")
        assert status == "finished:completed", status
        summary = json.loads(next((tmp_path / "out").glob("*/summary.json")).read_text())
        assert summary["final-version"] == RUN["num-rounds"] and summary["total-failures"] == 0
        assert rounds and legit and set(legit) == {200}
        for fates in rounds:  # at most the per-client cap held, the others refused with 503 (which Flower retries)
            assert set(fates) <= {"held", "503", "closed"} and fates.get("held", 0) <= CAP < fates["503"], fates
        # the slow headers were cut by client_header_timeout (10 s): the run and the attack took longer
        closed = attacker.fates(slow_headers, 15.0)
        attacker.close(slow_headers)
        assert closed.get("held", 0) == 0, closed
