"""A device of another architecture: an arm64 SuperNode, emulated, in a federation run from this (x86_64) machine.

    python -m benchmarks.arm64_device [--models digits,fmnist] [--cache /var/cache/hybridfl-arm64]
                                      [--out benchmarks/results/arm64_device.jsonl]      (root; `make arm64-device`)

A device's userland is Debian bookworm for arm64 (``debootstrap --arch=arm64``), run under ``qemu-aarch64``
(qemu-user-static: binfmt_misc hands every aarch64 executable to the emulator, flag F, so the userland holds no qemu
of its own); in it a venv with a device's install only (requirements/device.txt, resolved against the aarch64 wheels
that ``make device-check`` downloads from PyPI, wheels only: torch's is PyPI's aarch64 build of the project's pin)
and the project's own wheel
``--no-deps``. The userland, its venv and the wheels are cached in `--cache` and reused; a changed requirement in
requirements/device.txt rebuilds the venvs; the project's wheel goes in anew every time.

Per model, one run on a local deployment secured as ``hybridfl run --mode deployment`` (hybridfl/launch/deploy_local.py:
TLS with a private CA, the SuperNodes' keys registered, the Runtime APIs' secrets; the warm devices,
client_app/supernode.py and client_app/warm_executor.py) with two SuperNodes on loopback: node 0 inside the arm64
userland (``chroot``; its processes are aarch64, emulated), node 1 native, from an x86_64 venv holding the same
requirements/device.txt (PyPI's wheels for x86_64). The run must end *finished:completed* with its summary.

Measured per device: the peak resident set of its processes together (SuperNode, executor, fork server and the
child forked per message; sampled every 0.25 s: the sum of their RSS, which counts the pages a fork shares with its
parent in each, and of their PSS, which shares them out), each long-lived process's own peak (``VmHWM``), the time
its train messages took (the ClientApp's ``device timing`` lines: handler and training), and its install (the venv's
site-packages on disk, torch's and CUDA's shares apart). Under qemu-user an emulated process's memory is the
emulator's: the guest's pages plus qemu's own (its code and its cache of translated code), more than the same
processes hold on an arm64 board; and its time is emulation's (several times a native device's on this machine),
not a board's. A round waits for both devices: the run's seconds are the emulated one's.

Models: ``digits``, the papers' CNN on scikit-learn's 8x8 digits (fedavg-digits); ``fmnist``, the Feddle protocol's
CNN (width 16) on Fashion-MNIST (feddle-fmnist/fedavg-dir0.3-n5 on 1 % of the data; Debian's dataset-fashion-mnist,
bound into the userland read-only); each `--rounds` (2) rounds of FedAvg on the 2 nodes, one local epoch, a short
run, with any ``KEY=VALUE`` run-config overrides after the flags (CI: ``data-fraction=0.1``, a tenth of the emulated
training: the claim there is a device that trains to the end, not its time). A table is printed and each device's
row, with its overrides, appended as a JSON line to `--out`.

Needs root (chroot, mounts), debootstrap, qemu-user-static with binfmt-support (Debian: ``apt-get install
qemu-user-static binfmt-support debootstrap dataset-fashion-mnist``) and PyPI and Debian's archive for the first
build (on a 2-core machine: ~4 min for the userland, 1 min to download the 3.2 GB of aarch64 wheels, ~8 min for
the venv, emulated; ~2 min for the x86_64 venv). A run then takes ~5 min per model, most of it the emulated device.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

from common.errors import ConfigError
from flower_internals.control import register_keys
from hybridfl.launch.deploy_local import CONNECTION, runtime_api, superexec
from hybridfl.launch.flwr_cli import check_completed, flwr_run, write_connection
from hybridfl.launch.job import app_run_config, parse_overrides, prepare
from hybridfl.launch.pki import make_pki, make_secrets
from hybridfl.launch.processes import ProcessGroup, flower_env, free_port, process_home, wait_healthy
from tools.probes import device_timings

REPO = Path(__file__).resolve().parents[1]
REQUIREMENTS = REPO / "requirements" / "device.txt"
CACHE = Path("/var/cache/hybridfl-arm64")
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"  # bookworm's python3 is 3.11, as make device-check's
ROOTFS_PACKAGES = "python3,python3-venv,python3-pip,ca-certificates"
DEVICE_VENV = "/opt/hybridfl-device"  # inside the userland
FMNIST = Path("/usr/share/datasets/fashion-mnist")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
CHROOT = shutil.which("chroot", path="/usr/sbin:/usr/bin:/sbin:/bin") or "chroot"  # run with the userland's PATH
SAMPLE_S = 0.25
# a train message's parts in the ClientApp's `device timing` line (client_app/app.py), summed over the run
PARTS = ("flower-s", "import-s", "data-s", "model-s", "work-s")

# name -> (what it trains, its run config): FedAvg on 2 clients (one per node), one local epoch, --rounds rounds
SHORT = {"num-clients": 2, "clients-per-round": 2, "local-epochs": 1, "eval-every": 1,
         "wait-nodes-s": 900.0, "reply-timeout-s": 1800.0}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "digits": ("the papers' CNN on digits (8x8)", {"preset": "fedavg-digits", **SHORT}),
    "fmnist": ("the Feddle protocol's CNN (width 16) on Fashion-MNIST (28x28), 1 % of it",
               {"preset": "feddle-fmnist/fedavg-dir0.3-n5", **SHORT, "data-fraction": 0.01, "central-size": 0,
                "validation-size": 0, "delay-sigma": 0.0}),
}


def sh(cmd: list[str], log: Path | None = None, **kw: Any) -> float:
    """Run `cmd` (output to `log`, else inherited), raise with the log's tail if it fails; return its seconds."""
    started = time.monotonic()
    with open(log, "a") if log else contextlib.nullcontext() as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, **kw)
    if proc.returncode:
        tail = log.read_text(errors="replace")[-3000:] if log else ""
        raise RuntimeError(f"{cmd[0]} ... exited {proc.returncode}: {' '.join(cmd)[:300]}\n{tail}")
    return time.monotonic() - started


