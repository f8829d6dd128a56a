"""Readiness scores predictions from the facts, and goodput shows what migrations saved (issue 44,
deliverable 3 and part of 4): sinks/prediction_audit.py on real chDB.

The audit rows are written through the sink's own row mapping; the expected fates and figures
are written out by hand from the scenario, not computed by the code under test."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas.events import (
    Action,
    ActionResult,
    Decision,
    Event,
    Evidence,
    Incident,
    Migration,
    MigrationState,
    NodeReturn,
)
from schemas.ids import current_cluster
from sinks.audit import AuditStore
from sinks.prediction_audit import migration_goodput, prediction_fates
from streams.policy import load_policy
from tests.integration.test_audit import insert_events
from trainmedic.ops.readiness import readiness

# The scenario is laid out back from the time of the run: the CLI and the console score at their own now.
NOW = float(int(time.time()))
HOUR = 3600.0
WINDOW_S = 24 * HOUR  # the default policy's readiness.expire_after_h


def predicted(
    name: str,
    t: float,
    node: str,
    *,
    job: str | None = None,
    rule: str = "row_remap_pending",
    nodes: int = 2,
    seen: float | None = None,
) -> Incident:
    """A predicted incident as streams/migration.py writes it: its verdict's rule in the evidence, the
    verdict's first_seen (`seen`, default 5 s before) as its first signal."""
    seen = t - 5 if seen is None else seen
    return Incident(
        event_id=name,
        event_time=t,
        incident_id=name,
        job_id=job or f"j-{name}",
        partition="gpu",
        job_nodes=[node] + [f"{node}-peer{i}" for i in range(1, nodes)],
        category="gpu_hardware",
        severity="warning",
        culprit_node=node,
        culprit_gpu=2,
        confidence=1.0,
        isolate=True,
        explanation="synthetic",
        evidence=[
            Evidence(
                source="gpu",
                provenance="gpu",
                signature=f"prefailure_{rule}",
                node=node,
                time=seen,
                line="remapped_rows_pending=True",
                role="root",
                gpu=2,
            )
        ],
        anomaly_ids=[],
        first_signal_time=seen,
        kind="predicted",
    )


def reactive(name: str, t: float, node: str, severity: str = "critical") -> Incident:
    return Incident(
        event_id=name,
        event_time=t,
        incident_id=name,
        job_id=f"j-{name}",
        partition="gpu",
        job_nodes=[node],
        category="gpu_hardware",
        severity=severity,  # type: ignore[arg-type]
        culprit_node=node,
        confidence=0.9,
        isolate=True,
        explanation="synthetic",
        evidence=[],
        anomaly_ids=[],
        first_signal_time=t - 1,
    )


def decision(inc: Incident, executed: bool) -> Decision:
    return Decision(
        event_id=f"dec-{inc.incident_id}",
        event_time=inc.event_time + 0.01,
        decision_id=f"dec-{inc.incident_id}",
        incident_id=inc.incident_id,
        job_id=inc.job_id,
        partition="gpu",
        category="gpu_hardware",
        culprit_node=inc.culprit_node,
        action="drain",
        mode="autonomous" if executed else "monitor",
        executed=executed,
        rule="prediction",
        reason="synthetic",
        first_signal_time=inc.first_signal_time,
        incident_time=inc.event_time,
    )


def drained(inc: Incident, after_s: float = 10.0) -> list[Event]:
    """The predictive drain of the incident's node, done `after_s` after the incident."""
    iid, node, t = inc.incident_id, inc.culprit_node, inc.event_time
    common = {"incident_id": iid, "job_id": inc.job_id, "node": node, "action": "drain"}
    return [
        decision(inc, executed=True),
        Action(
            event_id=f"act-{iid}",
            event_time=t + 0.02,
            action_id=f"act-{iid}",
            decision_id=f"dec-{iid}",
            partition="gpu",
            reason="synthetic",
            requested_by="policy",
            incident_time=t,
            first_signal_time=inc.first_signal_time,
            predicted=True,
            **common,  # type: ignore[arg-type]
        ),
        ActionResult(
            event_id=f"res-{iid}",
            event_time=t + after_s,
            action_id=f"act-{iid}",
            status="done",
            backend="simulated",
            steps=["synthetic"],
            started_at=t + 0.03,
            verified_at=t + after_s,
            incident_time=t,
            first_signal_time=inc.first_signal_time,
            **common,  # type: ignore[arg-type]
        ),
    ]


def returned(inc: Incident, t: float, passed: bool | None, outcome: str = "resumed") -> NodeReturn:
    return NodeReturn(
        event_id=f"ret-{inc.incident_id}-{t}",
        event_time=t,
        node=inc.culprit_node or "",
        incident_id=inc.incident_id,
        drain_reason=f"trainmedic {inc.incident_id}: gpu_hardware",
        operator="auto-return",
        outcome=outcome,  # type: ignore[arg-type]
        check=None if passed is None else "dcgmi diag -r 2",
        check_passed=passed,
    )


