"""Attribution: group one job's anomalies inside a window into ONE incident.

Pure logic with explicit state; the Faust agent only feeds it records and a
clock. Which signal is the cause and which are collateral is streams/causal.py:
a recognised root cause over collateral symptoms over bare crash markers, then
severity, source and the earliest in time; the same error on every rank of one
node is that node's; collective timeouts alone are judged by their context.

The incident states facts: category, culprit node / rank / GPU, confidence,
evidence, whether the fault lives on the culprit's node (`isolate`), whether the
culprit is one of the job's nodes per the scheduler, and whether isolating it may
be carried out (streams.policy.isolation). Which action follows is policy's alone
(streams.policy.choose_action).

Time: one cascade is evidence no further apart, link to link in the anomalies' own times, than
the cascade window (`cascade_window_s`; a collective timeout that says it was configured longer
stretches its own link). A group whose evidence falls apart into several cascades is judged once
per cascade, oldest first: an older fault never becomes the root of a newer one, and the newest
incident names the earlier ones in its explanation. A held incident absorbs only what continues
its cascade.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from schemas.events import Anomaly, Evidence, Incident, SchedEvent
from schemas.ids import stable_id
from schemas.vocab import PROVENANCE_RANK, SEVERITY_RANK
from streams.causal import DEFAULT_COLLECTIVE_TIMEOUT_MS, judge, tier, when
from streams.policy import SCHEDULER_NODE_DOWN, isolation, job_evidence_only, node_evidence, strongest_provenance

MAX_EVIDENCE = 50
# Jobs that finished are forgotten after this long, to bound memory.
ALLOCATION_TTL_S = 24 * 3600.0
# The longest a fault's cascade takes to show on the other ranks by default: a rank that waits on a
# dead peer reports it when its collective times out, after torch's default NCCL timeout of 10 min
# (PyTorch torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp: kProcessGroupNCCLDefaultTimeout =
# 10 * 60 * 1000 ms, surfaced as torch.distributed.constants.default_pg_nccl_timeout; the
# heartbeat monitor's TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, 480 s, fires within it). Evidence further
# apart than this, link to link, is not one cascade.
CASCADE_WINDOW_S = DEFAULT_COLLECTIVE_TIMEOUT_MS / 1000.0


@dataclass
class _Group:
    key: str
    job_id: str | None
    opened_at: float
    anomalies: list[Anomaly] = field(default_factory=list)
    # The same fault seen through another source (an Xid in the kernel log, through NVML and
    # from NVSentinel): one piece of evidence, the twin's id still taken by the incident.
    twins: list[Anomaly] = field(default_factory=list)
    # Anomalies whose time is not their own (offline: a line without a timestamp, timed by line
    # order): they never split a cascade and join the one they fall in.
    untimed: set[str] = field(default_factory=set)
    # Anomalies timed by another clock than the default one (offline: each input file's own).
    clocks: dict[str, str] = field(default_factory=dict)

    def all_ids(self) -> set[str]:
        return {a.event_id for a in self.anomalies} | {a.event_id for a in self.twins}

    def add(self, anomaly: Anomaly) -> None:
        if anomaly.event_id in self.all_ids():
            return  # redelivered, or already adopted from a node's group
        twin = next((i for i, a in enumerate(self.anomalies) if _same_fault(a, anomaly)), None)
        if twin is None:
            self.anomalies.append(anomaly)
            return
        # The strongest report is judged (a fatal kernel line over another system's non-fatal
        # note of the same code), then the one that names the GPU; the GPU is kept either way.
        old = self.anomalies[twin]
        kept, other = (anomaly, old) if _strength(anomaly) > _strength(old) else (old, anomaly)
        if kept.gpu is None and other.gpu is not None:
            kept = kept.model_copy(update={"gpu": other.gpu})
        self.anomalies[twin] = kept
        self.twins.append(other)

    @property
    def has_root(self) -> bool:
        # A recognised cause; collateral symptoms and bare crash markers wait for one.
        return any(tier(a) == 2 for a in self.anomalies)


@dataclass
class _Allocation:
    nodes: tuple[str, ...]
    partition: str | None
    seen_at: float
    job_name: str | None = None
    user: str | None = None
    account: str | None = None
    restarts: int | None = None  # Slurm's restart count of the job
    comment: str | None = None  # the job's Comment (its owner's trainmedic=... setting)
    # The placement is the scheduler's (a SchedEvent, or an incident that had one), not
    # what a job's log batches claim: only then can a culprit be checked against the job.
    from_scheduler: bool = False


def _same_fault(a: Anomaly, b: Anomaly) -> bool:
    """One fault reported by two sources: same signature on the same node (and GPU, where both
    name it). Repeats from one source stay separate evidence: they are what that source saw."""
    return (
        a.source != b.source
        and a.signature == b.signature
        and a.node is not None
        and a.node == b.node
        and (a.gpu is None or b.gpu is None or a.gpu == b.gpu)
    )


def _strength(a: Anomaly) -> tuple[int, bool, bool]:
    return (SEVERITY_RANK[a.severity], a.isolate, a.gpu is not None)


def _restarts(src: SchedEvent | Incident | _Allocation | None) -> int | None:
    if isinstance(src, SchedEvent):
        return src.restart_count
    if isinstance(src, Incident):
        return src.job_restarts
    return src.restarts if src is not None else None


def _comment(src: SchedEvent | Incident | _Allocation | None) -> str | None:
    if isinstance(src, SchedEvent):
        return src.comment
    if isinstance(src, Incident):
        return src.job_comment
    return src.comment if src is not None else None


@dataclass(frozen=True)
class _Held:
    """An incident holding its job (or node): until when, its id, whether it explains the fault (a
    category other than unknown), and the provenance rank its isolation rested on (None: it
    isolated nothing - no fault of a node, or isolation not permitted)."""

    until: float
    incident_id: str
    explains: bool
    isolated_on: int | None
    # The latest own time of the evidence it holds: what a later anomaly must follow within the
    # cascade window to be part of the same cascade.
    last_signal: float = 0.0


def _isolation_rank(inc: Incident) -> int | None:
    """The provenance rank an incident's isolation rested on; None when it isolates nothing."""
    if not (inc.isolate and inc.isolatable and inc.culprit_node):
        return None
    strong = node_evidence(inc)
    if strong:
        return PROVENANCE_RANK[strong[0].provenance]
    return PROVENANCE_RANK["job"]  # a partition that lets job evidence isolate


