"""SIGKILL the Faust streams worker of a real Stack while a fault is in flight, start a
new one, and check the fault still becomes exactly one incident, one decision and
one action (stable incident ids; ReplacingMergeTree rows counted with FINAL)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiokafka.partitioner import murmur2  # type: ignore[import-untyped]

from bus.publish import Publisher
from producers.joblogs import JobLayout, JobLogProducer
from producers.kernel import KernelLogProducer
from schemas.topics import ANOMALIES, DEFAULT_PARTITIONS
from sinks.audit import AuditStore
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import wait_for
from tests.integration.scenario import NODES, RANKS_PER_NODE, incidents_of, write_cascade
from tests.reliability.harness import anomaly, produce, report_row
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig


def _count(store: AuditStore, table: str, job: str, final: bool = True) -> int:
    sql = f"SELECT count() AS n FROM {{db}}.{table} {'FINAL' if final else ''} WHERE job_id = {{j:String}}"
    return int(store.query(sql, {"j": job})[0]["n"])


def _report(fault: str, store: AuditStore, calls: list[str], note: str) -> None:
    raw = store.query("SELECT count() AS n FROM {db}.incidents WHERE NOT startsWith(ifNull(job_id, ''), '9')")
    final = len(_fault_rows(store, "incidents"))
    report_row(
        fault,
        sent=1,
        landed=final,
        where="incidents (1 fault)",
        duplicates=int(raw[0]["n"]) - final,
        actions_expected=2,
        actions_taken=len(calls),
        note=note,
    )


def _calls_for(sched: SimulatedScheduler, job: str) -> list[str]:
    """The scheduler calls of the injected fault (not of the marker faults)."""
    return [c for c in sched.calls if "gpu02" in c or f" {job} " in f"{c} "]


def _partition(key: str) -> int:
    """Where the producers' murmur2 partitioner puts a key."""
    return int((murmur2(key.encode()) & 0x7FFFFFFF) % DEFAULT_PARTITIONS)


def _kill_and_restart_worker(stack: Stack) -> None:
    worker = stack.worker(0)
    assert worker is not None and worker.poll() is None
    worker.kill()  # SIGKILL: no shutdown, no final offset commit
    worker.wait(30)
    stack._start_worker(0)
    stack._wait_worker_ready(0)


# A restarted worker recovers its tables from the changelogs and waits out the dead member's
# session before it gets partitions: on a loaded 2-core CI machine that has taken over a minute.
RESTART_WAIT_S = 240.0
FAUST_COMMIT_S = 2.8  # faust.App's broker_commit_interval default


def _after_restart(stack: Stack, what: str, probe: Callable[[], Any]) -> Any:
    """wait_for, with the restarted worker's log in the failure: why it did not get there."""
    try:
        return wait_for(what, probe, timeout=RESTART_WAIT_S)
    except pytest.fail.Exception:
        log = stack.worker_log(0)
        tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else "(no log)"
        pytest.fail(f"timed out after {RESTART_WAIT_S:.0f} s waiting for {what}; the worker's log ends:\n{tail}")


def _stack(broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path, sched: SimulatedScheduler) -> Stack:
    return Stack(
        StackConfig(
            data_dir=tmp_path / "var",
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            mode="autonomous",
            settle_s=1.0,
            # Collateral-only evidence waits long enough that nothing is published before the kill.
            collateral_wait_s=60.0,
        ),
        sched,
    ).start()


