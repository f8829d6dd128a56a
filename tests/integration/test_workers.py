"""Several streams workers split the jobs between them, and lose nothing when one dies.

Real broker, real Faust workers (`trainmedic up --workers N`'s Stack), real chDB audit:

- the same fault set through 1 and 3 workers yields the same incidents (ids, jobs, culprits,
  categories), and with 3 the jobs really were split (each worker attributed partitions of its own);
- the worker that attributes a job is SIGKILLed between the first symptoms and the root cause: a
  surviving worker takes the partition over, reads the evidence back, and the one incident (one id,
  audited once) holds the evidence from before and after the kill;
- a worker joins during a storm of faults: every faulted job gets exactly one incident.
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from aiokafka.partitioner import murmur2  # type: ignore[import-untyped]
from confluent_kafka.admin import AdminClient

from bus.publish import Publisher
from producers.joblogs import JobLayout, JobLogProducer
from producers.kernel import KernelLogProducer
from schemas.events import Event, GpuMetrics, GpuSample, HealthEvent, SchedEvent
from schemas.topics import DEFAULT_PARTITIONS, GPU_SAMPLES, HEALTH_EXTERNAL, SCHED_EVENTS, Topic
from sinks.audit import AuditStore
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import wait_for, wait_placed
from tests.integration.scenario import RANKS_PER_NODE, watchdog_line, xid79_line
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig

NODES = [f"gpu{n:02d}" for n in range(1, 17)]
IDLE_NODE = "gpu16"


class Recorder:
    """Takes what the real producers publish, so that two runs replay the very same events."""

    def __init__(self) -> None:
        self.events: list[tuple[Topic, Event]] = []

    def publish(self, topic: Topic, event: Event) -> None:
        self.events.append((topic, event))

    def flush(self, timeout: float = 0) -> int:
        return 0


def _replay(bootstrap: str, events: list[tuple[Topic, Event]]) -> None:
    pub = Publisher(bootstrap, "test-producer")
    for topic, event in events:
        pub.publish(topic, event)
    assert pub.flush(10) == 0


def _running(job: str, nodes: list[str]) -> SchedEvent:
    return SchedEvent(
        event_id=f"run-{job}", event_time=time.time(), kind="job", job_id=job, state="RUNNING", nodes=nodes
    )


def _kernel_xid(rec: Recorder, tmp: Path, node: str) -> None:
    kern = tmp / f"kern-{node}.log"
    kern.write_text(xid79_line(node) + "\n")
    KernelLogProducer(cast(Publisher, rec), kern, node=node, from_start=True).poll_once()


def _collateral(rec: Recorder, tmp: Path, job: str, nodes: list[str], culprit: str) -> None:
    """NCCL watchdog timeouts on every rank but the culprit's: symptoms, no cause."""
    paths = {}
    for i, node in enumerate(nodes):
        path = tmp / f"{job}-{node}.log"
        lines = (
            [] if node == culprit else [watchdog_line(r) for r in range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE)]
        )
        path.write_text("".join(x + "\n" for x in lines))
        paths[node] = path
    JobLogProducer(
        cast(Publisher, rec),
        job,
        list(paths.values()),
        JobLayout(tuple(nodes), RANKS_PER_NODE),
        node_of_path={p: n for n, p in paths.items()},
    ).poll_once()


