"""Roles on the operator API of a real Stack: the read-only token sees everything an operator
sees and changes nothing; approvals, labels, mode changes and resumes need the operator token."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx

from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import wait_for
from tests.integration.scenario import NODES, publish_cascade, wait_incident
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig


def test_viewer_token_reads_but_only_the_operator_token_acts(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler([*NODES, "gpu05"], requeue_delay_s=0.2)
    job = sched.submit("train", 4)
    stack = Stack(
        StackConfig(
            data_dir=tmp_path,
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            mode="monitor",
            api_port=0,
        ),
        sched,
    ).start()
    try:
        assert stack.store is not None and stack.api is not None
        cfg = stack.config
        operator, viewer = cfg.token_file.read_text().strip(), cfg.viewer_token_file.read_text().strip()
        assert operator != viewer and len(viewer) >= 16
        assert stat.S_IMODE(cfg.viewer_token_file.stat().st_mode) == 0o600
        publish_cascade(broker.bootstrap, tmp_path, job, NODES, culprit="gpu02")
        wait_incident(stack.store, job)
        as_viewer = {"Authorization": f"Bearer {viewer}"}
        as_operator = {"Authorization": f"Bearer {operator}"}
        with httpx.Client(base_url=stack.api.url, timeout=30) as http:
            recs = wait_for(
                "the recommendation",
                lambda: [r for r in http.get("/api/recommendations", headers=as_viewer).json() if r["job_id"] == job],
            )
            decision = recs[0]["decision_id"]
            for path in ("/api/incidents", "/api/modes", "/api/nodes", "/api/readiness", "/api/console/status"):
                assert http.get(path, headers=as_viewer).status_code == 200, path

            refused = [
                http.post(f"/api/recommendations/{decision}/approve", json={"operator": "eve"}, headers=as_viewer),
                http.post(
                    f"/api/recommendations/{decision}/reject",
                    json={"operator": "eve", "reason": "not_a_fault"},
                    headers=as_viewer,
                ),
                http.post(
                    "/api/modes",
                    json={"partition": "gpu", "mode": "autonomous", "operator": "eve", "reason": "x", "force": True},
                    headers=as_viewer,
                ),
                http.post("/api/nodes/gpu02/resume", json={"operator": "eve"}, headers=as_viewer),
            ]
            for resp in refused:
                assert resp.status_code == 403, (resp.request.url, resp.status_code, resp.text)
                assert "operator role required" in resp.text
            assert sched.calls == []  # a viewer changed nothing

            approved = http.post(
                f"/api/recommendations/{decision}/approve", json={"operator": "alice"}, headers=as_operator
            )
            assert approved.status_code == 202, approved.text
        wait_for("the approved drain", lambda: "drain gpu02" in sched.calls)
        assert not stack.store.query("SELECT 1 FROM {db}.approvals FINAL WHERE operator = 'eve'")
    finally:
        stack.stop()
