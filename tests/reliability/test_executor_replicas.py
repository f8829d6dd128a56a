"""Guardrails count attempts, durably, across executor replicas, on the real broker with the
simulated scheduler.

The storm of issue 14: 16 Xid 79 actions at once on a full 64-node cluster whose requeued jobs
never run again within the verify timeout (so every action ends failed), two executor replicas
in one group, `max_drains_per_window: 2`. Before attempts were counted, 6 nodes were drained
(only the 10 % partition fraction stopped it). The 14 drains the cap refuses still requeue their
jobs with the node excluded (issue 40). Also: a replica that lost the acting lease makes
no further call, a drain whose requeue fails counts, and a crash after the attempt record and
before the call counts after the restart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.publish import Publisher
from schemas.codec import decode
from schemas.events import Action, ActionAttempt, ActionResult, GuardrailTrip
from schemas.topics import ACTION_ATTEMPTS, ACTION_RESULTS, ACTIONS, GUARDRAIL_TRIPS
from sinks.backends.simulated import SimulatedScheduler
from sinks.executor import Executor, ExecutorService, ExecutorSettings
from sinks.guardrails import Guardrails, GuardrailSettings
from tests.conftest import REPO, read_topic, wait_for
from trainmedic.stack.broker import EmbeddedBroker

NODES = [f"n{i:02d}" for i in range(64)]
JOBS = 16
NODES_PER_JOB = 4


def xid_action(i: int, job: str | None, node: str, *, own: bool = True) -> Action:
    now = time.time()
    return Action(
        event_id=f"act-r{i}",
        event_time=now,
        action_id=f"act-r{i}",
        decision_id=f"dec-r{i}",
        incident_id=f"inc-r{i}",
        job_id=job,
        node=node,
        partition="gpu",
        action="drain_and_requeue",
        reason=f"trainmedic inc-r{i}: gpu_hardware",
        requested_by="policy",
        incident_time=now,
        first_signal_time=now - 1,
        node_reported_fault=own,  # a Xid 79 comes from the node's own kernel log
    )


def service(
    bootstrap: str,
    sched: SimulatedScheduler,
    name: str,
    rails: GuardrailSettings,
    group: str,
    verify_timeout_s: float = 2.0,
    max_poll_interval_s: float = 300.0,
) -> ExecutorService:
    settings = ExecutorSettings(
        verify_timeout_s=verify_timeout_s, poll_interval_s=0.05, group=group, max_poll_interval_s=max_poll_interval_s
    )
    return ExecutorService(bootstrap, Executor(sched, settings), Guardrails(lambda: rails, sched), client_id=name)


class Replicas:
    """Executor replicas, each on its own named thread (the simulated scheduler notes the caller)."""

    def __init__(self) -> None:
        self.threads: dict[str, threading.Thread] = {}
        self.services: dict[str, ExecutorService] = {}

    def start(self, name: str, svc: ExecutorService) -> ExecutorService:
        t = threading.Thread(target=svc.run, name=name, daemon=True)
        self.threads[name], self.services[name] = t, svc
        t.start()
        return svc

    def stop(self, name: str) -> None:
        self.services[name].stop_event.set()
        self.threads[name].join(60)
        assert not self.threads[name].is_alive(), f"replica {name} did not stop"

    def stop_all(self) -> None:
        for name, t in self.threads.items():
            if t.is_alive():
                self.stop(name)


@pytest.fixture
def replicas() -> Iterator[Replicas]:
    r = Replicas()
    yield r
    r.stop_all()


def results_of(bootstrap: str) -> list[ActionResult]:
    return [decode(ActionResult, v) for v in read_topic(bootstrap, ACTION_RESULTS.name, 1.5)]


def wait_results(bootstrap: str, n: int, timeout: float = 180) -> list[ActionResult]:
    return wait_for(f"{n} action results", lambda: r if len(r := results_of(bootstrap)) >= n else None, timeout=timeout)


@pytest.mark.slow(
    reason="16 drain-and-requeue actions on 64 simulated nodes through two executor replicas, the acting one "
    "stopped mid-storm, and every requeue waited out until it fails verification"
)
def test_storm_on_a_full_cluster_two_replicas_drains_capped(broker: EmbeddedBroker, replicas: Replicas) -> None:
    # 16 jobs x 4 nodes fill all 64 nodes; a requeued job waits an hour (and finds no room):
    # every action's requeue ends "not verified", the case that used to go uncounted.
    sched = SimulatedScheduler(NODES, requeue_delay_s=3600)
    jobs = [sched.submit(f"train-{j}", NODES_PER_JOB) for j in range(JOBS)]
    assert all(sched.job_state(j).state == "RUNNING" for j in jobs) and all(
        sched.node_state(n).state == "ALLOCATED" for n in NODES
    )
    rails = GuardrailSettings(max_drains_per_window=2)  # max_drain_fraction stays 10 %: 6 of 64 nodes
    a = replicas.start("exec-a", service(broker.bootstrap, sched, "exec-a", rails, "storm"))
    b = replicas.start("exec-b", service(broker.bootstrap, sched, "exec-b", rails, "storm"))
    wait_for("one replica holding the acting lease", lambda: a.acting or b.acting, timeout=60)
    actor, standby = ("exec-a", "exec-b") if a.acting else ("exec-b", "exec-a")
    wait_for("the standby in the lease group", lambda: replicas.services[standby]._lease.assignment(), timeout=60)
    assert not replicas.services[standby].acting

    t0 = time.monotonic()
    pub = Publisher(broker.bootstrap, "test")
    for i, job in enumerate(jobs):
        pub.publish(ACTIONS, xid_action(i, job, sched.job_state(job).nodes[i % NODES_PER_JOB]))
    assert pub.flush(10) == 0
    # Mid-storm the acting replica goes away (a rolling update): the standby takes over and must
    # count what its predecessor attempted, read back from action.attempts.
    wait_results(broker.bootstrap, 1)
    replicas.stop(actor)
    results = wait_results(broker.bootstrap, JOBS)
    elapsed = time.monotonic() - t0
    trips = [decode(GuardrailTrip, v) for v in read_topic(broker.bootstrap, GUARDRAIL_TRIPS.name, 1.5)]
    attempts = [decode(ActionAttempt, v) for v in read_topic(broker.bootstrap, ACTION_ATTEMPTS.name, 1.5)]

    drains = [c for c in sched.calls if c.startswith("drain")]
    drained = [n for n in NODES if sched.node_state(n).drained]
    by_status = {s: sum(1 for r in results if r.status == s) for s in ("done", "failed", "skipped")}
    print(
        f"\nstorm: {JOBS} actions, 2 replicas, takeover mid-storm: {len(drains)} drain call(s) {drains}, "
        f"{len(drained)} node(s) drained, results {by_status}, {len(trips)} trips "
        f"({sorted({t.guardrail for t in trips})}), {len(attempts)} attempt records, {elapsed:.1f} s"
    )
    assert len(drains) == 2 and len(drained) == 2, sched.calls
    assert sorted(r.action_id for r in results) == sorted(f"act-r{i}" for i in range(JOBS)), "each result once"
    # Every job is requeued, the 14 whose drain the cap refused too; none runs again in time.
    assert by_status == {"done": 0, "failed": JOBS, "skipped": 0}
    assert all("not verified" in (r.error or "") for r in results if r.status == "failed")
    capped = [r for r in results if "refused by guardrail blast_radius" in r.steps[0]]
    assert len(capped) == JOBS - 2 and all("verified requeued" in r.steps[1] for r in capped)
    assert len(trips) == JOBS - 2 and {t.guardrail for t in trips} == {"blast_radius"}
    assert all("max_drains_per_window is 2" in t.detail for t in trips)
    # Both replicas' work is in the one log: 2 drains, and every job's requeue.
    assert sorted(x.call for x in attempts) == ["drain", "drain"] + ["requeue"] * JOBS
    assert sum(1 for c in sched.calls if c.startswith("requeue")) == JOBS
    assert replicas.services[standby].results, "the standby took over and handled the rest"
    assert {x.executor for x in attempts} <= {s.replica for s in replicas.services.values()}


def test_replica_that_lost_the_lease_makes_no_further_call(broker: EmbeddedBroker, replicas: Replicas) -> None:
    """The acting replica is stuck in a slow scheduler call past its poll interval: its groups evict
    it and the standby takes over. When its call returns, it is fenced before the next one."""
    nodes = [f"gpu{i:02d}" for i in range(1, 9)]
    sched = SimulatedScheduler(nodes, requeue_delay_s=0.0)
    job = sched.submit("train", 4)
    rails = GuardrailSettings(max_drains_per_window=5, max_drain_fraction=1.0)
    kw = {"group": "fence", "verify_timeout_s": 20.0, "max_poll_interval_s": 7.0}
    a = replicas.start("exec-a", service(broker.bootstrap, sched, "exec-a", rails, **kw))  # type: ignore[arg-type]
    wait_for("exec-a holding the acting lease", lambda: a.acting, timeout=60)
    b = replicas.start("exec-b", service(broker.bootstrap, sched, "exec-b", rails, **kw))  # type: ignore[arg-type]
    wait_for("exec-b standing by in the lease group", lambda: b._lease.assignment() and a.acting, timeout=60)
    assert not b.acting

    sched.call_latency_s = 12.0  # slurmctld answers after 12 s: longer than max_poll_interval_s
    pub = Publisher(broker.bootstrap, "test")
    pub.publish(ACTIONS, xid_action(1, job, "gpu02"))
    assert pub.flush(10) == 0
    wait_for("exec-a's drain attempt", lambda: a.attempts, timeout=60)
    wait_for("exec-b taking over the lease", lambda: b.acting, timeout=60)
    sched.call_latency_s = 0.0
    # When its drain returns, exec-a is fenced at its next call (the requeue) or when it would
    # publish the result. It would take the lease back on rejoining (its member id sorts first,
    # and then rightly carry on, having read the attempts back): it is stopped once fenced.
    wait_for("exec-a to find it was fenced", lambda: a.fenced, timeout=60)
    replicas.stop("exec-a")
    result = wait_results(broker.bootstrap, 1, timeout=120)[0]
    assert result.status == "done", result
    calls = list(zip(sched.callers, sched.calls, strict=True))
    print(f"\nfenced replica: calls {calls}; exec-a fenced {a.fenced}x, attempts by a {[x.call for x in a.attempts]}")
    # exec-a's drain was in flight when it lost the lease; it made no call after it.
    assert [c for who, c in calls if who == "exec-a"] == ["drain gpu02"]
    assert [c for who, c in calls if who == "exec-b" and c.startswith("requeue")] == [f"requeue {job} exclude=gpu02"]
    assert a.results == [] and [r.action_id for r in b.results] == ["act-r1"]
    assert [x.call for x in a.attempts] == ["drain"], "no confirmed attempt of exec-a after the takeover"
    state = sched.job_state(job)
    assert state.state == "RUNNING" and "gpu02" not in state.nodes and state.restart_count == 1


def test_drain_whose_requeue_fails_is_counted(broker: EmbeddedBroker, replicas: Replicas) -> None:
    nodes = [f"gpu{i:02d}" for i in range(1, 10)]
    sched = SimulatedScheduler(nodes, requeue_delay_s=0.0)
    stuck = sched.submit("no-requeue", 4, requeue=False)  # gpu01-04; `scontrol requeue` refuses it
    other = sched.submit("other", 4)  # gpu05-08; gpu09 free
    rails = GuardrailSettings(max_drains_per_window=1, max_drain_fraction=1.0, node_cooldown_s=600)
    replicas.start("exec-a", service(broker.bootstrap, sched, "exec-a", rails, "requeue-fails"))
    pub = Publisher(broker.bootstrap, "test")
    pub.publish(ACTIONS, xid_action(1, stuck, "gpu02"))
    assert pub.flush(10) == 0
    first = wait_results(broker.bootstrap, 1)[0]
    assert first.status == "failed" and "not requeueable" in (first.error or ""), first
    pub.publish(ACTIONS, xid_action(2, other, "gpu06"))  # another node within the window
    pub.publish(ACTIONS, xid_action(3, None, "gpu02"))  # the same node again, another incident
    assert pub.flush(10) == 0
    results = {r.action_id: r for r in wait_results(broker.bootstrap, 3)}
    # The cap keeps gpu06 in service; its job is still requeued without it.
    refused = results["act-r2"].steps[0]
    assert results["act-r2"].status == "done" and "refused by guardrail blast_radius" in refused
    assert "gpu02" in refused and not sched.node_state("gpu06").drained
    assert "gpu06" in sched.job_state(other).excluded_nodes
    assert results["act-r3"].status == "skipped" and "guardrail node_cooldown" in (results["act-r3"].error or "")
    assert [c for c in sched.calls if c.startswith("drain")] == ["drain gpu02"]


# A replica in its own process, on its own (simulated) cluster whose controller takes a minute
# to answer: it records the drain attempt, and is killed while the call has not landed.
CHILD = textwrap.dedent(
    """
    import logging, sys
    from sinks.backends.simulated import SimulatedScheduler
    from sinks.executor import Executor, ExecutorService, ExecutorSettings
    from sinks.guardrails import Guardrails, GuardrailSettings
    logging.basicConfig(level=logging.INFO)
    sched = SimulatedScheduler([f"gpu{i:02d}" for i in range(1, 10)], call_latency_s=600)
    sched.submit("a", 4), sched.submit("b", 4)
    rails = GuardrailSettings(max_drains_per_window=1, max_drain_fraction=1.0)
    ExecutorService(sys.argv[1], Executor(sched, ExecutorSettings(group="crash")), Guardrails(lambda: rails, sched),
                    client_id="exec-child").run()
    """
)


def test_crash_after_the_attempt_record_counts_after_restart(
    broker: EmbeddedBroker, replicas: Replicas, tmp_path: Path
) -> None:
    log = tmp_path / "child.log"
    with open(log, "wb") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, broker.bootstrap],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    try:
        pub = Publisher(broker.bootstrap, "test")
        pub.publish(ACTIONS, xid_action(1, "1001", "gpu02"))
        assert pub.flush(10) == 0
        wait_for(
            "the child's drain attempt on action.attempts",
            lambda: read_topic(broker.bootstrap, ACTION_ATTEMPTS.name, 2.0),
            timeout=90,
        )
        child.send_signal(signal.SIGKILL)  # inside drain_node, before the drain landed
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    # The same cluster after the crash: the drain never landed, but Slurm's node health check has
    # since drained gpu02 itself, so the redelivered action makes no drain call of its own.
    sched = SimulatedScheduler([f"gpu{i:02d}" for i in range(1, 11)], requeue_delay_s=0.0)
    job_a, job_b = sched.submit("a", 4), sched.submit("b", 4)  # gpu01-04, gpu05-08; gpu09-10 free
    sched.drain_node("gpu02", "NHC: GPU has fallen off the bus")
    rails = GuardrailSettings(max_drains_per_window=1, max_drain_fraction=1.0)
    replicas.start("exec-a", service(broker.bootstrap, sched, "exec-a", rails, "crash"))
    pub.publish(ACTIONS, xid_action(2, job_b, "gpu06"))
    assert pub.flush(10) == 0
    results = {r.action_id: r for r in wait_results(broker.bootstrap, 2)}
    assert results["act-r1"].status == "done" and "already drained by someone else" in " ".join(results["act-r1"].steps)
    # The counted drain attempt spent the window: gpu06 stays in service, job b is requeued without it.
    refused = results["act-r2"].steps[0]
    assert results["act-r2"].status == "done", results["act-r2"]
    assert "refused by guardrail blast_radius" in refused and "gpu02" in refused
    assert not sched.node_state("gpu06").drained and "gpu06" in sched.job_state(job_b).excluded_nodes
    assert sched.job_state(job_a).restart_count == 1  # the redelivered action finished its requeue
