"""Timestamps written in log lines, as the usual tools write them, turned into epoch seconds.

Offline there is no arrival time: a line's own timestamp is the best clock there is, and line
order the fallback. Forms understood (searched near the start of the line, after any rank
prefix, because loggers put their own prefixes first: ``[titan] 2025-06-16 22:30:50,322``):

- ISO 8601 and Python logging: ``2023-03-06T03:17:51``, ``2016-11-02 15:51:19,011``,
  ``[2022-03-21 13:34:34]``, ``2016-07-23 14:34:15.784645``, with an optional ``Z`` or offset;
- US dates of HF/accelerate loggers: ``06/16/2025 22:30:48``;
- syslog / journal ``Mar  4 19:10:02`` and glog (torch's C++ log) ``[W501 10:00:00.123456``:
  month and day, **no year**;
- epoch seconds ``1678060671.123`` (10 digits, at the start of the line).

A time without a zone is read as UTC: what matters offline is the order and the gaps between
lines, and the files of one job are written on one cluster.

Yearless stamps take their year from the other stamps of the same files (`resolve_year`): the
year that puts them nearest to the dated lines. With no dated line at all they keep a
placeholder year, so their order and gaps among themselves stay right; a file whose month goes
backwards (December to January) moves to the next year.

Kernel uptime stamps (``[ 1234.567890]``) count from the node's boot, not a wall clock: they
are not read here.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

# Where a timestamp may sit: loggers put short prefixes first ('[titan] ', 'INFO ', 'host:').
SEARCH_CHARS = 48
# Yearless stamps with no dated line anywhere get this year: its only job is to keep order.
PLACEHOLDER_YEAR = 2000
MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m}

_ISO = re.compile(
    r"(?<!\d)(?P<y>\d{4})-(?P<mo>\d{2})-(?P<d>\d{2})[T ](?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})"
    r"(?:[.,](?P<frac>\d{1,9}))?(?P<tz>Z|[+-]\d{2}:?\d{2}(?!\d))?"
)
_US = re.compile(
    r"(?<!\d)(?P<mo>\d{2})/(?P<d>\d{2})/(?P<y>\d{4}) (?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})(?:[.,](?P<frac>\d{1,9}))?"
)
_SYSLOG = re.compile(
    r"(?<![A-Za-z])(?P<mon>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) {1,2}(?P<d>\d{1,2}) "
    r"(?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})(?:\.(?P<frac>\d{1,9}))?(?!\d)"
)
# glog as torch's c10 writes it: level letter, month (unpadded or padded) and day: 'W501', 'I1207'.
_GLOG = re.compile(
    r"^\[?[IWEF](?P<mo>\d{1,2})(?P<d>\d{2}) (?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})(?:\.(?P<frac>\d{1,9}))?(?!\d)"
)
# Slurm's own end-of-step line puts its ISO time mid-line.
_SLURM_AT = re.compile(r"\b(?:CANCELLED|FAILED|PREEMPTED) AT (?=\d{4}-\d{2}-\d{2}T)")
_EPOCH = re.compile(r"^\[?(?P<sec>1\d{9})(?:\.(?P<frac>\d{1,9}))?\]?(?![\d-])")


@dataclass(frozen=True)
class RawStamp:
    """A timestamp as the line wrote it; `year` is None for syslog and glog forms."""

    month: int
    day: int
    hour: int
    minute: int
    second: float
    year: int | None = None
    offset_s: float = 0.0  # the stamp's zone offset from UTC
    epoch: float | None = None  # set for epoch-seconds stamps (all else unused then)

    def at_year(self, year: int) -> float | None:
        """Epoch seconds with this year; None when the date does not exist (Feb 29)."""
        if self.epoch is not None:
            return self.epoch
        try:
            dt = datetime(year, self.month, self.day, self.hour, self.minute, tzinfo=UTC)
        except ValueError:
            return None
        return (dt + timedelta(seconds=self.second - self.offset_s)).timestamp()

    def resolved(self) -> float | None:
        """Epoch seconds when the stamp says its year (or is epoch seconds); None otherwise."""
        if self.epoch is not None:
            return self.epoch
        return self.at_year(self.year) if self.year is not None else None


def _frac(text: str | None) -> float:
    return float(f"0.{text}") if text else 0.0


def _tz(text: str | None) -> float:
    if not text or text == "Z":
        return 0.0
    sign = -1.0 if text[0] == "-" else 1.0
    digits = text[1:].replace(":", "")
    return sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)


def _valid(mo: int, d: int, h: int, mi: int, s: int) -> bool:
    return 1 <= mo <= 12 and 1 <= d <= 31 and h <= 23 and mi <= 59 and s <= 60


def parse_stamp(text: str) -> RawStamp | None:
    """The timestamp near the start of a log line, or None."""
    head = text[:SEARCH_CHARS]
    at = _SLURM_AT.search(text)
    if at is not None:
        head = text[at.end() : at.end() + SEARCH_CHARS]
    m = _EPOCH.match(head)
    if m:
        return RawStamp(1, 1, 0, 0, 0.0, epoch=int(m.group("sec")) + _frac(m.group("frac")))
    for rx in (_ISO, _US):
        m = rx.search(head)
        if m:
            y, mo, d = int(m.group("y")), int(m.group("mo")), int(m.group("d"))
            h, mi, s = int(m.group("h")), int(m.group("mi")), int(m.group("s"))
            if not _valid(mo, d, h, mi, s):
                continue
            tz = m.groupdict().get("tz")
            return RawStamp(mo, d, h, mi, s + _frac(m.group("frac")), year=y, offset_s=_tz(tz))
    m = _GLOG.match(head)
    if m is None:
        m = _SYSLOG.search(head)
    if m is None:
        return None
    mo = MONTHS[m.group("mon").lower()] if "mon" in m.groupdict() else int(m.group("mo"))
    d, h, mi, s = int(m.group("d")), int(m.group("h")), int(m.group("mi")), int(m.group("s"))
    if not _valid(mo, d, h, mi, s):
        return None
    return RawStamp(mo, d, h, mi, s + _frac(m.group("frac")))


def reference_time(stamps: list[RawStamp]) -> float | None:
    """The median of the dated stamps: where yearless stamps should land near."""
    dated = sorted(t for t in (s.resolved() for s in stamps) if t is not None)
    return dated[len(dated) // 2] if dated else None


def resolve_year(stamp: RawStamp, reference: float | None) -> int:
    """The year for a yearless stamp: the one that puts it nearest to `reference`."""
    if reference is None:
        return PLACEHOLDER_YEAR
    ref_year = datetime.fromtimestamp(reference, UTC).year
    best, best_gap = ref_year, float("inf")
    for year in (ref_year - 1, ref_year, ref_year + 1):
        t = stamp.at_year(year)
        if t is not None and abs(t - reference) < best_gap:
            best, best_gap = year, abs(t - reference)
    return best


class FileClock:
    """Times for the lines of one file, in order: each stamp resolved, yearless ones given a year
    (and the next year when the month goes backwards within the file: a December-to-January
    log). Lines without a stamp are given None; the caller places them by line order."""

    def __init__(self, reference: float | None) -> None:
        self.reference = reference
        self._year: int | None = None
        self._last_month: int | None = None

    def time_of(self, stamp: RawStamp | None) -> float | None:
        if stamp is None:
            return None
        if stamp.year is not None or stamp.epoch is not None:
            return stamp.resolved()
        if self._year is None:
            self._year = resolve_year(stamp, self.reference)
        elif self._last_month is not None and stamp.month < self._last_month - 6:
            self._year += 1  # the log crossed New Year
        self._last_month = stamp.month
        t = stamp.at_year(self._year)
        if t is None:  # Feb 29 in a non-leap year: the year guess was wrong, try the next leap one
            t = stamp.at_year(self._year + (4 - self._year % 4))
        return t
