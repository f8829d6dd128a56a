"""Two clusters in one audit database (issue 43): the operator queries and `trainmedic audit
--cluster` read one cluster's rows, on chDB with the migrated schema. Both clusters have a job 1
on a node gpu01, so a filter that missed one table would join the other cluster's rows in."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from typer.testing import CliRunner

from schemas.events import Event, SchedEvent
from schemas.ids import DEFAULT_CLUSTER, current_cluster, set_cluster
from sinks import audit_queries as q
from sinks.audit import AuditStore
from tests.integration.test_audit import incident_events, insert_events, operator_events
from trainmedic.cli.audit import audit_app

EAST, WEST = "gpu-east", "gpu-west"


def _made_in(cluster: str, make: list[Event]) -> list[Event]:
    return [e.model_copy(update={"cluster": cluster}) for e in make]


@pytest.fixture
def two_clusters(chdb_url: str, database: str) -> Iterator[AuditStore]:
    store = AuditStore(chdb_url, database)
    store.migrate()
    t0 = time.time() - 1800
    # East: incidents 0 and 1 of job 1 (one culprit gpu01), a stop on job 2. West: incident 5 of its own job 1.
    east = incident_events(0, t0, job="1", node="gpu01") + incident_events(1, t0 + 60, job="1", node="gpu01")
    east += incident_events(2, t0 + 90, job="2", node="gpu02", category="user_code", action="stop")
    east += operator_events(t0, "1", 0, "gpu01")
    west: list[Event] = incident_events(5, t0 + 30, job="1", node="gpu01", category="interconnect", detect_s=9.0)
    # West's job 1 runs again 20 s in: read for east's job 1, east's first incident would have ended then.
    west.append(SchedEvent(event_id="sched-west-1", event_time=t0 + 20, kind="job", job_id="1", state="RUNNING"))
    insert_events(store, _made_in(EAST, east) + _made_in(WEST, west))
    try:
        yield store
    finally:
        store.close()


def test_incidents_and_latency_read_one_cluster(two_clusters: AuditStore) -> None:
    day = timedelta(days=1)
    east = {r["incident_id"] for r in q.incidents(two_clusters, since=day, cluster=EAST)}
    assert east == {"inc-1-0", "inc-1-1", "inc-2-2"}
    (west,) = q.incidents(two_clusters, since=day, cluster=WEST)
    assert west["incident_id"] == "inc-1-5" and west["category"] == "interconnect"
    # The children (decision, results) are the west incident's own.
    assert west["decision_action"] == "drain_and_requeue" and west["actions_done"] == 1
    assert len(q.incidents(two_clusters, since=day)) == 4  # no cluster: every cluster's
    assert q.incidents(two_clusters, since=day, cluster="gpu-north") == []

    lat = q.latency(two_clusters, since=day, cluster=WEST)
    assert lat["overall"]["incidents"] == 1 and lat["overall"]["detection_p50"] == pytest.approx(9.0)
    assert q.latency(two_clusters, cluster=EAST)["overall"]["incidents"] == 3


def test_job_and_node_history_do_not_mix_clusters(two_clusters: AuditStore) -> None:
    east = q.job_timeline(two_clusters, "1", cluster=EAST)
    assert [i["incident_id"] for i in east["incidents"]] == ["inc-1-0", "inc-1-1"]
    assert {t["incident_id"] for t in east["timeline"] if t["incident_id"]} == {"inc-1-0", "inc-1-1"}
    west = q.job_timeline(two_clusters, "1", cluster=WEST)
    assert [i["incident_id"] for i in west["incidents"]] == ["inc-1-5"] and west["restarts"] == 1
    assert len(q.job_timeline(two_clusters, "1")["incidents"]) == 3

    node = q.node_history(two_clusters, "gpu01", cluster=WEST)
    assert node["incidents_blamed"] == 1 and {e["incident_id"] for e in node["events"]} == {"inc-1-5"}
    assert q.node_history(two_clusters, "gpu01", cluster=EAST)["incidents_blamed"] == 2


def test_goodput_reads_one_cluster(two_clusters: AuditStore) -> None:
    east = q.goodput(two_clusters, since=timedelta(days=1), cluster=EAST)
    west = q.goodput(two_clusters, since=timedelta(days=1), cluster=WEST)
    assert {i["incident_id"] for i in east["incidents"]} == {"inc-1-0", "inc-1-1", "inc-2-2"}
    assert [i["incident_id"] for i in west["incidents"]] == ["inc-1-5"]
    assert east["fleet"]["incidents"] + west["fleet"]["incidents"] == 4
    # Nothing of east's says job 1 ran again; west's RUNNING report is another job 1.
    basis = {i["incident_id"]: i["lost_basis"] for i in east["incidents"]}
    assert basis["inc-1-0"] == "still down" and east["fleet"]["incidents_running_again"] == 0
    assert q.goodput(two_clusters, since=timedelta(days=1))["fleet"]["incidents_running_again"] > 0


def test_cli_cluster_option_defaults_to_the_cluster_setting(
    two_clusters: AuditStore, chdb_url: str, database: str
) -> None:
    base = ["incidents", "--clickhouse", chdb_url, "--database", database, "--json"]

    def ids(*args: str, env: dict[str, str] | None = None) -> set[str]:
        result = CliRunner().invoke(audit_app, [*base, *args], env=env)
        assert result.exit_code == 0, result.output
        return {r["incident_id"] for r in json.loads(result.output)}

    assert ids("--cluster", WEST) == {"inc-1-5"}
    assert ids("--all-clusters") == {"inc-1-0", "inc-1-1", "inc-2-2", "inc-1-5"}
    # No --cluster: the cluster this installation serves (TRAINMEDIC_CLUSTER), none of the others.
    assert ids(env={"TRAINMEDIC_CLUSTER": EAST}) == {"inc-1-0", "inc-1-1", "inc-2-2"}
    assert ids() == set()  # the default cluster wrote nothing here
    assert current_cluster() == DEFAULT_CLUSTER

    # A job only the other cluster has: not found, saying which cluster was read.
    job = CliRunner().invoke(
        audit_app, ["job", "2", "--clickhouse", chdb_url, "--database", database, "--cluster", WEST]
    )
    assert job.exit_code != 0 and "for cluster gpu-west" in job.output
    both = CliRunner().invoke(audit_app, [*base, "--cluster", WEST, "--all-clusters"])
    assert both.exit_code == 2 and "not both" in both.output
    bad = CliRunner().invoke(audit_app, [*base, "--cluster", "West Coast"])
    assert bad.exit_code == 2 and "cluster name" in bad.output


def test_events_made_under_another_cluster_carry_it() -> None:
    # What the fixture's copies stand for: a process of that cluster makes its events so.
    set_cluster(WEST)
    try:
        (first, *_) = incident_events(0, time.time(), job="1", node="gpu01")
        assert first.cluster == WEST
    finally:
        set_cluster(DEFAULT_CLUSTER)
