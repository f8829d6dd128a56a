"""Which jobs run on this node, from the central Slurm producer's events on the bus.

A node-local log discoverer that asks slurmctld every second puts one RPC per node
per second on it (1,024/s at 1,024 nodes; bench/slurm_rpc.py). The Slurm producer
already polls the whole cluster once per interval and publishes every job
transition to ``sched.events`` with the job's expanded node list, so a node can
follow placements from there instead: `BusPlacements` reads the topic from its
beginning (a restarted discoverer rebuilds the picture), keeps the job events whose
node list holds its node, and answers "RUNNING job id -> generation" as
`JobDiscovery.running_jobs` does (the generation goes up each time a job starts
RUNNING again, a requeue: a new allocation is followed afresh).

What the bus cannot say is covered by a slow Slurm resync (``resync``, every
``resync_s``; also at once when the producer announces a cold start, whose
baseline it never publishes): jobs the bus never announced are added, and jobs
the bus still holds as running but Slurm does not are ended. Between resyncs no
call reaches slurmctld; the discoverer still describes each new job once
(``scontrol show job``: its StdOut/StdErr paths, which the events do not carry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from bus.consume import Follower, MissingTopic
from schemas.codec import decode
from schemas.events import SchedEvent
from schemas.ids import current_cluster
from schemas.topics import SCHED_EVENTS

log = logging.getLogger("trainmedic.placements")

#: The Slurm producer's start marker and the state of a job that left squeue.
SNAPSHOT, GONE = "SNAPSHOT", "GONE"
#: Most records taken from the topic per call: a long backlog is read over several polls.
MAX_PER_POLL = 50_000


@dataclass
class _Placement:
    running: bool
    generation: int


class BusPlacements:
    """Callable: RUNNING job id -> generation for the jobs placed on `node`."""

    def __init__(
        self,
        bootstrap: str,
        node: str,
        resync: Callable[[], dict[str, int]] | None = None,
        resync_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 10.0,
    ) -> None:
        if resync_s <= 0:
            raise ValueError(f"resync_s must be > 0, got {resync_s}")
        self.node = node
        self.resync_s = resync_s
        self._resync = resync
        self._clock = clock
        self._jobs: dict[str, _Placement] = {}
        self._next_resync = clock()  # the first call resyncs: what ran before we started
        self.events_read = 0
        self.resyncs = 0
        self.resync_errors = 0
        # Each discoverer reads the whole topic itself (it needs every node's events to find
        # its own), and a restart reads it again.
        try:
            self._follower = Follower(bootstrap, SCHED_EVENTS.name, f"trainmedic-placements-{node}", timeout_s)
        except MissingTopic as exc:
            raise ValueError(
                f"placements from the bus: {exc}; "
                "is the Slurm producer (trainmedic produce slurm) running against this broker?"
            ) from exc

    def __call__(self) -> dict[str, int]:
        caught_up = self._read()
        # Resync only with the backlog read: an old event read after it would undo what Slurm said.
        if caught_up and self._resync is not None and self._clock() >= self._next_resync:
            self._do_resync()
        return {job: p.generation for job, p in self._jobs.items() if p.running}

    @property
    def caught_up(self) -> bool:
        """The topic's backlog was read whole (from then on each call may resync)."""
        return self._follower.caught_up

    def close(self) -> None:
        self._follower.close()

    def _read(self) -> bool:
        """Apply what the topic has; True once every partition was read to its end."""
        for value in self._follower.poll(MAX_PER_POLL):
            try:
                event = decode(SchedEvent, value)
            except ValueError as exc:
                log.warning("placements: skipping an unreadable sched.events record: %s", exc)
                continue
            self.events_read += 1
            self._apply(event)
        return self._follower.caught_up

    def _apply(self, e: SchedEvent) -> None:
        if e.kind != "job" or e.cluster != current_cluster():  # node names repeat across clusters
            return
        if e.state == SNAPSHOT:
            if "COLD_START" in e.flags:
                # The producer took the cluster as it found it and published none of it.
                self._next_resync = self._clock()
            return
        if e.job_id is None:
            return
        here = self.node in e.nodes
        prev = self._jobs.get(e.job_id)
        if e.state == GONE:
            self._jobs.pop(e.job_id, None)
        elif e.state == "RUNNING" and here:
            if prev is None:
                self._jobs[e.job_id] = _Placement(True, 0)
            elif not prev.running or "REQUEUED" in e.flags:
                # REQUEUED on a RUNNING event: a requeue the producer saw only as a higher restart count.
                prev.running, prev.generation = True, prev.generation + 1
        elif prev is not None:
            prev.running = False  # ended, pending again, or running elsewhere after a requeue
        # Otherwise another node's job, or one not started: nothing to follow, nothing kept.

    def _do_resync(self) -> None:
        self._next_resync = self._clock() + self.resync_s
        assert self._resync is not None
        try:
            running = self._resync()
        except Exception as exc:  # noqa: BLE001 - a failed resync keeps what the bus says
            self.resync_errors += 1
            log.warning("placements: Slurm resync failed, keeping the bus's picture: %s", exc)
            return
        self.resyncs += 1
        for job, p in self._jobs.items():
            if p.running and job not in running:
                log.info("placements: job %s ended without an event on the bus (Slurm resync)", job)
                p.running = False
        for job, restarts in running.items():
            known = self._jobs.get(job)
            if known is None:
                log.info("placements: job %s runs here but was never on the bus (Slurm resync)", job)
                self._jobs[job] = _Placement(True, restarts)
            elif not known.running:
                known.running, known.generation = True, known.generation + 1
