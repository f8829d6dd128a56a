"""Supervision of `trainmedic up`'s parts: a dead one is logged, restarted with backoff
and reported unhealthy until it is back; too many crashes in a window give up.

A component is three callables: is it alive, how did it end, and start it again
(blocking until it is ready, raising when it cannot). The supervisor runs in one
long-lived thread that also does every restart: the child processes it starts carry
a parent-death signal, and Linux sends that signal when the *thread* that forked the
child ends, so the thread that forks must live as long as the children
(`Supervisor.stop` is called only after the children are stopped).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("trainmedic.stack.supervisor")

DEFAULT_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


@dataclass
class Component:
    name: str
    alive: Callable[[], bool]
    restart: Callable[[], None]
    exit_status: Callable[[], str] = lambda: "ended"


def describe_returncode(rc: int | None) -> str:
    """'exit code 1', 'signal SIGKILL' (Popen reports a signal as -N)."""
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


@dataclass
class _State:
    state: str = "up"  # up | restarting | failed
    reason: str | None = None
    restarts: int = 0
    crashes: deque[float] = field(default_factory=deque)
    next_try: float = 0.0


class Supervisor:
    def __init__(
        self,
        components: Sequence[Component],
        *,
        max_crashes: int = 5,
        window_s: float = 300.0,
        backoff_s: Sequence[float] = DEFAULT_BACKOFF_S,
        interval_s: float = 0.5,
    ) -> None:
        self.components = list(components)
        self.max_crashes = max_crashes
        self.window_s = window_s
        self.backoff_s = tuple(backoff_s)
        self.interval_s = interval_s
        self.gave_up = threading.Event()  # set with `failure` when a component crashed too often
        self.failure: str | None = None
        self._states = {c.name: _State() for c in self.components}
        self._lock = threading.Lock()
        self._checking = threading.Event()
        self._exit = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None

    def start(self) -> Supervisor:
        self._checking.set()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def pause(self, timeout: float = 120.0) -> None:
        """Stop watching (a clean shutdown is no crash); waits for a restart in progress."""
        self._checking.clear()
        self._idle.wait(timeout)

    def stop(self) -> None:
        self._checking.clear()
        self._exit.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> dict[str, Any]:
        """{"ok": bool, "components": {name: {"state", "restarts", "reason"}}}: ok only when all are up."""
        with self._lock:
            comps = {
                name: {"state": s.state, "restarts": s.restarts, "reason": s.reason} for name, s in self._states.items()
            }
        ok = all(c["state"] == "up" for c in comps.values()) and (self.alive or not self._checking.is_set())
        out: dict[str, Any] = {"ok": ok and not self.gave_up.is_set(), "components": comps}
        down = {n: c["reason"] for n, c in comps.items() if c["state"] != "up"}
        if down:
            out["down"] = down
        if self.gave_up.is_set():
            out["failure"] = self.failure
        return out

    # --- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._exit.is_set():
            if self._checking.is_set():
                self._idle.clear()
                try:
                    for c in self.components:
                        if not self._checking.is_set() or self.gave_up.is_set():
                            break
                        self._check(c)
                except Exception:  # the watcher itself must not die silently
                    log.exception("supervisor: unexpected error while checking components")
                finally:
                    self._idle.set()
            self._exit.wait(self.interval_s)

    def _crashed(self, c: Component, st: _State, reason: str) -> None:
        now = time.monotonic()
        st.crashes.append(now)
        while st.crashes and st.crashes[0] < now - self.window_s:
            st.crashes.popleft()
        n = len(st.crashes)
        with self._lock:
            st.reason = reason
            if n > self.max_crashes:
                st.state = "failed"
                times = f"{n} time{'s' if n != 1 else ''}"
                self.failure = f"{c.name} crashed {times} within {self.window_s:.0f} s (last: {reason}); giving up"
            else:
                st.state = "restarting"
                st.next_try = now + self.backoff_s[min(n - 1, len(self.backoff_s) - 1)]
        if st.state == "failed":
            log.error("supervisor: %s", self.failure)
            self.gave_up.set()
            return
        log.error(
            "supervisor: %s died (%s); restart %d in %.0f s (crash %d of %d allowed within %.0f s)",
            c.name,
            reason,
            st.restarts + 1,
            st.next_try - now,
            n,
            self.max_crashes,
            self.window_s,
        )

    def _check(self, c: Component) -> None:
        st = self._states[c.name]
        if st.state == "up":
            if c.alive():
                return
            self._crashed(c, st, c.exit_status())
            return
        if st.state != "restarting" or time.monotonic() < st.next_try:
            return
        try:
            c.restart()
        except Exception as exc:
            self._crashed(c, st, f"restart failed: {str(exc)[:500]}")
            return
        with self._lock:
            st.state, st.reason = "up", None
            st.restarts += 1
        log.warning("supervisor: %s is back (restart %d)", c.name, st.restarts)


# --- children die with their parent ---------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_libc: Any = None


def die_with_parent() -> Callable[[], None]:
    """A Popen preexec_fn: the child gets SIGKILL when the thread that started it ends (an OOM
    kill or SIGKILL of `up` included), so no broker or worker outlives `up` as an orphan.
    libc is loaded here, before the fork: the function that runs in the child only calls it."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    libc = _libc
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec
