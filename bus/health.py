"""Liveness and readiness of a process's loops, for its probe endpoints and its alerts.

Every long-running loop (a consumer, a producer's poll, the executor, the audit sink) holds a
`Loop` and calls `beat()` each time round - also when idle, so a quiet topic is not a dead loop -
and `beat(processed=n)` when it handled records. `set_ready()` says whether it can do its work
(connected, assigned, schema current). The process's probe listener (trainmedic.probe_server)
answers /healthz from `alive` (every loop beat recently: the loop is not stuck or dead) and
/readyz from `ready`. The gauges let Prometheus see a stalled consumer, which the record-age
gauges cannot: they keep their last value when nothing is processed any more.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Gauge

LAST_BEAT = Gauge("trainmedic_loop_last_beat_timestamp_seconds", "When the loop last went round (Unix time)", ["loop"])
LAST_PROCESSED = Gauge(
    "trainmedic_consumer_last_processed_timestamp_seconds",
    "When the loop last handled a record (Unix time); stays still while it stalls or has nothing to do",
    ["loop"],
)
READY = Gauge(
    "trainmedic_loop_ready", "1 while the loop can do its work (connected, assigned, schema current)", ["loop"]
)
#: What every process exports (trainmedic/stack/metrics_server.py).
FAMILIES = (LAST_BEAT, LAST_PROCESSED, READY)

#: A loop that has not beaten for this long is taken for stuck (its probe fails, it is restarted).
DEFAULT_STALE_S = 60.0


@dataclass
class Loop:
    name: str
    stale_after_s: float = DEFAULT_STALE_S
    started: float = field(default_factory=time.monotonic)
    last_beat: float | None = None
    last_processed: float | None = None
    processed: int = 0
    ready: bool = False
    why: str = "starting"
    stopped: bool = False

    def beat(self, processed: int = 0) -> None:
        now = time.monotonic()
        self.last_beat = now
        LAST_BEAT.labels(self.name).set(time.time())
        if processed:
            self.processed += processed
            self.last_processed = now
            LAST_PROCESSED.labels(self.name).set(time.time())

    def set_ready(self, ready: bool, why: str = "") -> None:
        self.ready, self.why = ready, why or ("ready" if ready else "not ready")
        READY.labels(self.name).set(1 if ready else 0)

    def stop(self) -> None:
        """A loop that ended on request: no longer counted (a clean stop is no failure), and its
        series go, so that no alert fires on a loop that is meant to be over."""
        self.stopped = True
        self.ready, self.why = False, "stopped"
        for gauge in (LAST_BEAT, LAST_PROCESSED, READY):
            with contextlib.suppress(KeyError):
                gauge.remove(self.name)

    @property
    def alive(self) -> bool:
        """Went round within stale_after_s (a loop not yet round once counts from its start)."""
        since = self.last_beat if self.last_beat is not None else self.started
        return time.monotonic() - since <= self.stale_after_s

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "alive": self.alive,
            "ready": self.ready and self.alive,
            "why": self.why if self.alive else f"no beat for {now - (self.last_beat or self.started):.0f} s",
            "last_beat_s_ago": None if self.last_beat is None else round(now - self.last_beat, 1),
            "last_processed_s_ago": None if self.last_processed is None else round(now - self.last_processed, 1),
            "processed": self.processed,
        }


def processed(consumer: str, n: int = 1) -> None:
    """`n` records handled by a consumer that is not a loop of its own (a Faust agent): only its
    last-processed gauge moves; its process's loop says whether it is alive."""
    if n:
        LAST_PROCESSED.labels(consumer).set(time.time())


_lock = threading.Lock()
_loops: dict[str, Loop] = {}


def loop(name: str, stale_after_s: float = DEFAULT_STALE_S) -> Loop:
    """The process's loop of that name (a restarted loop gets a fresh one, not yet ready)."""
    with _lock:
        current = Loop(name, stale_after_s)
        current.set_ready(False, "starting")
        _loops[name] = current
        return current


def loops() -> dict[str, Loop]:
    with _lock:
        return {name: lp for name, lp in _loops.items() if not lp.stopped}


def report() -> dict[str, Any]:
    """What /healthz and /readyz answer: live = every loop alive, ready = every loop also ready.
    A process with no loop registered yet is live but not ready."""
    current = loops()
    described = {name: lp.describe() for name, lp in current.items()}
    live = all(d["alive"] for d in described.values())
    ready = bool(described) and all(d["ready"] for d in described.values())
    return {"live": live, "ready": ready, "loops": described}


def forget_all() -> None:
    """Tests only: a clean registry."""
    with _lock:
        _loops.clear()
