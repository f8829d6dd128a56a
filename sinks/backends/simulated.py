"""An in-memory scheduler with Slurm's semantics, for the demo and the simulator.

Implements SchedulerBackend, so the executor cannot tell it from Slurm:
drained nodes take no new jobs, a requeued job waits `requeue_delay_s`
(Slurm waits for cred_expire) and then runs on nodes it does not exclude.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sinks.backends.base import BackendError, JobState, NodeState, refuse_relabel

Listener = Callable[[str, str, JobState | NodeState], None]  # (kind, change, new state)


@dataclass
class _Node:
    name: str
    partition: str
    drained: bool = False
    reason: str | None = None
    down: bool = False
    reboot: bool = False  # a reboot was asked for (reboot_node); it stays drained


@dataclass
class _Job:
    job_id: str
    name: str
    partition: str
    num_nodes: int
    state: str = "PENDING"
    nodes: tuple[str, ...] = ()
    excluded: set[str] = field(default_factory=set)
    restarts: int = 0
    held: bool = False
    eligible_at: float = 0.0
    comment: str | None = None
    requeue: bool = True  # Slurm's --requeue/--no-requeue


class SimulatedScheduler:
    name = "simulated"

    def __init__(
        self, nodes: Sequence[str], partition: str = "gpu", requeue_delay_s: float = 1.0, call_latency_s: float = 0.0
    ) -> None:
        self._lock = threading.RLock()
        self._nodes = {n: _Node(n, partition) for n in nodes}
        self._jobs: dict[str, _Job] = {}
        self._next_id = 1000
        self.requeue_delay_s = requeue_delay_s
        self._listeners: list[Listener] = []
        self.calls: list[str] = []  # every mutating call, for tests and the demo report
        self.callers: list[str] = []  # the thread that made each of `calls`
        # How long each mutating call takes before it lands, as on a busy slurmctld (outside the
        # lock: other clients keep reading the cluster meanwhile). May be changed at any time.
        self.call_latency_s = call_latency_s

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _called(self, call: str) -> None:
        self.calls.append(call)
        self.callers.append(threading.current_thread().name)

    def _slow(self) -> None:
        if self.call_latency_s > 0:
            time.sleep(self.call_latency_s)

    def _emit(self, kind: str, change: str, state: JobState | NodeState) -> None:
        for listener in self._listeners:
            listener(kind, change, state)

    # -- job submission (what sbatch does) ------------------------------------------

    def submit(self, name: str, num_nodes: int, partition: str = "gpu", requeue: bool = True) -> str:
        with self._lock:
            self._next_id += 1
            job = _Job(str(self._next_id), name, partition, num_nodes, requeue=requeue)
            self._jobs[job.job_id] = job
            self._schedule(time.time())
            return job.job_id

    def _busy(self) -> set[str]:
        return {n for j in self._jobs.values() if j.state == "RUNNING" for n in j.nodes}

    def _schedule(self, now: float) -> None:
        for job in sorted(self._jobs.values(), key=lambda j: int(j.job_id)):
            if job.state != "PENDING" or job.held or now < job.eligible_at:
                continue
            busy = self._busy()
            free = [
                n.name
                for n in self._nodes.values()
                if not n.drained
                and not n.down
                and n.name not in busy
                and n.name not in job.excluded
                and n.partition == job.partition
            ]
            if len(free) >= job.num_nodes:
                job.nodes = tuple(sorted(free)[: job.num_nodes])
                job.state = "RUNNING"
                self._emit("job", "RUNNING", self._job_view(job))

    def tick(self) -> None:
        with self._lock:
            self._schedule(time.time())

    # -- SchedulerBackend ---------------------------------------------------------------

    def _node(self, node: str) -> _Node:
        try:
            return self._nodes[node]
        except KeyError:
            raise BackendError(f"simulated: no such node {node!r}") from None

    def _job(self, job_id: str) -> _Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise BackendError(f"simulated: no such job {job_id!r}") from None

    def drain_node(self, node: str, reason: str, *, node_failed: bool = False) -> None:
        self._slow()
        with self._lock:
            n = self._node(node)
            n.drained, n.reason = True, reason
            self._called(f"drain {node}")
            self._emit("node", "DRAIN", self._node_view(n))

    def reboot_node(self, node: str, reason: str) -> str:
        with self._lock:
            n = self._node(node)
            refuse_relabel(node, self._node_view(n))
            n.reason, n.reboot = reason, True
            self._called(f"reboot {node}")
        return "DRAIN"

    def relabel_node(self, node: str, reason: str) -> None:
        with self._lock:
            n = self._node(node)
            refuse_relabel(node, self._node_view(n))
            n.reason = reason
            self._called(f"relabel {node}")

    def resume_node(self, node: str) -> None:
        self._slow()
        with self._lock:
            n = self._node(node)
            n.drained, n.reason = False, None
            self._called(f"resume {node}")
            self._schedule(time.time())

    def requeue_job(self, job_id: str, exclude_nodes: Sequence[str]) -> None:
        self._slow()
        with self._lock:
            job = self._job(job_id)
            if job.state not in ("RUNNING", "PENDING"):
                raise BackendError(f"simulated: job {job_id} is {job.state}, cannot requeue")
            if not job.requeue and job.state == "RUNNING":
                # As `scontrol requeue` on a job submitted with --no-requeue.
                raise BackendError(f"simulated: job {job_id} is not requeueable (--no-requeue)")
            job.excluded.update(exclude_nodes)
            if job.state == "PENDING":
                # As Slurm: a queued job is only narrowed, not restarted.
                self._called(f"exclude {job_id} {','.join(sorted(exclude_nodes))}")
                return
            job.state, job.nodes = "PENDING", ()
            job.restarts += 1
            job.eligible_at = time.time() + self.requeue_delay_s
            self._called(f"requeue {job_id} exclude={','.join(sorted(exclude_nodes))}")
            self._emit("job", "REQUEUED", self._job_view(job))

    def cancel_job(self, job_id: str) -> None:
        self._slow()
        with self._lock:
            job = self._job(job_id)
            job.state, job.nodes = "CANCELLED", ()
            self._called(f"cancel {job_id}")
            self._emit("job", "CANCELLED", self._job_view(job))
            self._schedule(time.time())

    def signal_job(self, job_id: str, signal: str) -> None:
        self._slow()
        with self._lock:
            job = self._job(job_id)
            if job.state != "RUNNING":
                raise BackendError(f"simulated: job {job_id} is {job.state}, not signalled")
            self._called(f"signal {job_id} {signal}")

    def hold_job(self, job_id: str) -> None:
        self._slow()
        with self._lock:
            job = self._job(job_id)
            if job.state == "RUNNING":
                job.state, job.nodes = "PENDING", ()
                job.restarts += 1
            job.held = True
            self._called(f"hold {job_id}")

    def release_job(self, job_id: str) -> None:
        self._slow()
        with self._lock:
            self._job(job_id).held = False
            self._called(f"release {job_id}")
            self._schedule(time.time())

    def annotate_job(self, job_id: str, note: str) -> None:
        with self._lock:
            self._job(job_id).comment = note

    def node_state(self, node: str) -> NodeState:
        with self._lock:
            self._schedule(time.time())
            return self._node_view(self._node(node))

    def list_nodes(self) -> list[NodeState]:
        with self._lock:
            self._schedule(time.time())
            # The busy set once, not once per node: per node it made a listing quadratic in the
            # cluster (3,072 nodes: 9.4 M set insertions per call, the executor's guardrail reads it).
            busy = self._busy()
            return [self._node_view(n, busy) for n in self._nodes.values()]

    def job_state(self, job_id: str) -> JobState:
        with self._lock:
            self._schedule(time.time())
            return self._job_view(self._job(job_id))

    def _node_view(self, n: _Node, busy: set[str] | None = None) -> NodeState:
        allocated = n.name in (self._busy() if busy is None else busy)
        state = "DOWN" if n.down else ("ALLOCATED" if allocated else "IDLE")
        flags = (("DRAIN",) if n.drained else ()) + (("REBOOT_REQUESTED",) if n.reboot else ())
        return NodeState(n.name, state, flags, n.reason, (n.partition,))

    def _job_view(self, j: _Job) -> JobState:
        return JobState(
            job_id=j.job_id,
            state=j.state,
            nodes=j.nodes,
            excluded_nodes=tuple(sorted(j.excluded)),
            partition=j.partition,
            name=j.name,
            restart_count=j.restarts,
            comment=j.comment,
            held=j.held,
        )