def _held(inc: Incident, until: float, last_signal: float | None = None) -> _Held:
    if last_signal is None:
        last_signal = max((e.time for e in inc.evidence), default=inc.first_signal_time or inc.event_time)
    return _Held(until, inc.incident_id, inc.category != "unknown", _isolation_rank(inc), last_signal)


def _link_s(a: Anomaly, window_s: float) -> float:
    """How long before `a` the evidence of its cascade may lie: the cascade window, or the collective
    timeout the line says was configured when that is longer (the rank waited that long)."""
    ms = a.facts.get("timeout_ms", "")
    return max(window_s, int(ms) / 1000.0) if ms.isdigit() else window_s


def cascades(
    anomalies: Sequence[Anomaly],
    window_s: float,
    untimed: set[str] | frozenset[str] = frozenset(),
    clocks: Mapping[str, str] | None = None,
) -> list[list[Anomaly]]:
    """The anomalies split into cascades, oldest first: sorted by their own time, a new cascade
    begins where an anomaly follows the previous one of its clock by more than the window
    (`_link_s`). Anomalies in `untimed` do not split; each joins the latest cascade that began at or
    before its time. `clocks` (anomaly id -> clock) names anomalies timed by another clock than
    the default one: a gap is measured only between times of one clock, since the times of
    different files agree only as far as their clocks do (other hosts, local time zones that
    syslog, glog and Python logging do not write, a year that year-less stamps leave to a guess)."""
    clock_of = clocks or {}
    timed = sorted((a for a in anomalies if a.event_id not in untimed), key=lambda a: a.event_time)
    out: list[list[Anomaly]] = []
    last: dict[str, float] = {}  # clock -> its latest time in the current cascade
    for a in timed:
        clock = clock_of.get(a.event_id, "")
        if not out or (clock in last and a.event_time - last[clock] > _link_s(a, window_s)):
            out.append([])
            last = {}
        out[-1].append(a)
        last[clock] = a.event_time
    for a in sorted((a for a in anomalies if a.event_id in untimed), key=lambda a: a.event_time):
        if not out:
            out.append([a])
            continue
        at = max((i for i, c in enumerate(out) if c[0].event_time <= a.event_time), default=0)
        out[at].append(a)
    return out


