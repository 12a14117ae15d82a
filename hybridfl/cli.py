"""The ``hybridfl`` command (typer, like Flower's ``flwr``): run a preset, resume a run, list the presets, sweep.

    hybridfl run                                   # the main job (Feddle-ID on digits), in-process
    hybridfl run fedbuff-digits num-rounds=5 --mode simulation
    hybridfl run fedbuff-digits --mode simulation --ray 10.0.0.5:6379 --client-num-gpus 0.25   # a Ray cluster's
    hybridfl run feddle-digits --mode deployment --supernodes 4
    hybridfl run fedasync-digits --mode deployment --supernodes 3 --latency 2=4 clock=wall concurrency=3
    hybridfl certs docker/certs --nodes 2
    hybridfl edge edge --certs certs                     # the devices' port: nginx, the Fleet API only
    hybridfl resume outputs/feddle-digits-s0-20261126-101500 num-rounds=200
    hybridfl presets
    hybridfl options tabular_task.fedavgm:FedAvgM      # a method's own keys (yours by import path)
    hybridfl sweep benchmarks/sweeps/fedmerge-fmnist.yaml --jobs 2
    hybridfl sweep benchmarks/sweeps/fedmerge-fmnist.yaml --ray 10.0.0.5:6379 --run-num-gpus 0.25
    hybridfl report benchmarks/sweeps/fedmerge-fmnist.yaml
    hybridfl superlink-db prune superlink.db --keep 10   # the SuperLink's --database: the finished runs but 10 go

KEY=VALUE pairs are run-config overrides with ``flwr run -c`` syntax (TOML values; a bare word is a string). A bad
key or value stops the command before anything starts, naming the key, the value and what is allowed (exit 2); a
run that fails exits 1.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import click
import typer

from hybridfl.launch.edge import FLEET_SIZE, LINK_RATE, MAX_BODY_MIB
from hybridfl.launch.flwr_cli import run_and_report
from hybridfl.launch.job import MAIN_JOB, parse_overrides
from hybridfl.launch.processes import terminated

app = typer.Typer(help=__doc__.split("\n\n")[0], no_args_is_help=True, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


class Mode(enum.StrEnum):
    in_process = "in-process"
    simulation = "simulation"
    deployment = "deployment"


MODE_HELP = ("in-process: hybridfl's own engine in this process (fastest; no Flower processes); simulation: "
             "`flwr run .` on a simulation SuperLink, one simulated SuperNode per client; deployment: one SuperLink "
             "and a SuperNode per client on loopback, the app submitted with `flwr run`")
FlwrHome = Annotated[Path, typer.Option(help="FLWR_HOME of the Flower processes (simulation, deployment); "
                                                   "default: .flwr in the folder it runs in")]
Supernodes = Annotated[int | None, typer.Option(help="deployment: SuperNodes to start (default: num-clients)")]
Latency = Annotated[list[str] | None, typer.Option(metavar="I=SECONDS",
                                                   help="deployment: slow SuperNode I's train replies (repeatable)")]
PlainHttp = Annotated[bool, typer.Option(help="deployment: plain HTTP and no SuperNode authentication (it warns; a "
                                              "test bench of your own only). By default every SuperLink API is HTTPS "
                                              "with a private CA (kept in <flwr-home>/pki) and only the registered "
                                              "SuperNode keys are admitted")]
Verbose = Annotated[bool, typer.Option(help="in-process on a terminal: the per-step log lines, not a progress "
                                            "line; and an unexpected error's traceback")]
Executor = Annotated[str, typer.Option(help="deployment: how each device runs its messages: `flower` (Flower's "
                                            "SuperNode and SuperExec: a process per message, 3 s idle polls), `warm` "
                                            "(client_app/warm_executor.py: forked from a process that imported torch "
                                            "once; and the SuperNode asks again soon after each reply, "
                                            "client_app/supernode.py) or `warm-executor` (the warm executor alone)")]


Ray = Annotated[str | None, typer.Option(help="simulation: join the Ray cluster at this address (what `ray start "
                                              "--head` prints; default: RAY_ADDRESS) instead of starting a Ray "
                                              "here; the ServerApp runs here, the clients on the cluster's nodes")]
ClientCpus = Annotated[float, typer.Option(help="simulation: CPUs each simulated client holds (Ray's num_cpus; "
                                                 "fractional allowed)")]
ClientGpus = Annotated[float | None, typer.Option(help="simulation: GPUs each simulated client holds (Ray's "
                                                        "num_gpus, fractional: 0.25 = four clients share one GPU); "
                                                        "default: a share of this machine's GPU, 0 on a cluster")]


@app.callback()
def _here_too() -> None:
    """Your own code by import path (`model`, `dataset`, `strategy`, a `package:path` preset) resolves from the
    current folder when no installed package provides it (common/user_code.py), here and in the Flower processes
    the command starts."""
    from common.user_code import USER_DIR

    os.environ[USER_DIR] = os.getcwd()


@dataclass(frozen=True)
class DeploymentFlags:
    """A local deployment's switches (``--mode deployment``)."""

    supernodes: int | None = None
    latency: tuple[str, ...] = ()
    plain_http: bool = False
    executor: str = "warm"

    def slow_nodes(self) -> dict[int, float]:
        """``--latency I=SECONDS`` items as {node: seconds}, or a ConfigError naming the bad item."""
        from common.errors import ConfigError

        try:
            return {int(i): float(sec) for i, sec in (item.split("=", 1) for item in self.latency)}
        except ValueError:
            raise ConfigError("--latency", list(self.latency), "I=SECONDS items (node index = seconds)") from None


