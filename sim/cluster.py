"""A simulated GPU cluster at scale: N nodes x 8 GPUs, many multi-node jobs, faults.

What it produces, as the real producers would:

- per node, one GpuSample per second with its 8 GPUs (`sim.gpus`), spread evenly over the
  second so that 1,024 nodes do not arrive in one burst;
- per job, Megatron-LM style iteration lines at the job's own step rate, printed by the first
  rank of every node (torchrun ``[rankN]:`` prefixes, one output file per node as
  ``srun -o %N.out``), with checkpoint saves that pause training, a slow first step after
  every (re)start, NCCL init lines and fp16 loss-scale overflow messages (healthy noise);
- kernel lines (NVRM Xid, mlx5 link state) per node;
- scheduler events (job RUNNING / REQUEUED / CANCELLED / FAILED, node DRAIN / DOWN) from a
  `ClusterScheduler` that the executor acts on, exactly as on the demo's simulated Slurm.

Two transports. ``direct`` builds the events a tailer would publish (LogBatch and
ProgressBatch per job output file per tick, with the real rank-prefix splitting and progress
parser; KernelEvent with the real kernel-line parser) and publishes them with
bus.publish.Publisher: cheap enough for 1,024 nodes on two cores. ``files`` writes real
files and runs the real JobLogProducer / KernelLogProducer over them (small clusters).
GPU samples and scheduler events are published directly in both.

Determinism: the job mix, every job's step times, losses and checkpoints, every node's GPU
noise and the fault plan come from `random.Random` streams derived from the seed (one per job
and per node), and every line carries the time its schedule gives it (`t0 + offset`), not the
time the loop got to it. Wall-clock effects remain where the real pipeline acts back on the
cluster (when a requeued job runs again).
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import orjson

from bus.publish import Publisher
from producers.gpu_edge import EdgeSummary, node_phase, payload_health
from producers.joblogs import JobLayout, JobLogProducer, split_rank_prefix
from producers.kernel import KernelLogProducer, parse_kernel_line, to_event
from producers.progress import ProgressParser
from schemas.codec import encode
from schemas.events import SCHEMA_VERSION, Event, GpuSample, LogBatch, LogLine, ProgressBatch, SchedEvent
from schemas.ids import stable_id
from schemas.topics import GPU_SAMPLES, JOB_LOGS, JOB_PROGRESS, NODE_KERNEL, SCHED_EVENTS, Topic, partition_key
from sim import faults as F
from sim.gpus import GPU_PCI, GPUS_PER_NODE, NodeGpus, gpu_index_of, sample_event, sample_payload
from sinks.backends.base import JobState, NodeState
from sinks.backends.simulated import SimulatedScheduler

log = logging.getLogger("trainmedic.sim.cluster")

Transport = Literal["direct", "files"]
Payload = Literal["fast", "model"]
JobStatus = Literal["running", "blocked", "hung", "pending", "ended"]


class RawPublisher(Protocol):
    """What the simulator needs of bus.publish.Publisher."""

    def publish_raw(self, topic_name: str, payload: bytes, key: bytes | None = None) -> None: ...


HANG_FLOOR_S = 30.0  # streams.detectors.hang.HangDetector's default floor_s


def node_name(i: int) -> str:
    return f"gpu{i:04d}"


# --- the scheduler -----------------------------------------------------------------------------


class ClusterScheduler(SimulatedScheduler):
    """The demo's simulated Slurm plus what a cluster does on its own: nodes stop
    responding, and jobs fail when their processes exit."""

    def set_node_down(self, node: str, reason: str) -> None:
        with self._lock:
            n = self._node(node)
            n.down, n.reason = True, reason
            view = self._node_view(n)
            self._emit("node", "DOWN", NodeState(view.name, "DOWN", ("NOT_RESPONDING",), reason, view.partitions))

    def fail_job(self, job_id: str, restarts: int, state: str = "FAILED") -> bool:
        """The job's processes all exited: it ends, unless it was requeued meanwhile."""
        with self._lock:
            job = self._job(job_id)
            if job.state != "RUNNING" or job.restarts != restarts:
                return False
            job.state, job.nodes = state, ()
            self._emit("job", state, self._job_view(job))
            self._schedule(time.time())
            return True


# --- configuration and ground truth -------------------------------------------------------------


