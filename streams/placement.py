"""Where each running job runs: the placement every streams worker shares.

The streams are partitioned by job: one job's evidence is judged by the one worker that owns
the job's partition. Evidence that names only a node (a kernel Xid, a GPU sample, an NVSentinel
event) must therefore be re-keyed to the job(s) on that node before attribution, and every worker
must be able to answer "which jobs run on node N", whichever partitions it owns.

The answer comes from the scheduler's job events (`sched.events`): a RUNNING event places a job on
its nodes, an end (finished, failed, requeued, pending again, gone) removes it. In the app the
placements live in a Faust GlobalTable keyed by job id (so each job's changes are written in order
by the worker owning its partition); every worker reads its changelog whole. This module is the
pure part: the value each job has in the table and the node -> jobs index derived from it.

Slurm's job events carry the node list in order, not ranks or GPUs: the rank layout is what the
job's own logs say (trainmedic/ops/rankmap.py), so the placement keeps the node order, which is what a
rank-to-node mapping needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from schemas.events import SchedEvent
from streams.detectors.hang import job_state_kind

__all__ = ["Placement", "PlacementIndex", "placement_change"]


@dataclass(frozen=True)
class Placement:
    """One running job's allocation as the scheduler reported it."""

    job_id: str
    nodes: tuple[str, ...]
    partition: str | None
    since: float  # the RUNNING event's time
    event_id: str  # the RUNNING event that placed it
    # Who runs the job, as the RUNNING event said: what a predicted incident (streams/migration.py),
    # made from a node's reading and not from the job's events, carries for policy's job settings.
    job_name: str | None = None
    user: str | None = None
    account: str | None = None
    comment: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The table's value (JSON)."""
        return {
            "job_id": self.job_id,
            "nodes": list(self.nodes),
            "partition": self.partition,
            "since": self.since,
            "event_id": self.event_id,
            "job_name": self.job_name,
            "user": self.user,
            "account": self.account,
            "comment": self.comment,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Placement:
        # A value written before the job's owner was kept lacks those keys: None.
        return cls(
            job_id=str(data["job_id"]),
            nodes=tuple(str(n) for n in data["nodes"]),
            partition=data.get("partition"),
            since=float(data["since"]),
            event_id=str(data["event_id"]),
            job_name=data.get("job_name"),
            user=data.get("user"),
            account=data.get("account"),
            comment=data.get("comment"),
        )


def placement_change(ev: SchedEvent) -> Placement | Literal["ended"] | None:
    """What a scheduler event does to its job's placement: a new placement (RUNNING with nodes),
    "ended" (the run is over), or None (no change: node events, transient states)."""
    if ev.kind != "job" or not ev.job_id:
        return None
    kind = job_state_kind(ev.state)
    if kind == "running" and ev.nodes:
        return Placement(
            ev.job_id, tuple(ev.nodes), ev.partition, ev.event_time, ev.event_id, ev.job_name, ev.user, ev.account,
            ev.comment,
        )  # fmt: skip
    if kind == "ended":
        return "ended"
    return None


class PlacementIndex:
    """job -> placement and node -> jobs, kept together.

    Fed from the table's changes (a worker's own writes and the changelog it reads); an older
    RUNNING event never replaces a newer placement of the same job, so a changelog read out of
    order with a worker's own write cannot move a job back to its previous nodes.
    """

    def __init__(self) -> None:
        self._jobs: dict[str, Placement] = {}
        self._by_node: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def put(self, placement: Placement) -> bool:
        """Place a job; False (and no change) when the index holds a newer placement of it."""
        before = self._jobs.get(placement.job_id)
        if before is not None and before.since > placement.since:
            return False
        self.drop(placement.job_id)
        self._jobs[placement.job_id] = placement
        for node in placement.nodes:
            self._by_node.setdefault(node, set()).add(placement.job_id)
        return True

    def drop(self, job_id: str) -> None:
        before = self._jobs.pop(job_id, None)
        if before is None:
            return
        for node in before.nodes:
            jobs = self._by_node.get(node)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self._by_node[node]

    def apply(self, job_id: str, raw: dict[str, Any] | None) -> None:
        """One changelog record: a placement, or a tombstone (None) for an ended run."""
        if raw is None:
            self.drop(job_id)
        else:
            self.put(Placement.from_dict(raw))

    def jobs_on(self, node: str) -> list[str]:
        """The jobs running on `node`, in a stable order (several when nodes are shared)."""
        return sorted(self._by_node.get(node, ()))

    def get(self, job_id: str) -> Placement | None:
        return self._jobs.get(job_id)