class Unsupported(Exception):
    """This host cannot run an emulated arm64 device (the reason)."""


def check_host() -> None:
    """Root, debootstrap and qemu-user-static (installed from Debian's packages where missing), and aarch64
    executables handed to qemu by binfmt_misc (mounted and enabled here when Debian's binfmt-support has the
    entry); raises :class:`Unsupported` naming what is missing."""
    if os.geteuid() != 0:
        raise Unsupported("needs root (debootstrap, chroot, bind mounts)")
    if platform.machine() != "x86_64":
        raise Unsupported(f"measures an emulated arm64 device against this x86_64 machine's; this is "
                          f"{platform.machine()}")
    tools = (("qemu-user-static", "qemu-aarch64-static"), ("binfmt-support", "update-binfmts"),
             ("debootstrap", "debootstrap"))
    missing = [pkg for pkg, tool in tools if not shutil.which(tool)]
    if missing and shutil.which("apt-get"):
        apt = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if subprocess.run(apt, env=env, check=False).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, check=False)
            subprocess.run(apt, env=env, check=False)
    entry = BINFMT / "qemu-aarch64"
    if not (BINFMT / "status").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], check=False)
    if not entry.exists() and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], check=False)
    text = entry.read_text() if entry.exists() else ""
    if not text.startswith("enabled") or not shutil.which("debootstrap"):
        raise Unsupported("needs qemu-aarch64 registered in binfmt_misc and debootstrap: "
                          "apt-get install qemu-user-static binfmt-support debootstrap")
    flags = next((line.split()[1] for line in text.splitlines() if line.startswith("flags:")), "")
    if "F" not in flags:
        raise Unsupported(f"binfmt_misc's qemu-aarch64 lacks flag F ({flags!r}): the userland would need its own "
                          "qemu; Debian's qemu-user-static registers it with F")


