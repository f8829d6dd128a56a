"""The optional automatic return to service (policy `return_to_service.automatic`, off by default).

Every `interval_s` the drained nodes are listed and each one trainmedic drained (its reason names
an incident) is judged by the same procedure as `trainmedic nodes resume`
(trainmedic.ops.return_to_service.return_node: lemon check, health check, the drain re-read after
the check, the NodeReturn recorded before the resume), as operator `trainmedic-auto`, when:

- it has been drained at least `after_s` by Slurm's own reason time (unknown: not judged);
- no reboot is pending (REBOOT_REQUESTED / REBOOT_ISSUED) and its reason carries no `| repair:`
  label (a lemon or a repair bucket is left to a person);
- a GPU reset asked for its drain (`| gpu reset (` in the reason, or a command for the drain's
  incident in the audit's node_commands) is done: the node agent answered that command `done`
  (not answered, failed or refused: not judged; a failed reset is left to a person);
- the automatic path has not judged it within `retry_s`.

At most `max_per_hour` nodes are returned (or recommended for return) per rolling hour,
cluster-wide. What was judged and returned is kept in memory and read back from the audit's
node_returns on every pass, so neither a restart nor a new lease holder runs the checks again at
once or starts the count from zero. The audit is read each pass rather than once because the
audit sink writes in batches: memory covers what it has not written yet.

**Where it runs: beside the executor**, in the process that holds the executor's acting lease
(sinks/lease.py): a resume acts on the cluster, and the lease is what makes exactly one replica
act. The API process has the audit and a publisher too, but no lease, and joining the executor's
lease group from it would make it compete with the executors for the lease. So `trainmedic up`
runs this as a thread next to its executor, and `trainmedic run executor` runs it when given the
audit (`--clickhouse`); it asks `ExecutorService.acting` before each pass and each node. That is
the replica's own last view of the lease (a paused replica may not know it lost it yet); the drain
re-read before the resume keeps two replicas from resuming one node twice.

**What stops it:** the guardrails' kill switch (read-only: nothing is judged while it is on);
the mode, known the way the streams workers know it (the policy file, the operators' changes on
mode.changes and their state file, streams.modes.ModeState; the whole-run `mode` setting) and the
guardrails' autonomy_partitions. A node autonomous for every partition it is in and the category
of its drain is resumed on a pass; otherwise it is judged and the NodeReturn says `recommended`,
so operators see what autonomy would have done. While the operators' modes are in doubt (the
topic not read yet, no state file) nothing is judged: a monitor-mode verdict then would hold the
node back for `retry_s`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import cast, get_args

from bus import health
from bus.publish import Publisher
from schemas.events import NodeReturn, incident_in_reason
from schemas.ids import current_cluster
from schemas.vocab import Category, Mode
from sinks.audit import AuditStore
from sinks.backends.base import NodeState, SchedulerBackend
from sinks.guardrails import GuardrailSettings
from streams.modes import ModeState
from streams.policy import AutoReturn, Policy, PolicyError, ReturnToService, load_policy
from trainmedic.ops.return_to_service import (
    GPU_RESET_MARK,
    Returned,
    ReturnRefused,
    Runner,
    gpu_reset_status,
    not_resumable,
    return_node,
    run_check,
)

log = logging.getLogger("trainmedic.ops.auto_return")

#: The operator the automatic path's NodeReturns name: how the audit tells its verdicts apart.
AUTO_OPERATOR = "trainmedic-auto"
HOUR_S = 3600.0
#: A label after trainmedic's reason that leaves the node to a person (a lemon, a repair bucket).
REPAIR_MARK = "| repair:"
#: Outcomes that count against max_per_hour: in monitor mode a recommendation stands for the
#: resume autonomy would have made, cap included.
RETURNS = ("resumed", "recommended")
# Like the API's publisher: a verdict is delivered or definitively failed within flush(10).
MESSAGE_TIMEOUT_MS = 8000
_CATEGORIES: frozenset[str] = frozenset(get_args(Category))
_CATEGORY_RE = re.compile(r"^trainmedic inc-[0-9A-Za-z_-]+: ([a-z_]+)")


def drain_category(reason: str | None) -> Category | None:
    """The category trainmedic wrote after the incident in its drain reason; None if unknown."""
    m = _CATEGORY_RE.match(reason or "")
    return cast("Category", m.group(1)) if m and m.group(1) in _CATEGORIES else None


def eligible(
    nodes: Iterable[NodeState],
    auto: AutoReturn,
    now: float,
    last_judged: Mapping[str, float],
    reset_status: Callable[[NodeState], str | None],
) -> tuple[list[NodeState], dict[str, str]]:
    """The nodes to judge now, longest drained first, and why each other node trainmedic drained is
    not judged. Nodes nobody drained, or someone else drained, are not mentioned at all."""
    todo: list[NodeState] = []
    skipped: dict[str, str] = {}
    for state in nodes:
        if incident_in_reason(state.reason) is None:
            continue
        if (why := not_resumable(state)) is not None:
            if state.drained or state.state == "DOWN":
                skipped[state.name] = why  # a reboot pending: said; anything else is not ours
            continue
        reason = state.reason or ""
        if REPAIR_MARK in reason:
            skipped[state.name] = "labelled for repair: left to a person"
            continue
        if state.reason_time is None:
            skipped[state.name] = "Slurm gives no time for its drain reason: not judged automatically"
            continue
        drained_for = now - state.reason_time
        if drained_for < auto.after_s:
            skipped[state.name] = f"drained {drained_for:.0f} s, judged after {auto.after_s:g} s"
            continue
        last = last_judged.get(state.name)
        if last is not None and now - last < auto.retry_s:
            skipped[state.name] = f"judged {now - last:.0f} s ago, again after {auto.retry_s:g} s"
            continue
        todo.append(state)
    ready: list[NodeState] = []
    for state in sorted(todo, key=lambda s: (s.reason_time or 0.0, s.name)):
        # Last, and only for the nodes otherwise ready: it asks the audit.
        status = reset_status(state)
        if status is None and GPU_RESET_MARK in (state.reason or ""):
            status = "issued"  # marked, and the audit sink has not written the command yet
        if status == "issued":
            skipped[state.name] = "its GPU reset is not done yet (node_commands)"
            continue
        if status not in (None, "done"):
            skipped[state.name] = f"its GPU reset ended {status}: left to a person"
            continue
        ready.append(state)
    return ready, skipped


def room(returns: Iterable[float], now: float, max_per_hour: int) -> int:
    """How many more nodes may be returned now under max_per_hour (a rolling hour)."""
    return max(0, max_per_hour - sum(1 for at in returns if now - at < HOUR_S))


def node_mode(policy: Policy, guards: GuardrailSettings, state: NodeState) -> tuple[Mode, str]:
    """Autonomous only when every partition the node is in is autonomous for its drain's category
    (and allowed by guardrails.autonomy_partitions); else monitor, and why."""
    category = drain_category(state.reason)
    if category is None:
        return "monitor", f"the drain reason {state.reason!r} names no category: monitor"
    for partition in state.partitions or (None,):
        if (mode := policy.mode_for(partition, category)) != "autonomous":
            return mode, f"{category} in partition {partition or '(default)'} is in {mode} mode"
        allowed = guards.autonomy_partitions
        if allowed is not None and (partition or "") not in allowed:
            return "monitor", f"partition {partition or '(none)'} is not in guardrails.autonomy_partitions {allowed}"
    return "autonomous", ""


class History:
    """What the automatic path judged: event id -> (node, when, outcome), from memory and the audit."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[str, float, str]] = {}

    def note(self, event_id: str, node: str, at: float, outcome: str) -> None:
        self.seen[event_id] = (node, at, outcome)

    def read_audit(self, store: AuditStore, since: float) -> None:
        """Merge in the automatic path's verdicts the audit has (this cluster's, since `since`)."""
        rows = store.query(
            "SELECT event_id, node, toUnixTimestamp64Milli(event_time) AS at_ms, outcome FROM {db}.node_returns FINAL "
            "WHERE operator = {o:String} AND cluster = {c:String} AND event_time >= fromUnixTimestamp64Milli({t:Int64})",
            {"o": AUTO_OPERATOR, "c": current_cluster(), "t": int(since * 1000)},
        )
        for r in rows:
            self.seen.setdefault(str(r["event_id"]), (str(r["node"]), int(r["at_ms"]) / 1000, str(r["outcome"])))

    def forget_before(self, since: float) -> None:
        self.seen = {k: v for k, v in self.seen.items() if v[1] >= since}

    def last_judged(self) -> dict[str, float]:
        last: dict[str, float] = {}
        for node, at, _ in self.seen.values():
            last[node] = max(at, last.get(node, at))
        return last

    def returns(self) -> list[float]:
        return [at for _, at, outcome in self.seen.values() if outcome in RETURNS]


