"""Group multi-line Python tracebacks into one log line per exception.

A traceback is a header line, indented frames, optional chained-exception
separators, and a final unindented "SomeError: message" line. Ranks interleave
their output, so each rank's traceback is collected separately. The grouped
line's text is the final exception line (what the detectors match); the whole
traceback rides along in `context`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.events import LogLine

HEADER = "Traceback (most recent call last):"
_CHAINING = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
MAX_BLOCK_LINES = 400
MAX_CONTEXT_CHARS = 60_000


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
        self.grouped = 0

    def feed(self, line: LogLine, now: float) -> list[LogLine]:
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