@contextlib.contextmanager
def mounted(root: Path, binds: Sequence[Path], readonly: Sequence[Path] = ()) -> Iterator[None]:
    """/proc in the userland, and each of `binds` (`readonly`: read-only) at its own path inside it (the PKI, the
    logs, the data: a path means the same on both sides); what this mounted is unmounted when the block ends, in
    reverse, and the folders it made for them removed. Not /sys: with this machine's /sys, torch's aarch64 build
    (cpuinfo) reads an x86_64 CPU's entries under qemu and segfaults on import; without it, it warns and works."""
    done: list[tuple[Path, bool]] = []
    try:
        for source, options in [("proc", ["-t", "proc"]), *((str(b), ["--bind"]) for b in binds),
                                *((str(b), ["--bind", "-o", "ro"]) for b in readonly)]:
            path = root / source.lstrip("/")
            if os.path.ismount(path):
                continue
            made = not path.exists()
            path.mkdir(parents=True, exist_ok=True)
            sh(["mount", *options, source, str(path)])
            done.append((path, made))
        yield
    finally:
        for path, made in reversed(done):
            if subprocess.run(["umount", str(path)], check=False).returncode:
                subprocess.run(["umount", "-l", str(path)], check=False)
            elif made:
                with contextlib.suppress(OSError):
                    path.rmdir()


def rootfs(cache: Path, log: Path) -> tuple[Path, float]:
    """The arm64 userland (cached: built once, ~4 min); returns it and the seconds its build took (0: cached)."""
    root, stamp = cache / "rootfs", cache / "rootfs" / ".hybridfl-rootfs"
    if stamp.exists():
        return root, 0.0
    if left := [m for m in Path("/proc/mounts").read_text().split() if m.startswith(f"{root}/")]:
        raise SystemExit(f"arm64_device: {root} is half built and has file systems mounted in it ({', '.join(left)}): "
                         "unmount them first (umount PATH)")
    shutil.rmtree(root, ignore_errors=True)  # a build that did not finish
    print(f"building the arm64 userland in {root} (debootstrap, then its second stage emulated) ...", flush=True)
    seconds = sh(["debootstrap", "--arch=arm64", "--foreign", "--variant=minbase", f"--include={ROOTFS_PACKAGES}",
                  SUITE, str(root), MIRROR], log)
    seconds += sh([CHROOT, str(root), "/debootstrap/debootstrap", "--second-stage"], log)
    stamp.write_text(f"{SUITE} arm64 {ROOTFS_PACKAGES}\n")
    return root, seconds


def wheels(cache: Path, log: Path, root: Path) -> tuple[Path, int, float]:
    """`make device-check` into the cache: requirements/device.txt resolved for aarch64 and every wheel downloaded
    (reused when there); returns the folder, the wheels' bytes and the seconds (0: not run, the userland's venv
    already installed from these requirements' resolution: resolving again, ~45 s with PyPI's answers, would change
    nothing the run uses)."""
    folder = cache / "wheels" / "aarch64"
    seconds = 0.0
    if not (_installed(_arm64_stamp(root)) and (folder / "device.lock").exists()):
        seconds = sh(["make", "-C", str(REPO), "device-check", f"DEVICE_WHEELS={cache / 'wheels'}"], log)
    lock = {line.split("==")[0].lower().replace("_", "-") for line in (folder / "device.lock").read_text().split()
            if "==" in line}
    size = sum(w.stat().st_size for w in folder.glob("*.whl")
               if w.name.split("-")[0].lower().replace("_", "-") in lock)
    return folder, size, seconds


def _arm64_stamp(root: Path) -> Path:
    return root / DEVICE_VENV.lstrip("/") / ".hybridfl-requirements"


def _installed(stamp: Path) -> bool:
    """A venv whose stamp names the requirements as they are now."""
    return stamp.exists() and stamp.read_text() == requirements_digest()


