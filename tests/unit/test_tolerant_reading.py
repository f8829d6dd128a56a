"""Tolerant reading of kernel and driver messages (issue 42, deliverable 2): a kernel line is found with
its node and time wherever a collector put it, multi-line driver messages are one message, and every
stamp is read by schemas.timestamps. Each framing is built from its writer's documented format (cited
beside the parser in producers/kernel.py and schemas/timestamps.py); the messages inside are the
emitters' own format strings filled in (NVRM Xid: kernel_rc.c; AER: drivers/pci/pcie/aer.c; hung task:
kernel/hung_task.c)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producers.kernel import join_continuations, parse_kernel_line, split_prefix
from schemas.timestamps import FileClock, Stamp, match_prefix, parse_stamp
from trainmedic.ops.diagnose import diagnose_paths

XID = "NVRM: Xid (PCI:0000:10:00): 79, pid=0, name=python3, GPU has fallen off the bus."
AER = "pcieport 0000:00:03.1: PCIe Bus Error: severity=Uncorrectable (Fatal), type=Transaction Layer, (Receiver ID)"
HUNG = "INFO: task python3:4242 blocked for more than 120 seconds."
# 2026-12-07 12:00:00.123456 UTC
T0 = datetime(2026, 12, 7, 12, 0, 0, 123456, tzinfo=UTC).timestamp()
JOB = "step 10 | loss 2.31\nstep 20 | loss 2.29\n"


def _journal_json(msg: str) -> str:
    return orjson.dumps({"MESSAGE": msg, "_HOSTNAME": "gpu03", "__REALTIME_TIMESTAMP": "1796644800123456"}).decode()


def _docker_json(msg: str) -> str:
    return orjson.dumps(
        {"log": f"Dec 07 12:00:00 gpu03 kernel: {msg}\n", "stream": "stderr", "time": "2026-12-07T12:00:00.123456Z"}
    ).decode()


# (framing, node the line names or None, epoch seconds of its stamp or None, a yearless stamp's (month, day, h, m, s))
FRAMINGS: list[tuple[str, str | None, float | None, tuple[int, int, int, int, float] | None]] = [
    # syslog RFC 3164 (no year), with the kernel's uptime after the header
    ("Dec  7 12:00:00 gpu03 kernel: [680111.646286] {m}", "gpu03", None, (12, 7, 12, 0, 0.0)),
    # journalctl -o short-precise
    ("Dec 07 12:00:00.123456 gpu03 kernel: {m}", "gpu03", None, (12, 7, 12, 0, 0.123456)),
    # journalctl -o short-iso-precise, rsyslog RFC 3339
    ("2026-12-07T12:00:00.123456+00:00 gpu03 kernel: {m}", "gpu03", T0, None),
    # journalctl -o short-monotonic: the uptime, then the host
    ("[  219.470994] gpu03 kernel: {m}", "gpu03", None, None),
    # journalctl -o short-unix
    ("1796644800.123456 gpu03 kernel: {m}", "gpu03", 1796644800.123456, None),
    # journalctl -o json: MESSAGE, _HOSTNAME, __REALTIME_TIMESTAMP (microseconds)
    ("{json}", "gpu03", 1796644800.123456, None),
    # dmesg -T (ctime, with the year); dmesg -x facility/level before it
    ("[Mon Dec  7 12:00:00 2026] {m}", None, datetime(2026, 12, 7, 12, 0, tzinfo=UTC).timestamp(), None),
    ("kern  :err   : [Mon Dec  7 12:00:00 2026] {m}", None, datetime(2026, 12, 7, 12, 0, tzinfo=UTC).timestamp(), None),
    # dmesg -H: "%b%e %H:%M" on the first line of a minute (no space from the 10th), then deltas
    ("[Dec 7 12:00] {m}", None, None, (12, 7, 12, 0, 0.0)),
    ("[Dec12 12:00] {m}", None, None, (12, 12, 12, 0, 0.0)),
    ("[  +0.000123] {m}", None, None, None),
    # RFC 3164 with its priority; RFC 5424 with host and with the nil host
    ("<3>Dec  7 12:00:00 gpu03 kernel: {m}", "gpu03", None, (12, 7, 12, 0, 0.0)),
    ("<3>1 2026-12-07T12:00:00.123456Z gpu03 kernel - - - {m}", "gpu03", T0, None),
    ('<3>1 2026-12-07T12:00:00.123456Z - kernel - - [meta sequenceId="1"] {m}', None, T0, None),
    # containerd / CRI-O log file line around journald's
    ("2026-12-07T12:00:00.123456Z stderr F Dec 07 12:00:00 gpu03 kernel: {m}", "gpu03", T0, None),
    # kubectl logs --prefix --timestamps
    ("[pod/npd-7x2/npd] 2026-12-07T12:00:00.123456789Z Dec 07 12:00:00 gpu03 kernel: {m}", "gpu03", T0, None),
    # Docker json-file
    ("{docker}", "gpu03", T0, None),
    # pdsh-collected kern.log: the remote host, then its syslog line; and before plain dmesg
    ("gpu03: Dec  2 12:00:00 gpu03 kernel: {m}", "gpu03", None, (12, 2, 12, 0, 0.0)),
    ("gpu03: [  219.470994] {m}", "gpu03", None, None),
    # a monitoring alert quoting the syslog line; a collector's "[time] source:" wrapper
    (
        "Xid errors on instance: gpu03, Error: Dec  7 12:00:00 gpu03 kernel: [680111.646286] {m}",
        "gpu03",
        None,
        (12, 7, 12, 0, 0.0),
    ),
    ("[2026-12-07 12:00:01] syslog: 2026-12-07T12:00:00.123456Z gpu03 kernel: {m}", "gpu03", T0, None),
]


def _framed(framing: str, message: str) -> str:
    if framing == "{json}":
        return _journal_json(message)
    if framing == "{docker}":
        return _docker_json(message)
    return framing.format(m=message)


def _check_time(stamp: Stamp | None, epoch: float | None, fields: tuple[int, int, int, int, float] | None) -> None:
    if epoch is not None:
        assert stamp is not None and stamp.epoch() == pytest.approx(epoch, abs=1e-6)
    elif fields is not None:
        assert stamp is not None and stamp.year is None
        assert (stamp.month, stamp.day, stamp.hour, stamp.minute) == fields[:4]
        assert stamp.second == pytest.approx(fields[4])
    else:
        assert stamp is None


@pytest.mark.parametrize(("framing", "node", "epoch", "fields"), FRAMINGS)
@pytest.mark.parametrize("message", [XID, AER, HUNG], ids=["xid", "aer", "hung_task"])
def test_a_kernel_message_is_found_in_every_framing(
    framing: str, node: str | None, epoch: float | None, fields: tuple[int, int, int, int, float] | None, message: str
) -> None:
    pre = split_prefix(_framed(framing, message))
    assert pre.message == message
    assert pre.host == node
    assert not pre.user_space
    _check_time(pre.time, epoch, fields)


@pytest.mark.parametrize(("framing", "node", "epoch", "fields"), FRAMINGS)
def test_the_xid_is_parsed_with_the_framings_node(
    framing: str, node: str | None, epoch: float | None, fields: tuple[int, int, int, int, float] | None
) -> None:
    parsed = parse_kernel_line(_framed(framing, XID), default_node="dflt")
    assert parsed is not None
    assert (parsed.kind, parsed.xid, parsed.pci_bus_id, parsed.node) == ("xid", 79, "0000:10:00", node or "dflt")


@pytest.mark.parametrize(
    "framing",
    [
        "2026-12-07T12:00:00.123456Z stderr F Dec 07 12:00:00 gpu03 kernel: {m}",
        "gpu03: Dec  2 12:00:00 gpu03 kernel: {m}",
        "{json}",
    ],
)
def test_diagnose_reads_a_framed_kernel_log(tmp_path: Path, framing: str) -> None:
    (tmp_path / "kern.log").write_text(_framed(framing, XID) + "\n")
    (tmp_path / "job.out").write_text(JOB)
    report = diagnose_paths([tmp_path / "kern.log", tmp_path / "job.out"])
    assert (report["category"], report["culprit"], report["action"]) == ("gpu_hardware", "gpu03", "drain_and_requeue")


def test_a_programs_line_is_not_the_kernels() -> None:
    """RFC 5424 names the program: a user's logger(1) line quoting an Xid is no kernel evidence."""
    line = f"<13>1 2026-12-07T12:00:00.123456Z gpu03 alice 4242 - - {XID}"
    assert split_prefix(line).user_space
    assert parse_kernel_line(line, default_node="dflt") is None


