"""The one reader of the timestamps that log and kernel lines start with, as the usual tools write them.

A pure parsing helper (no I/O, no project imports), on the shared floor like `schemas.yamlsafe`:
the kernel producer (`producers/kernel.py`) and the offline log clock of `trainmedic diagnose`
both read stamps through it, and producers may not import streams (nor streams producers).

Forms (ASCII digits only; each names month, day and time of day, most also the year):

- ISO 8601 / RFC 3339 and Python logging, with ``T`` or a space, ``.`` or ``,`` decimals (up to 9
  digits) and an optional ``Z`` / ``+hh:mm`` / ``+hhmm`` zone: ``2023-03-06T03:17:51``,
  ``2016-11-02 15:51:19,011``, ``[2022-03-21 13:34:34]``, ``2019-07-05T02:16:36.434782-04:00``
  (journalctl ``-o short-iso`` / ``short-iso-precise``, rsyslog, ``dmesg --time-format iso``);
- ``dmesg -T`` and C's ctime: ``[Mon Dec  7 15:43:14 2026]``, weekday, month, day, time, year;
- syslog (RFC 3164) and journalctl ``short`` / ``short-precise``: ``Mar  4 19:10:02``,
  ``Mar 04 19:10:02.123456``: **no year**;
- glog (torch's C++ log) ``[W501 10:00:00.123456``: month and day, **no year**;
- US dates of HF/accelerate loggers: ``06/16/2025 22:30:48``;
- epoch seconds ``1678060671.123`` (10 digits, at the start of the line; journalctl ``-o short-unix``);
- ``dmesg -H`` / ``--reltime`` (util-linux 2.38 sys-utils/dmesg.c, print_record and short_ctime):
  ``[Dec 7 12:00]`` (strftime ``%b%e %H:%M``, so ``[Dec12 12:00]`` from the 10th: minutes, **no year**)
  on the first line of a minute, then ``[  +0.000123]`` deltas (``"[  %+8.06f] "``), no wall clock;
- the kernel's monotonic ``[  219.470994]`` (seconds since boot, not a wall clock): `match_uptime`;
  also what journalctl ``-o short-monotonic`` writes first.

Two ways to read, one set of patterns and one conversion:

- `parse_stamp`: a job log's stamp, searched near the start of the line, behind whatever prefix a
  logger puts first (``[titan] 2025-06-16 22:30:50,322``); every form above but the uptime.
- `match_prefix`: the stamp a syslog, journal or dmesg writer puts exactly at a position (the
  start of a kernel line, after dmesg -x's facility), with where it ends and its form, so the
  kernel producer reads the host (syslog, ISO) and the uptime after it.

A stamp without a zone has `utc_offset_s` None; `Stamp.epoch()` then reads it in the offset it is
given (UTC by default). Yearless stamps take a year from the caller (`Stamp.epoch(year=...)`) or,
offline, from the other stamps of the same files (`reference_time`, `resolve_year`, `FileClock`).

Why no date library: the work is finding a stamp in free text at the speed of every log line.
python-dateutil's fuzzy parser takes 80-100 us a line and refuses these lines; its `isoparse` and
`datetime.fromisoformat` convert only an ISO span the regex has already found (whose digit groups
convert directly), and `fromisoformat` refuses the leap second ``23:59:60``.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

# Where a job log's timestamp may sit: loggers put short prefixes first ('[titan] ', 'INFO ', 'host:').
SEARCH_CHARS = 48
# Yearless stamps with no dated line anywhere get this year: its only job is to keep order.
PLACEHOLDER_YEAR = 2000
MONTHS = {m: i for i, m in enumerate(calendar.month_abbr) if m}

_MON = "|".join(MONTHS)
_DOW = "Mon|Tue|Wed|Thu|Fri|Sat|Sun"
_HMS = r"(?P<h>[0-9]{2}):(?P<mi>[0-9]{2}):(?P<s>[0-9]{2})"


def _iso(sep: str) -> str:
    """ISO 8601 with `sep` between date and time: 'T', or '[T ]' to read a space too (Python logging)."""
    return (
        rf"(?<![0-9])(?P<y>[0-9]{{4}})-(?P<mo>[0-9]{{2}})-(?P<d>[0-9]{{2}}){sep}{_HMS}"
        r"(?:[.,](?P<frac>[0-9]{1,9}))?(?P<tz>Z|[+-][0-9]{2}:?[0-9]{2}(?![0-9]))?"
    )


# Syslog's 'Mar  4 19:10:02', journald's 'Mar 04 19:10:02.123456'; 'Mar 4' too.
_SYSLOG = rf"(?P<mon>{_MON}) {{1,2}}(?P<d>[0-9]{{1,2}}) {_HMS}(?:\.(?P<frac>[0-9]{{1,9}}))?"
# dmesg -T / ctime: the syslog form between a weekday and the year.
_CTIME = rf"(?P<dow>{_DOW}) {_SYSLOG} (?P<y>[0-9]{{4}})"

# parse_stamp's searches, in the order tried. A syslog stamp after a weekday and before a year is
# ctime (dmesg -T): it has the year. 'Sun Mar  4 19:10:02 UTC 2024' (date(1)) is a yearless syslog one.
_SEARCH_ISO = re.compile(_iso("[T ]"))
_SEARCH_US = re.compile(
    rf"(?<![0-9])(?P<mo>[0-9]{{2}})/(?P<d>[0-9]{{2}})/(?P<y>[0-9]{{4}}) {_HMS}(?:[.,](?P<frac>[0-9]{{1,9}}))?"
)
_SEARCH_SYSLOG = re.compile(rf"(?<![A-Za-z])(?:(?P<dow>{_DOW}) )?{_SYSLOG}(?(dow) (?P<y>[0-9]{{4}}))(?![0-9])")
# glog as torch's c10 writes it: level letter, month (unpadded or padded) and day: 'W501', 'I1207'.
_GLOG = re.compile(rf"\[?[IWEF](?P<mo>[0-9]{{1,2}})(?P<d>[0-9]{{2}}) {_HMS}(?:\.(?P<frac>[0-9]{{1,9}}))?(?![0-9])")
_EPOCH = re.compile(r"\[?(?P<sec>1[0-9]{9})(?:\.(?P<frac>[0-9]{1,9}))?\]?(?![0-9-])")
# Slurm's own end-of-step line puts its ISO time mid-line.
_SLURM_AT = re.compile(r"\b(?:CANCELLED|FAILED|PREEMPTED) AT (?=[0-9]{4}-[0-9]{2}-[0-9]{2}T)")
# Megatron's print_datetime: '[after training is done] datetime: 2025-12-03 14:45:03' (its label can
# push the stamp past SEARCH_CHARS; megatron/training/training.py, print_datetime).
_MEGATRON_DATETIME = re.compile(r"^\[[^\]]{1,80}\] datetime: (?=[0-9]{4}-[0-9]{2}-[0-9]{2} )")

# match_prefix's forms, anchored, with the separator a writer puts after them. Syslog, journald
# and dmesg write ISO stamps with a 'T': a line starting '2024-05-01 10:00:00,123 ' is some
# program's logger, whose next word is no host.
PrefixForm = Literal["syslog", "iso", "dmesg_t", "dmesg_h", "dmesg_delta", "epoch"]
_PREFIXES: tuple[tuple[PrefixForm, re.Pattern[str]], ...] = (
    ("syslog", re.compile(rf"{_SYSLOG}\s+")),
    ("iso", re.compile(_iso("T") + r"\s+")),
    ("dmesg_t", re.compile(rf"\[{_CTIME}\]\s?")),
    # dmesg -H's "%b%e %H:%M": the day space-padded, so no space at all from the 10th on.
    ("dmesg_h", re.compile(rf"\[(?P<mon>{_MON}) ?(?P<d>[0-9]{{1,2}}) (?P<h>[0-9]{{2}}):(?P<mi>[0-9]{{2}})\]\s?")),
    # dmesg -H's delta from the line before: a shape with no time of its own (stamp None).
    ("dmesg_delta", re.compile(r"\[\s*[+-][0-9]+\.[0-9]{6}\]\s?")),
    # journalctl -o short-unix: "1678060671.123456 host kernel: ...".
    ("epoch", re.compile(r"(?P<sec>1[0-9]{9})\.(?P<frac>[0-9]{1,9})\s+")),
)
_UPTIME = re.compile(r"\[\s*(?P<up>[0-9]{1,10}\.[0-9]{1,9})\]\s?")


@dataclass(frozen=True, slots=True)
class Stamp:
    """A timestamp as the line wrote it.

    `year` is None for the syslog and glog forms; `utc_offset_s` is None when the line names no
    zone (syslog, dmesg -T and zoneless ISO stamps are the writer's local time, whatever that was).
    `epoch_s` is set for epoch-seconds stamps, whose other fields are then unused.
    """

    month: int
    day: int
    hour: int
    minute: int
    second: float
    year: int | None = None
    utc_offset_s: int | None = None
    epoch_s: float | None = None

    def epoch(self, year: int | None = None, utc_offset_s: int = 0) -> float | None:
        """Seconds since the epoch; `year` for a stamp without one, `utc_offset_s` for one without a
        zone. None when no year is known or the date does not exist (Feb 30, Feb 29 in a common year)."""
        if self.epoch_s is not None:
            return self.epoch_s
        y = self.year if self.year is not None else year
        if y is None:
            return None
        offset = self.utc_offset_s if self.utc_offset_s is not None else utc_offset_s
        try:
            base = datetime(y, self.month, self.day, self.hour, self.minute, tzinfo=UTC)
        except ValueError:
            return None
        return (base + timedelta(seconds=self.second - offset)).timestamp()


@dataclass(frozen=True, slots=True)
class PrefixStamp:
    """What `match_prefix` read: the stamp (None when the text has a stamp's shape but names no
    time, such as hour 25), the position after it and its separator, and its form."""

    stamp: Stamp | None
    end: int
    form: PrefixForm


def _zone(text: str) -> int | None:
    """'Z', '+05:30', '-0400' -> seconds east of UTC; None for an offset no clock has (+24:00)."""
    if text == "Z":
        return 0
    digits = text[1:].replace(":", "")
    h, m = int(digits[:2]), int(digits[2:])
    if h > 23 or m > 59:
        return None
    return (-1 if text[0] == "-" else 1) * (h * 3600 + m * 60)


def _stamp(m: re.Match[str]) -> Stamp | None:
    """The stamp a form's match names; None when a field is out of range."""
    g = m.groupdict()
    if g.get("sec") is not None:
        frac = g.get("frac")
        return Stamp(1, 1, 0, 0, 0.0, epoch_s=int(g["sec"]) + (float(f"0.{frac}") if frac else 0.0))
    if "h" not in g:
        return None  # a form that names no time of its own (dmesg -H's delta)
    mon = g.get("mon")
    mo = MONTHS[mon] if mon else int(g["mo"])
    # dmesg -H's date names no seconds.
    d, h, mi, s = int(g["d"]), int(g["h"]), int(g["mi"]), int(g["s"]) if g.get("s") else 0
    if not (1 <= mo <= 12 and 1 <= d <= 31 and h <= 23 and mi <= 59 and s <= 60):  # 60: a leap second
        return None
    tz = g.get("tz")
    offset = None
    if tz is not None:
        offset = _zone(tz)
        if offset is None:
            return None
    frac, y = g.get("frac"), g.get("y")
    second = s + float(f"0.{frac}") if frac else float(s)
    return Stamp(mo, d, h, mi, second, int(y) if y else None, offset)


def parse_stamp(line: str) -> Stamp | None:
    """The timestamp near the start of a log line (the first `SEARCH_CHARS` characters), or None.

    Slurm's "CANCELLED AT <ISO>" step line and Megatron's "[label] datetime: <date time>" line are
    read at their stamp. Kernel uptime stamps are no wall
    clock and not read here (`match_uptime`)."""
    head = line[:SEARCH_CHARS]
    at = _SLURM_AT.search(line) or _MEGATRON_DATETIME.match(line)
    if at is not None:
        head = line[at.end() : at.end() + SEARCH_CHARS]
    m = _EPOCH.match(head)
    if m:
        frac = m.group("frac")
        return Stamp(1, 1, 0, 0, 0.0, epoch_s=int(m.group("sec")) + (float(f"0.{frac}") if frac else 0.0))
    for rx in (_SEARCH_ISO, _SEARCH_US):
        m = rx.search(head)
        if m:
            stamp = _stamp(m)
            if stamp is not None:
                return stamp
    m = _GLOG.match(head) or _SEARCH_SYSLOG.search(head)
    return _stamp(m) if m else None


def match_prefix(line: str, pos: int = 0) -> PrefixStamp | None:
    """A syslog / journald short, ISO 8601, dmesg -T or -H, or epoch-seconds stamp starting exactly
    at `pos`, with the whitespace after it; None when none starts there. dmesg -H's delta form
    ``[  +0.000123]`` is matched with stamp None: it dates nothing by itself."""
    for form, rx in _PREFIXES:
        m = rx.match(line, pos)
        if m:
            return PrefixStamp(_stamp(m), m.end(), form)
    return None


def match_uptime(line: str, pos: int = 0) -> tuple[float, int] | None:
    """The kernel's monotonic stamp ``[  219.470994]`` (seconds since boot) starting at `pos`, and
    the position after it and one space; None when none starts there."""
    m = _UPTIME.match(line, pos)
    return (float(m.group("up")), m.end()) if m else None


def reference_time(stamps: list[Stamp]) -> float | None:
    """The median of the dated stamps: where yearless stamps should land near."""
    dated = sorted(t for t in (s.epoch() for s in stamps) if t is not None)
    return dated[len(dated) // 2] if dated else None


def resolve_year(stamp: Stamp, reference: float | None) -> int:
    """The year for a yearless stamp: the one that puts it nearest to `reference`."""
    if reference is None:
        return PLACEHOLDER_YEAR
    ref_year = datetime.fromtimestamp(reference, UTC).year
    best, best_gap = ref_year, float("inf")
    for year in (ref_year - 1, ref_year, ref_year + 1):
        t = stamp.epoch(year=year)
        if t is not None and abs(t - reference) < best_gap:
            best, best_gap = year, abs(t - reference)
    return best


class FileClock:
    """Times for the lines of one file, in order: each stamp resolved (a zoneless one as UTC: what
    matters offline is the order and the gaps between lines, and the files of one job are written
    on one cluster), yearless ones given a year (and the next year when the month goes backwards
    within the file: a December-to-January log). With no dated line at all they keep
    `PLACEHOLDER_YEAR`, so their order and gaps among themselves stay right. Lines without a stamp
    are given None; the caller places them by line order."""

    def __init__(self, reference: float | None) -> None:
        self.reference = reference
        self._year: int | None = None
        self._last_month: int | None = None

    def time_of(self, stamp: Stamp | None) -> float | None:
        if stamp is None:
            return None
        if stamp.year is not None or stamp.epoch_s is not None:
            return stamp.epoch()
        if self._year is None:
            self._year = resolve_year(stamp, self.reference)
        elif self._last_month is not None and stamp.month < self._last_month - 6:
            self._year += 1  # the log crossed New Year
        self._last_month = stamp.month
        t = stamp.epoch(year=self._year)
        if t is None:  # Feb 29 in a non-leap year: the year guess was wrong, try the next leap one
            t = stamp.epoch(year=self._year + (4 - self._year % 4))
        return t