def requirements_digest() -> str:
    """requirements/device.txt's requirements (its comments left out: rewording one rebuilds nothing)."""
    lines = (line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return hashlib.sha256("\n".join(line for line in lines if line).encode()).hexdigest()


def device_env(venv: str, home: Path) -> dict[str, str]:
    """A device process's whole environment: its venv's bin/ on PATH, nothing of this machine's (pip's settings,
    this venv's PATH), Flower's settings as the launchers set them (hybridfl/launch/processes.py flower_env)."""
    base = flower_env(home)
    keep = ("FLWR_HOME", "FLWR_TELEMETRY_ENABLED", "FLWR_DISABLE_UPDATE_CHECK", "FLWR_SUPEREXEC_TASK_POLL_INTERVAL",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "PYTHONUNBUFFERED")
    return {**{k: base[k] for k in keep}, "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
            "LANG": "C.UTF-8", "HYBRIDFL_USER_DIR": str(home)}


def arm64_venv(root: Path, wheel_dir: Path, log: Path) -> float:
    """requirements/device.txt in the userland's venv, from the downloaded aarch64 wheels only (``--no-index``: the
    device's own pip resolves the file again, against what make device-check resolved); cached by the
    requirements' digest. Returns the seconds (0: cached)."""
    stamp = _arm64_stamp(root)
    if _installed(stamp):
        return 0.0
    print(f"installing requirements/device.txt in the userland's {DEVICE_VENV} (emulated pip) ...", flush=True)
    shutil.rmtree(root / DEVICE_VENV.lstrip("/"), ignore_errors=True)
    shutil.copy(REQUIREMENTS, root / "tmp" / "device.txt")
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
    with mounted(root, [wheel_dir]):
        seconds = sh([CHROOT, str(root), "/usr/bin/python3", "-m", "venv", DEVICE_VENV], log, env=env)
        seconds += sh([CHROOT, str(root), f"{DEVICE_VENV}/bin/pip", "install", "--no-index", "--find-links",
                       str(wheel_dir), "-r", "/tmp/device.txt"], log, env=env)
    (root / "tmp" / "device.txt").unlink()
    stamp.write_text(requirements_digest())
    return seconds


def x86_venv(cache: Path, log: Path) -> tuple[Path, float]:
    """requirements/device.txt in a venv of this machine (a native device's install: PyPI's x86_64 wheels, through
    this machine's pip settings); cached by the requirements' digest. Returns it and the seconds (0: cached)."""
    venv = cache / "x86_64-venv"
    stamp = venv / ".hybridfl-requirements"
    if _installed(stamp):
        return venv, 0.0
    print(f"installing requirements/device.txt in {venv} ...", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    seconds = sh([sys.executable, "-m", "venv", str(venv)], log)
    seconds += sh([str(venv / "bin" / "pip"), "install", "-r", str(REQUIREMENTS)], log)
    stamp.write_text(requirements_digest())
    return venv, seconds


def install_project(root: Path, x86: Path, work: Path, log: Path) -> None:
    """The project's wheel (built here), ``--no-deps``, into both devices' venvs, replacing what was there."""
    dist = work / "dist"
    sh([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist), str(REPO)], log)
    (wheel,) = dist.glob("hybridfl-*.whl")
    flags = ["install", "--quiet", "--no-deps", "--no-index", "--force-reinstall"]
    sh([str(x86 / "bin" / "pip"), *flags, str(wheel)], log)
    inside = root / "tmp" / wheel.name
    shutil.copy(wheel, inside)
    sh([CHROOT, str(root), f"{DEVICE_VENV}/bin/pip", *flags, f"/tmp/{wheel.name}"], log,
       env={"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"})
    inside.unlink()


def disk_bytes(folder: Path) -> int:
    """Bytes on disk below `folder` (blocks, each file once; not below another file system mounted there)."""
    seen, total = set(), 0
    for dirpath, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(dirpath, d))]
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


CUDA_PREFIXES = ("nvidia", "cuda", "triton")


