"""`trainmedic produce ...`: one small process per source, on each node or once per cluster."""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from bus.publish import Publisher
from schemas.errors import ConfigError, Unavailable, UsageError
from trainmedic.cli_base import new_app, settings

if TYPE_CHECKING:
    from producers.position import Checkpointer, PositionStore

produce_app = new_app(
    help="Run a signal producer: gpu (NVML), dcgm, kernel, logs, slurm, ingest. Each publishes to Kafka."
)

BootstrapOpt = Annotated[
    Optional[str], typer.Option(help="Kafka HOST:PORT (default: the running `trainmedic up` in --data-dir).")
]
DataDirOpt = Annotated[Path, typer.Option("--data-dir", help="Where a local `trainmedic up` keeps runtime.json.")]
NodeOpt = Annotated[
    Optional[str], typer.Option(help="Slurm node name to report (default: TRAINMEDIC_NODE, else this host's name).")
]


def _node(flag: str | None) -> str | None:
    return settings(node=flag).node


def _publisher(bootstrap: str | None, data_dir: Path, client_id: str) -> Publisher:
    from trainmedic.runtime import StackError, check_bootstrap

    runtime_file: Path | None = None
    bootstrap = settings(bootstrap=bootstrap).bootstrap
    if not bootstrap:
        runtime_file = data_dir / "runtime.json"
        try:
            bootstrap = json.loads(runtime_file.read_text())["bootstrap"]
        except (OSError, ValueError, KeyError):
            raise ConfigError(
                f"no Kafka given (--bootstrap, TRAINMEDIC_BOOTSTRAP or `bootstrap` in the config file) and no "
                f"running `trainmedic up` found in {data_dir}"
            ) from None
    assert bootstrap
    try:
        check_bootstrap(bootstrap)
    except StackError as exc:
        raise ConfigError(str(exc)) from None
    # A local `up` may be restarted with its broker elsewhere: follow runtime.json then.
    return Publisher(bootstrap, client_id, bootstrap_file=runtime_file)


StateDirOpt = Annotated[
    Optional[Path], typer.Option(help="Where read positions are kept across restarts (default DATA_DIR/producers).")
]
LookbackOpt = Annotated[
    float, typer.Option(help="With no saved position: read back this many seconds of kernel messages.")
]
# A file has no index by time: its look-back is the last bytes before the end.
FILE_LOOKBACK_BYTES = 1024 * 1024


def _positions(state_dir: Path | None, data_dir: Path, name: str) -> PositionStore:
    from producers.position import PositionStore

    return PositionStore((state_dir or data_dir / "producers") / f"{name}.json")


def _flushed(pub: Publisher) -> Callable[[float], bool]:
    return lambda timeout: pub.flush(timeout) == 0


def _stop_event() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop


def _run_loop(name: str, run: Callable[[threading.Event], object], stop: threading.Event | None = None) -> None:
    """Only `up` supervises: a lone producer whose loop dies exits non-zero, so systemd or
    Kubernetes restarts it."""
    stop = stop or _stop_event()
    try:
        run(stop)
    except Exception as exc:
        logging.getLogger("trainmedic.produce").exception("the %s producer's loop died", name)
        # Exit 3, as `trainmedic executor` does when its loop dies.
        raise Unavailable(f"the {name} producer's loop died: {type(exc).__name__}: {exc}") from None
    if not stop.is_set():
        raise Unavailable(f"the {name} producer's loop ended without being asked to stop")


