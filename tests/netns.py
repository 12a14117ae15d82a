"""Loopback only: a network namespace whose one interface is loopback, for the whole suite (tests/conftest.py) and
for the Ray cluster of tests/ray_nodes.py inside it. No test sends traffic to any address but loopback; outside such a
namespace Ray binds the machine's interface address where it is told 127.0.0.1 (ray-project/ray#59110), and so does
the Ray that every Flower simulation starts. Plain functions of the standard library: tests/ray_nodes.py runs as a
script beside this file.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

CLONE_NEWNET = 0x40000000  # <linux/sched.h>


def loopback_up() -> None:
    """`ip link set lo up` without iproute2: a new network namespace's loopback starts down."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sh", fcntl.ioctl(sock, siocgifflags, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def enter_loopback_only() -> str | None:
    """Moves the calling thread, and every thread and process it starts from now on, into a network namespace of its
    own with loopback up (unshare(2), as `unshare -n`); returns why not (not root, or a container without
    CAP_SYS_ADMIN) and changes nothing then."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        return f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}"
    loopback_up()
    return None


def loopback_only() -> bool:
    """Whether this process's only network interface is loopback."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]
