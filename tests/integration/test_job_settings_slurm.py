"""Per-job settings from `sbatch --comment` on the REAL Slurm 22.05 and 24.11 clusters (#20 item 7).

The job's Comment travels the real path: squeue -> the Slurm producer -> sched.events -> the
streams worker's attribution -> the incident -> policy. The Xid 79 cascade of
tests/integration/scenario.py is the fault; the stack runs autonomous.

- `trainmedic=off`: the job is never touched (not requeued, its Comment unchanged); the node whose
  own kernel log reported the Xid is still drained - it would fail the next job placed on it.
- No setting, only the owner's notes: the job is drained-and-requeued as the policy says, and the
  executor's mark goes beside the owner's text in the Comment instead of replacing it.

Every test starts and ends with no job of root's and gpu01..gpu04 idle, undrained.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.publish import Publisher
from producers.slurm import SlurmProducer
from sinks.audit import AuditStore
from sinks.backends.slurm_cli import SlurmCliBackend
from tests.conftest import Cluster, wait_for
from tests.integration.scenario import NODES, publish_cascade, running_stack, wait_incident
from tests.integration.test_slurm_coexistence import _clean, _sh
from trainmedic.stack.broker import EmbeddedBroker

pytestmark = pytest.mark.slurm


@pytest.fixture
def cluster(slurm_any: Cluster) -> Iterator[Cluster]:
    _clean(slurm_any)
    yield slurm_any
    _clean(slurm_any)


def _submit_and_publish(cluster: Cluster, bootstrap: str, comment: str, state: Path) -> str:
    """A 4-node job with `comment`, seen RUNNING by the Slurm producer, its events on the bus."""
    backend = SlurmCliBackend(cluster.runner())
    publisher = Publisher(bootstrap, "test-slurm-producer")
    producer = SlurmProducer(publisher, runner=cluster.runner(), interval_s=1.0, state_path=state)
    try:
        producer.poll_once()  # cold start: the baseline
        out = _sh(
            cluster,
            "sbatch",
            "--parsable",
            "--hold",
            "--nodes=3-4",
            "--requeue",
            "--job-name=train",
            f"--comment={comment}",
            "--output=/dev/null",
            "--wrap",
            "sleep 600",
        )
        job = out.strip().split(";")[0]
        seen = producer.poll_once()
        _sh(cluster, "scontrol", "release", job)
        wait_for(
            f"job {job} RUNNING on 4 nodes",
            lambda: (s := backend.job_state(job)).state == "RUNNING" and len(s.nodes) == 4,
            timeout=60,
        )

        def running() -> bool:
            seen.extend(producer.poll_once())
            return any(e.job_id == job and e.state == "RUNNING" for e in seen)

        wait_for(f"the producer's RUNNING event of job {job}", running, timeout=30, interval=0.5)
        event = next(e for e in seen if e.job_id == job and e.state == "RUNNING")
        assert event.comment == comment
        assert publisher.flush(10) == 0
    finally:
        publisher.close()
    return job


def _result(store: AuditStore, incident_id: str) -> dict[str, object]:
    return wait_for(
        "the action result",
        lambda: store.query(
            "SELECT * FROM {db}.action_results FINAL WHERE incident_id = {i:String}", {"i": incident_id}
        ),
        timeout=120,
    )[0]


def test_trainmedic_off_in_the_comment_leaves_the_job_alone_and_drains_only_the_faulty_node(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    backend = SlurmCliBackend(cluster.runner())
    comment = "exp42 trainmedic=off"
    # Published before the stack starts: the worker takes the job states back before it judges anything.
    job = _submit_and_publish(cluster, broker.bootstrap, comment, tmp_path / "producer.json")
    before = backend.job_state(job)
    with running_stack(broker.bootstrap, chdb_url, database, backend, "autonomous", tmp_path / "stack") as stack:
        store = stack.store
        assert store is not None
        publish_cascade(broker.bootstrap, tmp_path, job, NODES, culprit="gpu02")
        inc = wait_incident(store, job)
        assert inc["job_comment"] == comment
        result = _result(store, str(inc["incident_id"]))
        assert (result["action"], result["status"]) == ("drain", "done"), result
        decision = store.query(
            "SELECT * FROM {db}.decisions FINAL WHERE incident_id = {i:String}", {"i": inc["incident_id"]}
        )[0]
        assert "trainmedic=off by the job's comment" in str(decision["rule"])
        assert f"job {job} is not requeued" in str(decision["reason"])
    node = backend.node_state("gpu02")
    assert node.drained and str(inc["incident_id"]) in (node.reason or "")
    after = backend.job_state(job)
    assert (after.state, after.nodes, after.restart_count, after.comment) == (
        "RUNNING",
        before.nodes,
        before.restart_count,
        comment,
    )
    assert "gpu02" in after.nodes and "gpu02" not in after.excluded_nodes


def test_the_executor_keeps_the_owners_comment_when_it_requeues(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    backend = SlurmCliBackend(cluster.runner())
    comment = "exp42 owner-note ticket=ML-1234"
    job = _submit_and_publish(cluster, broker.bootstrap, comment, tmp_path / "producer.json")
    with running_stack(broker.bootstrap, chdb_url, database, backend, "autonomous", tmp_path / "stack") as stack:
        store = stack.store
        assert store is not None
        publish_cascade(broker.bootstrap, tmp_path, job, NODES, culprit="gpu02")
        inc = wait_incident(store, job)
        result = _result(store, str(inc["incident_id"]))
        assert (result["action"], result["status"]) == ("drain_and_requeue", "done"), result
    after = backend.job_state(job)
    assert after.state == "RUNNING" and "gpu02" not in after.nodes and after.restart_count >= 1
    assert after.comment is not None and after.comment.startswith(comment + " | trainmedic act-"), after.comment
    assert after.comment.endswith(" restarts=0")
