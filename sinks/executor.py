"""The executor: a Kafka consumer group that carries out actions on the scheduler.

For each action it acts, reads the scheduler back until the effect is
visible (or a timeout), publishes an ActionResult, and only then commits the
action's offset. Each step first checks whether its effect is already there,
so a redelivered action is not performed twice.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from schemas.clients import consumer_config, producer_config, read_records
from schemas.codec import DecodeError, decode, encode
from schemas.deadletter import make_dead_letter
from schemas.events import Action, ActionResult, GuardrailTrip
from schemas.topics import ACTION_RESULTS, ACTIONS, DEADLETTER, GUARDRAIL_TRIPS, partition_key
from sinks import metrics
from sinks.backends.base import BackendError, JobState, SchedulerBackend
from sinks.guardrails import GuardrailFile, Guardrails

log = logging.getLogger("trainmedic.executor")

_GONE = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


class VerifyTimeout(RuntimeError):
    pass


def _marked_restarts(comment: str | None, action_id: str) -> int | None:
    """The restart count our mark recorded before requeueing, if the mark is this action's."""
    m = re.search(rf"trainmedic {re.escape(action_id)} restarts=(\d+)", comment or "")
    return int(m.group(1)) if m else None


@dataclass
class ExecutorSettings:
    verify_timeout_s: float = 60.0
    poll_interval_s: float = 0.2
    group: str = "trainmedic-executor"


@dataclass
class _Run:
    action: Action
    started_at: float
    steps: list[str] = field(default_factory=list)


class Executor:
    def __init__(self, backend: SchedulerBackend, settings: ExecutorSettings | None = None) -> None:
        self.backend = backend
        self.settings = settings or ExecutorSettings()

    # -- one action -----------------------------------------------------------------

    def execute(self, action: Action) -> ActionResult:
        run = _Run(action, time.time())
        try:
            if action.action == "none":
                run.steps.append("nothing to do")
                return self._result(run, "skipped", None, verified=False)
            if action.action == "drain_and_requeue":
                if action.node:
                    self._drain(run)
                if action.job_id:
                    self._requeue(run, exclude=[action.node] if action.node else [])
            elif action.action == "requeue":
                if not action.job_id:
                    raise BackendError("requeue needs a job id")
                self._requeue(run, exclude=[])
            elif action.action == "stop":
                if not action.job_id:
                    raise BackendError("stop needs a job id")
                self._stop(run)
            return self._result(run, "done", None, verified=True)
        except (BackendError, VerifyTimeout, ValueError) as exc:
            log.error("action %s failed: %s", action.action_id, exc)
            return self._result(run, "failed", str(exc), verified=False)

    def refused(self, action: Action, why: str) -> ActionResult:
        run = _Run(action, time.time())
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

    def _drain(self, run: _Run) -> None:
        a = run.action
        assert a.node
        state = self.backend.node_state(a.node)
        if state.drained and state.reason and a.incident_id in state.reason:
            run.steps.append(f"drain {a.node}: already drained for {a.incident_id}")
            return
        if state.drained:
            # Someone else drained it: leave their reason alone, it is out of service either way.
            run.steps.append(f"drain {a.node}: already drained by someone else ({state.reason})")
            return
        self.backend.drain_node(a.node, a.reason)

        def drained() -> bool:
            s = self.backend.node_state(a.node or "")
            return s.drained and bool(s.reason) and a.incident_id in (s.reason or "")

        self._wait(f"{a.node} DRAIN with reason naming {a.incident_id}", drained)
        run.steps.append(f"drain {a.node}: verified DRAIN, reason {a.reason!r}")

    def _requeue(self, run: _Run, exclude: list[str]) -> None:
        a = run.action
        assert a.job_id
        before = self.backend.job_state(a.job_id)
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
            self.backend.annotate_job(a.job_id, f"trainmedic {a.action_id} restarts={before.restart_count}")
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
        if a.stop_mode == "hold":
            # Held, not cancelled: the job keeps its place and its history for a human to look at.
            if not (state.held and state.state == "PENDING"):
                self.backend.hold_job(a.job_id)

            def held() -> bool:
                s = self.backend.job_state(a.job_id or "")
                return s.held and s.state == "PENDING"

            self._wait(f"job {a.job_id} held", held)
            run.steps.append(f"stop {a.job_id}: verified held (PENDING, held for an operator)")
            return
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


