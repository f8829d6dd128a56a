"""The same loop against a real Apache Kafka and a real ClickHouse server in containers.

These run where a Docker engine answers (testcontainers) and are skipped with that
reason otherwise; on these machines the identical tests run on Tansu and chDB
(test_pipeline.py, test_audit_migration.py). Only the addresses differ.

The server image is pinned to the ClickHouse release the audit DDL is written for
(docs/audit.md, "Server versions"): the current LTS.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.admin import ensure_topics
from sinks.audit import AuditStore
from sinks.backends.simulated import SimulatedScheduler
from tests.integration.scenario import NODES, incidents_of, publish_cascade, running_stack, wait_incident


def _docker_answers() -> str | None:
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env(timeout=3).ping()
    except Exception as exc:  # any failure means: no engine to run containers on
        return f"no Docker engine answers ({type(exc).__name__}: {str(exc)[:120]})"
    return None


_NO_DOCKER = _docker_answers()
CLICKHOUSE_IMAGE = "clickhouse/clickhouse-server:25.8"  # an LTS release; docs/audit.md "Server versions"
pytestmark = pytest.mark.skipif(_NO_DOCKER is not None, reason=_NO_DOCKER or "")


@pytest.fixture(scope="module")
def kafka_bootstrap() -> Iterator[str]:
    from testcontainers.kafka import KafkaContainer  # type: ignore[import-untyped]

    with KafkaContainer() as kafka:
        bootstrap = kafka.get_bootstrap_server()
        ensure_topics(bootstrap)
        yield bootstrap


@pytest.fixture(scope="module")
def clickhouse_url() -> Iterator[str]:
    from testcontainers.clickhouse import ClickHouseContainer  # type: ignore[import-untyped]

    with ClickHouseContainer(CLICKHOUSE_IMAGE) as ch:
        host, port = ch.get_container_host_ip(), ch.get_exposed_port(8123)
        yield f"http://{ch.username}:{ch.password}@{host}:{port}"


def test_xid79_cascade_on_real_kafka_and_clickhouse(kafka_bootstrap: str, clickhouse_url: str, tmp_path: Path) -> None:
    sched = SimulatedScheduler(NODES + ["gpu05"], requeue_delay_s=0.5)
    job = sched.submit("train", 4)
    with running_stack(kafka_bootstrap, clickhouse_url, "tm_containers", sched, "autonomous", tmp_path) as stack:
        assert stack.store is not None
        publish_cascade(kafka_bootstrap, tmp_path, job, NODES, culprit="gpu02")
        inc = wait_incident(stack.store, job, timeout=120)
        assert (inc["culprit_node"], inc["category"]) == ("gpu02", "gpu_hardware")
        assert len(incidents_of(stack.store, job)) == 1


def test_layout_migration_on_a_real_clickhouse_server(clickhouse_url: str, tmp_path: Path) -> None:
    """Migrations 001-005, rows, then the layout migration on a server: every row kept, idempotent."""
    import time

    from sinks.audit_schema import BY_NAME, LayoutSettings
    from tests.integration.test_audit_migration import _contents, _events, _insert_old, _old_layout

    store = AuditStore(clickhouse_url, "tm_layout", LayoutSettings())
    try:
        store._command("DROP DATABASE IF EXISTS tm_layout")
        (engine,) = store.query("SELECT version() AS v")
        _old_layout(store, tmp_path)
        _insert_old(store, _events(time.time() - 86400))
        before = _contents(store)
        store.migrate()
        assert _contents(store) == before, engine
        assert all(store.layout_matches(t) for t in BY_NAME.values())
        assert store.migrate() == []
        db_engine = store.query("SELECT engine FROM system.databases WHERE name = 'tm_layout'")[0]["engine"]
        assert db_engine == "Atomic"  # EXCHANGE TABLES needs it; the server's default since 20.10
    finally:
        store.close()
