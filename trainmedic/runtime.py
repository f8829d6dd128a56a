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
from pathlib import Path

from confluent_kafka.admin import AdminClient

from producers.publisher import Publisher
from schemas.clients import admin_config
from sinks.audit import AuditSink, AuditStore
from sinks.backends.base import SchedulerBackend
from sinks.executor import Executor, ExecutorService, ExecutorSettings
from sinks.guardrails import GuardrailFile, Guardrails
from streams.policy import DEFAULT_POLICY
from trainmedic.api import ApiError, ApiServer, create_api, load_or_create_token
from trainmedic.broker import BrokerError, EmbeddedBroker, ensure_topics, free_port
from trainmedic.console import LiveFeed

log = logging.getLogger("trainmedic.runtime")


class StackError(RuntimeError):
    pass


@dataclass
class StackConfig:
    data_dir: Path = Path("var")
    bootstrap: str | None = None  # None: start the embedded broker
    clickhouse: str | None = None  # None: chDB in data_dir/chdb
    database: str = "trainmedic"
    policy: Path | None = None
    mode: str | None = None  # overrides the policy's mode everywhere
    settle_s: float = 1.0
    collateral_wait_s: float = 5.0
    verify_timeout_s: float = 60.0
    group_suffix: str = ""  # isolates consumer groups (tests sharing a broker)
    worker_ready_timeout_s: float = 90.0
    api_host: str = "127.0.0.1"
    api_port: int | None = None  # None: no operator API
    api_insecure: bool = False  # allow a non-loopback address without TLS
    worker_metrics_port: int | None = None  # the streams worker's Prometheus endpoint

    @property
    def token_file(self) -> Path:
        return self.data_dir / "api-token"

    @property
    def viewer_token_file(self) -> Path:
        """A read-only token: the console and the GET endpoints, no approvals or changes."""
        return self.data_dir / "api-viewer-token"


def check_bootstrap(bootstrap: str, timeout: float = 10.0) -> None:
    for part in bootstrap.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise StackError(f"--bootstrap {bootstrap!r}: expected HOST:PORT[,HOST:PORT]")
    try:
        AdminClient(admin_config(bootstrap)).list_topics(timeout=timeout)
    except Exception as exc:
        raise StackError(f"--bootstrap {bootstrap}: Kafka does not answer within {timeout:.0f} s ({exc})") from None


