"""The stack in one process tree: broker (embedded or external), streams worker,
audit sink and executor. The same code runs embedded and against external
services; only addresses differ.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

from bus.admin import check_bootstrap, ensure_topics
from bus.publish import Publisher
from schemas.errors import TrainmedicError
from schemas.vocab import Mode
from sinks.audit import AuditSink, AuditStore
from sinks.backends.base import SchedulerBackend
from sinks.executor import Executor, ExecutorService, ExecutorSettings
from sinks.guardrails import GuardrailFile, Guardrails
from streams.policy import DEFAULT_POLICY
from trainmedic.ops.auto_return import AutoReturnService
from trainmedic.settings import Settings, audit_layout
from trainmedic.stack.broker import BrokerError, EmbeddedBroker, check_port_free, free_port, port_in_use
from trainmedic.stack.broker_watch import BrokerWatch
from trainmedic.stack.metrics_server import MetricsServer
from trainmedic.stack.supervisor import Component, Supervisor, describe_returncode, die_with_parent
from trainmedic.web.api import API_MESSAGE_TIMEOUT_MS, PENDING, ApiError, ApiServer, create_api, load_or_create_token
from trainmedic.web.console import LiveFeed

log = logging.getLogger("trainmedic.stack.runtime")


class StackError(TrainmedicError, RuntimeError):
    pass


@dataclass
class StackConfig:
    data_dir: Path = Path("var")
    bootstrap: str | None = None  # None: start the embedded broker
    clickhouse: str | None = None  # None: chDB in data_dir/chdb
    database: str = "trainmedic"
    policy: Path | None = None
    mode: str | None = None  # overrides the policy's mode everywhere
    # None: the streams worker's own settings (TRAINMEDIC_SETTLE_S / _COLLATERAL_S, the config file).
    settle_s: float | None = None
    collateral_wait_s: float | None = None
    verify_timeout_s: float = 60.0
    group_suffix: str = ""  # isolates consumer groups (tests sharing a broker)
    worker_ready_timeout_s: float = 90.0
    api_host: str = "127.0.0.1"
    api_port: int | None = None  # None: no operator API
    api_insecure: bool = False  # allow a non-loopback address without TLS
    api_tls_cert: Path | None = None  # with api_tls_key: the API serves HTTPS (and may leave loopback)
    api_tls_key: Path | None = None
    # The streams workers' Prometheus endpoints: this port and up (Stack.worker_metrics_ports).
    worker_metrics_port: int | None = None
    # Streams workers: one consumer group splitting the jobs between them (at most the partition count).
    workers: int = 1
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # the rest of the stack's Prometheus listener (no token); None: off
    broker_port: int | None = None  # the embedded broker's port; None: the previous run's when free, else any
    supervise: bool = False  # `up`: restart dead parts with backoff, give up after too many crashes
    max_crashes: int = 5  # ... per component within crash_window_s
    crash_window_s: float = 300.0
    restart_backoff_s: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
    broker_watch_s: float = 60.0  # how often what the embedded broker holds is read (trainmedic/stack/broker_watch.py)

    @property
    def token_file(self) -> Path:
        return self.data_dir / "api-token"

    @property
    def viewer_token_file(self) -> Path:
        """A read-only token: the console and the GET endpoints, no approvals or changes."""
        return self.data_dir / "api-viewer-token"


@dataclass
class Stack:
    config: StackConfig
    backend: SchedulerBackend
    broker: EmbeddedBroker | None = None
    bootstrap: str = ""
    store: AuditStore | None = None
    sink: AuditSink | None = None
    executor: ExecutorService | None = None
    auto_return: AutoReturnService | None = None
    broker_watch: BrokerWatch | None = None
    api: ApiServer | None = None
    console_feed: LiveFeed | None = None
    publisher: Publisher | None = None
    metrics: MetricsServer | None = None
    supervisor: Supervisor | None = None
    _workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    _threads: list[threading.Thread] = field(default_factory=list)
    _previous_run: dict[str, Any] = field(default_factory=dict)

    @property
    def logs_dir(self) -> Path:
        return self.config.data_dir / "logs"

    @property
    def policy_path(self) -> Path:
        return Path(self.config.policy).resolve() if self.config.policy else DEFAULT_POLICY

    @property
    def modes_path(self) -> Path:
        return (self.config.data_dir / "modes.yaml").resolve()

    def start(self) -> Stack:
        cfg = self.config
        self.preflight()  # refusals first: nothing is started when one applies
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        try:
            if cfg.bootstrap:
                check_bootstrap(cfg.bootstrap)
                self.bootstrap = cfg.bootstrap
            else:
                self.broker = EmbeddedBroker(port=self._broker_port(), log_path=self.logs_dir / "broker.log").start()
                self.bootstrap = self.broker.bootstrap
            # Every topic with its partition count before anything writes (an auto-created one gets 1).
            ensure_topics(self.bootstrap, Settings.load().topic_partitions)
            if self.broker is not None:
                self._start_broker_watch()
            self._start_workers()
            self.store = (
                AuditStore(cfg.clickhouse, cfg.database, audit_layout(Settings.load()))
                if cfg.clickhouse
                else AuditStore.embedded(cfg.data_dir / "chdb", cfg.database, audit_layout(Settings.load()))
            )
            self.store.migrate()
            self._start_sink()
            self._start_executor()
            self._start_auto_return()
            if cfg.metrics_port is not None:
                # This process runs the executor (and auto-return), the audit sink, the API and
                # the embedded broker's watch; the streams workers serve their own.
                roles = ["executor", "audit-sink"]
                roles += ["api"] if cfg.api_port is not None else []
                roles += ["embedded-broker"] if self.broker is not None else []
                self.metrics = MetricsServer(cfg.metrics_host, cfg.metrics_port, roles=roles).start()
            if cfg.api_port is not None:
                self._start_api()
            self._wait_workers_ready()
            if cfg.supervise:
                self.supervisor = Supervisor(
                    self._components(),
                    max_crashes=cfg.max_crashes,
                    window_s=cfg.crash_window_s,
                    backoff_s=cfg.restart_backoff_s,
                ).start()
            self._write_runtime_file()
        except (BrokerError, StackError):
            self.stop()
            raise
        except Exception as exc:
            self.stop()
            raise StackError(str(exc)) from exc
        return self

    def preflight(self) -> None:
        """Refuse to start, before starting anything, when the settings or the machine say no:
        a non-loopback API without --insecure, another `up` alive on this data dir, a busy port."""
        cfg = self.config
        if (cfg.api_tls_cert is None) != (cfg.api_tls_key is None):
            raise StackError("api_tls_cert and api_tls_key go together: give both (PEM files) or neither")
        for what, path in (("api_tls_cert", cfg.api_tls_cert), ("api_tls_key", cfg.api_tls_key)):
            if path is not None and not path.is_file():
                raise StackError(f"{what} {path}: no such file")
        tls = cfg.api_tls_cert is not None
        if cfg.api_port is not None and cfg.api_host not in LOOPBACK and not (cfg.api_insecure or tls):
            raise StackError(
                f"--api-host {cfg.api_host}: off loopback the operator API serves TLS (api_tls_cert and "
                "api_tls_key) or needs --insecure (TLS terminated in front of it)"
            )
        if cfg.api_port is not None:
            for token_file in (cfg.token_file, cfg.viewer_token_file):
                if token_file.exists():
                    try:
                        load_or_create_token(token_file)  # an existing file: its mode and length checked
                    except (ApiError, OSError) as exc:
                        raise StackError(str(exc)) from None
        self._previous_run = {}
        if self.runtime_file.exists():
            try:
                self._previous_run = dict(json.loads(self.runtime_file.read_text()))
            except (OSError, ValueError, TypeError):
                log.warning("%s is unreadable; ignoring it", self.runtime_file)
            pid = self._previous_run.get("pid")
            if isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid):
                raise StackError(
                    f"{self.runtime_file}: trainmedic (pid {pid}) is still running on this data dir; "
                    "stop it first (Ctrl-C or kill -TERM). Nothing was started."
                )
            if pid is not None:
                log.warning("stale %s of pid %s (no longer running): replacing it", self.runtime_file, pid)
        partitions = Settings.load().topic_partitions
        if not 1 <= cfg.workers <= partitions:
            raise StackError(
                f"--workers {cfg.workers}: between 1 and the topics' partition count ({partitions}, the setting "
                "topic_partitions); "
                "a worker beyond it would get no partition and judge nothing"
            )
        checks = [
            (cfg.api_host, cfg.api_port, "--api-port (operator API)"),
            (cfg.metrics_host, cfg.metrics_port, "--metrics-address (metrics listener)"),
        ]
        checks += [
            ("127.0.0.1", port, f"--metrics-port (streams worker {i} metrics)")
            for i, port in enumerate(self.worker_metrics_ports())
        ]
        if not cfg.bootstrap and cfg.broker_port:
            checks.append(("127.0.0.1", cfg.broker_port, "--broker-port (embedded broker)"))
        for host, port, what in checks:
            if port:
                try:
                    check_port_free(host, port, what)
                except BrokerError as exc:
                    raise StackError(str(exc)) from None

    def worker_metrics_ports(self, count: int | None = None) -> list[int]:
        """The metrics ports of the first `count` workers (default: the configured workers): from
        --metrics-port up, passing over the ports the rest of this stack listens on. By default `up`'s
        own listener is 9479, right after the first worker's 9478: with `+ i` alone, a second worker
        took 9479 and `up` stopped at start ("address already in use")."""
        cfg = self.config
        count = cfg.workers if count is None else count
        if not cfg.worker_metrics_port:
            return []
        taken = {p for p in (cfg.metrics_port, cfg.api_port, cfg.broker_port) if p}
        ports: list[int] = []
        port = cfg.worker_metrics_port
        while len(ports) < count:
            if port > 65535:
                raise StackError(
                    f"--metrics-port {cfg.worker_metrics_port}: no room for {count} worker ports below 65536"
                )
            if port not in taken:
                ports.append(port)
            port += 1
        return ports

    def _broker_port(self) -> int:
        """Stable across restarts of `up`: producers that cached the address find the new broker.
        The configured port, else the previous run's when it is free, else any free one."""
        if self.config.broker_port:
            return self.config.broker_port
        previous = self._previous_run.get("broker_port")
        if isinstance(previous, int) and 0 < previous < 65536:
            if not port_in_use("127.0.0.1", previous):
                return previous
            log.warning("the previous broker port %d is taken now; the broker gets a new one", previous)
        return free_port()

    def _start_sink(self) -> None:
        assert self.store is not None
        self.sink = AuditSink(self.bootstrap, self.store, group=f"trainmedic-audit{self.config.group_suffix}")
        self._start_thread("audit-sink", self.sink.run)

    def _start_executor(self) -> None:
        cfg = self.config
        self.executor = ExecutorService(
            self.bootstrap,
            Executor(
                self.backend,
                ExecutorSettings(verify_timeout_s=cfg.verify_timeout_s, group=f"trainmedic-executor{cfg.group_suffix}"),
            ),
            Guardrails(GuardrailFile(self.policy_path), self.backend),
        )
        self._start_thread("executor", self.executor.run)

    def _start_auto_return(self) -> None:
        """Beside the executor: it acts only while this executor holds the acting lease (trainmedic/ops/auto_return.py)."""
        assert self.store is not None
        self.auto_return = AutoReturnService(
            self.backend,
            self.store,
            self.bootstrap,
            self.policy_path,
            acting=lambda: self.executor is not None and self.executor.acting,
            guardrails=GuardrailFile(self.policy_path),
            modes_file=self.modes_path,
            mode_override=cast("Mode | None", self.config.mode),
        )
        self._start_thread("auto-return", self.auto_return.run)

    def _start_broker_watch(self) -> None:
        self.broker_watch = BrokerWatch(
            self.bootstrap,
            lambda: self.broker.pid if self.broker is not None else None,
            Settings.load().embedded_broker_warn_records,
        )
        self._start_thread("broker-watch", partial(self.broker_watch.run, self.config.broker_watch_s))

    def _start_thread(self, name: str, target: Any) -> None:
        def run() -> None:
            try:
                target()
            except Exception:  # the supervisor sees the thread end; the log says why
                log.exception("the %s thread died", name)

        self._threads = [t for t in self._threads if t.name != name]
        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _thread_alive(self, name: str) -> bool:
        return any(t.name == name and t.is_alive() for t in self._threads)

    # --- supervision ------------------------------------------------------------------

    def _components(self) -> list[Component]:
        comps: list[Component] = []
        if self.broker is not None:
            broker = self.broker
            comps.append(Component("broker", broker.alive, self._restart_broker, broker.exit_status))
            comps.append(
                Component(
                    "broker-watch", lambda: self._thread_alive("broker-watch"), self._start_broker_watch, _thread_ended
                )
            )
        for i in range(self.config.workers):
            comps.append(
                Component(
                    self.worker_name(i),
                    partial(self.worker_alive, i),
                    partial(self._restart_worker, i),
                    partial(self._worker_exit, i),
                )
            )
        comps.append(Component("executor", lambda: self._thread_alive("executor"), self._start_executor, _thread_ended))
        comps.append(Component("audit-sink", lambda: self._thread_alive("audit-sink"), self._start_sink, _thread_ended))
        comps.append(
            Component("auto-return", lambda: self._thread_alive("auto-return"), self._start_auto_return, _thread_ended)
        )
        if self.console_feed is not None:
            feed = self.console_feed
            comps.append(Component("console-feed", lambda: feed.alive, self._restart_feed, _thread_ended))
        if self.api is not None:
            comps.append(
                Component("api", lambda: self.api is not None and self.api.alive, self._restart_api, _thread_ended)
            )
        if self.metrics is not None:
            metrics = self.metrics
            comps.append(Component("metrics", lambda: metrics.alive, metrics.restart, _thread_ended))
        return comps

    def _worker_exit(self, i: int) -> str:
        proc = self._workers.get(i)
        return describe_returncode(proc.poll() if proc else None) + f"; log {self.worker_log(i)}.1"

    def _stop_worker(self, i: int) -> None:
        proc = self._workers.get(i)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)

    def _restart_worker(self, i: int) -> None:
        self._stop_worker(i)
        self._start_worker(i)
        self._wait_worker_ready(i)

    def _restart_broker(self) -> None:
        """Memory-only: the new broker is empty. Same port, topics recreated with their partition
        counts, then a fresh streams worker (its offsets and changelogs went with the old broker)."""
        assert self.broker is not None
        # The workers go first: a live one reconnects to the empty broker at once, and its
        # metadata requests auto-create its topics with the broker's default partition count
        # before ensure_topics can create them with ours (seen in CI: 4 partitions, not 12).
        for i in range(self.config.workers):
            self._stop_worker(i)
        self.broker.stop(grace_s=0)  # memory-only: a graceful exit (about 5 s) keeps nothing more
        self.broker.start()
        report = ensure_topics(self.bootstrap, Settings.load().topic_partitions)
        if report.mismatched:
            log.error(
                "after the broker restart these topics exist with another partition count (created by a "
                "client before trainmedic could): %s",
                ", ".join(f"{name} ({count})" for name, count in sorted(report.mismatched.items())),
            )
        log.warning(
            "the embedded broker was restarted on %s: events it held that no consumer had read are lost; "
            "the audit keeps what was recorded",
            self.bootstrap,
        )
        for i in range(self.config.workers):
            self._restart_worker(i)

    def _restart_feed(self) -> None:
        assert self.console_feed is not None
        self.console_feed.start()  # the same feed object: the console's routes hold it

    def _restart_api(self) -> None:
        assert self.api is not None
        old = self.api
        self.api = ApiServer(
            old.app, old.host, old.port, tls_cert=self.config.api_tls_cert, tls_key=self.config.api_tls_key
        ).start()

    def health(self) -> dict[str, Any]:
        """What /api/health answers: ok, and per component its state, restarts and reason; and
        `warnings` and `degraded`, which leave it ok (what the embedded broker holds; the audit's
        inserts failing)."""
        if self.supervisor is not None:
            out = self.supervisor.health()
        else:
            try:
                self.check_alive()
                out = {"ok": True}
            except StackError as exc:
                out = {"ok": False, "down": {"stack": str(exc).splitlines()[0]}}
        if self.broker_watch is not None and self.broker_watch.warnings:
            out["warnings"] = list(self.broker_watch.warnings)
        if (problem := self.audit_problem()) is not None:
            out["degraded"] = {**out.get("degraded", {}), "audit": problem}
        return out

    def audit_problem(self) -> str | None:
        """Why the audit is behind: its inserts fail now (sinks/audit.py InsertFailure), named under
        `degraded` in the health (still ok: the pipeline goes on, the events wait in Kafka) and by the
        audit's read paths (503); None while inserts succeed."""
        sink = self.sink
        failing = sink.failing if sink is not None else None
        return failing.describe() if failing is not None else None

    @property
    def runtime_file(self) -> Path:
        return self.config.data_dir / "runtime.json"

    def _write_runtime_file(self) -> None:
        """Where the CLI and producers find the running stack. Written last, when every part is up."""
        info = {
            "pid": os.getpid(),
            "bootstrap": self.bootstrap,
            "embedded_broker": self.broker is not None,
            "broker_port": self.broker.port if self.broker else None,
            "broker_storage": "memory" if self.broker else "external",
            "api_url": self.api.url if self.api else None,
            "metrics_url": self.metrics.url if self.metrics else None,
            "worker_metrics_urls": [f"http://127.0.0.1:{p}/metrics" for p in self.worker_metrics_ports()],
            "started_at": time.time(),
            "note": (
                "Producers re-read 'bootstrap' from this file when the broker stops answering. The embedded "
                "broker keeps its port across restarts of `up` while the port is free, but it keeps events in "
                "memory only: what no consumer had read when it stopped is lost; the audit is the durable record."
            ),
        }
        tmp = self.runtime_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=1) + "\n")
        tmp.replace(self.runtime_file)  # atomic: a producer never reads half a file

    def _start_api(self) -> None:
        cfg = self.config
        assert self.store is not None
        self.publisher = Publisher(
            self.bootstrap, "trainmedic-api", config={"message.timeout.ms": API_MESSAGE_TIMEOUT_MS}
        )
        token = load_or_create_token(cfg.token_file)
        viewer_token = load_or_create_token(cfg.viewer_token_file)
        self.console_feed = LiveFeed(self.bootstrap, group_prefix=f"trainmedic-console{cfg.group_suffix}").start()
        api = create_api(
            self.store,
            self.publisher,
            token,
            self.backend,
            self.policy_path,
            self.modes_path,
            feed=self.console_feed,
            viewer_token=viewer_token,
            health=self.health,
            audit_problem=self.audit_problem,
        )
        self.api = ApiServer(
            api, cfg.api_host, cfg.api_port or free_port(), tls_cert=cfg.api_tls_cert, tls_key=cfg.api_tls_key
        )
        try:
            self.api.start()
        except ApiError as exc:
            raise StackError(str(exc)) from None

    # --- streams workers ---------------------------------------------------------------

    def worker_name(self, i: int) -> str:
        return "streams-worker" if i == 0 else f"streams-worker-{i}"

    def worker_log(self, i: int) -> Path:
        return self.logs_dir / ("streams.log" if i == 0 else f"streams-{i}.log")

    def worker_alive(self, i: int) -> bool:
        proc = self._workers.get(i)
        return proc is not None and proc.poll() is None

    def worker(self, i: int = 0) -> subprocess.Popen[bytes] | None:
        return self._workers.get(i)

    def _start_workers(self) -> None:
        for i in range(self.config.workers):
            self._start_worker(i)

    def _start_worker(self, i: int = 0) -> None:
        cfg = self.config
        env = dict(os.environ)
        # Only what `up` itself decides: the rest the worker reads from the settings as `up` did.
        env.update(TRAINMEDIC_BOOTSTRAP=self.bootstrap, TRAINMEDIC_MODES_FILE=str(self.modes_path))
        # Faust's local folder beside the rest of this run's data, one per worker, unless the settings name one.
        if "TRAINMEDIC_STREAMS_DATA_DIR" in env:
            if i:
                env["TRAINMEDIC_STREAMS_DATA_DIR"] = f"{env['TRAINMEDIC_STREAMS_DATA_DIR']}-{i}"
        else:
            env["TRAINMEDIC_STREAMS_DATA_DIR"] = str(
                (cfg.data_dir / ("streams" if i == 0 else f"streams-{i}")).resolve()
            )
        if cfg.settle_s is not None:
            env["TRAINMEDIC_SETTLE_S"] = str(cfg.settle_s)
        if cfg.collateral_wait_s is not None:
            env["TRAINMEDIC_COLLATERAL_S"] = str(cfg.collateral_wait_s)
        if cfg.group_suffix:
            env["TRAINMEDIC_STREAMS_ID"] = f"trainmedic-streams{cfg.group_suffix}"
        if cfg.policy:
            env["TRAINMEDIC_POLICY"] = str(Path(cfg.policy).resolve())
        if cfg.mode:
            env["TRAINMEDIC_MODE"] = cfg.mode
        if cfg.worker_metrics_port:
            env["TRAINMEDIC_METRICS_PORT"] = str(self.worker_metrics_ports(i + 1)[i])
        log_path = self.worker_log(i)
        if log_path.exists() and log_path.stat().st_size:
            log_path.replace(log_path.with_suffix(".log.1"))  # the last run's, for the post-mortem
        log_path.write_bytes(b"")
        with open(log_path, "ab") as out:
            self._workers[i] = subprocess.Popen(
                [sys.executable, "-m", "trainmedic.stack.streams_worker", "worker", "--without-web", "-l", "info"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C goes to `up`, which stops the worker in order
                preexec_fn=die_with_parent(),  # a killed `up` takes the worker with it
            )

    def _wait_workers_ready(self) -> None:
        for i in range(self.config.workers):
            self._wait_worker_ready(i)

    def _wait_worker_ready(self, i: int = 0) -> None:
        deadline = time.monotonic() + self.config.worker_ready_timeout_s
        log_path = self.worker_log(i)
        while time.monotonic() < deadline:
            if not self.worker_alive(i):
                tail = log_path.read_text(errors="replace")[-3000:]
                raise StackError(f"{self.worker_name(i)} exited at start; its log ({log_path}) ends:\n{tail}")
            if b"[^Worker]: Ready" in log_path.read_bytes():
                return
            time.sleep(0.2)
        raise StackError(
            f"{self.worker_name(i)} was not ready within {self.config.worker_ready_timeout_s:.0f} s; see {log_path}"
        )

    def check_alive(self) -> None:
        """Raise StackError naming the component that died."""
        for i in range(self.config.workers):
            if not self.worker_alive(i):
                tail = self.worker_log(i).read_text(errors="replace")[-2000:]
                raise StackError(f"{self.worker_name(i)} died; its log ({self.worker_log(i)}) ends:\n{tail}")
        if self.broker is not None and not self.broker.alive():
            raise StackError("the embedded broker died; see its log in " + str(self.logs_dir / "broker.log"))
        if self.console_feed is not None and not self.console_feed.alive:
            raise StackError("the console's live feed thread died; see the log above")
        for t in self._threads:
            if not t.is_alive():
                raise StackError(f"the {t.name} thread died; see the log above")

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.pause()  # a clean stop is no crash; its thread ends after the children
        if self._owns_runtime_file():
            self.runtime_file.unlink(missing_ok=True)
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self.console_feed is not None:  # first: open event streams would keep uvicorn waiting
            self.console_feed.stop()
            self.console_feed = None
        if self.api is not None:
            self.api.stop()
            self.api = None
        if self.publisher is not None:
            self.publisher.close(5)  # flushes, and ends its delivery thread
            self.publisher = None
        # The workers' graceful stop (Faust commits and leaves its group: about 1.7 s) overlaps the
        # threads' (a poll interval each): what a worker published before it stopped is on the bus
        # for the next start either way, as the sink and executor stop first in both orders.
        for proc in self._workers.values():
            if proc.poll() is None:
                proc.terminate()
        for svc in (self.executor, self.sink, self.auto_return, self.broker_watch):
            if svc is not None:
                svc.stop_event.set()
        for t in self._threads:
            t.join(timeout=15)
        self._threads.clear()
        for proc in self._workers.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._workers.clear()
        if self.broker is not None:
            # Memory-only and its clients gone: Tansu's graceful exit (about 5 s) would keep nothing.
            self.broker.stop(grace_s=0)
        if self.store is not None:
            PENDING.release(self.store)
            self.store.close()
            self.store = None
        if self.supervisor is not None:
            self.supervisor.stop()

    def _owns_runtime_file(self) -> bool:
        """A refused start must not delete the file of the `up` that is running."""
        try:
            return bool(json.loads(self.runtime_file.read_text()).get("pid") == os.getpid())
        except (OSError, ValueError, AttributeError):
            return False


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _thread_ended() -> str:
    return "its thread ended; the log says why ('the ... thread died')"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie or a recycled pid of something else is not a running trainmedic.
    try:
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return status != "Z" and b"trainmedic" in cmdline