def _finish(pub: Publisher, counters: dict[str, Any], checkpoint: Checkpointer | None = None) -> None:
    saved = checkpoint.save(timeout=10) if checkpoint is not None else False
    left = pub.close(10)
    dropped = sum(pub.dropped.values())
    typer.echo(
        f"stopped: {json.dumps(counters)}; delivered {sum(pub.delivered.values())}, "
        f"dropped {dropped}, dead-lettered {sum(pub.dead_lettered.values())}, still queued {left}"
        + ("" if checkpoint is None else f"; position {'saved' if saved else 'NOT saved (undelivered events)'}")
    )


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@produce_app.command()
def gpu(
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    node: NodeOpt = None,
    interval: Annotated[float, typer.Option(help="Seconds between samples.")] = 1.0,
) -> None:
    """GPU metrics and Xid events through NVML: one record per node per interval, all GPUs in it."""
    from producers.gpu_nvml import NvmlProducer, NvmlUnavailable

    _logging()
    pub = _publisher(bootstrap, data_dir, "trainmedic-gpu")
    try:
        producer = NvmlProducer(pub, node=_node(node), interval_s=interval)
    except NvmlUnavailable as exc:
        raise UsageError(str(exc)) from None
    stop = _stop_event()
    typer.echo(f"producing GPU samples every {interval:g} s")
    with producer:
        _run_loop("gpu", producer.run, stop)
    _finish(pub, {"samples": producer.samples, "errors": producer.errors})


@produce_app.command()
def dcgm(
    url: Annotated[str, typer.Option(help="dcgm-exporter metrics URL, e.g. http://HOST:9400/metrics.")],
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    node: NodeOpt = None,
    interval: Annotated[float, typer.Option(help="Seconds between scrapes.")] = 5.0,
    timeout: Annotated[float, typer.Option(help="HTTP timeout in seconds.")] = 5.0,
) -> None:
    """Scrape dcgm-exporter and publish the same per-node GPU records as `gpu`."""
    from producers.gpu_dcgm import DcgmProducer

    _logging()
    pub = _publisher(bootstrap, data_dir, "trainmedic-dcgm")
    try:
        producer = DcgmProducer(pub, url, interval_s=interval, timeout_s=timeout, node=_node(node))
    except ValueError as exc:
        raise UsageError(f"--url: {exc}") from None
    _run_loop("dcgm", producer.run)
    _finish(pub, {"scrapes": producer.scrapes, "samples": producer.samples, "errors": producer.errors})


def _nvml_gpu_index() -> Any:
    """PCI bus id -> GPU index from NVML where it answers; without it Xid events carry no index."""
    from producers.gpu_nvml import NvmlCollector, NvmlUnavailable
    from producers.kernel import nvml_gpu_index

    try:
        collector = NvmlCollector()
    except NvmlUnavailable as exc:
        logging.getLogger("trainmedic.kernel").warning("%s: Xid events will carry no GPU index", exc)
        return None
    try:
        return nvml_gpu_index(collector)
    finally:
        collector.close()


@produce_app.command()
def kernel(
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    node: NodeOpt = None,
    file: Annotated[
        Optional[Path], typer.Option(help="Follow this file (Debian kern.log, RHEL /var/log/messages, syslog).")
    ] = None,
    kmsg: Annotated[bool, typer.Option(help="Read /dev/kmsg (root).")] = False,
    journal: Annotated[bool, typer.Option(help="Read `journalctl -k -f -o json`.")] = False,
    state_dir: StateDirOpt = None,
    lookback: LookbackOpt = 600.0,
) -> None:
    """NVRM Xid / SXid / fallen-off-the-bus lines from the kernel log, resuming where it stopped."""
    from producers.kernel import KernelLogProducer, KernelStreamProducer, boot_id, read_journal, read_kmsg
    from producers.position import Checkpointer

    if sum((file is not None, kmsg, journal)) != 1:
        raise UsageError("give exactly one of --file PATH, --kmsg, --journal")
    _logging()
    pub = _publisher(bootstrap, data_dir, "trainmedic-kernel")
    stop = _stop_event()
    gpu_index_of = _nvml_gpu_index()
    store = _positions(state_dir, data_dir, "kernel")
    if file is not None:
        key = f"file:{file}"
        follower = KernelLogProducer(
            pub,
            file,
            node=_node(node),
            gpu_index_of=gpu_index_of,
            resume=store.file(key),
            lookback_bytes=FILE_LOOKBACK_BYTES,
        )
        checkpoint = Checkpointer(store, follower.positions, _flushed(pub))
        while not stop.wait(0.5):
            follower.poll_once()
            checkpoint.maybe_save()
        _finish(pub, {"published": follower.published}, checkpoint)
        return
    stream = KernelStreamProducer(pub, node=_node(node), gpu_index_of=gpu_index_of)
    # The stream's position: the journal cursor, or the kmsg sequence number within this boot.
    last: dict[str, Any] = {}
    checkpoint = Checkpointer(store, lambda: dict(last), _flushed(pub))
    try:
        if kmsg:
            saved = store.get("kmsg")
            same_boot = isinstance(saved, dict) and saved.get("boot_id") == boot_id()
            after = int(saved["seq"]) if same_boot and isinstance(saved.get("seq"), int) else None
            for message, seq in read_kmsg(after_seq=after, lookback_s=lookback):
                stream.handle(message)
                if seq is not None:
                    last["kmsg"] = {"boot_id": boot_id(), "seq": seq}
                checkpoint.maybe_save()
                if stop.is_set():
                    break
        else:
            cursor = store.get("journal")
            for message, host, entry_cursor in read_journal(
                cursor if isinstance(cursor, str) else None, lookback_s=lookback
            ):
                stream.handle(message, host)
                if entry_cursor:
                    last["journal"] = entry_cursor
                checkpoint.maybe_save()
                if stop.is_set():
                    break
    except OSError as exc:
        raise UsageError(f"cannot read the kernel log: {exc}") from None
    _finish(pub, {"published": stream.published}, checkpoint)


