"""A process's probe listener: /metrics (Prometheus), /healthz (liveness), /readyz (readiness).

Prometheus convention: unauthenticated, read-only, on its own address (`--metrics-address`
or the settings metrics_host/metrics_port), so it can be scraped and probed remotely or kept
private independently of the operator API, which stays token-only. /healthz and /readyz answer
200 or 503 with a JSON body from bus.health (each loop: alive, ready, why); Kubernetes probes
and systemd watchdogs read the status code. Hand-written over http.server: prometheus_client's
own server serves /metrics only.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from bus import health
from schemas.errors import ConfigError
from schemas.masking import mask
from trainmedic.build import BUILD_INFO  # noqa: F401 - registers trainmedic_build_info in every process


class MetricsError(ConfigError, ValueError):
    pass


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

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            # Masked (schemas/masking.py): a label or a reason may quote a URL or an exception.
            self._send(200, mask(generate_latest(REGISTRY).decode()).encode(), CONTENT_TYPE_LATEST)
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

    def __init__(self, host: str, port: int) -> None:
        import socket

        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)


class MetricsServer:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> MetricsServer:
        try:
            self._server = _Server(self.host, self.port)
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
