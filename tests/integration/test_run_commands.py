"""`trainmedic run ...` and `trainmedic topics create` as real processes against the real broker
and chDB: each deployable started alone from its settings, until its /readyz says so."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from schemas.topics import ALL_TOPICS, DEFAULT_PARTITIONS
from tests.launch import probe, running, self_signed_certificate, start, stop, wait_ready
from trainmedic.stack.broker import EmbeddedBroker, free_port

TRAINMEDIC = str(Path(sys.executable).with_name("trainmedic"))


@pytest.fixture
def bare_broker() -> Iterator[EmbeddedBroker]:
    """A broker with no topics: `topics create` makes them."""
    b = EmbeddedBroker().start()
    yield b
    b.stop(grace_s=0)


def _env(bootstrap: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    env.update(TRAINMEDIC_BOOTSTRAP=bootstrap, TRAINMEDIC_METRICS_HOST="127.0.0.1", **extra)
    return env


def _tm(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TRAINMEDIC, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _probes(env: dict[str, str]) -> tuple[dict[str, str], str]:
    port = free_port()
    return dict(env, TRAINMEDIC_METRICS_PORT=str(port)), f"http://127.0.0.1:{port}"


def test_topics_create_makes_every_topic_once_and_refuses_another_partition_count(
    bare_broker: EmbeddedBroker,
) -> None:
    env = _env(bare_broker.bootstrap)
    first = _tm("topics", "create", env=env)
    assert first.returncode == 0, first.stderr
    assert f"created {len(ALL_TOPICS)}" in first.stdout
    again = _tm("topics", "create", env=env)
    assert again.returncode == 0 and "created 0" in again.stdout and f"already there {len(ALL_TOPICS)}" in again.stdout
    admin = AdminClient({"bootstrap.servers": bare_broker.bootstrap})
    topics = admin.list_topics(timeout=10).topics
    assert "mode.changes" in topics and all(
        len(topics[t].partitions) == DEFAULT_PARTITIONS for t in ("mode.changes", "incidents")
    )
    configs = {
        res.name: fut.result(10)
        for res, fut in admin.describe_configs(
            [ConfigResource("topic", "mode.changes"), ConfigResource("topic", "incidents")]
        ).items()
    }
    assert configs["mode.changes"]["retention.ms"].value == "-1"  # the modes are rebuilt from the whole topic
    assert configs["incidents"]["retention.ms"].value == str(168 * 3600 * 1000)
    mismatch = _tm("topics", "create", "--partitions", "8", env=env)
    assert mismatch.returncode == 2
    assert "another partition count" in mismatch.stderr and f"incidents ({DEFAULT_PARTITIONS})" in mismatch.stderr
    short = _tm("topics", "create", "--retention-hours", "2", env=env)
    assert short.returncode == 2 and "topic_retention_hours" in short.stderr


def test_a_deployable_without_kafka_or_clickhouse_says_which_setting(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    no_kafka = _tm("run", "executor", env=env)
    assert no_kafka.returncode == 2 and "TRAINMEDIC_BOOTSTRAP" in no_kafka.stderr
    b = EmbeddedBroker().start()
    try:
        no_ch = _tm("run", "audit-sink", env=_env(b.bootstrap))
        assert no_ch.returncode == 2 and "TRAINMEDIC_CLICKHOUSE_URL" in no_ch.stderr
    finally:
        b.stop(grace_s=0)


def test_streams_executor_and_audit_sink_start_alone_until_ready(broker: EmbeddedBroker, tmp_path: Path) -> None:
    base = _env(broker.bootstrap)
    env, url = _probes(dict(base, TRAINMEDIC_STREAMS_DATA_DIR=str(tmp_path / "streams")))
    with running([TRAINMEDIC, "run", "streams"], env, tmp_path / "streams.log", f"{url}/readyz") as (_, ready):
        assert ready["loops"]["streams"]["why"] == "consuming"  # type: ignore[index]
        status, live = probe(f"{url}/healthz")
        assert status == 200 and live and live["live"]
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'trainmedic_loop_ready{loop="streams"} 1.0' in text and "trainmedic_build_info{" in text
        # The default policy's mode, as the worker decides by it (the operators' modes read whole).
        assert 'trainmedic_mode{mode="monitor",partition="*"} 1.0' in text
    assert (tmp_path / "streams").is_dir()  # Faust's tables live where the setting says

    env, url = _probes(base)
    with running(
        [TRAINMEDIC, "run", "executor", "--backend", "simulated"], env, tmp_path / "ex.log", f"{url}/readyz"
    ) as (
        _,
        ready,
    ):
        assert ready["loops"]["executor"]["why"] == "acting: holds the lease"  # type: ignore[index]

    # The audit sink waits, not ready, for a schema it does not create; then consumes.
    folder = tmp_path / "audit"
    env, url = _probes(dict(base, TRAINMEDIC_CLICKHOUSE_URL=f"chdb://{folder}"))
    sink = start([TRAINMEDIC, "run", "audit-sink"], env, tmp_path / "sink1.log")
    try:
        status, body = 0, None
        for _ in range(300):
            status, body = probe(f"{url}/readyz")
            # The loop registers as "starting" before its first look at the schema; wait for that look.
            schema = body["loops"].get("audit-schema") if body else None  # type: ignore[attr-defined,union-attr]
            if schema and schema["why"] != "starting":
                break
            assert sink.proc.poll() is None, sink.output()
            subprocess.run(["sleep", "0.2"])
        assert status == 503 and body is not None
        assert "trainmedic audit db migrate" in body["loops"]["audit-schema"]["why"]  # type: ignore[index]
    finally:
        assert stop(sink) == 0
    migrated = _tm("audit", "db", "migrate", env=dict(base, TRAINMEDIC_CLICKHOUSE_URL=f"chdb://{folder}"))
    assert migrated.returncode == 0, migrated.stderr
    # After a rollback the schema is ahead of the code: a migration this version does not know.
    future = (
        "from sinks.audit import AuditStore; import datetime; s = AuditStore(sys.argv[1]); "
        "s.insert('schema_migrations', [[999, 'future', 'x', datetime.datetime.now(datetime.UTC)]], "
        "['version', 'name', 'checksum', 'applied_at']); s.close()"
    )
    subprocess.run([sys.executable, "-c", f"import sys; {future}", f"chdb://{folder}"], check=True, timeout=120)
    with running([TRAINMEDIC, "run", "audit-sink"], env, tmp_path / "sink2.log", f"{url}/readyz") as (launched, ready):
        assert ready["loops"]["audit-sink"]["ready"]  # type: ignore[index]
    assert "newer than this trainmedic (999_future)" in launched.output()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate")
def test_the_api_alone_serves_tls_and_refuses_plaintext_off_loopback(broker: EmbeddedBroker, tmp_path: Path) -> None:
    folder = tmp_path / "audit"
    base = _env(broker.bootstrap, TRAINMEDIC_CLICKHOUSE_URL=f"chdb://{folder}")
    assert _tm("audit", "db", "migrate", env=base).returncode == 0
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    base |= {"TRAINMEDIC_TOKEN_FILE": str(token), "TRAINMEDIC_MODES_FILE": str(tmp_path / "state" / "modes.yaml")}
    base["TRAINMEDIC_SLURM_ACCESS"] = "local"

    plaintext = _tm("run", "api", "--backend", "simulated", env=dict(base, TRAINMEDIC_API_LISTEN="0.0.0.0:18477"))
    assert plaintext.returncode == 2 and "TRAINMEDIC_API_TLS_CERT" in plaintext.stderr
    no_token = _tm("run", "api", env={k: v for k, v in base.items() if k != "TRAINMEDIC_TOKEN_FILE"})
    assert no_token.returncode == 2 and "TRAINMEDIC_TOKEN" in no_token.stderr

    cert, key = self_signed_certificate(tmp_path)
    api_port = free_port()
    env, url = _probes(
        dict(
            base,
            TRAINMEDIC_API_LISTEN=f"127.0.0.1:{api_port}",
            TRAINMEDIC_API_TLS_CERT=str(cert),
            TRAINMEDIC_API_TLS_KEY=str(key),
        )
    )
    with running([TRAINMEDIC, "run", "api", "--backend", "simulated"], env, tmp_path / "api.log", f"{url}/readyz"):
        context = ssl.create_default_context(cafile=str(cert))
        req = urllib.request.Request(
            f"https://127.0.0.1:{api_port}/api/recommendations", headers={"Authorization": "Bearer " + "t" * 32}
        )
        with urllib.request.urlopen(req, context=context, timeout=10) as resp:
            assert resp.status == 200
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        # Nothing recommended yet: the family is there, with no partition pending.
        assert "trainmedic_recommendations_pending" in metrics


def test_ingest_alone_until_ready(broker: EmbeddedBroker, tmp_path: Path) -> None:
    token = tmp_path / "ingest-token"
    token.write_text("i" * 32 + "\n")
    env, url = _probes(_env(broker.bootstrap, TRAINMEDIC_INGEST_TOKEN_FILE=str(token)))
    port = free_port()
    launched = start([TRAINMEDIC, "run", "ingest", "--port", str(port)], env, tmp_path / "ingest.log")
    try:
        wait_ready(launched, f"{url}/readyz", timeout=60)
        status, _ = probe(f"http://127.0.0.1:{port}/healthz")
        assert status == 200
    finally:
        assert stop(launched) == 0
