"""The executor: carries out actions on the scheduler, one replica at a time.

For each action it acts, reads the scheduler back until the effect is
visible (or a timeout), publishes an ActionResult, and only then commits the
action's offset. Each step first checks whether its effect is already there,
so a redelivered action is not performed twice.

Before every scheduler call that may change the cluster (drain, requeue, hold,
cancel) the executor writes an ActionAttempt to action.attempts (acks=all,
flushed), counts it in the guardrails and confirms it still holds the acting
lease (sinks/lease.py); only then does it make the call. A node is drained for
a job's incident only when the scheduler says the job runs there, or the node
itself reported the fault. When a cap on drains (blast radius, node cooldown)
refuses a drain_and_requeue's drain, the node stays in service and the job is
still requeued with it excluded.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from bus import health
from bus.consume import read_records
from bus.deadletter import make_dead_letter
from bus.publish import NotDelivered, Publisher
from bus.watchdog import WatchedConsumer
from schemas import errors
from schemas.codec import DecodeError, decode
from schemas.errors import Unavailable
from schemas.events import (
    Action,
    ActionAttempt,
    ActionResult,
    AttemptCall,
    GuardrailTrip,
    NodeCommand,
    incident_in_reason,
)
from schemas.ids import cluster_scoped, current_cluster, stable_id
from schemas.job_settings import checkpoint_signal, job_mode
from schemas.topics import (
    ACTION_ATTEMPTS,
    ACTION_RESULTS,
    ACTIONS,
    DEADLETTER,
    GUARDRAIL_TRIPS,
    NODE_COMMANDS,
)
from schemas.vocab import Guardrail
from sinks import metrics
from sinks.backends.base import ActionRefused, BackendError, JobState, NodeState, SchedulerBackend
from sinks.guardrails import GuardrailFile, Guardrails, Trip, requeues_without_drain
from sinks.lease import ActingLease, Fenced

log = logging.getLogger("trainmedic.executor")

_GONE = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")

# Called before each scheduler call that may change the cluster; raises to prevent the call.
BeforeCall = Callable[[Action, AttemptCall], None]
# Puts a command on node.commands for the node's agent, acknowledged before it returns; NotDelivered if not.
PublishCommand = Callable[[NodeCommand], None]


class VerifyTimeout(Unavailable, RuntimeError):
    pass


class Refused(errors.Refused):
    """A guardrail stopped the action: nothing (more) is done, the refusal is audited."""

    def __init__(self, guardrail: Guardrail, detail: str) -> None:
        super().__init__(f"{guardrail}: {detail}")
        self.guardrail: Guardrail = guardrail
        self.detail = detail


class AttemptNotRecorded(Unavailable, RuntimeError):
    """The attempt record was not acknowledged: the call is not made, the action is retried."""


def _marked_restarts(comment: str | None, action_id: str) -> int | None:
    """The restart count our mark recorded before requeueing, if the mark is this action's."""
    m = re.search(rf"trainmedic {re.escape(action_id)} restarts=(\d+)", comment or "")
    return int(m.group(1)) if m else None


# Slurm's flags of a node whose reboot is asked for or under way.
_REBOOT_PENDING = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED", "REBOOT"})
# Our mark, with the separator it was written after: an earlier action's is replaced, not stacked.
_MARK_RE = re.compile(r"(?:\s*\|\s*)?trainmedic act-[0-9A-Za-z_-]+ restarts=\d+")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]+")


def annotated(comment: str | None, mark: str) -> str:
    """The job's Comment with our mark: what its owner wrote is kept (their trainmedic= setting,
    their notes), an earlier mark of ours is replaced. Control characters, which no scheduler
    call may carry, become spaces."""
    own = _CONTROL_RE.sub(" ", _MARK_RE.sub("", comment or "")).strip()
    return f"{own} | {mark}" if own else mark


@dataclass
class ExecutorSettings:
    verify_timeout_s: float = 60.0
    poll_interval_s: float = 0.2
    group: str = "trainmedic-executor"
    # A replica that has not polled its consumers this long leaves the groups and loses the
    # acting lease; it must exceed the longest action (a few verify timeouts).
    max_poll_interval_s: float = 300.0


@dataclass
class _Run:
    action: Action
    started_at: float
    before_call: BeforeCall
    steps: list[str] = field(default_factory=list)