@produce_app.command()
def logs(
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    job: Annotated[Optional[str], typer.Option(help="Follow this job's files (with --path).")] = None,
    path: Annotated[Optional[list[Path]], typer.Option(help="Output file(s) of --job.")] = None,
    nodes: Annotated[Optional[str], typer.Option(help="The job's nodes, comma-separated (rank -> node).")] = None,
    ranks_per_node: Annotated[Optional[int], typer.Option(help="Ranks per node (block layout).")] = None,
    discover: Annotated[bool, typer.Option(help="Find running jobs' StdOut/StdErr from Slurm.")] = False,
    only_node: Annotated[
        Optional[str],
        typer.Option(help="With --discover: only jobs running on this node (default: TRAINMEDIC_NODE when set)."),
    ] = None,
    interval: Annotated[float, typer.Option(help="With --discover: seconds between Slurm queries.")] = 1.0,
    placements: Annotated[
        str,
        typer.Option(
            help="With --discover --only-node: where running jobs come from: 'slurm' (squeue -w NODE every "
            "--interval) or 'bus' (the Slurm producer's sched.events; Slurm only every --resync seconds)."
        ),
    ] = "slurm",
    resync: Annotated[float, typer.Option(help="With --placements bus: seconds between Slurm resyncs.")] = 300.0,
    state_dir: StateDirOpt = None,
) -> None:
    """Follow training logs (rotation, truncation, srun/torchrun rank prefixes) and publish them."""
    from producers.jobdiscovery import JobDiscovery
    from producers.joblogs import JobLayout, JobLogProducer
    from producers.position import Checkpointer

    if discover == bool(job):
        raise UsageError("give either --discover or --job ID --path FILE")
    if interval <= 0:
        raise UsageError("--interval must be > 0")
    if placements not in ("slurm", "bus"):
        raise UsageError(f"--placements {placements!r}: expected 'slurm' or 'bus'")
    # On a node (TRAINMEDIC_NODE set, as the chart's DaemonSet does) discovery follows that node's jobs.
    only_node = _node(only_node) if discover else only_node
    if placements == "bus" and not only_node:
        raise UsageError("--placements bus needs --only-node NODE (the node whose jobs to follow)")
    if resync <= 0:
        raise UsageError("--resync must be > 0")
    _logging()
    pub = _publisher(bootstrap, data_dir, "trainmedic-logs")
    stop = _stop_event()
    if discover:
        from producers.placements import BusPlacements

        store = _positions(state_dir, data_dir, f"logs-discover-{only_node or 'all'}")
        finder = JobDiscovery(pub, only_node=only_node, positions=store)
        if placements == "bus":
            assert only_node
            try:
                finder.follow_placements(
                    BusPlacements(pub.bootstrap, only_node, resync=finder.running_jobs, resync_s=resync)
                )
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        checkpoint = Checkpointer(store, finder.current_positions, _flushed(pub))
        while not stop.is_set():
            finder.poll_once()
            checkpoint.maybe_save()
            stop.wait(interval)
        for t in finder.tailers.values():
            t.drain()
        _finish(pub, {"jobs": len(finder.tailers), "errors": finder.errors}, checkpoint)
        for t in finder.tailers.values():
            t.close()
        return
    if not path:
        raise UsageError("--job needs at least one --path")
    assert job and path
    layout = JobLayout(tuple(n for n in (nodes or "").split(",") if n), ranks_per_node)
    store = _positions(state_dir, data_dir, f"logs-job-{job}")
    resume = {p: pos for p in path if (pos := store.file(f"job:{job}:{p}")) is not None}
    tailer = JobLogProducer(pub, job, path, layout, resume=resume)
    checkpoint = Checkpointer(store, tailer.positions, _flushed(pub))
    while not stop.wait(0.2):
        tailer.poll_once()
        checkpoint.maybe_save()
    tailer.drain()
    _finish(pub, {"lines": tailer.lines_published}, checkpoint)


