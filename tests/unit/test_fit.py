"""Events over the message size limit: split, cut, or left for a dead letter - never a raise."""

from __future__ import annotations

from bus.fit import CUT_MARKER, fit_event, fits
from schemas.codec import decode, encode
from schemas.events import KernelEvent, LogBatch, LogLine, ProgressBatch, ProgressSample

LIMIT = 1_000_000


def _batch(n: int, size: int) -> LogBatch:
    return LogBatch(
        event_id="log-1",
        event_time=1.0,
        job_id="42",
        source="/data/job.out",
        lines=[LogLine(text=chr(ord("a") + i % 26) * size, ts=1.0, rank=i, lineno=i + 1) for i in range(n)],
    )


def test_twenty_lines_of_65kb_go_out_in_parts_that_each_fit() -> None:
    batch = _batch(20, 65_000)
    assert not fits(encode(batch), 300_000)
    parts, unfit = fit_event(batch, 300_000)
    assert not unfit and len(parts) > 1
    assert all(fits(payload, 300_000) for _, payload in parts)
    lines = [ln for part, _ in parts for ln in decode(LogBatch, encode(part)).lines]
    assert [ln.lineno for ln in lines] == list(range(1, 21)) and lines == batch.lines
    ids = [part.event_id for part, _ in parts]
    assert len(set(ids)) == len(ids)
    # A re-read of the same input splits the same way: the same ids, so downstream dedup holds.
    assert [p.event_id for p, _ in fit_event(batch, 300_000)[0]] == ids


def test_a_batch_that_fits_is_sent_as_it_is() -> None:
    batch = _batch(3, 100)
    ((part, payload),) = fit_event(batch, LIMIT)[0]
    assert part is batch and payload == encode(batch)


def test_one_line_alone_over_the_limit_is_cut_and_says_so() -> None:
    batch = _batch(1, 60_000)
    parts, unfit = fit_event(batch, 20_000)
    assert not unfit and len(parts) == 1
    part = parts[0][0]
    assert isinstance(part, LogBatch)
    line = part.lines[0]
    assert line.text.endswith(CUT_MARKER) and fits(parts[0][1], 20_000)


def test_progress_batches_split_by_samples() -> None:
    batch = ProgressBatch(
        event_id="prg-1",
        event_time=1.0,
        job_id="42",
        samples=[ProgressSample(ts=1.0, rank=r, step=r, format="custom") for r in range(2000)],
    )
    limit = len(encode(batch)) // 3
    parts, unfit = fit_event(batch, limit)
    assert not unfit and len(parts) >= 3
    assert sum(len(p.samples) for p, _ in parts if isinstance(p, ProgressBatch)) == 2000


def test_what_cannot_be_split_is_returned_for_a_dead_letter() -> None:
    ev = KernelEvent(event_id="kern-1", event_time=1.0, node="gpu01", kind="xid", xid=79, text="x" * 60_000)
    parts, unfit = fit_event(ev, 10_000)
    assert parts == [] and unfit == [ev]