def _stronger_isolating(held: _Held, anomaly: Anomaly) -> bool:
    """Later stronger evidence reopens the judgement: an isolating fault reported by the node's
    kernel or GPUs, the scheduler or a service is never absorbed by an incident that isolated
    nothing (it decided no action, or its isolation was not permitted) or isolated on weaker
    provenance (the job's own output, a syslog file)."""
    if not (anomaly.isolate and anomaly.role == "root" and anomaly.provenance != "job"):
        return False
    return held.isolated_on is None or held.isolated_on < PROVENANCE_RANK[anomaly.provenance]


#: Slurm's node states that say the node itself failed: what corroborates a job's node-failure line.
_NODE_DOWN_STATES = frozenset({"DOWN"})
_NODE_DOWN_FLAGS = frozenset({"NOT_RESPONDING"})


def _node_down(ev: SchedEvent) -> bool:
    return (ev.state in _NODE_DOWN_STATES or bool(_NODE_DOWN_FLAGS.intersection(ev.flags))) and (
        "MAINTENANCE" not in ev.flags and ev.reservation is None
    )


def _scheduler_evidence(ev: SchedEvent) -> Evidence:
    shown = "+".join([ev.state, *ev.flags])
    why = f": {ev.reason}" if ev.reason else ""
    return Evidence(
        source="scheduler",
        provenance="scheduler",
        signature=SCHEDULER_NODE_DOWN,
        node=ev.node,
        time=ev.event_time,
        line=f"slurm: node {ev.node} {shown}{why}"[:4096],
        role="collateral",
    )


def _names_the_cause(held_explains: bool, anomaly: Anomaly) -> bool:
    """Whether `anomaly`, arriving while an incident holds its job, must be an incident of its own.

    An incident that found no cause (category unknown: a crash with no recognised reason, a
    throughput drop, an unexplained error line) never holds the job's later evidence back: a
    later recognised cause (a root of a known category - an Xid, a straggler, an OOM, a storage
    error) opens its own judgement at once. A job-wide slowdown is seen within seconds, the
    throttled node behind it tens of seconds later: absorbed, the node would never be drained.
    What stays absorbed: collateral symptoms and bare crash markers (a timeout after an
    unexplained crash is its consequence), and a hang, which is what a crashed job's silence
    looks like. An incident that explains its fault absorbs the cascade it causes."""
    return not held_explains and tier(anomaly) == 2 and anomaly.category != "hang"