@pytest.mark.parametrize("line", [f"fp16: {XID}", f"the node said through the kernel: {XID}", f"step 10: {XID}"])
def test_prose_and_configs_name_no_host(line: str) -> None:
    assert split_prefix(line).host is None


# -- multi-line driver messages ------------------------------------------------------------------

FALLEN_DMESG = [  # dmesg prints a record's later lines indented and unstamped
    "[14387.209961] NVRM: The NVIDIA GPU 0000:5d:00.0",
    "               NVRM: (PCI ID: 10de:2330) installed in this system has",
    "               NVRM: fallen off the bus and is not responding to commands.",
    "[14387.210134] nvidia: probe of 0000:5d:00.0 failed with error -1",
]
FALLEN_SYSLOG = [
    f"Dec  7 12:00:00 gpu05 kernel: {line.strip()[15:].strip() if line.startswith('[') else line.strip()}"
    for line in FALLEN_DMESG[:3]
]
AER_REPORT = [
    "Dec  7 12:00:01 gpu05 kernel: pcieport 0000:00:03.1: AER: Multiple Uncorrected (Fatal) error received: 0000:5d:00.0",
    "Dec  7 12:00:01 gpu05 kernel: nvidia 0000:5d:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, (Receiver ID)",
    "Dec  7 12:00:01 gpu05 kernel: nvidia 0000:5d:00.0:   device [10de:2330] error status/mask=00040000/00000000",
    "Dec  7 12:00:01 gpu05 kernel: nvidia 0000:5d:00.0:    [18] MalfTLP                (First)",
    "Dec  7 12:00:01 gpu05 kernel: nvidia 0000:5d:00.0: AER:   TLP Header: 4a000001 01000004 00000000 00000000",
    "Dec  7 12:00:01 gpu05 kernel: nvidia 0000:5d:00.0: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)",
]


