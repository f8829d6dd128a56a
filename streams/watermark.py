"""The clock the silence detectors judge by: the newest signal this worker has read.

The hang and straggler detectors judge silence: no progress for k x the job's step time, GPUs
idle for a minute. Measured against the wall clock, a worker that is behind its input (it was
down, or a rebalance gave it a backlog) sees every job silent for as long as it is behind, and
calls every job hung (the catch-up benchmark, bench/catchup.py, saw 302 hang incidents on a
healthy 5,000-node fleet before this). Measured against the newest event time it has read (plus
a little slack for the gaps between records), silence is what the data says: a backlog delays
the verdicts, it does not make them.

While the worker is behind, progress silence is judged per partition of job.progress
(`PartitionClocks`): a job by the newest progress line read on its own partition, since topics
and partitions are read at uneven speeds during a catch-up. The newest is a maximum, so one
producer with a slow clock cannot hold a clock back while others are current. And the clocks
hold back only while the records read are old when read: when the worker reads fresh records,
or none at all, silence is judged by the wall clock (a site without GPU producers whose only
job hangs still sees the hang).
"""

from __future__ import annotations

__all__ = ["PartitionClocks", "Watermark"]

#: How far past the newest signal read the clock may run: the gaps between records (GPU samples
#: every 1-5 s with edge aggregation, a step's progress line) must not hold detection back.
DEFAULT_SLACK_S = 10.0


class Watermark:
    """The newest event time read, and how old the last record was when it was read.

    Behind means the last record read was older than `slack_s` when it was read: the worker is
    reading a backlog. That is judged when each record is read, so a worker starved of CPU for
    a while (no record processed) is still known to be behind, and a quiet input (nothing left
    to read, the last record fresh when read) is not: silence is then judged by the wall clock,
    so a job that hangs alone on a quiet site is still seen."""

    def __init__(self, slack_s: float = DEFAULT_SLACK_S) -> None:
        if slack_s < 0:
            raise ValueError(f"slack_s must be >= 0, got {slack_s}")
        self.slack_s = slack_s
        self.newest: float | None = None
        self._lag_s = 0.0  # age of the last record when it was read

    def see(self, event_time: float, wall: float) -> None:
        self._lag_s = wall - event_time
        if self.newest is None or event_time > self.newest:
            self.newest = event_time

    def judged_now(self, wall: float) -> float:
        """The time to judge silence at: the wall clock, or, while the worker is reading old
        records, the newest signal read + slack."""
        if self.newest is None or self._lag_s <= self.slack_s:
            return wall
        return min(wall, self.newest + self.slack_s)

    def behind_s(self, wall: float) -> float:
        """How far the judged clock is behind the wall clock (0 when the worker is current)."""
        return wall - self.judged_now(wall)


class PartitionClocks:
    """The newest progress read on each partition of job.progress. While the worker is behind
    (its Watermark over every signal says so), a job's silence is judged by its own partition's
    newest progress: topics and partitions drain at uneven speeds in a catch-up (a job's GPU
    samples may be minutes ahead of its progress lines, and a partition may wait its turn
    while others are read), so the shared clock would still run ahead of it.
    While the worker is current, every job is judged by the wall clock."""

    def __init__(self, slack_s: float = DEFAULT_SLACK_S) -> None:
        self.slack_s = slack_s
        self._newest: dict[int, float] = {}

    def see(self, partition: int, event_time: float) -> None:
        if event_time > self._newest.get(partition, float("-inf")):
            self._newest[partition] = event_time

    def judged_now(self, partition: int, wall: float, overall: Watermark) -> float:
        """The time to judge a job of `partition` at."""
        if overall.behind_s(wall) <= 0:
            return wall
        newest = self._newest.get(partition)
        judged = overall.judged_now(wall)
        return judged if newest is None else min(judged, newest + self.slack_s)
