"""The silence detectors' clock: a worker behind its input judges by what it has read."""

from __future__ import annotations

import pytest

from streams.detectors.hang import HangDetector
from streams.watermark import PartitionClocks, Watermark
from tests.unit.test_hang import T0, running, steady


def test_a_current_worker_judges_by_the_wall_clock_and_a_lagging_one_by_its_newest_signal() -> None:
    wm = Watermark(slack_s=10.0)
    assert wm.judged_now(1000.0) == 1000.0  # nothing read yet
    wm.see(998.0, wall=1000.0)
    assert wm.judged_now(1000.0) == 1000.0 and wm.behind_s(1000.0) == 0.0
    wm.see(700.0, wall=1300.0)  # an older record read after a newer one: the newest stands
    assert wm.judged_now(1300.0) == 1008.0 and wm.behind_s(1300.0) == 292.0
    # Starved of CPU for a minute, nothing processed: still behind (the last record was old when read).
    assert wm.judged_now(1360.0) == 1008.0
    wm.see(1359.0, wall=1360.0)  # caught up: a fresh record
    assert wm.judged_now(1400.0) == 1400.0  # and then a quiet input: the wall clock
    with pytest.raises(ValueError, match="slack_s"):
        Watermark(slack_s=-1.0)


def test_a_backlog_does_not_make_a_healthy_job_hang() -> None:
    """A job stepping every 10 s, read 300 s late: by the wall clock it is silent, by its own
    signals it is not."""
    det = HangDetector()
    wm = Watermark()
    running(det, at=T0)
    last = steady(det, T0, 30, 10.0)
    wall = last + 300.0
    wm.see(last, wall)  # still reading the backlog at the check
    assert det.check(wm.judged_now(wall)) == []
    assert [a.signature for a in det.check(wall)] != []  # what the wall clock would have said


def test_a_job_that_hangs_when_nothing_else_sends_is_still_seen() -> None:
    """No GPU producers, one job, and it stops: no record arrives, so the clock is the wall's."""
    det = HangDetector()
    wm = Watermark()
    running(det, at=T0)
    last = steady(det, T0, 30, 10.0)
    wm.see(last, last)
    assert det.check(wm.judged_now(last + 120.0)) != []


def test_each_partition_judges_its_own_jobs_by_its_own_newest_progress_while_behind() -> None:
    """Catching up, partition 1's progress has been read far ahead of partition 0's: partition 0's
    jobs are judged by partition 0's newest progress, not by the worker's newest signal."""
    wall = T0 + 400.0
    overall = Watermark(slack_s=10.0)
    overall.see(T0 + 360.0, wall)  # the worker is 40 s behind, records still arriving
    clocks = PartitionClocks(slack_s=10.0)
    clocks.see(0, T0 + 290.0)
    clocks.see(1, T0 + 360.0)
    det = HangDetector()
    running(det, at=T0)
    steady(det, T0, 30, 10.0)  # job 1001: last step at T0 + 290
    assert det.check(wall, lambda job: clocks.judged_now(0, wall, overall)) == []
    assert det.check(wall, lambda job: clocks.judged_now(1, wall, overall)) != []  # the other partition's clock
    assert clocks.judged_now(7, wall, overall) == T0 + 370.0  # nothing read there: the worker's clock
    # Current again: every partition by the wall clock, so a partition whose jobs all hang is seen.
    overall.see(wall - 1.0, wall)
    assert clocks.judged_now(0, wall, overall) == wall