@pytest.mark.parametrize("lines", [FALLEN_DMESG[:3], FALLEN_SYSLOG], ids=["dmesg", "syslog"])
def test_a_split_lost_gpu_message_is_one_message_naming_its_gpu(lines: list[str]) -> None:
    joined = join_continuations(lines)
    assert len(joined) == 1 and joined[0][0] == 0
    parsed = parse_kernel_line(joined[0][1], default_node="dflt")
    assert parsed is not None and (parsed.kind, parsed.pci_bus_id) == ("fallen_off_bus", "0000:5d:00.0")


def test_an_aer_report_is_one_message_per_error() -> None:
    joined = join_continuations(AER_REPORT)
    assert [i for i, _ in joined] == [0, 1, 5]
    text = joined[1][1]
    assert "error status/mask=00040000/00000000" in text and "[18] MalfTLP" in text and "TLP Header:" in text


def test_nvrm_lines_of_another_gpu_or_host_are_not_joined() -> None:
    lines = [
        "Dec  7 12:00:02 gpu05 kernel: NVRM: GPU at PCI:0000:5d:00: GPU-2b3c",
        "Dec  7 12:00:02 gpu05 kernel: NVRM: GPU Board Serial Number: 1650123456789",
        f"Dec  7 12:00:02 gpu05 kernel: {XID}",
        "Dec  7 12:00:02 gpu06 kernel: NVRM: GPU Board Serial Number: 1650123456780",
    ]
    assert [i for i, _ in join_continuations(lines)] == [0, 2, 3]


def test_diagnose_reads_a_split_lost_gpu_message_as_one_fault_of_its_node(tmp_path: Path) -> None:
    (tmp_path / "kern.log").write_text("\n".join(FALLEN_SYSLOG) + "\n")
    (tmp_path / "job.out").write_text(JOB)
    report = diagnose_paths([tmp_path / "kern.log", tmp_path / "job.out"])
    assert (report["category"], report["culprit"], report["action"]) == ("gpu_hardware", "gpu05", "drain_and_requeue")
    # The Xid detector and the signature catalog each read it, but always as the one joined message.
    kernel = [e["line"] for e in report["evidence"] if e["source"] == "kernel"]
    assert kernel and all("The NVIDIA GPU 0000:5d:00.0" in line and "fallen off the bus" in line for line in kernel)


# -- one timestamp reader -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "epoch"),
    [
        ("2026-12-07T12:00:00.123456789Z rest", datetime(2026, 12, 7, 12, 0, 0, 123457, tzinfo=UTC).timestamp()),
        ("[Mon Dec  7 12:00:00 2026] rest", datetime(2026, 12, 7, 12, 0, tzinfo=UTC).timestamp()),
        ("1796644800.5 rest", 1796644800.5),
    ],
)
def test_job_and_kernel_readers_agree(text: str, epoch: float) -> None:
    """parse_stamp (job logs) and match_prefix (kernel prefixes) are one reader: the same instant."""
    job, kern = parse_stamp(text), match_prefix(text)
    assert job is not None and kern is not None and kern.stamp is not None
    assert job.epoch() == pytest.approx(epoch, abs=1e-5) and kern.stamp.epoch() == pytest.approx(epoch, abs=1e-5)


def test_a_yearless_kernel_stamp_takes_the_year_of_the_other_files() -> None:
    clock = FileClock(reference=T0)
    stamp = split_prefix(f"Dec  7 12:00:05 gpu03 kernel: {XID}").time
    assert clock.time_of(stamp) == pytest.approx(T0 - 0.123456 + 5)


_HOSTS = st.from_regex(r"gpu[0-9]{2}", fullmatch=True)
_WHEN = st.datetimes(min_value=datetime(2001, 9, 10), max_value=datetime(2099, 1, 1), timezones=st.just(UTC))


@settings(max_examples=60, deadline=None)
@given(host=_HOSTS, when=_WHEN, outer=st.sampled_from(["", "cri", "kubectl", "pdsh", "pri"]))
def test_any_framing_of_a_journald_line_keeps_message_host_and_second(host: str, when: datetime, outer: str) -> None:
    iso = when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    line = f"{iso} {host} kernel: {XID}"
    line = {
        "": line,
        "cri": f"{iso} stdout F {line}",
        "kubectl": f"[pod/npd/npd] {iso} {line}",
        "pdsh": f"{host}: {line}",
        "pri": f"<3>{line}",
    }[outer]
    pre = split_prefix(line)
    assert (pre.host, pre.message) == (host, XID)
    assert pre.time is not None and pre.time.epoch() == pytest.approx(when.timestamp(), abs=1e-5)
