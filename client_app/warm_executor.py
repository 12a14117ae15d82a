"""A warm ClientApp executor: Flower's SuperExec, with ClientApp tasks forked from a process that imported once.

    python -m client_app.warm_executor [flower-superexec's flags: --insecure | --root-certificates F,
                                        --runtime-api-address HOST:PORT, --superexec-auth-secret-file F, ...]

Flower's SuperExec starts a new ``flwr-clientapp`` process for every message: Python, Flower and torch are imported
again each time (1.6 s + 1.6 s per train message of `benchmarks/deploy_overhead.py` on a 2-core machine). This
command is Flower's own ``flower-superexec`` — its command line, its loop, its SuperExec authentication — with one
part replaced: a ClientApp task is handed to a *fork server*, a process started once that imported torch and
Flower's ClientApp runtime, and that forks a child per task. The child runs Flower's own ``run_clientapp`` on the
task's token: it pulls the message, the Context and the FAB from the SuperNode, loads the app from the FAB and
pushes the reply, as ``flwr-clientapp`` does, then exits. So:

- Flower's semantics are kept: node state travels in the Context through the SuperNode; an exception in the app is
  Flower's error reply; a run or FAB is imported afresh by every child (the fork server imports no app code), so
  nothing of one run leaks into another.
- A fork server that dies is started again by the executor before the next task (tests/test_warm_executor.py);
  memory stays bounded because every child exits. A child that dies mid-message (SIGKILL, out of memory) loses only
  its message: once its task's heartbeat expires (Flower's 30 s x patience 2) the SuperNode answers it with Flower's
  error "ClientApp stopped responding", as for a dead ``flwr-clientapp`` (tested).
- A child whose executor died (SIGKILL) gets Flower's exit (its parent monitor's SIGINT), and ends itself if that
  has not finished ORPHAN_GRACE_S later: Flower's exit waits on its retries first (over 30 s measured under load).
- A FAB that a child installed whole is not unzipped and re-verified by the next children (marked by its SHA-256);
  one that a killed child left half installed is installed again (Flower would take its folder for installed).
- Not kept across messages: the node's data and model (read from the node's partition cache, ~0.5 s) and a CUDA
  context (CUDA cannot cross a fork: each child makes its own).

Other task types (none on a SuperNode), and tasks whose app's dependencies Flower installs per run, go to Flower's
subprocess executor. The executor and the fork server reach under Flower's public API: they live in
flower_internals/ (superexec.py, fork_server.py), with the internals they rely on, which
``tests/test_flower_internals.py`` checks against the installed Flower.
"""

from __future__ import annotations

from flower_internals.superexec import WarmExecutor, run_superexec


def main() -> None:
    """``flower-superexec`` with the warm executor in place of its subprocess executor."""
    run_superexec(WarmExecutor())


if __name__ == "__main__":
    main()
