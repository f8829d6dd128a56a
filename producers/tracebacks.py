"""Group multi-line Python tracebacks into one log line per exception.

A traceback is a header line, indented frames, optional chained-exception
separators, and a final unindented "SomeError: message" line. Ranks interleave
their output, so each rank's traceback is collected separately. The grouped
line's text is the final exception line (what the detectors match); the whole
traceback rides along in `context`.

torchrun's ChildFailedError summary is a table whose entries spread one failure over
several lines (host, rank, exitcode, ...); `FailureTable` gives the lines of its
"Root Cause (first observed failure)" entry that entry's rank, host and local rank, so a
signature on the exitcode line names where the first failure was.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from schemas.events import LogLine
from schemas.ids import NODE_NAME_PATTERN

HEADER = "Traceback (most recent call last):"
_CHAINING = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
MAX_BLOCK_LINES = 400
MAX_CONTEXT_CHARS = 60_000

_ROOT_CAUSE = "Root Cause (first observed failure):"
_TABLE_HOST = re.compile(rf"^\s+host\s*: (?P<host>{NODE_NAME_PATTERN})\s*$")  # a Slurm node name (schemas.ids)
_TABLE_RANK = re.compile(r"^\s+rank\s*: (?P<rank>\d{1,7})(?: \(local_rank: (?P<local>\d{1,4})\))?")
_TABLE_FIELD = re.compile(r"^\s+(?:time|exitcode|error_file|traceback)\s*:")
_TABLE_ENTRY = re.compile(r"^\[\d+\]:\s*$")


class FailureTable:
    """Attributes the lines of torchrun's root-cause entry to its rank and host.

    The entry is "[0]:" then "  time : ...", "  host : gpu02", "  rank : 5 (local_rank: 1)",
    "  exitcode : -9 (pid: ...)", "  error_file: ...", "  traceback : ...". The other
    failures of the table are left alone: they are usually ranks the agent stopped after
    the first one failed.
    """

    def __init__(self) -> None:
        self._in_root = False
        self._host: str | None = None
        self._rank: int | None = None
        self._gpu: int | None = None

    def feed(self, line: LogLine) -> LogLine:
        text = line.text
        if text.strip() == _ROOT_CAUSE:
            self._in_root, self._host, self._rank, self._gpu = True, None, None, None
            return line
        if not self._in_root or _TABLE_ENTRY.match(text):
            return line
        if m := _TABLE_HOST.match(text):
            self._host = m.group("host")
        elif m := _TABLE_RANK.match(text):
            self._rank = int(m.group("rank"))
            self._gpu = int(m.group("local")) if m.group("local") else None
        elif not _TABLE_FIELD.match(text):
            self._in_root = False  # the entry (and the table) ended
            return line
        update: dict[str, object] = {}
        if self._rank is not None:
            update["rank"] = self._rank
        if self._host is not None:
            update["node"] = self._host
        if self._gpu is not None:
            update["gpu"] = self._gpu
        return line.model_copy(update=update) if update else line


@dataclass
class _Block:
    lines: list[LogLine] = field(default_factory=list)
    last_seen: float = 0.0


def _continues(text: str) -> bool:
    return text == "" or text[:1] in (" ", "\t") or text.strip() in _CHAINING or text.strip() == HEADER


class TracebackGrouper:
    """Feed lines in file order; get lines back, tracebacks folded into one."""

    def __init__(self, stale_after_s: float = 2.0) -> None:
        self.stale_after_s = stale_after_s
        self._open: dict[int | None, _Block] = {}
        self._table = FailureTable()
        self.grouped = 0

    def feed(self, line: LogLine, now: float) -> list[LogLine]:
        line = self._table.feed(line)
        block = self._open.get(line.rank)
        if block is None:
            if line.text.strip() == HEADER:
                self._open[line.rank] = _Block([line], now)
                return []
            return [line]
        if _continues(line.text) and len(block.lines) < MAX_BLOCK_LINES:
            block.lines.append(line)
            block.last_seen = now
            return []
        del self._open[line.rank]
        if _continues(line.text):  # over-long: give up grouping, keep every line
            return [*block.lines, line]
        return [self._fold(block.lines, line)]

    @property
    def holding(self) -> bool:
        """Lines fed but not yet handed back (an open traceback)."""
        return bool(self._open)

    def flush(self, now: float, force: bool = False) -> list[LogLine]:
        """Tracebacks that stopped growing without a final line (the process died mid-print)."""
        out = []
        for rank, block in list(self._open.items()):
            if force or now - block.last_seen >= self.stale_after_s:
                del self._open[rank]
                out.append(self._fold(block.lines[:-1], block.lines[-1]) if len(block.lines) > 1 else block.lines[0])
        return out

    def _fold(self, head: list[LogLine], last: LogLine) -> LogLine:
        self.grouped += 1
        context = "\n".join(x.text for x in [*head, last])
        if len(context) > MAX_CONTEXT_CHARS:
            context = context[:1000] + "\n...\n" + context[-(MAX_CONTEXT_CHARS - 1100) :]
        return last.model_copy(update={"context": context})