def install_size(site: Path) -> dict[str, float]:
    """A venv's site-packages in MiB: all of it, torch's own (torch/, torchgen/, functorch/) and CUDA's (nvidia/,
    cuda*, triton/: the libraries torch's wheel requires), each with its dist-info."""
    parts = {"install-mib": 0, "torch-mib": 0, "cuda-mib": 0}
    for entry in site.iterdir():
        size = disk_bytes(entry) if entry.is_dir() else entry.lstat().st_blocks * 512
        name = entry.name.lower()
        parts["install-mib"] += size
        if name.split("-")[0] in ("torch", "torchgen", "functorch"):
            parts["torch-mib"] += size
        elif name.startswith(CUDA_PREFIXES):
            parts["cuda-mib"] += size
    return {k: round(v / 2**20, 1) for k, v in parts.items()}


def smaps(pid: int) -> tuple[int, int, int]:
    """(RSS, PSS, VmHWM) of `pid` in KiB; zeros when it is gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0, 0, 0
    field = lambda lines, key: next((int(x.split()[1]) for x in lines if x.startswith(key)), 0)
    return field(rollup, "Rss:"), field(rollup, "Pss:"), field(status, "VmHWM:")


class Sampler:
    """Every SAMPLE_S seconds, the memory of each device's processes (its roots and all their descendants): the
    peak of their RSS summed, of their PSS summed, and each process's own peak (VmHWM) by role."""

    def __init__(self, devices: dict[str, list[tuple[str, int]]]) -> None:
        self.devices = devices  # device -> [(role, root pid)]
        self.peak = {d: {"rss": 0, "pss": 0, "processes": 0} for d in devices}
        self.hwm: dict[str, dict[str, int]] = {d: {} for d in devices}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _role(self, role: str, proc: psutil.Process, root: int) -> str:
        if proc.pid == root:
            return role
        try:
            depth = 1 if proc.ppid() == root else 2
        except psutil.NoSuchProcess:
            depth = 2
        return {("executor", 1): "fork-server", ("executor", 2): "message-child"}.get((role, depth), f"{role}-child")

    def sample(self) -> None:
        for device, roots in self.devices.items():
            rss = pss = count = 0
            for role, root in roots:
                try:
                    top = psutil.Process(root)
                    tree = [top, *top.children(recursive=True)]
                except psutil.NoSuchProcess:
                    continue
                for proc in tree:
                    r, p, h = smaps(proc.pid)
                    if not r:
                        continue
                    rss, pss, count = rss + r, pss + p, count + 1
                    name = self._role(role, proc, root)
                    self.hwm[device][name] = max(self.hwm[device].get(name, 0), h)
            peak = self.peak[device]
            peak["processes"] = max(peak["processes"], count)
            peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


OWN_KEYS = {"num-rounds", "output-dir", "run-name"}  # what run_model sets itself