@produce_app.command()
def slurm(
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    slurm_conf: Annotated[Optional[str], typer.Option(help="slurm.conf (default: $SLURM_CONF).")] = None,
    interval: Annotated[float, typer.Option(help="Seconds between polls (one squeue + one sinfo each).")] = 5.0,
    state_file: Annotated[Optional[Path], typer.Option(help="Last-seen state (default DATA_DIR/producers/).")] = None,
) -> None:
    """Job state transitions and node state/flag changes from Slurm, as change events only."""
    from producers.slurm import SlurmProducer, default_state_path

    _logging()
    pub = _publisher(bootstrap, data_dir, "trainmedic-slurm-producer")
    producer = SlurmProducer(
        pub, slurm_conf=slurm_conf, interval_s=interval, state_path=state_file or default_state_path(data_dir)
    )
    _run_loop("slurm", producer.run)
    _finish(pub, {"polls_failed": producer.failed_polls})


@produce_app.command()
def ingest(
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    host: Annotated[str, typer.Option(help="Bind address; loopback unless TLS or --insecure.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8470,
    token_file: Annotated[
        Optional[Path],
        typer.Option(help="File holding the token (else the setting ingest_token: TRAINMEDIC_INGEST_TOKEN[_FILE])."),
    ] = None,
    tls_cert: Annotated[Optional[Path], typer.Option(help="TLS certificate (PEM).")] = None,
    tls_key: Annotated[Optional[Path], typer.Option(help="TLS private key (PEM).")] = None,
    insecure: Annotated[bool, typer.Option(help="Allow plaintext on a non-loopback address.")] = False,
) -> None:
    """HTTP endpoint for NVSentinel health events and NVRx reports (token required). See docs/ingest.md."""
    from producers.ingest import TOKEN_ENV, IngestConfigError, load_token, run_ingest

    _logging()
    try:
        # The token as the settings have it (TRAINMEDIC_INGEST_TOKEN, _FILE or the config file).
        token = load_token(token_file, {TOKEN_ENV: settings().secret("ingest_token") or ""})
    except IngestConfigError as exc:
        raise UsageError(str(exc)) from None
    pub = _publisher(bootstrap, data_dir, "trainmedic-ingest")
    try:
        stats = run_ingest(
            pub,
            host,
            port,
            token,
            tls_cert=tls_cert,
            tls_key=tls_key,
            allow_insecure=insecure,
            stop_event=_stop_event(),
        )
    except IngestConfigError as exc:
        raise UsageError(str(exc)) from None
    _finish(pub, {"stats": str(stats)})
