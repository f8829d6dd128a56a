"""Operator mode changes as every streams process sees them: fail closed.

The durable record of operator mode changes is the API's state file (DATA_DIR/modes.yaml,
written after the change is on the topic) and the audit's mode_changes table. Each change
is published on `mode.changes`, which every streams process follows whole (not as a
consumer group: every worker needs every change).

A worker starts from the state file when it can read it, then applies the topic from its
beginning. Until it has read the topic to its end it is "in doubt" unless it had the file:
in doubt, every partition and category is in monitor mode. So losing the topic (the
embedded broker is memory-only) can never make anything more autonomous than the durable
record says, and a worker that has neither runs in monitor mode until it has the topic.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bus.consume import Follower, MissingTopic
from schemas.codec import DecodeError, decode
from schemas.events import ModeChange
from schemas.ids import current_cluster
from schemas.topics import MODE_CHANGES
from schemas.vocab import Category, Mode
from streams.policy import ModeOverlay, PartitionPolicy, PolicyError, load_overlay

log = logging.getLogger("trainmedic.modes")


def apply_change(overlay: ModeOverlay, partition: str | None, category: Category | None, mode: Mode) -> None:
    """Set `mode` for one scope of the overlay: everything, a category, a partition, or both."""
    if partition is None and category is None:
        overlay.mode = mode
    elif partition is None:
        assert category is not None
        overlay.categories[category] = mode
    else:
        part = overlay.partitions.setdefault(partition, PartitionPolicy())
        if category is None:
            part.mode = mode
        else:
            part.categories[category] = mode


class ModeState:
    """The overlay a streams process applies, and whether it may trust it."""

    def __init__(
        self,
        bootstrap: str | None,
        state_file: Path | None = None,
        follower: Callable[[], Follower] | None = None,
    ) -> None:
        self.overlay = ModeOverlay()
        self.durable = False  # started from the state file
        self.version = 0  # bumped on every applied change: the policy store reloads on it
        if state_file is not None:
            try:
                self.overlay = load_overlay(state_file)
                self.durable = state_file.exists()
            except PolicyError as exc:
                # An unreadable record is no record: in doubt until the topic is read.
                log.error("mode state file refused (%s): monitor mode until mode.changes is read", exc)
        self._make_follower = follower or (
            # Prompt, not background: a switch to monitor mode is an operator's brake, and one
            # follower of a small topic costs the broker little.
            (lambda: Follower(bootstrap, MODE_CHANGES.name, "trainmedic-modes", background=False))
            if bootstrap
            else None
        )
        self._follower: Follower | None = None
        self._pending: ModeOverlay | None = None  # the backlog read so far, before it is all read
        self._read_whole = False  # the topic's backlog has been applied
        self._missing_logged = 0.0
        self._lock = threading.Lock()
        self._seen: set[str] = set()

    @property
    def in_doubt(self) -> bool:
        """Neither the durable record nor the whole topic is known: act as in monitor mode.

        The topic counts once its backlog is applied (`_read_whole`), not when the follower first
        reaches its end: the last chunk is still being decoded then."""
        return not self.durable and not self._read_whole

    def poll(self) -> int:
        """Apply the changes that arrived on the topic; how many were applied."""
        with self._lock:  # the worker's start and its timer may both poll; one consumer, one reader
            return self._poll()

    def _poll(self) -> int:
        if self._follower is None:
            if self._make_follower is None:
                return 0
            try:
                self._follower = self._make_follower()
            except MissingTopic as exc:
                # Once a minute, not once a poll: a missing topic is a setup fault, not news each second.
                if time.monotonic() - self._missing_logged > 60:
                    self._missing_logged = time.monotonic()
                    log.error(
                        "mode changes not readable (%s); %s - create the topics (`trainmedic up` does)",
                        exc,
                        self._standing(),
                    )
                return 0
        applied = 0
        # Changes go into a copy swapped in whole: the policy store reads the overlay from the
        # event loop while this runs in a thread. While the topic's backlog is still being read
        # the copy is not swapped in: an old change replayed before a newer one must not show.
        overlay = self._pending or self.overlay.model_copy(deep=True)
        for value in self._follower.poll():
            try:
                change = decode(ModeChange, value)
            except DecodeError as exc:
                # A change that cannot be read cannot raise autonomy: skipped, loudly.
                log.error("unreadable record on %s skipped: %s", MODE_CHANGES.name, exc)
                continue
            if change.outcome != "applied" or change.cluster != current_cluster() or change.event_id in self._seen:
                continue
            self._seen.add(change.event_id)
            apply_change(overlay, change.partition, change.category, change.new_mode)
            applied += 1
        if not self._follower.caught_up:
            self._pending = overlay
            return 0
        if applied or self._pending is not None or not self._read_whole:
            self.overlay, self._pending = overlay, None
            self._read_whole = True  # after the swap: never trusted with the overlay half applied
            self.version += 1
            log.info("mode changes applied from %s (%d new)", MODE_CHANGES.name, applied)
        return applied

    def _standing(self) -> str:
        return "keeping the state file's modes" if self.durable else "every partition in monitor mode meanwhile"

    def close(self) -> None:
        if self._follower is not None:
            self._follower.close()
