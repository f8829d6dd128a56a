"""Guardrails the executor enforces itself, whatever policy asked for.

Settings live in the `guardrails:` section of the policy file and are reread
when the file changes, so the kill switch takes effect without a restart.
They are cluster-wide caps only: the kill switch, the partitions autonomy may
act in, drains per window and the share of a partition drained (blast radius),
and the node cooldown. How often one job may be restarted is the policy's
`restart_budget` alone (streams/policy.py); a file that still sets the old
`max_restarts_per_job` / `restart_window_s` here is refused, not ignored.

What counts is every scheduler call that may have taken effect, not actions
that ended well: a drain that was sent counts toward the drain window, the
node cooldown and the blast radius whether its requeue then failed, timed out
or the executor crashed. The executor writes an ActionAttempt to the
action.attempts topic (acks=all, flushed) before each call and feeds it to
`count()`; when it takes over the acting lease it reads the topic back through
the same `count()`. So there is one accounting path, a crash between record and
call errs on the side of counting, and, as exactly one executor replica acts at
a time and reads back what the previous one recorded before acting, the count
holds across replicas. The partition drain fraction is read from the scheduler
on every drain.

The kill switch and `autonomy_partitions` refuse the whole action. The caps on
drains (blast radius, node cooldown) refuse taking the node out, not acting on
the job: a drain_and_requeue whose drain they refuse still requeues its job
with the node excluded (`requeues_without_drain`); the guardrail trip and the
action's result say both.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.errors import ConfigError
from schemas.events import Action, ActionAttempt, AttemptCall
from schemas.vocab import DRAINS, Guardrail
from schemas.yamlsafe import YamlError, load_yaml
from sinks import metrics
from sinks.backends.base import SchedulerBackend

log = logging.getLogger("trainmedic.guardrails")


class GuardrailConfigError(ConfigError, ValueError):
    pass


# Keys this section had before the restart budget was the policy's alone, and where each went.
# Refused rather than ignored: a file that still sets them expects a limit the executor no
# longer enforces, and must not be read as if it were in force.
MOVED_TO_POLICY: dict[str, str] = {
    "max_restarts_per_job": "restart_budget.max_restarts",
    "restart_window_s": "restart_budget.window_h (hours)",
}


def moved_key_error(key: str) -> str:
    return (
        f"{key} is no longer a guardrail: the per-job restart budget moved to the policy's "
        f"{MOVED_TO_POLICY[key]} (one budget, counted by policy); remove it from guardrails "
        "and set restart_budget instead"
    )


class GuardrailSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kill_switch: bool = False
    # Partitions where policy-made (autonomous) actions may run; None: every partition.
    # Operator-approved actions are not limited by it.
    autonomy_partitions: list[str] | None = None
    max_drains_per_window: int = Field(default=2, ge=0)
    # Drains for predicted failures (a migration, streams/migration.py), per the same window: a cap
    # of their own, and they never count against max_drains_per_window, so predictions can never
    # spend the drains that failures need.
    max_predictive_drains_per_window: int = Field(default=1, ge=0)
    max_drain_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    drain_window_s: float = Field(default=3600.0, gt=0)
    node_cooldown_s: float = Field(default=600.0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_keys(cls, data: object) -> object:
        # Every way in (the file, a replayed policy's section) says where the key went,
        # not only "extra inputs are not permitted".
        if isinstance(data, dict):
            for key in MOVED_TO_POLICY:
                if key in data:
                    raise ValueError(moved_key_error(key))
        return data


def parse_guardrails(text: str, origin: str) -> GuardrailSettings:
    try:
        # Bounded (size, depth, aliases): a live reload must refuse a bad file, not raise into
        # or stall the executor.
        data = load_yaml(text, origin) or {}
    except YamlError as exc:
        raise GuardrailConfigError(str(exc)) from None
    return guardrail_settings(data.get("guardrails", {}) if isinstance(data, dict) else {}, origin)


def guardrail_settings(section: object, origin: str) -> GuardrailSettings:
    """The `guardrails:` section (already parsed), validated; errors name the field."""
    if isinstance(section, dict):
        for key in MOVED_TO_POLICY:
            if key in section:
                raise GuardrailConfigError(f"{origin}: field 'guardrails.{key}': {moved_key_error(key)}")
    try:
        return GuardrailSettings.model_validate(section or {})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise GuardrailConfigError(f"{origin}: field 'guardrails.{field}': {err['msg']}") from None


class GuardrailFile:
    """The `guardrails:` section of a policy file, reloaded when the file changes."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._mtime = -1.0
        self._settings = GuardrailSettings()
        if path is not None:
            self._settings = parse_guardrails(path.read_text(), str(path))
            self._mtime = os.stat(path).st_mtime

    def __call__(self) -> GuardrailSettings:
        if self.path is None:
            return self._settings
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return self._settings
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                self._settings = parse_guardrails(self.path.read_text(), str(self.path))
                log.info("guardrails reloaded from %s: %s", self.path, self._settings.model_dump())
            except (GuardrailConfigError, OSError) as exc:
                log.error("guardrails reload refused, keeping the previous settings: %s", exc)
        return self._settings