def migration(inc: Incident, state: MigrationState, t: float, step: int | None = None) -> Migration:
    return Migration(
        event_id=f"mig-{inc.incident_id}-{state}",
        event_time=t,
        migration_id=f"mig-{inc.incident_id}",
        incident_id=inc.incident_id,
        decision_id=f"dec-{inc.incident_id}",
        job_id=inc.job_id or "",
        node=inc.culprit_node or "",
        gpu=2,
        rule="row_remap_pending",
        state=state,
        decided_at=inc.event_time,
        deadline=inc.event_time + HOUR,
        checkpoint_before=400,
        checkpoint_step=step,
        requested_by="policy",
    )


T = NOW - 5 * 24 * HOUR
# Acted: drained, and the health check before the return found the fault.
FOUND = predicted("p-found", T, "gpu01")
# Acted: drained (verified 10 s later), returned 2 h later with a passing check.
HEALTHY = predicted("p-healthy", T + 100, "gpu02")
# Monitor mode, one verdict about gpu03 running two jobs (one incident each): the failure came 3 h later.
FAILED_A = predicted("p-failed-a", T + 200, "gpu03", job="j-a")
FAILED_B = predicted("p-failed-b", T + 200.5, "gpu03", job="j-b", seen=FAILED_A.first_signal_time)
# Monitor mode, no failure within the window (another rule).
QUIET = predicted("p-quiet", T + 300, "gpu04", rule="ecc_sbe_rate")
# Monitor mode, its failure 30 h later: past the 24 h window.
LATE = predicted("p-late", T + 400, "gpu05")
# Monitor mode, recent: only a warning about the node and a failure of another node since: pending.
RECENT = predicted("p-recent", NOW - HOUR, "gpu06")
# Acted, old, never returned: a drained GPU has no chance to fail, so the window alone never makes it false.
HELD = predicted("p-held", T + 500, "gpu07")
# Acted and migrated: its job requeued at the next checkpoint 10 min after the verdict.
MOVED = predicted("p-moved", T + 600, "gpu08")
# Acted, its migration fell back (no checkpoint within the bound).
FELL = predicted("p-fell", T + 700, "gpu09")


def scenario() -> list[Event]:
    events: list[Event] = [FOUND, HEALTHY, FAILED_A, FAILED_B, QUIET, LATE, RECENT, HELD, MOVED, FELL]
    events += drained(FOUND) + [returned(FOUND, T + HOUR, passed=False, outcome="refused")]
    events += drained(HEALTHY) + [returned(HEALTHY, HEALTHY.event_time + 2 * HOUR, passed=True)]
    for inc in (FAILED_A, FAILED_B, QUIET, LATE, RECENT):
        events.append(decision(inc, executed=False))
    events.append(reactive("r-gpu03", FAILED_A.event_time + 3 * HOUR, "gpu03"))
    events.append(reactive("r-gpu05", LATE.event_time + 30 * HOUR, "gpu05"))
    events.append(reactive("r-gpu06-warn", RECENT.event_time + 60, "gpu06", severity="warning"))
    events.append(reactive("r-gpu99", RECENT.event_time + 60, "gpu99"))
    events += drained(HELD) + drained(MOVED) + drained(FELL)
    events += [
        migration(MOVED, "waiting", MOVED.event_time + 1),
        migration(MOVED, "requeued", MOVED.event_time + 600, 500),
    ]
    events += [migration(FELL, "waiting", FELL.event_time + 1), migration(FELL, "fell_back", FELL.event_time + HOUR)]
    return events


@pytest.fixture
def store(chdb_url: str, database: str) -> Iterator[AuditStore]:
    s = AuditStore(chdb_url, database)
    s.migrate()
    insert_events(s, scenario())
    yield s
    s.close()


def test_each_prediction_is_scored_by_the_facts(store: AuditStore) -> None:
    rows = prediction_fates(store, NOW - 30 * 24 * HOUR, WINDOW_S, current_cluster(), now=NOW)
    # gpu03's two incidents (two jobs on the node) are one verdict, scored once.
    assert sorted(rows[2]["ids"]) == ["p-failed-a", "p-failed-b"] and len(rows) == 9
    assert {r["node"]: (r["fate"], r["basis"]) for r in rows} == {
        "gpu01": ("true", "repair hand-off"),
        "gpu02": ("false", "returned healthy"),
        "gpu03": ("true", "failure followed"),
        "gpu04": ("false", "no failure in window"),
        "gpu05": ("false", "no failure in window"),
        "gpu06": ("pending", "pending"),
        "gpu07": ("pending", "pending"),
        "gpu08": ("pending", "pending"),
        "gpu09": ("pending", "pending"),
    }


