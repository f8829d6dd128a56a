"""The operator API's policy: the file as last read successfully, and why the latest read failed.

The API must never answer 500 because someone saved a broken policy file: the brake
(`trainmedic mode set monitor`) goes through it. So each use reads the file again, a read
that fails keeps the last good policy in force (as the streams workers do,
streams/policy_store.py), and the failure is remembered for /api/health and the console.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from streams.policy import Policy, PolicyError, load_policy

log = logging.getLogger("trainmedic.web.api")

# What identifies one version of the file without reading it: a rewrite (in place or by
# rename) changes at least one of these.
FileSignature = tuple[int, int, int, int]


@dataclass(frozen=True)
class PolicyState:
    """The last good policy (None when no read has ever succeeded), when it was last read
    successfully, and the latest read's error."""

    policy: Policy | None
    loaded_at: float | None
    error: str | None

    def problem(self) -> str | None:
        """What /api/health names as degraded; None while the file in place is the policy in force."""
        if self.error is None:
            return None
        if self.policy is None or self.loaded_at is None:
            return f"{self.error} (no valid policy has been loaded: only a switch to monitor is possible)"
        read = datetime.fromtimestamp(self.loaded_at, UTC).isoformat(timespec="seconds")
        return f"{self.error} (the policy last read successfully, at {read}, stays in force)"


class LastGoodPolicy:
    """Thread-safe: the API serves requests from a thread pool."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._state = PolicyState(None, None, None)
        self._signature: FileSignature | None = None
        self.reload()

    @property
    def state(self) -> PolicyState:
        return self._state

    def reload(self) -> PolicyState:
        """Read the file now: for decisions an operator is waiting on (modes, readiness, resume)."""
        with self._lock:
            signature = self._file_signature()
            try:
                policy = load_policy(self.path)
            except PolicyError as exc:
                self._remember_failure(str(exc))
            else:
                self._remember_success(policy)
            self._signature = signature
            return self._state

    def refresh(self) -> PolicyState:
        """Read the file only if it changed since the last read: for /api/health, which load
        balancers and the console poll (a read and validation costs milliseconds)."""
        if self._file_signature() == self._signature and self._signature is not None:
            return self._state
        return self.reload()

    def _file_signature(self) -> FileSignature | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None  # missing: read again each time, so the error names the current cause
        return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)

    def _remember_failure(self, error: str) -> None:
        if error != self._state.error:
            # Logged once per distinct error, not on every request that meets it.
            log.error("policy file refused, keeping the last good policy: %s", error)
        self._state = PolicyState(self._state.policy, self._state.loaded_at, error)

    def _remember_success(self, policy: Policy) -> None:
        if self._state.error is not None:
            log.info("policy file %s is valid again; it is the policy in force", self.path)
        self._state = PolicyState(policy, self._clock(), None)
