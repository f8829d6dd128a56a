"""Issue 41 on the REAL Slurm 22.05 cluster and the real stack (autonomous): who could have written
a line decides what it may trigger.

(1) Two jobs each print one line naming one of their own nodes - srun's "Node failure on" and an
    NCCL InfiniBand port error with a host prefix. Job evidence restarts only the job that wrote
    it: both jobs are requeued, no node is drained, no drain is attempted (the drains per window
    stay unspent), and the real Xid 79 in a third job's node's kernel log right after is acted on.
(2) A job names a node outside it (no action); the real Xid 79 on its own node seconds later is not
    absorbed into that no-action incident: an incident of its own drains the node.
(3) On both Slurm versions: the node's slurmd stops answering, Slurm reports the node
    NOT_RESPONDING (then DOWN), and the job's srun line about it is corroborated: the node is
    drained, so it stays out of service when its slurmd answers again (Slurm would put it back).

The jobs' placements travel the real path (squeue -> the Slurm producer -> sched.events).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from bus.publish import Publisher
from producers.kernel import KernelLogProducer
from producers.slurm import SlurmProducer
from sinks.audit import AuditStore
from sinks.backends.slurm_cli import SlurmCliBackend
from tests.conftest import Cluster, slurm_cmd, wait_for, wait_placed
from tests.integration.scenario import incidents_of, publish_log_file, running_stack, xid79_line
from trainmedic.stack.broker import EmbeddedBroker

pytestmark = pytest.mark.slurm

NODES = ("gpu01", "gpu02", "gpu03", "gpu04")


def _jobs_running(cluster: Cluster, backend: SlurmCliBackend, bootstrap: str, state: Path, n: int) -> list[str]:
    """`n` one-node requeueable jobs, RUNNING, their RUNNING events published by the Slurm producer."""
    publisher = Publisher(bootstrap, "test-slurm-producer")
    producer = SlurmProducer(publisher, runner=cluster.runner(), interval_s=1.0, state_path=state)
    try:
        producer.poll_once()  # cold start: the baseline
        jobs = [
            slurm_cmd(
                cluster,
                "sbatch",
                "--parsable",
                "--nodes=1",
                "--exclusive",
                "--requeue",
                "--output=/dev/null",
                "--wrap",
                "sleep 600",
            )
            .strip()
            .split(";")[0]
            for _ in range(n)
        ]
        seen = []

        def running() -> bool:
            seen.extend(producer.poll_once())
            return all(any(e.job_id == j and e.state == "RUNNING" for e in seen) for j in jobs)

        wait_for(f"the producer's RUNNING events of jobs {jobs}", running, timeout=30, interval=0.5)
        assert publisher.flush(10) == 0
    finally:
        publisher.close()
    return jobs


def _decisions(store: AuditStore, job: str) -> list[dict[str, object]]:
    return store.query("SELECT * FROM {db}.decisions FINAL WHERE job_id = {j:String} ORDER BY event_time", {"j": job})


def _decision(store: AuditStore, job: str, n: int = 1) -> list[dict[str, object]]:
    return wait_for(
        f"{n} decision(s) of job {job}",
        lambda: (
            rows
            if len(
                rows := store.query(
                    "SELECT * FROM {db}.decisions FINAL WHERE job_id = {j:String} ORDER BY event_time", {"j": job}
                )
            )
            >= n
            else None
        ),
        # An upper bound, not a wait: the first decision also waits out the stack's start-up,
        # which took over 40 s on a loaded 2-core CI machine.
        timeout=90,
    )


def _kernel_xid(bootstrap: str, root: Path, node: str) -> None:
    kern = root / "nodes" / node / "kern.log"
    kern.parent.mkdir(parents=True, exist_ok=True)
    kern.write_text(xid79_line(node) + "\n")
    pub = Publisher(bootstrap, "test-kernel")
    KernelLogProducer(pub, kern, node=node, from_start=True).poll_once()
    assert pub.flush(10) == 0


def _log(bootstrap: str, root: Path, job: str, node: str, line: str) -> None:
    path = root / f"job-{job}.out"
    path.write_text(line + "\n")
    publish_log_file(bootstrap, job, path, [node])


def _excludes(backend: SlurmCliBackend, job: str, node: str) -> bool:
    return node in backend.job_state(job).excluded_nodes


def _drain_attempts(store: AuditStore) -> list[str]:
    rows = store.query("SELECT DISTINCT node FROM {db}.action_attempts WHERE call = 'drain'")
    return sorted(str(r["node"]) for r in rows)


@pytest.mark.slow(
    reason="three real Slurm jobs, a whole stack, and a real drain verified by slurmctld: 57 s on a loaded CI machine"
)
def test_job_lines_naming_their_own_nodes_drain_nothing_and_the_real_xid_that_follows_is_acted_on(
    broker: EmbeddedBroker, slurm_cluster: Cluster, slurm: SlurmCliBackend, chdb_url: str, database: str, tmp_path: Path
) -> None:
    a, b, c = _jobs_running(slurm_cluster, slurm, broker.bootstrap, tmp_path / "producer.json", 3)
    node = {j: slurm.job_state(j).nodes[0] for j in (a, b, c)}
    assert len(set(node.values())) == 3, node  # --exclusive: the Xid's node is no job line's
    with running_stack(broker.bootstrap, chdb_url, database, slurm, "autonomous", tmp_path / "stack") as stack:
        store = stack.store
        assert store is not None
        wait_placed(broker.bootstrap, (a, b, c))  # the placements first, as after the producer's snapshot
        _log(broker.bootstrap, tmp_path, a, node[a], f"srun: error: Node failure on {node[a]}")
        _log(
            broker.bootstrap,
            tmp_path,
            b,
            node[b],
            f"{node[b]}:815:864 [0] transport/net_ib.cu:80 NCCL WARN NET/IB : Got async event : port error",
        )
        for job in (a, b):
            (d,) = _decision(store, job)
            assert (d["action"], d["kind"]) == ("requeue", "action"), d
            assert "job evidence only" in str(d["rule"]) and f"isolating {node[job]} recommended" in str(d["reason"])
            (inc,) = incidents_of(store, job)
            assert inc["provenance"] == "job" and inc["isolate"] is True
            assert '"provenance":"job"' in str(inc["evidence"])
            # The restart keeps the job off the node its own output blamed (the node stays in service).
            wait_for(f"job {job} requeued without {node[job]}", partial(_excludes, slurm, job, node[job]), timeout=60)
        # Right after: a real Xid 79 in the third job's node's kernel log.
        _kernel_xid(broker.bootstrap, tmp_path, node[c])
        (d,) = _decision(store, c)
        assert (d["action"], d["kind"]) == ("drain_and_requeue", "action"), d
        wait_for(f"{node[c]} drained", lambda: slurm.node_state(node[c]).drained, timeout=40)
        (inc,) = incidents_of(store, c)
        assert inc["provenance"] == "kernel_file"  # read from a kern.log file
        assert store.query("SELECT count() AS n FROM {db}.guardrail_trips")[0]["n"] == 0
        # Only the Xid's node was ever attempted: the job lines spent none of the drains per window.
        # (The attempt reaches the audit through its sink, after slurmctld shows the drain.)
        assert wait_for("the drain attempt in the audit", lambda: _drain_attempts(store) or None, timeout=30) == [
            node[c]
        ]
    assert not slurm.node_state(node[a]).drained and not slurm.node_state(node[b]).drained


def test_a_no_action_incident_does_not_absorb_a_later_kernel_xid_on_the_jobs_node(
    broker: EmbeddedBroker, slurm_cluster: Cluster, slurm: SlurmCliBackend, chdb_url: str, database: str, tmp_path: Path
) -> None:
    (job,) = _jobs_running(slurm_cluster, slurm, broker.bootstrap, tmp_path / "producer.json", 1)
    own = slurm.job_state(job).nodes[0]
    with running_stack(broker.bootstrap, chdb_url, database, slurm, "autonomous", tmp_path / "stack") as stack:
        store = stack.store
        assert store is not None
        wait_placed(broker.bootstrap, (job,))
        _log(broker.bootstrap, tmp_path, job, own, "srun: error: Node failure on gpu06")
        (first,) = _decision(store, job)
        assert first["action"] == "none" and "culprit outside the job" in str(first["rule"])
        _kernel_xid(broker.bootstrap, tmp_path, own)
        second = _decision(store, job, 2)[1]
        assert (second["action"], second["kind"], second["culprit_node"]) == ("drain_and_requeue", "action", own)
        assert len(incidents_of(store, job)) == 2
        wait_for(f"{own} drained", lambda: slurm.node_state(own).drained, timeout=40)


def _slurmd_pids(cluster: Cluster) -> dict[str, int]:
    """Each emulated node's slurmd, by the pid files the start scripts keep (24.11's in its data dir)."""
    run = cluster.state_dir / ("data/run" if cluster.version == "24.11" else "run")
    return {n: int((run / f"slurmd-{n}.pid").read_text().strip()) for n in NODES}


def _reset(cluster: Cluster, backend: SlurmCliBackend) -> None:
    """No jobs; every node answering, undrained and idle."""
    for pid in _slurmd_pids(cluster).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    slurm_cmd(cluster, "scancel", "--user", "root")
    for node in NODES:
        s = backend.node_state(node)
        if s.drained or s.state == "DOWN":
            backend.resume_node(node)
    wait_for(
        "all nodes idle and unflagged",
        lambda: all((s := backend.node_state(n)).state == "IDLE" and not s.flags for n in NODES),
        timeout=90,
    )


@pytest.fixture
def any_slurm(slurm_any: Cluster) -> Iterator[tuple[Cluster, SlurmCliBackend]]:
    backend = SlurmCliBackend(slurm_any.runner())
    _reset(slurm_any, backend)
    try:
        yield slurm_any, backend
    finally:
        _reset(slurm_any, backend)


@contextlib.contextmanager
def _slurm_producer(cluster: Cluster, bootstrap: str, state: Path) -> Iterator[None]:
    """The Slurm producer polling as deployed, so node state changes travel the real path."""
    publisher = Publisher(bootstrap, "test-slurm-producer")
    producer = SlurmProducer(publisher, runner=cluster.runner(), interval_s=1.0, state_path=state)
    stop = threading.Event()
    thread = threading.Thread(target=producer.run, args=(stop,), name="slurm-producer", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
        publisher.close()


def test_a_jobs_node_failure_line_drains_the_node_slurm_reports_not_responding(
    broker: EmbeddedBroker, any_slurm: tuple[Cluster, SlurmCliBackend], chdb_url: str, database: str, tmp_path: Path
) -> None:
    cluster, backend = any_slurm
    state = tmp_path / "producer.json"
    (job,) = _jobs_running(cluster, backend, broker.bootstrap, state, 1)
    node = backend.job_state(job).nodes[0]
    stack_dir = tmp_path / "stack"
    with (
        running_stack(broker.bootstrap, chdb_url, database, backend, "autonomous", stack_dir) as stack,
        _slurm_producer(cluster, broker.bootstrap, state),
    ):
        store = stack.store
        assert store is not None
        wait_placed(broker.bootstrap, (job,))
        # The node fails: its slurmd stops answering (frozen, so it can answer again afterwards).
        os.kill(_slurmd_pids(cluster)[node], signal.SIGSTOP)
        wait_for(
            f"Slurm reporting {node} NOT_RESPONDING",
            lambda: "NOT_RESPONDING" in backend.node_state(node).flags,
            timeout=60,
        )
        # srun prints this once slurmctld has told it the node failed.
        _log(broker.bootstrap, tmp_path, job, node, f"srun: error: Node failure on {node}")
        # Either the scheduler's report reached attribution first (one incident, corroborated at
        # once) or the line did (its incident recommends the drain, then one corroborated by the
        # report drains): in both the drain is decided on the scheduler's word, within the hold.
        decided = wait_for(
            f"a drain of {node} decided for job {job}",
            lambda: [d for d in _decisions(store, job) if str(d["action"]).startswith("drain")] or None,
            timeout=90,
        )
        (d,) = decided
        assert (d["kind"], d["culprit_node"]) == ("action", node), d
        s = wait_for(
            f"{node} drained for {d['incident_id']}",
            lambda: (n := backend.node_state(node)).drained and str(d["incident_id"]) in (n.reason or "") and n,
            timeout=60,
        )
        assert s
        (inc,) = [i for i in incidents_of(store, job) if i["incident_id"] == d["incident_id"]]
        assert f"slurm: node {node} " in str(inc["evidence"]) and '"provenance":"scheduler"' in str(inc["evidence"])
        # The node answers again: Slurm would return it to service; the drain keeps it out.
        os.kill(_slurmd_pids(cluster)[node], signal.SIGCONT)
        wait_for(
            f"{node} answering again",
            lambda: "NOT_RESPONDING" not in (n := backend.node_state(node)).flags and n,
            timeout=60,
        )
        assert backend.node_state(node).drained
