"""The loop acting on the REAL local Slurm cluster (infra/slurm/start.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sinks.backends.slurm_cli import SlurmCliBackend
from tests.conftest import Cluster, slurm_cmd, wait_for
from tests.integration.scenario import NODES, publish_cascade, running_stack, wait_incident
from trainmedic.stack.broker import EmbeddedBroker

pytestmark = pytest.mark.slurm


@pytest.fixture
def training_job(slurm_cluster: Cluster, slurm: SlurmCliBackend) -> str:
    # 3-4 nodes: it gets all four now and can run on three once gpu02 is excluded.
    out = slurm_cmd(
        slurm_cluster,
        "sbatch",
        "--parsable",
        "--nodes=3-4",
        "--requeue",
        "--job-name=train",
        "--output=/dev/null",
        "--wrap",
        "sleep 600",
    )
    job = out.strip().split(";")[0]
    wait_for(
        f"job {job} RUNNING on 4 nodes",
        lambda: slurm.job_state(job).state == "RUNNING" and len(slurm.job_state(job).nodes) == 4,
        timeout=60,
    )
    return job


def test_monitor_mode_changes_nothing_in_slurm(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path, slurm: SlurmCliBackend, training_job: str
) -> None:
    before_job = slurm.job_state(training_job)
    before_nodes = {n: slurm.node_state(n) for n in NODES}
    with running_stack(broker.bootstrap, chdb_url, database, slurm, "monitor", tmp_path) as stack:
        assert stack.store is not None
        publish_cascade(broker.bootstrap, tmp_path, training_job, NODES, culprit="gpu02")
        inc = wait_incident(stack.store, training_job)
        decision = wait_for(
            "the recommendation",
            lambda: stack.store.query(  # type: ignore[union-attr]
                "SELECT * FROM {db}.decisions FINAL WHERE incident_id = {i:String}", {"i": inc["incident_id"]}
            ),
        )[0]
        assert (decision["kind"], decision["mode"], decision["action"]) == (
            "recommendation",
            "monitor",
            "drain_and_requeue",
        )
        assert stack.store.query("SELECT count() AS n FROM {db}.actions FINAL")[0]["n"] == 0
    after_job = slurm.job_state(training_job)
    assert (after_job.state, after_job.nodes, after_job.restart_count) == (
        "RUNNING",
        before_job.nodes,
        before_job.restart_count,
    )
    for n in NODES:
        after = slurm.node_state(n)
        assert (after.state, after.flags, after.reason) == (
            before_nodes[n].state,
            before_nodes[n].flags,
            before_nodes[n].reason,
        )


def test_autonomous_drains_culprit_and_requeues_elsewhere(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path, slurm: SlurmCliBackend, training_job: str
) -> None:
    with running_stack(broker.bootstrap, chdb_url, database, slurm, "autonomous", tmp_path) as stack:
        store = stack.store
        assert store is not None
        publish_cascade(broker.bootstrap, tmp_path, training_job, NODES, culprit="gpu02")
        inc = wait_incident(store, training_job)
        result = wait_for(
            "the action result",
            lambda: store.query(
                "SELECT * FROM {db}.action_results FINAL WHERE incident_id = {i:String}", {"i": inc["incident_id"]}
            ),
            timeout=120,
        )[0]
        assert result["status"] == "done", result
        assert result["backend"] == "slurm-cli"
        for table, key in (
            ("anomalies", "job_id"),
            ("incidents", "job_id"),
            ("decisions", "job_id"),
            ("actions", "job_id"),
            ("action_results", "job_id"),
        ):
            n = store.query(
                f"SELECT count() AS n FROM {{db}}.{table} FINAL WHERE {key} = {{j:String}}", {"j": training_job}
            )[0]["n"]
            assert n >= 1, f"no {table} row for job {training_job}"
    node = slurm.node_state("gpu02")
    assert node.drained and node.reason is not None and str(inc["incident_id"]) in node.reason
    job = slurm.job_state(training_job)
    assert job.state == "RUNNING" and "gpu02" not in job.nodes and "gpu02" in job.excluded_nodes
    assert job.restart_count >= 1
