"""`trainmedic produce ...`: one small process per source, on each node or once per cluster."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from bus.admin import check_bootstrap
from bus.identity import NodeSigner, parse_node_key
from bus.publish import Publisher
from schemas.errors import ConfigError, Unavailable, UsageError
from trainmedic.cli.base import MetricsOpt, new_app, settings, start_probes
from trainmedic.stack.metrics_server import MetricsServer

if TYPE_CHECKING:
    from producers.gpu_nvml import NvmlCollector
    from producers.position import Checkpointer, PositionStore

produce_app = new_app(
    help="Run a signal producer: gpu (NVML), dcgm, ib (InfiniBand / RoCE ports), kernel, logs, slurm. Each publishes to Kafka. "
    "(HTTP ingest of NVSentinel / NVRx events is `trainmedic run ingest`.)"
)

BootstrapOpt = Annotated[
    Optional[str], typer.Option(help="Kafka HOST:PORT (default: the running `trainmedic up` in --data-dir).")
]
DataDirOpt = Annotated[Path, typer.Option("--data-dir", help="Where a local `trainmedic up` keeps runtime.json.")]
NodeOpt = Annotated[
    Optional[str], typer.Option(help="Slurm node name to report (default: TRAINMEDIC_NODE, else this host's name).")
]


@contextlib.contextmanager
def _probes(flag: str | None, producer: str) -> Iterator[MetricsServer | None]:
    """The probe listener for the body (its loops' /healthz and /readyz, /metrics of `producer`'s
    families); None when off."""
    server = start_probes(flag, producer)
    if server is not None:
        typer.echo(f"probes on {server.url} (/healthz, /readyz)")
    try:
        yield server
    finally:
        if server is not None:
            server.stop()


def _node(flag: str | None, host_default: bool = True) -> str | None:
    """The Slurm NodeName to report: the flag, else the node setting, else (host_default) this
    host's name - each through node_map / node_strip_domain. None: the producer's own default."""
    s = settings(node=flag)
    if flag or s.node or host_default:
        return s.slurm_node()
    return None


def _signer(flag: str | None) -> NodeSigner | None:
    """The node's signing (setting node_key, usually node_key_file): its records on the node topics
    carry its signature, which the streams worker checks; None when the node has no key."""
    s = settings(node=flag)
    key = s.secret("node_key")
    if not key:
        return None
    try:
        return NodeSigner(s.slurm_node(), parse_node_key(key))
    except ValueError as exc:
        raise ConfigError(f"setting node_key (TRAINMEDIC_NODE_KEY_FILE or node_key_file): {exc}") from None


def _publisher(bootstrap: str | None, data_dir: Path, client_id: str, signer: NodeSigner | None = None) -> Publisher:
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
    check_bootstrap(bootstrap)
    # A local `up` may be restarted with its broker elsewhere: follow runtime.json then.
    return Publisher(bootstrap, client_id, bootstrap_file=runtime_file, node_signer=signer)


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


class NvmlMissing(Unavailable):
    """`produce gpu` on a host where NVML cannot be used."""


NVML_HINT = (
    "`trainmedic produce gpu` needs the NVIDIA driver's libnvidia-ml.so.1 (in a container: the NVIDIA "
    "container runtime); where dcgm-exporter runs, use `trainmedic produce dcgm --url http://HOST:9400/metrics`"
)


def _nvml_collector() -> NvmlCollector:
    """NVML opened, or NvmlMissing saying why (no bindings, no library, no driver, no permission)."""
    try:
        from producers.gpu_nvml import NvmlCollector, NvmlUnavailable
    except ImportError as exc:
        raise NvmlMissing(
            f"NVML is not available on this host: its Python bindings (package nvidia-ml-py, module pynvml) "
            f"cannot be imported ({exc}). {NVML_HINT}"
        ) from None
    try:
        return NvmlCollector()
    except NvmlUnavailable as exc:
        reason = str(exc).removeprefix("NVML unavailable: ")
        raise NvmlMissing(f"NVML is not available on this host: {reason}. {NVML_HINT}") from None


@produce_app.command()
def gpu(
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    node: NodeOpt = None,
    interval: Annotated[float, typer.Option(help="Seconds between samples.")] = 1.0,
    summary_every: Annotated[
        Optional[float],
        typer.Option(
            "--summary-every",
            metavar="SECONDS",
            help="Edge aggregation: still sample every --interval, but publish the latest sample only this "
            "often, and at once any sample whose GPU health changed (lost, Xid, DBE ECC, row remap, PCIe, "
            "NVLink, throttle reasons). At most 30; 5 or less keeps the straggler detector's view whole. "
            "Default: publish every sample.",
        ),
    ] = None,
    metrics_address: MetricsOpt = None,
) -> None:
    """GPU metrics and Xid events through NVML: one record per node per interval (or per
    --summary-every, and at once on a health change), all GPUs in it."""
    from producers.gpu_edge import MAX_EVERY_S

    if not interval > 0:
        raise UsageError("--interval must be > 0")
    if summary_every is not None:
        if not summary_every > 0:
            raise UsageError(f"--summary-every must be > 0 seconds, got {summary_every:g}")
        if summary_every < interval:
            raise UsageError(
                f"--summary-every ({summary_every:g} s) must be >= --interval ({interval:g} s): "
                "it publishes a subset of the samples taken every --interval"
            )
        if summary_every > MAX_EVERY_S:
            raise UsageError(
                f"--summary-every ({summary_every:g} s) must be <= {MAX_EVERY_S:g} s: the hang detector "
                "treats GPU readings older than 60 s as stale"
            )
    name = _node(node)  # a name that is not a Slurm node name is refused before anything starts
    signer = _signer(node)
    _logging()
    # NVML first: a host without it is told so, not about Kafka.
    collector = _nvml_collector()
    from producers.gpu_nvml import NvmlProducer

    try:
        with _probes(metrics_address, "gpu"):
            pub = _publisher(bootstrap, data_dir, "trainmedic-gpu", signer)
            producer = NvmlProducer(
                pub, node=name, interval_s=interval, collector=collector, summary_every_s=summary_every
            )
            stop = _stop_event()
            if summary_every is None:
                typer.echo(f"producing GPU samples every {interval:g} s")
            else:
                typer.echo(
                    f"producing GPU samples: sampling every {interval:g} s, publishing every {summary_every:g} s "
                    "and at once on a health change"
                )
            _run_loop("gpu", producer.run, stop)
    finally:
        collector.close()
    _finish(pub, {"samples": producer.samples, "suppressed": producer.suppressed, "errors": producer.errors})


@produce_app.command()
def dcgm(
    url: Annotated[str, typer.Option(help="dcgm-exporter metrics URL, e.g. http://HOST:9400/metrics.")],
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    node: NodeOpt = None,
    interval: Annotated[float, typer.Option(help="Seconds between scrapes.")] = 5.0,
    timeout: Annotated[float, typer.Option(help="HTTP timeout in seconds.")] = 5.0,
    metrics_address: MetricsOpt = None,
) -> None:
    """Scrape dcgm-exporter and publish the same per-node GPU records as `gpu`."""
    from producers.gpu_dcgm import DcgmProducer

    name = _node(node, host_default=False)  # refused before Kafka: not a Slurm node name
    signer = _signer(node)
    _logging()
    with _probes(metrics_address, "dcgm"):
        pub = _publisher(bootstrap, data_dir, "trainmedic-dcgm", signer)
        try:
            producer = DcgmProducer(pub, url, interval_s=interval, timeout_s=timeout, node=name)
        except ValueError as exc:
            raise UsageError(f"--url: {exc}") from None
        _run_loop("dcgm", producer.run)
    _finish(pub, {"scrapes": producer.scrapes, "samples": producer.samples, "errors": producer.errors})


def _nvml_gpu_index() -> Any:
    """PCI bus id -> GPU index from NVML where it answers; without it Xid events carry no index."""
    from producers.kernel import nvml_gpu_index

    try:
        collector = _nvml_collector()
    except NvmlMissing as exc:
        logging.getLogger("trainmedic.kernel").warning("%s: Xid events will carry no GPU index", exc)
        return None
    try:
        return nvml_gpu_index(collector)
    finally:
        collector.close()


#: A quiet kernel stream still wakes its loop this often (liveness beat, stop check).
STREAM_IDLE_S = 5.0


@produce_app.command()
def ib(
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    node: NodeOpt = None,
    interval: Annotated[
        Optional[float], typer.Option(help="Seconds between samples (default: the setting ib_interval_s, 10).")
    ] = None,
    sysfs_root: Annotated[
        Optional[Path],
        typer.Option(
            "--sysfs-root",
            help="The InfiniBand sysfs class directory to read (default: the setting ib_sysfs_root, "
            "/sys/class/infiniband).",
        ),
    ] = None,
    metrics_address: MetricsOpt = None,
) -> None:
    """InfiniBand / RoCE port state and error counters from sysfs: one record per node per interval,
    every port of every RDMA device in it (topic net.ports)."""
    from producers.ib_sysfs import IbSysfsCollector, IbSysfsProducer, IbSysfsUnavailable

    if interval is not None and not interval > 0:
        raise UsageError("--interval must be > 0")
    s = settings(ib_sysfs_root=sysfs_root, ib_interval_s=interval)
    name = _node(node)  # refused before anything starts: not a Slurm node name
    signer = _signer(node)
    _logging()
    # The sysfs tree first: a host without RDMA devices is told so, not about Kafka.
    try:
        collector = IbSysfsCollector(s.ib_sysfs_root)
    except IbSysfsUnavailable as exc:
        raise Unavailable(f"InfiniBand / RoCE ports cannot be read on this host: {exc}") from None
    with _probes(metrics_address, "ib"):
        pub = _publisher(bootstrap, data_dir, "trainmedic-ib", signer)
        producer = IbSysfsProducer(pub, node=name, interval_s=s.ib_interval_s, collector=collector)
        typer.echo(f"producing InfiniBand / RoCE port samples from {s.ib_sysfs_root} every {s.ib_interval_s:g} s")
        _run_loop("ib", producer.run)
    _finish(pub, {"samples": producer.samples, "errors": producer.errors, "port_errors": producer.port_errors})


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
    metrics_address: MetricsOpt = None,
) -> None:
    """NVRM Xid / SXid / fallen-off-the-bus lines from the kernel log, resuming where it stopped."""
    if sum((file is not None, kmsg, journal)) != 1:
        raise UsageError("give exactly one of --file PATH, --kmsg, --journal")
    name = settings(node=node).slurm_node()  # as _node(node); refused before Kafka: not a Slurm node name
    signer = _signer(node)
    _logging()
    with _probes(metrics_address, "kernel"):
        _kernel(bootstrap, data_dir, name, file, kmsg, state_dir, lookback, signer)


def _kernel(
    bootstrap: str | None,
    data_dir: Path,
    node: str,
    file: Path | None,
    kmsg: bool,
    state_dir: Path | None,
    lookback: float,
    signer: NodeSigner | None = None,
) -> None:
    from producers.kernel import KernelLogProducer, KernelStreamProducer, boot_id, read_journal, read_kmsg
    from producers.metrics import ProducerHealth
    from producers.position import Checkpointer

    pub = _publisher(bootstrap, data_dir, "trainmedic-kernel", signer)
    stop = _stop_event()
    gpu_index_of = _nvml_gpu_index()
    store = _positions(state_dir, data_dir, "kernel")
    if file is not None:
        key = f"file:{file}"
        follower = KernelLogProducer(
            pub,
            file,
            node=node,
            gpu_index_of=gpu_index_of,
            resume=store.file(key),
            lookback_bytes=FILE_LOOKBACK_BYTES,
        )
        checkpoint = Checkpointer(store, follower.positions, _flushed(pub))
        liveness = ProducerHealth("kernel", 0.5)
        while not stop.wait(0.5):
            published = follower.poll_once()
            checkpoint.maybe_save()
            # Ready once the file is open (it may appear after the producer starts).
            if follower.follower.is_open:
                liveness.ok(published, f"following {file}")
            else:
                liveness.failed(f"{file} cannot be opened (not there yet, or no permission)")
        liveness.stop()
        _finish(pub, {"published": follower.published}, checkpoint)
        return
    stream = KernelStreamProducer(pub, node=node, gpu_index_of=gpu_index_of, reader="kmsg" if kmsg else "journald")
    # The stream's position: the journal cursor, or the kmsg sequence number within this boot.
    last: dict[str, Any] = {}
    checkpoint = Checkpointer(store, lambda: dict(last), _flushed(pub))
    source = "/dev/kmsg" if kmsg else "journalctl -k"
    # Ready at the stream's first record or idle wake-up: the source is open then.
    liveness = ProducerHealth("kernel", STREAM_IDLE_S)
    try:
        if kmsg:
            saved = store.get("kmsg")
            same_boot = isinstance(saved, dict) and saved.get("boot_id") == boot_id()
            after = int(saved["seq"]) if same_boot and isinstance(saved.get("seq"), int) else None
            for message, seq in read_kmsg(after_seq=after, lookback_s=lookback, idle_s=STREAM_IDLE_S):
                liveness.ok(1 if stream.handle(message) else 0, f"reading {source}")
                if seq is not None:
                    last["kmsg"] = {"boot_id": boot_id(), "seq": seq}
                checkpoint.maybe_save()
                if stop.is_set():
                    break
        else:
            cursor = store.get("journal")
            for message, host, entry_cursor in read_journal(
                cursor if isinstance(cursor, str) else None, lookback_s=lookback, idle_s=STREAM_IDLE_S
            ):
                liveness.ok(1 if stream.handle(message, host) else 0, f"reading {source}")
                if entry_cursor:
                    last["journal"] = entry_cursor
                checkpoint.maybe_save()
                if stop.is_set():
                    break
    except OSError as exc:
        raise UsageError(f"cannot read the kernel log: {exc}") from None
    finally:
        liveness.stop()
    _finish(pub, {"published": stream.published}, checkpoint)
    if not stop.is_set():
        # journalctl exited (or kmsg closed): a lone producer exits non-zero to be restarted.
        raise Unavailable(f"the kernel log stream ({source}) ended without being asked to stop")


@produce_app.command()
def logs(
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    job: Annotated[Optional[str], typer.Option(help="Follow this job's files (with --path).")] = None,
    path: Annotated[Optional[list[Path]], typer.Option(help="Output file(s) of --job.")] = None,
    nodes: Annotated[
        Optional[str], typer.Option(help="The job's nodes, comma-separated or a Slurm hostlist (rank -> node).")
    ] = None,
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
    metrics_address: MetricsOpt = None,
) -> None:
    """Follow training logs (rotation, truncation, srun/torchrun rank prefixes) and publish them."""
    if discover == bool(job):
        raise UsageError("give either --discover or --job ID --path FILE")
    if interval <= 0:
        raise UsageError("--interval must be > 0")
    if placements not in ("slurm", "bus"):
        raise UsageError(f"--placements {placements!r}: expected 'slurm' or 'bus'")
    # On a node (TRAINMEDIC_NODE set, as the chart's DaemonSet does) discovery follows that node's jobs.
    only_node = _node(only_node, host_default=False) if discover else only_node
    if placements == "bus" and not only_node:
        raise UsageError("--placements bus needs --only-node NODE (the node whose jobs to follow)")
    if resync <= 0:
        raise UsageError("--resync must be > 0")
    if not discover and not path:
        raise UsageError("--job needs at least one --path")
    job_nodes = _job_nodes(nodes)
    _logging()
    with _probes(metrics_address, "logs"):
        if discover:
            _discover_logs(bootstrap, data_dir, only_node, interval, placements, resync, state_dir)
        else:
            assert job and path
            _job_logs(bootstrap, data_dir, job, path, job_nodes, ranks_per_node, state_dir)


def _discover_logs(
    bootstrap: str | None,
    data_dir: Path,
    only_node: str | None,
    interval: float,
    placements: str,
    resync: float,
    state_dir: Path | None,
) -> None:
    from producers.jobdiscovery import JobDiscovery
    from producers.metrics import ProducerHealth
    from producers.placements import BusPlacements
    from producers.position import Checkpointer

    pub = _publisher(bootstrap, data_dir, "trainmedic-logs")
    stop = _stop_event()
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
    # A round lists the running jobs and may describe new ones, each call up to the runner's timeout.
    liveness = ProducerHealth("logs", interval, 2 * finder.timeout_s)
    while not stop.is_set():
        list_errors = finder.list_errors
        published = finder.poll_once()
        checkpoint.maybe_save()
        if finder.list_errors > list_errors:
            liveness.failed(finder.last_error or "listing the running jobs failed")
        else:
            liveness.ok(published, f"discovery running: following {len(finder.tailers)} job(s)")
        stop.wait(interval)
    liveness.stop()
    for t in finder.tailers.values():
        t.drain()
    _finish(pub, {"jobs": len(finder.tailers), "errors": finder.errors}, checkpoint)
    for t in finder.tailers.values():
        t.close()


def _job_nodes(nodes: str | None) -> tuple[str, ...]:
    """--nodes as node names: a hostlist (gpu[01-04] or gpu01,gpu02) whose every name is a Slurm
    node name (slurmio.hostlist refuses any other, naming it)."""
    from slurmio.hostlist import HostlistError, expand_hostlist

    try:
        return tuple(expand_hostlist(nodes))
    except HostlistError as exc:
        raise UsageError(f"--nodes: {exc}") from None


def _job_logs(
    bootstrap: str | None,
    data_dir: Path,
    job: str,
    path: list[Path],
    nodes: tuple[str, ...],
    ranks_per_node: int | None,
    state_dir: Path | None,
) -> None:
    from producers.joblogs import JobLayout, JobLogProducer
    from producers.metrics import ProducerHealth
    from producers.position import Checkpointer

    pub = _publisher(bootstrap, data_dir, "trainmedic-logs")
    stop = _stop_event()
    layout = JobLayout(nodes, ranks_per_node)
    store = _positions(state_dir, data_dir, f"logs-job-{job}")
    resume = {p: pos for p in path if (pos := store.file(f"job:{job}:{p}")) is not None}
    tailer = JobLogProducer(pub, job, path, layout, resume=resume)
    checkpoint = Checkpointer(store, tailer.positions, _flushed(pub))
    # A job's files may appear only once it starts: following them is the work, open or not yet.
    liveness = ProducerHealth("logs", 0.2)
    while not stop.wait(0.2):
        published = tailer.poll_once()
        checkpoint.maybe_save()
        opened = sum(1 for f in tailer.followers if f.is_open)
        liveness.ok(published, f"following job {job}: {opened} of {len(tailer.followers)} file(s) open")
    liveness.stop()
    tailer.drain()
    _finish(pub, {"lines": tailer.lines_published}, checkpoint)


@produce_app.command()
def slurm(
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    slurm_conf: Annotated[Optional[str], typer.Option(help="slurm.conf (default: $SLURM_CONF).")] = None,
    interval: Annotated[float, typer.Option(help="Seconds between polls (one squeue + one sinfo each).")] = 5.0,
    state_file: Annotated[Optional[Path], typer.Option(help="Last-seen state (default DATA_DIR/producers/).")] = None,
    metrics_address: MetricsOpt = None,
) -> None:
    """Job state transitions and node state/flag changes from Slurm, as change events only.

    Runs squeue/sinfo here (slurm_access local) or on the login node over SSH (slurm_access ssh,
    the executor's slurm_ssh_* settings); slurmrestd cannot answer what it reads (refused)."""
    from producers.slurm import SlurmProducer, default_state_path

    _logging()
    access = settings().slurm_access
    runner = None
    if access == "rest":
        raise UsageError(
            "produce slurm reads squeue/sinfo --json and scontrol show reservation, which slurmrestd does not "
            "serve alike: run it where the Slurm client works (slurm_access local) or over SSH (slurm_access ssh)"
        )
    if access == "ssh":
        from trainmedic.cli.backend import scheduler_backend

        if slurm_conf is not None:
            raise UsageError("--slurm-conf is for local access; over SSH the setting slurm_ssh_slurm_conf names it")
        runner = scheduler_backend("slurm-ssh").runner
    with _probes(metrics_address, "slurm"):
        pub = _publisher(bootstrap, data_dir, "trainmedic-slurm")
        producer = SlurmProducer(
            pub,
            slurm_conf=slurm_conf if runner is None else None,
            runner=runner,
            interval_s=interval,
            state_path=state_file or default_state_path(data_dir),
        )
        _run_loop("slurm", producer.run)
    _finish(pub, {"polls_failed": producer.failed_polls})
