"""Follow a growing text file: new complete lines, through rotation and truncation."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

MAX_LINE_BYTES = 64 * 1024


@dataclass
class FileFollower:
    path: Path
    from_start: bool = True
    lineno: int = 0
    truncated_lines: int = 0  # over-long lines cut to MAX_LINE_BYTES
    _fh: BinaryIO | None = None
    _inode: int | None = None
    _partial: bytes = b""
    _pending: list[str] = field(default_factory=list)

    def _open(self) -> bool:
        try:
            fh = open(self.path, "rb")  # noqa: SIM115 - kept open while following
        except OSError:
            return False
        st = os.fstat(fh.fileno())
        if not self.from_start and self._inode is None:
            fh.seek(st.st_size)
        self._fh, self._inode, self._partial = fh, st.st_ino, b""
        return True

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
