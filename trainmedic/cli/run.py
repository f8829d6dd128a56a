"""`trainmedic run ...`: one deployable per process, against an external Kafka and ClickHouse.

These are the commands the Helm chart's containers and the systemd units run. Each takes its
settings from the one settings model (TRAINMEDIC_* environment, the config file, a few flags)
and serves /metrics, /healthz and /readyz on its metrics address (the settings metrics_host /
metrics_port, or --metrics-address). `trainmedic up` runs the same components in one process
tree with the embedded broker and chDB. A loop that dies exits 3 (systemd and Kubernetes
restart it); bad settings exit 2 naming the setting.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from bus import health
from schemas.errors import ConfigError, Unavailable, UsageError
from schemas.extras import MissingExtra, require
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
from trainmedic.cli.base import MetricsOpt, new_app, settings, start_probes
from trainmedic.stack.metrics_server import parse_address

if TYPE_CHECKING:
    from sinks.audit import AuditStore

run_app = new_app(
    help="Run one deployable (streams, executor, audit-sink, api, ingest, notifier, node-agent) against external Kafka "
    "and ClickHouse."
)
log = logging.getLogger("trainmedic.run")

BootstrapOpt = Annotated[
    Optional[str], typer.Option(help="Kafka bootstrap servers HOST:PORT[,...] (default: the setting bootstrap).")
]
ClickHouseOpt = Annotated[
    Optional[str],
    typer.Option("--clickhouse", help="ClickHouse URL, or chdb:///FOLDER (default: the setting clickhouse_url)."),
]
DatabaseOpt = Annotated[str, typer.Option(help="Audit database name.")]


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _bootstrap(flag: str | None, what: str) -> str:
    from bus.admin import check_bootstrap

    bootstrap = settings(bootstrap=flag).bootstrap
    if not bootstrap:
        raise UsageError(f"{what} needs Kafka: --bootstrap HOST:PORT, TRAINMEDIC_BOOTSTRAP or `bootstrap` in --config")
    check_bootstrap(bootstrap)
    return bootstrap


def _on_term(stop: Callable[[], None]) -> None:
    signal.signal(signal.SIGTERM, lambda *_: stop())
    signal.signal(signal.SIGINT, lambda *_: stop())


def _run_until_stopped(name: str, run: Callable[[], None], stop: threading.Event) -> None:
    """Only `up` supervises: alone, a dead loop exits non-zero so systemd or Kubernetes restarts it."""
    try:
        run()
    except Exception as exc:
        logging.getLogger(f"trainmedic.{name}").exception("the %s loop died", name)
        raise Unavailable(f"the {name} loop died: {type(exc).__name__}: {exc}") from None
    if not stop.is_set():
        raise Unavailable(f"the {name} loop ended without being asked to stop")
    typer.echo(f"{name} stopped.")


def _store(clickhouse: str | None, database: str, what: str) -> AuditStore:
    from sinks.audit import AuditStore, AuditStoreError
    from trainmedic.settings import audit_layout, clickhouse_dsn

    s = settings(clickhouse_url=clickhouse)
    url = clickhouse_dsn(s)
    if not url:
        raise UsageError(
            f"{what} needs ClickHouse: --clickhouse URL, TRAINMEDIC_CLICKHOUSE_URL[_FILE] or `clickhouse_url` in "
            "--config (chdb:///FOLDER for an embedded one)"
        )
    try:
        return AuditStore(url, database, audit_layout(s))
    except MissingExtra:
        raise  # its own message and exit status, not ClickHouse's being unavailable
    except AuditStoreError as exc:
        raise Unavailable(str(exc)) from None
    except Exception as exc:  # clickhouse-connect's errors: bad URL, refused, auth
        raise Unavailable(f"ClickHouse ({what}): {type(exc).__name__}: {exc}") from None


def _wait_for_schema(store: AuditStore, stop: threading.Event) -> bool:
    """Wait, not ready, until the audit schema is current (the migration Job or one-shot makes it
    so; this process never migrates). False when stopped first."""
    waiting = health.loop("audit-schema", stale_after_s=60.0)
    said = ""
    while not stop.is_set():
        waiting.beat()
        try:
            status = store.migration_status()
        except Exception as exc:  # ClickHouse away: keep waiting, say so
            why = f"ClickHouse does not answer: {type(exc).__name__}: {exc}"
        else:
            pending = [m["name"] for m in status if m["state"] == "pending"]
            if not pending:
                if newer := [f"{m['version']:03d}_{m['name']}" for m in status if m["state"] != "applied"]:
                    # A rollback: the schema is ahead of this version; its inserts name their columns.
                    log.warning(
                        "the audit schema has migration(s) newer than this trainmedic (%s): running on it, "
                        "as after a rollback (docs/deploy-bare-metal.md, 'Roll back')",
                        ", ".join(newer),
                    )
                waiting.stop()
                return True
            why = (
                f"audit schema of {store.database} is behind ({len(pending)} migration(s) pending: "
                f"{', '.join(pending[:3])}{'...' if len(pending) > 3 else ''}); run `trainmedic audit db migrate`"
            )
        waiting.set_ready(False, why)
        if why != said:
            log.warning("not ready: %s", why)
            said = why
        stop.wait(5.0)
    waiting.stop()
    return False


# -- the deployables ---------------------------------------------------------------------------


@run_app.command("streams")
def streams(
    bootstrap: BootstrapOpt = None,
    metrics_address: MetricsOpt = None,
    log_level: Annotated[str, typer.Option("--log-level", help="Faust's log level.")] = "info",
) -> None:
    """The streams worker (detectors, attribution, policy): a Faust worker of the group streams_id.

    Workers of one group share the partitions; each keeps its tables in streams_data_dir."""
    # Before the Kafka check (10 s on a wrong address): the worker's own imports come last.
    require("server", "trainmedic run streams", only=("faust", "mode", "aiokafka", "numpy"))
    _logging()
    env_bootstrap = _bootstrap(bootstrap, "the streams worker")
    # The worker builds its Faust app from the settings at import: flags go in as the settings' env.
    os.environ["TRAINMEDIC_BOOTSTRAP"] = env_bootstrap
    if metrics_address is not None:
        at = parse_address(metrics_address)
        if at is None:
            os.environ.pop("TRAINMEDIC_METRICS_PORT", None)
        else:
            os.environ["TRAINMEDIC_METRICS_HOST"], os.environ["TRAINMEDIC_METRICS_PORT"] = at[0], str(at[1])
    data_dir = settings().streams_data_dir
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"streams_data_dir {data_dir}: {exc.strerror or exc} (it must be writable)") from None
    from trainmedic.stack.streams_worker import main

    main(["worker", "--without-web", "-l", log_level])


@run_app.command("executor")
def executor(
    bootstrap: BootstrapOpt = None,
    policy: Annotated[Optional[Path], typer.Option(help="Policy YAML whose guardrails section applies.")] = None,
    backend: Annotated[
        Optional[str], typer.Option(help="Scheduler backend (default: the settings' slurm_access, local: slurm-cli).")
    ] = None,
    group: Annotated[str, typer.Option(help="Consumer group; replicas share it.")] = "trainmedic-executor",
    verify_timeout: Annotated[float, typer.Option(help="Seconds to wait for each effect to show.")] = 60.0,
    ssh: SshOpt = None,
    ssh_key: SshKeyOpt = None,
    known_hosts: KnownHostsOpt = None,
    remote_slurm_conf: RemoteConfOpt = None,
    rest_url: RestUrlOpt = None,
    rest_user: RestUserOpt = None,
    rest_token_file: RestTokenFileOpt = None,
    metrics_address: MetricsOpt = None,
    clickhouse: Annotated[
        Optional[str],
        typer.Option(
            "--clickhouse",
            help="ClickHouse URL (default: the setting clickhouse_url): the audit the automatic return to "
            "service (policy return_to_service.automatic) reads; without it that path is off.",
        ),
    ] = None,
    database: DatabaseOpt = "trainmedic",
) -> None:
    """The executor (one replica of its consumer group): acts on Slurm as decisions say, within the guardrails."""
    from sinks.executor import Executor, ExecutorService, ExecutorSettings
    from sinks.guardrails import GuardrailFile, Guardrails
    from streams.policy import DEFAULT_POLICY, load_policy
    from trainmedic.ops.auto_return import AutoReturnService
    from trainmedic.settings import clickhouse_dsn

    _logging()
    address = _bootstrap(bootstrap, "the executor")
    # The policy file the streams worker decides by (TRAINMEDIC_POLICY): its guardrails.
    s = settings(policy=policy, clickhouse_url=clickhouse)
    policy_path = s.policy or DEFAULT_POLICY
    rails = GuardrailFile(policy_path)
    sched = scheduler_backend(
        backend, ssh, ssh_key, known_hosts, remote_slurm_conf, (rest_url, rest_user, rest_token_file)
    )
    probes = start_probes(metrics_address, "executor")
    service = ExecutorService(
        address,
        Executor(sched, ExecutorSettings(verify_timeout_s=verify_timeout, group=group)),
        Guardrails(rails, sched),
    )
    # The automatic return to service resumes nodes: it runs beside the lease holder's executor
    # (trainmedic/ops/auto_return.py), and needs the audit for its verdicts, counts and lemon checks.
    auto: AutoReturnService | None = None
    store: AuditStore | None = None
    if clickhouse_dsn(s):
        try:
            store = _store(clickhouse, database, "the automatic return to service")
        except Unavailable as exc:
            # The executor's own work needs no audit: it starts without the automatic path.
            log.error("automatic return to service off: %s", exc)
    if store is not None:
        auto = AutoReturnService(
            sched,
            store,
            address,
            policy_path,
            acting=lambda: service.acting,
            guardrails=rails,
            modes_file=s.modes_file,
            mode_override=s.mode,
        )
        threading.Thread(target=auto.run, name="auto-return", daemon=True).start()
    elif load_policy(policy_path).return_to_service.automatic.enabled:
        log.warning(
            "return_to_service.automatic is enabled but this executor has no audit (--clickhouse, "
            "TRAINMEDIC_CLICKHOUSE_URL): nodes are returned only by `trainmedic nodes resume`"
        )

    def stop() -> None:
        service.stop_event.set()
        if auto is not None:
            auto.stop_event.set()

    _on_term(stop)
    typer.echo(f"executor up: group {group}, scheduler {sched.name}, probes {probes.url if probes else 'off'}")
    try:
        _run_until_stopped("executor", service.run, service.stop_event)
    finally:
        if auto is not None:
            auto.stop_event.set()
        if store is not None:
            store.close()
        if probes is not None:
            probes.stop()


@run_app.command("audit-sink")
def audit_sink(
    bootstrap: BootstrapOpt = None,
    clickhouse: ClickHouseOpt = None,
    database: DatabaseOpt = "trainmedic",
    group: Annotated[str, typer.Option(help="Consumer group; replicas share the partitions.")] = "trainmedic-audit",
    metrics_address: MetricsOpt = None,
) -> None:
    """Every topic into the ClickHouse audit. Not ready until the schema is current (`audit db migrate`)."""
    from sinks.audit import AuditSink

    _logging()
    address = _bootstrap(bootstrap, "the audit sink")
    store = _store(clickhouse, database, "the audit sink")
    probes = start_probes(metrics_address, "audit-sink")
    stop = threading.Event()
    _on_term(stop.set)
    try:
        if not _wait_for_schema(store, stop):
            typer.echo("audit sink stopped before the schema was current.")
            return
        sink = AuditSink(address, store, group=group)
        sink.stop_event = stop
        typer.echo(f"audit sink up: group {group}, {database} in {store.where}")
        _run_until_stopped("audit-sink", sink.run, stop)
    finally:
        store.close()
        if probes is not None:
            probes.stop()


@run_app.command("api")
def api(
    bootstrap: BootstrapOpt = None,
    clickhouse: ClickHouseOpt = None,
    database: DatabaseOpt = "trainmedic",
    listen: Annotated[
        Optional[str], typer.Option(help="HOST:PORT to serve on (default: the setting api_listen, 127.0.0.1:8477).")
    ] = None,
    policy: Annotated[Optional[Path], typer.Option(help="Policy YAML (for replays and the console).")] = None,
    backend: Annotated[
        Optional[str], typer.Option(help="Scheduler backend for node listing and resume (default: slurm_access).")
    ] = None,
    metrics_address: MetricsOpt = None,
) -> None:
    """The operator API and Recovery Console: recommendations to approve, modes, nodes, the audit.

    Off loopback it serves TLS (api_tls_cert / api_tls_key) unless api_insecure is set."""
    from bus.publish import Publisher
    from streams.policy import DEFAULT_POLICY, load_policy
    from trainmedic.stack.runtime import LOOPBACK
    from trainmedic.web.api import API_MESSAGE_TIMEOUT_MS, ApiError, ApiServer, create_api
    from trainmedic.web.console import LiveFeed

    _logging()
    s = settings(api_listen=listen, policy=policy)
    at = parse_address(s.api_listen)
    if at is None:
        raise UsageError(f"api_listen {s.api_listen!r}: expected HOST:PORT")
    host, port = at
    tls = (s.api_tls_cert, s.api_tls_key)
    if (tls[0] is None) != (tls[1] is None):
        raise UsageError("api_tls_cert and api_tls_key go together: give both (PEM files) or neither")
    for what, path in zip(("api_tls_cert", "api_tls_key"), tls, strict=True):
        if path is not None and not path.is_file():
            raise ConfigError(f"{what} {path}: no such file")
    if host not in LOOPBACK and tls[0] is None and not s.api_insecure:
        raise UsageError(
            f"api_listen {s.api_listen}: off loopback the API serves TLS (api_tls_cert and api_tls_key, "
            "TRAINMEDIC_API_TLS_CERT / _KEY) or needs api_insecure=true (TLS terminated in front of it)"
        )
    token = s.secret("token")
    if not token or len(token) < 16:
        raise UsageError("the API needs an operator token of at least 16 characters: TRAINMEDIC_TOKEN[_FILE]")
    viewer = s.secret("viewer_token")
    if viewer is not None and len(viewer) < 16:
        raise UsageError("viewer_token: at least 16 characters")
    if s.modes_file is None:
        raise UsageError("the API needs its state file of mode changes: TRAINMEDIC_MODES_FILE (a writable path)")
    policy_path = s.policy or DEFAULT_POLICY
    load_policy(policy_path)
    address = _bootstrap(bootstrap, "the API")
    sched = scheduler_backend(backend)
    store = _store(clickhouse, database, "the API")
    probes = start_probes(metrics_address, "api")
    stop = threading.Event()
    _on_term(stop.set)
    server: ApiServer | None = None
    feed: LiveFeed | None = None
    publisher: Publisher | None = None
    try:
        if not _wait_for_schema(store, stop):
            return
        publisher = Publisher(address, "trainmedic-api", config={"message.timeout.ms": API_MESSAGE_TIMEOUT_MS})
        feed = LiveFeed(address).start()
        serving = health.loop("api", stale_after_s=60.0)

        def report() -> dict[str, object]:
            rep = health.report()
            return {"ok": rep["live"], **({} if rep["live"] else {"down": rep["loops"]})}

        app = create_api(
            store,
            publisher,
            token,
            sched,
            policy_path,
            s.modes_file,
            feed=feed,
            viewer_token=viewer,
            health=report,
        )
        server = ApiServer(app, host, port, tls_cert=tls[0], tls_key=tls[1])
        try:
            server.start()
        except ApiError as exc:
            raise Unavailable(str(exc)) from None
        typer.echo(f"api up: {server.url}/ (console), probes {probes.url if probes else 'off'}")
        while not stop.wait(2.0):
            serving.beat()
            if not server.alive:
                raise Unavailable("the API server thread ended")
            if not feed.alive:
                raise Unavailable("the console's live feed ended")
            serving.set_ready(True, f"serving on {server.url}")
        serving.stop()
        typer.echo("api stopped.")
    finally:
        if feed is not None:
            feed.stop()
        if server is not None:
            server.stop()
        if publisher is not None:
            publisher.close(5)
        store.close()
        if probes is not None:
            probes.stop()


@run_app.command("ingest")
def ingest(
    bootstrap: BootstrapOpt = None,
    host: Annotated[str, typer.Option(help="Bind address; loopback unless TLS or --insecure.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8470,
    token_file: Annotated[
        Optional[Path],
        typer.Option(help="File holding the token (else the setting ingest_token: TRAINMEDIC_INGEST_TOKEN[_FILE])."),
    ] = None,
    tls_cert: Annotated[Optional[Path], typer.Option(help="TLS certificate (PEM).")] = None,
    tls_key: Annotated[Optional[Path], typer.Option(help="TLS private key (PEM).")] = None,
    insecure: Annotated[bool, typer.Option(help="Allow plaintext on a non-loopback address.")] = False,
    metrics_address: MetricsOpt = None,
) -> None:
    """HTTP ingest of NVSentinel health events and NVRx reports (token required). See docs/ingest.md."""
    from bus.publish import Publisher
    from producers.ingest import IngestConfigError, run_ingest
    from trainmedic.cli.ingest import ingest_auth

    _logging()
    try:
        auth = ingest_auth(settings(), token_file)
    except (IngestConfigError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    address = _bootstrap(bootstrap, "the ingest endpoint")
    pub = Publisher(address, "trainmedic-ingest")
    probes = start_probes(metrics_address, "ingest")
    stop = threading.Event()
    _on_term(stop.set)
    try:
        stats = run_ingest(
            pub, host, port, auth, tls_cert=tls_cert, tls_key=tls_key, allow_insecure=insecure, stop_event=stop
        )
    except IngestConfigError as exc:
        raise UsageError(str(exc)) from None
    finally:
        left = pub.close(10)
        if probes is not None:
            probes.stop()
    typer.echo(f"ingest stopped: {stats}; still queued {left}")


@run_app.command("notifier")
def notifier(
    webhooks: Annotated[
        Path,
        typer.Option(
            "--webhooks",
            help="The notifier's YAML: endpoints, templates, tokens, retries (docs/notifier.md).",
        ),
    ],
    bootstrap: BootstrapOpt = None,
    group: Annotated[str, typer.Option(help="Consumer group; replicas share the partitions.")] = "trainmedic-notifier",
    metrics_address: MetricsOpt = None,
) -> None:
    """Incidents, guardrail trips and escalations POSTed to webhooks (Slack, PagerDuty, generic JSON)."""
    from sinks.notifier import Notifier, load_config

    _logging()
    config = load_config(webhooks)  # a bad file exits 2 naming the line and field
    address = _bootstrap(bootstrap, "the notifier")
    probes = start_probes(metrics_address, "notifier")
    service = Notifier(address, config, group)
    _on_term(service.stop)
    typer.echo(
        f"notifier up: group {group}, {len(config.endpoints)} endpoint(s) "
        f"({', '.join(e.label for e in config.endpoints)}), probes {probes.url if probes else 'off'}"
    )
    try:
        _run_until_stopped("notifier", service.run, service.stop_event)
    finally:
        if probes is not None:
            probes.stop()


@run_app.command("node-agent")
def node_agent(
    bootstrap: BootstrapOpt = None,
    node: Annotated[
        Optional[str],
        typer.Option(help="This host's Slurm NodeName (default: TRAINMEDIC_NODE, else this host's name)."),
    ] = None,
    reset_command: Annotated[
        str,
        typer.Option(help="Resets one GPU: a command line (no shell), {gpu} replaced by the GPU's NVML index."),
    ] = "nvidia-smi --gpu-reset -i {gpu}",
    reset_all_command: Annotated[
        str, typer.Option(help="Resets every GPU of the node, for a command that names no GPU.")
    ] = "nvidia-smi --gpu-reset",
    idle_timeout: Annotated[
        float, typer.Option(help="Seconds a command waits for the node to be idle (no job, no GPU process).")
    ] = 1800.0,
    reset_timeout: Annotated[
        float, typer.Option(help="Seconds the reset command may run before it is killed.")
    ] = 300.0,
    poll_interval: Annotated[float, typer.Option(help="Seconds between looks at Slurm and NVML while waiting.")] = 10.0,
    state_dir: Annotated[
        Path, typer.Option(help="Where the agent records the commands it began and finished (never run twice).")
    ] = Path("var/node-agent"),
    metrics_address: MetricsOpt = None,
) -> None:
    """The node agent of this GPU node: carries out the executor's commands for it (a GPU reset once
    nothing runs on the node). Needs CAP_SYS_ADMIN for the reset, NVML and the node's Slurm client."""
    from sinks.node_agent import AgentSettings, GpuProbe, NodeAgent, parse_argv
    from slurmio.runners import LocalRunner

    _logging()
    for name, value in (("--idle-timeout", idle_timeout), ("--reset-timeout", reset_timeout)):
        if not value > 0:
            raise UsageError(f"{name} must be > 0 seconds, got {value:g}")
    if not 0 < poll_interval <= idle_timeout:
        raise UsageError(f"--poll-interval must be > 0 and at most --idle-timeout, got {poll_interval:g}")
    config = AgentSettings(
        node=settings(node=node).slurm_node(),
        state_dir=state_dir,
        reset_command=parse_argv(reset_command, "--reset-command", needs_gpu=True),
        reset_all_command=parse_argv(reset_all_command, "--reset-all-command", needs_gpu=False),
        idle_timeout_s=idle_timeout,
        reset_timeout_s=reset_timeout,
        poll_interval_s=poll_interval,
    )
    # NVML first: a host without it is told so, not about Kafka.
    probe = GpuProbe()
    gpus = probe.check()
    address = _bootstrap(bootstrap, "the node agent")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--state-dir {state_dir}: {exc.strerror or exc} (it must be writable)") from None
    probes = start_probes(metrics_address, "node-agent")
    agent = NodeAgent(address, config, probe, LocalRunner())
    _on_term(agent.stop_event.set)
    typer.echo(
        f"node agent up: node {config.node}, {gpus} GPU(s), group {config.consumer_group}, "
        f"probes {probes.url if probes else 'off'}"
    )
    try:
        _run_until_stopped("node-agent", agent.run, agent.stop_event)
    finally:
        if probes is not None:
            probes.stop()
