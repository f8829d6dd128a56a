"""Follow a growing text file: new complete lines, through rotation and truncation.

A follower can resume from a saved `FilePosition`: the same file (by inode) at
the saved offset; or, when the file was rotated while the producer was away,
the rest of the rotated file (found by its inode next to the path) and then
the new file from its start. So no line is skipped across a restart.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from producers.position import FilePosition

MAX_LINE_BYTES = 64 * 1024
log = logging.getLogger("trainmedic.follow")


@dataclass
class FileFollower:
    path: Path
    from_start: bool = True
    lineno: int = 0
    truncated_lines: int = 0  # over-long lines cut to MAX_LINE_BYTES
    resume: FilePosition | None = None
    # Not from the start and nothing to resume: read back this many bytes before the end
    # (a fault line written just before the producer started is not missed).
    lookback_bytes: int = 0
    _fh: BinaryIO | None = None
    _inode: int | None = None
    _partial: bytes = b""
    _pending: list[str] = field(default_factory=list)

    @property
    def is_open(self) -> bool:
        """The file is open and being followed (a producer's readiness: its source opened)."""
        return self._fh is not None

    def position(self) -> FilePosition | None:
        """Up to the last complete line handed out (a partial line is read again after a restart)."""
        if self._fh is None or self._inode is None:
            return self.resume
        return FilePosition(self._inode, self._fh.tell() - len(self._partial), self.lineno)

    def _open(self) -> bool:
        if self.resume is not None and self._inode is None:
            resume, self.resume = self.resume, None
            if self._resume(resume):
                return True
        try:
            fh = open(self.path, "rb")  # noqa: SIM115 - kept open while following
        except OSError:
            return False
        st = os.fstat(fh.fileno())
        partial = b""
        if not self.from_start and self._inode is None:
            start = max(0, st.st_size - self.lookback_bytes)
            fh.seek(start)
            if start > 0:
                fh.readline()  # the cut line before the look-back window is not a line of ours
        self._fh, self._inode, self._partial = fh, st.st_ino, partial
        return True

    def _resume(self, pos: FilePosition) -> bool:
        """Open the file the saved position is in, at that position; False to start afresh."""
        candidates = [self.path, *sorted(self.path.parent.glob(self.path.name + ".*"))]
        for candidate in candidates:
            try:
                st = os.stat(candidate)
            except OSError:
                continue
            if st.st_ino != pos.inode:
                continue
            if st.st_size < pos.offset:
                log.warning("%s: shorter than its saved position (truncated?): reading it from the start", candidate)
                break
            fh = open(candidate, "rb")  # noqa: SIM115 - kept open while following
            fh.seek(pos.offset)
            self._fh, self._inode, self._partial, self.lineno = fh, pos.inode, b"", pos.lineno
            # A rotated file: poll() drains it, then moves on to the new file at self.path.
            return True
        else:
            log.warning(
                "%s: the file of the saved position is gone: reading the current file from the start", self.path
            )
        self.from_start = True
        self.lineno = pos.lineno
        return False

    def poll(self, max_bytes: int = 8 * 1024 * 1024) -> list[str]:
        """Complete lines appended since the last call (decoded, newline stripped)."""
        if self._fh is None and not self._open():
            return []
        assert self._fh is not None
        lines = self._read(max_bytes)
        try:
            st = os.stat(self.path)
        except OSError:
            return lines  # rotated away and not yet recreated: keep the old handle
        if st.st_ino != self._inode:
            # Rotated: drain what is left of the old file, then follow the new one from its start.
            lines += self._read(max_bytes)
            if self._partial:
                lines.append(self._decode(self._partial))
            self._fh.close()
            self._fh, self._inode = None, None
            self.from_start = True
            if self._open():
                lines += self._read(max_bytes)
        elif st.st_size < self._fh.tell():
            # Truncated in place (copytruncate): start over.
            self._fh.seek(0)
            self._partial = b""
            lines += self._read(max_bytes)
        return lines

    def _read(self, max_bytes: int) -> list[str]:
        assert self._fh is not None
        data = self._fh.read(max_bytes)
        if not data:
            return []
        data = self._partial + data
        parts = data.split(b"\n")
        self._partial = parts.pop()
        if len(self._partial) > MAX_LINE_BYTES:
            parts.append(self._partial)
            self._partial = b""
        return [self._decode(p) for p in parts]

    def _decode(self, raw: bytes) -> str:
        self.lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            self.truncated_lines += 1
            raw = raw[:MAX_LINE_BYTES]
        return raw.rstrip(b"\r").decode("utf-8", errors="replace")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
