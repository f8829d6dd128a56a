"""Attempt lineage: a job's runs across its restarts, and whether each restart bought progress.

A Slurm job keeps its id across requeues; each requeue raises its restart count and gives it a
new submit time. The lineage of a job is keyed by cluster + job id + the time the job was first
seen, carried across requeues; a job id seen again with its restart count back to a lower value,
or under another name or user, is another job (slurmctld state reset, id wrap-around): a new
lineage starts.

Each attempt (the first run, then one per restart) records when it started and ended, the
incident that ended it when policy ordered the restart, the nodes excluded so far, and progress:
the best training step and the last checkpoint seen before it started and during it (progress
samples on job.progress: a step, or a checkpoint save). An attempt *progressed* when it reached a
step beyond the lineage's best before it, or saved a checkpoint beyond the last one; it made *no
progress* when it reported neither; its progress is *unknown* when the job never reported any
progress at all (no parser for its log): the no-progress limit never counts an unknown attempt.

Pure logic on JSON-ready dicts: the streams worker keeps one value per job in a Faust table
(`job_lineage`, keyed by job id, on the job's partition) so a restarted worker, or the worker a
partition moves to, takes the lineage along. Values are replaced, never changed in place.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from schemas.events import Incident, JobAttempt, ProgressBatch, SchedEvent
from schemas.ids import current_cluster, stable_id

# Attempts kept per lineage: older ones are in the audit (job.attempts), not needed to decide.
MAX_ATTEMPTS = 20
_CHECKPOINT_END_SUFFIX = "checkpoint_end"
_ENDED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "GONE"})


@dataclass(frozen=True)
class Cause:
    """What ended an attempt: the incident's category, root signature and culprit node."""

    incident_id: str
    category: str
    signature: str | None
    node: str | None


@dataclass(frozen=True)
class RestartHistory:
    """What `decide` reads from the lineage: how many restarts in a row made no progress
    (the current attempt included, when a restart started it), and what ended the previous attempt."""

    no_progress: int = 0
    previous: Cause | None = None
    attempt: int = 1


def root_signature(incident: Incident) -> str | None:
    return next((e.signature for e in incident.evidence if e.role == "root"), None)


def _progressed(lin: dict[str, Any], att: dict[str, Any]) -> bool | None:
    if not att["reported"] and not lin["reported_before"].get(str(att["n"]), False):
        return None
    beyond_step = att["max_step"] is not None and (att["start_step"] is None or att["max_step"] > att["start_step"])
    return bool(beyond_step or att["new_checkpoint"])


