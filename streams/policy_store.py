"""The policy in force, reloaded when its file changes (no restart needed)."""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from schemas.events import Action, Decision, Incident
from schemas.vocab import MODES, Mode
from streams import metrics
from streams.modes import ModeState
from streams.policy import DEFAULT_POLICY, RESTARTS, Policy, PolicyError, decide, load_policy

log = logging.getLogger("trainmedic.policy")


class PolicyStore:
    """Policy file + operator mode changes (streams.modes) (+ a whole-run override for demos/tests).

    Without `modes` (offline: diagnose, replay, tests) the policy file's modes apply. With them,
    a worker in doubt about the operators' changes (streams.modes.ModeState.in_doubt) decides as
    in monitor mode everywhere."""

    def __init__(
        self, path: str | Path | None = None, mode_override: str | None = None, modes: ModeState | None = None
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
        # guardrails keep cluster-wide caps) counts them. A worker restart takes them back
        # from the actions topic (`restore`).
        self._restarts: dict[str, deque[float]] = {}
        self._counted: dict[str, float] = {}  # action id -> when: each restart counted once

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
        """Count the restarts a previous worker ordered (read back from the actions topic),
        so that a worker restart does not reset any job's restart budget."""
        restored = 0
        for a in sorted(actions, key=lambda a: a.event_time):
            # The same action published twice (a crash between send and commit), or read back again
            # when partitions move between workers: counted once.
            if (
                a.requested_by == "policy"
                and a.action in RESTARTS
                and a.job_id
                and self._count(a.action_id, a.job_id, a.event_time)
            ):
                restored += 1
        return restored

    def _count(self, action_id: str, job_id: str, at: float) -> bool:
        """Count one restart toward the job's budget, once per action id."""
        if action_id in self._counted:
            return False
        self._counted[action_id] = at
        times = self._restarts.setdefault(job_id, deque())
        times.append(at)
        if len(times) > 1 and times[-2] > at:  # read back out of order
            self._restarts[job_id] = deque(sorted(times))
        return True

    def decide(self, incident: Incident, now: float) -> tuple[Decision, Action | None]:
        policy = self.policy
        window_s = policy.restart_budget.window_h * 3600
        times = self._restarts.setdefault(incident.job_id or "", deque())
        while times and now - times[0] > window_s:
            times.popleft()
        decision, action = decide(policy, incident, now, recent_restarts=len(times))
        if action is not None and action.action in RESTARTS and incident.job_id:
            # An incident delivered twice decides the same action id: one restart, not two.
            self._count(action.action_id, incident.job_id, now)
        for aid in [a for a, at in self._counted.items() if now - at > window_s]:
            del self._counted[aid]
        return decision, action
