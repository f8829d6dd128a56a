"""`trainmedic demo`: the whole loop on a simulated cluster, with real broker,
real streams worker, real executor and real chDB audit.

A 4-node job and a healthy 2-node job run on an 8-node simulated cluster; a
GPU on one node of the first job falls off the bus (Xid 79) and the other
ranks then hit NCCL watchdog timeouts. The demo prints what trainmedic saw
and did, with detection and action latency.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bus.publish import Publisher
from producers.joblogs import JobLayout, JobLogProducer
from producers.kernel import KernelLogProducer
from schemas.errors import TrainmedicError
from schemas.events import SchedEvent
from schemas.ids import stable_id
from schemas.topics import SCHED_EVENTS
from sim.training import GroundTruth, SimJob
from sinks.backends.base import BackendError, JobState, NodeState, SchedulerBackend
from sinks.backends.simulated import SimulatedScheduler
from sinks.backends.slurm_cli import SlurmCliBackend
from trainmedic.stack.runtime import Stack, StackConfig

NODES = [f"gpu{i:02d}" for i in range(1, 9)]
PARTITION = "gpu"
LOCAL_SLURM_CONF = Path("/tmp/trainmedic-slurm/etc/slurm.conf")


class DemoError(TrainmedicError, RuntimeError):
    pass


@dataclass
class DemoWorld:
    """The simulated training jobs and the node-side producers that watch them."""

    root: Path
    publisher: Publisher
    sched: SchedulerBackend
    partition: str = PARTITION
    jobs: dict[str, SimJob] = field(default_factory=dict)
    tailers: dict[str, JobLogProducer] = field(default_factory=dict)
    kernels: list[KernelLogProducer] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    stop_event: threading.Event = field(default_factory=threading.Event)

    def publish_sched(self, kind: str, change: str, state: JobState | NodeState) -> None:
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
                job_name=state.name,
                user=state.extra.get("user"),
                account=state.extra.get("account"),
                # As the Slurm producer reports them: the restart budget and the lineage count requeues.
                restart_count=state.restart_count,
                comment=state.comment,
            ),
        )

    def watch(self, job_id: str) -> SimJob:
        """Start the simulated training processes of a job the scheduler placed."""
        job = SimJob(self.sched, job_id, self.root / "jobs", self.root / "nodes", seed=len(self.jobs) + 1)
        nodes = job.nodes()
        self.jobs[job_id] = job
        self.restarts[job_id] = self.sched.job_state(job_id).restart_count
        self.tailers[job_id] = JobLogProducer(
            self.publisher,
            job_id,
            [job.log_path(n) for n in nodes],
            JobLayout(nodes, job.ranks_per_node),
            partition=self.partition,
            node_of_path={job.log_path(n): n for n in nodes},
        )
        job.start()
        return job

    def _follow_restarts(self) -> None:
        # A requeued job that runs again restarts its processes on its new nodes.
        for job_id, job in self.jobs.items():
            state = self.sched.job_state(job_id)
            if state.state != "RUNNING" or state.restart_count <= self.restarts[job_id]:
                continue
            self.restarts[job_id] = state.restart_count
            tailer = self.tailers[job_id]
            tailer.layout = JobLayout(state.nodes, job.ranks_per_node)
            known = {f.path for f in tailer.followers}
            for n in state.nodes:
                if job.log_path(n) not in known:
                    tailer.add_path(job.log_path(n), n)
            job.restart()

    def pump(self) -> None:
        ticks = 0
        while not self.stop_event.wait(0.1):
            for t in list(self.tailers.values()):
                t.poll_once()
            for k in self.kernels:
                k.poll_once()
            ticks += 1
            if ticks % 5 == 0:
                self._follow_restarts()


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


def _slurm_conf() -> str | None:
    return os.environ.get("SLURM_CONF") or (str(LOCAL_SLURM_CONF) if LOCAL_SLURM_CONF.exists() else None)


def _slurm_backend() -> SlurmCliBackend:
    backend = SlurmCliBackend(slurm_conf=_slurm_conf())
    try:
        backend.node_state("gpu01")
    except BackendError as exc:
        raise DemoError(
            f"--slurm needs the local Slurm cluster (nodes gpu01..gpu04): run `infra/slurm/start.sh` as root first ({exc})"
        ) from None
    return backend


def _sbatch(name: str) -> str:
    env = dict(os.environ)
    conf = _slurm_conf()
    if conf:
        env["SLURM_CONF"] = conf
    # 3-4 nodes: it gets all four now and can run on three once the culprit is excluded.
    proc = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=3-4",
            "--requeue",
            f"--job-name={name}",
            "--output=/dev/null",
            "--wrap",
            "sleep 3600",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    if proc.returncode != 0:
        raise DemoError(f"sbatch failed: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def run_demo(
    data_dir: Path,
    mode: str = "autonomous",
    slurm: bool = False,
    warmup_s: float = 3.0,
    timeout_s: float = 120.0,
    say: Any = print,
) -> dict[str, Any]:
    root = data_dir / "demo"
    shutil.rmtree(root, ignore_errors=True)
    sim: SimulatedScheduler | None = None
    backend: SchedulerBackend
    if slurm:
        backend = _slurm_backend()
    else:
        backend = sim = SimulatedScheduler(NODES, PARTITION, requeue_delay_s=1.0)
    say(f"starting the stack (embedded broker, streams worker, executor, chDB audit in {root / 'chdb'}) ...")
    stack = Stack(StackConfig(data_dir=root, mode=mode), backend).start()
    publisher = Publisher(stack.bootstrap, "trainmedic-demo")
    world = DemoWorld(root, publisher, backend)
    pump = threading.Thread(target=world.pump, daemon=True)
    slurm_job: str | None = None
    try:
        if sim is not None:
            sim.subscribe(world.publish_sched)
            victim = world.watch(sim.submit("llama-70b-pretrain", 4, PARTITION))
            healthy: SimJob | None = world.watch(sim.submit("vit-finetune", 2, PARTITION))
        else:
            assert isinstance(backend, SlurmCliBackend)
            slurm_job = _sbatch("llama-70b-pretrain")
            _wait(
                f"Slurm job {slurm_job} RUNNING on 4 nodes",
                lambda: (
                    backend.job_state(slurm_job or "").state == "RUNNING"
                    and len(backend.job_state(slurm_job or "").nodes) == 4
                ),
                60,
                stack,
            )
            # What the Slurm producer tells a deployment: where the job runs. Without it a Xid
            # that comes before the job's first log anomaly has no job to join (a race under load).
            world.publish_sched("job", "RUNNING", backend.job_state(slurm_job))
            victim, healthy = world.watch(slurm_job), None
        for n in NODES if sim is not None else victim.nodes():
            kern = victim.kern_path(n)
            kern.parent.mkdir(parents=True, exist_ok=True)
            kern.touch()
            world.kernels.append(KernelLogProducer(publisher, kern, node=n, from_start=True))
        pump.start()
        victim_nodes = victim.nodes()
        say(
            f"job {victim.job_id} (llama-70b-pretrain) running on {','.join(victim_nodes)}"
            + (f"; job {healthy.job_id} (vit-finetune) on {','.join(healthy.nodes())}" if healthy else "")
            + f"; scheduler {backend.name}; mode {mode}"
        )
        time.sleep(warmup_s)
        culprit = victim_nodes[1]
        truth = victim.inject_xid79(culprit)
        say(
            f"injected: Xid 79 (GPU fallen off the bus) on {culprit}; NCCL watchdog timeouts follow on the other "
            f"nodes after {victim.collective_timeout_s:.0f} s (compressed from the 600 s default)"
        )
        report = _collect(stack, truth, victim.job_id, healthy.job_id if healthy else None, mode, timeout_s)
        report["scheduler"] = backend.name
        report["scheduler_calls"] = list(sim.calls) if sim is not None else _slurm_calls(report)
        report["job_after"] = _job_dict(backend.job_state(victim.job_id))
        return report
    finally:
        world.stop_event.set()
        for j in world.jobs.values():
            j.stop()
        publisher.flush(5)
        stack.stop()
        if slurm_job is not None and isinstance(backend, SlurmCliBackend):
            _cleanup_slurm(backend, slurm_job, say)


def _slurm_calls(report: dict[str, Any]) -> list[str]:
    res = report.get("action_result")
    calls = [step.split(":")[0] for step in res["steps"]] if res else []
    return [c for c in calls if c.split(" ")[0] in ("drain", "requeue", "stop")]


def _cleanup_slurm(backend: SlurmCliBackend, job_id: str, say: Any) -> None:
    """Leave the local cluster as we found it: cancel the demo job, undrain what the demo drained."""
    with contextlib.suppress(BackendError):
        backend.cancel_job(job_id)
    for n in ("gpu01", "gpu02", "gpu03", "gpu04"):
        with contextlib.suppress(BackendError):
            state = backend.node_state(n)
            if state.drained and state.reason and state.reason.startswith("trainmedic "):
                backend.resume_node(n)
                say(f"cleanup: cancelled demo job {job_id}, resumed {n}")


def _evidence_summary(evidence_json: str) -> list[str]:
    by_sig: dict[str, tuple[int, set[str]]] = {}
    for e in orjson.loads(evidence_json):
        n, nodes = by_sig.get(e["signature"], (0, set()))
        nodes.add(e["node"] or "?")
        by_sig[e["signature"]] = (n + 1, nodes)
    return [f"{sig} x{n} ({','.join(sorted(nodes))})" for sig, (n, nodes) in by_sig.items()]


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
    truth: GroundTruth,
    job_id: str,
    healthy_job: str | None,
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
            "evidence_summary": _evidence_summary(incident["evidence"]),
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
