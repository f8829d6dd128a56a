"""A process's probe listener: /metrics (Prometheus), /healthz (liveness), /readyz (readiness).

Prometheus convention: unauthenticated, read-only, on its own address (`--metrics-address`
or the settings metrics_host/metrics_port), so it can be scraped and probed remotely or kept
private independently of the operator API, which stays token-only. /healthz and /readyz answer
200 or 503 with a JSON body from bus.health (each loop: alive, ready, why); Kubernetes probes
and systemd watchdogs read the status code. Hand-written over http.server: prometheus_client's
own server serves /metrics only.

/metrics serves the registry of the process's roles (`role_registry`): only the metric families
its code uses, not every family some imported module defines (a kernel producer on every GPU
node would otherwise export the executor's and the audit's zeros), with the series the alerts
read created at 0 for their known label sets, so that `increase()` sees the first event.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.registry import Collector

from bus import health
from bus import metrics as publisher_metrics
from schemas import topics
from schemas.errors import ConfigError
from schemas.masking import mask
from trainmedic.build import BUILD_INFO


class MetricsError(ConfigError, ValueError):
    pass


#: Each role's publishers: client id less `trainmedic-` -> the topics it publishes to (its dead
#: letters go to `deadletter` besides). Each producer publishes under its own name.
PUBLISHERS: dict[str, dict[str, tuple[topics.Topic, ...]]] = {
    "gpu": {"gpu": (topics.GPU_SAMPLES,)},
    "dcgm": {"dcgm": (topics.GPU_SAMPLES,)},
    "ib": {"ib": (topics.NET_PORTS,)},
    "kernel": {"kernel": (topics.NODE_KERNEL,)},
    "logs": {"logs": (topics.JOB_LOGS, topics.JOB_PROGRESS)},
    "slurm": {"slurm": (topics.SCHED_EVENTS,)},
    "ingest": {"ingest": (topics.HEALTH_EXTERNAL,)},
    # The executor process runs the automatic return to service beside it (trainmedic/ops/auto_return.py).
    "executor": {
        "executor": (topics.ACTION_RESULTS, topics.GUARDRAIL_TRIPS, topics.ACTION_ATTEMPTS, topics.NODE_COMMANDS),
        "auto-return": (topics.NODE_RETURNS,),
    },
    "api": {"api": (topics.ACTIONS, topics.APPROVALS, topics.MODE_CHANGES, topics.NODE_RETURNS)},
    "notifier": {"notifier": ()},
    "node-agent": {"node-agent": (topics.NODE_COMMAND_RESULTS,)},
}
#: Roles whose code reads a topic through a watched consumer or a follower (bus/watchdog.py): the
#: executor (actions, lease, the modes of auto-return), notifier, node agent, the streams worker
#: (the modes) and the job-log producer (the placements of its node).
WATCHED = ("executor", "notifier", "node-agent", "streams", "logs")
PRODUCERS = ("gpu", "dcgm", "ib", "kernel", "logs", "slurm", "ingest")
#: Every role a process can have; `trainmedic up` has several (executor, audit-sink, api, embedded-broker).
ROLES = (*PRODUCERS, "streams", "executor", "audit-sink", "api", "notifier", "node-agent", "embedded-broker")


def role_families(role: str) -> tuple[Collector, ...]:
    """The metric families a process of `role` exports beyond every process's (build, loops),
    each known series of the counters the alerts read created at 0. A role's modules are
    imported here, so that a process imports only its own roles' (the streams worker's metrics
    module is not loaded into a producer)."""
    if role not in ROLES:
        raise MetricsError(f"unknown metrics role {role!r}: one of {', '.join(ROLES)}")
    found: list[Collector] = []
    if role in PRODUCERS:
        from producers import metrics as producer_metrics

        found += producer_metrics.families(role)
    elif role == "streams":
        from streams import metrics as streams_metrics

        found += streams_metrics.families()
    elif role in ("executor", "audit-sink", "node-agent"):
        from sinks import metrics as sink_metrics

        found += {
            "executor": sink_metrics.executor_families,
            "audit-sink": sink_metrics.audit_sink_families,
            "node-agent": sink_metrics.node_agent_families,
        }[role]()
    elif role == "api":
        from trainmedic.web.api import PENDING

        found.append(PENDING)
    elif role == "embedded-broker":
        from trainmedic.stack import broker_watch

        found += (
            broker_watch.STORED_RECORDS,
            broker_watch.LARGEST_PARTITION,
            broker_watch.RESIDENT_BYTES,
            broker_watch.CPU_SECONDS,
        )
    if role in PUBLISHERS:
        for producer, published in PUBLISHERS[role].items():
            publisher_metrics.expect_publisher(producer, (t.name for t in published))
        found += publisher_metrics.FAMILIES
    if role in WATCHED:
        from bus import watchdog

        found += watchdog.FAMILIES
    return tuple(found)


def role_registry(roles: Iterable[str]) -> CollectorRegistry:
    """A registry of only what a process of these roles exports: every process's families (the
    standard process_* and python_* ones, its build, its loops) and each role's. The families stay in prometheus_client's default
    registry too (where modules define them); this one is what /metrics serves."""
    # Not auto-described: the API's collector would query the audit to say its names.
    registry = CollectorRegistry(auto_describe=False)
    seen: set[int] = set()
    common = (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR, BUILD_INFO, *health.FAMILIES)
    for family in (*common, *(f for role in roles for f in role_families(role))):
        if id(family) not in seen:  # a family two roles share (a publisher's) is registered once
            seen.add(id(family))
            registry.register(family)
    return registry


def parse_address(text: str) -> tuple[str, int] | None:
    """'HOST:PORT' (IPv6 as [::1]:PORT) -> (host, port); 'off' or '' -> None."""
    text = text.strip()
    if text.lower() in ("", "off", "none"):
        return None
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise MetricsError(f"--metrics-address {text!r}: expected HOST:PORT (e.g. 127.0.0.1:9479) or off")
    return host, int(port)


class _Handler(BaseHTTPRequestHandler):
    server_version = "trainmedic-probes"
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            # Masked (schemas/masking.py): a label or a reason may quote a URL or an exception.
            self._send(200, mask(generate_latest(self.server.registry).decode()).encode(), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/livez", "/readyz"):
            rep = health.report()
            ok = rep["live"] if path != "/readyz" else rep["ready"]
            self._send(200 if ok else 503, mask(orjson.dumps(rep).decode()).encode(), "application/json")
        else:
            self._send(404, b'{"error": "not found: /metrics, /healthz, /readyz"}', "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - probes every few seconds: no log line each
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        import socket

        if ":" in host:
            self.address_family = socket.AF_INET6
        self.registry = registry
        super().__init__((host, port), _Handler)


class MetricsServer:
    """The probe listener of a process of `roles` (ROLES); with none given it serves every family
    registered in the process (prometheus_client's default registry: tools and tests)."""

    def __init__(self, host: str, port: int, roles: Iterable[str] | None = None) -> None:
        self.host, self.port = host, port
        self.registry = role_registry(roles) if roles is not None else REGISTRY
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> MetricsServer:
        try:
            self._server = _Server(self.host, self.port, self.registry)
        except OSError as exc:
            raise MetricsError(f"--metrics-address {self.host}:{self.port}: {exc.strerror or exc}") from None
        self.port = int(self._server.server_address[1])  # port 0: the one the system chose
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        return self

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
