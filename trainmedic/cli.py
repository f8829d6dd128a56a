"""The `trainmedic` command."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from schemas.vocab import CATEGORIES, MODES, REJECT_REASONS
from trainmedic.audit_cli import audit_app, db_app
from trainmedic.bench_cli import bench_app
from trainmedic.policy_cli import policy_app
from trainmedic.produce_cli import produce_app
from trainmedic.readiness_cli import label_cmd, readiness_cmd, replay_cmd

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Workload-level recovery for distributed AI training on Slurm."
)

DataDir = Annotated[Path, typer.Option("--data-dir", help="Where the embedded chDB audit and logs live.")]


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


SshOpt = Annotated[Optional[str], typer.Option("--ssh", help="slurm-ssh: USER@HOST[:PORT] of a login node.")]
SshKeyOpt = Annotated[Optional[Path], typer.Option("--ssh-key", help="slurm-ssh: private key file.")]
KnownHostsOpt = Annotated[Optional[Path], typer.Option("--known-hosts", help="slurm-ssh: known_hosts file (strict).")]
RemoteConfOpt = Annotated[Optional[str], typer.Option("--remote-slurm-conf", help="slurm-ssh: SLURM_CONF there.")]
RestUrlOpt = Annotated[Optional[str], typer.Option("--rest-url", help="slurm-rest: slurmrestd URL, https://HOST:PORT.")]
RestUserOpt = Annotated[Optional[str], typer.Option("--rest-user", help="slurm-rest: the Slurm user of the token.")]
RestTokenFileOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--rest-token-file", help="slurm-rest: file holding the JWT (default: env TRAINMEDIC_SLURMRESTD_TOKEN)."
    ),
]


@app.command()
def up(
    data_dir: DataDir = Path("var"),
    bootstrap: Annotated[
        Optional[str], typer.Option(help="Use this Kafka (HOST:PORT) instead of the embedded broker.")
    ] = None,
    clickhouse: Annotated[
        Optional[str], typer.Option(help="ClickHouse URL (http://user:pw@host:8123) instead of embedded chDB.")
    ] = None,
    policy: Annotated[Optional[Path], typer.Option(help="Policy YAML (default infra/policies/default.yaml).")] = None,
    mode: Annotated[
        Optional[str], typer.Option(help="Override the policy's mode everywhere: monitor|autonomous.")
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            help="Scheduler backend: slurm-cli (this host), slurm-ssh (a login node), slurm-rest (slurmrestd, JWT), "
            "pyslurm (in-process, untested) or simulated."
        ),
    ] = "slurm-cli",
    api_port: Annotated[int, typer.Option(help="Port of the operator API (approvals, modes, nodes).")] = 8477,
    api_host: Annotated[
        str, typer.Option(help="Address of the operator API; loopback unless --insecure.")
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
    ssh: SshOpt = None,
    ssh_key: SshKeyOpt = None,
    known_hosts: KnownHostsOpt = None,
    remote_slurm_conf: RemoteConfOpt = None,
    rest_url: RestUrlOpt = None,
    rest_user: RestUserOpt = None,
    rest_token_file: RestTokenFileOpt = None,
) -> None:
    """Start the broker (or use --bootstrap), streams worker, executor and audit sink, supervised; Ctrl-C stops all."""
    from streams.policy import PolicyError, load_policy
    from trainmedic.broker import BrokerError
    from trainmedic.metrics_server import MetricsError, parse_address
    from trainmedic.runtime import LOOPBACK, Stack, StackConfig, StackError

    # Refusals that need no start-up work come first.
    if api_host not in LOOPBACK and not insecure:
        _fail(
            f"--api-host {api_host}: the operator API binds loopback only unless --insecure is given "
            "(TLS termination belongs in front of it)"
        )
    try:
        metrics_at = parse_address(metrics_address)
    except MetricsError as exc:
        _fail(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if mode not in (None, "monitor", "autonomous"):
        _fail(f"--mode {mode!r}: expected monitor or autonomous")
    try:
        load_policy(policy)
    except PolicyError as exc:
        _fail(str(exc))
    sched = _backend(backend, ssh, ssh_key, known_hosts, remote_slurm_conf, (rest_url, rest_user, rest_token_file))
    try:
        config = StackConfig(
            data_dir=data_dir,
            bootstrap=bootstrap,
            clickhouse=clickhouse,
            policy=policy,
            mode=mode,
            api_port=api_port,
            api_host=api_host,
            api_insecure=insecure,
            worker_metrics_port=metrics_port or None,
            metrics_host=metrics_at[0] if metrics_at else "127.0.0.1",
            metrics_port=metrics_at[1] if metrics_at else None,
            broker_port=broker_port or None,
            supervise=True,
            max_crashes=max_crashes,
        )
        stack = Stack(config, sched).start()
    except (StackError, BrokerError, MetricsError) as exc:
        _fail(str(exc))
    durability = (
        f"The embedded broker on {stack.bootstrap} keeps events in memory only: stopping or restarting `up` "
        "loses events not yet processed; the audit is the durable record."
        if stack.broker is not None
        else f"Kafka {stack.bootstrap}."
    )
    typer.echo(
        f"trainmedic is up: {durability} Audit {stack.store.url if stack.store else '?'}, "
        f"scheduler {sched.name}, operator API and console {stack.api.url + '/' if stack.api else '-'} "
        f"(operator token in {stack.config.token_file}, read-only token in {stack.config.viewer_token_file}), "
        f"metrics {stack.metrics.url if stack.metrics else 'off'}, logs in {stack.logs_dir}. "
        "Dead parts are restarted; Ctrl-C stops."
    )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    supervisor = stack.supervisor
    assert supervisor is not None
    with contextlib.suppress(KeyboardInterrupt):
        while not done.wait(0.5) and not supervisor.gave_up.is_set():
            pass
    if supervisor.gave_up.is_set():
        typer.echo("stopping after repeated crashes: executor, audit sink, streams worker, broker ...")
        stack.stop()
        _fail(f"trainmedic stopped: {supervisor.failure}", code=3)
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
    from trainmedic.demo import DemoError, run_demo
    from trainmedic.runtime import StackError

    if mode not in ("monitor", "autonomous"):
        _fail(f"--mode {mode!r}: expected monitor or autonomous")
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
    try:
        report = run_demo(data_dir, mode=mode, slurm=slurm, say=say)
    except (DemoError, StackError) as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
    if not report["correct"]:
        raise typer.Exit(1)


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
    from trainmedic.diagnose import DiagnoseError, diagnose_paths

    try:
        if job is not None:
            from trainmedic.diagnose_job import diagnose_job

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
    except DiagnoseError as exc:
        _fail(str(exc))
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
                f"job         {j['job_id']} ({j['state']}) on {j['nodelist'] or 'no nodes'}: {', '.join(j['paths'])}"
            )
        typer.echo(
            f"category    {report['category']}\nculprit     {culprit}\naction      {report['action']}\n"
            f"confidence  {report['confidence']}\nwhy         {report['explanation']}"
        )
        for e in report["evidence"][:20]:
            where = e["node"] or "?"
            if e["rank"] is not None:
                where += f" rank {e['rank']}"
            typer.echo(f"  [{e['role']:10}] {e['signature']:28} {where:16} {e['line'][:160]}")
    if report["category"] != "healthy":
        raise typer.Exit(1)


def _backend(
    name: str,
    ssh: str | None = None,
    ssh_key: Path | None = None,
    known_hosts: Path | None = None,
    remote_slurm_conf: str | None = None,
    rest: tuple[str | None, str | None, Path | None] = (None, None, None),
) -> Any:
    """The scheduler backend: slurm-cli runs Slurm's CLI here (munge auth); slurm-ssh runs it on a
    login node over SSH with strict host-key checking; slurm-rest calls slurmrestd with a JWT
    (what its API cannot do is refused, see sinks/backends/slurm_rest_api.yaml); pyslurm calls libslurm in-process (Slurm
    23.02+, untested here); simulated is the demo's in-memory scheduler."""
    if name == "slurm-cli":
        from sinks.backends.slurm_cli import SlurmCliBackend

        return SlurmCliBackend()
    if name == "slurm-ssh":
        from sinks.backends.slurm_ssh import slurm_ssh_backend

        if not ssh or not ssh_key or not known_hosts:
            _fail("--backend slurm-ssh needs --ssh USER@HOST[:PORT], --ssh-key FILE and --known-hosts FILE")
        assert ssh and ssh_key and known_hosts
        user, _, hostport = ssh.rpartition("@")
        host, _, port = hostport.partition(":")
        if not user or not host or (port and not port.isdigit()):
            _fail(f"--ssh {ssh!r}: expected USER@HOST[:PORT]")
        try:
            return slurm_ssh_backend(host, int(port or 22), user, ssh_key, known_hosts, slurm_conf=remote_slurm_conf)
        except (ValueError, OSError) as exc:
            _fail(f"--ssh-key/--known-hosts: {exc}")
    if name == "slurm-rest":
        from sinks.backends.base import BackendError
        from sinks.backends.slurm_rest import SlurmRestBackend, TokenSource

        rest_url, rest_user, token_file = rest
        if not rest_url or not rest_user:
            _fail("--backend slurm-rest needs --rest-url URL and --rest-user USER (token: --rest-token-file FILE)")
        assert rest_url and rest_user
        token = TokenSource(file=token_file) if token_file else TokenSource(env="TRAINMEDIC_SLURMRESTD_TOKEN")
        try:
            return SlurmRestBackend(rest_url, rest_user, token)
        except (BackendError, ValueError) as exc:
            _fail(f"--backend slurm-rest: {exc}")
    if name == "simulated":
        from sinks.backends.simulated import SimulatedScheduler

        return SimulatedScheduler([])
    if name == "pyslurm":
        from sinks.backends.base import BackendError
        from sinks.backends.pyslurm_backend import PyslurmBackend

        try:
            return PyslurmBackend()
        except BackendError as exc:
            _fail(f"--backend pyslurm: {exc}")
    _fail(f"--backend {name!r}: expected slurm-cli, slurm-ssh, slurm-rest, pyslurm or simulated")