@dataclass(frozen=True)
class SimulationFlags:
    """A simulation's switches (``--mode simulation``): the Ray cluster to join and each client's resources."""

    ray: str | None = None
    client_num_cpus: float = 1.0
    client_num_gpus: float | None = None


def launch(overrides: dict[str, Any], mode: Mode, flwr_home: Path, deployment: DeploymentFlags = DeploymentFlags(),
           verbose: bool = False, simulation: SimulationFlags = SimulationFlags()) -> int:
    """Run `overrides` in `mode`; print the summary. Exit code 0 = completed, 1 = the run failed, 2 = bad config.
    In-process on a terminal, a progress line replaces the per-step log lines unless `verbose`."""
    def go() -> Path:
        from common.errors import ConfigError

        if mode is not Mode.deployment and deployment != DeploymentFlags():
            raise ConfigError("--mode", str(mode), "deployment, the only mode with --supernodes, --latency, "
                              "--plain-http and --executor")
        if mode is not Mode.simulation and simulation != SimulationFlags():
            raise ConfigError("--mode", str(mode), "simulation, the only mode with --ray, --client-num-cpus and "
                              "--client-num-gpus")
        if mode is Mode.in_process:
            from hybridfl.engine.inprocess import run_inprocess

            with progress_line(verbose):
                return run_inprocess(overrides)  # output-dir relative to here, as the user typed it
        if mode is Mode.simulation:
            from hybridfl.launch import cluster
            from hybridfl.launch.simulate import simulate

            return simulate(overrides, flwr_home.resolve(), ray_address=cluster.address(simulation.ray),
                            client_cpus=simulation.client_num_cpus, client_gpus=simulation.client_num_gpus)
        from hybridfl.launch.deploy_local import deploy

        return deploy(overrides, flwr_home.resolve(), deployment.supernodes, deployment.slow_nodes(),
                      plain_http=deployment.plain_http, executor=deployment.executor)[0]

    return run_and_report(go, verbose)


@contextlib.contextmanager
def progress_line(verbose: bool) -> Iterator[None]:
    """On a terminal (and unless `verbose`): the runs of this process report to a progress line, and Flower's
    INFO lines (the per-step log, device timings) stay quiet meanwhile; warnings and errors still print."""
    from hybridfl.progress import Line, RunProgress
    from server_app.tracking import watching

    line = Line()
    if verbose or not line.tty:
        yield
        return
    flwr = logging.getLogger("flwr")
    level = flwr.level
    flwr.setLevel(logging.WARNING)
    try:
        with watching(lambda cfg, out: RunProgress(cfg, out, line)):
            yield
    finally:
        flwr.setLevel(level)
        line.close()


OWN_TASK = ("dataset", "model")  # keys that name a task of one's own