class Executor:
    def __init__(self, backend: SchedulerBackend, settings: ExecutorSettings | None = None) -> None:
        self.backend = backend
        self.settings = settings or ExecutorSettings()
        # How a reset_gpu remediation reaches the node's agent (ExecutorService sets its publisher's);
        # None: no agent can be asked, the node stays drained for a person.
        self.publish_command: PublishCommand | None = None

    # -- one action -----------------------------------------------------------------

    def execute(self, action: Action, before_call: BeforeCall, drain_refused: Trip | None = None) -> ActionResult:
        """Carry out one action. `before_call` runs before every call that may change the cluster
        (the service records and counts the attempt there, and checks its lease).

        `drain_refused`: the guardrail trip that refused a drain_and_requeue's drain alone
        (sinks/guardrails.py requeues_without_drain): the node is left in service, the job is
        requeued with it excluded, and the steps say both.

        Raises Refused when a guardrail checked at a call stops the action (the culprit check),
        and lets Fenced and AttemptNotRecorded through: then no result is due from this replica.
        """
        if drain_refused is not None and not requeues_without_drain(action, drain_refused):
            raise ValueError(f"{action.action_id}: a refused drain leaves nothing to do for {action.action}")
        run = _Run(action, time.time(), before_call)
        try:
            if action.action == "none":
                run.steps.append("nothing to do")
                return self._result(run, "skipped", None, verified=False)
            if action.action == "drain_and_requeue":
                if not action.node:
                    # An approved isolation whose culprit is only a rank or GPU: a plain requeue
                    # could land on the same bad GPU. A person must name the node.
                    raise BackendError("drain_and_requeue needs the culprit's node; none is known")
                if drain_refused is None:
                    self._drain(run)
                else:
                    guardrail, detail = drain_refused
                    run.steps.append(
                        f"drain {action.node}: refused by guardrail {guardrail} ({detail}); it stays in service, "
                        f"job {action.job_id} is requeued with it excluded"
                    )
                if action.job_id:
                    self._requeue(run, exclude=[action.node])
                if drain_refused is None:
                    # A remediation (reboot, GPU reset) is for a node drained for the incident.
                    self._remediate(run)
            elif action.action == "drain_and_stop":
                # The job's budget is spent, and its node's own fault still takes the node out.
                if not action.job_id:
                    raise BackendError("drain_and_stop needs a job id")
                if action.node:
                    self._drain(run)
                self._stop(run)
                self._remediate(run)
            elif action.action == "drain" and action.nodes:
                self._drain_set(run)
            elif action.action == "drain":
                # The node only: the job's owner said trainmedic must not touch the job, and a
                # drain lets it run on (Slurm drains a node once its jobs end).
                if not action.node:
                    raise BackendError("drain needs the culprit's node; none is known")
                drained_now = self._drain(run)
                if action.predicted and action.job_id and drained_now:
                    self._ask_checkpoint(run)
                self._remediate(run)
            elif action.action == "requeue":
                if not action.job_id:
                    raise BackendError("requeue needs a job id")
                self._requeue(run, exclude=[action.node] if action.exclude_node and action.node else [])
            elif action.action == "stop":
                if not action.job_id:
                    raise BackendError("stop needs a job id")
                self._stop(run)
            return self._result(run, "done", None, verified=True)
        except ActionRefused as exc:
            # The backend refused before calling the scheduler (maintenance, someone else's drain,
            # a down node): nothing changed; the result says why, so the suppression is audited.
            log.warning("action %s suppressed: %s", action.action_id, exc)
            run.steps.append(f"refused: {exc}")
            return self._result(run, "skipped", str(exc), verified=False)
        except (BackendError, VerifyTimeout, ValueError) as exc:
            log.error("action %s failed: %s", action.action_id, exc)
            return self._result(run, "failed", str(exc), verified=False)

    def refused(self, action: Action, why: str) -> ActionResult:
        run = _Run(action, time.time(), _no_call)
        run.steps.append("refused: " + why)
        return self._result(run, "skipped", why, verified=False)

    def _wait(self, what: str, check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.settings.verify_timeout_s
        while True:
            if check():
                return
            if time.monotonic() > deadline:
                raise VerifyTimeout(f"not verified within {self.settings.verify_timeout_s:.0f} s: {what}")
            time.sleep(self.settings.poll_interval_s)

    def _check_culprit(self, a: Action) -> None:
        """Refuse to drain a node for a job's incident unless the scheduler places the job there
        or the node reported the fault itself. Fails closed: unreadable placement, no drain."""
        if not a.job_id or a.node_reported_fault or a.node_failed:
            return
        try:
            nodes = self.backend.job_state(a.job_id).nodes
        except Exception as exc:  # any failure to read the placement: do not drain
            raise Refused(
                "culprit_not_in_job",
                f"not draining {a.node}: the nodes of job {a.job_id} cannot be read from the scheduler ({exc}), "
                "and only the node's own kernel/GPU report could justify draining it without them",
            ) from None
        if a.node not in nodes:
            raise Refused(
                "culprit_not_in_job",
                f"not draining {a.node}: it is not one of job {a.job_id}'s nodes per the scheduler "
                f"({','.join(nodes) or 'none'}); the job's output named it, the node itself reported nothing",
            )

    def _drain(self, run: _Run) -> bool:
        """Drain the action's node; whether this call drained it (False: it already was)."""
        a = run.action
        assert a.node
        state = self.backend.node_state(a.node)
        if state.drained and state.reason and a.incident_id in state.reason:
            run.steps.append(f"drain {a.node}: already drained for {a.incident_id}")
            return False
        if state.drained:
            # Someone else drained it: leave their reason alone, it is out of service either way.
            by = f" by {state.reason_user}" if state.reason_user else ""
            run.steps.append(f"drain {a.node}: already drained by someone else ({state.reason}{by})")
            return False
        # Checked here, just before the call, not only when the action arrived: a redelivered
        # action is not re-checked by the guardrails, and the job may have moved since.
        self._check_culprit(a)
        run.before_call(a, "drain")
        self.backend.drain_node(a.node, a.reason, node_failed=a.node_failed)

        def drained() -> bool:
            s = self.backend.node_state(a.node or "")
            return s.drained and bool(s.reason) and a.incident_id in (s.reason or "")

        self._wait(f"{a.node} DRAIN with reason naming {a.incident_id}", drained)
        run.steps.append(f"drain {a.node}: verified DRAIN, reason {a.reason!r}")
        return True

    def _ask_checkpoint(self, run: _Run) -> None:
        """A migration's drain (streams/migration.py): the job is asked for a checkpoint now, when its
        comment declares the signal it saves on - its checkpoint interval may be longer than the
        warning's lead time. Sent once: a redelivered action finds the node drained and sends nothing.
        Failing to send it fails nothing: the migration waits for the job's own next save."""
        a = run.action
        assert a.job_id
        comment = self.backend.job_state(a.job_id).comment
        signal = checkpoint_signal(comment)
        if signal is None:
            run.steps.append(f"job {a.job_id}: declares no checkpoint_signal, its own next save is awaited")
            return
        run.before_call(a, "signal")
        try:
            self.backend.signal_job(a.job_id, signal)
        except BackendError as exc:
            run.steps.append(f"job {a.job_id}: asking for a checkpoint ({signal}) failed: {exc}")
            return
        run.steps.append(f"job {a.job_id}: asked for a checkpoint now ({signal}, as its comment declares)")

    def _drain_set(self, run: _Run) -> None:
        """A fleet incident's drain set: each node of the shared component not yet out of service
        is drained (its jobs run on: Slurm drains a node once they end). The guardrails passed the
        set as a whole; a node the scheduler refuses (maintenance, down, drained meanwhile by
        someone else) is left as it is and said. Each drain is recorded as its own attempt."""
        a = run.action
        pending: list[str] = []
        for node in a.nodes:
            one = a.model_copy(update={"node": node, "nodes": []})
            state = self.backend.node_state(node)
            if state.drained and a.incident_id in (state.reason or ""):
                run.steps.append(f"drain {node}: already drained for {a.incident_id}")
                continue
            if state.drained:
                by = f" by {state.reason_user}" if state.reason_user else ""
                run.steps.append(f"drain {node}: already out of service ({state.reason}{by}), left as it is")
                continue
            run.before_call(one, "drain")
            try:
                self.backend.drain_node(node, a.reason)
            except ActionRefused as exc:
                run.steps.append(f"drain {node}: refused by the scheduler side ({exc}), left as it is")
                continue
            pending.append(node)
        for node in pending:

            def drained(node: str = node) -> bool:
                s = self.backend.node_state(node)
                return s.drained and a.incident_id in (s.reason or "")

            self._wait(f"{node} DRAIN with reason naming {a.incident_id}", drained)
            run.steps.append(f"drain {node}: verified DRAIN, reason {a.reason!r}")

    def _remediate(self, run: _Run) -> None:
        """After the drain: what the fault's resolution bucket calls for (the decision's remediation).
        Each step recognises itself done (a redelivered action issues nothing twice)."""
        a = run.action
        if a.remediation is None or not a.node:
            return
        bucket = a.remediation_bucket or "?"
        state = self.backend.node_state(a.node)
        if a.remediation == "reset_gpu":
            self._ask_gpu_reset(run, state, bucket)
            return
        if a.remediation == "repair":
            label = f"repair: {bucket}"
            if label in (state.reason or ""):
                run.steps.append(f"repair label on {a.node}: already there")
                return
            run.before_call(a, "relabel")
            try:
                self.backend.relabel_node(a.node, f"{state.reason or a.reason} | {label}")
            except BackendError as exc:
                run.steps.append(f"repair label on {a.node} not set ({exc}): it stays drained")
                return
            run.steps.append(f"repair label on {a.node}: {label} (stays drained for a person)")
            return
        label = f"| reboot ({bucket})"
        if _REBOOT_PENDING & set(state.flags) or label in (state.reason or ""):
            # Asked for already: pending, or done and back (our reason says so). Never twice.
            run.steps.append(f"reboot {a.node}: already requested ({'+'.join(state.flags) or state.reason})")
            return
        run.before_call(a, "reboot")
        try:
            next_state = self.backend.reboot_node(a.node, f"{a.reason} {label}")
        except BackendError as exc:
            # The node stays drained either way: the remediation is left to a person, and said.
            run.steps.append(f"reboot {a.node} not done ({exc}): it stays drained for a person")
            return
        self._wait(
            f"{a.node} reboot requested",
            lambda: bool(_REBOOT_PENDING & set(self.backend.node_state(a.node or "").flags)),
        )
        run.steps.append(
            f"reboot {a.node}: requested ASAP ({bucket}), back as {next_state} until its health check passes"
        )

    def _ask_gpu_reset(self, run: _Run, state: NodeState, bucket: str) -> None:
        """Ask the node's agent (sinks/node_agent.py) to reset the culprit GPU, every GPU when none is
        known, once nothing runs on the node. The drain reason's marker says it was asked, so a
        redelivered action never asks twice. The marker follows the acknowledged command: a reason
        never claims a reset nobody was asked for, and a crash between the two asks again with the
        same command id, which the agent carries out once."""
        a = run.action
        assert a.node
        marker = f"| gpu reset ({bucket})"
        which = "every GPU" if a.culprit_gpu is None else f"GPU {a.culprit_gpu}"
        if marker in (state.reason or ""):
            run.steps.append(f"gpu reset on {a.node}: already asked of its node agent ({state.reason})")
            return
        if not state.drained or incident_in_reason(state.reason) != a.incident_id:
            # The agent resets only a node drained for this incident: another drain is its owner's.
            run.steps.append(
                f"gpu reset on {a.node} not asked: it is not drained for {a.incident_id} (reason {state.reason!r})"
            )
            return
        if self.publish_command is None:
            run.steps.append(f"gpu reset on {a.node} not asked: no node agent can be reached; it stays drained")
            return
        now = time.time()
        command_id = stable_id("cmd", a.action_id)
        try:
            command = NodeCommand(
                event_id=command_id,
                event_time=now,
                command_id=command_id,
                node=a.node,
                kind="gpu_reset",
                gpu=a.culprit_gpu,
                action_id=a.action_id,
                incident_id=a.incident_id,
                reason=state.reason or a.reason,
                requested_by=a.requested_by,
                issued_at=now,
            )
        except ValueError as exc:
            run.steps.append(f"gpu reset on {a.node} not asked ({exc}): it stays drained for a person")
            return
        run.before_call(a, "reset_gpu")
        try:
            self.publish_command(command)
        except NotDelivered as exc:
            run.steps.append(f"gpu reset on {a.node} not asked ({exc}): it stays drained for a person")
            return
        try:
            self.backend.relabel_node(a.node, f"{state.reason or a.reason} {marker}")
        except BackendError as exc:
            run.steps.append(
                f"gpu reset of {which} on {a.node}: asked of its node agent (command {command_id}), "
                f"but the drain reason was not marked ({exc})"
            )
            return
        run.steps.append(
            f"gpu reset of {which} on {a.node}: asked of its node agent ({bucket}, command {command_id}) for when "
            "nothing runs there; it stays drained until its health check passes"
        )

    def _owner_allows(self, run: _Run, before: JobState, what: str) -> None:
        """The job's comment as it is now (its owner may have changed it since the incident): off,
        or an unreadable setting, and trainmedic does not touch the job; monitor leaves it to an
        operator's approval. Raises ActionRefused (nothing called)."""
        mode, error = job_mode(before.comment)
        a = run.action
        approved = a.requested_by.startswith("operator")
        if mode == "off" or error is not None and not approved:
            why = error or "trainmedic=off"
            raise ActionRefused(f"not {what} job {a.job_id}: its comment says {why}")
        if mode == "monitor" and not approved:
            raise ActionRefused(
                f"not {what} job {a.job_id}: its comment says trainmedic=monitor (recommendations only)"
            )

    def _requeue(self, run: _Run, exclude: list[str]) -> None:
        a = run.action
        assert a.job_id
        before = self.backend.job_state(a.job_id)
        if _marked_restarts(before.comment, a.action_id) is None:
            self._owner_allows(run, before, "requeueing")
        marked = _marked_restarts(before.comment, a.action_id)
        if marked is not None and before.restart_count > marked:
            # Our own mark in the scheduler says this action already requeued the job
            # (the executor died before committing): do not requeue it twice, but finish
            # what a crash may have left half done (exclusion not set, job still held).
            run.steps.append(
                f"requeue {a.job_id}: already done by this action (restarts {marked}->{before.restart_count})"
            )
            if not set(exclude) <= set(before.excluded_nodes):
                self._wait(f"job {a.job_id} PENDING", lambda: self.backend.job_state(a.job_id or "").state == "PENDING")
                run.before_call(a, "requeue")
                self.backend.requeue_job(a.job_id, exclude)
                run.steps.append(f"requeue {a.job_id}: exclusion of {','.join(exclude)} completed")
            if before.held:
                # A requeued job passes COMPLETING/REQUEUE_HOLD before it is PENDING and releasable.
                self._wait(f"job {a.job_id} PENDING", lambda: self.backend.job_state(a.job_id or "").state == "PENDING")
                self.backend.release_job(a.job_id)
                run.steps.append(f"requeue {a.job_id}: released the hold a crash left behind")
        elif before.state in _GONE:
            raise BackendError(f"job {a.job_id} is {before.state}; nothing to requeue")
        else:
            # Recorded before the mark too: a replica that lost the lease writes nothing to the job.
            run.before_call(a, "requeue")
            mark = f"trainmedic {a.action_id} restarts={before.restart_count}"
            self.backend.annotate_job(a.job_id, annotated(before.comment, mark))
            self.backend.requeue_job(a.job_id, exclude)

            def requeued() -> bool:
                s = self.backend.job_state(a.job_id or "")
                return s.restart_count > before.restart_count and self._requeue_done(s, exclude)

            self._wait(f"job {a.job_id} requeued excluding {exclude}", requeued)
            run.steps.append(
                f"requeue {a.job_id}: verified requeued (restarts {before.restart_count}->{before.restart_count + 1})"
            )

        def running() -> bool:
            s = self.backend.job_state(a.job_id or "")
            return s.state == "RUNNING" and not set(exclude) & set(s.nodes)

        self._wait(f"job {a.job_id} RUNNING on nodes without {exclude}", running)
        s = self.backend.job_state(a.job_id)
        run.steps.append(f"job {a.job_id}: RUNNING again on {','.join(s.nodes)}")

    @staticmethod
    def _requeue_done(s: JobState, exclude: list[str]) -> bool:
        """The job is off the excluded nodes and can never be placed on them again."""
        return set(exclude) <= set(s.excluded_nodes) and not set(exclude) & set(s.nodes)

    def _stop(self, run: _Run) -> None:
        a = run.action
        assert a.job_id
        state = self.backend.job_state(a.job_id)
        if state.state in _GONE:
            run.steps.append(f"stop {a.job_id}: already {state.state}")
            return
        if not (a.stop_mode == "hold" and state.held and state.state == "PENDING"):
            self._owner_allows(run, state, "stopping")
        if a.stop_mode == "hold":
            # Held, not cancelled: the job keeps its place and its history for a human to look at.
            if not (state.held and state.state == "PENDING"):
                run.before_call(a, "hold")
                self.backend.hold_job(a.job_id)

            def held() -> bool:
                s = self.backend.job_state(a.job_id or "")
                return s.held and s.state == "PENDING"

            self._wait(f"job {a.job_id} held", held)
            run.steps.append(f"stop {a.job_id}: verified held (PENDING, held for an operator)")
            return
        run.before_call(a, "cancel")
        self.backend.cancel_job(a.job_id)
        self._wait(f"job {a.job_id} stopped", lambda: self.backend.job_state(a.job_id or "").state in _GONE)
        run.steps.append(f"stop {a.job_id}: verified CANCELLED")

    def _result(self, run: _Run, status: str, error: str | None, verified: bool) -> ActionResult:
        a = run.action
        now = time.time()
        return ActionResult(
            event_id=f"res-{a.action_id.removeprefix('act-')}",
            event_time=now,
            action_id=a.action_id,
            incident_id=a.incident_id,
            job_id=a.job_id,
            node=a.node,
            action=a.action,
            status=status,  # type: ignore[arg-type]
            backend=self.backend.name,
            steps=run.steps,
            error=error,
            started_at=run.started_at,
            verified_at=now if verified else None,
            incident_time=a.incident_time,
            first_signal_time=a.first_signal_time,
        )


def _no_call(action: Action, call: AttemptCall) -> None:
    raise AssertionError(f"a refused action made a {call} call")  # refused() performs nothing


class ExecutorService:
    """The executor replica: stands by, or holds the acting lease and works the actions topic.

    Every replica joins the lease group; only the lease holder (sinks/lease.py) reads back the
    attempts, subscribes to the actions topic and calls the scheduler. A replica that loses the
    lease closes its actions consumer without committing, so the holder after it redoes what it
    left half done (every step recognises what is already done, and its attempts are counted).
    Offsets are committed only after the result is published.
    """

    def __init__(
        self,
        bootstrap: str,
        executor: Executor,
        guardrails: Guardrails | None = None,
        client_id: str = "trainmedic-executor",
    ) -> None:
        self.executor = executor
        self.guardrails = guardrails or Guardrails(GuardrailFile(None), executor.backend)
        self._bootstrap = bootstrap
        self._client_id = client_id
        # Names the replica in its attempt records: client ids are often the same on every host.
        self.replica = f"{client_id}@{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        settings = executor.settings
        self._lease = ActingLease(
            bootstrap, f"{cluster_scoped(settings.group)}.lease", client_id, settings.max_poll_interval_s
        )
        self._consumer: WatchedConsumer | None = None  # the actions consumer, only while holding the lease
        self._publisher = Publisher(bootstrap, client_id)
        executor.publish_command = self._publish_command
        self._restored_epoch = 0  # the lease epoch whose attempts have been read back
        self.stop_event = threading.Event()
        self.results: list[ActionResult] = []
        self.trips: list[GuardrailTrip] = []
        self.attempts: list[ActionAttempt] = []  # recorded by this replica
        self.rejected = 0
        self.fenced = 0  # times this replica found it had lost the lease while working

    @property
    def acting(self) -> bool:
        """Holds the lease and has read back the attempts: may act."""
        return self._lease.owned and self._restored_epoch == self._lease.epoch

    # -- the attempt record, the one thing every scheduler call waits for ---------------

    def _before_call(self, action: Action, call: AttemptCall) -> None:
        if not self.acting:
            raise Fenced("this replica does not hold the acting lease")
        attempt = ActionAttempt(
            event_id=f"att-{action.action_id.removeprefix('act-')}-{call}-{time.time_ns()}",
            event_time=time.time(),
            action_id=action.action_id,
            incident_id=action.incident_id,
            job_id=action.job_id,
            node=action.node,
            partition=action.partition,
            action=action.action,
            call=call,
            executor=self.replica,
            predicted=action.predicted,
        )
        # Counted before it is written: if the record fails, this replica still errs on counting.
        self.guardrails.count(attempt)
        end = self._record(attempt)
        # After the record, not before: whatever a confirmed holder did is on the topic before a
        # successor can hold the lease and read the topic back.
        self._lease.confirm(end)
        self.attempts.append(attempt)
        metrics.ATTEMPTS.labels(call).inc()

    def _publish_command(self, command: NodeCommand) -> None:
        """A command to a node's agent, acknowledged (acks=all) before the drain reason says it was asked."""
        self._publisher.publish_sync(NODE_COMMANDS, command, timeout_s=30)

    def _record(self, attempt: ActionAttempt) -> int:
        """Write the attempt to its partition, acks=all, and wait for it; the end offset after it."""
        try:
            # One record per flush: the broker's end offset is exact for single-record batches.
            return self._publisher.publish_sync(ACTION_ATTEMPTS, attempt, timeout_s=30) + 1
        except NotDelivered as exc:
            raise AttemptNotRecorded(f"attempt {attempt.call} for {attempt.action_id} not recorded: {exc}") from None

    # -- taking over ----------------------------------------------------------------------

    def _restore(self) -> bool:
        """Read back every attempt within the guardrails' horizon; False if that failed.

        Fails closed: without the earlier attempts the counts would start from zero, so a
        replica that cannot read them does not act (it retries)."""
        now = time.time()
        try:
            records = read_records(self._bootstrap, ACTION_ATTEMPTS.name, now - self.guardrails.horizon_s)
        except (KafkaException, TimeoutError) as exc:
            log.error("cannot read back %s (%s): not acting until it can be read", ACTION_ATTEMPTS.name, exc)
            return False
        attempts = []
        for _, value in records:
            try:
                attempts.append(decode(ActionAttempt, value))
            except DecodeError as exc:
                log.error("unreadable record on %s skipped: %s", ACTION_ATTEMPTS.name, exc)
        counted = self.guardrails.restore(attempts)
        log.info(
            "acting lease held: %d attempt record(s) read back from %s, %d new to the guardrails' counts",
            len(attempts),
            ACTION_ATTEMPTS.name,
            counted,
        )
        return True

    def _subscribe_actions(self) -> WatchedConsumer:
        settings = self.executor.settings
        # Watched (bus/watchdog.py): a holder of the lease whose actions consumer gets no partition,
        # or does not move with actions waiting, would otherwise be ready and acting and do nothing.
        return WatchedConsumer(
            self._bootstrap,
            cluster_scoped(settings.group),
            self._client_id,
            [ACTIONS.name],
            name="executor-actions",
            background=False,  # an action waits on this fetch
            overrides={"max.poll.interval.ms": int(settings.max_poll_interval_s * 1000)},
            on_assign=lambda _c, ps: log.info("actions partitions assigned: %s", sorted(p.partition for p in ps)),
        )

    def _stand_by(self) -> None:
        """Stop consuming actions, committing nothing more."""
        metrics.EXECUTOR_ACTING.set(0)
        if self._consumer is not None:
            log.info("standing by: the actions consumer leaves group %s", self.executor.settings.group)
            try:
                self._consumer.close()
            except (KafkaException, RuntimeError) as exc:
                log.warning("closing the actions consumer: %s", exc)
            self._consumer = None

    # -- one action ---------------------------------------------------------------------

    def _handle(self, action: Action) -> tuple[ActionResult, GuardrailTrip | None]:
        now = time.time()
        drain_refused: Trip | None = None
        try:
            try:
                trip = self.guardrails.check(action, now)
            except BackendError as exc:
                # The partition's state cannot be read (slurmctld away): fail closed, and keep the
                # loop alive - a dead executor would crash-loop `up` on the same action.
                raise Refused("blast_radius", f"partition state unreadable, not acting: {exc}") from None
            if trip is not None and requeues_without_drain(action, trip):
                # A cap on drains refused the node, not the job: the job still leaves it.
                drain_refused = trip
            elif trip is not None:
                raise Refused(*trip)
            log.info("executing %s %s job=%s node=%s", action.action_id, action.action, action.job_id, action.node)
            result = self.executor.execute(action, self._before_call, drain_refused)
        except Refused as refusal:
            log.warning("guardrail %s stopped %s: %s", refusal.guardrail, action.action_id, refusal.detail)
            event = self._trip(action, refusal.guardrail, refusal.detail, now)
            return self.executor.refused(action, f"guardrail {refusal.guardrail}: {refusal.detail}"), event
        if result.status == "done" and result.verified_at is not None:
            metrics.ACTION_LATENCY.observe(max(0.0, result.verified_at - action.incident_time))
        if drain_refused is None:
            return result, None
        guardrail, detail = drain_refused
        log.warning("guardrail %s refused the drain of %s: %s", guardrail, action.action_id, detail)
        outcome = f"the drain alone: the requeue of job {action.job_id} with {action.node} excluded is {result.status}"
        return result, self._trip(action, guardrail, f"{detail} ({outcome})", now)

    @staticmethod
    def _trip(action: Action, guardrail: Guardrail, detail: str, now: float) -> GuardrailTrip:
        return GuardrailTrip(
            event_id=f"grd-{action.action_id.removeprefix('act-')}-{guardrail}",
            event_time=now,
            guardrail=guardrail,
            action_id=action.action_id,
            incident_id=action.incident_id,
            job_id=action.job_id,
            node=action.node,
            partition=action.partition,
            action=action.action,
            detail=detail,
        )

    def _dead_letter(self, consumer: Consumer, msg: Message, exc: DecodeError) -> None:
        # An action we cannot read is never guessed at: dead-letter it, loudly.
        self.rejected += 1
        log.error("rejected undecodable action at %s/%s: %s", msg.partition(), msg.offset(), exc)
        letter = make_dead_letter(
            "sinks.executor", msg.topic() or ACTIONS.name, msg.partition(), msg.offset(), str(exc), msg.value()
        )
        self._publisher.publish(DEADLETTER, letter)
        if self._publisher.flush(30) != 0:
            log.error("dead letter for %s/%s not delivered; not committing", msg.partition(), msg.offset())
            self._retry_later(consumer, msg)
            return
        try:
            consumer.commit(message=msg, asynchronous=False)
        except KafkaException as exc:
            raise Fenced(f"committing a dead letter in {self.executor.settings.group}: {exc}") from None

    @staticmethod
    def _retry_later(consumer: Consumer, msg: Message) -> None:
        """Poll this message again (the position has moved past it)."""
        consumer.seek(TopicPartition(msg.topic() or ACTIONS.name, msg.partition() or 0, msg.offset() or 0))

    def _process(self, consumer: Consumer, msg: Message) -> None:
        try:
            action = decode(Action, msg.value() or b"")
        except DecodeError as exc:
            self._dead_letter(consumer, msg, exc)
            return
        if action.cluster != current_cluster():
            # Fail closed: this replica's scheduler is not that cluster's. Its own executors (their
            # own consumer group) carry it out; here it is only passed over.
            log.warning(
                "action %s is for cluster %s, not %s: not acted on", action.action_id, action.cluster, current_cluster()
            )
            metrics.FOREIGN_ACTIONS.labels(action.cluster).inc()
            try:
                consumer.commit(message=msg, asynchronous=False)
            except KafkaException as exc:
                raise Fenced(f"committing past {action.action_id} in {self.executor.settings.group}: {exc}") from None
            return
        _, ts_ms = msg.timestamp()
        if ts_ms > 0:
            metrics.RECORD_AGE.labels("executor", ACTIONS.name).set(max(0.0, time.time() - ts_ms / 1000))
        try:
            result, trip = self._handle(action)
        except AttemptNotRecorded as exc:
            log.error("%s: no scheduler call made; %s is retried", exc, action.action_id)
            self._retry_later(consumer, msg)
            self.stop_event.wait(1.0)
            return
        # Only the lease holder says what happened: a fenced replica's verdict could overwrite
        # its successor's (raises Fenced).
        self._lease.confirm()
        metrics.ACTIONS.labels(action.action, result.status).inc()
        if trip is not None:
            self._publisher.publish(GUARDRAIL_TRIPS, trip)
            metrics.GUARDRAIL_TRIPS.labels(trip.guardrail).inc()
        self._publisher.publish(ACTION_RESULTS, result)
        if self._publisher.flush(30) != 0:
            log.error("result of %s not delivered; not committing, it is retried", action.action_id)
            self._retry_later(consumer, msg)
            return
        if trip is not None:
            self.trips.append(trip)
        self.results.append(result)
        log.info("result %s: %s %s", action.action_id, result.status, "; ".join(result.steps))
        try:
            consumer.commit(message=msg, asynchronous=False)
        except KafkaException as exc:
            # The actions group moved on (this replica was evicted from it): whoever consumes the
            # action next redoes it, each step recognising what is done, and publishes it again.
            raise Fenced(f"committing {action.action_id} in {self.executor.settings.group}: {exc}") from None

    # -- the loop -------------------------------------------------------------------------

    def _step(self) -> None:
        self._health.beat()
        self._lease.poll(0.0 if self.acting else 0.2)
        if not self._lease.owned:
            metrics.EXECUTOR_ACTING.set(0)
            if self._lease.elsewhere and self._lease.heard:
                self._health.set_ready(True, "standing by: another replica holds the acting lease")
            else:
                self._health.set_ready(False, "joining the lease group")
            if self._lease.elsewhere:
                # Another replica may hold the lease: leave the actions to it. During a rebalance
                # that may give the lease back, the consumer stays (idle): closing and re-joining
                # on every membership change would only churn the actions group.
                self._stand_by()
            return
        if self._restored_epoch != self._lease.epoch:
            # Gained (or regained) the lease: count what every earlier holder attempted first.
            if not self._restore():
                self._health.set_ready(False, f"holding the lease, but {ACTION_ATTEMPTS.name} cannot be read back")
                self.stop_event.wait(1.0)
                return
            self._restored_epoch = self._lease.epoch
            metrics.EXECUTOR_ACTING.set(1)
        if self._consumer is None:
            self._consumer = self._subscribe_actions()
        # Raises ConsumerStalled when no remedy helped: the loop ends and its supervisor restarts it.
        stalled = self._consumer.check()
        self._health.set_ready(stalled is None, stalled or "acting: holds the lease")
        consumer = self._consumer.consumer
        msg = consumer.poll(0.2)
        if msg is None:
            return
        if (err := msg.error()) is not None:
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", err)
            return
        try:
            self._process(consumer, msg)
        except Fenced as exc:
            # Lost the lease while working: no result, no commit; the next holder redoes it.
            self.fenced += 1
            metrics.EXECUTOR_FENCED.inc()
            log.warning("fenced while handling %s/%s: %s; standing by", msg.partition(), msg.offset(), exc)
            self._stand_by()
            self._lease.rejoin()

    def run(self) -> None:
        # One action may wait for its effects (verify timeout) per step: not stuck until well past that.
        self._health = health.loop("executor", stale_after_s=max(180.0, 4 * self.executor.settings.verify_timeout_s))
        self._lease.join()
        try:
            while not self.stop_event.is_set():
                self._step()
        finally:
            self._health.stop()
            self._stand_by()
            self._lease.close()
            self._publisher.close(5)