def _fault_set(tmp: Path) -> tuple[list[tuple[Topic, Event]], list[tuple[Topic, Event]], dict[str, str]]:
    """Placements, then one fault per job of a different kind each, and one on an idle node.
    Returns (placements, faults, job -> culprit node)."""
    jobs = {f"j{i}": NODES[2 * i : 2 * i + 2] for i in range(6)}
    placed = Recorder()
    for job, nodes in jobs.items():
        placed.publish(SCHED_EVENTS, _running(job, nodes))
    rec = Recorder()
    culprits = {}
    # j0: the cascade - NCCL timeouts everywhere, the Xid 79 in the culprit's kernel log.
    culprits["j0"] = jobs["j0"][1]
    _collateral(rec, tmp, "j0", jobs["j0"], culprits["j0"])
    _kernel_xid(rec, tmp, culprits["j0"])
    # j1: a kernel Xid only (node-level evidence, re-keyed to the job).
    culprits["j1"] = jobs["j1"][0]
    _kernel_xid(rec, tmp, culprits["j1"])
    # j2: NVML says a GPU is lost.
    culprits["j2"] = jobs["j2"][1]
    rec.publish(
        GPU_SAMPLES,
        GpuSample(
            event_id=f"nvml-{culprits['j2']}",
            event_time=time.time(),
            node=culprits["j2"],
            collector="nvml",
            gpus=[GpuMetrics(index=0, utilization_pct=97.0), GpuMetrics(index=1, lost=True)],
        ),
    )
    # j3: NVSentinel reports a fatal Xid 48 on a node.
    culprits["j3"] = jobs["j3"][0]
    rec.publish(
        HEALTH_EXTERNAL,
        HealthEvent(
            event_id=f"nvs-{culprits['j3']}",
            event_time=time.time(),
            origin="nvsentinel",
            node=culprits["j3"],
            check_name="SysLogsXIDError",
            component="GPU",
            component_ids=["0"],
            error_codes=["48"],
            is_fatal=True,
            recommended_action="RESTART_VM",
            message="XID 48 DBE",
        ),
    )
    # j4: the cascade on its other node; j5 stays healthy.
    culprits["j4"] = jobs["j4"][0]
    _collateral(rec, tmp, "j4", jobs["j4"], culprits["j4"])
    _kernel_xid(rec, tmp, culprits["j4"])
    # An idle node: a node incident.
    _kernel_xid(rec, tmp, IDLE_NODE)
    return placed.events, rec.events, culprits


def _stack(bootstrap: str, chdb_url: str, database: str, tmp: Path, workers: int, **kw: Any) -> Stack:
    return Stack(
        StackConfig(
            data_dir=tmp,
            bootstrap=bootstrap,
            clickhouse=chdb_url,
            database=database,
            mode=kw.pop("mode", "monitor"),
            settle_s=1.0,
            collateral_wait_s=kw.pop("collateral_wait_s", 3.0),
            workers=workers,
            worker_ready_timeout_s=180.0,
            **kw,
        ),
        SimulatedScheduler(NODES),
    ).start()


def _incidents(store: AuditStore) -> list[dict[str, object]]:
    return store.query("SELECT incident_id, job_id, culprit_node, category FROM {db}.incidents FINAL")


def _assigned(stack: Stack, i: int) -> list[int]:
    """The partitions worker i attributes now (its last 'attributing partitions' line)."""
    found = re.findall(r"attributing partitions \[([0-9, ]*)\]", stack.worker_log(i).read_text(errors="replace"))
    return [int(p) for p in found[-1].split(",") if p.strip()] if found else []


def _partition(key: str) -> int:
    return int((murmur2(key.encode()) & 0x7FFFFFFF) % DEFAULT_PARTITIONS)


@pytest.fixture
def second_broker() -> Iterator[EmbeddedBroker]:
    b = EmbeddedBroker().start()
    try:
        yield b
    finally:
        b.stop(grace_s=0)


def _run(bootstrap: str, chdb_url: str, database: str, tmp: Path, workers: int, fault_set: Any) -> Any:
    placed, faults, culprits = fault_set
    stack = _stack(bootstrap, chdb_url, database, tmp, workers)
    try:
        store = stack.store
        assert store is not None
        if workers > 1:
            # Every worker has its share before the faults (the group settled).
            wait_for(
                "every worker attributing partitions",
                lambda: (
                    all(_assigned(stack, i) for i in range(workers))
                    and sum(len(_assigned(stack, i)) for i in range(workers)) == DEFAULT_PARTITIONS
                ),
                timeout=120,
            )
        _replay(bootstrap, placed)
        # The placements first, as after the Slurm producer's snapshot.
        wait_placed(bootstrap, [e.job_id for _, e in placed if isinstance(e, SchedEvent) and e.job_id])
        _replay(bootstrap, faults)
        wait_for("an incident per faulted job and the idle node", lambda: len(_incidents(store)) >= 6 or None)
        time.sleep(5.0)  # the collateral wait and hold: nothing more may come
        shares = [_assigned(stack, i) for i in range(workers)]
        idle = wait_for(
            "the idle node's decision",
            lambda: store.query(
                "SELECT action, culprit_node FROM {db}.decisions FINAL WHERE job_id IS NULL OR job_id = ''"
            ),
        )
        return (
            sorted(
                (str(r["incident_id"]), str(r["job_id"]), str(r["culprit_node"]), str(r["category"]))
                for r in _incidents(store)
            ),
            [(str(d["action"]), str(d["culprit_node"])) for d in idle],
            shares,
            culprits,
        )
    finally:
        stack.stop()
        gc.collect()