@dataclass
class Stack:
    config: StackConfig
    backend: SchedulerBackend
    broker: EmbeddedBroker | None = None
    bootstrap: str = ""
    store: AuditStore | None = None
    sink: AuditSink | None = None
    executor: ExecutorService | None = None
    api: ApiServer | None = None
    console_feed: LiveFeed | None = None
    publisher: Publisher | None = None
    _worker: subprocess.Popen[bytes] | None = None
    _threads: list[threading.Thread] = field(default_factory=list)

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
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        try:
            if cfg.bootstrap:
                check_bootstrap(cfg.bootstrap)
                self.bootstrap = cfg.bootstrap
            else:
                self.broker = EmbeddedBroker(log_path=self.logs_dir / "broker.log").start()
                self.bootstrap = self.broker.bootstrap
            ensure_topics(self.bootstrap)
            self._start_worker()
            self.store = (
                AuditStore(cfg.clickhouse, cfg.database)
                if cfg.clickhouse
                else AuditStore.embedded(cfg.data_dir / "chdb", cfg.database)
            )
            self.store.migrate()
            self.sink = AuditSink(self.bootstrap, self.store, group=f"trainmedic-audit{cfg.group_suffix}")
            self.executor = ExecutorService(
                self.bootstrap,
                Executor(
                    self.backend,
                    ExecutorSettings(
                        verify_timeout_s=cfg.verify_timeout_s, group=f"trainmedic-executor{cfg.group_suffix}"
                    ),
                ),
                Guardrails(GuardrailFile(self.policy_path), self.backend),
            )
            for name, target in (("audit-sink", self.sink.run), ("executor", self.executor.run)):
                t = threading.Thread(target=target, name=name, daemon=True)
                t.start()
                self._threads.append(t)
            if cfg.api_port is not None:
                self._start_api()
            self._wait_worker_ready()
            self._write_runtime_file()
        except (BrokerError, StackError):
            self.stop()
            raise
        except Exception as exc:
            self.stop()
            raise StackError(str(exc)) from exc
        return self

    @property
    def runtime_file(self) -> Path:
        return self.config.data_dir / "runtime.json"

    def _write_runtime_file(self) -> None:
        """Where the CLI finds the running stack (the embedded broker's port is random)."""
        info = {"pid": os.getpid(), "bootstrap": self.bootstrap, "api_url": self.api.url if self.api else None}
        self.runtime_file.write_text(json.dumps(info) + "\n")

    def _start_api(self) -> None:
        cfg = self.config
        if cfg.api_host not in ("127.0.0.1", "localhost", "::1") and not cfg.api_insecure:
            raise StackError(
                f"--api-host {cfg.api_host}: the operator API binds loopback only unless --insecure is given "
                "(TLS termination belongs in front of it)"
            )
        assert self.store is not None
        self.publisher = Publisher(self.bootstrap, "trainmedic-api")
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
        )
        self.api = ApiServer(api, cfg.api_host, cfg.api_port or free_port())
        try:
            self.api.start()
        except ApiError as exc:
            raise StackError(str(exc)) from None

    def _start_worker(self) -> None:
        cfg = self.config
        env = dict(os.environ)
        env.update(
            TRAINMEDIC_BOOTSTRAP=self.bootstrap,
            TRAINMEDIC_SETTLE_S=str(cfg.settle_s),
            TRAINMEDIC_COLLATERAL_S=str(cfg.collateral_wait_s),
            TRAINMEDIC_STREAMS_ID=f"trainmedic-streams{cfg.group_suffix}",
            TRAINMEDIC_MODES_FILE=str(self.modes_path),
        )
        if cfg.policy:
            env["TRAINMEDIC_POLICY"] = str(Path(cfg.policy).resolve())
        if cfg.mode:
            env["TRAINMEDIC_MODE"] = cfg.mode
        if cfg.worker_metrics_port:
            env["TRAINMEDIC_METRICS_PORT"] = str(cfg.worker_metrics_port)
        self._worker_log = self.logs_dir / "streams.log"
        self._worker_log.write_bytes(b"")
        self._worker = subprocess.Popen(
            [sys.executable, "-m", "trainmedic.streams_worker", "worker", "--without-web", "-l", "info"],
            stdout=open(self._worker_log, "ab"),  # noqa: SIM115 - the child owns it
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def _wait_worker_ready(self) -> None:
        deadline = time.monotonic() + self.config.worker_ready_timeout_s
        while time.monotonic() < deadline:
            if self._worker is None or self._worker.poll() is not None:
                tail = self._worker_log.read_text(errors="replace")[-3000:]
                raise StackError(f"the streams worker exited at start; its log ({self._worker_log}) ends:\n{tail}")
            if b"[^Worker]: Ready" in self._worker_log.read_bytes():
                return
            time.sleep(0.2)
        raise StackError(
            f"the streams worker was not ready within {self.config.worker_ready_timeout_s:.0f} s; see {self._worker_log}"
        )

    def check_alive(self) -> None:
        """Raise StackError naming the component that died."""
        if self._worker is None or self._worker.poll() is not None:
            tail = self._worker_log.read_text(errors="replace")[-2000:]
            raise StackError(f"the streams worker died; its log ({self._worker_log}) ends:\n{tail}")
        if self.broker is not None and not self.broker.alive():
            raise StackError("the embedded broker died; see its log in " + str(self.logs_dir / "broker.log"))
        if self.console_feed is not None and not self.console_feed.alive:
            raise StackError("the console's live feed thread died; see the log above")
        for t in self._threads:
            if not t.is_alive():
                raise StackError(f"the {t.name} thread died; see the log above")

    def stop(self) -> None:
        self.runtime_file.unlink(missing_ok=True)
        if self.console_feed is not None:  # first: open event streams would keep uvicorn waiting
            self.console_feed.stop()
            self.console_feed = None
        if self.api is not None:
            self.api.stop()
            self.api = None
        if self.publisher is not None:
            self.publisher.flush(5)
            self.publisher = None
        for svc in (self.executor, self.sink):
            if svc is not None:
                svc.stop_event.set()
        for t in self._threads:
            t.join(timeout=15)
        self._threads.clear()
        if self._worker is not None and self._worker.poll() is None:
            self._worker.terminate()
            try:
                self._worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._worker.kill()
                self._worker.wait()
        self._worker = None
        if self.broker is not None:
            self.broker.stop()
        if self.store is not None:
            self.store.close()
            self.store = None
