"""Where each producer got to in its input, kept across restarts.

A producer restarted while lines are being written must read those lines once
it is back: not skip them (a Xid written during the restart would be missed)
and not read them twice. Positions are saved only once everything published
before them has been acknowledged by the broker, so a crash re-reads at most
what was not confirmed - and those events carry the same ids as before, so
consumers drop the duplicates.

One small JSON file per producer, replaced atomically (write, fsync, rename).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("trainmedic.position")


@dataclass(frozen=True)
class FilePosition:
    """A followed file: which file (inode), how far (bytes of complete lines), which line number."""

    inode: int
    offset: int
    lineno: int


class PositionStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._data: dict[str, Any] = self._load()

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            # An unreadable position must not stop the producer: start afresh and say so.
            log.warning("%s: position file unreadable (%s): starting without saved positions", self.path, exc)
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> Any:
        return self._data.get(key)

    def file(self, key: str) -> FilePosition | None:
        raw = self._data.get(key)
        if not isinstance(raw, dict):
            return None
        try:
            return FilePosition(int(raw["inode"]), int(raw["offset"]), int(raw["lineno"]))
        except (TypeError, KeyError, ValueError):
            return None

    def update(self, values: dict[str, Any]) -> None:
        self._data.update({k: asdict(v) if isinstance(v, FilePosition) else v for k, v in values.items()})

    def forget(self, keys: list[str]) -> None:
        for k in keys:
            self._data.pop(k, None)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(self._data, fh, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class Checkpointer:
    """Saves positions once everything published before them is acknowledged.

    `flushed(timeout)` answers whether the publisher has nothing left in flight
    (Publisher.flush(timeout) == 0). While the broker is away nothing is saved:
    a restart then reads again what may not have arrived.
    """

    def __init__(
        self,
        store: PositionStore,
        positions: Callable[[], dict[str, Any]],
        flushed: Callable[[float], bool],
        every_s: float = 1.0,
    ) -> None:
        self.store = store
        self._positions = positions
        self._flushed = flushed
        self.every_s = every_s
        self._last = 0.0
        self.saves = 0

    def maybe_save(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if now - self._last < self.every_s:
            return False
        self._last = now
        return self.save(timeout=0.5)

    def save(self, timeout: float = 10.0) -> bool:
        snapshot = self._positions()  # taken before the flush: only what was published by now
        if not self._flushed(timeout):
            return False
        self.store.update(snapshot)
        self.store.save()
        self.saves += 1
        return True