class Lineages:
    """Per-job lineages in `store` (a Faust table in the worker, a dict elsewhere).

    Every method returns the JobAttempt records to publish (an attempt opened, ended, or given
    its cause), so the audit holds the lineage as it happens."""

    def __init__(self, store: MutableMapping[str, Any] | None = None) -> None:
        self._store: MutableMapping[str, Any] = store if store is not None else {}
        # Step counts that rose since the last write: written by flush(), not on every batch
        # (each write is a changelog record). A worker that dies loses at most a flush period
        # of step counts, never an attempt, a cause or a checkpoint (those are written at once).
        self._steps: dict[str, dict[str, Any]] = {}

    def get(self, job_id: str) -> dict[str, Any] | None:
        value = self._steps.get(job_id) or self._store.get(job_id)
        return copy.deepcopy(value) if value is not None else None

    def _put(self, job_id: str, lin: dict[str, Any]) -> None:
        self._steps.pop(job_id, None)
        self._store[job_id] = lin

    def flush(self) -> int:
        """Write the step counts held back; returns how many jobs."""
        held, self._steps = self._steps, {}
        for job_id, lin in held.items():
            self._store[job_id] = lin
        return len(held)

    def retain(self, keep: Callable[[str], bool]) -> None:
        """Drop held-back step counts of jobs this worker no longer judges (a rebalance)."""
        self._steps = {k: v for k, v in self._steps.items() if keep(k)}

    # -- inputs ---------------------------------------------------------------------------

    def observe_sched(self, ev: SchedEvent) -> list[JobAttempt]:
        if ev.kind != "job" or not ev.job_id or ev.state == "SNAPSHOT":
            return []
        lin = self.get(ev.job_id)
        out: list[JobAttempt] = []
        if ev.state == "GONE":
            # Out of the scheduler's view: the id may be reused from now on; the lineage is in the audit.
            if lin is not None:
                out += self._end(lin, ev.event_time, "gone")
            self._steps.pop(ev.job_id, None)
            self._store.pop(ev.job_id, None)
            return out
        restarts = ev.restart_count
        if lin is not None and self._other_job(lin, ev):
            out += self._end(lin, ev.event_time, "id reused by another job")
            self._put(ev.job_id, lin)  # kept only until replaced below
            lin = None
        if lin is None:
            if ev.state in _ENDED:
                return out
            lin = self._new(ev.job_id, ev.event_time, restarts or 0, ev.job_name, ev.user)
            out.append(self._record(lin, lin["attempts"][-1]))
        else:
            lin["job_name"] = lin["job_name"] or ev.job_name
            lin["user"] = lin["user"] or ev.user
            current = lin["attempts"][-1]
            if restarts is not None and restarts > current["restart_count"] and current["ended_at"] is None:
                out += self._end(lin, ev.event_time, f"requeued (Slurm restart count {restarts})")
                out.append(self._open(lin, ev.event_time, restarts))
            elif ev.state in _ENDED and current["ended_at"] is None:
                out += self._end(lin, ev.event_time, ev.state.lower())
        self._put(ev.job_id, lin)
        return out

    def observe_progress(self, batch: ProgressBatch) -> list[JobAttempt]:
        # A value held back for flush() is this object's own (flush hands it to the store and
        # forgets it): changed in place, with no copy. A copy per batch was 1.4 % of the streams
        # worker's time at 2,048 nodes (py-spy), every job's progress arriving every few seconds.
        lin = self._steps.get(batch.job_id) or self.get(batch.job_id)
        out: list[JobAttempt] = []
        if lin is None:
            lin = self._new(batch.job_id, batch.event_time, 0, None, None)
            out.append(self._record(lin, lin["attempts"][-1]))
        att = lin["attempts"][-1]
        if att["ended_at"] is not None:
            return out  # a late batch of an ended attempt: the next one has not started yet
        changed = bool(out)  # something to write at once
        stepped = False  # only step counts rose: held back for flush()
        was_progressed = _progressed(lin, att) is True
        for s in batch.samples:
            if att["n"] > 1 and s.ts < att["started_at"]:
                continue  # written before the requeue: the run before (a log tailer lagging the scheduler)
            if not att["reported"]:
                att["reported"] = changed = True
            if s.phase == "checkpoint":
                if not completed_save(s.format):
                    continue
                if s.step is not None and (lin["checkpoint_step"] is None or s.step > lin["checkpoint_step"]):
                    lin["checkpoint_step"] = s.step
                    changed = True  # the next attempt starts from it: written at once
                if s.step is None or att["start_checkpoint"] is None or s.step > att["start_checkpoint"]:
                    # A save during the attempt beyond the last one (or of no stated step).
                    changed = changed or not att["new_checkpoint"]
                    att["new_checkpoint"] = True
                continue
            if s.step is not None:
                if att["max_step"] is None or s.step > att["max_step"]:
                    att["max_step"] = s.step
                    stepped = True
                if lin["best_step"] is None or s.step > lin["best_step"]:
                    lin["best_step"] = s.step
        if changed or (stepped and not was_progressed and _progressed(lin, att) is True):
            # The first progress of an attempt is what the no-progress limit reads: never held back.
            self._put(batch.job_id, lin)
        elif stepped:
            self._steps[batch.job_id] = lin
        return out

    def ended_by(self, incident: Incident, excluded: str | None) -> list[JobAttempt]:
        """Policy ordered a restart or a stop of the incident's job: the current attempt ends for
        this cause (`excluded`: the node the restart takes out)."""
        if not incident.job_id:
            return []
        lin = self.get(incident.job_id)
        if lin is None:
            lin = self._new(incident.job_id, incident.first_signal_time, incident.job_restarts or 0, None, None)
        att = lin["attempts"][-1]
        if att["cause"] is not None and att["cause"]["incident_id"] == incident.incident_id:
            return []
        att["cause"] = {
            "incident_id": incident.incident_id,
            "category": incident.category,
            "signature": root_signature(incident),
            "node": incident.culprit_node,
        }
        if excluded and excluded not in lin["excluded"]:
            lin["excluded"] = [*lin["excluded"], excluded]
        # Dated when policy decided: after the attempt's opening record, so the audit's latest wins.
        record = self._record(lin, att, max(incident.event_time, att["started_at"]))
        self._put(incident.job_id, lin)
        return [record]

    # -- what policy reads ----------------------------------------------------------------

    def history(self, job_id: str | None) -> RestartHistory:
        lin = self.get(job_id) if job_id else None
        if lin is None:
            return RestartHistory()
        streak = 0
        for att in reversed(lin["attempts"]):
            if att["n"] == 1 or _progressed(lin, att) is not False:
                break
            streak += 1
        previous = None
        if len(lin["attempts"]) >= 2 and (cause := lin["attempts"][-2]["cause"]) is not None:
            previous = Cause(cause["incident_id"], cause["category"], cause["signature"], cause["node"])
        return RestartHistory(streak, previous, lin["attempts"][-1]["n"])

    def checkpoints(self, job_id: str | None) -> tuple[bool, int | None]:
        """Whether the job ever reported a completed checkpoint, and the highest step one stated."""
        lin = self.get(job_id) if job_id else None
        if lin is None:
            return False, None
        known = lin["checkpoint_step"] is not None or any(a["new_checkpoint"] for a in lin["attempts"])
        return known, lin["checkpoint_step"]

    # -- internals ------------------------------------------------------------------------

    @staticmethod
    def _other_job(lin: dict[str, Any], ev: SchedEvent) -> bool:
        current = lin["attempts"][-1]["restart_count"]
        if ev.restart_count is not None and ev.restart_count < current:
            return True
        return any(
            new is not None and old is not None and new != old
            for new, old in ((ev.job_name, lin["job_name"]), (ev.user, lin["user"]))
        )

    def _new(self, job_id: str, at: float, restarts: int, name: str | None, user: str | None) -> dict[str, Any]:
        lin: dict[str, Any] = {
            "lineage_id": stable_id("lin", current_cluster(), job_id, int(at)),
            "job_id": job_id,
            "first_seen": at,
            "job_name": name,
            "user": user,
            "best_step": None,
            "checkpoint_step": None,
            "excluded": [],
            # attempt n -> whether the lineage had reported progress before it started
            "reported_before": {},
            "attempts": [],
        }
        self._open(lin, at, restarts, record=False)
        return lin

    def _open(self, lin: dict[str, Any], at: float, restarts: int, record: bool = True) -> JobAttempt:
        n = lin["attempts"][-1]["n"] + 1 if lin["attempts"] else 1
        lin["reported_before"][str(n)] = any(a["reported"] for a in lin["attempts"]) or bool(
            lin["reported_before"].get(str(n - 1), False)
        )
        att = {
            "n": n,
            "restart_count": restarts,
            "started_at": at,
            "ended_at": None,
            "end_reason": None,
            "cause": None,
            "start_step": lin["best_step"],
            "start_checkpoint": lin["checkpoint_step"],
            "max_step": None,
            "new_checkpoint": False,
            "reported": False,
        }
        lin["attempts"] = [*lin["attempts"], att][-MAX_ATTEMPTS:]
        keep = {str(a["n"]) for a in lin["attempts"]}
        lin["reported_before"] = {k: v for k, v in lin["reported_before"].items() if k in keep}
        return self._record(lin, att)

    def _end(self, lin: dict[str, Any], at: float, reason: str) -> list[JobAttempt]:
        att = lin["attempts"][-1]
        if att["ended_at"] is not None:
            return []
        att["ended_at"] = at
        att["end_reason"] = reason
        return [self._record(lin, att)]

    @staticmethod
    def _record(lin: dict[str, Any], att: dict[str, Any], at: float | None = None) -> JobAttempt:
        """The attempt as it stands, dated `at` (default: its end, else its start): each state of
        an attempt is later than the one before, so the audit's latest record is the attempt."""
        cause = att["cause"] or {}
        if at is None:
            at = att["ended_at"] if att["ended_at"] is not None else att["started_at"]
        # Strictly after the attempt's previous record: Slurm's whole-second times and an
        # incident's fractional one must not reorder its states (the audit keeps the latest).
        at = max(at, att["started_at"], float(att.get("recorded_at") or 0.0) + 0.001)
        att["recorded_at"] = at
        return JobAttempt(
            event_id=stable_id("att", lin["lineage_id"], att["n"], att["ended_at"] or 0, cause.get("incident_id", "")),
            event_time=at,
            lineage_id=lin["lineage_id"],
            job_id=lin["job_id"],
            job_name=lin["job_name"],
            user=lin["user"],
            first_seen=lin["first_seen"],
            attempt=att["n"],
            restart_count=att["restart_count"],
            started_at=att["started_at"],
            ended_at=att["ended_at"],
            end_reason=att["end_reason"],
            cause_incident_id=cause.get("incident_id"),
            cause_category=cause.get("category"),
            cause_node=cause.get("node"),
            excluded_nodes=list(lin["excluded"]),
            start_step=att["start_step"],
            start_checkpoint=att["start_checkpoint"],
            max_step=att["max_step"],
            new_checkpoint=att["new_checkpoint"],
            progressed=_progressed(lin, att) if att["ended_at"] is not None or att["cause"] else None,
        )


# Formats whose save prints an end line (producers/progress.py): their start line is no saved
# checkpoint yet. The others (HF, Lightning) print one line as they save.
_END_LINE_FORMATS = frozenset({"megatron", "deepspeed", "torchtitan", "dcp"})


def completed_save(fmt: str) -> bool:
    """Whether a checkpoint sample (format '<parser>:checkpoint_start|end') means a save was made:
    its end line where the framework prints one (an asynchronous save prints its start before the
    write is done), its one line otherwise."""
    parser, _, marker = fmt.partition(":")
    return marker == _CHECKPOINT_END_SUFFIX or parser not in _END_LINE_FORMATS