@app.command("executor")
def executor_cmd(
    bootstrap: Annotated[str, typer.Option(help="Kafka bootstrap servers HOST:PORT.")],
    policy: Annotated[Optional[Path], typer.Option(help="Policy YAML whose guardrails section applies.")] = None,
    backend: Annotated[str, typer.Option(help="Scheduler backend.")] = "slurm-cli",
    group: Annotated[str, typer.Option(help="Consumer group; replicas share it.")] = "trainmedic-executor",
    verify_timeout: Annotated[float, typer.Option(help="Seconds to wait for each effect to show.")] = 60.0,
    ssh: SshOpt = None,
    ssh_key: SshKeyOpt = None,
    known_hosts: KnownHostsOpt = None,
    remote_slurm_conf: RemoteConfOpt = None,
    rest_url: RestUrlOpt = None,
    rest_user: RestUserOpt = None,
    rest_token_file: RestTokenFileOpt = None,
    metrics_address: Annotated[
        str, typer.Option(help="HOST:PORT of a Prometheus listener (unauthenticated, read-only); off: none.")
    ] = "off",
) -> None:
    """Run only the executor (one replica of its consumer group), e.g. as its own Deployment."""
    from sinks.executor import Executor, ExecutorService, ExecutorSettings
    from sinks.guardrails import GuardrailConfigError, GuardrailFile, Guardrails
    from streams.policy import DEFAULT_POLICY
    from trainmedic.metrics_server import MetricsError, MetricsServer, parse_address
    from trainmedic.runtime import StackError, check_bootstrap

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        metrics_at = parse_address(metrics_address)
        check_bootstrap(bootstrap)
        rails = GuardrailFile(policy or DEFAULT_POLICY)
        metrics = MetricsServer(*metrics_at).start() if metrics_at else None
    except (StackError, GuardrailConfigError, OSError, MetricsError) as exc:
        _fail(str(exc))
    sched = _backend(backend, ssh, ssh_key, known_hosts, remote_slurm_conf, (rest_url, rest_user, rest_token_file))
    service = ExecutorService(
        bootstrap,
        Executor(sched, ExecutorSettings(verify_timeout_s=verify_timeout, group=group)),
        Guardrails(rails, sched),
    )
    signal.signal(signal.SIGTERM, lambda *_: service.stop_event.set())
    typer.echo(f"executor up: group {group}, scheduler {sched.name}, metrics {metrics.url if metrics else 'off'}")
    try:
        service.run()
    except KeyboardInterrupt:
        service.stop_event.set()
    except Exception as exc:
        # Only `up` supervises: alone, a dead loop exits non-zero so systemd or Kubernetes restarts it.
        logging.getLogger("trainmedic.executor").exception("the executor loop died")
        _fail(f"the executor loop died: {type(exc).__name__}: {exc}", code=3)
    if not service.stop_event.is_set():
        _fail("the executor loop ended without being asked to stop", code=3)
    typer.echo("executor stopped.")


