"""The ca_bundle setting (issue 43): the operator CLI verifies an https API against it, and the
audit's ClickHouse client verifies an https server against it. Real processes and real TLS: the
API is `trainmedic run api` with a self-signed certificate (openssl), the ClickHouse side a TLS
listener that records whether a request got through the handshake."""

from __future__ import annotations

import http.server
import os
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from sinks.audit import AuditStore, AuditStoreError
from tests.launch import running, self_signed_certificate
from trainmedic.settings import Settings, clickhouse_dsn
from trainmedic.stack.broker import EmbeddedBroker, free_port

TRAINMEDIC = str(Path(sys.executable).with_name("trainmedic"))

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a test certificate")


def _tm(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TRAINMEDIC, *args], env=env, capture_output=True, text=True, timeout=120)


def test_the_cli_verifies_the_apis_certificate_against_the_ca_bundle(broker: EmbeddedBroker, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    env |= {
        "TRAINMEDIC_BOOTSTRAP": broker.bootstrap,
        "TRAINMEDIC_CLICKHOUSE_URL": f"chdb://{tmp_path / 'audit'}",
        "TRAINMEDIC_TOKEN_FILE": str(token),
        "TRAINMEDIC_MODES_FILE": str(tmp_path / "state" / "modes.yaml"),
        "TRAINMEDIC_SLURM_ACCESS": "local",
        "TRAINMEDIC_METRICS_HOST": "127.0.0.1",
    }
    assert _tm("audit", "db", "migrate", env=env).returncode == 0
    cert, key = self_signed_certificate(tmp_path)
    api_port, metrics_port = free_port(), free_port()
    server = dict(
        env,
        TRAINMEDIC_API_LISTEN=f"127.0.0.1:{api_port}",
        TRAINMEDIC_API_TLS_CERT=str(cert),
        TRAINMEDIC_API_TLS_KEY=str(key),
        TRAINMEDIC_METRICS_PORT=str(metrics_port),
    )
    ready = f"http://127.0.0.1:{metrics_port}/readyz"
    with running([TRAINMEDIC, "run", "api", "--backend", "simulated"], server, tmp_path / "api.log", ready):
        cli = dict(env, TRAINMEDIC_API=f"https://127.0.0.1:{api_port}")
        # A self-signed certificate is in no system trust store: refused, naming the setting.
        refused = _tm("recommendations", "list", "--json", env=cli)
        assert refused.returncode == 2, refused.stderr
        assert "cannot verify the TLS certificate" in refused.stderr and "TRAINMEDIC_CA_BUNDLE" in refused.stderr
        trusted = _tm("recommendations", "list", "--json", env=dict(cli, TRAINMEDIC_CA_BUNDLE=str(cert)))
        assert trusted.returncode == 0, trusted.stderr
        assert trusted.stdout.strip() == "[]"
        # Another CA's bundle does not verify it either.
        other = tmp_path / "other"
        other.mkdir()
        other_cert, _ = self_signed_certificate(other)
        wrong = _tm("recommendations", "list", "--json", env=dict(cli, TRAINMEDIC_CA_BUNDLE=str(other_cert)))
        assert wrong.returncode == 2 and "cannot verify the TLS certificate" in wrong.stderr


class _Recorder(http.server.BaseHTTPRequestHandler):
    requests: list[str] = []

    def _answer(self) -> None:
        type(self).requests.append(self.path)
        body = b"Code: 999. DB::Exception: not a ClickHouse (test listener)"
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture
def tls_listener(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """An https listener on 127.0.0.1 with a self-signed certificate: (port, the certificate)."""
    cert, key = self_signed_certificate(tmp_path)
    _Recorder.requests = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], cert
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_clickhouse_client_verifies_an_https_server_against_the_ca_bundle(tls_listener: tuple[int, Path]) -> None:
    port, cert = tls_listener
    # Not 8443: clickhouse-connect picks TLS by port unless told, so the scheme must be what tells it.
    url = f"https://reader:pw@127.0.0.1:{port}/"
    without = clickhouse_dsn(Settings(clickhouse_url=SecretStr(url)))
    assert without is not None and "ca_cert" not in without
    with pytest.raises(AuditStoreError, match="CERTIFICATE_VERIFY_FAILED"):
        AuditStore(without)
    assert _Recorder.requests == []  # the handshake failed: nothing was sent

    dsn = clickhouse_dsn(Settings(clickhouse_url=SecretStr(url), ca_bundle=cert))
    assert dsn is not None and "ca_cert=" in dsn
    with pytest.raises(AuditStoreError) as answered:
        AuditStore(dsn)
    # Verified and spoken to over TLS: the listener's own (non-ClickHouse) answer is what failed it.
    assert "CERTIFICATE_VERIFY_FAILED" not in str(answered.value)
    assert _Recorder.requests, "no request reached the listener over TLS"
    assert "pw" not in str(answered.value)  # the URL's password stays masked


def test_the_ca_bundle_goes_only_into_https_urls() -> None:
    bundle = Path("/etc/trainmedic/ch-ca.pem")
    plain = clickhouse_dsn(Settings(clickhouse_url=SecretStr("http://h:8123/"), ca_bundle=bundle))
    assert plain == "http://h:8123/"
    named = clickhouse_dsn(Settings(clickhouse_url=SecretStr("https://h:8443/?ca_cert=/own.pem"), ca_bundle=bundle))
    assert named == "https://h:8443/?ca_cert=/own.pem"  # the URL's own choice stands
    added = clickhouse_dsn(
        Settings(clickhouse_url=SecretStr("https://h:8443/?compress=lz4"), clickhouse_user="ro", ca_bundle=bundle)
    )
    assert added == "https://ro@h:8443/?compress=lz4&ca_cert=%2Fetc%2Ftrainmedic%2Fch-ca.pem"