def command_overrides(args: list[str]) -> dict[str, Any]:
    """``[PRESET] [KEY=VALUE ...]`` -> run-config overrides: the preset named first (else a ``preset`` key, else,
    unless a run is resumed or names its own task, the main job) and the overrides. A task of one's own
    (``dataset`` or ``model`` given, no preset) runs on the plain base, the run keys' defaults (``RunConfig.preset``:
    FedAvg, no server data), not on the main job's protocol."""
    preset = args[0] if args and "=" not in args[0] else None
    given = parse_overrides(args[1:] if preset else args)
    if preset:
        return {**given, "preset": preset}
    own = {"resume", "preset", *OWN_TASK} & set(given)
    return given if own else {"preset": MAIN_JOB, **given}


@app.command()
def run(args: Annotated[list[str] | None, typer.Argument(metavar="[PRESET] [KEY=VALUE]...",
                                                        help="a preset (`hybridfl presets`; default: the main job "
                                                             f"{MAIN_JOB}) and run-config overrides")] = None,
        mode: Annotated[Mode, typer.Option(help=MODE_HELP)] = Mode.in_process,
        flwr_home: FlwrHome = Path(".flwr"), supernodes: Supernodes = None, latency: Latency = None,
        plain_http: PlainHttp = False, executor: Executor = "warm", ray: Ray = None,
        client_num_cpus: ClientCpus = 1.0, client_num_gpus: ClientGpus = None, verbose: Verbose = False) -> None:
    """Run a preset, with overrides; outputs go to `<output-dir>/<run-name>/`."""
    raise typer.Exit(launch(_or_exit_2(lambda: command_overrides(args or [])), mode, flwr_home,
                            DeploymentFlags(supernodes, tuple(latency or ()), plain_http, executor), verbose,
                            SimulationFlags(ray, client_num_cpus, client_num_gpus)))


@app.command()
def resume(run_dir: Annotated[Path, typer.Argument(help="a run folder with a checkpoint.pt")],
           overrides: Annotated[list[str] | None, typer.Argument(metavar="[KEY=VALUE]...",
                                                                 help="only keys a resumed run may change, such as "
                                                                      "num-rounds")] = None,
           mode: Annotated[Mode, typer.Option(help=MODE_HELP)] = Mode.in_process,
           flwr_home: FlwrHome = Path(".flwr"), supernodes: Supernodes = None, latency: Latency = None,
           plain_http: PlainHttp = False, executor: Executor = "warm", ray: Ray = None,
           client_num_cpus: ClientCpus = 1.0, client_num_gpus: ClientGpus = None, verbose: Verbose = False) -> None:
    """Continue a run from its last checkpoint, in its own folder (any mode resumes a run of any mode)."""
    given = _or_exit_2(lambda: parse_overrides(overrides or []))
    raise typer.Exit(launch({**given, "resume": str(run_dir.resolve())}, mode, flwr_home,
                            DeploymentFlags(supernodes, tuple(latency or ()), plain_http, executor), verbose,
                            SimulationFlags(ray, client_num_cpus, client_num_gpus)))


# A sentence ends at a full stop before a capital, a digit, a bracket or the end, but not after an abbreviation
SENTENCE_END = re.compile(r"(?<!App)(?<!Tab)(?<!Fig)(?<!Eq)(?<!Alg)(?<!Sec)(?<!al)(?<!e\.g)(?<!i\.e)"
                          r"\.(?=\s+[A-Z0-9(`]|$)")


def describe(name: str) -> str:
    """A preset's one line: the first sentence of its leading comment, whole, else what it builds on and what it
    sets."""
    from server_app.presets import preset_file, preset_path

    comment = []
    for line in preset_path(name).read_text().splitlines():
        if not line.startswith("#") or (comment and not line.strip("# ")):
            break
        if line.strip("# "):
            comment.append(line.strip("# "))
    if comment:
        text = " ".join(comment)
        end = SENTENCE_END.search(text)
        return text[:end.end()] if end else text
    bases, data = preset_file(name)
    return " + ".join(filter(None, [", ".join(bases), ", ".join(f"{k}={v}" for k, v in data.items())]))


@app.command()
def presets(family: Annotated[str, typer.Argument(help="only presets whose name starts with this")] = "") -> None:
    """List the presets under configs/, each with its one-line description."""
    from server_app.presets import preset_names

    names = [n for n in preset_names() if n.startswith(family)]
    width = max((len(n) for n in names), default=0)
    for name in names:
        typer.echo(f"{name:<{width}}  {describe(name)}")