def test_readiness_has_a_row_per_rule_and_keeps_predictions_out_of_the_category(store: AuditStore) -> None:
    scores = {(s.category, s.partition): s for s in readiness(store, load_policy(), NOW - 30 * 24 * HOUR, now=NOW)}
    remap = scores[("predicted: row_remap_pending", None)]
    # 8 verdicts of this rule (gpu03's two incidents are one): true gpu01, gpu03; false gpu02, gpu05.
    assert (remap.recommendations, remap.confirmed, remap.refuted, remap.open) == (8, 2, 2, 4)
    assert remap.precision == pytest.approx(0.5)
    assert remap.bases == {"repair hand-off": 1, "failure followed": 1, "returned healthy": 1,
                           "no failure in window": 1, "pending": 4}  # fmt: skip
    ecc = scores[("predicted: ecc_sbe_rate", None)]
    assert (ecc.recommendations, ecc.confirmed, ecc.refuted, ecc.precision) == (1, 0, 1, 0.0)
    # The monitor-mode predictions are recommendations of gpu_hardware, but not the category's.
    assert scores[("gpu_hardware", None)].recommendations == 0


def test_goodput_saved_by_migration_and_false_drains(store: AuditStore) -> None:
    g = migration_goodput(store, NOW - 30 * 24 * HOUR, WINDOW_S, current_cluster(), now=NOW)
    # Only the requeued migration saved anything; the fell_back one is not there.
    assert [m["migration_id"] for m in g["migrations"]] == ["mig-p-moved"]
    m = g["migrations"][0]
    # 2 nodes x 8 GPUs x (600 s from the decision to the requeue + 30 s detection).
    assert (m["gpus"], m["work_s"], m["checkpoint_step"]) == (16, pytest.approx(600.0), 500)
    assert g["gpu_hours_saved"] == pytest.approx(16 * 630 / 3600)
    # gpu02's drain, verified 10 s after its incident, held it until it returned 2 h after the incident.
    assert g["false_predictions_drained"] == 1
    assert g["false_drain_node_hours"] == pytest.approx((2 * HOUR - 10) / 3600)
    # One cluster's rows, or every cluster's (None).
    assert migration_goodput(store, None, WINDOW_S, "another", now=NOW)["migrations_requeued"] == 0
    assert migration_goodput(store, None, WINDOW_S, None, now=NOW)["false_predictions_drained"] == 1
    # The job filter.
    fell = migration_goodput(store, None, WINDOW_S, current_cluster(), job="j-p-fell", now=NOW)
    assert fell["migrations"] == [] and fell["false_drains"] == []
    healthy = migration_goodput(store, None, WINDOW_S, current_cluster(), job="j-p-healthy", now=NOW)
    assert healthy["migrations"] == [] and [d["node"] for d in healthy["false_drains"]] == ["gpu02"]


def test_cli_goodput_shows_saved_by_migration(store: AuditStore, chdb_url: str) -> None:
    from trainmedic.cli.main import app

    store.close()
    args = ["audit", "goodput", "--since", "3650d", "--clickhouse", chdb_url, "--database", store.database]
    out = CliRunner().invoke(app, args, catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "saved by migration" in out.output
    data = json.loads(CliRunner().invoke(app, [*args, "--json"], catch_exceptions=False).output)
    saved = data["saved_by_migration"]
    assert saved["migrations_requeued"] == 1 and saved["gpu_hours_saved"] == pytest.approx(16 * 630 / 3600)
    assert timedelta(seconds=saved["assumptions"]["window_s"]) == timedelta(hours=24)


def test_console_goodput_route_shows_saved_by_migration(store: AuditStore) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from trainmedic.web.console.routes import console_router

    app = FastAPI()
    # The API passes the policy's window (readiness.expire_after_h); the answer says which one scored.
    app.include_router(console_router(store, "tok", None, prediction_window_s=lambda: HOUR))
    with TestClient(app) as client:
        r = client.get("/api/goodput", params={"since": "30d"}, headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200, r.text
    saved = r.json()["saved_by_migration"]
    assert [m["job_id"] for m in saved["migrations"]] == ["j-p-moved"]
    assert saved["gpu_hours_saved"] == pytest.approx(16 * 630 / 3600)
    assert saved["false_predictions_drained"] == 1 and saved["assumptions"]["window_s"] == HOUR


def test_cli_readiness_lists_predictions_per_rule(store: AuditStore, chdb_url: str, tmp_path: Path) -> None:
    from trainmedic.cli.main import app
    from trainmedic.cli.readiness import PREDICTED_PREFIX as CLI_PREFIX
    from trainmedic.ops.readiness import PREDICTED_PREFIX

    assert CLI_PREFIX == PREDICTED_PREFIX
    store.close()
    args = ["readiness", "--since", "3650d", "--data-dir", str(tmp_path), "--clickhouse", chdb_url]
    out = CliRunner().invoke(app, [*args, "--database", store.database], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    line = next(x for x in out.output.splitlines() if x.startswith("row_remap_pending"))
    # 8 verdicts, 2 true, 2 false, 4 pending, precision 50%: too few samples for a verdict.
    assert line.split()[1:6] == ["8", "2", "2", "4", "50%"] and "not_yet" in line
    assert "1 repair hand-off" in line and "1 returned healthy" in line
