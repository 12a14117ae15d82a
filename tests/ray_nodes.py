"""A Ray cluster of two nodes of one CPU each, both raylets on 127.0.0.1, for tests/test_ray_cluster.py.

Run it in a network namespace of its own whose only interface is loopback (`unshare -n`, `lo` up): outside one, Ray
replaces 127.0.0.1 by the machine's interface address (ray-project/ray#59110), which no test may use. It prints one
JSON line (the cluster's address, its nodes' ids, the head's log folder), then reads commands from stdin:
``kill-worker`` kills the worker node as a crash would (answered by ``killed``); end of input shuts the cluster down.
"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import sys

from ray.cluster_utils import Cluster


def loopback_up() -> None:
    """`ip link set lo up` without iproute2: a new network namespace's loopback starts down."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sh", fcntl.ioctl(sock, siocgifflags, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def main() -> None:
    loopback_up()
    cluster = Cluster(initialize_head=True, shutdown_at_exit=False,
                      head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    try:
        worker = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        print(json.dumps({"address": cluster.address, "nodes": [cluster.head_node.node_id, worker.node_id],
                          "logs": cluster.head_node.get_logs_dir_path()}), flush=True)
        for line in sys.stdin:
            if line.strip() == "kill-worker":
                cluster.remove_node(worker, allow_graceful=False)
                print("killed", flush=True)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