def reset_status_of(store: AuditStore) -> Callable[[NodeState], str | None]:
    """The GPU reset of each node's drain, as the audit has it (trainmedic.ops.return_to_service)."""

    def status(state: NodeState) -> str | None:
        incident_id = incident_in_reason(state.reason)
        return gpu_reset_status(store, state.name, incident_id) if incident_id else None

    return status


class AutoReturnService:
    """The loop: one pass every interval_s while the policy enables it (read every pass)."""

    def __init__(
        self,
        backend: SchedulerBackend,
        store: AuditStore,
        bootstrap: str,
        policy_path: Path,
        *,
        acting: Callable[[], bool],
        guardrails: Callable[[], GuardrailSettings],
        modes_file: Path | None = None,
        mode_override: Mode | None = None,
        runner: Runner = run_check,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend, self.store, self.policy_path = backend, store, policy_path
        self._bootstrap = bootstrap
        self.acting, self.guardrails = acting, guardrails
        self._modes_file, self._mode_override = modes_file, mode_override
        self._modes: ModeState | None = None  # made on the first enabled pass: no consumer while off
        self._publisher: Publisher | None = None
        self.runner, self.clock = runner, clock
        self.history = History()
        self.stop_event = threading.Event()
        self.status = "not started"  # what the last pass found (logged when it changes)
        self._loop: health.Loop | None = None

    # -- what may be done now -------------------------------------------------------------

    def _say(self, why: str, level: int = logging.INFO) -> None:
        if why != self.status:
            log.log(level, "automatic return to service: %s", why)
            self.status = why
        if self._loop is not None:
            self._loop.set_ready(True, why)  # standing by or paused is a state, not a fault

    def _policy(self) -> Policy | None:
        """The policy in force with the operators' mode changes; None while they are in doubt."""
        try:
            policy = load_policy(self.policy_path)
        except PolicyError as exc:
            log.error("automatic return to service paused: policy unreadable: %s", exc)
            return None
        if not policy.return_to_service.automatic.enabled:
            return policy
        if self._mode_override is not None:
            return policy.with_mode(self._mode_override)
        if self._modes is None:
            self._modes = ModeState(self._bootstrap, self._modes_file)
        try:
            self._modes.poll()
        except Exception as exc:  # the broker away: the modes stay as last read
            log.warning("mode changes not read this pass: %s", exc)
        if self._modes.in_doubt:
            self._say("waiting for the operators' mode changes (mode.changes) before judging anything")
            return None
        return policy.with_overlay(self._modes.overlay)

    def _hold(self, state: NodeState) -> str | None:
        """Asked by return_node once the node has passed: why not to resume it now, if so."""
        if self.stop_event.is_set():
            return "trainmedic is stopping"
        if not self.acting():
            return "this replica no longer holds the executor's acting lease"
        guards = self.guardrails()
        if guards.kill_switch:
            return "the guardrails' kill switch is on"
        policy = self._policy()
        if policy is None:
            return "the mode is not known"
        if not policy.return_to_service.automatic.enabled:
            return "return_to_service.automatic was switched off"
        mode, why = node_mode(policy, guards, state)
        return None if mode == "autonomous" else why

    # -- one pass -------------------------------------------------------------------------

    def step(self) -> list[tuple[str, NodeReturn | None, str]]:
        """One pass: (node, its NodeReturn or None, what happened) for each node judged."""
        policy = self._policy()
        if policy is None:
            return []
        auto = policy.return_to_service.automatic
        if not auto.enabled:
            self._say("off (return_to_service.automatic.enabled is false)")
            return []
        if not self.acting():
            self._say("standing by: this replica does not hold the executor's acting lease")
            return []
        if self.guardrails().kill_switch:
            self._say("paused: the guardrails' kill switch is on")
            return []
        now = self.clock()
        horizon = now - max(auto.retry_s, HOUR_S)
        try:
            self.history.read_audit(self.store, horizon)
            self.history.forget_before(horizon)
            nodes = self.backend.list_nodes()
            todo, skipped = eligible(nodes, auto, now, self.history.last_judged(), reset_status_of(self.store))
        except Exception as exc:  # BackendError, and the audit client's own kinds
            # Fail closed: without the audit's count the cap could be passed; without Slurm nothing is known.
            self._say(f"paused this pass: {type(exc).__name__}: {exc}")
            return []
        for node, why in skipped.items():
            log.debug("not judged automatically now: %s: %s", node, why)
        done: list[tuple[str, NodeReturn | None, str]] = []
        for i, state in enumerate(todo):
            if self.stop_event.is_set() or not self.acting() or self.guardrails().kill_switch:
                break
            if room(self.history.returns(), self.clock(), auto.max_per_hour) == 0:
                self._say(
                    f"max_per_hour ({auto.max_per_hour}) nodes returned or recommended in the last hour; "
                    f"waiting: {', '.join(s.name for s in todo[i:])}",
                    logging.WARNING,
                )
                break
            if i == 0:
                self._say(f"on: judging {len(todo)} node(s); {len(skipped)} drained by trainmedic wait")
            if self._loop is not None:
                self._loop.stale_after_s = _stale_after(policy.return_to_service)
                self._loop.beat()
            done.append(self._judge(policy, state, now))
        if not todo:
            self._say(f"on: nothing to judge; {len(skipped)} drained by trainmedic wait")
        return done

    def _judge(self, policy: Policy, state: NodeState, now: float) -> tuple[str, NodeReturn | None, str]:
        node = state.name
        drained_for = now - (state.reason_time or now)
        try:
            returned: Returned = return_node(
                self.backend,
                self.store,
                self._publisher_(),
                lambda: policy.return_to_service,
                node,
                AUTO_OPERATOR,
                f"automatic return to service, drained {drained_for:.0f} s",
                hold=lambda: self._hold(state),
                runner=self.runner,
            )
            event: NodeReturn | None = returned.event
            what: str = returned.event.outcome
        except ReturnRefused as exc:
            event, what = exc.event, exc.detail
        except Exception as exc:  # the audit or Slurm failing mid-way: this node waits, the loop goes on
            log.exception("automatic return of %s failed", node)
            event, what = None, f"{type(exc).__name__}: {exc}"
        # Noted even when nothing was recorded (the node changed, Kafka away): not checked again
        # before retry_s either way.
        if event is not None:
            self.history.note(event.event_id, node, event.event_time, event.outcome)
        else:
            at = self.clock()
            self.history.note(f"unrecorded-{node}-{at}", node, at, "unrecorded")
        return node, event, what

    def _publisher_(self) -> Publisher:
        if self._publisher is None:
            self._publisher = Publisher(
                self._bootstrap, "trainmedic-auto-return", config={"message.timeout.ms": MESSAGE_TIMEOUT_MS}
            )
        return self._publisher

    def _settings(self) -> ReturnToService:
        try:
            return load_policy(self.policy_path).return_to_service
        except PolicyError:
            return ReturnToService()  # the defaults, until the file is readable again

    def run(self) -> None:
        self._loop = health.loop("auto-return", stale_after_s=_stale_after(self._settings()))
        try:
            while not self.stop_event.is_set():
                self._loop.beat()
                self.step()
                self._loop.beat()
                self.stop_event.wait(self._settings().automatic.interval_s)
        finally:
            self._loop.stop()
            if self._modes is not None:
                self._modes.close()
            if self._publisher is not None:
                self._publisher.close(5)


def _stale_after(rts: ReturnToService) -> float:
    """How long the loop may go without a beat: one health check (up to timeout_s) and a wait."""
    return max(180.0, rts.timeout_s + 2 * rts.automatic.interval_s + 120)