ApiOpt = Annotated[Optional[str], typer.Option("--api", help="Operator API URL (default: from DATA_DIR/runtime.json).")]
TokenOpt = Annotated[
    Optional[str], typer.Option("--token", help="API token (default: TRAINMEDIC_TOKEN or DATA_DIR/api-token).")
]
OperatorOpt = Annotated[str, typer.Option("--operator", help="Who is doing this (recorded in the audit).")]


def _api(data_dir: Path, api: str | None, token: str | None, method: str, path: str, body: Any = None) -> Any:
    from trainmedic.client import ClientError, api_token, api_url, call

    try:
        return call(api_url(data_dir, api), api_token(data_dir, token), method, path, body)
    except ClientError as exc:
        _fail(str(exc))


def _whoami() -> str:
    return os.environ.get("USER") or os.environ.get("LOGNAME") or "operator"


@app.command()
def approve(
    decision_id: Annotated[str, typer.Argument(help="The recommendation's decision id (dec-...).")],
    comment: Annotated[str, typer.Option(help="Why.")] = "",
    operator: OperatorOpt = "",
    data_dir: DataDir = Path("var"),
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Approve a monitor-mode recommendation: the executor carries it out, recorded with who approved."""
    r = _api(
        data_dir,
        api,
        token,
        "POST",
        f"/api/recommendations/{decision_id}/approve",
        {"operator": operator or _whoami(), "comment": comment},
    )
    typer.echo(f"approved {decision_id}: action {r['action_id']} sent to the executor")


@app.command()
def reject(
    decision_id: Annotated[str, typer.Argument(help="The recommendation's decision id (dec-...).")],
    reason: Annotated[str, typer.Option(help=f"One of: {', '.join(REJECT_REASONS)}.")],
    comment: Annotated[str, typer.Option(help="Free text.")] = "",
    operator: OperatorOpt = "",
    data_dir: DataDir = Path("var"),
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Reject a recommendation, with a reason from a fixed list (it feeds readiness scoring)."""
    if reason not in REJECT_REASONS:
        _fail(f"--reason {reason!r}: expected one of {', '.join(REJECT_REASONS)}")
    _api(
        data_dir,
        api,
        token,
        "POST",
        f"/api/recommendations/{decision_id}/reject",
        {"operator": operator or _whoami(), "reason": reason, "comment": comment},
    )
    typer.echo(f"rejected {decision_id} ({reason})")


@app.command()
def recommendations(
    data_dir: DataDir = Path("var"),
    api: ApiOpt = None,
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List recommendations waiting for an operator."""
    rows = _api(data_dir, api, token, "GET", "/api/recommendations")
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        typer.echo(
            f"{r['decision_id']}  {r['event_time'][:19]}  job {r['job_id'] or '-':8} {r['category']:13} "
            f"{r['action']:18} culprit {r['culprit_node'] or '-':8} {r['verdict'] or 'pending'}"
        )


app.add_typer(produce_app, name="produce")
app.add_typer(audit_app, name="audit")
app.add_typer(db_app, name="db")
app.add_typer(policy_app, name="policy")
app.add_typer(bench_app, name="bench")
app.command("readiness")(readiness_cmd)
app.command("replay")(replay_cmd)
app.command("label")(label_cmd)

mode_app = typer.Typer(help="Autonomy per partition and category (audited; takes effect without a restart).")
app.add_typer(mode_app, name="mode")


@mode_app.command("show")
def mode_show(data_dir: DataDir = Path("var"), api: ApiOpt = None, token: TokenOpt = None) -> None:
    """Print the modes in force: default, per category, per partition."""
    typer.echo(json.dumps(_api(data_dir, api, token, "GET", "/api/modes"), indent=2))


@mode_app.command("set")
def mode_set(
    mode: Annotated[str, typer.Argument(help="monitor or autonomous")],
    partition: Annotated[Optional[str], typer.Option(help="Only this partition.")] = None,
    category: Annotated[Optional[str], typer.Option(help="Only this category.")] = None,
    reason: Annotated[str, typer.Option(help="Why (recorded).")] = "",
    force: Annotated[bool, typer.Option(help="Record that a readiness verdict was overridden.")] = False,
    operator: OperatorOpt = "",
    data_dir: DataDir = Path("var"),
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Switch monitor/autonomous for everything, a partition, a category, or both."""
    if mode not in MODES:
        _fail(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    if category is not None and category not in CATEGORIES:
        _fail(f"--category {category!r}: expected one of {', '.join(CATEGORIES)}")
    r = _api(
        data_dir,
        api,
        token,
        "POST",
        "/api/modes",
        {
            "mode": mode,
            "partition": partition,
            "category": category,
            "operator": operator or _whoami(),
            "reason": reason,
            "force": force,
        },
    )
    typer.echo(
        f"mode for partition={r['partition'] or '*'} category={r['category'] or '*'}: "
        f"{r['old_mode']} -> {r['new_mode']}"
    )


@app.command()
def nodes(
    data_dir: DataDir = Path("var"),
    api: ApiOpt = None,
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Nodes as the scheduler sees them; drained ones with their reason and incident."""
    rows = _api(data_dir, api, token, "GET", "/api/nodes")
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        flags = ",".join(r["flags"]) or "-"
        typer.echo(f"{r['node']:12} {r['state']:10} {flags:16} {r['incident_id'] or '':26} {r['reason'] or ''}")


@app.command()
def resume(
    node: Annotated[str, typer.Argument(help="A node trainmedic drained.")],
    comment: Annotated[str, typer.Option(help="What was fixed.")] = "",
    operator: OperatorOpt = "",
    data_dir: DataDir = Path("var"),
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Return a node trainmedic drained to service (refused for nodes drained by someone else)."""
    r = _api(
        data_dir,
        api,
        token,
        "POST",
        f"/api/nodes/{node}/resume",
        {"operator": operator or _whoami(), "comment": comment},
    )
    typer.echo(f"resumed {node} (it was drained for {r['incident_id']})")


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