@app.command()
def options(strategy: Annotated[str, typer.Argument(help="a strategy's name (`fedbuff`), or your own "
                                                         "'module:Class'")]) -> None:
    """A method's own keys, with their defaults, what is allowed and what they mean (the reference's
    configuration keys have every key)."""
    from hybridfl.config_table import method_table

    _echo_or_exit_2(lambda: method_table(strategy))


@app.command()
def certs(directory: Annotated[Path, typer.Argument(help="where the files go (kept if they exist)")],
          name: Annotated[list[str] | None, typer.Option(help="a name the devices reach the SuperLink by (repeatable; "
                                                                "default: superlink, edge, the compose file's); "
                                                                "localhost and 127.0.0.1 are always added")] = None,
          nodes: Annotated[int, typer.Option(min=0, help="SuperNode key pairs and secrets to create")] = 0) -> None:
    """Certificates, SuperNode keys and Runtime API secrets for a secured deployment (TLS, SuperNode authentication,
    SuperExec authentication): a CA, the SuperLink's and the edge's certificates (a key each), `supernode-I` key
    pairs, and `superlink.secret`
    and `supernode-I.secret` (docs: "TLS and node authentication")."""
    from hybridfl.launch.pki import DEFAULT_NAMES, make_pki

    make_pki(directory, tuple(name or DEFAULT_NAMES), nodes)
    typer.echo(f"certificates, keys and secrets in {directory} (keep the keys and the secrets private)")


@app.command()
def edge(directory: Annotated[Path, typer.Argument(help="where nginx.conf, listen.conf and nginx's own files go")],
         certs: Annotated[Path, typer.Option(help="the folder of `hybridfl certs` (ca.crt, edge.crt, edge.key)")],
         superlink: Annotated[str, typer.Option(help="the SuperLink's own address (HOST:PORT), on this machine's "
                                                     "loopback")] = "127.0.0.1:9093",
         listen: Annotated[str, typer.Option(help="the devices' address (HOST:PORT) the edge listens on")
                           ] = "0.0.0.0:8000",
         plain_http: Annotated[bool, typer.Option(help="no TLS (a closed test bench only)")] = False,
         fleet_size: Annotated[int, typer.Option(help="devices that may reach the edge from one address (a fleet "
                                                      "behind one NAT: all of it); sizes the per-client connection "
                                                      "and rate limits and nginx's connections")] = FLEET_SIZE,
         max_body_mib: Annotated[int, typer.Option(help="the largest request body a device sends (push-object: one "
                                                        "array chunk of Flower's, 5 MiB, and its framing); every "
                                                        "other route takes 1 MiB")] = MAX_BODY_MIB,
         link_rate: Annotated[int, typer.Option(help="asks for work (a pull of messages, an activation) a second the "
                                                     "edge passes to the SuperLink from all devices together; work "
                                                     "under way and heartbeats pass (Flower 1.42's SuperLink answers "
                                                     "on one event loop: docs \"Sizing a deployment\")")
                              ] = LINK_RATE) -> None:
    """The edge proxy (nginx) for a SuperLink of one's own: on the devices' port, only Flower's Fleet API and /health
    reach the SuperLink, within limits sized by --fleet-size, --max-body-mib and --link-rate; its Control and
    Runtime APIs stay on `--superlink`, which only this machine reaches (docs: "A deployment on devices", and
    security.md "The edge's limits, and how to size them"). Prints the nginx command that runs it."""
    import shlex

    from hybridfl.launch import edge as edge_proxy

    needed = () if plain_http else ("ca.crt", "edge.crt", "edge.key")
    if missing := [str(certs / f) for f in needed if not (certs / f).is_file()]:
        typer.echo(f"error: --certs {certs}: no {', '.join(missing)} (make them with `hybridfl certs {certs}`)",
                   err=True)
        raise typer.Exit(2)
    try:
        conf = edge_proxy.write(directory, certs, superlink, listen, plain_http, fleet_size=fleet_size,
                                max_body_mib=max_body_mib, link_rate=link_rate)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(shlex.join(edge_proxy.command(conf)))


SweepSpec = Annotated[Path, typer.Argument(help="a sweep spec (YAML; docs: \"Sweeps and tracking\")")]


