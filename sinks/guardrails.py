"""Guardrails the executor enforces itself, whatever policy asked for.

Settings live in the `guardrails:` section of the policy file and are reread
when the file changes, so the kill switch takes effect without a restart.
Counters of recent drains and requeues are kept in memory and read back from
the action.results topic when the executor starts, so a restart forgets
nothing; the per-job budget also reads Slurm's own restart counter. Two
executor replicas each count only what they did themselves (plus what they
read at start): the partition drain fraction, read from the scheduler on every
drain, is the cap they share.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.events import Action, ActionResult
from schemas.vocab import Guardrail
from schemas.yamlsafe import YamlError, load_yaml
from sinks.backends.base import SchedulerBackend

log = logging.getLogger("trainmedic.guardrails")


class GuardrailConfigError(ValueError):
    pass


class GuardrailSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kill_switch: bool = False
    # Partitions where policy-made (autonomous) actions may run; None: every partition.
    # Operator-approved actions are not limited by it.
    autonomy_partitions: list[str] | None = None
    max_drains_per_window: int = Field(default=2, ge=0)
    max_drain_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    drain_window_s: float = Field(default=3600.0, gt=0)
    max_restarts_per_job: int = Field(default=3, ge=0)
    restart_window_s: float = Field(default=6 * 3600.0, gt=0)
    node_cooldown_s: float = Field(default=600.0, ge=0)


def parse_guardrails(text: str, origin: str) -> GuardrailSettings:
    try:
        # Bounded (size, depth, aliases): a live reload must refuse a bad file, not raise into
        # or stall the executor.
        data = load_yaml(text, origin) or {}
    except YamlError as exc:
        raise GuardrailConfigError(str(exc)) from None
    section = data.get("guardrails", {}) if isinstance(data, dict) else {}
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


class Guardrails:
    def __init__(self, settings: Callable[[], GuardrailSettings], backend: SchedulerBackend) -> None:
        self.settings = settings
        self.backend = backend
        self._lock = threading.Lock()
        self._drains: deque[tuple[float, str]] = deque()
        self._requeues: dict[str, deque[float]] = {}
        self._node_acted: dict[str, float] = {}
        self._done: set[str] = set()  # action ids carried out (this run, or read back at start)

    @property
    def horizon_s(self) -> float:
        """How far back carried-out actions still count against a guardrail."""
        s = self.settings()
        return max(s.drain_window_s, s.restart_window_s, s.node_cooldown_s)

    def restore(self, results: Sequence[ActionResult]) -> int:
        """Count the actions a previous executor carried out (read back from action.results at
        start), so that a restart does not reset the blast radius, cooldowns or restart budget."""
        restored = 0
        for r in sorted(results, key=lambda r: r.started_at):
            if r.status != "done" or r.action_id in self._done:
                continue
            self._count(r.action_id, r.action, r.node, r.job_id, r.started_at)
            restored += 1
        return restored

    def check(self, action: Action, now: float) -> Trip | None:
        s = self.settings()
        if s.kill_switch:
            return "kill_switch", "the global kill switch is on: no scheduler action is taken"
        if action.action == "none":
            return None
        if action.action_id in self._done:
            # Already carried out (a redelivery after a crash): the executor recognises it and
            # publishes the same result again; refusing it now would overwrite "done".
            return None
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
            if action.node and action.action == "drain_and_requeue":
                trip = self._check_drain(s, action.node, now)
                if trip:
                    return trip
            if action.job_id and action.action in ("requeue", "drain_and_requeue"):
                trip = self._check_restarts(s, action.job_id, now)
                if trip:
                    return trip
        return None

    def _check_drain(self, s: GuardrailSettings, node: str, now: float) -> Trip | None:
        last = self._node_acted.get(node)
        if last is not None and now - last < s.node_cooldown_s:
            return "node_cooldown", f"{node} was acted on {now - last:.0f} s ago (cooldown {s.node_cooldown_s:.0f} s)"
        while self._drains and now - self._drains[0][0] > s.drain_window_s:
            self._drains.popleft()
        if len(self._drains) >= s.max_drains_per_window:
            recent = ", ".join(n for _, n in self._drains)
            return "blast_radius", (
                f"{len(self._drains)} node(s) drained in the last {s.drain_window_s:.0f} s ({recent}); "
                f"max_drains_per_window is {s.max_drains_per_window}: not draining {node}"
            )
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

    def _check_restarts(self, s: GuardrailSettings, job_id: str, now: float) -> Trip | None:
        times = self._requeues.setdefault(job_id, deque())
        while times and now - times[0] > s.restart_window_s:
            times.popleft()
        try:
            slurm_restarts = self.backend.job_state(job_id).restart_count
        except Exception:  # an unknown job fails later, in the action itself, with its own error
            slurm_restarts = 0
        used = max(len(times), slurm_restarts)
        if used >= s.max_restarts_per_job:
            return "restart_budget", (
                f"job {job_id} was restarted {used} time(s) (max_restarts_per_job {s.max_restarts_per_job} "
                f"per {s.restart_window_s / 3600:.0f} h): not restarting it again"
            )
        return None

    def record(self, action: Action, now: float) -> None:
        """Count an action that was carried out."""
        self._count(action.action_id, action.action, action.node, action.job_id, now)

    def _count(self, action_id: str, kind: str, node: str | None, job_id: str | None, at: float) -> None:
        with self._lock:
            if action_id in self._done:
                return
            self._done.add(action_id)
            if node and kind == "drain_and_requeue":
                self._drains.append((at, node))
                self._node_acted[node] = max(at, self._node_acted.get(node, 0.0))
            if job_id and kind in ("requeue", "drain_and_requeue"):
                self._requeues.setdefault(job_id, deque()).append(at)
