"""The one timestamp reader (schemas.timestamps), on real line prefixes: job logs and kernel lines.

Lines are copied from the fixtures named beside them (sources in their SOURCES.md or label.yaml)
or from the public thread cited inline; lines marked "built" follow the tool's documented format
where no fixture has one (and the New Year case uses stamps built directly).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas.timestamps import (
    PLACEHOLDER_YEAR,
    FileClock,
    Stamp,
    match_prefix,
    match_uptime,
    parse_stamp,
    reference_time,
    resolve_year,
)


def utc(year: int, month: int, day: int, hour: int, minute: int, second: int, us: int = 0) -> float:
    return datetime(year, month, day, hour, minute, second, us, tzinfo=UTC).timestamp()


# --- parse_stamp: a job log's own clock --------------------------------------------------------------


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
        # OpenMPI --timestamp-output: ISO with 'T', millis and 'Z' (corpus dev/ic_ib_local_catastrophic_error).
        (
            "2019-06-02T16:13:44.884Z: [1,12]<stdout>:gpu01:815:864 [0] transport/net_ib.cu:80 NCCL WARN NET/IB",
            utc(2019, 6, 2, 16, 13, 44, us=884000),
        ),
        # TensorFlow's C++ log: space, microseconds (corpus dev/unknown_sigkill_exitcode9).
        (
            "2022-10-27 09:53:44.129836: I tensorflow/stream_executor/platform/default/dso_loader.cc:53]",
            utc(2022, 10, 27, 9, 53, 44, us=129836),
        ),
        # rsyslog RFC 3339, a negative zone (openzfs/zfs#8994).
        ("2019-07-05T02:16:36.434782-04:00 gpu03 kernel: Lustre: 42858:0:", utc(2019, 7, 5, 6, 16, 36, us=434782)),
        # journalctl -o short-iso: '+hhmm' (built, systemd's journalctl(1) format).
        ("2024-05-01T10:00:00+0530 gpu02 kernel: NVRM: Xid", utc(2024, 5, 1, 4, 30, 0)),
        # dmesg -T: ctime with the year (corpus dev/gpu_xid119_gsp_timeout_dmesg).
        (
            "[Sun Apr 26 23:12:26 2026] NVRM: Xid (PCI:0001:6c:00): 119, pid=10200, name=NvmlTaskRunner",
            utc(2026, 4, 26, 23, 12, 26),
        ),
        # US dates of HF/accelerate loggers (built, '%m/%d/%Y %H:%M:%S').
        ("06/16/2025 22:30:48 - INFO - __main__ - Distributed environment: MULTI_GPU", utc(2025, 6, 16, 22, 30, 48)),
        # Epoch seconds at the start of the line (built).
        ("1678060671.123 step 10 loss 2.5", 1678060671.123),
        ("[1678060671] step 10 loss 2.5", 1678060671.0),
    ],
)
def test_dated_forms(line: str, expected: float) -> None:
    stamp = parse_stamp(line)
    assert stamp is not None
    assert stamp.epoch() == pytest.approx(expected)


def test_nine_decimal_digits_and_zones_are_kept() -> None:
    # glog's nanoseconds (tests/fixtures/logs/nccl_watchdog_timeout.log) and a zone's sign.
    s = parse_stamp("2024-05-01T10:00:00.123456789+05:30 gpu02 kernel: NVRM")
    assert s is not None and s.second == pytest.approx(0.123456789) and s.utc_offset_s == 19800
    assert parse_stamp("2023-03-06T03:17:51Z x") == Stamp(3, 6, 3, 17, 51.0, 2023, 0)
    # No zone written: None (the writer's local time); epoch() reads it as UTC unless told otherwise.
    plain = parse_stamp("2016-11-02 15:51:19,011 Node Epoch[0]")
    assert plain is not None and plain.utc_offset_s is None
    assert plain.epoch(utc_offset_s=3600) == pytest.approx(utc(2016, 11, 2, 14, 51, 19, us=11000))


# tests/fixtures/logs/xid79_kern.log (syslog) and tests/fixtures/logs/nccl_watchdog_timeout.log
# (torch's glog prefix behind torchrun's rank prefix, stripped by the job-log producer).
SYSLOG = "Sep 09 15:53:18 gpu01 kernel: nvidia-gpu 0000:10:00.3: can't change power state from D3cold to D0"
GLOG = "[E1229 16:47:25.333820755 ProcessGroupNCCL.cpp:541] [Rank 4] found async exception when checking"
GLOG_UNPADDED = "[E704 13:48:58.260494728 ProcessGroupNCCL.cpp:1746] [PG ID 0 PG GUID 0(default_pg) Rank 2]"


@pytest.mark.parametrize(
    ("line", "month_day_time"),
    [
        (SYSLOG, (9, 9, 15, 53, 18.0)),
        # 'Dec  2', two spaces (tests/fixtures/logs/xid48_kern.log).
        ("Dec  2 11:38:27 gpu02 kernel: [  199.234935] NVRM: GPU 0000:0a:00.0", (12, 2, 11, 38, 27.0)),
        # journalctl -o short-precise (built, journalctl(1)).
        ("Mar 04 19:10:02.123456 gpu01 kernel: NVRM: Xid", (3, 4, 19, 10, 2.123456)),
        # date(1) names a zone before the year: read as a syslog stamp, without the year (built).
        ("Sun Mar  4 19:10:02 UTC 2024 starting", (3, 4, 19, 10, 2.0)),
        # glog, unpadded and padded month; torchelastic's glog without the bracket (corpus
        # dev/unknown_sigkill_exitcode9).
        (GLOG, (12, 29, 16, 47, 25.333820755)),
        (GLOG_UNPADDED, (7, 4, 13, 48, 58.260494728)),
        ("E0813 06:19:49.809000 161210 site-packages/torch/distributed/elastic/", (8, 13, 6, 19, 49.809)),
    ],
)
def test_yearless_forms(line: str, month_day_time: tuple[int, int, int, int, float]) -> None:
    s = parse_stamp(line)
    assert s is not None and s.year is None and s.epoch() is None
    assert (s.month, s.day, s.hour, s.minute) == month_day_time[:4]
    assert s.second == pytest.approx(month_day_time[4])


@pytest.mark.parametrize(
    "line",
    [
        # Lines of the corpus (dev) and fixtures without a wall clock.
        " iteration    33240/  311541 | consumed samples:     15019344 | elapsed time per iteration (ms): 23491.4",
        "epoch: 3451 loss: nan",
        "  successfully saved checkpoint at iteration   33241 to /gpfsscratch/rech/six/commun/checkpoints/tr1-13B",
        # The kernel's uptime counts from boot: no wall clock (tests/fixtures/logs/kernel_hung_lustre.log).
        "[ 3600.832490] INFO: task ll_cfg_requeue:4037 blocked for more than 120 seconds.",
        # Fields out of range, a zone no clock has, digits that are not ASCII (built).
        "2024-13-01 10:00:00 x",
        "Dec 32 15:43:14 gpu01 kernel: x",
        "2024-05-01T10:00:00+2400 x",
        "\u0662\u0660\u0662\u0663-\u0660\u0663-\u0660\u0666 \u0660\u0663:\u0661\u0667:\u0665\u0661 x",
    ],
)
def test_lines_without_a_wall_clock(line: str) -> None:
    assert parse_stamp(line) is None


def test_megatron_print_datetime_is_read_past_its_label() -> None:
    # tests/fixtures/corpus/dev/hang_megatron_bridge_exit_hang_time_limit: the stamp starts at character 35,
    # after a label of any length; the same stamp further into an ordinary line is not read.
    stamp = parse_stamp("[after training is done] datetime: 2025-12-03 14:45:03")
    assert stamp == Stamp(month=12, day=3, hour=14, minute=45, second=3.0, year=2025)
    assert parse_stamp("x " * 15 + "] datetime: 2025-12-03 14:45:03") is None


def test_a_stamp_past_the_search_window_is_not_read() -> None:
    # SEARCH_CHARS (48): a stamp must end within the first 48 characters.
    assert parse_stamp("x " * 15 + "2023-03-06 03:17:51 INFO x") is None
    assert parse_stamp("x " * 14 + "2023-03-06 03:17:51 INFO x") is not None


# --- Stamp.epoch ------------------------------------------------------------------------------------


def test_epoch_takes_the_year_and_zone_it_is_given_and_refuses_missing_dates() -> None:
    s = Stamp(month=8, day=26, hour=22, minute=5, second=6.0)
    assert s.epoch() is None
    assert s.epoch(year=2014) == datetime(2014, 8, 26, 22, 5, 6, tzinfo=UTC).timestamp()
    assert Stamp(month=2, day=29, hour=0, minute=0, second=0.0).epoch(year=2023) is None
    assert Stamp(month=2, day=29, hour=0, minute=0, second=0.0).epoch(year=2024) == utc(2024, 2, 29, 0, 0, 0)
    assert Stamp(2, 30, 10, 0, 0.0, 2024).epoch() is None
    # A leap second is the next minute's first second.
    assert Stamp(12, 31, 23, 59, 60.0, 2016, 0).epoch() == utc(2017, 1, 1, 0, 0, 0)
    # A written zone wins over the one supplied.
    assert Stamp(1, 1, 0, 0, 0.0, 2024, 3600).epoch(utc_offset_s=-7200) == utc(2023, 12, 31, 23, 0, 0)


# --- match_prefix / match_uptime: the kernel line's prefix ---------------------------------------------


def test_prefix_forms_their_end_and_the_uptime_after_them() -> None:
    line = "Dec  2 11:38:27 gpu02 kernel: [  199.234935] NVRM: GPU 0000:0a:00.0"  # xid48_kern.log
    at = match_prefix(line)
    assert at is not None and at.form == "syslog" and line[at.end :].startswith("gpu02 kernel:")
    assert at.stamp == Stamp(12, 2, 11, 38, 27.0)
    assert match_uptime(line, len("Dec  2 11:38:27 gpu02 kernel: ")) == (
        199.234935,
        len(line) - len("NVRM: GPU 0000:0a:00.0"),
    )
    # cloud-hypervisor/cloud-hypervisor#8284 (journal / rsyslog RFC 3339)
    iso = "2026-05-28T12:21:57.303295+00:00 vm-1 kernel:  ret_from_fork+0x44/0x70"
    at = match_prefix(iso)
    assert at is not None and at.form == "iso" and iso[at.end :].startswith("vm-1 kernel:")
    assert at.stamp is not None and at.stamp.epoch() == utc(2026, 5, 28, 12, 21, 57, us=303295)
    # leptonai/gpud PR #870 (dmesg -x --time-format iso), after dmesg -x's facility.
    dx = "syslog:err   : 2025-05-27T04:18:56,089671+00:00 NVRM: Xid (PCI:0000:04:00): 79"
    at = match_prefix(dx, len("syslog:err   : "))
    assert at is not None and at.stamp is not None and dx[at.end :].startswith("NVRM: Xid")
    assert at.stamp.epoch() == utc(2025, 5, 27, 4, 18, 56, us=89671)
    # dmesg -T (corpus dev/gpu_xid119_gsp_timeout_dmesg)
    t = "[Sun Apr 26 23:12:26 2026] NVRM: Xid (PCI:0001:6c:00): 119"
    at = match_prefix(t)
    assert at is not None and at.form == "dmesg_t" and t[at.end :].startswith("NVRM:")
    assert at.stamp == Stamp(month=4, day=26, hour=23, minute=12, second=26.0, year=2026)
    # dmesg uptime alone (tests/fixtures/logs/kernel_hung_lustre.log): no wall-clock prefix.
    up = "[ 3600.832490] INFO: task ll_cfg_requeue:4037 blocked for more than 120 seconds."
    assert match_prefix(up) is None and match_uptime(up) == (3600.832490, len("[ 3600.832490] "))


def test_prefix_is_anchored_and_names_a_shape_without_a_time() -> None:
    assert match_prefix("kernel: Mar  3 12:00:00 gpu02") is None
    # A logger's space-separated ISO stamp is no syslog / journal / dmesg prefix (no host after it).
    assert match_prefix("2016-11-02 15:51:19,011 Node Epoch[0]") is None
    # Hour 25: the prefix's shape (so the host after it is still found), no time.
    at = match_prefix("Dec  7 25:43:14 gpu01 kernel: NVRM")
    assert at is not None and at.stamp is None and at.end == len("Dec  7 25:43:14 ")


# --- the year of yearless stamps -------------------------------------------------------------------


def test_yearless_forms_take_the_year_of_the_dated_lines() -> None:
    syslog, glog = parse_stamp(SYSLOG), parse_stamp(GLOG)
    assert syslog is not None and glog is not None
    dated = parse_stamp("[2022-05-01 03:56:11] PULSE: tr11-176B-ml is waiting to be scheduled")
    assert dated is not None
    ref = reference_time([dated, syslog])
    assert ref == dated.epoch()
    # The year that puts Sep 09 nearest to May 2022: 2022 (131 days after), not 2021 (234 before).
    assert resolve_year(syslog, ref) == 2022
    # A late-December stamp next to dated lines of the first days of January is from the year before.
    assert resolve_year(glog, utc(2024, 1, 1, 0, 0, 5)) == 2023
    # dmesg -T stamps are dated lines too.
    ctime = parse_stamp("[Sun Apr 26 23:12:26 2026] NVRM: Xid (PCI:0001:6c:00): 119")
    assert ctime is not None and reference_time([ctime, syslog]) == utc(2026, 4, 26, 23, 12, 26)


def test_no_dated_line_keeps_order_with_a_placeholder_year_and_crosses_new_year() -> None:
    clock = FileClock(reference=None)
    december = Stamp(month=12, day=31, hour=23, minute=59, second=58.0)
    january = Stamp(month=1, day=1, hour=0, minute=0, second=3.0)
    ta, tb = clock.time_of(december), clock.time_of(january)
    assert ta is not None and tb is not None
    assert datetime.fromtimestamp(ta, UTC).year == PLACEHOLDER_YEAR
    assert tb - ta == pytest.approx(5.0)


def test_file_clock_reads_dated_and_epoch_stamps_as_written() -> None:
    clock = FileClock(reference=None)
    assert clock.time_of(None) is None
    assert clock.time_of(parse_stamp("1678060671.5 x")) == 1678060671.5
    assert clock.time_of(parse_stamp("2019-07-05T02:16:36-04:00 x")) == utc(2019, 7, 5, 6, 16, 36)
    # A yearless Feb 29 lands in a leap year.
    leap = FileClock(reference=utc(2023, 3, 1, 0, 0, 0))
    t = leap.time_of(Stamp(month=2, day=29, hour=0, minute=0, second=0.0))
    assert t == utc(2024, 2, 29, 0, 0, 0)
