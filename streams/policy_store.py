"""The policy in force, reloaded when its file changes (no restart needed)."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

from schemas.events import Action, Decision, Incident
from schemas.vocab import MODES, Mode
from streams import metrics
from streams.lineage import RestartHistory
from streams.modes import ModeState
from streams.policy import DEFAULT_POLICY, RESTARTS, Policy, PolicyError, decide, decide_predicted, load_policy

log = logging.getLogger("trainmedic.policy")


class RestartLedger:
    """The restarts policy ordered, per job: what the restart budget counts.

    Held in `store`: in the streams worker a Faust Table keyed by job id with a changelog, written
    by the worker that owns the job's `incidents` partition, so a restarted worker and the worker a
    partition moves to take the budget along. A value is a list of [action id, time]: each action
    id counts once, so an incident delivered twice spends one restart, not two. Values are
    replaced, never changed in place (a table only records what is assigned).
    """

    def __init__(self, store: MutableMapping[str, Any] | None = None) -> None:
        self._store: MutableMapping[str, Any] = store if store is not None else {}

    def recent(self, job_id: str, now: float, window_s: float) -> int:
        """Restarts of the job within the window (older ones are forgotten)."""
        entries = self._store.get(job_id) or []
        kept = [e for e in entries if now - float(e[1]) <= window_s]
        if len(kept) != len(entries):
            if kept:
                self._store[job_id] = kept
            else:
                del self._store[job_id]
        return len(kept)

    def count(self, job_id: str, action_id: str, at: float) -> bool:
        """Count one restart; False when this action id was counted already."""
        entries = list(self._store.get(job_id) or [])
        if any(e[0] == action_id for e in entries):
            return False
        self._store[job_id] = sorted([*entries, [action_id, at]], key=lambda e: float(e[1]))
        return True


class PolicyStore:
    """Policy file + operator mode changes (streams.modes) (+ a whole-run override for demos/tests).

    Without `modes` (offline: diagnose, replay, tests) the policy file's modes apply. With them,
    a worker in doubt about the operators' changes (streams.modes.ModeState.in_doubt) decides as
    in monitor mode everywhere."""

    def __init__(
        self,
        path: str | Path | None = None,
        mode_override: str | None = None,
        modes: ModeState | None = None,
        restarts: MutableMapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(path) if path else DEFAULT_POLICY
        self.modes = modes
        if mode_override is not None and mode_override not in MODES:
            raise PolicyError(f"TRAINMEDIC_MODE: unknown mode {mode_override!r} (expected one of {', '.join(MODES)})")
        self._override: Mode | None = mode_override  # type: ignore[assignment]
        if mode_override is not None:
            log.warning(
                "mode %s for every partition (the mode setting): operator mode changes have no effect here",
                mode_override,
            )
        self._mtimes = self._stat()
        self._policy = self._load()
        metrics.show_modes(self._policy)
        # Restarts policy ordered per job: the restart budget (the only one: the executor's
        # guardrails keep cluster-wide caps) counts them; `restarts` is where they are kept.
        self.restarts = RestartLedger(restarts)

    def _stat(self) -> tuple[float, int, bool]:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            mtime = 0.0
        if self.modes is None:
            return mtime, 0, False
        return mtime, self.modes.version, self.modes.in_doubt

    def _load(self) -> Policy:
        policy = load_policy(self.path)
        if self._override:
            return policy.with_mode(self._override)
        if self.modes is not None:
            if self.modes.in_doubt:
                return policy.with_mode("monitor")
            policy = policy.with_overlay(self.modes.overlay)
        return policy

    @property
    def policy(self) -> Policy:
        mtimes = self._stat()
        if mtimes != self._mtimes:
            self._mtimes = mtimes
            try:
                self._policy = self._load()
                metrics.show_modes(self._policy)
                doubt = self.modes is not None and self.modes.in_doubt
                log.info("policy reloaded from %s%s", self.path, " (operator modes in doubt: monitor)" if doubt else "")
            except PolicyError as exc:
                # Keep acting on the last valid policy; a typo must not stop the service.
                log.error("policy reload refused, keeping the previous one: %s", exc)
        return self._policy

    def restore(self, actions: Sequence[Action]) -> int:
        """Count the restarts read back from the actions topic (each action id once, so reading
        them again on a take-over, or over what the table recovered, changes nothing). The table
        is the record on Kafka; this is the floor for a broker whose end offsets cut a table's
        recovery short (the embedded Tansu, docs/scaling.md). Returns how many were new."""
        return sum(
            1
            for a in sorted(actions, key=lambda a: a.event_time)
            if a.requested_by == "policy"
            and a.action in RESTARTS
            and a.job_id
            and self.restarts.count(a.job_id, a.action_id, a.event_time)
        )

    def decide(
        self, incident: Incident, now: float, history: RestartHistory | None = None
    ) -> tuple[Decision, Action | None]:
        policy = self.policy
        window_s = policy.restart_budget.window_h * 3600
        recent = self.restarts.recent(incident.job_id, now, window_s) if incident.job_id else 0
        decision, action = decide(policy, incident, now, recent_restarts=recent, history=history)
        if action is not None and action.action in RESTARTS and incident.job_id:
            # An incident delivered twice decides the same action id: one restart, not two.
            self.restarts.count(incident.job_id, action.action_id, now)
        return decision, action

    def decide_predicted(
        self, incident: Incident, now: float, checkpoints_known: bool
    ) -> tuple[Decision, Action | None, bool]:
        """A predicted incident (streams/policy.py decide_predicted), its restart counted like decide's."""
        policy = self.policy
        window_s = policy.restart_budget.window_h * 3600
        recent = self.restarts.recent(incident.job_id, now, window_s) if incident.job_id else 0
        decision, action, migrate = decide_predicted(policy, incident, now, checkpoints_known, recent)
        if action is not None and action.action in RESTARTS and incident.job_id:
            self.restarts.count(incident.job_id, action.action_id, now)
        return decision, action, migrate

    def count_restart(self, job_id: str, action_id: str, now: float) -> bool:
        """A restart policy ordered outside `decide` (a migration's requeue): the budget counts it."""
        return self.restarts.count(job_id, action_id, now)