@dataclass
class ClusterConfig:
    nodes: int = 64
    seed: int = 0
    partition: str = "gpu"
    transport: Transport = "direct"
    payload: Payload = "fast"
    root: Path | None = None  # files transport: where job output and kernel logs go
    spare_fraction: float = 0.15  # nodes left free for requeued jobs
    min_spare: int = 4
    job_sizes: tuple[tuple[int, float], ...] = ((2, 0.40), (4, 0.35), (8, 0.18), (16, 0.07))
    step_s: tuple[float, float] = (1.5, 4.5)
    tick_s: float = 0.2
    gpu_interval_s: float = 1.0
    # Edge aggregation as the node producer does it (`produce gpu --summary-every`): every node is
    # still read each gpu_interval_s, but producers.gpu_edge.EdgeSummary decides what is published.
    gpu_summary_every_s: float | None = None
    nccl_timeout_s: float = 10.0  # stands in for NCCL's 600 s watchdog (compressed)
    requeue_delay_s: float = 1.0
    backdate_s: float = 0.0  # >0: jobs were already running this long when the sim starts
    first_step_extra_s: tuple[float, float] = (12.0, 25.0)  # compilation, data loading, checkpoint load
    ckpt_every: tuple[int, int] = (40, 90)
    ckpt_pause_s: tuple[float, float] = (10.0, 45.0)
    overflow_p: float = 0.01
    per_node_progress_fraction: float = 0.5  # the other jobs print progress on their last rank only
    straggler_slowdown: float = 1.35  # a throttled node slows the whole synchronous job
    ranks_per_node: int = GPUS_PER_NODE


@dataclass
class Injection:
    """One injected fault and its ground truth."""

    seq: int
    kind: str
    at_s: float  # planned offset from the start of the simulation
    job_id: str
    node: str
    rank: int | None
    gpu: int | None
    category: str
    expected_action: str
    culprit: str | None  # the node attribution must name (None: not part of the truth)
    job_nodes: tuple[str, ...] = ()
    job_gpus: int = 0
    run_before: int = 0
    free_nodes: int = 0  # idle, undrained nodes when it happened (for the status quo's requeue)
    first_fit_relands: bool = False  # a plain requeue placed first-fit would land on the node again
    injected_at: float | None = None  # wall time it happened
    signal_at: float | None = None  # when the first fault signal was written / published
    skipped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class SchedRecord:
    t: float
    kind: str
    change: str
    job_id: str | None
    node: str | None
    restarts: int
    nodes: tuple[str, ...]


@dataclass
class _Job:
    job_id: str
    name: str
    size: int
    rng: random.Random
    step_s: float
    gbs: int
    total: int
    ckpt_every: int
    nodes: tuple[str, ...] = ()
    run: int = 0
    status: JobStatus = "pending"
    step: int = 0
    last_ckpt: int = 0
    phase: Literal["train", "ckpt"] = "train"
    next_at: float = 0.0
    ckpt_path: str = ""
    slow: float = 1.0
    nan: bool = False
    silent: set[str] = field(default_factory=set)
    loss_scale: float = 65536.0
    first_step: bool = False
    first_extra: float = 0.0
    per_node: bool = True  # progress printed on every node (torchtitan-like) or the last rank only (Megatron)


# --- the cluster ----------------------------------------------------------------------------------