def run_model(name: str, root: Path, x86: Path, work: Path, rounds: int,
              extra: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], float]:
    """One short run with node 0 in the arm64 userland and node 1 native (`extra`: run-config overrides); the
    devices' rows and the run's seconds."""
    what, job = MODELS[name]
    home = work / f"home-{name}"
    overrides, run_path, _ = prepare({**job, **(extra or {}), "num-rounds": rounds, "output-dir": str(work / "runs"),
                                      "run-name": f"arm64-{name}"})
    env = flower_env(home)
    port, node_ports = free_port(), [free_port(), free_port()]
    pki, secret = make_pki(home / "pki", nodes=2), make_secrets(home / "pki", 2)
    ca = pki / "ca.crt"
    to_link = ["--root-certificates", str(ca)]
    roots: dict[str, list[tuple[str, int]]] = {}
    data = [FMNIST] if FMNIST.is_dir() else []
    with mounted(root, [work], readonly=data), ProcessGroup(run_path / "flower-logs", env) as procs:
        link = procs.start("superlink", [
            "flower-superlink", "--ssl-ca-certfile", str(ca), "--ssl-certfile", str(pki / "server.crt"),
            "--ssl-keyfile", str(pki / "server.key"), "--enable-supernode-auth", *runtime_api(secret["superlink"]),
            "--host", "127.0.0.1", "--port", str(port), "--disable-runtime-dependency-installation"])
        wait_healthy(port, link, ca=ca)
        write_connection(home, CONNECTION, port, ca)
        register_keys(home, CONNECTION, [pki / f"supernode-{i}.pub" for i in range(len(node_ports))])
        procs.start("superexec-serverapp", superexec(to_link, f"127.0.0.1:{port}", secret["superlink"]))
        for i, (device, node_port) in enumerate(zip(("arm64", "x86_64"), node_ports)):
            node_secret = secret[f"supernode-{i}"]
            node = [*to_link, "--auth-supernode-private-key", str(pki / f"supernode-{i}"),
                    "--superlink", f"127.0.0.1:{port}", *runtime_api(node_secret), "--host", "127.0.0.1",
                    "--port", str(node_port), "--node-config",
                    f'partition-id={i} num-partitions=2 cache-dir="{work / f"cache-{name}-{i}"}"']
            executor = ["--insecure", "--runtime-api-address", f"127.0.0.1:{node_port}",
                        "--superexec-auth-secret-file", str(node_secret)]
            for role, module, args in (("supernode", "client_app.supernode", node),
                                       ("executor", "client_app.warm_executor", executor)):
                proc_home = process_home(home, f"{role}-{i}")
                proc_home.mkdir(parents=True, exist_ok=True)
                if device == "arm64":  # the same paths inside: `work` is bound at its own path
                    venv = DEVICE_VENV
                    cmd = [CHROOT, str(root), "/usr/bin/env", f"--chdir={proc_home}", f"{venv}/bin/python"]
                else:
                    venv = str(x86)
                    cmd = [f"{venv}/bin/python"]
                proc = procs.start(f"{role}-{i}-{device}", [*cmd, "-P", "-m", module, *args],
                                   env=device_env(venv, proc_home), cwd=proc_home)
                roots.setdefault(device, []).append((role, proc.pid))
        with Sampler(roots) as sampler:
            started = time.monotonic()
            run_id, status = flwr_run(env, CONNECTION, overrides, timeout=3600.0)
            seconds = time.monotonic() - started
    check_completed(run_id, status, run_path)
    rows = []
    for i, device in enumerate(("arm64", "x86_64")):
        logs = sorted((run_path / "flower-logs").glob(f"executor-{i}-*.log"))
        trains = [d for d in device_timings(logs) if d["message"] == "train"]
        rows.append({
            "model": name, "what": what, "device": device, "emulated": device == "arm64",
            "peak-rss-mib": round(sampler.peak[device]["rss"] / 1024, 1),
            "peak-pss-mib": round(sampler.peak[device]["pss"] / 1024, 1),
            "processes": sampler.peak[device]["processes"],
            "hwm-mib": {k: round(v / 1024, 1) for k, v in sorted(sampler.hwm[device].items())},
            "train-messages": len(trains), "train-handler-s": round(sum(d["handler-s"] for d in trains), 2),
            "train-work-s": round(sum(d.get("work-s", 0.0) for d in trains), 2),
            "train-s": {k: round(sum(d.get(k, 0.0) for d in trains), 2) for k in PARTS},
            "run-s": round(seconds, 1), "rounds": rounds, "overrides": extra or {}, "run-id": run_id,
        })
    return rows, seconds


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | device | peak RSS (MiB) | peak PSS (MiB) | SuperNode / executor / fork server VmHWM (MiB) "
            "| train messages: handler / training s | install (MiB): all / torch / CUDA | run s |")
    out = [head, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        h = r["hwm-mib"]
        dev = f"{r['device']} (emulated, qemu-user)" if r["emulated"] else f"{r['device']} (native)"
        out.append(f"| {r['model']} | {dev} | {r['peak-rss-mib']:.0f} | {r['peak-pss-mib']:.0f} | "
                   f"{h.get('supernode', 0):.0f} / {h.get('executor', 0):.0f} / {h.get('fork-server', 0):.0f} | "
                   f"{r['train-messages']}: {r['train-handler-s']:.1f} / {r['train-work-s']:.1f} | "
                   f"{r['install-mib']:.0f} / {r['torch-mib']:.0f} / {r['cuda-mib']:.0f} | {r['run-s']:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--cache", type=Path, default=CACHE, help="the userland, its venv, the wheels (reused)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "arm64_device.jsonl")
    parser.add_argument("--rounds", type=int, default=2, help="FedAvg rounds per run (CI: 1; an emulated round "
                        "of digits takes ~100 s on 2 cores)")
    parser.add_argument("--skip-unsupported", action="store_true",
                        help="exit 0 saying why where this host cannot emulate an arm64 device (CI), not 1")
    parser.add_argument("--host-only", action="store_true", help="install and check this host's tools (qemu-user, "
                        "binfmt_misc, debootstrap), then stop (CI: before the engine test's apt-free part runs beside "
                        "this run)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="run-config overrides of every model's run, as `hybridfl run` takes them")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    try:  # a bad override fails now, not after the userland's build
        extra = parse_overrides(args.overrides)
        if own := sorted(set(extra) & OWN_KEYS):
            raise ConfigError(own[0], extra[own[0]], "set by this command (--rounds for num-rounds)",
                              f"{own[0]} is this command's own: --rounds sets num-rounds, each run its folder")
        for name in set(models) & set(MODELS):
            app_run_config({**MODELS[name][1], **extra})
    except ConfigError as e:
        print(f"arm64_device: {e}", file=sys.stderr)
        return 2
    if unknown := set(models) - set(MODELS):
        parser.error(f"unknown model(s) {sorted(unknown)}: {', '.join(MODELS)}")
    try:
        check_host()
    except Unsupported as why:
        print(f"arm64_device: {'SKIPPED: ' if args.skip_unsupported else ''}{why}", file=sys.stderr)
        return 0 if args.skip_unsupported else 1
    if args.host_only:
        print("arm64_device: this host can emulate an arm64 device", flush=True)
        return 0
    args.cache.mkdir(parents=True, exist_ok=True)
    log = args.cache / "build.log"
    steps: dict[str, float] = {}
    root, steps["rootfs-s"] = rootfs(args.cache, log)
    wheel_dir, wheel_bytes, steps["device-check-s"] = wheels(args.cache, log, root)
    steps["arm64-venv-s"] = arm64_venv(root, wheel_dir, log)
    x86, steps["x86-venv-s"] = x86_venv(args.cache, log)
    sizes = {"arm64": {**install_size(root / DEVICE_VENV.lstrip("/") / "lib" / "python3.11" / "site-packages"),
                       "wheels-mib": round(wheel_bytes / 2**20, 1), "userland-mib": round(disk_bytes(root) / 2**20, 1)},
             "x86_64": install_size(x86 / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" /
                                    "site-packages")}
    print("setup (s, 0 = cached):", json.dumps({k: round(v, 1) for k, v in steps.items()}), flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hybridfl-arm64-") as tmp:
        work = Path(tmp)
        install_project(root, x86, work, log)
        for name in models:
            device_rows, seconds = run_model(name, root, x86, work, args.rounds, extra)
            print(f"{name}: completed in {seconds:.0f} s", flush=True)
            setup = {"setup-s": {k: round(v, 1) for k, v in steps.items()}}
            rows += [{**r, **sizes[r["device"]], **(setup if r["device"] == "arm64" else {})} for r in device_rows]
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"date": time.strftime("%Y-%m-%d"), "host": platform.machine(), "cpus": os.cpu_count(),
             "qemu": shutil.which("qemu-aarch64-static") and subprocess.run(
                 ["qemu-aarch64-static", "--version"], capture_output=True, text=True).stdout.split("\n")[0]}
    with args.out.open("a") as out:
        out.writelines(json.dumps({**stamp, **r}) + "\n" for r in rows)
    print(f"appended {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
