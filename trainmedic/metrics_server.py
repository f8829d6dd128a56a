"""The Prometheus listener of `trainmedic up` (executor, audit sink, API counters).

Prometheus convention: unauthenticated, read-only, on its own address
(`--metrics-address`, 127.0.0.1:9479 by default), so it can be scraped remotely
or kept private independently of the operator API, which stays token-only.
It serves this process's default registry and nothing else.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import start_http_server

from schemas.errors import ConfigError


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


class MetricsServer:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> MetricsServer:
        try:
            self._server, self._thread = start_http_server(self.port, addr=self.host)
        except OSError as exc:
            raise MetricsError(f"--metrics-address {self.host}:{self.port}: {exc.strerror}") from None
        self.port = int(self._server.server_address[1])  # port 0: the one the system chose
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