class SimCluster:
    def __init__(self, config: ClusterConfig, publisher: RawPublisher | None = None) -> None:
        self.cfg = config
        self.publisher: RawPublisher | None = publisher
        self.rng = random.Random(f"{config.seed}:cluster")
        self.node_names = [node_name(i) for i in range(1, config.nodes + 1)]
        self.sched = ClusterScheduler(self.node_names, config.partition, requeue_delay_s=config.requeue_delay_s)
        self.gpus = {n: NodeGpus(n, random.Random(f"{config.seed}:gpu:{n}")) for n in self.node_names}
        self.node_index = {n: i for i, n in enumerate(self.node_names)}
        self.jobs: dict[str, _Job] = {}
        self.injections: list[Injection] = []
        self.sched_log: list[SchedRecord] = []
        self.sent: Counter[str] = Counter()
        self.lines_written = 0
        self.late_gpu_samples = 0  # samples dropped because the loop was more than an interval late
        every = config.gpu_summary_every_s
        self.edge: dict[str, EdgeSummary] = (
            {
                n: EdgeSummary(every, slack_s=config.gpu_interval_s / 2, phase_s=node_phase(n, every))
                for n in self.node_names
            }
            if every is not None
            else {}
        )
        self.max_tick_lag_s = 0.0
        self.t0 = 0.0
        self._parser = ProgressParser()
        self._changes: deque[tuple[str, str, JobState | NodeState]] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = 0
        self._lines: dict[tuple[str, str], list[tuple[float, str]]] = {}
        self._lineno: Counter[tuple[str, str]] = Counter()
        self._next_sample: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pump: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending_injections: list[Injection] = []
        self.tailers: dict[str, JobLogProducer] = {}
        self.kernels: dict[str, KernelLogProducer] = {}
        self.thread_ids: dict[str, int] = {}
        if config.transport == "files" and config.root is None:
            raise ValueError("the files transport needs ClusterConfig.root")

    # -- setup -------------------------------------------------------------------------------------

    def _job_plan(self) -> list[int]:
        """Job sizes that fill the cluster but the spare nodes, deterministic under the seed."""
        spare = max(self.cfg.min_spare, int(self.cfg.nodes * self.cfg.spare_fraction))
        room = self.cfg.nodes - spare
        sizes: list[int] = []
        choices = [s for s, _ in self.cfg.job_sizes]
        weights = [w for _, w in self.cfg.job_sizes]
        smallest = min(choices)
        while room >= smallest:
            s = self.rng.choices(choices, weights)[0]
            if s > room:
                s = max(c for c in choices if c <= room)
            sizes.append(s)
            room -= s
        return sizes

    def prepare(self, publisher: RawPublisher | None = None, now: float | None = None) -> SimCluster:
        """Submit the jobs and start them (no threads): `step(now)` then drives the cluster."""
        if publisher is not None:
            self.publisher = publisher
        if self.publisher is None:
            raise ValueError("SimCluster needs a publisher")
        if self.cfg.transport == "files" and not isinstance(self.publisher, Publisher):
            raise ValueError("the files transport runs the real tailers: it needs a bus.publish.Publisher")
        self.t0 = time.time() if now is None else now
        self.sched.subscribe(self._on_sched)
        for i, size in enumerate(self._job_plan()):
            name = f"{self.rng.choice(('llama', 'gpt', 'mixtral', 'vit', 'bert', 't5'))}-{size * 8}g-{i:03d}"
            jrng = random.Random(f"{self.cfg.seed}:job:{i}")
            job_id = self.sched.submit(name, size, self.cfg.partition)
            job = _Job(
                job_id=job_id,
                name=name,
                size=size,
                rng=jrng,
                step_s=round(jrng.uniform(*self.cfg.step_s), 3),
                gbs=jrng.choice((256, 512, 1024, 2048)),
                total=500_000,
                ckpt_every=jrng.randint(*self.cfg.ckpt_every),
                ckpt_path=f"/lustre/ckpt/{name}",
                per_node=jrng.random() < self.cfg.per_node_progress_fraction,
            )
            self.jobs[job_id] = job
        self._drain_changes(self.t0)  # RUNNING of every job: start them
        for i, n in enumerate(self.node_names):
            # Spread the nodes' sampling instants evenly over the interval.
            self._next_sample[n] = self.t0 + self.cfg.gpu_interval_s * (i % 50) / 50
        return self

    def start(self, publisher: RawPublisher | None = None) -> SimCluster:
        """prepare(), then run the cluster in a thread (and the real tailers in another, for files)."""
        self.prepare(publisher)
        self._thread = threading.Thread(target=self._loop, name="sim-cluster", daemon=True)
        self._thread.start()
        if self.cfg.transport == "files":
            self._pump = threading.Thread(target=self._pump_files, name="sim-tailers", daemon=True)
            self._pump.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in (self._thread, self._pump):
            if t is not None:
                t.join(timeout=10)
        for tailer in self.tailers.values():
            tailer.close()

    # -- fault plan -------------------------------------------------------------------------------

    def plan(
        self,
        kinds: Sequence[str],
        reps: int = 1,
        start_s: float = 25.0,
        spacing_s: float = 4.0,
        hang_at_s: float | None = None,
        straggler_at_s: float = 200.0,
        healthy_min: int = 2,
    ) -> list[Injection]:
        """Choose victims for `reps` injections of each kind: distinct jobs, nodes, ranks, GPUs.

        Explicit faults start at `start_s` one every `spacing_s` in a seeded order; hangs at
        `hang_at_s` (default: with the others), stragglers at `straggler_at_s` (jobs must have run
        the straggler detector's warm-up and a window first). At least `healthy_min` jobs stay
        untouched, to count false actions on healthy jobs."""
        rng = random.Random(f"{self.cfg.seed}:faults")
        order = [k for k in kinds for _ in range(reps)]
        rng.shuffle(order)
        free = sorted(self.jobs, key=int)
        rng.shuffle(free)
        budget = len(free) - healthy_min
        injections: list[Injection] = []
        t_explicit = start_s
        t_straggler = straggler_at_s
        for seq, kind in enumerate(order):
            spec = F.FAULTS[kind]
            if len(injections) >= budget:
                log.warning("not enough jobs for every injection: %d planned of %d", len(injections), len(order))
                break
            pick = next((j for j in free if self.jobs[j].size >= spec.min_nodes), None)
            if pick is None:
                log.warning("no job with >= %d nodes left for %s", spec.min_nodes, kind)
                continue
            free.remove(pick)
            job = self.jobs[pick]
            lo = 1 if kind == "node_not_responding" else 0  # srun reports from the first node
            idx = rng.randrange(lo, len(job.nodes))
            node = job.nodes[idx]
            gpu = rng.randrange(GPUS_PER_NODE)
            rank = idx * self.cfg.ranks_per_node + gpu
            if kind == "straggler":
                at = t_straggler
                t_straggler += spacing_s
            elif kind == "hang" and hang_at_s is not None:
                at = hang_at_s + spacing_s * sum(1 for i in injections if i.kind == "hang")
            else:
                at = t_explicit
                t_explicit += spacing_s
            category, action = spec.category, spec.action
            if kind == "nccl_dead_rank" and self.cfg.nccl_timeout_s > HANG_FLOOR_S + 10:
                # With a realistic watchdog the waiting ranks stall for longer than the hang detector's
                # floor: the silence is the first signal, not the timeout lines.
                category, action = "hang", "requeue"
            injections.append(
                Injection(
                    seq=seq,
                    kind=kind,
                    at_s=at,
                    job_id=pick,
                    node=node,
                    rank=rank,
                    gpu=gpu,
                    category=category,
                    expected_action=action,
                    culprit=node if spec.culprit_scored else None,
                    job_nodes=job.nodes,
                    job_gpus=job.size * GPUS_PER_NODE,
                )
            )
        injections.sort(key=lambda i: i.at_s)
        with self._lock:
            self.injections.extend(injections)
            self._pending_injections.extend(injections)
            self._pending_injections.sort(key=lambda i: i.at_s)
        return injections

    # -- scheduler events --------------------------------------------------------------------------

    def _on_sched(self, kind: str, change: str, state: JobState | NodeState) -> None:
        # Called by the scheduler (any thread, under its lock): publish, and let the loop react.
        now = time.time()
        if isinstance(state, JobState):
            t = now
            if change == "RUNNING" and state.restart_count == 0 and self.cfg.backdate_s > 0:
                t = now - self.cfg.backdate_s  # the job was already running when we attached
            ev = SchedEvent(
                event_id=stable_id("sched", state.job_id, change, state.restart_count),
                event_time=t,
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
            )
            self.sched_log.append(SchedRecord(now, "job", change, state.job_id, None, state.restart_count, state.nodes))
        else:
            ev = SchedEvent(
                event_id=stable_id("sched-node", state.name, change, now),
                event_time=now,
                kind="node",
                node=state.name,
                state=state.state,
                flags=list(state.flags),
                reason=state.reason,
                partition=state.partitions[0] if state.partitions else None,
            )
            self.sched_log.append(SchedRecord(now, "node", change, None, state.name, 0, ()))
        self._publish(SCHED_EVENTS, ev)
        self._changes.append((kind, change, state))

    def _drain_changes(self, now: float) -> None:
        while self._changes:
            kind, change, state = self._changes.popleft()
            if not isinstance(state, JobState):
                continue
            job = self.jobs.get(state.job_id)
            if job is None:
                continue
            if change == "RUNNING":
                self._start_run(job, state, now)
            elif change in ("REQUEUED", "CANCELLED", "FAILED", "NODE_FAIL"):
                self._end_run(job, "pending" if change == "REQUEUED" else "ended")

    def _start_run(self, job: _Job, state: JobState, now: float) -> None:
        fresh = state.restart_count == 0
        job.run = state.restart_count
        job.nodes = tuple(state.nodes)
        job.status = "running"
        job.phase = "train"
        job.silent = set()
        job.nan = False
        job.slow = self.cfg.straggler_slowdown if any(self.gpus[n].throttled for n in job.nodes) else 1.0
        if fresh and self.cfg.backdate_s > 0:
            job.step = job.rng.randint(200, 20_000)
            job.last_ckpt = job.step - job.step % job.ckpt_every
            job.first_step = False
            job.next_at = now + job.rng.uniform(0, job.step_s)
        else:
            job.step = job.last_ckpt  # a restart resumes from the last checkpoint
            job.first_step = True  # compilation, data loader start, checkpoint load
            job.first_extra = job.rng.uniform(*self.cfg.first_step_extra_s)
            job.next_at = now + job.first_extra
        for n in job.nodes:
            self.gpus[n].load = "busy"
        if self.cfg.transport == "files":
            self._follow_job(job)
        if not (fresh and self.cfg.backdate_s > 0):
            self._banner(job, now)

    def _end_run(self, job: _Job, status: JobStatus) -> None:
        job.status = status
        for n in job.nodes:
            if self._job_on(n) in (None, job.job_id):
                self.gpus[n].load = "idle"

    def _job_on(self, node: str) -> str | None:
        for j in self.jobs.values():
            if j.status in ("running", "blocked", "hung") and node in j.nodes:
                return j.job_id
        return None

    # -- output ---------------------------------------------------------------------------------------

    def _publish(self, topic: Topic, event: Event | dict[str, Any]) -> None:
        assert self.publisher is not None
        if isinstance(event, dict):
            key = (event.get("job_id") or event.get("node") or event["event_id"]).encode()
            self.publisher.publish_raw(topic.name, orjson.dumps(event), key=key)
        else:
            self.publisher.publish_raw(topic.name, encode(event), key=partition_key(event))
        self.sent[topic.name] += 1

    def _say(self, job: _Job, node: str, ts: float, text: str, rank: int | None = None) -> None:
        """One line in the output file of `node`, with torchrun's rank prefix when a rank wrote it."""
        line = f"[rank{rank}]:{text}" if rank is not None else text
        self._lines.setdefault((job.job_id, node), []).append((ts, line))

    def _say_ranks(self, job: _Job, node: str, ts: float, text: Callable[[int], str]) -> None:
        i = job.nodes.index(node)
        for r in range(i * self.cfg.ranks_per_node, (i + 1) * self.cfg.ranks_per_node):
            self._say(job, node, ts, text(r), r)

    def _kernel(self, node: str, lines: list[str], ts: float) -> None:
        if self.cfg.transport == "files":
            assert self.cfg.root is not None
            path = self.cfg.root / "nodes" / node / "kern.log"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as fh:
                fh.write("".join(x + "\n" for x in lines))
            return
        for line in lines:
            parsed = parse_kernel_line(line, node)
            if parsed is None:
                continue  # what producers.kernel drops (e.g. mlx5 link lines): never published
            # The simulated node's kernel, as the kmsg producer would read it.
            self._publish(NODE_KERNEL, to_event(parsed, ts, gpu_index_of(parsed.pci_bus_id), reader="kmsg"))

    def _flush_lines(self, now: float) -> None:
        if not self._lines:
            return
        batches, self._lines = self._lines, {}
        for (job_id, node), lines in batches.items():
            self.lines_written += len(lines)
            job = self.jobs[job_id]
            if self.cfg.transport == "files":
                assert self.cfg.root is not None
                path = self._log_path(job_id, node)
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "a") as fh:
                    fh.write("".join(text + "\n" for _, text in lines))
                continue
            self._publish_direct(job, node, lines, now)

    def _publish_direct(self, job: _Job, node: str, lines: list[tuple[float, str]], now: float) -> None:
        """What JobLogProducer publishes for one poll of one output file, built without the file."""
        source = str(Path("/sim/jobs") / job.job_id / f"{node}.out")
        key = (job.job_id, node)  # line numbers go on across runs, as in a file opened for append
        first = self._lineno[key] + 1
        self._lineno[key] += len(lines)
        parsed = [split_rank_prefix(text) for _, text in lines]
        nodes = list(job.nodes)
        samples = [
            s
            for (ts, _), r in zip(lines, parsed, strict=True)
            if (s := self._parser.parse(r.text, ts, r.rank, node)) is not None
        ]
        if self.cfg.payload == "model":
            self._publish(
                JOB_LOGS,
                LogBatch(
                    event_id=stable_id("log", job.job_id, source, first),
                    event_time=now,
                    job_id=job.job_id,
                    source=source,
                    job_nodes=nodes,
                    partition=self.cfg.partition,
                    lines=[
                        LogLine(text=r.text, ts=ts, rank=r.rank, node=node, lineno=first + i)
                        for i, ((ts, _), r) in enumerate(zip(lines, parsed, strict=True))
                    ],
                ),
            )
            if samples:
                self._publish(
                    JOB_PROGRESS,
                    ProgressBatch(
                        event_id=stable_id("prg", job.job_id, source, first),
                        event_time=now,
                        job_id=job.job_id,
                        job_nodes=nodes,
                        partition=self.cfg.partition,
                        samples=samples,
                    ),
                )
            return
        self._publish(
            JOB_LOGS,
            {
                "schema_version": SCHEMA_VERSION,
                "event_id": stable_id("log", job.job_id, source, first),
                "event_time": now,
                "produced_at": time.time(),
                "job_id": job.job_id,
                "source": source,
                "job_nodes": nodes,
                "partition": self.cfg.partition,
                "lines": [
                    {"text": r.text, "ts": ts, "rank": r.rank, "node": node, "lineno": first + i}
                    for i, ((ts, _), r) in enumerate(zip(lines, parsed, strict=True))
                ],
            },
        )
        if samples:
            self._publish(
                JOB_PROGRESS,
                {
                    "schema_version": SCHEMA_VERSION,
                    "event_id": stable_id("prg", job.job_id, source, first),
                    "event_time": now,
                    "produced_at": time.time(),
                    "job_id": job.job_id,
                    "job_nodes": nodes,
                    "partition": self.cfg.partition,
                    "samples": [s.model_dump(mode="json") for s in samples],
                },
            )

    def _log_path(self, job_id: str, node: str) -> Path:
        assert self.cfg.root is not None
        return self.cfg.root / "jobs" / job_id / f"{node}.out"

    # -- files transport: the real tailers -------------------------------------------------------------

    def _follow_job(self, job: _Job) -> None:
        paths = [self._log_path(job.job_id, n) for n in job.nodes]
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.touch()
        layout = JobLayout(job.nodes, self.cfg.ranks_per_node)
        with self._lock:
            tailer = self.tailers.get(job.job_id)
            if tailer is None:
                assert isinstance(self.publisher, Publisher)
                self.tailers[job.job_id] = JobLogProducer(
                    self.publisher,
                    job.job_id,
                    paths,
                    layout,
                    partition=self.cfg.partition,
                    node_of_path={p: n for p, n in zip(paths, job.nodes, strict=True)},
                )
            else:
                tailer.layout = layout
                known = {f.path for f in tailer.followers}
                for p, n in zip(paths, job.nodes, strict=True):
                    if p not in known:
                        tailer.add_path(p, n)
            for n in job.nodes:
                if n not in self.kernels:
                    assert self.cfg.root is not None
                    kern = self.cfg.root / "nodes" / n / "kern.log"
                    kern.parent.mkdir(parents=True, exist_ok=True)
                    kern.touch()
                    assert isinstance(self.publisher, Publisher)
                    self.kernels[n] = KernelLogProducer(
                        self.publisher, kern, node=n, from_start=True, gpu_index_of=gpu_index_of
                    )

    def _pump_files(self) -> None:
        self.thread_ids["tailers"] = threading.get_native_id()
        while not self._stop.wait(0.1):
            with self._lock:
                tailers = list(self.tailers.values())
                kernels = list(self.kernels.values())
            for t in tailers:
                t.poll_once()
            for k in kernels:
                k.poll_once()

    # -- the loop --------------------------------------------------------------------------------------

    def _after(self, when: float, fn: Callable[[], None]) -> None:
        self._timer_seq += 1
        heapq.heappush(self._timers, (when, self._timer_seq, fn))

    def _loop(self) -> None:
        self.thread_ids["sim"] = threading.get_native_id()
        tick = 0
        next_tick = time.time()
        while not self._stop.is_set():
            now = time.time()
            self.max_tick_lag_s = max(self.max_tick_lag_s, now - next_tick)
            try:
                self.step(now)
            except Exception:
                log.exception("simulator tick failed")
                raise
            tick += 1
            next_tick += self.cfg.tick_s
            delay = next_tick - time.time()
            if delay > 0:
                self._stop.wait(delay)
            elif -delay > 5 * self.cfg.tick_s:
                next_tick = time.time()  # hopelessly late: do not try to catch up tick by tick

    def step(self, now: float) -> None:
        """Everything due at `now`: scheduler changes, timers, injections, lines, GPU samples."""
        self._drain_changes(now)
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            fn()
        with self._lock:
            due = [i for i in self._pending_injections if self.t0 + i.at_s <= now]
            self._pending_injections = [i for i in self._pending_injections if self.t0 + i.at_s > now]
        for inj in due:
            self._inject(inj, now)
        for job in self.jobs.values():
            self._advance(job, now)
        self._flush_lines(now)
        self._sample_gpus(now)

    def _printers(self, job: _Job, what: Literal["step", "checkpoint"]) -> list[tuple[str, int]]:
        """(node, rank) of the ranks that print this kind of line and are still alive.

        Per-node jobs (torchtitan-like) print on the first rank of every node; Megatron-style jobs
        print iterations on the last rank only and checkpoint messages on rank 0."""
        rpn = self.cfg.ranks_per_node
        if job.per_node:
            return [(n, i * rpn) for i, n in enumerate(job.nodes) if n not in job.silent]
        if what == "step":
            n, r = job.nodes[-1], len(job.nodes) * rpn - 1
        else:
            n, r = job.nodes[0], 0
        return [] if n in job.silent else [(n, r)]

    def _advance(self, job: _Job, now: float) -> None:
        while job.status == "running" and job.next_at <= now:
            ts = job.next_at
            if job.phase == "ckpt":
                _, end = F.checkpoint_lines(job.step, job.ckpt_path)
                for n, r in self._printers(job, "checkpoint"):
                    self._say(job, n, ts, end, r)
                for n in job.nodes:
                    self.gpus[n].load = "busy"
                job.phase = "train"
                job.next_at = ts + job.step_s * job.slow
                continue
            job.step += 1
            step_time = job.step_s * job.slow * job.rng.uniform(0.97, 1.03)
            if job.first_step:
                step_time += job.first_extra  # the slow first step prints its real duration
                job.first_step = False
            loss = None if job.nan else 9.0 / (1 + 0.002 * job.step) + job.rng.uniform(-0.02, 0.02)
            gn = None if job.nan else job.rng.uniform(0.6, 1.2)
            line = F.iteration_line(job.step, job.total, step_time * 1000, 3.0e-4, job.gbs, loss, job.loss_scale, gn)
            printers = self._printers(job, "step")
            for n, r in printers:
                self._say(job, n, ts, line, r)
            if job.rng.random() < self.cfg.overflow_p and printers:
                self._say(job, printers[0][0], ts, F.OVERFLOW_LINE, printers[0][1])
            if job.step % job.ckpt_every == 0:
                start, _ = F.checkpoint_lines(job.step, job.ckpt_path)
                for n, r in self._printers(job, "checkpoint"):
                    self._say(job, n, ts, start, r)
                for n in job.nodes:
                    if n not in job.silent:
                        self.gpus[n].load = "checkpoint"
                job.last_ckpt = job.step
                job.phase = "ckpt"
                job.next_at = ts + job.rng.uniform(*self.cfg.ckpt_pause_s)
            else:
                job.next_at = ts + job.step_s * job.slow * job.rng.uniform(0.97, 1.03)

    def _banner(self, job: _Job, ts: float) -> None:
        for i, n in enumerate(job.nodes):
            lines = F.nccl_init_lines(n, self.node_index[n])
            r0 = i * self.cfg.ranks_per_node
            for line in lines:
                self._say(job, n, ts, line, r0)
            if i == 0:
                for w in F.USER_WARNING_LINES:
                    self._say(job, n, ts, w, r0)
                for _ in range(job.rng.randint(1, 3)):
                    self._say(job, n, ts, F.OVERFLOW_LINE, r0)  # fp16 loss-scale warm-up

    def _sample_gpus(self, now: float) -> None:
        interval = self.cfg.gpu_interval_s
        for n, due in self._next_sample.items():
            if due > now:
                continue
            behind = int((now - due) // interval)
            if behind >= 2:
                self.late_gpu_samples += behind
                due += behind * interval
            self._next_sample[n] = due + interval
            g = self.gpus[n]
            if not g.responding:
                continue
            sample: GpuSample | dict[str, Any] = (
                sample_event(g, due, time.time())
                if self.cfg.payload == "model"
                else sample_payload(g, due, time.time())
            )
            if self.edge and not self._edge_publishes(n, sample, due):
                continue
            self._publish(GPU_SAMPLES, sample)

    def _edge_publishes(self, node: str, sample: GpuSample | dict[str, Any], now: float) -> bool:
        edge = self.edge[node]
        if isinstance(sample, GpuSample):
            return edge.publish(sample, now)
        # A fast payload's health read from its JSON objects: decoding 8 GPUs per node per second
        # would make the simulator the bottleneck of a large run (on a real node this runs there).
        gpus = sample["gpus"]
        return edge.decide(payload_health(gpus), any(g.get("xid_events") for g in gpus), now)

    # -- faults ---------------------------------------------------------------------------------------

    def _inject(self, inj: Injection, now: float) -> None:
        job = self.jobs[inj.job_id]
        if job.status != "running" or inj.node not in job.nodes:
            inj.skipped = f"job {job.job_id} was {job.status} on {','.join(job.nodes)} at injection"
            log.warning("skipped %s: %s", inj.kind, inj.skipped)
            return
        inj.injected_at = now
        inj.signal_at = now
        inj.run_before = job.run
        inj.job_nodes = job.nodes
        inj.job_gpus = job.size * GPUS_PER_NODE
        free = [n.name for n in self.sched.list_nodes() if n.state == "IDLE" and not n.drained]
        inj.free_nodes = len(free)
        inj.first_fit_relands = inj.node in sorted(free + list(job.nodes))[: len(job.nodes)]
        idx = job.nodes.index(inj.node)
        inj.rank = idx * self.cfg.ranks_per_node + (inj.gpu or 0)
        node, gpu, rank = inj.node, inj.gpu or 0, inj.rank
        g = self.gpus[node]
        pci = GPU_PCI[gpu]
        kind = inj.kind
        if kind == "xid79":
            self._kernel(node, F.kernel_lines(kind, node, pci, now), now)
            g.lost.add(gpu)
            self._rank_dies(job, node, now)
        elif kind == "xid48_dbe":
            self._kernel(node, F.kernel_lines(kind, node, pci, now), now)
            g.dbe[gpu] = g.dbe.get(gpu, 0) + 1
            for text in F.CUDA_ECC_LINES:
                self._say(job, node, now, text, rank)
            self._rank_dies(job, node, now)
        elif kind == "xid64_row_remap":
            self._kernel(node, F.kernel_lines(kind, node, pci, now), now)
            g.remap_failed.add(gpu)
            self._rank_dies(job, node, now)
        elif kind == "xid74_nvlink":
            self._kernel(node, F.kernel_lines(kind, node, pci, now), now)
            g.nvlink_errors[gpu] = g.nvlink_errors.get(gpu, 0) + 17
            self._say(job, node, now, F.CUDA_NVLINK_LINE, rank)
            self._rank_dies(job, node, now)
        elif kind == "nccl_dead_rank":
            self._rank_dies(job, node, now)
        elif kind == "ib_link_flap":
            self._kernel(node, F.kernel_lines("ib_link_flap", node, pci, now), now)
            up = now + 2.0  # the link comes back: a flap
            self._after(up, lambda: self._kernel(node, F.kernel_lines("ib_link_up", node, pci, up), up))
            r0 = idx * self.cfg.ranks_per_node
            for i, text in enumerate(F.ib_port_error_lines(node)):
                self._say(job, node, now, text, r0 + i)
            self._block(job, now)
        elif kind == "hang":
            job.status = "hung"
            for n in job.nodes:
                self.gpus[n].load = "idle"
        elif kind == "straggler":
            g.throttled = True
            job.slow = self.cfg.straggler_slowdown
        elif kind == "cuda_oom":
            for text in F.OOM_LINES:
                self._say(job, node, now, text, rank)
            self._rank_dies(job, node, now)
        elif kind == "nan_loss":
            job.nan = True
        elif kind == "user_exception":
            for text in F.USER_EXCEPTION_LINES:
                self._say(job, node, now, text, rank)
            self._rank_dies(job, node, now)
        elif kind == "storage_full":
            start, _ = F.checkpoint_lines(job.step, job.ckpt_path)
            r0 = idx * self.cfg.ranks_per_node
            self._say(job, node, now, start, r0)
            for text in F.STORAGE_FULL_LINES:
                self._say(job, node, now, text, r0)
            self._rank_dies(job, node, now)
        elif kind == "node_not_responding":
            g.responding = False
            self.sched.set_node_down(node, "Not responding")
            batch_host = job.nodes[0]
            for text in F.srun_node_failure_lines(node):
                self._say(job, batch_host, now, text)
            self._after(
                now + 1.0,
                lambda: self._say(
                    job, batch_host, time.time(), F.step_cancelled_line(job.job_id, batch_host, time.time())
                ),
            )
            self._rank_dies(job, node, now)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    def _rank_dies(self, job: _Job, node: str, now: float) -> None:
        """The node's ranks are gone (torchrun tears down the local group); the rest wait."""
        job.silent.add(node)
        self.gpus[node].load = "idle"
        self._block(job, now)

    def _block(self, job: _Job, now: float) -> None:
        """Every live rank waits in a collective that will never finish, until NCCL's watchdog."""
        job.status = "blocked"
        run = job.run
        seq = 7000 + job.step
        self._after(now + self.cfg.nccl_timeout_s, lambda: self._watchdog(job, run, seq))

    def _watchdog(self, job: _Job, run: int, seq: int) -> None:
        if job.run != run or job.status != "blocked":
            return  # requeued or stopped before the watchdog fired: Slurm killed the waiting ranks
        t = time.time()
        for n in job.nodes:
            if n not in job.silent:
                self._say_ranks(job, n, t, lambda r: F.watchdog_line(r, t, seq))
        # The processes take themselves down after the timeout: the job fails.
        self._after(t + 1.0, lambda: self._processes_exit(job, run))

    def _processes_exit(self, job: _Job, run: int) -> None:
        self.sched.fail_job(job.job_id, run)

    # -- reporting --------------------------------------------------------------------------------------

    def job_nodes(self) -> dict[str, list[str]]:
        return {j.job_id: list(j.nodes) for j in self.jobs.values()}

    def summary(self) -> dict[str, Any]:
        sizes = Counter(j.size for j in self.jobs.values())
        return {
            "nodes": self.cfg.nodes,
            "gpus": self.cfg.nodes * GPUS_PER_NODE,
            "jobs": len(self.jobs),
            "job_sizes": {str(k): v for k, v in sorted(sizes.items())},
            "allocated_nodes": sum(j.size for j in self.jobs.values()),
            "transport": self.cfg.transport,
            "payload": self.cfg.payload,
            "seed": self.cfg.seed,
            "nccl_timeout_s": self.cfg.nccl_timeout_s,
            "requeue_delay_s": self.cfg.requeue_delay_s,
            "backdate_s": self.cfg.backdate_s,
            "step_s_range": list(self.cfg.step_s),
            "straggler_slowdown": self.cfg.straggler_slowdown,
            "per_node_progress_fraction": self.cfg.per_node_progress_fraction,
            "gpu_summary_every_s": self.cfg.gpu_summary_every_s,
            "gpu_readings_suppressed_at_edge": sum(e.suppressed for e in self.edge.values()),
        }
