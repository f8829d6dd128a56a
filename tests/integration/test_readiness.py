"""Autonomy readiness on the real broker and chDB: labels flow into the report, promotion
is refused below the threshold and allowed above it (audited both times), and a replay
under a stricter policy reports exactly the decisions that change, executing nothing."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from bus.publish import Publisher
from producers.kernel import KernelLogProducer
from sinks.backends.simulated import SimulatedScheduler
from sinks.backends.slurm_cli import SlurmCliBackend
from streams.policy import DEFAULT_POLICY, parse_policy
from tests.conftest import Cluster, wait_for
from tests.integration.scenario import xid79_line
from trainmedic.cli.client import ClientError, call
from trainmedic.ops.replay import replay
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig

NODES = [f"gpu{i:02d}" for i in range(1, 9)]


def _policy(tmp_path: Path, extra: str = "") -> Path:
    text = DEFAULT_POLICY.read_text()
    text = text.replace("min_samples: 10", "min_samples: 3").replace("min_precision: 0.9", "min_precision: 0.7")
    text = text.replace("max_drains_per_window: 2", "max_drains_per_window: 10")
    text = text.replace("max_drain_fraction: 0.1", "max_drain_fraction: 1.0")
    path = tmp_path / "policy.yaml"
    path.write_text(text + extra)
    return path


def _xid_on(bootstrap: str, tmp_path: Path, node: str) -> None:
    pub = Publisher(bootstrap, "test")
    kern = tmp_path / "kern" / node / "kern.log"
    kern.parent.mkdir(parents=True, exist_ok=True)
    kern.write_text(xid79_line(node) + "\n")
    KernelLogProducer(pub, kern, node=node, from_start=True).poll_once()
    assert pub.flush(10) == 0


def test_labels_flow_into_readiness_and_gate_promotion(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.1)
    jobs = {n: sched.submit(f"train-{n}", 1) for n in NODES[:4]}  # one single-node job per node
    stack = Stack(
        StackConfig(
            data_dir=tmp_path,
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            policy=_policy(tmp_path),
            api_port=0,
            settle_s=0.5,
        ),
        sched,
    ).start()
    try:
        store, api = stack.store, stack.api
        assert store is not None and api is not None
        token = (tmp_path / "api-token").read_text().strip()
        for node in jobs:
            _xid_on(broker.bootstrap, tmp_path, node)

        def recommendations() -> list[dict[str, object]] | None:
            rows = store.query(
                "SELECT decision_id, culprit_node FROM {db}.decisions FINAL WHERE kind = 'recommendation' "
                "ORDER BY culprit_node"
            )
            return rows if len(rows) == 4 else None

        recs = wait_for("4 recommendations", recommendations)
        ids = [r["decision_id"] for r in recs]

        def promote(force: bool = False) -> dict[str, object]:
            return call(
                api.url,
                token,
                "POST",
                "/api/modes",
                {  # type: ignore[no-any-return]
                    "mode": "autonomous",
                    "category": "gpu_hardware",
                    "operator": "alice",
                    "reason": "go",
                    "force": force,
                },
            )

        with pytest.raises(ClientError, match="too few samples: 0 decided, need 3"):
            promote()
        call(api.url, token, "POST", f"/api/recommendations/{ids[0]}/approve", {"operator": "alice"})
        call(
            api.url, token, "POST", f"/api/recommendations/{ids[1]}/reject", {"operator": "bob", "reason": "wrong_node"}
        )
        call(
            api.url,
            token,
            "POST",
            f"/api/recommendations/{ids[2]}/label",
            {"verdict": "confirmed", "operator": "carol", "comment": "RMA 1234"},
        )
        rows = wait_for(
            "the labels in the audit",
            lambda: (
                (r := call(api.url, token, "GET", "/api/readiness"))
                and next(
                    (s for s in r if s["category"] == "gpu_hardware" and s["partition"] is None and s["decided"] == 3),
                    None,
                )
            ),
        )
        assert (rows["approved"], rows["rejected"], rows["confirmed"], rows["open"]) == (1, 1, 1, 1)
        assert rows["rejected_reasons"] == {"wrong_node": 1}
        assert rows["precision"] == pytest.approx(2 / 3) and rows["verdict"] == "not_yet"
        assert "precision 67% below 70%" in " ".join(rows["missing"])
        with pytest.raises(ClientError, match="precision 67% below 70%"):
            promote()
        call(api.url, token, "POST", f"/api/recommendations/{ids[3]}/approve", {"operator": "alice"})
        wait_for(
            "the fourth verdict",
            lambda: (
                next(
                    s
                    for s in call(api.url, token, "GET", "/api/readiness")
                    if s["category"] == "gpu_hardware" and s["partition"] is None
                )["decided"]
                == 4
            ),
        )
        assert promote()["new_mode"] == "autonomous"

        def mode_changes() -> list[dict[str, object]] | None:
            rows = store.query("SELECT outcome, forced, readiness FROM {db}.mode_changes FINAL ORDER BY event_time")
            return rows if len(rows) == 3 else None

        changes = wait_for("3 mode changes in the audit", mode_changes)
        assert [c["outcome"] for c in changes] == ["refused", "refused", "applied"]
        assert all(c["readiness"].startswith("gpu_hardware:") for c in changes) and not changes[2]["forced"]
    finally:
        stack.stop()


@pytest.mark.slurm
def test_replay_with_stricter_policy_reports_exact_changes_and_executes_nothing(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path, slurm_cluster: Cluster
) -> None:
    # A recorded run in autonomous mode on the simulated cluster.
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.1)
    for n in NODES[:3]:
        sched.submit(f"train-{n}", 1)
    start = time.time() - 1
    stack = Stack(
        StackConfig(
            data_dir=tmp_path,
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            policy=_policy(tmp_path),
            mode="autonomous",
            settle_s=0.5,
        ),
        sched,
    ).start()
    try:
        store = stack.store
        assert store is not None
        for node in NODES[:3]:
            _xid_on(broker.bootstrap, tmp_path, node)
        wait_for("3 action results", lambda: len(store.query("SELECT 1 FROM {db}.action_results FINAL")) == 3)
        recorded = store.query("SELECT incident_id FROM {db}.decisions FINAL WHERE kind = 'action'")
        calls_before = list(sched.calls)
        slurm = SlurmCliBackend(slurm_conf=slurm_cluster.slurm_conf)
        nodes_before = slurm.list_nodes()
        jobs_before = subprocess.run(
            ["squeue", "-h", "-o", "%i %T %N"],
            capture_output=True,
            text=True,
            env=slurm_cluster.env(),
            timeout=30,
            check=True,
        ).stdout
        stricter = parse_policy(_policy(tmp_path).read_text().replace("min_confidence: 0.6", "min_confidence: 0.99"))
        report = replay(store, stricter, since_s=start)
    finally:
        stack.stop()
    assert report["incidents"] == 3 and report["changed"] == 3
    assert {c["incident_id"] for c in report["changes"]} == {r["incident_id"] for r in recorded}
    assert all(c["actual"] == "action: drain_and_requeue" for c in report["changes"])
    assert all(c["replayed"] == "recommendation: drain_and_requeue" for c in report["changes"])
    assert report["actions_before"] == 3 and report["actions_after"] == 0 and report["gpu_hours_delta"] < 0
    assert sched.calls == calls_before  # the replay acted on nothing
    assert slurm.list_nodes() == nodes_before
    assert (
        subprocess.run(
            ["squeue", "-h", "-o", "%i %T %N"],
            capture_output=True,
            text=True,
            env=slurm_cluster.env(),
            timeout=30,
            check=True,
        ).stdout
        == jobs_before
    )
