"""The ServerApp: builds the run from its configuration (``server_app.run``), drives it, writes the outputs.

The configuration is ``configs/<preset>.yaml`` overlaid with exactly the keys the user passed
(``flwr run -c``), which Flower hands over as ``grid.run.override_config``; with ``resume`` it is
the checkpoint's.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from server_app.config import load_config
from server_app.run import build_run

app = ServerApp()
RUN_STATE = "hybridfl-run"  # ConfigRecord left in the ServerApp's context.state: {"output-dir": ...}


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = build_run(grid, load_config(grid.run.override_config))
    context.state[RUN_STATE] = ConfigRecord({"output-dir": str(run.out)})
    run.execute()