class ExecutorService:
    """The consumer-group loop around Executor. Commit only after the result is published."""

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
        self._consumer = Consumer(consumer_config(bootstrap, executor.settings.group, client_id))
        self._producer = Producer(producer_config(bootstrap, client_id))
        self.stop_event = threading.Event()
        self.results: list[ActionResult] = []
        self.trips: list[GuardrailTrip] = []
        self.rejected = 0

    def _handle(self, action: Action) -> ActionResult:
        now = time.time()
        trip = self.guardrails.check(action, now)
        if trip is not None:
            name, detail = trip
            log.warning("guardrail %s stopped %s: %s", name, action.action_id, detail)
            event = GuardrailTrip(
                event_id=f"grd-{action.action_id.removeprefix('act-')}-{name}",
                event_time=now,
                guardrail=name,
                action_id=action.action_id,
                incident_id=action.incident_id,
                job_id=action.job_id,
                node=action.node,
                partition=action.partition,
                action=action.action,
                detail=detail,
            )
            self._producer.produce(GUARDRAIL_TRIPS.name, key=partition_key(event), value=encode(event))
            self.trips.append(event)
            metrics.GUARDRAIL_TRIPS.labels(name).inc()
            return self.executor.refused(action, f"guardrail {name}: {detail}")
        log.info("executing %s %s job=%s node=%s", action.action_id, action.action, action.job_id, action.node)
        result = self.executor.execute(action)
        if result.status == "done":
            self.guardrails.record(action, now)
            if result.verified_at is not None:
                metrics.ACTION_LATENCY.observe(max(0.0, result.verified_at - action.incident_time))
        return result

    def restore(self) -> None:
        """Read back the results of the actions carried out within the guardrails' horizon."""
        now = time.time()
        try:
            records = read_records(self._bootstrap, ACTION_RESULTS.name, now - self.guardrails.horizon_s)
        except (KafkaException, TimeoutError) as exc:
            log.error(
                "could not read back earlier action results (%s): guardrail counts start from zero; the "
                "partition drain fraction (read from the scheduler) still applies",
                exc,
            )
            return
        results = []
        for _, value in records:
            try:
                results.append(decode(ActionResult, value))
            except DecodeError:
                continue  # the audit sink dead-letters it
        log.info(
            "guardrails: %d carried-out action(s) read back from %s",
            self.guardrails.restore(results),
            ACTION_RESULTS.name,
        )

    def run(self) -> None:
        self.restore()
        self._consumer.subscribe([ACTIONS.name])
        try:
            while not self.stop_event.is_set():
                msg = self._consumer.poll(0.2)
                if msg is None:
                    continue
                if (err := msg.error()) is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        log.warning("consumer error: %s", err)
                    continue
                try:
                    action = decode(Action, msg.value() or b"")
                except DecodeError as exc:
                    # An action we cannot read is never guessed at: dead-letter it, loudly.
                    self.rejected += 1
                    log.error("rejected undecodable action at %s/%s: %s", msg.partition(), msg.offset(), exc)
                    letter = make_dead_letter(
                        "sinks.executor",
                        msg.topic() or ACTIONS.name,
                        msg.partition(),
                        msg.offset(),
                        str(exc),
                        msg.value(),
                    )
                    self._producer.produce(DEADLETTER.name, key=partition_key(letter), value=encode(letter))
                    if self._producer.flush(30) != 0:
                        log.error("dead letter for %s/%s not delivered; not committing", msg.partition(), msg.offset())
                        continue
                    self._consumer.commit(message=msg, asynchronous=False)
                    continue
                _, ts_ms = msg.timestamp()
                if ts_ms > 0:
                    metrics.RECORD_AGE.labels("executor", ACTIONS.name).set(max(0.0, time.time() - ts_ms / 1000))
                result = self._handle(action)
                metrics.ACTIONS.labels(action.action, result.status).inc()
                self._producer.produce(ACTION_RESULTS.name, key=partition_key(result), value=encode(result))
                if self._producer.flush(30) != 0:
                    log.error("result of %s not delivered; not committing, it will be redelivered", action.action_id)
                    continue
                self.results.append(result)
                log.info("result %s: %s %s", action.action_id, result.status, "; ".join(result.steps))
                self._consumer.commit(message=msg, asynchronous=False)
        finally:
            self._consumer.close()
            self._producer.flush(5)
