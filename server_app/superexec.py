"""The ServerApp's SuperExec: Flower's ``flower-superexec`` (its command line, loop and SuperExec authentication) whose
task poll waits out a SuperLink's server errors, where Flower's exits on the first and takes the running ServerApp
with it, and slows to Flower's 1 s while no run comes (flower_internals/superexec.py ``task_poll`` says why).

    python -m server_app.superexec [flower-superexec's flags: --insecure | --root-certificates F,
                                    --runtime-api-address HOST:PORT, --superexec-auth-secret-file F, ...]
"""

from __future__ import annotations

from flower_internals.superexec import run_superexec


def main() -> None:
    """``flower-superexec``, its task poll patient and paced."""
    run_superexec()


if __name__ == "__main__":
    main()
