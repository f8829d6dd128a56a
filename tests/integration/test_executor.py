"""The executor as a consumer group on the real broker, with guardrails, approvals
through the operator API, and the alert-storm case through the whole pipeline."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from confluent_kafka import Consumer

from bus.config import consumer_config
from bus.publish import Publisher
from producers.kernel import KernelLogProducer
from schemas.codec import decode
from schemas.events import Action, ActionResult, GuardrailTrip
from schemas.topics import ACTION_RESULTS, ACTIONS, GUARDRAIL_TRIPS
from sinks.audit import AuditSink, AuditStore
from sinks.backends.simulated import SimulatedScheduler
from sinks.executor import Executor, ExecutorService, ExecutorSettings
from sinks.guardrails import GuardrailFile, Guardrails
from streams.policy import DEFAULT_POLICY
from tests.conftest import wait_for
from tests.integration.scenario import NODES, publish_cascade, wait_incident, xid79_line
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig


def _read_all(bootstrap: str, topic: str, group: str, expect: int, timeout: float = 60.0) -> list[bytes]:
    consumer = Consumer(consumer_config(bootstrap, group, group))
    consumer.subscribe([topic])
    seen: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(seen) < expect:
        msg = consumer.poll(0.2)
        if msg is not None and not msg.error():
            seen.append(msg.value() or b"")
    # a little longer: anything beyond `expect` would be a duplicate
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        msg = consumer.poll(0.2)
        if msg is not None and not msg.error():
            seen.append(msg.value() or b"")
    consumer.close()
    return seen


def _requeue_action(i: int, job: str) -> Action:
    return Action(
        event_id=f"act-{i}",
        event_time=1.0,
        action_id=f"act-{i}",
        decision_id=f"dec-{i}",
        incident_id=f"inc-{i}",
        job_id=job,
        node=None,
        partition="gpu",
        action="requeue",
        reason=f"trainmedic inc-{i}: hang",
        requested_by="policy",
        incident_time=1.0,
        first_signal_time=0.5,
    )


def test_two_executors_one_acts_the_other_takes_over(broker: EmbeddedBroker) -> None:
    """Two replicas in one group: one holds the acting lease and does everything; when it
    stops, the other takes over and carries on. Every action is performed once."""
    sched = SimulatedScheduler([f"gpu{i:02d}" for i in range(1, 41)], requeue_delay_s=0.0)
    jobs = [sched.submit(f"j{i}", 1) for i in range(20)]
    services = [
        ExecutorService(
            broker.bootstrap,
            Executor(sched, ExecutorSettings(verify_timeout_s=10, group="exec")),
            client_id=f"exec-{i}",
        )
        for i in range(2)
    ]
    threads = [threading.Thread(target=s.run, daemon=True) for s in services]
    for t in threads:
        t.start()
    pub = Publisher(broker.bootstrap, "test")
    for i, job in enumerate(jobs[:10]):
        pub.publish(ACTIONS, _requeue_action(i, job))
    assert pub.flush(10) == 0
    first = [decode(ActionResult, v) for v in _read_all(broker.bootstrap, ACTION_RESULTS.name, "r1", expect=10)]
    actor = next(i for i, s in enumerate(services) if s.results)
    standby = services[1 - actor]
    assert len(services[actor].results) == 10 and standby.results == [] and not standby.acting
    assert {a.executor for a in services[actor].attempts} == {services[actor].replica}
    services[actor].stop_event.set()
    threads[actor].join(30)
    wait_for("the standby to take over the lease", lambda: standby.acting, timeout=60)
    for i, job in enumerate(jobs[10:], start=10):
        pub.publish(ACTIONS, _requeue_action(i, job))
    assert pub.flush(10) == 0
    results = [decode(ActionResult, v) for v in _read_all(broker.bootstrap, ACTION_RESULTS.name, "r2", expect=20)]
    standby.stop_event.set()
    threads[1 - actor].join(30)
    assert len(first) == 10
    assert sorted(r.action_id for r in results) == sorted(f"act-{i}" for i in range(20))
    assert all(r.status == "done" for r in results)
    assert sorted(c for c in sched.calls if c.startswith("requeue")) == sorted(f"requeue {j} exclude=" for j in jobs)
    assert all(sched.job_state(j).restart_count == 1 for j in jobs)
    assert sorted(r.action_id for r in standby.results) == sorted(f"act-{i}" for i in range(10, 20))


def test_drain_of_a_node_outside_the_job_is_refused_and_audited(broker: EmbeddedBroker) -> None:
    """A job on gpu01-04 printed `srun: error: Node failure on gpu06`; gpu06 runs another job.
    The executor checks the job's placement itself before draining: no drain, the reason in the
    result and a guardrail trip."""
    sched = SimulatedScheduler([f"gpu{i:02d}" for i in range(1, 9)], requeue_delay_s=0.0)
    job, other = sched.submit("train", 4), sched.submit("other", 4)  # gpu01-04, gpu05-08
    svc = ExecutorService(broker.bootstrap, Executor(sched, ExecutorSettings(verify_timeout_s=10, group="foreign")))
    thread = threading.Thread(target=svc.run, daemon=True)
    thread.start()
    pub = Publisher(broker.bootstrap, "test")
    pub.publish(
        ACTIONS,
        Action(
            event_id="act-foreign",
            event_time=time.time(),
            action_id="act-foreign",
            decision_id="dec-foreign",
            incident_id="inc-foreign",
            job_id=job,
            node="gpu06",
            partition="gpu",
            action="drain_and_requeue",
            reason="trainmedic inc-foreign: node",
            requested_by="policy",
            incident_time=time.time(),
            first_signal_time=time.time(),
        ),
    )
    assert pub.flush(10) == 0
    results = [decode(ActionResult, v) for v in _read_all(broker.bootstrap, ACTION_RESULTS.name, "r", expect=1)]
    trips = [decode(GuardrailTrip, v) for v in _read_all(broker.bootstrap, GUARDRAIL_TRIPS.name, "g", expect=1)]
    svc.stop_event.set()
    thread.join(30)
    assert len(results) == 1 and results[0].status == "skipped", results
    assert "guardrail culprit_not_in_job: not draining gpu06" in (results[0].error or "")
    assert "gpu01,gpu02,gpu03,gpu04" in (results[0].error or "")
    assert [t.guardrail for t in trips] == ["culprit_not_in_job"] and trips[0].node == "gpu06"
    assert sched.calls == [] and sched.job_state(other).state == "RUNNING"


def test_alert_storm_blast_radius_one_drain_then_guardrail(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(DEFAULT_POLICY.read_text().replace("max_drains_per_window: 2", "max_drains_per_window: 1"))
    sched = SimulatedScheduler(NODES)
    stack = Stack(
        StackConfig(
            data_dir=tmp_path,
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            mode="autonomous",
            policy=policy,
        ),
        sched,
    ).start()
    try:
        pub = Publisher(broker.bootstrap, "test")
        # 3 of 4 nodes report a Xid 79 inside a minute; no job runs on them.
        for node in ("gpu01", "gpu02", "gpu03"):
            kern = tmp_path / node / "kern.log"
            kern.parent.mkdir()
            kern.write_text(xid79_line(node) + "\n")
            KernelLogProducer(pub, kern, node=node, from_start=True).poll_once()
        assert pub.flush(10) == 0
        results = [decode(ActionResult, v) for v in _read_all(broker.bootstrap, ACTION_RESULTS.name, "r", expect=3)]
        trips = [decode(GuardrailTrip, v) for v in _read_all(broker.bootstrap, GUARDRAIL_TRIPS.name, "g", expect=2)]
    finally:
        stack.stop()
    assert sorted(r.status for r in results) == ["done", "skipped", "skipped"]
    assert [c for c in sched.calls if c.startswith("drain")] and len(sched.calls) == 1
    assert len(trips) == 2 and all(t.guardrail == "blast_radius" for t in trips)
    drained = [n for n in ("gpu01", "gpu02", "gpu03", "gpu04") if sched.node_state(n).drained]
    assert len(drained) == 1


def test_monitor_mode_recommendation_then_approve(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler(NODES + ["gpu05"], requeue_delay_s=0.2)
    job = sched.submit("train", 4)
    stack = Stack(
        StackConfig(
            data_dir=tmp_path,
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            mode="monitor",
            api_port=0,
            settle_s=1.0,
        ),
        sched,
    ).start()
    try:
        store, api = stack.store, stack.api
        assert store is not None and api is not None
        publish_cascade(broker.bootstrap, tmp_path, job, NODES, culprit="gpu02")
        inc = wait_incident(store, job)
        dec = wait_for(
            "the recommendation",
            lambda: store.query(
                "SELECT * FROM {db}.decisions FINAL WHERE incident_id = {i:String}", {"i": inc["incident_id"]}
            ),
        )[0]
        assert dec["kind"] == "recommendation" and sched.calls == []
        cli = [sys.executable, "-m", "trainmedic.cli.main"]
        common = ["--data-dir", str(tmp_path), "--api", api.url]
        unknown = subprocess.run(
            [*cli, "recommendations", "approve", "dec-doesnotexist", *common, "--operator", "alice"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert unknown.returncode == 2 and "404" in unknown.stderr
        # A wrong token, from the environment: the CLI takes no token on its command line.
        no_token = subprocess.run(
            [*cli, "recommendations", "approve", dec["decision_id"], *common],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "TRAINMEDIC_TOKEN": "wrong-token-123456"},
        )
        assert no_token.returncode == 2 and "401" in no_token.stderr
        assert sched.calls == []  # neither did anything
        ok = subprocess.run(
            [*cli, "recommendations", "approve", dec["decision_id"], *common, "--operator", "alice"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert ok.returncode == 0, ok.stderr
        result = wait_for(
            "the approved action's result",
            lambda: store.query(
                "SELECT * FROM {db}.action_results FINAL WHERE incident_id = {i:String}", {"i": inc["incident_id"]}
            ),
        )[0]
        assert result["status"] == "done"
        act = store.query(
            "SELECT requested_by FROM {db}.actions FINAL WHERE incident_id = {i:String}", {"i": inc["incident_id"]}
        )[0]
        assert act["requested_by"] == "operator:alice"
        again = subprocess.run(
            [*cli, "recommendations", "approve", dec["decision_id"], *common, "--operator", "bob"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert again.returncode == 2 and "already approved" in again.stderr
    finally:
        stack.stop()
    assert sched.calls == ["drain gpu02", f"requeue {job} exclude=gpu02"]


def test_resume_only_nodes_trainmedic_drained_and_audit_it(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    from trainmedic.cli.client import ClientError, call

    sched = SimulatedScheduler(NODES)
    sched.drain_node("gpu01", "trainmedic inc-0123456789abcdef0123: gpu_hardware")
    sched.drain_node("gpu03", "admin: bad PSU")
    # A node drained for a fault of its own returns only after a passing health check.
    policy = tmp_path / "policy.yaml"
    policy.write_text(DEFAULT_POLICY.read_text() + "return_to_service: {health_check: [test, -n, '{node}']}\n")
    stack = Stack(
        StackConfig(
            data_dir=tmp_path,
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            api_port=0,
            policy=policy,
        ),
        sched,
    ).start()
    try:
        assert stack.api is not None and stack.store is not None
        store = stack.store
        token = (tmp_path / "api-token").read_text().strip()
        nodes = {n["node"]: n for n in call(stack.api.url, token, "GET", "/api/nodes")}
        assert nodes["gpu01"]["drained_by_trainmedic"] and nodes["gpu01"]["incident_id"] == "inc-0123456789abcdef0123"
        assert nodes["gpu03"]["drained"] and not nodes["gpu03"]["drained_by_trainmedic"]
        try:
            call(stack.api.url, token, "POST", "/api/nodes/gpu03/resume", {"operator": "alice"})
            raise AssertionError("resuming a node someone else drained must be refused")
        except ClientError as exc:
            assert "409" in str(exc) and "drained by someone else" in str(exc)
        assert sched.node_state("gpu03").drained
        r = call(stack.api.url, token, "POST", "/api/nodes/gpu01/resume", {"operator": "alice", "comment": "reseated"})
        assert r["status"] == "resumed" and not sched.node_state("gpu01").drained
        row = wait_for("the return in the audit", lambda: store.query("SELECT * FROM {db}.node_returns FINAL"))[0]
        assert (row["node"], row["incident_id"], row["operator"]) == ("gpu01", "inc-0123456789abcdef0123", "alice")
        assert (row["outcome"], row["check"], row["check_passed"]) == ("resumed", "test -n gpu01", True)
    finally:
        stack.stop()


def test_another_clusters_action_is_never_acted_on(broker: EmbeddedBroker) -> None:
    """Clusters may share one Kafka: an action stamped with another cluster is passed over (its
    executors, in their own group, carry it out), and the next action of this cluster is done."""
    sched = SimulatedScheduler([f"gpu{i:02d}" for i in range(1, 5)], requeue_delay_s=0.0)
    job = sched.submit("train", 2)
    svc = ExecutorService(broker.bootstrap, Executor(sched, ExecutorSettings(verify_timeout_s=10, group="clusters")))
    thread = threading.Thread(target=svc.run, daemon=True)
    thread.start()
    pub = Publisher(broker.bootstrap, "test")
    pub.publish(ACTIONS, _requeue_action(1, job).model_copy(update={"cluster": "east"}))
    pub.publish(ACTIONS, _requeue_action(2, job))
    assert pub.flush(10) == 0
    results = [decode(ActionResult, v) for v in _read_all(broker.bootstrap, ACTION_RESULTS.name, "r", expect=1)]
    svc.stop_event.set()
    thread.join(30)
    # Only this cluster's action has a result; the other made no scheduler call at all.
    assert [r.action_id for r in results] == ["act-2"] and results[0].status == "done", results
    assert [c for c in sched.calls if c.startswith("requeue")] == [f"requeue {job} exclude="], sched.calls


def _isolation(i: int, job: str, node: str) -> Action:
    """A policy's drain_and_requeue for a Xid 79 the node's own kernel reported."""
    now = time.time()
    return Action(
        event_id=f"act-iso{i}",
        event_time=now,
        action_id=f"act-iso{i}",
        decision_id=f"dec-iso{i}",
        incident_id=f"inc-iso{i}",
        job_id=job,
        node=node,
        partition="gpu",
        action="drain_and_requeue",
        reason=f"trainmedic inc-iso{i}: gpu_hardware",
        requested_by="policy",
        incident_time=now,
        first_signal_time=now - 1,
        node_reported_fault=True,
    )


def test_a_drain_the_blast_radius_refuses_still_requeues_the_job_without_the_node(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    """Issue 40: in a storm, a drain refused by the blast radius skipped the requeue too, and jobs
    kept running on GPUs that had fallen off the bus. With max_drains_per_window spent, the node
    stays in service but the job is requeued with it excluded, and the audit says both; with the
    kill switch on, neither happens."""
    policy = tmp_path / "policy.yaml"
    rails = "guardrails:\n  kill_switch: {}\n  max_drains_per_window: 1\n  max_drain_fraction: 1.0\n"

    def kill_switch(on: bool, mtime: float) -> None:
        policy.write_text(rails.format(str(on).lower()))
        os.utime(policy, (mtime, mtime))  # the executor rereads the file when its mtime changes

    kill_switch(False, 1000.0)
    sched = SimulatedScheduler([f"gpu{i:02d}" for i in range(1, 11)], requeue_delay_s=0.0)
    a, b = sched.submit("a", 4), sched.submit("b", 4)  # gpu01-04, gpu05-08; gpu09-10 free
    store = AuditStore(chdb_url, database)
    store.migrate()
    sink = AuditSink(broker.bootstrap, store, group="audit-refused-drain", batch_wait_s=0.2)
    svc = ExecutorService(
        broker.bootstrap,
        Executor(sched, ExecutorSettings(verify_timeout_s=10, poll_interval_s=0.05, group="refused-drain")),
        Guardrails(GuardrailFile(policy), sched),
    )
    threads = [threading.Thread(target=x.run, daemon=True) for x in (sink, svc)]
    for t in threads:
        t.start()
    pub = Publisher(broker.bootstrap, "test")

    def act(action: Action) -> dict[str, object]:
        pub.publish(ACTIONS, action)
        assert pub.flush(10) == 0
        return wait_for(  # type: ignore[no-any-return]
            f"the result of {action.action_id} in the audit",
            lambda: store.query(
                "SELECT * FROM {db}.action_results FINAL WHERE action_id = {a:String}", {"a": action.action_id}
            ),
        )[0]

    try:
        first = act(_isolation(1, a, "gpu02"))  # the one drain the window allows
        assert first["status"] == "done" and sched.node_state("gpu02").drained
        kill_switch(True, 2000.0)
        braked = act(_isolation(2, b, "gpu06"))
        calls_braked = list(sched.calls)
        kill_switch(False, 3000.0)
        capped = act(_isolation(3, b, "gpu06"))
        trips = wait_for(
            "both trips in the audit",
            lambda: (
                rows
                if len(rows := store.query("SELECT * FROM {db}.guardrail_trips FINAL ORDER BY action_id")) == 2
                else None
            ),
        )
    finally:
        sink.stop_event.set()
        svc.stop_event.set()
        for t in threads:
            t.join(30)
    # The kill switch: no drain, no requeue, a refusal in the audit.
    assert braked["status"] == "skipped" and "guardrail kill_switch" in str(braked["error"])
    assert calls_braked == ["drain gpu02", f"requeue {a} exclude=gpu02"]
    assert [(t["action_id"], t["guardrail"]) for t in trips] == [
        ("act-iso2", "kill_switch"),
        ("act-iso3", "blast_radius"),
    ]
    # The blast radius: gpu06 stays in service, job b is requeued excluding it, and runs elsewhere.
    assert sched.calls == [*calls_braked, f"requeue {b} exclude=gpu06"], sched.calls
    assert not sched.node_state("gpu06").drained
    job = sched.job_state(b)
    assert job.state == "RUNNING" and job.restart_count == 1 and "gpu06" in job.excluded_nodes
    assert "gpu06" not in job.nodes
    # The audit says both: the drain refused (which guardrail, why) and the requeue done.
    steps = " | ".join(capped["steps"])  # type: ignore[arg-type]
    assert capped["status"] == "done" and capped["verified_at"] is not None, capped
    assert "drain gpu06: refused by guardrail blast_radius" in steps and "max_drains_per_window is 1" in steps
    assert f"requeue {b}: verified requeued" in steps and f"job {b}: RUNNING again" in steps
    assert "max_drains_per_window is 1" in str(trips[1]["detail"])
    assert f"the requeue of job {b} with gpu06 excluded is done" in str(trips[1]["detail"])
