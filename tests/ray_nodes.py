"""A Ray cluster of two nodes of one CPU each, both raylets on 127.0.0.1, for tests/test_ray_cluster.py.

Run it in a network namespace of its own whose only interface is loopback (`unshare -n`, `lo` up): outside one, Ray
replaces 127.0.0.1 by the machine's interface address (ray-project/ray#59110), which no test may use. It prints one
JSON line (the cluster's address, its nodes' ids, the head's log folder), then reads commands from stdin:
``kill-worker`` kills the worker node as a crash would (answered by ``killed``); end of input shuts the cluster down.
"""

from __future__ import annotations

import json
import sys

from netns import loopback_up
from ray.cluster_utils import Cluster


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