@pytest.mark.slow(
    reason="the same fault set through two whole stacks, one worker then three (a consumer group to settle), "
    "each with its absence window"
)
def test_one_and_three_workers_make_the_same_incidents(
    broker: EmbeddedBroker, second_broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    fault_set = _fault_set(tmp_path)
    one, idle, _, culprits = _run(broker.bootstrap, chdb_url, database, tmp_path / "one", 1, fault_set)
    three, idle3, shares, _ = _run(
        second_broker.bootstrap, chdb_url, f"{database}_3w", tmp_path / "three", 3, fault_set
    )
    # A fault on an idle node: isolate the node (monitor: recommended). With no job there is nothing to
    # requeue: the executor's drain_and_requeue drains only (sinks/executor.py).
    assert idle == idle3 == [("drain_and_requeue", IDLE_NODE)]
    assert one == three
    by_job = {job: (node, category) for _, job, node, category in one}
    assert {j: by_job[j][0] for j in culprits} == culprits
    assert {by_job[j][1] for j in culprits} == {"gpu_hardware"}
    assert by_job[""][0] == IDLE_NODE and "j5" not in by_job  # the idle node's own incident; the healthy job none
    assert len(one) == 6
    # With three workers the jobs were judged in three places, each partition by one worker.
    assert all(shares) and sorted(p for s in shares for p in s) == list(range(DEFAULT_PARTITIONS))


def test_a_worker_killed_mid_fault_hands_its_jobs_over_and_the_incident_is_made_once(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    job, nodes = "k1", NODES[:4]
    culprit = nodes[2]
    stack = _stack(broker.bootstrap, chdb_url, database, tmp_path, 3, collateral_wait_s=60.0)
    try:
        store = stack.store
        assert store is not None
        wait_for(
            "every worker attributing partitions",
            lambda: (
                sum(len(_assigned(stack, i)) for i in range(3)) == DEFAULT_PARTITIONS
                and all(_assigned(stack, i) for i in range(3))
            ),
            timeout=120,
        )
        owner = next(i for i in range(3) if _partition(job) in _assigned(stack, i))
        _replay(broker.bootstrap, [(SCHED_EVENTS, _running(job, nodes))])
        wait_placed(broker.bootstrap, [job])
        before = Recorder()
        _collateral(before, tmp_path, job, nodes, culprit)
        _replay(broker.bootstrap, before.events)
        # The owner consumed the symptoms (and, past Faust's commit interval, committed them) and
        # holds them in an open group, waiting for a cause: now it dies without a word.
        seen = wait_for(
            "the symptoms in the audit",
            lambda: (
                r
                if len(
                    r := store.query("SELECT event_id FROM {db}.anomalies FINAL WHERE job_id = {j:String}", {"j": job})
                )
                >= len(nodes) - 1
                else None
            ),
        )
        time.sleep(4.0)  # past Faust's commit interval (2.8 s): the killed worker had committed the halves
        proc = stack.worker(owner)
        assert proc is not None
        proc.kill()
        proc.wait(30)
        survivors = [i for i in range(3) if i != owner]
        wait_for(
            f"partition {_partition(job)} taken over",
            lambda: any(_partition(job) in _assigned(stack, i) for i in survivors),
            timeout=120,
        )
        after = Recorder()
        _kernel_xid(after, tmp_path, culprit)
        _replay(broker.bootstrap, after.events)
        inc = wait_for(
            "the incident",
            lambda: store.query("SELECT * FROM {db}.incidents FINAL WHERE job_id = {j:String}", {"j": job}),
            timeout=120,
        )
        time.sleep(5.0)  # absence: no second incident within the collateral wait and settle
        rows = store.query(
            "SELECT incident_id, culprit_node, category, anomaly_ids FROM {db}.incidents FINAL WHERE job_id = {j:String}",
            {"j": job},
        )
        assert len(rows) == 1, rows
        assert (rows[0]["culprit_node"], rows[0]["category"]) == (culprit, "gpu_hardware")
        taken = set(cast(list[str], rows[0]["anomaly_ids"]))
        assert {str(r["event_id"]) for r in seen} <= taken  # the dead worker's evidence carried over
        assert inc[0]["incident_id"] == rows[0]["incident_id"]
    finally:
        stack.stop()
        gc.collect()


def test_a_worker_joining_during_a_storm_loses_no_incident_and_doubles_none(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    jobs = {f"s{i}": NODES[2 * i : 2 * i + 2] for i in range(8)}
    # Supervised, as `up`, the systemd units and the chart run workers. The embedded broker answers
    # a changelog's end offset below what the workers already read (the last batch's base offset
    # + 1); with Faust's consistency check on, each rebalance stopped the running workers
    # (ConsistencyError), their restarts rebalanced again, and in one CI run the group never
    # settled within 180 s. The join must not cost a single worker restart.
    stack = _stack(broker.bootstrap, chdb_url, database, tmp_path, 2, supervise=True)
    try:
        store = stack.store
        assert store is not None
        placed = Recorder()
        for job, nodes in jobs.items():
            placed.publish(SCHED_EVENTS, _running(job, nodes))
        _replay(broker.bootstrap, placed.events)
        wait_placed(broker.bootstrap, list(jobs))
        for n, (job, nodes) in enumerate(jobs.items()):
            rec = Recorder()
            _collateral(rec, tmp_path, job, nodes, nodes[1])  # symptoms first ...
            _kernel_xid(rec, tmp_path, nodes[1])  # ... then the cause
            _replay(broker.bootstrap, rec.events)
            if n == 2:
                stack._start_worker(2)  # a third worker joins: the group rebalances mid-storm
            time.sleep(0.3)  # pacing: the storm's faults come over seconds, not at once
        stack._wait_worker_ready(2)
        wait_for("an incident per job", lambda: len(_incidents(store)) >= len(jobs) or None, timeout=180)
        time.sleep(6.0)  # absence: no doubled incident within the collateral wait, settle and a rebalance
        rows = _incidents(store)
        per_job: dict[str, list[str]] = {}
        for r in rows:
            per_job.setdefault(str(r["job_id"]), []).append(str(r["incident_id"]))
        assert sorted(per_job) == sorted(jobs) and all(len(ids) == 1 for ids in per_job.values()), per_job
        assert _assigned(stack, 2), "the joining worker never got a partition"
        assert stack.supervisor is not None
        restarts = {n: c["restarts"] for n, c in stack.supervisor.health()["components"].items() if c["restarts"]}
        assert not restarts, f"a rebalance restarted workers: {restarts}"
    finally:
        stack.stop()
        gc.collect()


def test_the_restart_budget_moves_with_the_job_to_the_worker_that_takes_it_over(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    """Autonomous, one restart allowed: the first fault restarts the job; its owner is then
    SIGKILLed, and the worker that takes the job over recovers the budget (a Faust table) and
    stops the job at the next fault instead of restarting it again."""
    default = (Path(__file__).resolve().parents[2] / "streams" / "policies" / "default.yaml").read_text()
    policy = tmp_path / "policy.yaml"
    policy.write_text(default.replace("restart_budget: {max_restarts: 3,", "restart_budget: {max_restarts: 1,", 1))
    job, nodes = "b1", NODES[:4]
    stack = _stack(broker.bootstrap, chdb_url, database, tmp_path, 3, policy=policy, mode="autonomous")
    try:
        store = stack.store
        assert store is not None
        wait_for(
            "every worker attributing partitions",
            lambda: (
                sum(len(_assigned(stack, i)) for i in range(3)) == DEFAULT_PARTITIONS
                and all(_assigned(stack, i) for i in range(3))
            ),
            timeout=120,
        )
        owner = next(i for i in range(3) if _partition(job) in _assigned(stack, i))

        def decisions() -> list[dict[str, object]]:
            return store.query(
                "SELECT incident_id, action, rule FROM {db}.decisions FINAL WHERE job_id = {j:String} ORDER BY event_time",
                {"j": job},
            )

        _replay(broker.bootstrap, [(SCHED_EVENTS, _running(job, nodes))])
        wait_placed(broker.bootstrap, [job])
        first = Recorder()
        _kernel_xid(first, tmp_path, nodes[1])
        _replay(broker.bootstrap, first.events)
        (d1,) = wait_for("the first decision", lambda: decisions() or None, timeout=60)
        assert d1["action"] == "drain_and_requeue", d1
        time.sleep(4.0)  # past the table's and the offsets' flush
        proc = stack.worker(owner)
        assert proc is not None
        proc.kill()
        proc.wait(30)
        wait_for(
            f"partition {_partition(job)} taken over",
            lambda: any(_partition(job) in _assigned(stack, i) for i in range(3) if i != owner),
            timeout=120,
        )
        # The job runs again after its requeue (a later RUNNING), then fails once more.
        rerun = _running(job, nodes[1:] + nodes[:1]).model_copy(update={"event_id": f"rerun-{job}"})
        _replay(broker.bootstrap, [(SCHED_EVENTS, rerun)])
        time.sleep(2.0)  # the re-run's placement replaces a key already in the changelog: wait_placed cannot tell
        second = Recorder()
        _kernel_xid(second, tmp_path, nodes[2])
        _replay(broker.bootstrap, second.events)
        both = wait_for("the second decision", lambda: r if len(r := decisions()) >= 2 else None, timeout=120)
        # The job is stopped; the node whose own kernel log reported the Xid is still drained.
        assert both[1]["action"] == "drain_and_stop" and "restart budget" in str(both[1]["rule"]), both
    finally:
        stack.stop()
        gc.collect()


def test_an_install_whose_topics_have_4_partitions_runs_with_the_setting_4(
    second_broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Topics an earlier trainmedic created have 4 partitions; with topic_partitions 4 the workers
    size their tables and compute job ownership for 4, and a node fault still reaches its job.
    (A broker without topics: `up` creates them with the setting's count.)"""
    monkeypatch.setenv("TRAINMEDIC_TOPIC_PARTITIONS", "4")
    job, nodes = "p4", NODES[:2]
    stack = _stack(second_broker.bootstrap, chdb_url, database, tmp_path, 2)
    try:
        store = stack.store
        assert store is not None
        admin_topics = AdminClient({"bootstrap.servers": second_broker.bootstrap}).list_topics(timeout=10).topics
        assert {len(admin_topics[t].partitions) for t in ("anomalies", "anomalies.by_job", "incidents")} == {4}
        wait_for("both workers attributing", lambda: all(_assigned(stack, i) for i in range(2)), timeout=120)
        _replay(second_broker.bootstrap, [(SCHED_EVENTS, _running(job, nodes))])
        wait_placed(second_broker.bootstrap, [job])
        rec = Recorder()
        _kernel_xid(rec, tmp_path, nodes[1])
        _replay(second_broker.bootstrap, rec.events)
        (inc,) = wait_for(
            "the job's incident",
            lambda: store.query("SELECT culprit_node FROM {db}.incidents FINAL WHERE job_id = {j:String}", {"j": job}),
        )
        assert inc["culprit_node"] == nodes[1]
        logs = "".join(stack.worker_log(i).read_text(errors="replace") for i in range(2))
        assert "but the setting topic_partitions" not in logs
        assert sorted(p for i in range(2) for p in _assigned(stack, i)) == [0, 1, 2, 3]
    finally:
        stack.stop()
        gc.collect()