Trip = tuple[Guardrail, str]

# The guardrails that cap taking nodes out of service, not acting on a job. When one of them
# refuses a drain_and_requeue's drain, the job is still requeued with the node excluded: its
# restart is within the policy's restart budget already (streams/policy.py turns an isolation
# whose budget is spent into drain_and_stop before it is sent), and leaving it running would
# leave it on the dead GPU. The kill switch and autonomy_partitions refuse the whole action.
ISOLATION_CAPS: frozenset[Guardrail] = frozenset({"blast_radius", "node_cooldown"})


def requeues_without_drain(action: Action, trip: Trip) -> bool:
    """Whether `action` goes on without its drain when `trip` refused it: a drain_and_requeue with
    a job and a node, refused by a cap on drains alone."""
    return trip[0] in ISOLATION_CAPS and action.action == "drain_and_requeue" and bool(action.job_id and action.node)


def _kill_switch_of(settings: GuardrailFile) -> Callable[[], bool]:
    ref = weakref.ref(settings)  # the gauge must not keep a stopped executor's file alive

    def engaged() -> bool:
        current = ref()
        return current is not None and current().kill_switch

    return engaged


class Guardrails:
    def __init__(self, settings: Callable[[], GuardrailSettings], backend: SchedulerBackend) -> None:
        self.settings = settings
        self.backend = backend
        if isinstance(settings, GuardrailFile):
            # The executor's (a policy file's) guardrails, not a replay's what-if settings: the
            # kill-switch gauge reads the file at each scrape, so it shows a switch flipped while idle.
            metrics.watch_kill_switch(_kill_switch_of(settings))
        self._lock = threading.Lock()
        self._drains: list[tuple[float, str]] = []  # (when, node), in time order
        self._predicted_drains: list[tuple[float, str]] = []  # the same, for predicted failures
        self._node_acted: dict[str, float] = {}
        self._attempted: set[str] = set()  # action ids with at least one counted call
        # (action id, call, node): each counts once; a drain set's drains count one per node.
        self._counted: set[tuple[str, str, str]] = set()

    @property
    def horizon_s(self) -> float:
        """How far back attempted calls still count against a guardrail."""
        s = self.settings()
        return max(s.drain_window_s, s.node_cooldown_s)

    def count(self, attempt: ActionAttempt) -> bool:
        """Count one scheduler call that may have taken effect: the only way anything is counted,
        both as the executor makes the call and when it reads action.attempts back.

        One action counts once per kind of call however often it is recorded (a redelivery
        records its calls again). Returns whether this attempt added to a count.
        """
        with self._lock:
            key = (attempt.action_id, attempt.call, attempt.node or "")
            self._attempted.add(attempt.action_id)
            if key in self._counted:
                return False
            self._counted.add(key)
            at = attempt.event_time
            if attempt.call == "drain" and attempt.node:
                bisect.insort(self._predicted_drains if attempt.predicted else self._drains, (at, attempt.node))
                self._node_acted[attempt.node] = max(at, self._node_acted.get(attempt.node, 0.0))
            # requeue, cancel and hold are recorded (and mark the action as attempted) but no
            # guardrail counts them: restarts per job are the policy's restart budget.
            return True

    def restore(self, attempts: Iterable[ActionAttempt]) -> int:
        """Count attempts read back from action.attempts; returns how many added to a count."""
        return sum(self.count(a) for a in sorted(attempts, key=lambda a: a.event_time))

    def record(self, action: Action, at: float) -> None:
        """Count every call `action` makes, as if each were attempted at `at` (what-if replays,
        which have no scheduler to call): through count(), like everything else."""
        calls: list[tuple[AttemptCall, str | None]] = []
        if action.action in DRAINS:
            calls += [("drain", node) for node in action.nodes or ([action.node] if action.node else [])]
        if action.action in ("requeue", "drain_and_requeue") and action.job_id:
            calls.append(("requeue", action.node))
        if action.action in ("stop", "drain_and_stop") and action.job_id:
            calls.append(("hold" if action.stop_mode == "hold" else "cancel", action.node))
        for call, node in calls:
            self.count(
                ActionAttempt(
                    event_id=f"att-{action.action_id}-{call}-{node or ''}",
                    event_time=at,
                    action_id=action.action_id,
                    incident_id=action.incident_id,
                    job_id=action.job_id,
                    node=node,
                    partition=action.partition,
                    action=action.action,
                    call=call,
                    executor="replay",
                    predicted=action.predicted,
                )
            )

    def attempted(self, action_id: str) -> bool:
        with self._lock:
            return action_id in self._attempted

    def _drain_counted(self, action: Action) -> bool:
        with self._lock:
            return (action.action_id, "drain", action.node or "") in self._counted

    def check(self, action: Action, now: float) -> Trip | None:
        s = self.settings()
        if s.kill_switch:
            return "kill_switch", "the global kill switch is on: no scheduler action is taken"
        if action.action == "none":
            return None
        if self.attempted(action.action_id):
            # Its calls are already counted (a redelivery after a crash or a takeover): the
            # executor finishes it, each step recognising what is already done; refusing it
            # now would leave a half-done action and overwrite its result.
            if action.action != "drain_and_requeue" or not action.node or self._drain_counted(action):
                return None
            # A drain_and_requeue whose requeue was attempted but whose drain never was: the drain
            # may have been refused by a cap (the job requeued without it). The drain is judged
            # again, not let through: a trip here keeps only the drain out (requeues_without_drain).
            with self._lock:
                return self._check_drain(s, action.node, now)
        if (
            action.requested_by == "policy"
            and s.autonomy_partitions is not None
            and (action.partition or "") not in s.autonomy_partitions
        ):
            return "partition_not_allowed", (
                f"partition {action.partition or '(none)'} is not in guardrails.autonomy_partitions "
                f"{s.autonomy_partitions}: recommend only"
            )
        with self._lock:
            if action.nodes and action.action in DRAINS:
                return self._check_drain_set(s, action, now)
            if action.node and action.action in DRAINS and action.predicted:
                return self._check_predictive_drain(s, action.node, now)
            if action.node and action.action in DRAINS:
                return self._check_drain(s, action.node, now)
        return None

    def _check_drain_set(self, s: GuardrailSettings, action: Action, now: float) -> Trip | None:
        """A fleet incident's drain set, judged as a whole: the nodes it would newly take out count
        against the drains per window and each partition's blast radius together, and a set over
        either is refused entirely. Part of a switch's nodes drained would leave the rest serving
        jobs through the broken part while looking handled."""
        members = action.nodes
        nodes = self.backend.list_nodes()
        by_name = {n.name: n for n in nodes}
        unknown = sorted(set(members) - set(by_name))
        if unknown:
            return "blast_radius", f"drain set names nodes the scheduler does not know ({', '.join(unknown)}): refused"
        new = [n for n in members if not by_name[n].drained]
        if not new:
            return None
        if action.requested_by == "policy" and s.autonomy_partitions is not None:
            # The set's own nodes, not the partition of the job whose incident came last.
            outside = sorted({p for n in new for p in by_name[n].partitions or [""]} - set(s.autonomy_partitions))
            if outside:
                return "partition_not_allowed", (
                    f"the drain set ({', '.join(new)}) has nodes in partition(s) {', '.join(p or '(none)' for p in outside)}, "
                    f"not in guardrails.autonomy_partitions {s.autonomy_partitions}: refused as a whole"
                )
        for node in new:
            last = self._node_acted.get(node)
            if last is not None and now - last < s.node_cooldown_s:
                return "node_cooldown", (
                    f"{node} of the drain set was acted on {now - last:.0f} s ago (cooldown {s.node_cooldown_s:.0f} s): "
                    "the set is refused as a whole"
                )
        self._drains = [(at, n) for at, n in self._drains if now - at <= s.drain_window_s]
        recent = [n for _, n in self._drains]
        if len(recent) + len(new) > s.max_drains_per_window:
            return "blast_radius", (
                f"the drain set would drain {len(new)} node(s) ({', '.join(new)}) after {len(recent)} drain(s) in the "
                f"last {s.drain_window_s:.0f} s; max_drains_per_window is {s.max_drains_per_window}: refused as a whole"
            )
        for part in sorted({p for n in new for p in by_name[n].partitions}):
            in_part = [n for n in nodes if part in n.partitions]
            out = sum(1 for n in in_part if n.drained or n.name in new)
            if out / len(in_part) > s.max_drain_fraction and out > 1:
                return "blast_radius", (
                    f"the drain set ({', '.join(new)}) would take {out} of {len(in_part)} nodes of partition {part} out of "
                    f"service (max_drain_fraction {s.max_drain_fraction:.0%}): refused as a whole"
                )
        return None

    def _check_predictive_drain(self, s: GuardrailSettings, node: str, now: float) -> Trip | None:
        """A drain for a predicted failure: the node cooldown and the partition's share as any drain,
        and the cap on predictive drains per window instead of max_drains_per_window."""
        last = self._node_acted.get(node)
        if last is not None and now - last < s.node_cooldown_s:
            return "node_cooldown", f"{node} was acted on {now - last:.0f} s ago (cooldown {s.node_cooldown_s:.0f} s)"
        self._predicted_drains = [(at, n) for at, n in self._predicted_drains if now - at <= s.drain_window_s]
        recent = [n for _, n in self._predicted_drains]
        if len(recent) >= s.max_predictive_drains_per_window:
            return "blast_radius", (
                f"{len(recent)} predictive drain(s) attempted in the last {s.drain_window_s:.0f} s ({', '.join(recent)}); "
                f"max_predictive_drains_per_window is {s.max_predictive_drains_per_window}: not draining {node}"
            )
        return self._check_fraction(s, node)

    def _check_drain(self, s: GuardrailSettings, node: str, now: float) -> Trip | None:
        last = self._node_acted.get(node)
        if last is not None and now - last < s.node_cooldown_s:
            return "node_cooldown", f"{node} was acted on {now - last:.0f} s ago (cooldown {s.node_cooldown_s:.0f} s)"
        # Attempts older than the window no longer count (nor does memory keep them).
        self._drains = [(at, n) for at, n in self._drains if now - at <= s.drain_window_s]
        recent = [n for _, n in self._drains]
        if len(recent) >= s.max_drains_per_window:
            return "blast_radius", (
                f"{len(recent)} drain(s) attempted in the last {s.drain_window_s:.0f} s ({', '.join(recent)}); "
                f"max_drains_per_window is {s.max_drains_per_window}: not draining {node}"
            )
        return self._check_fraction(s, node)

    def _check_fraction(self, s: GuardrailSettings, node: str) -> Trip | None:
        nodes = self.backend.list_nodes()
        target = next((n for n in nodes if n.name == node), None)
        if target is not None and target.partitions:
            part = set(target.partitions)
            members = [n for n in nodes if part & set(n.partitions)]
            drained = sum(1 for n in members if n.drained and n.name != node)
            if members and (drained + 1) / len(members) > s.max_drain_fraction and drained + 1 > 1:
                return "blast_radius", (
                    f"draining {node} would take {drained + 1} of {len(members)} nodes of partition(s) "
                    f"{','.join(sorted(part))} out of service (max_drain_fraction {s.max_drain_fraction:.0%})"
                )
        return None