def test_worker_killed_between_halves_of_a_fault_still_yields_one_incident(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler([*NODES, "gpu05"], requeue_delay_s=0.5)
    job = sched.submit("train", 4)
    stack = _stack(broker, chdb_url, database, tmp_path, sched)
    try:
        store = stack.store
        assert store is not None
        paths = write_cascade(tmp_path, NODES, culprit="gpu02")
        pub = Publisher(broker.bootstrap, "test-producer")
        # First half: the NCCL watchdog timeouts of the three healthy nodes' ranks.
        JobLogProducer(
            pub,
            job,
            list(paths.values()),
            JobLayout(tuple(NODES), RANKS_PER_NODE),
            partition="gpu",
            node_of_path={p: n for n, p in paths.items()},
        ).poll_once()
        assert pub.flush(10) == 0
        wait_for("the collateral anomalies in the audit", lambda: _count(store, "anomalies", job) >= 6)
        assert incidents_of(store, job) == []  # still collecting evidence when the worker dies
        # Past Faust's commit interval (2.8 s): the dead worker has committed what it consumed, so
        # the evidence it held is in no uncommitted offset, only in its memory and on the topic.
        time.sleep(FAUST_COMMIT_S * 2)

        _kill_and_restart_worker(stack)

        # Second half: the Xid 79 on gpu02.
        KernelLogProducer(pub, tmp_path / "nodes" / "gpu02" / "kern.log", node="gpu02", from_start=True).poll_once()
        assert pub.flush(10) == 0
        inc = _after_restart(stack, "the incident", lambda: incidents_of(store, job))[0]
        assert (inc["culprit_node"], inc["category"]) == ("gpu02", "gpu_hardware")
        wait_for(
            "the action result",
            lambda: store.query("SELECT status FROM {db}.action_results FINAL WHERE job_id = {j:String}", {"j": job}),
        )
        stack.check_alive()
        assert _count(store, "incidents", job) == 1
        assert _count(store, "decisions", job) == 1
        assert _count(store, "actions", job) == 1
        _report(
            "streams worker SIGKILLed between the halves of a fault",
            store,
            _calls_for(sched, job),
            "collateral before the kill, root cause after",
        )
    finally:
        stack.stop()
    assert sched.calls == ["drain gpu02", f"requeue {job} exclude=gpu02"]


def _sync(broker: EmbeddedBroker, store: AuditStore, *keys: str) -> None:
    """Publish a marker fault on the anomalies partition of each key (a job id or a node name) and
    wait for its action result in the audit. Partitions are processed in order at every hop
    (anomalies -> incident -> decision -> action -> result, keyed alike), so once the marker's
    result is in the audit, whatever the worker did before with records of those keys is too."""
    for n, key in enumerate(keys):
        marker = next(str(j) for j in range(9000, 9999) if _partition(str(j)) == _partition(key))
        produce(broker.bootstrap, [(ANOMALIES.name, anomaly(n, marker, "gpu05", job_nodes=["gpu05"], prefix="sync"))])

        def landed(m: str = marker) -> list[dict[str, object]]:
            return store.query("SELECT 1 FROM {db}.action_results FINAL WHERE job_id = {j:String}", {"j": m})

        wait_for(f"the marker fault's action result (job {marker})", landed, timeout=RESTART_WAIT_S)


def _fault_rows(store: AuditStore, table: str) -> list[dict[str, object]]:
    """Rows not made by the marker faults (jobs 9000-9998)."""
    return store.query(f"SELECT * FROM {{db}}.{table} FINAL WHERE NOT startsWith(ifNull(job_id, ''), '9')")


def _publish_fault(broker: EmbeddedBroker, tmp_path: Path, job: str) -> Publisher:
    paths = write_cascade(tmp_path, NODES, culprit="gpu02")
    pub = Publisher(broker.bootstrap, "test-producer")
    JobLogProducer(
        pub,
        job,
        list(paths.values()),
        JobLayout(tuple(NODES), RANKS_PER_NODE),
        partition="gpu",
        node_of_path={p: n for n, p in paths.items()},
    ).poll_once()
    _reread_kernel_log(pub, tmp_path)
    return pub


def _reread_kernel_log(pub: Publisher, tmp_path: Path) -> None:
    KernelLogProducer(pub, tmp_path / "nodes" / "gpu02" / "kern.log", node="gpu02", from_start=True).poll_once()
    assert pub.flush(10) == 0


def test_worker_killed_right_after_publishing_the_incident_does_not_act_twice(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    """The worst moment: the incident is out, the offsets of the anomalies behind it may not
    be committed yet (Faust commits every few seconds). Whatever the new worker reprocesses
    must not become a second incident or a second action."""
    sched = SimulatedScheduler([*NODES, "gpu05"], requeue_delay_s=0.5)
    job = sched.submit("train", 4)
    stack = _stack(broker, chdb_url, database, tmp_path, sched)
    try:
        store = stack.store
        assert store is not None
        _publish_fault(broker, tmp_path, job)
        wait_for("the incident", lambda: incidents_of(store, job), interval=0.05)
        _kill_and_restart_worker(stack)
        _sync(broker, store, job, "gpu02")
        stack.check_alive()
        incidents = _fault_rows(store, "incidents")
        assert len(incidents) == 1, [(i["incident_id"], i["job_id"], i["anomaly_ids"]) for i in incidents]
        assert len(_fault_rows(store, "decisions")) == 1
        assert len(_fault_rows(store, "actions")) == 1
        _report(
            "streams worker SIGKILLed right after publishing the incident",
            store,
            _calls_for(sched, job),
            "uncommitted evidence reprocessed by the new worker",
        )
    finally:
        stack.stop()
    assert sched.calls == ["drain gpu02", f"requeue {job} exclude=gpu02"]


def test_redelivered_evidence_after_a_worker_restart_is_not_a_second_incident(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler([*NODES, "gpu05"], requeue_delay_s=0.5)
    job = sched.submit("train", 4)
    stack = _stack(broker, chdb_url, database, tmp_path, sched)
    try:
        store = stack.store
        assert store is not None
        pub = _publish_fault(broker, tmp_path, job)
        wait_for(
            "the action result",
            lambda: store.query("SELECT 1 FROM {db}.action_results FINAL WHERE job_id = {j:String}", {"j": job}),
        )
        _kill_and_restart_worker(stack)
        # The Xid line comes again with the same stable event id: a kernel-log reader that
        # restarted re-reads it, or the crashed worker had not committed node.kernel yet.
        _reread_kernel_log(pub, tmp_path)
        _sync(broker, store, job, "gpu02")
        stack.check_alive()
        assert len(store.query("SELECT 1 FROM {db}.anomalies FINAL WHERE signature = 'xid_79' AND node = 'gpu02'")) == 1
        incidents = _fault_rows(store, "incidents")
        assert len(incidents) == 1, [(i["incident_id"], i["job_id"], i["culprit_node"]) for i in incidents]
        assert len(_fault_rows(store, "actions")) == 1
        _report(
            "worker restart, then the same Xid line read again",
            store,
            _calls_for(sched, job),
            "state read back from the topics at start",
        )
    finally:
        stack.stop()
