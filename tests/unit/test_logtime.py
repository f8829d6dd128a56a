"""Timestamps written in log lines as diagnose reads them (schemas.timestamps, the one reader the
kernel producer shares; tests/unit/test_timestamps.py covers every form). These ids are kept:
tests/ids-before.txt lists them.

Every line is copied from the fixtures named beside it (sources in their SOURCES.md or label.yaml)
or from the public thread cited inline; the New Year case uses stamps built directly.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas.timestamps import (
    PLACEHOLDER_YEAR,
    FileClock,
    parse_stamp,
    reference_time,
    resolve_year,
)
from schemas.timestamps import Stamp as RawStamp


def utc(year: int, month: int, day: int, hour: int, minute: int, second: int, us: int = 0) -> float:
    return datetime(year, month, day, hour, minute, second, us, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # Python logging, comma millis (apache/mxnet#3695).
        (
            "2016-11-02 15:51:19,011 Node Epoch[0] Batch [50]\tSpeed: 2017.78 samples/sec",
            utc(2016, 11, 2, 15, 51, 19, us=11000),
        ),
        # torchtitan behind its logger prefix (pytorch/torchtitan#1287, rank prefix already stripped).
        (
            "[titan] 2025-06-16 22:30:50,322 - root - INFO - step: 200  loss:  6.1384",
            utc(2025, 6, 16, 22, 30, 50, us=322000),
        ),
        # Bracketed (corpus dev/hang_bloom_eval_stuck_no_timeout).
        ("[2022-05-01 03:56:11] PULSE: tr11-176B-ml is waiting to be scheduled", utc(2022, 5, 1, 3, 56, 11)),
        # Slurm's step line puts its ISO time mid-line (corpus dev/node_failure_during_validation).
        (
            "slurmstepd: error: *** STEP 1943824.0 ON gpu01 CANCELLED AT 2023-03-06T03:17:51 DUE TO NODE FAILURE",
            utc(2023, 3, 6, 3, 17, 51),
        ),
    ],
)
def test_dated_forms(line: str, expected: float) -> None:
    stamp = parse_stamp(line)
    assert stamp is not None
    assert stamp.epoch() == pytest.approx(expected)


# tests/fixtures/logs/xid79_kern.log (syslog) and tests/fixtures/logs/nccl_watchdog_timeout.log
# (torch's glog prefix behind torchrun's rank prefix, stripped by the job-log producer).
SYSLOG = "Sep 09 15:53:18 gpu01 kernel: nvidia-gpu 0000:10:00.3: can't change power state from D3cold to D0"
GLOG = "[E1229 16:47:25.333820755 ProcessGroupNCCL.cpp:541] [Rank 4] found async exception when checking"
GLOG_UNPADDED = "[E704 13:48:58.260494728 ProcessGroupNCCL.cpp:1746] [PG ID 0 PG GUID 0(default_pg) Rank 2]"


def test_yearless_forms_take_the_year_of_the_dated_lines() -> None:
    syslog, glog, unpadded = parse_stamp(SYSLOG), parse_stamp(GLOG), parse_stamp(GLOG_UNPADDED)
    assert syslog is not None and syslog.year is None and syslog.epoch() is None
    assert glog is not None and (glog.month, glog.day, glog.hour, glog.minute) == (12, 29, 16, 47)
    assert glog.second == pytest.approx(25.333820755)
    assert unpadded is not None and (unpadded.month, unpadded.day) == (7, 4)
    dated = parse_stamp("[2022-05-01 03:56:11] PULSE: tr11-176B-ml is waiting to be scheduled")
    assert dated is not None
    ref = reference_time([dated, syslog])
    assert ref == dated.epoch()
    # The year that puts Sep 09 nearest to May 2022: 2022 (131 days after), not 2021 (234 before).
    assert resolve_year(syslog, ref) == 2022
    # A late-December stamp next to dated lines of the first days of January is from the year before.
    assert resolve_year(glog, utc(2024, 1, 1, 0, 0, 5)) == 2023


def test_no_dated_line_keeps_order_with_a_placeholder_year_and_crosses_new_year() -> None:
    clock = FileClock(reference=None)
    december = RawStamp(month=12, day=31, hour=23, minute=59, second=58.0)
    january = RawStamp(month=1, day=1, hour=0, minute=0, second=3.0)
    ta, tb = clock.time_of(december), clock.time_of(january)
    assert ta is not None and tb is not None
    assert datetime.fromtimestamp(ta, UTC).year == PLACEHOLDER_YEAR
    assert tb - ta == pytest.approx(5.0)


@pytest.mark.parametrize(
    "line",
    [
        # Lines of the corpus (dev) and fixtures without a wall clock.
        " iteration    33240/  311541 | consumed samples:     15019344 | elapsed time per iteration (ms): 23491.4",
        "epoch: 3451 loss: nan",
        "  successfully saved checkpoint at iteration   33241 to /gpfsscratch/rech/six/commun/checkpoints/tr1-13B",
    ],
)
def test_lines_without_a_wall_clock(line: str) -> None:
    assert parse_stamp(line) is None