@app.command()
def sweep(spec: SweepSpec,
          jobs: Annotated[int, typer.Option(min=1, help="runs in parallel on this machine (processes, one torch "
                                                        "thread each)")] = 1,
          ray: Annotated[str | None, typer.Option(help="run every run as a task on the Ray cluster at this address "
                                                       "(what `ray start --head` prints) instead of --jobs "
                                                       "processes here")] = None,
          run_num_cpus: Annotated[float, typer.Option(help="--ray: CPUs each run holds")] = 1.0,
          run_num_gpus: Annotated[float, typer.Option(help="--ray: GPUs each run holds (fractional: 0.25 = four "
                                                           "runs share one GPU)")] = 0.0) -> None:
    """Run a sweep's runs that have no current result (resumable: run it again after a stop), then report it."""
    from common.errors import ConfigError
    from hybridfl import sweep as sweeps
    from hybridfl.progress import Line, SweepProgress

    def go() -> str:
        if ray is None and (run_num_cpus, run_num_gpus) != (1.0, 0.0):
            raise ConfigError("--ray", None, "a Ray cluster's address: --run-num-cpus and --run-num-gpus place runs "
                              "on one")
        if ray is not None and jobs != 1:
            raise ConfigError("--jobs", jobs, "1 with --ray: the cluster's resources decide how many runs at once")
        place = sweeps.RayPlace(ray, run_num_cpus, run_num_gpus) if ray else None
        return sweeps.run(sweeps.load(spec), jobs, progress=SweepProgress(Line(sys.stdout)), ray=place)

    try:
        _echo_or_exit_2(go)
    except sweeps.RunsFailed as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None


@app.command()
def report(spec: SweepSpec) -> None:
    """Tabulate a sweep from its results file, running nothing."""
    from hybridfl import sweep as sweeps

    _echo_or_exit_2(lambda: sweeps.report(sweeps.load(spec)))


superlink_db = typer.Typer(help="The SuperLink's database (`flower-superlink --database FILE`): Flower never deletes "
                                "a run, its logs or its app, so the file grows with every run (docs/security.md, "
                                "\"The SuperLink's database\").", no_args_is_help=True)
app.add_typer(superlink_db, name="superlink-db")


@superlink_db.command("prune")
def prune_superlink_db(
        db: Annotated[Path, typer.Argument(help="the SuperLink's --database file (compose: superlink.db in the "
                                                "superlink-state volume)")],
        keep: Annotated[int, typer.Option(min=0, help="finished runs to keep, the newest")] = 10,
        vacuum: Annotated[bool, typer.Option(help="give the freed space back to the file system (VACUUM: rewrites "
                                                  "what is kept, holding the database's lock meanwhile); without it "
                                                  "SQLite reuses the space: the file stops growing")] = True) -> None:
    """Delete the finished runs beyond the newest --keep (their tasks, logs, events, messages, objects, and the apps
    and run series no kept run uses), then give the space back (VACUUM); safe while the SuperLink runs (a run that has
    not finished is never touched). Prints what it removed and the file's size before and after; a file that is not
    a SuperLink database is refused (exit 2), unchanged."""
    from hybridfl.launch.linkdb import prune

    _echo_or_exit_2(lambda: str(prune(db, keep, vacuum)))


T = TypeVar("T")


def _or_exit_2(make: Callable[[], T]) -> T:
    """What `make` returns; a bad spec, configuration or override is one line on stderr and exit code 2."""
    from common.errors import ConfigError

    try:
        return make()
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


def _echo_or_exit_2(make: Callable[[], str]) -> None:
    """Print what `make` returns (:func:`_or_exit_2`)."""
    typer.echo(_or_exit_2(make))


def main(argv: list[str] | None = None) -> int:
    """The command with `argv` (default: the process's), returning its exit code: 130 after Ctrl-C, as a shell
    reports a process it interrupted (the launchers stop what they started on the way out)."""
    try:
        return app(args=argv, standalone_mode=False) or 0
    except click.ClickException as err:  # a usage error: the message, as the command line prints it
        err.show()
        return err.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):  # click turns a KeyboardInterrupt into Abort
        print("interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The `hybridfl` console command: SIGTERM (a `kill`, a service manager, CI's timeout) unwinds every launcher
    as Ctrl-C does, stopping what it started, and exits 143."""
    signal.signal(signal.SIGTERM, terminated)
    raise SystemExit(main())


if __name__ == "__main__":
    entry()
