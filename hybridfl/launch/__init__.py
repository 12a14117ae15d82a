"""The launchers: a run started as a Flower simulation (simulate.py, on this machine's Ray or a cluster's:
cluster.py), as a local deployment with TLS and node keys (deploy_local.py, pki.py, the devices' edge proxy: edge/),
or on docker compose (compose.py, its files read as Compose reads them: compose_file.py); a fleet of devices on either
(real_fleet.py, compose_fleet.py, their links: shaper.py); the main job and a run's folder (job.py), the Flower
processes they start and stop (processes.py), the `flwr` command driven from Python (flwr_cli.py), the app they hand
it (bundle.py) and the SuperLink's database kept bounded (linkdb.py)."""
