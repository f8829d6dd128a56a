"""The policy in force, reloaded when its file changes (no restart needed)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from schemas.events import Action, Decision, Incident
from schemas.vocab import MODES, Mode
from streams.policy import DEFAULT_POLICY, Policy, PolicyError, decide, load_policy

log = logging.getLogger("trainmedic.policy")


class PolicyStore:
    def __init__(self, path: str | Path | None = None, mode_override: str | None = None) -> None:
        self.path = Path(path) if path else DEFAULT_POLICY
        if mode_override is not None and mode_override not in MODES:
            raise PolicyError(f"TRAINMEDIC_MODE: unknown mode {mode_override!r} (expected one of {', '.join(MODES)})")
        self._override: Mode | None = mode_override  # type: ignore[assignment]
        self._mtime = self._stat()
        self._policy = self._apply_override(load_policy(self.path))

    def _stat(self) -> float:
        try:
            return os.stat(self.path).st_mtime
        except OSError:
            return 0.0

    def _apply_override(self, policy: Policy) -> Policy:
        return policy.with_mode(self._override) if self._override else policy

    @property
    def policy(self) -> Policy:
        mtime = self._stat()
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                self._policy = self._apply_override(load_policy(self.path))
                log.info("policy reloaded from %s", self.path)
            except PolicyError as exc:
                # Keep acting on the last valid policy; a typo must not stop the service.
                log.error("policy reload refused, keeping the previous one: %s", exc)
        return self._policy

    def decide(self, incident: Incident, now: float) -> tuple[Decision, Action | None]:
        return decide(self.policy, incident, now)
