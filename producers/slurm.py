"""Slurm producer: the cluster's job and node changes -> sched.events.

`trainmedic produce slurm` polls the whole cluster with ONE
``squeue --json --states=all``, ONE node listing (``sinfo --json`` on 22.05,
``scontrol show node --json`` on 23.11+: slurmio.nodes) and ONE
``scontrol show reservation -o`` per interval and
publishes a ``SchedEvent`` for each change, never the unchanged rest. The
documents are read by slurmio, which knows every data parser from 22.05
(v0.0.38) to 24.11 (v0.0.42) and refuses a shape it does not know (the poll
fails, counted as ``parse``) instead of misreading it:

- ``kind="job"``: a job's state changed (PENDING, RUNNING, COMPLETING,
  COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, PREEMPTED, REQUEUED, ...)
  or its restart count went up (a requeue we did not see as its own state:
  such an event carries the flag ``REQUEUED``). ``previous_state`` is the last
  state we saw (None for a job seen for the first time), ``nodes`` its expanded
  node list, ``partition`` its partition, ``reason`` Slurm's state reason plus
  the exit status of a finished job (``exit 3``, ``signal 9``).
  A job that drops out of squeue (MinJobAge after it ended) is reported with
  state ``GONE`` -- only when we know its last state.
- ``kind="node"``: a node's availability changed: base state DOWN, ERROR,
  FUTURE, UNKNOWN, ...; flags DRAIN, NOT_RESPONDING, FAIL, MAINTENANCE, REBOOT_*
  ...; or its reason. ``state`` is Slurm's base state (a drained idle node is
  ``IDLE`` with flag ``DRAIN``, as ``sinfo --json`` says), ``flags`` all its
  flags, ``reason`` its reason. IDLE, ALLOCATED and MIXED count as one "up"
  state and the COMPLETING/PLANNED flags are ignored, so the load of a healthy
  node never makes an event. A node removed from the configuration: ``GONE``.
  ``reason_user`` and ``reason_time`` say who set the reason and when, as
  Slurm reports them: a drain by someone else (NHC, an admin, NVSentinel) is
  told from trainmedic's own by its reason (`schemas.events.incident_in_reason`)
  and keeps its author. A node in an active reservation with the ``MAINT``
  flag (planned maintenance) carries ``reservation`` and the flag
  ``MAINTENANCE`` at once: Slurm sets that flag itself only at its next
  periodic reservation check. Reservations are read with one
  ``scontrol show reservation -o`` per poll (slurmio.reservations).

Restarts and idempotency
------------------------
The last-seen state lives in a small JSON file (``state_path``; default
``var/producers/slurm-state.json``, see `default_state_path`), written
atomically after the poll's events were flushed to Kafka. It is written only
after a successful flush, so a crash in between makes the next start re-emit
those changes -- with the same event ids.

Every start emits exactly ONE marker event before any change::

    SchedEvent(kind="job", job_id=None, node=None, state="SNAPSHOT",
               flags=["COLD_START"] | ["WARM_START"] (+ "STATE_UNREADABLE"),
               nodes=<nodes currently unavailable>, reason=<one-line summary>)

A warm start (state file present) then emits only what changed while the
producer was away, diffed against the file. A cold start (no file, or an
unreadable one) takes the cluster as it is as the baseline and emits nothing
else: a first start must not flood consumers with the whole cluster. The
marker tells consumers that the stream had a gap (``COLD_START``: anything
before it is unknown to this producer).

Event ids are derived, never random:

- job: job id, state, restart count, submit time and the time Slurm gives the
  state (start_time + suspend_time for RUNNING, end_time for finished states).
  They are Slurm's own fields, so a re-emission after a crash, or by a producer
  that lost its state file, carries the same id.
- node: Slurm clears a node's reason time on resume, so a node's fields do not
  tell two DRAIN->IDLE cycles apart; its ids use the state file's random
  ``epoch`` plus a per-node change counter kept in the file.
- snapshot: ``epoch`` plus the number of starts recorded in the file.

Commands are argv lists run without a shell, with an explicit environment
(PATH, LC_ALL=C, HOME, SLURM_CONF) and a timeout. A failed poll (command
error, timeout, bad JSON) is logged and counted in ``failed_polls``; it changes
no state and never ends `run`.

Where commands run is pluggable: a slurmio ``Runner`` maps an argv to its
stdout. `LocalRunner` runs them here; the executor's SSH runner (login node)
keeps the same contract and fits the same slot.

One producer per state file: two instances sharing one would each count changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus.publish import Publisher
from producers.metrics import POLL_FAILURES, ProducerHealth
from schemas.events import SchedEvent
from schemas.ids import is_node_name, stable_id
from schemas.topics import SCHED_EVENTS
from slurmio.hostlist import HostlistError, expand_hostlist
from slurmio.nodes import read_all_nodes
from slurmio.records import FINISHED_JOB_STATES, ExitStatus, NodeInfo
from slurmio.reservations import maintenance_nodes, read_reservations
from slurmio.runners import LocalRunner, Runner, SlurmCommandError
from slurmio.sinfo import parse_sinfo as slurmio_parse_sinfo
from slurmio.squeue import SQUEUE_ALL, parse_jobs
from slurmio.versions import SlurmFormatError, detect, load_document

__all__ = [
    "DEFAULT_STATE_PATH",
    "HostlistError",
    "JobView",
    "LocalRunner",
    "NodeView",
    "Runner",
    "SlurmCommandError",
    "SlurmProducer",
    "default_state_path",
    "expand_hostlist",
    "parse_sinfo",
    "parse_squeue",
]

log = logging.getLogger("trainmedic.producers.slurm")

DEFAULT_STATE_PATH = Path("var") / "producers" / "slurm-state.json"
STATE_VERSION = 1
SNAPSHOT = "SNAPSHOT"
GONE = "GONE"

# The load of a healthy node (idle/allocated/mixed) is not news.
_UP_STATES = frozenset({"IDLE", "ALLOCATED", "MIXED"})
# Set and cleared around every job end or backfill plan: noise, not health.
_IGNORED_FLAGS = frozenset({"COMPLETING", "PLANNED"})
_UNAVAILABLE_FLAGS = frozenset(
    {
        "DRAIN",
        "NOT_RESPONDING",
        "FAIL",
        "MAINTENANCE",
        "REBOOT_REQUESTED",
        "REBOOT_ISSUED",
        "POWER_DOWN",
        "POWERED_DOWN",
        "POWERING_DOWN",
        "INVALID_REG",
    }
)
_FINISHED = FINISHED_JOB_STATES


def default_state_path(data_dir: Path) -> Path:
    return Path(data_dir) / "producers" / "slurm-state.json"


# --------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class JobView:
    job_id: str
    state: str
    restart_cnt: int = 0
    submit_time: int = 0
    start_time: int = 0
    end_time: int = 0
    suspend_time: int = 0
    nodes: str = ""  # Slurm hostlist, expanded only when an event needs it
    partition: str | None = None
    state_reason: str | None = None
    exit: ExitStatus | None = None
    name: str | None = None
    user: str | None = None
    account: str | None = None
    comment: str | None = None  # sbatch --comment: the owner's trainmedic=... and the executor's mark


@dataclass(frozen=True)
class NodeView:
    name: str
    state: str  # base state, upper case
    flags: tuple[str, ...] = ()
    reason: str | None = None
    reason_time: int = 0
    partitions: tuple[str, ...] = ()
    reason_user: str | None = None
    reservation: str | None = None  # the active MAINT reservation holding it

    @property
    def unavailable(self) -> bool:
        return self.state not in _UP_STATES or bool(_UNAVAILABLE_FLAGS.intersection(self.flags))


def _load_document(text: str, what: str) -> dict[str, Any]:
    return load_document(text, what)


def parse_squeue(data: Mapping[str, Any]) -> dict[str, JobView]:
    """``squeue --json`` of any data parser slurmio reads -> job id -> JobView.

    Raises SlurmCommandError (a SlurmFormatError naming field and version) for a
    shape its version does not promise.
    """
    return {
        job_id: JobView(
            job_id=job_id,
            state=j.state,
            restart_cnt=j.restart_cnt,
            submit_time=j.submit_time or 0,
            start_time=j.start_time or 0,
            end_time=j.end_time or 0,
            suspend_time=j.suspend_time or 0,
            nodes=j.nodes,
            partition=j.partition,
            state_reason=j.state_reason,
            exit=j.exit,
            name=j.name,
            user=j.user,
            account=j.account,
            comment=j.comment[:4096] if j.comment else None,
        )
        for job_id, j in parse_jobs(data, "squeue --json").jobs.items()
    }


def parse_sinfo(data: Mapping[str, Any]) -> dict[str, NodeView]:
    """``sinfo --json`` of any data parser slurmio reads -> node name -> NodeView.

    23.02+ give one reason per group of nodes: `SlurmProducer.fetch` reads
    nodes with slurmio.nodes.read_all_nodes instead, which has each node's own.
    """
    return {name: _node_view(n) for name, n in slurmio_parse_sinfo(data, "sinfo --json").nodes.items()}


def _node_view(n: NodeInfo) -> NodeView:
    return NodeView(
        name=n.name,
        state=n.state,
        flags=n.flags,
        reason=n.reason,
        reason_time=n.reason_time or 0,
        partitions=n.partitions,
        reason_user=n.reason_user,
    )


# --------------------------------------------------------------------- state
@dataclass
class _JobMem:
    state: str
    restart_cnt: int
    submit_time: int
    nodes: str
    partition: str | None


@dataclass
class _NodeMem:
    state: str
    flags: list[str]
    reason: str | None
    seq: int = 0


@dataclass
class _State:
    epoch: str
    starts: int = 0
    jobs: dict[str, _JobMem] = field(default_factory=dict)
    nodes: dict[str, _NodeMem] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "starts": self.starts,
            "saved_at": time.time(),
            "jobs": {
                k: {
                    "state": j.state,
                    "restart": j.restart_cnt,
                    "submit": j.submit_time,
                    "nodes": j.nodes,
                    "part": j.partition,
                }
                for k, j in self.jobs.items()
            },
            "nodes": {
                k: {"state": n.state, "flags": n.flags, "reason": n.reason, "seq": n.seq} for k, n in self.nodes.items()
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> _State:
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported state version {data.get('version')!r}")
        jobs = {
            str(k): _JobMem(
                state=str(v["state"]),
                restart_cnt=int(v["restart"]),
                submit_time=int(v["submit"]),
                nodes=str(v.get("nodes") or ""),
                partition=v.get("part"),
            )
            for k, v in dict(data["jobs"]).items()
        }
        nodes = {
            str(k): _NodeMem(
                state=str(v["state"]),
                flags=[str(f) for f in v.get("flags") or []],
                reason=v.get("reason"),
                seq=int(v.get("seq", 0)),
            )
            for k, v in dict(data["nodes"]).items()
        }
        return cls(epoch=str(data["epoch"]), starts=int(data["starts"]), jobs=jobs, nodes=nodes)


def _node_fingerprint(state: str, flags: Iterable[str], reason: str | None) -> tuple[str, tuple[str, ...], str]:
    state_class = "UP" if state in _UP_STATES else state
    return state_class, tuple(sorted(set(flags) - _IGNORED_FLAGS)), reason or ""


# --------------------------------------------------------------------- producer
class SlurmProducer:
    """Polls squeue/sinfo and publishes job and node changes to sched.events.

    `poll_once` fetches, diffs, publishes, flushes and saves the state file; it
    returns the events it published ([] when the poll failed). `run` calls it
    every `interval_s` until `stop_event` is set.
    """

    def __init__(
        self,
        publisher: Publisher,
        slurm_conf: str | None = None,
        interval_s: float = 5.0,
        state_path: Path = DEFAULT_STATE_PATH,
        *,
        runner: Runner | None = None,
        command_timeout_s: float = 30.0,
        flush_timeout_s: float = 10.0,
    ) -> None:
        if runner is not None and slurm_conf is not None:
            raise ValueError("pass slurm_conf to the runner, not together with a custom runner")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.publisher = publisher
        self.runner: Runner = runner if runner is not None else LocalRunner(slurm_conf)
        self.interval_s = interval_s
        self.state_path = Path(state_path)
        self.command_timeout_s = command_timeout_s
        self.flush_timeout_s = flush_timeout_s
        self.polls = 0
        self.failed_polls: Counter[str] = Counter()
        self.emitted: Counter[str] = Counter()  # by event kind: job, node, snapshot
        self.last_error: str | None = None
        self._state: _State | None = None
        self._start_flags: list[str] = []
        self._snapshot_done = False
        self._dirty = False
        self._load_state()

    # ---- state file
    def _load_state(self) -> None:
        try:
            raw = self.state_path.read_text()
        except FileNotFoundError:
            self._start_flags = ["COLD_START"]
            return
        except OSError as exc:
            log.warning("cannot read state file %s (%s): cold start", self.state_path, exc)
            self._start_flags = ["COLD_START", "STATE_UNREADABLE"]
            return
        try:
            self._state = _State.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("state file %s is not usable (%s): cold start", self.state_path, exc)
            self._start_flags = ["COLD_START", "STATE_UNREADABLE"]
            return
        self._state.starts += 1
        self._start_flags = ["WARM_START"]

    def _save_state(self) -> None:
        assert self._state is not None
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps(self._state.to_json(), separators=(",", ":"))
        fd, tmp = tempfile.mkstemp(prefix=self.state_path.name + ".", dir=self.state_path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            # A reader never sees a half-written file: rename is atomic.
            os.replace(tmp, self.state_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    # ---- polling
    def fetch(self) -> tuple[dict[str, JobView], dict[str, NodeView]]:
        """One squeue --json, one node listing and one scontrol show reservation -o; raises SlurmCommandError."""
        # --states=all: 23.02+ list only pending/running jobs by default, and a job's end
        # (COMPLETED, FAILED, ...) must be seen, not inferred from its absence.
        squeue = _load_document(self.runner(list(SQUEUE_ALL), self.command_timeout_s), "squeue --json")
        jobs = parse_squeue(squeue)
        # Each node with its own reason (23.02+ sinfo --json gives a group of nodes one reason).
        _, infos = read_all_nodes(self.runner, self.command_timeout_s, detect(squeue, "squeue --json"))
        nodes = {name: _node_view(n) for name, n in infos.items() if is_node_name(name)}
        if len(nodes) < len(infos):
            # No event can carry such a name (schemas.ids); the others are still reported.
            odd = [name for name in infos if not is_node_name(name)]
            log.warning(
                "skipped %d node(s) whose name is not a Slurm node name: %s", len(odd), ", ".join(map(repr, odd[:5]))
            )
        in_maint = maintenance_nodes(read_reservations(self.runner, self.command_timeout_s))
        for name, resv in in_maint.items():
            if (view := nodes.get(name)) is not None:
                flags = tuple(sorted({*view.flags, "MAINTENANCE"}))
                nodes[name] = dataclasses.replace(view, flags=flags, reservation=resv)
        return jobs, nodes

    def poll_once(self) -> list[SchedEvent]:
        self.polls += 1
        now = time.time()
        try:
            jobs, nodes = self.fetch()
        except SlurmFormatError as exc:  # a Slurm whose output slurmio cannot read
            self._fail("parse", str(exc))
            return []
        except SlurmCommandError as exc:
            self._fail("command", str(exc))
            return []
        except Exception as exc:  # a parse bug must not end the producer
            self._fail("parse", f"{type(exc).__name__}: {exc}")
            return []
        try:
            events = self._diff(jobs, nodes, now)
        except Exception as exc:
            self._fail("diff", f"{type(exc).__name__}: {exc}")
            return []
        for ev in events:
            self.publisher.publish(SCHED_EVENTS, ev)
            self.emitted["snapshot" if ev.state == SNAPSHOT and ev.job_id is None else ev.kind] += 1
        if events:
            self._dirty = True
        if not self._dirty:
            return events
        left = self.publisher.flush(self.flush_timeout_s)
        if left:
            # Keep the old file: a restart re-emits these changes with the same ids.
            self._fail("flush", f"{left} events still queued after {self.flush_timeout_s:g}s; state not saved")
            return events
        try:
            self._save_state()
            self._dirty = False
        except OSError as exc:
            self._fail("state_save", f"cannot write {self.state_path}: {exc}")
        return events

    def run(self, stop_event: threading.Event) -> None:
        log.info("slurm producer: polling every %gs, state in %s", self.interval_s, self.state_path)
        # Ready once squeue and sinfo answered; a round runs three commands and a flush to their timeouts.
        liveness = ProducerHealth("slurm", self.interval_s, 3 * self.command_timeout_s + self.flush_timeout_s)
        try:
            while not stop_event.is_set():
                failed = sum(self.failed_polls.values())
                events: list[SchedEvent] = []
                try:
                    events = self.poll_once()
                except Exception as exc:  # e.g. the publisher raised: count it and keep polling
                    self._fail("unexpected", f"{type(exc).__name__}: {exc}")
                if sum(self.failed_polls.values()) > failed:
                    liveness.failed(f"slurm poll failed: {self.last_error}")
                else:
                    liveness.ok(len(events), "squeue and sinfo answer")
                stop_event.wait(self.interval_s)
        finally:
            liveness.stop()

    def _fail(self, reason: str, message: str) -> None:
        self.failed_polls[reason] += 1
        POLL_FAILURES.labels("slurm", reason).inc()
        self.last_error = message
        log.error("slurm poll failed (%s): %s", reason, message)

    # ---- diffing
    def _diff(self, jobs: Mapping[str, JobView], nodes: Mapping[str, NodeView], now: float) -> list[SchedEvent]:
        cold = self._state is None
        if self._state is None:
            self._state = _State(epoch=secrets.token_hex(8), starts=1)
        state = self._state
        changes: list[SchedEvent] = []
        if cold:
            self._absorb(jobs, nodes)
        else:
            changes.extend(self._node_changes(state, nodes, now))
            changes.extend(self._job_changes(state, jobs, now))
        if self._snapshot_done:
            return changes
        self._snapshot_done = True
        return [self._snapshot(state, jobs, nodes, len(changes), now), *changes]

    def _absorb(self, jobs: Mapping[str, JobView], nodes: Mapping[str, NodeView]) -> None:
        assert self._state is not None
        self._state.jobs = {
            k: _JobMem(j.state, j.restart_cnt, j.submit_time, j.nodes, j.partition) for k, j in jobs.items()
        }
        self._state.nodes = {k: _NodeMem(n.state, list(n.flags), n.reason) for k, n in nodes.items()}
        self._dirty = True

    def _snapshot(
        self, state: _State, jobs: Mapping[str, JobView], nodes: Mapping[str, NodeView], n_changes: int, now: float
    ) -> SchedEvent:
        by_state = Counter(j.state for j in jobs.values())
        down = sorted(n for n, v in nodes.items() if v.unavailable)
        details = ", ".join(
            f"{n} ({'+'.join([nodes[n].state, *nodes[n].flags])}{': ' + str(nodes[n].reason) if nodes[n].reason else ''})"
            for n in down[:20]
        )
        more = f" and {len(down) - 20} more" if len(down) > 20 else ""
        jobs_text = ", ".join(f"{k} {v}" for k, v in sorted(by_state.items()))
        mode = "warm" if "WARM_START" in self._start_flags else "cold"
        summary = (
            f"{mode} start #{state.starts}: {len(jobs)} jobs ({jobs_text or 'none'}), {len(nodes)} nodes, "
            f"{len(down)} unavailable{': ' + details + more if down else ''}"
            + (f"; {n_changes} changes since the last run follow" if mode == "warm" else "")
        )
        return SchedEvent(
            event_id=stable_id("sched-snap", state.epoch, state.starts),
            event_time=now,
            kind="job",
            state=SNAPSHOT,
            nodes=down,
            reason=summary[:4000],
            flags=list(self._start_flags),
        )

    def _node_changes(self, state: _State, nodes: Mapping[str, NodeView], now: float) -> list[SchedEvent]:
        events: list[SchedEvent] = []
        for name in sorted(nodes):
            view = nodes[name]
            mem = state.nodes.get(name)
            new_fp = _node_fingerprint(view.state, view.flags, view.reason)
            if mem is not None and _node_fingerprint(mem.state, mem.flags, mem.reason) == new_fp:
                mem.state, mem.flags = view.state, list(view.flags)
                continue
            seq = (mem.seq if mem else 0) + 1
            reason_changed = mem is None or (mem.reason or "") != (view.reason or "")
            events.append(
                SchedEvent(
                    event_id=stable_id("sched-node", state.epoch, name, seq, repr(new_fp)),
                    event_time=float(view.reason_time) if reason_changed and view.reason_time > 0 else now,
                    kind="node",
                    node=name,
                    state=view.state,
                    previous_state=mem.state if mem else None,
                    partition=",".join(view.partitions) or None,
                    reason=view.reason,
                    flags=list(view.flags),
                    reason_user=view.reason_user if view.reason else None,
                    reason_time=float(view.reason_time) if view.reason and view.reason_time > 0 else None,
                    reservation=view.reservation,
                )
            )
            state.nodes[name] = _NodeMem(view.state, list(view.flags), view.reason, seq)
        for name in sorted(set(state.nodes) - set(nodes)):
            mem = state.nodes.pop(name)
            events.append(
                SchedEvent(
                    event_id=stable_id("sched-node", state.epoch, name, mem.seq + 1, GONE),
                    event_time=now,
                    kind="node",
                    node=name,
                    state=GONE,
                    previous_state=mem.state,
                )
            )
        return events

    def _job_changes(self, state: _State, jobs: Mapping[str, JobView], now: float) -> list[SchedEvent]:
        events: list[SchedEvent] = []
        for job_id in sorted(jobs, key=_job_sort_key):
            view = jobs[job_id]
            mem = state.jobs.get(job_id)
            if mem is not None and view.restart_cnt < mem.restart_cnt:
                mem = None  # the id was reused (slurmctld state wiped): a different job
            if mem is not None and (mem.state, mem.restart_cnt) == (view.state, view.restart_cnt):
                mem.nodes, mem.partition = view.nodes, view.partition
                continue
            events.append(self._job_event(view, mem, now))
            state.jobs[job_id] = _JobMem(view.state, view.restart_cnt, view.submit_time, view.nodes, view.partition)
        for job_id in sorted(set(state.jobs) - set(jobs), key=_job_sort_key):
            mem = state.jobs.pop(job_id)
            events.append(
                SchedEvent(
                    event_id=stable_id("sched-job", job_id, GONE, mem.restart_cnt, mem.submit_time, mem.state),
                    event_time=now,
                    kind="job",
                    job_id=job_id,
                    state=GONE,
                    previous_state=mem.state,
                    nodes=_safe_expand(mem.nodes),
                    partition=mem.partition,
                )
            )
        return events

    def _job_event(self, view: JobView, mem: _JobMem | None, now: float) -> SchedEvent:
        if view.state == "RUNNING":
            anchor: tuple[int, ...] = (view.start_time, view.suspend_time)
            when = view.suspend_time or view.start_time
        elif view.state in _FINISHED:
            anchor = (view.end_time,)
            when = view.end_time
        elif view.state == "PENDING":
            # submit_time is reset on requeue, so it dates this PENDING.
            anchor = ()
            when = view.submit_time
        else:
            anchor = ()
            when = 0
        reason_parts = [p for p in (view.state_reason,) if p]
        if view.state in _FINISHED and view.exit is not None and (exit_text := view.exit.text()):
            reason_parts.append(exit_text)
        flags = ["REQUEUED"] if mem is not None and view.restart_cnt > mem.restart_cnt else []
        return SchedEvent(
            event_id=stable_id("sched-job", view.job_id, view.state, view.restart_cnt, view.submit_time, *anchor),
            event_time=float(when) if when > 0 else now,
            kind="job",
            job_id=view.job_id,
            state=view.state,
            previous_state=mem.state if mem else None,
            nodes=_safe_expand(view.nodes),
            partition=view.partition,
            reason="; ".join(reason_parts) or None,
            flags=flags,
            job_name=view.name,
            user=view.user,
            account=view.account,
            restart_count=view.restart_cnt,
            comment=view.comment,
        )


def _job_sort_key(job_id: str) -> tuple[int, str]:
    head = re.match(r"\d+", job_id)
    return (int(head.group()) if head else 0, job_id)


def _safe_expand(nodelist: str) -> list[str]:
    try:
        return expand_hostlist(nodelist)
    except HostlistError as exc:
        # One odd nodelist must not cost the whole poll; the warning says where (the text is no node name).
        log.warning("%s", exc)
        return []
