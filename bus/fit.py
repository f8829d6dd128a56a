"""Make an event fit one Kafka record: split batches, cut what a single item cannot carry.

A record over the smallest message limit on its way (the client's
`message.max.bytes`, the broker's, the topic's `max.message.bytes`) is refused
whole. Retrying the same batch fails the same way, so a producer that re-reads
its input after a crash would loop on it forever. Instead, a batch is split in
halves until every part fits; a single item that still does not fit has its
free text cut (saying so), and only what even then does not fit is left for
the caller to dead-letter.

Parts get ids derived from the original id and the part's first item, so a
re-read of the same input splits the same way and downstream deduplication
by event id still holds.
"""

from __future__ import annotations

from collections.abc import Callable

from schemas.codec import encode
from schemas.events import Event, LogBatch, LogLine, ProgressBatch
from schemas.ids import stable_id

# Kafka's record framing, key and headers ride on top of the value.
RECORD_OVERHEAD_BYTES = 1024
CUT_MARKER = " [... cut by trainmedic: line over the message size limit]"


def fits(payload: bytes, limit: int) -> bool:
    return len(payload) + RECORD_OVERHEAD_BYTES <= limit


def fit_event(event: Event, limit: int) -> tuple[list[tuple[Event, bytes]], list[Event]]:
    """(parts that fit with their encoded payloads, events that cannot be made to fit)."""
    payload = encode(event)
    if fits(payload, limit):
        return [(event, payload)], []
    splitter = _SPLITTERS.get(type(event))
    if splitter is None:
        return [], [event]
    parts = splitter(event, limit)
    if parts is None:
        return [], [event]
    ok: list[tuple[Event, bytes]] = []
    failed: list[Event] = []
    for part in parts:
        a, b = fit_event(part, limit)
        ok += a
        failed += b
    return ok, failed


def _cut_line(line: LogLine, budget: int) -> LogLine:
    keep = max(0, budget - len(CUT_MARKER))
    text = line.text if len(line.text.encode()) <= budget else _prefix(line.text, keep) + CUT_MARKER
    context = None if line.context is None else _prefix(line.context, keep)
    return line.model_copy(update={"text": text, "context": context})


def _prefix(text: str, max_bytes: int) -> str:
    return text.encode()[:max_bytes].decode("utf-8", errors="ignore")


def _split_logs(event: Event, limit: int) -> list[Event] | None:
    assert isinstance(event, LogBatch)
    lines = event.lines
    if len(lines) > 1:
        mid = len(lines) // 2
        return [_log_part(event, lines[:mid]), _log_part(event, lines[mid:])]
    if not lines:
        return None
    # One line alone is too big: its text and traceback context share what is left.
    budget = max(0, (limit - RECORD_OVERHEAD_BYTES - len(encode(event.model_copy(update={"lines": []})))) // 3)
    cut = _cut_line(lines[0], budget)
    return None if cut == lines[0] else [event.model_copy(update={"lines": [cut]})]


def _log_part(event: LogBatch, lines: list[LogLine]) -> LogBatch:
    return event.model_copy(update={"event_id": stable_id("log", event.event_id, lines[0].lineno), "lines": lines})


def _split_progress(event: Event, limit: int) -> list[Event] | None:
    assert isinstance(event, ProgressBatch)
    samples = event.samples
    if len(samples) < 2:
        return None
    mid = len(samples) // 2
    return [
        event.model_copy(update={"event_id": stable_id("prg", event.event_id, start), "samples": part})
        for start, part in ((0, samples[:mid]), (mid, samples[mid:]))
    ]


_SPLITTERS: dict[type[Event], Callable[[Event, int], list[Event] | None]] = {
    LogBatch: _split_logs,
    ProgressBatch: _split_progress,
}
