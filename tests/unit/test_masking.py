"""schemas/masking.py: the one masking function, the secrets a process remembers, and where it is
applied (log records, uncaught exceptions, the API's errors, the probe listener, `config show`)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import urllib.request

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY, Gauge

from schemas.masking import MASK, _mask_record, mask, remember
from trainmedic.web.masked_errors import mask_errors


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "cannot open ClickHouse at http://audit:pw-1@127.0.0.1:1/db: refused",
            f"cannot open ClickHouse at http://audit:{MASK}@127.0.0.1:1/db: refused",
        ),
        ("https://u:p@ss@ch:8443/x", f"https://u:{MASK}@ch:8443/x"),  # a raw '@' in the password
        ("https://u:p%40ss@ch:8443/x", f"https://u:{MASK}@ch:8443/x"),
        (
            "chdb:///var/audit?password=pw&x=1 and https://h/a?access_token=t&X-Amz-Signature=s&sig=q&api_key=k",
            f"chdb:///var/audit?password={MASK}&x=1 and https://h/a?access_token={MASK}&X-Amz-Signature={MASK}"
            f"&sig={MASK}&api_key={MASK}",
        ),
        # Nothing secret: left as it was.
        (
            "http://ch:8123/db, user@host, a=b, ?monkey=1&keyboard=2",
            "http://ch:8123/db, user@host, a=b, ?monkey=1&keyboard=2",
        ),
        ("", ""),
    ],
)
def test_urls_lose_their_passwords_and_secret_parameters(text: str, expected: str) -> None:
    assert mask(text) == expected
    assert mask(expected) == expected


def test_remembered_secrets_are_masked_anywhere_raw_and_quoted() -> None:
    remember("tok-unit-4f1e9a", "p@ss:unit/77", None, "")
    assert mask("Bearer tok-unit-4f1e9a, p@ss:unit/77, p%40ss%3Aunit%2F77") == f"Bearer {MASK}, {MASK}, {MASK}"
    remember('q"uote\\unit')
    assert mask(json.dumps({"why": 'q"uote\\unit failed'})) == json.dumps({"why": f"{MASK} failed"})  # JSON-escaped
    # A URL's secrets are its password and secret query values; its host stays readable.
    remember("http://audit:url-pw-unit-3c@ch.unit:8123/db?token=qtok-unit-9d")
    assert mask("url-pw-unit-3c qtok-unit-9d ch.unit") == f"{MASK} {MASK} ch.unit"
    # Too short for free text (it would garble every word holding it), masked in a URL all the same.
    remember("ab1")
    assert mask("tab1e at http://u:ab1@h") == f"tab1e at http://u:{MASK}@h"
    assert mask("one-off-unit-value", extra=["one-off-unit-value", None]) == MASK


def test_a_log_record_is_masked_message_arguments_and_traceback() -> None:
    remember("log-secret-unit-8b")
    try:
        raise ValueError("driver said http://u:log-secret-unit-8b@h:1 refused")
    except ValueError:
        record = logging.LogRecord(
            "t", logging.ERROR, __file__, 1, "open %s: %s", ("x", "log-secret-unit-8b"), sys.exc_info()
        )
    _mask_record(record)
    text = logging.Formatter("%(message)s").format(record)
    assert "log-secret-unit-8b" not in text
    assert f"open x: {MASK}" in text and "ValueError: driver said http://u:" in text
    plain = logging.LogRecord("t", logging.INFO, __file__, 1, "nothing %s", ("here",), None)
    _mask_record(plain)
    assert (plain.msg, plain.args) == ("nothing %s", ("here",))  # untouched unless it held a secret


def test_settings_apply_masks_every_log_line_and_uncaught_traceback_of_the_process() -> None:
    code = (
        "import logging, os\n"
        "from trainmedic.settings import Settings, apply\n"
        "apply(Settings.load())\n"
        "logging.basicConfig(format='%(message)s')\n"
        "logging.getLogger('x').warning('token %s', os.environ['TRAINMEDIC_TOKEN'])\n"
        "try:\n"
        "    raise RuntimeError('at ' + os.environ['TRAINMEDIC_CLICKHOUSE_URL'])\n"
        "except RuntimeError:\n"
        "    logging.getLogger('x').exception('failed')\n"
        "raise RuntimeError('uncaught ' + os.environ['TRAINMEDIC_TOKEN'])\n"
    )
    env = {
        "TRAINMEDIC_TOKEN": "subprocess-token-5e2a9c",
        "TRAINMEDIC_CLICKHOUSE_URL": "http://audit:subprocess-pw-71@ch:8123/db",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 1
    assert "subprocess-token-5e2a9c" not in proc.stderr and "subprocess-pw-71" not in proc.stderr, proc.stderr
    assert f"token {MASK}" in proc.stderr and f"RuntimeError: uncaught {MASK}" in proc.stderr
    assert f"RuntimeError: at http://audit:{MASK}@ch:8123/db" in proc.stderr


def test_the_api_masks_every_error_body() -> None:
    remember("api-secret-unit-0d")
    app = mask_errors(FastAPI())

    @app.get("/fail")
    def fail() -> None:
        raise HTTPException(status_code=404, detail="no incident in chdb:///a?password=pw (api-secret-unit-0d)")

    @app.get("/typed")
    def typed(n: int) -> int:
        return n

    client = TestClient(app)
    got = client.get("/fail")
    assert got.status_code == 404 and got.json() == {"detail": f"no incident in chdb:///a?password={MASK} ({MASK})"}
    bad = client.get("/typed", params={"n": "api-secret-unit-0d"})
    assert bad.status_code == 422 and "api-secret-unit-0d" not in bad.text
    assert client.get("/nowhere").status_code == 404


def test_the_probe_listener_masks_metrics() -> None:
    from trainmedic.stack.metrics_server import MetricsServer

    gauge = Gauge("trainmedic_test_masking_info", "a label that quotes a URL", ["where"])
    gauge.labels(where="http://audit:metrics-pw-unit-2b@ch:8123").set(1)
    server = MetricsServer("127.0.0.1", 0).start()
    try:
        body = urllib.request.urlopen(server.url, timeout=10).read().decode()
    finally:
        server.stop()
        REGISTRY.unregister(gauge)
    assert f'where="http://audit:{MASK}@ch:8123"' in body and "metrics-pw-unit-2b" not in body


def test_config_show_masks_urls_of_settings_that_are_not_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from trainmedic.settings import provenance

    for name in [n for n in os.environ if n.startswith("TRAINMEDIC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TRAINMEDIC_API", "https://op:api-pw-unit-6@api.example:8477")
    monkeypatch.setenv("TRAINMEDIC_TOKEN", "config-token-unit-1f")
    shown = {name: value for name, value, _ in provenance(None)}
    assert shown["api"] == f"https://op:{MASK}@api.example:8477" and shown["token"] == MASK