class Attributor:
    """Groups anomalies per job (or per node when no job is known).

    settle_s: how long a group with root evidence collects more before it is
    published; collateral_wait_s: how long a group of collateral symptoms only
    (NCCL timeouts) waits for a root cause to show up; hold_s: after an
    incident, further anomalies of the same job are absorbed into it (the
    cascade a fault causes is one incident) until the job runs again;
    cascade_window_s: how far apart, in their own times, two consecutive
    anomalies of one cascade may lie (CASCADE_WINDOW_S, torch's default NCCL
    timeout): evidence further apart is judged as separate incidents and is
    not absorbed by a held incident.
    """

    def __init__(
        self,
        settle_s: float = 1.0,
        collateral_wait_s: float = 5.0,
        hold_s: float = 600.0,
        cascade_window_s: float = CASCADE_WINDOW_S,
    ) -> None:
        self.settle_s = settle_s
        self.collateral_wait_s = collateral_wait_s
        self.hold_s = hold_s
        self.cascade_window_s = cascade_window_s
        self._groups: dict[str, _Group] = {}
        # key -> the incident holding the job (or node) and what it may absorb
        self._closed: dict[str, _Held] = {}
        # node -> Slurm's latest report of it down or not responding (a SchedEvent of kind node):
        # what corroborates a job's own evidence about the node (streams.policy.isolation).
        self._down: dict[str, SchedEvent] = {}
        # node -> an incident whose isolation of that node waits for corroboration (only the job's
        # own evidence named it): Slurm reporting the node down within its hold reissues it.
        self._awaiting: dict[str, Incident] = {}
        self._reissued: list[Incident] = []
        self._alloc: dict[str, _Allocation] = {}  # job id -> allocation
        self._node_job: dict[str, str] = {}  # node -> running job id
        self._incident_times: dict[str, float] = {}
        # anomaly id -> until: evidence already in a published incident. Catches a
        # redelivered anomaly whose job is unknown again (its key differs from the incident's).
        self._attributed: dict[str, float] = {}
        self.absorbed = 0

    def restore(
        self,
        incidents: Sequence[Incident],
        sched: Sequence[SchedEvent],
        now: float,
        anomalies: Sequence[tuple[float, Anomaly]] = (),
    ) -> int:
        """Take back what a previous worker published (read from the topics at start).

        Replayed in time order so that a job that ran again after its incident is
        open for new incidents, exactly as it would be had the worker never stopped.
        The window's anomalies (with the time each reached the topic) are replayed
        in the same order, each at that time: what an incident took or absorbed is
        absorbed again, as it was then, and what the previous worker had consumed
        (perhaps committed) but not yet published opens its group as it was - its
        window counted from then, not from the restart - instead of being lost with
        that worker's memory. Returns how many incidents still hold their job.
        """
        # An anomaly reaches the topic before the incident that took it: mark every taken one
        # first, or its replay would open a group the incident already closed.
        for inc in incidents:
            for aid in inc.anomaly_ids:
                self._attributed[aid] = max(self._attributed.get(aid, 0.0), inc.event_time + self.hold_s)
        timeline: list[tuple[float, int, Incident | SchedEvent | Anomaly]] = [(i.event_time, 0, i) for i in incidents]
        timeline += [(e.event_time, 1, e) for e in sched]
        timeline += [(min(at, now), 2, a) for at, a in anomalies]
        for at, _, item in sorted(timeline, key=lambda t: (t[0], t[1])):
            if isinstance(item, SchedEvent):
                self.observe_sched(item, item.event_time)
            elif isinstance(item, Incident):
                self._restore_incident(item)
            else:
                self.add(item, at)
        self._expire(now)
        return len(self._closed)

    def _restore_incident(self, inc: Incident) -> None:
        if inc.job_id and inc.job_nodes:
            self._set_alloc(inc.job_id, tuple(inc.job_nodes), inc.partition, inc.event_time, inc)
        node = inc.culprit_node or next((e.node for e in inc.evidence if e.node), None)
        key = inc.job_id or f"node:{node or '?'}"
        until = inc.event_time + self.hold_s
        self._closed[key] = _held(inc, until)
        self._await_corroboration(inc)
        self._incident_times[inc.incident_id] = inc.event_time
        for aid in inc.anomaly_ids:
            self._attributed[aid] = until

    # -- inputs ------------------------------------------------------------------

    def observe_sched(self, ev: SchedEvent, now: float) -> None:
        if ev.kind == "node" and ev.node:
            self._observe_node(ev, now)
            return
        if ev.kind != "job" or not ev.job_id:
            return
        if ev.state == "RUNNING" and ev.nodes:
            self._set_alloc(ev.job_id, tuple(ev.nodes), ev.partition, now, ev)
            closed = self._closed.get(ev.job_id)
            if closed and ev.event_time > self._incident_time(closed.incident_id):
                # The job runs again after our incident: new faults are new incidents.
                del self._closed[ev.job_id]
        elif ev.state in (
            "COMPLETED",
            "CANCELLED",
            "FAILED",
            "TIMEOUT",
            "NODE_FAIL",
            "PREEMPTED",
            "REQUEUED",
            "PENDING",
            "GONE",  # the Slurm producer: left squeue
        ):
            alloc = self._alloc.get(ev.job_id)
            if alloc:
                for n in alloc.nodes:
                    if self._node_job.get(n) == ev.job_id:
                        del self._node_job[n]

    def add(self, anomaly: Anomaly, now: float, timed: bool = True, clock: str | None = None) -> None:
        """Take one anomaly at `now`. `timed`: its event_time is its own (offline, False for a line
        without a timestamp: it then never splits a cascade); `clock`: whose clock timed it, when
        not the one all others share (offline: its file)."""
        job_id = anomaly.job_id
        if job_id and anomaly.job_nodes:
            self._set_alloc(job_id, tuple(anomaly.job_nodes), anomaly.partition, now)
        if not job_id and anomaly.node:
            job_id = self._node_job.get(anomaly.node)
        key = job_id or f"node:{anomaly.node or '?'}"
        closed = self._closed.get(key)
        holds = (
            closed is not None
            and now < closed.until
            and not _names_the_cause(closed.explains, anomaly)
            and not _stronger_isolating(closed, anomaly)
            and not (timed and self._after_cascade(closed, anomaly))
        )
        if holds or self._attributed.get(anomaly.event_id, 0.0) > now:
            if holds and closed is not None and timed and anomaly.event_time > closed.last_signal:
                # What the incident absorbs continues its cascade: the next link is measured from it.
                self._closed[key] = replace(closed, last_signal=anomaly.event_time)
            self.absorbed += 1
            return
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(key=key, job_id=job_id, opened_at=now)
        group.add(anomaly)
        if not timed:
            group.untimed.add(anomaly.event_id)
        if clock is not None:
            group.clocks[anomaly.event_id] = clock
        if job_id:
            self._adopt_node_groups(group)

    # -- outputs -----------------------------------------------------------------

    def flush(self, now: float) -> list[Incident]:
        """Publish every group whose window has closed."""
        ready = [
            g
            for g in self._groups.values()
            if now - g.opened_at >= (self.settle_s if g.has_root else self.collateral_wait_s)
        ]
        incidents, self._reissued = self._reissued, []
        for g in ready:
            del self._groups[g.key]
            if g.job_id is None and g.anomalies[0].node and g.anomalies[0].node in self._node_job:
                # A job became known on this node meanwhile: let its group take this evidence.
                job_group = self._groups.get(self._node_job[g.anomalies[0].node])
                if job_group is not None:
                    for a in [*g.anomalies, *g.twins]:
                        job_group.add(a)
                    job_group.untimed |= g.untimed
                    job_group.clocks.update(g.clocks)
                    continue
            # Evidence far apart in time is not one cascade: each is judged on its own, oldest
            # first, so an older fault never becomes the root of a newer one; the newest holds the job.
            earlier: list[Incident] = []
            last = 0.0
            for part in cascades(g.anomalies, self.cascade_window_s, g.untimed, g.clocks):
                twins = [t for t in g.twins if any(_same_fault(a, t) for a in part)]
                inc = self._incident(g, now, part, twins, earlier)
                last = max((a.event_time for a in part if a.event_id not in g.untimed), default=inc.first_signal_time)
                self._await_corroboration(inc)
                for aid in inc.anomaly_ids:
                    self._attributed[aid] = now + self.hold_s
                earlier.append(inc)
            inc = earlier[-1]
            self._closed[g.key] = _held(inc, now + self.hold_s, last)
            self._incident_times[inc.incident_id] = inc.event_time
            incidents += earlier
        self._expire(now)
        return incidents

    def pending(self) -> int:
        return len(self._groups) + len(self._reissued)

    def retain(self, keep: Callable[[str], bool]) -> int:
        """Drop the open groups whose key `keep` refuses (their job's partition went to another
        worker, which reads the evidence back itself); returns how many were dropped."""
        gone = [k for k in self._groups if not keep(k)]
        for k in gone:
            del self._groups[k]
        return len(gone)

    # -- internals -----------------------------------------------------------------

    def _incident_time(self, incident_id: str) -> float:
        return self._incident_times.get(incident_id, 0.0)

    def _set_alloc(
        self,
        job_id: str,
        nodes: tuple[str, ...],
        partition: str | None,
        now: float,
        owner: SchedEvent | Incident | None = None,
    ) -> None:
        before = self._alloc.get(job_id)
        scheduler = isinstance(owner, SchedEvent) or (isinstance(owner, Incident) and owner.culprit_in_job is not None)
        if owner is None and before is not None and before.from_scheduler:
            # A log batch re-stating (or mis-stating) the placement never replaces the
            # scheduler's: a job's output must not choose which nodes count as the job's.
            nodes, partition = before.nodes, before.partition or partition
            scheduler = True
        # Log-derived placements carry no owner: keep what the scheduler said about it.
        src: SchedEvent | Incident | _Allocation | None = owner or before
        self._alloc[job_id] = _Allocation(
            nodes,
            partition,
            now,
            src.job_name if src else None,
            src.user if src else None,
            src.account if src else None,
            _restarts(src),
            _comment(src),
            scheduler,
        )
        for n in nodes:
            self._node_job[n] = job_id

    def _adopt_node_groups(self, group: _Group) -> None:
        alloc = self._alloc.get(group.key)
        if not alloc:
            return
        for n in alloc.nodes:
            node_group = self._groups.pop(f"node:{n}", None)
            if node_group is not None:
                for a in [*node_group.anomalies, *node_group.twins]:
                    group.add(a)
                group.untimed |= node_group.untimed
                group.clocks.update(node_group.clocks)
                group.opened_at = min(group.opened_at, node_group.opened_at)

    def _expire(self, now: float) -> None:
        for key in [k for k, held in self._closed.items() if held.until <= now]:
            self._incident_times.pop(self._closed.pop(key).incident_id, None)
        for node in [n for n, inc in self._awaiting.items() if inc.event_time + self.hold_s <= now]:
            del self._awaiting[node]
        for node in [n for n, ev in self._down.items() if now - ev.event_time > ALLOCATION_TTL_S]:
            del self._down[node]
        for aid in [a for a, until in self._attributed.items() if until <= now]:
            del self._attributed[aid]
        for job_id in [j for j, a in self._alloc.items() if now - a.seen_at > ALLOCATION_TTL_S]:
            del self._alloc[job_id]

    def _after_cascade(self, held: _Held, anomaly: Anomaly) -> bool:
        """Whether `anomaly` comes too long after the held incident's evidence to be its cascade."""
        return anomaly.event_time - held.last_signal > _link_s(anomaly, self.cascade_window_s)

    def _incident(
        self,
        g: _Group,
        now: float,
        anomalies: Sequence[Anomaly],
        twins: Sequence[Anomaly],
        earlier: Sequence[Incident] = (),
    ) -> Incident:
        alloc = self._alloc.get(g.job_id) if g.job_id else None
        job_nodes = list(alloc.nodes) if alloc else list(anomalies[0].job_nodes)
        v = judge(anomalies, job_nodes)
        top = v.top
        partition = top.partition or (alloc.partition if alloc else None)
        culprit_in_job = (
            (v.culprit_node in alloc.nodes) if (alloc and alloc.from_scheduler and v.culprit_node) else None
        )
        taken = [*anomalies, *twins]
        first = min(a.event_time for a in taken)
        incident_id = stable_id("inc", g.key, min(a.event_id for a in taken))
        explanation = v.explanation
        evidence = [
            Evidence(
                source=a.source,
                provenance=a.provenance,
                signature=a.signature,
                node=a.node,
                rank=a.rank,
                time=a.event_time,
                line=a.line,
                role=a.role,
                gpu=a.gpu,
            )
            for a in v.ranked[:MAX_EVIDENCE]
        ]
        down = self._down.get(v.culprit_node or "")
        if v.isolate and down is not None and down.event_time >= first - self.hold_s:
            # Slurm's own word that the node failed: corroborates the job's evidence about it.
            evidence.append(_scheduler_evidence(down))
            explanation += f"; corroborated by the scheduler: {evidence[-1].line}"
        if twins:
            seen = sorted({f"{a.signature} on {a.node} (source {a.source})" for a in twins})
            explanation += f"; also reported by another source, counted once: {', '.join(seen)}"
        if earlier:
            explanation += "; " + _earlier_words(earlier, first, self.cascade_window_s)
        draft = Incident(
            event_id=incident_id,
            incident_id=incident_id,
            event_time=now,
            job_id=g.job_id,
            partition=partition,
            job_nodes=job_nodes,
            job_name=alloc.job_name if alloc else None,
            user=alloc.user if alloc else None,
            account=alloc.account if alloc else None,
            job_restarts=alloc.restarts if alloc else None,
            job_comment=alloc.comment if alloc else None,
            category=v.category,
            severity=v.severity,
            culprit_node=v.culprit_node,
            culprit_rank=v.culprit_rank,
            culprit_gpu=v.culprit_gpu,
            culprit_in_job=culprit_in_job,
            confidence=v.confidence,
            isolate=v.isolate,
            explanation=explanation,
            evidence=evidence,
            provenance=strongest_provenance(evidence),
            anomaly_ids=sorted(a.event_id for a in taken),
            first_signal_time=first,
        )
        return _judged(draft)

    # -- corroboration by the scheduler ----------------------------------------------

    def _observe_node(self, ev: SchedEvent, now: float) -> None:
        node = ev.node
        assert node is not None
        if not _node_down(ev):
            self._down.pop(node, None)
            return
        self._down[node] = ev
        waiting = self._awaiting.pop(node, None)
        if waiting is None or now >= waiting.event_time + self.hold_s:
            return
        # The incident whose isolation only the job's own evidence called for: Slurm now says the node
        # failed. Judged again with that evidence, as an incident of its own (the first decided
        # without it); it then holds the job as the first did.
        evidence = [*waiting.evidence, _scheduler_evidence(ev)]
        incident_id = stable_id("inc", waiting.incident_id, "corroborated", ev.event_id)
        redone = _judged(
            waiting.model_copy(
                update={
                    "event_id": incident_id,
                    "incident_id": incident_id,
                    "event_time": now,
                    "evidence": evidence,
                    "provenance": strongest_provenance(evidence),
                    "explanation": waiting.explanation + f"; corroborated by the scheduler: {evidence[-1].line}",
                }
            )
        )
        key = waiting.job_id or f"node:{node}"
        self._closed[key] = _held(redone, now + self.hold_s)
        self._incident_times[incident_id] = now
        self._reissued.append(redone)

    def _await_corroboration(self, inc: Incident) -> None:
        if inc.isolate and inc.culprit_node and not inc.isolatable and job_evidence_only(inc):
            self._awaiting[inc.culprit_node] = inc


def _earlier_words(earlier: Sequence[Incident], first: float, window_s: float) -> str:
    """The separate, earlier faults of the job's evidence, named in the newer incident's explanation."""
    parts = []
    for inc in earlier:
        top = inc.evidence[0] if inc.evidence else None
        what = f"{inc.category} ({top.signature}" if top else f"{inc.category} ("
        if top is not None and top.node:
            what += f" on {top.node}"
        at = when(inc.first_signal_time or 0.0)
        what += (f" at {at}" if at else "") + ")"
        gap = first - max((e.time for e in inc.evidence), default=inc.first_signal_time or first)
        parts.append(f"{what}, {_span(gap)} before")
    return (
        f"an earlier, separate fault not part of this failure (more than the {window_s:g} s cascade window "
        f"before it): {'; '.join(parts)}"
    )


def _span(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def _judged(draft: Incident) -> Incident:
    """The incident with whether isolating its culprit may be carried out (streams.policy.isolation)."""
    if not draft.isolate:
        return draft
    ok, note = isolation(draft)
    return draft.model_copy(update={"isolatable": ok, "isolation_note": "" if ok else note})
