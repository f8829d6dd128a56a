"""The `trainmedic` command: the app, its top-level verbs (up, demo, diagnose, executor) and the wiring.

Each noun has its module: recommendations_cli, policy_cli, nodes_cli, mode_cli, audit_cli,
produce_cli, readiness_cli, bench_cli. Exit statuses: schemas/errors.py, docs/cli.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from schemas.errors import ExitCode, Unavailable, UsageError
from schemas.extras import require
from schemas.printable import printable
from trainmedic.cli.acls import acls_cmd
from trainmedic.cli.audit import audit_app
from trainmedic.cli.backend import (
    KnownHostsOpt,
    RemoteConfOpt,
    RestTokenFileOpt,
    RestUrlOpt,
    RestUserOpt,
    SshKeyOpt,
    SshOpt,
    scheduler_backend,
)
from trainmedic.cli.base import new_app, settings, use_config
from trainmedic.cli.bench import bench_app
from trainmedic.cli.config import config_app
from trainmedic.cli.ingest import ingest_app
from trainmedic.cli.migrations import migrations_app
from trainmedic.cli.mode import mode_app
from trainmedic.cli.nodes import nodes_app
from trainmedic.cli.policy import policy_app
from trainmedic.cli.produce import produce_app
from trainmedic.cli.readiness import readiness_cmd
from trainmedic.cli.recommendations import recommendations_app
from trainmedic.cli.run import run_app
from trainmedic.cli.topics import topics_app
from trainmedic.settings import clickhouse_dsn

app = new_app(help="Workload-level recovery for distributed AI training on Slurm.")

DataDir = Annotated[Path, typer.Option("--data-dir", help="Where the embedded chDB audit and logs live.")]


def up_needs(bootstrap: str | None, clickhouse: str | None) -> tuple[str, str]:
    """The extra `up` needs, and why, given the effective Kafka and ClickHouse settings."""
    embedded = [
        what
        for what, needed in (
            ("the embedded broker (no --bootstrap)", not bootstrap),
            ("the embedded chDB audit (no ClickHouse server URL)", not clickhouse or clickhouse.startswith("chdb://")),
        )
        if needed
    ]
    if embedded:
        return "embedded", f"trainmedic up with {' and '.join(embedded)}"
    return "server", "trainmedic up"


@app.command()
def up(
    data_dir: DataDir = Path("var"),
    bootstrap: Annotated[
        Optional[str], typer.Option(help="Use this Kafka (HOST:PORT) instead of the embedded broker.")
    ] = None,
    clickhouse: Annotated[
        Optional[str], typer.Option(help="ClickHouse URL (http://user:pw@host:8123) instead of embedded chDB.")
    ] = None,
    policy: Annotated[
        Optional[Path], typer.Option(help="Policy YAML (default: the packaged streams/policies/default.yaml).")
    ] = None,
    mode: Annotated[
        Optional[str], typer.Option(help="Override the policy's mode everywhere: monitor|autonomous.")
    ] = None,
    backend: Annotated[
        Optional[str],
        typer.Option(
            help="Scheduler backend: slurm-cli (this host), slurm-ssh (a login node), slurm-rest (slurmrestd, JWT), "
            "pyslurm (in-process, untested) or simulated (default: the settings' slurm_access, local: slurm-cli)."
        ),
    ] = None,
    api_port: Annotated[int, typer.Option(help="Port of the operator API (approvals, modes, nodes).")] = 8477,
    api_host: Annotated[
        str, typer.Option(help="Address of the operator API; loopback unless TLS (api_tls_cert/_key) or --insecure.")
    ] = "127.0.0.1",
    insecure: Annotated[bool, typer.Option(help="Allow the API on a non-loopback address without TLS.")] = False,
    metrics_port: Annotated[int, typer.Option(help="Streams worker's Prometheus port on 127.0.0.1; 0: off.")] = 9478,
    metrics_address: Annotated[
        str,
        typer.Option(
            help="HOST:PORT of the Prometheus listener for the rest of `up` (unauthenticated, read-only); off: none."
        ),
    ] = "127.0.0.1:9479",
    broker_port: Annotated[
        int, typer.Option(help="Port of the embedded broker; 0: the previous run's when free (stable), else any.")
    ] = 0,
    max_crashes: Annotated[
        int, typer.Option(min=0, help="Restarts allowed per part within 5 minutes; one more stops `up` (exit 3).")
    ] = 5,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Streams workers (one consumer group; jobs split between them by partition). At most the "
            "topics' partition count; their metrics ports are --metrics-port and up, passing over "
            "--metrics-address's and --api-port's.",
        ),
    ] = 1,
    ssh: SshOpt = None,
    ssh_key: SshKeyOpt = None,
    known_hosts: KnownHostsOpt = None,
    remote_slurm_conf: RemoteConfOpt = None,
    rest_url: RestUrlOpt = None,
    rest_user: RestUserOpt = None,
    rest_token_file: RestTokenFileOpt = None,
) -> None:
    """Start the broker (or use --bootstrap), streams worker, executor and audit sink, supervised; Ctrl-C stops all."""
    # Before the stack's imports: the first missing module there is a [server] one (uvicorn),
    # whichever extra the command needs.
    require(*up_needs(settings(bootstrap=bootstrap).bootstrap, clickhouse_dsn(settings(clickhouse_url=clickhouse))))
    from streams.policy import load_policy
    from trainmedic.stack.metrics_server import parse_address
    from trainmedic.stack.runtime import LOOPBACK, Stack, StackConfig

    # Refusals that need no start-up work come first.
    api_settings = settings()
    if api_host not in LOOPBACK and not insecure and api_settings.api_tls_cert is None:
        raise UsageError(
            f"--api-host {api_host}: off loopback the operator API serves TLS (the settings api_tls_cert and "
            "api_tls_key) or needs --insecure (TLS terminated in front of it)"
        )
    metrics_at = parse_address(metrics_address)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if mode not in (None, "monitor", "autonomous"):
        raise UsageError(f"--mode {mode!r}: expected monitor or autonomous")
    load_policy(policy)
    sched = scheduler_backend(
        backend, ssh, ssh_key, known_hosts, remote_slurm_conf, (rest_url, rest_user, rest_token_file)
    )
    config = StackConfig(
        data_dir=data_dir,
        bootstrap=settings(bootstrap=bootstrap).bootstrap,
        clickhouse=clickhouse_dsn(settings(clickhouse_url=clickhouse)),
        policy=settings(policy=policy).policy,
        mode=mode,
        api_port=api_port,
        api_host=api_host,
        api_insecure=insecure,
        api_tls_cert=api_settings.api_tls_cert,
        api_tls_key=api_settings.api_tls_key,
        worker_metrics_port=metrics_port or None,
        metrics_host=metrics_at[0] if metrics_at else "127.0.0.1",
        metrics_port=metrics_at[1] if metrics_at else None,
        broker_port=broker_port or None,
        supervise=True,
        max_crashes=max_crashes,
        workers=workers,
    )
    stack = Stack(config, sched).start()
    durability = (
        f"The embedded broker on {stack.bootstrap} keeps events in memory only: stopping or restarting `up` "
        "loses events not yet processed; the audit is the durable record. It also keeps every event, and grows "
        "slower as it holds more: for a demo or a trial; run a cluster on Kafka (--bootstrap)."
        if stack.broker is not None
        else f"Kafka {stack.bootstrap}."
    )
    typer.echo(
        f"trainmedic is up: {durability} Audit {stack.store.where if stack.store else '?'}, "
        f"scheduler {sched.name}, operator API and console {stack.api.url + '/' if stack.api else '-'} "
        f"(operator token in {stack.config.token_file}, read-only token in {stack.config.viewer_token_file}), "
        f"metrics {stack.metrics.url if stack.metrics else 'off'} (streams workers: "
        f"{', '.join(f'127.0.0.1:{p}' for p in stack.worker_metrics_ports()) or 'off'}), logs in {stack.logs_dir}. "
        "Dead parts are restarted; Ctrl-C stops."
    )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    # Explicitly: a process started in the background of a non-interactive shell inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt for it - `kill -INT` did nothing.
    signal.signal(signal.SIGINT, lambda *_: done.set())
    supervisor = stack.supervisor
    assert supervisor is not None
    with contextlib.suppress(KeyboardInterrupt):
        while not done.wait(0.5) and not supervisor.gave_up.is_set():
            pass
    if supervisor.gave_up.is_set():
        typer.echo("stopping after repeated crashes: executor, audit sink, streams worker, broker ...")
        stack.stop()
        raise Unavailable(f"trainmedic stopped: {supervisor.failure}")
    typer.echo("stopping: executor, audit sink, streams worker, broker ...")
    stack.stop()
    typer.echo("trainmedic stopped cleanly.")


@app.command()
def demo(
    data_dir: DataDir = Path("var"),
    mode: Annotated[str, typer.Option(help="monitor (recommend only) or autonomous (act).")] = "autonomous",
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
    slurm: Annotated[
        bool, typer.Option("--slurm", help="Act on the local Slurm cluster instead of the simulator.")
    ] = False,
) -> None:
    """Run the whole loop: a simulated training job, a Xid 79, and trainmedic finding and fixing it."""
    require("embedded", "trainmedic demo (the embedded broker and chDB)")
    from trainmedic.stack.demo import run_demo

    if mode not in ("monitor", "autonomous"):
        raise UsageError(f"--mode {mode!r}: expected monitor or autonomous")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    say = (lambda _m: None) if as_json else typer.echo
    if not as_json:
        typer.echo(
            f"demo: mode {mode}"
            + (
                " (the default for the demo, so that the whole loop is visible; deployments default to monitor)"
                if mode == "autonomous"
                else ""
            )
        )
    report = run_demo(data_dir, mode=mode, slurm=slurm, say=say)
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
    if not report["correct"]:
        raise typer.Exit(ExitCode.NO)


@app.command()
def diagnose(
    paths: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="Job logs, kernel logs (kern.log*, dmesg*, syslog*), directories (every file in them) or - (stdin)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    job: Annotated[
        Optional[str],
        typer.Option(
            "--job", help="A Slurm job id: diagnose its StdOut/StdErr with its node list (from Slurm), plus any PATHS."
        ),
    ] = None,
    slurm_conf: Annotated[
        Optional[str], typer.Option("--slurm-conf", help="With --job: the slurm.conf to ask (default $SLURM_CONF).")
    ] = None,
    nodelist: Annotated[
        Optional[str], typer.Option("--nodelist", help="The job's nodes, a Slurm hostlist (gpu[01-04]).")
    ] = None,
    ranks_per_node: Annotated[
        Optional[int],
        typer.Option(
            "--ranks-per-node",
            help="Ranks per node (block); default: torchrun's local world size if the log prints it.",
        ),
    ] = None,
    distribution: Annotated[
        str, typer.Option("--distribution", help="How ranks were placed on --nodelist: block or cyclic.")
    ] = "block",
    rank_map: Annotated[
        Optional[Path], typer.Option("--rank-map", help="File of 'RANK NODE' lines, for any other placement.")
    ] = None,
) -> None:
    """Post-mortem: run the detectors and attribution offline over log files (no broker needed).

    Exit status: 0 healthy, 1 a fault was found (or a crash of unknown cause), 2 bad input."""
    from trainmedic.ops.diagnose import DiagnoseError, diagnose_paths

    if job is not None:
        from trainmedic.ops.diagnose_job import diagnose_job

        if nodelist is not None or rank_map is not None:
            raise DiagnoseError("--job takes the node list from Slurm: give no --nodelist or --rank-map with it")
        report = diagnose_job(
            job,
            extra_paths=paths or [],
            slurm_conf=slurm_conf,
            ranks_per_node=ranks_per_node,
            distribution=distribution,
        )
    elif not paths:
        raise DiagnoseError("give log PATHS, or --job ID")
    else:
        report = diagnose_paths(
            paths, nodelist=nodelist, ranks_per_node=ranks_per_node, distribution=distribution, rank_map=rank_map
        )
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        culprit = report["culprit"] or report["culprit_node_resolved"] or "no single node"
        if report["culprit_rank"] is not None:
            how = ", node from the rank map" if not report["culprit"] and report["culprit_node_resolved"] else ""
            culprit += f" (rank {report['culprit_rank']}{how})"
        if "job" in report:
            j = report["job"]
            typer.echo(
                printable(
                    f"job         {j['job_id']} ({j['state']}) on {j['nodelist'] or 'no nodes'}: {', '.join(j['paths'])}"
                )
            )
        # One line each, control characters escaped: the evidence quotes the logs (ANSI colours and all).
        for line in (
            f"category    {report['category']}",
            f"culprit     {culprit}",
            f"action      {report['action']}",
            f"confidence  {report['confidence']}",
            f"why         {report['explanation']}",
        ):
            typer.echo(printable(line))
        for e in report["evidence"][:20]:
            where = e["node"] or "?"
            if e["rank"] is not None:
                where += f" rank {e['rank']}"
            typer.echo(printable(f"  [{e['role']:10}] {e['signature']:28} {where:16} {e['line'][:160]}"))
    if report["category"] != "healthy":
        raise typer.Exit(ExitCode.NO)


app.add_typer(recommendations_app, name="recommendations")
app.add_typer(policy_app, name="policy")
app.add_typer(nodes_app, name="nodes")
app.add_typer(migrations_app, name="migrations")
app.add_typer(mode_app, name="mode")
app.add_typer(audit_app, name="audit")
app.add_typer(produce_app, name="produce")
app.command("readiness")(readiness_cmd)
app.add_typer(bench_app, name="bench")
app.add_typer(config_app, name="config")
app.add_typer(ingest_app, name="ingest")
app.add_typer(run_app, name="run")
# On the topics noun without touching topics.py: the ACLs are of the topics it creates.
topics_app.command("acls")(acls_cmd)
app.add_typer(topics_app, name="topics")


def _print_version(value: bool) -> None:
    if value:
        from trainmedic.build import VERSION

        typer.echo(f"trainmedic {VERSION}")
        raise typer.Exit()


@app.callback()
def _settings(
    config: Annotated[
        Optional[Path],
        typer.Option(
            "--config",
            help="Settings file (YAML; default: TRAINMEDIC_CONFIG, else /etc/trainmedic/config.yaml if present). "
            "Precedence: flags, then TRAINMEDIC_* environment, then this file. `trainmedic config show` prints them.",
        ),
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, help="Print the version and exit.", callback=_print_version)
    ] = False,
) -> None:
    """Workload-level recovery for distributed AI training on Slurm."""
    # Before any command: its cluster name and Kafka security are the whole process's.
    use_config(config)


def _print_report(r: dict[str, Any]) -> None:
    inc, dec, res = r["incident"], r["decision"], r["action_result"]
    lines = [
        "",
        f"incident     {inc['incident_id']}  job {inc['job_id']}",
        f"  category   {inc['category']}   culprit {inc['culprit']}   confidence {inc['confidence']}",
        f"  why        {inc['explanation']}",
        f"  evidence   {inc['evidence_lines']} signals in this one incident: {'; '.join(inc['evidence_summary'])}",
        f"decision     {dec['action']} ({dec['kind']}, mode {dec['mode']}; rule {dec['rule']})",
    ]
    if res:
        lines.append(
            f"action       {res['status']}: "
            + "; ".join(res["steps"])
            + (f" ERROR {res['error']}" if res["error"] else "")
        )
    else:
        lines.append("action       none taken: monitor mode records a recommendation; the scheduler was not called")
    lines += [
        f"latency      detection {r['detection_latency_s']:.2f} s (Xid line written -> incident published)"
        + (
            f"; action {r['action_latency_s']:.2f} s (incident -> drain + requeue verified)"
            if r["action_latency_s"] is not None
            else ""
        ),
        "             (NVIDIA's published means: detection 69 s, recovery action 94 s)",
        f"healthy job  {r['healthy_job']['job_id'] or '(none on this cluster)'}: {r['healthy_job']['incidents']} incidents",
        f"scheduler    {', '.join(r['scheduler_calls']) or 'no calls'}; job now {r['job_after']['state']} on "
        f"{','.join(r['job_after']['nodes']) or '-'}",
        f"verdict      {'culprit and category correct' if r['correct'] else 'WRONG attribution'}",
    ]
    typer.echo("\n".join(lines))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
