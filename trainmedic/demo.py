"""`trainmedic demo`: the whole loop on a simulated cluster, with real broker,
real streams worker, real executor and real chDB audit.

A 4-node job and a healthy 2-node job run on an 8-node simulated cluster; a
GPU on one node of the first job falls off the bus (Xid 79) and the other
ranks then hit NCCL watchdog timeouts. The demo prints what trainmedic saw
and did, with detection and action latency.
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producers.joblogs import JobLayout, JobLogProducer
from producers.kernel import KernelLogProducer
from producers.publisher import Publisher
from schemas.events import SchedEvent
from schemas.ids import stable_id
from schemas.topics import SCHED_EVENTS
from sim.training import GroundTruth, SimJob
from sinks.backends.base import JobState, NodeState
from sinks.backends.simulated import SimulatedScheduler
from trainmedic.runtime import Stack, StackConfig

NODES = [f"gpu{i:02d}" for i in range(1, 9)]
PARTITION = "gpu"


class DemoError(RuntimeError):
    pass


@dataclass
class DemoWorld:
    """The simulated cluster and the node-side producers that watch it."""

    root: Path
    publisher: Publisher
    sched: SimulatedScheduler
    jobs: dict[str, SimJob] = field(default_factory=dict)
    tailers: dict[str, JobLogProducer] = field(default_factory=dict)
    kernels: list[KernelLogProducer] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)

    def on_change(self, kind: str, change: str, state: JobState | NodeState) -> None:
        # The simulated scheduler plays the Slurm producer's part: state changes -> sched.events.
        if not isinstance(state, JobState):
            return
        self.publisher.publish(
            SCHED_EVENTS,
            SchedEvent(
                event_id=stable_id("sched", state.job_id, change, state.restart_count),
                event_time=time.time(),
                kind="job",
                job_id=state.job_id,
                state=change,
                nodes=list(state.nodes),
                partition=state.partition,
            ),
        )
        job = self.jobs.get(state.job_id)
        if job is not None and change == "RUNNING" and state.restart_count > 0:
            tailer = self.tailers[state.job_id]
            tailer.layout = JobLayout(state.nodes, job.ranks_per_node)
            known = {f.path for f in tailer.followers}
            for n in state.nodes:
                if job.log_path(n) not in known:
                    tailer.add_path(job.log_path(n), n)
            job.restart()

    def add_job(self, name: str, num_nodes: int, seed: int) -> SimJob:
        job_id = self.sched.submit(name, num_nodes, PARTITION)
        job = SimJob(self.sched, job_id, self.root / "jobs", self.root / "nodes", seed=seed)
        nodes = job.nodes()
        self.jobs[job_id] = job
        self.tailers[job_id] = JobLogProducer(
            self.publisher,
            job_id,
            [job.log_path(n) for n in nodes],
            JobLayout(nodes, job.ranks_per_node),
            partition=PARTITION,
            node_of_path={job.log_path(n): n for n in nodes},
        )
        job.start()
        return job

    def pump(self) -> None:
        while not self.stop_event.wait(0.1):
            for t in list(self.tailers.values()):
                t.poll_once()
            for k in self.kernels:
                k.poll_once()
            self.sched.tick()


def _wait(what: str, check: Any, timeout: float, stack: Stack | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stack is not None:
            stack.check_alive()
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise DemoError(f"timed out after {timeout:.0f} s waiting for {what}")


def run_demo(
    data_dir: Path, mode: str = "autonomous", warmup_s: float = 3.0, timeout_s: float = 120.0, say: Any = print
) -> dict[str, Any]:
    root = data_dir / "demo"
    shutil.rmtree(root, ignore_errors=True)
    sched = SimulatedScheduler(NODES, PARTITION, requeue_delay_s=1.0)
    say(f"starting the stack (embedded broker, streams worker, executor, chDB audit in {root / 'chdb'}) ...")
    stack = Stack(StackConfig(data_dir=root, mode=mode), sched).start()
    publisher = Publisher(stack.bootstrap, "trainmedic-demo")
    world = DemoWorld(root, publisher, sched)
    sched.subscribe(world.on_change)
    pump = threading.Thread(target=world.pump, daemon=True)
    try:
        victim = world.add_job("llama-70b-pretrain", 4, seed=1)
        healthy = world.add_job("vit-finetune", 2, seed=2)
        for n in NODES:
            kern = victim.kern_path(n)
            kern.parent.mkdir(parents=True, exist_ok=True)
            kern.touch()
            world.kernels.append(KernelLogProducer(publisher, kern, node=n, from_start=True))
        pump.start()
        victim_nodes = victim.nodes()
        say(
            f"job {victim.job_id} (llama-70b-pretrain) running on {','.join(victim_nodes)}; "
            f"job {healthy.job_id} (vit-finetune) on {','.join(healthy.nodes())}; mode {mode}"
        )
        time.sleep(warmup_s)
        culprit = victim_nodes[1]
        truth = victim.inject_xid79(culprit)
        say(
            f"injected: Xid 79 (GPU fallen off the bus) on {culprit}; NCCL watchdog timeouts follow on the other "
            f"nodes after {victim.collective_timeout_s:.0f} s (compressed from the 600 s default)"
        )
        report = _collect(stack, sched, truth, victim.job_id, healthy.job_id, mode, timeout_s)
        report["scheduler_calls"] = list(sched.calls)
        report["job_after"] = _job_dict(sched.job_state(victim.job_id))
        return report
    finally:
        world.stop_event.set()
        for j in world.jobs.values():
            j.stop()
        publisher.flush(5)
        stack.stop()


def _job_dict(s: JobState) -> dict[str, Any]:
    return {
        "job_id": s.job_id,
        "state": s.state,
        "nodes": list(s.nodes),
        "excluded_nodes": list(s.excluded_nodes),
        "restarts": s.restart_count,
    }


def _collect(
    stack: Stack,
    sched: SimulatedScheduler,
    truth: GroundTruth,
    job_id: str,
    healthy_job: str,
    mode: str,
    timeout_s: float,
) -> dict[str, Any]:
    store = stack.store
    assert store is not None and stack.executor is not None
    incident = _wait(
        "the incident in the audit",
        lambda: store.query("SELECT * FROM {db}.incidents FINAL WHERE job_id = {j:String}", {"j": job_id}),
        timeout_s,
        stack,
    )[0]
    decision = _wait(
        "the decision in the audit",
        lambda: store.query(
            "SELECT * FROM {db}.decisions FINAL WHERE incident_id = {i:String}", {"i": incident["incident_id"]}
        ),
        timeout_s,
        stack,
    )[0]
    result = None
    if decision["kind"] == "action":
        result = _wait(
            "the action result in the audit",
            lambda: store.query(
                "SELECT * FROM {db}.action_results FINAL WHERE incident_id = {i:String}", {"i": incident["incident_id"]}
            ),
            timeout_s,
        )[0]
    # Let any late cascade lines be processed, to show they were absorbed, not new incidents.
    time.sleep(1.0)
    incidents = store.query("SELECT job_id, count() AS n FROM {db}.incidents FINAL GROUP BY job_id")
    anomalies = store.query(
        "SELECT count() AS n FROM {db}.anomalies FINAL WHERE job_id = {j:String} OR node = {n:String}",
        {"j": job_id, "n": truth.node},
    )[0]["n"]
    incident_time = incident["event_time"].timestamp()
    detection = incident_time - truth.written_at
    report: dict[str, Any] = {
        "mode": mode,
        "injected": {
            "fault": truth.kind,
            "job_id": truth.job_id,
            "node": truth.node,
            "category": truth.category,
            "expected_action": truth.expected_action,
        },
        "incident": {
            "incident_id": incident["incident_id"],
            "job_id": incident["job_id"],
            "category": incident["category"],
            "culprit": incident["culprit_node"],
            "culprit_rank": incident["culprit_rank"],
            "confidence": round(float(incident["confidence"]), 2),
            "explanation": incident["explanation"],
            "evidence_lines": len(incident["anomaly_ids"]),
            "anomalies_seen": int(anomalies),
        },
        "decision": {
            "action": decision["action"],
            "kind": decision["kind"],
            "mode": decision["mode"],
            "rule": decision["rule"],
            "reason": decision["reason"],
        },
        "action_result": None
        if result is None
        else {
            "status": result["status"],
            "steps": list(result["steps"]),
            "error": result["error"],
        },
        "detection_latency_s": round(detection, 3),
        "action_latency_s": None
        if result is None or result["action_latency_s"] is None
        else round(float(result["action_latency_s"]), 3),
        "incidents_per_job": {r["job_id"]: int(r["n"]) for r in incidents},
        "healthy_job": {
            "job_id": healthy_job,
            "incidents": sum(int(r["n"]) for r in incidents if r["job_id"] == healthy_job),
        },
        "correct": incident["culprit_node"] == truth.node and incident["category"] == truth.category,
    }
    return report
