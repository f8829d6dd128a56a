"""The policy in force, reloaded when its file changes (no restart needed)."""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from schemas.events import Action, Decision, Incident
from schemas.vocab import MODES, Mode
from streams.policy import DEFAULT_POLICY, RESTARTS, Policy, PolicyError, decide, load_overlay, load_policy

log = logging.getLogger("trainmedic.policy")


class PolicyStore:
    """Policy file + operator mode overlay (+ a whole-run override for demos/tests)."""

    def __init__(
        self, path: str | Path | None = None, mode_override: str | None = None, overlay: str | Path | None = None
    ) -> None:
        self.path = Path(path) if path else DEFAULT_POLICY
        self.overlay_path = Path(overlay) if overlay else None
        if mode_override is not None and mode_override not in MODES:
            raise PolicyError(f"TRAINMEDIC_MODE: unknown mode {mode_override!r} (expected one of {', '.join(MODES)})")
        self._override: Mode | None = mode_override  # type: ignore[assignment]
        self._mtimes = self._stat()
        self._policy = self._load()
        # Restarts policy ordered per job: the restart budget (the only one: the executor's
        # guardrails keep cluster-wide caps) counts them. A worker restart takes them back
        # from the actions topic (`restore`).
        self._restarts: dict[str, deque[float]] = {}

    def _stat(self) -> tuple[float, float]:
        def mtime(p: Path | None) -> float:
            try:
                return os.stat(p).st_mtime if p else 0.0
            except OSError:
                return 0.0

        return mtime(self.path), mtime(self.overlay_path)

    def _load(self) -> Policy:
        policy = load_policy(self.path)
        if self.overlay_path is not None:
            policy = policy.with_overlay(load_overlay(self.overlay_path))
        return policy.with_mode(self._override) if self._override else policy

    @property
    def policy(self) -> Policy:
        mtimes = self._stat()
        if mtimes != self._mtimes:
            self._mtimes = mtimes
            try:
                self._policy = self._load()
                log.info("policy reloaded from %s (overlay %s)", self.path, self.overlay_path)
            except PolicyError as exc:
                # Keep acting on the last valid policy; a typo must not stop the service.
                log.error("policy reload refused, keeping the previous one: %s", exc)
        return self._policy

    def restore(self, actions: Sequence[Action]) -> int:
        """Count the restarts a previous worker ordered (read back from the actions topic),
        so that a worker restart does not reset any job's restart budget."""
        restored, seen = 0, set()
        for a in sorted(actions, key=lambda a: a.event_time):
            if a.action_id in seen:
                continue  # the same action published twice (a crash between send and commit)
            seen.add(a.action_id)
            if a.requested_by == "policy" and a.action in RESTARTS and a.job_id:
                self._restarts.setdefault(a.job_id, deque()).append(a.event_time)
                restored += 1
        return restored

    def decide(self, incident: Incident, now: float) -> tuple[Decision, Action | None]:
        policy = self.policy
        window_s = policy.restart_budget.window_h * 3600
        times = self._restarts.setdefault(incident.job_id or "", deque())
        while times and now - times[0] > window_s:
            times.popleft()
        decision, action = decide(policy, incident, now, recent_restarts=len(times))
        if action is not None and action.action in RESTARTS and incident.job_id:
            times.append(now)
        return decision, action
