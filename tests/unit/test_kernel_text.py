"""Kernel evidence beyond Xid on real kernel text: hung tasks and their filesystem, SXids, NVLink5 Xids,
and the syslog / journal / dmesg prefixes parse_kernel_line reads host and time from.

Fixture files are in tests/fixtures/logs/ (sources in SOURCES.md); single lines quoted here carry their
source URL beside them. Host names were replaced by gpuNN as in SOURCES.md; nothing else was changed.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from producers.kernel import parse_kernel_line, split_prefix, to_event
from schemas.events import Anomaly, KernelEvent
from schemas.timestamps import Stamp
from streams.catalog import load_kernel_signatures
from streams.detectors.kernel_text import KernelTextDetector
from streams.detectors.xid import SxidDetector, XidDetector
from tests.conftest import FIXTURES

LOGS = FIXTURES / "logs"


def _events(lines: list[str], node: str = "gpu07", t0: float = 100.0, step: float = 0.001) -> list[KernelEvent]:
    out = []
    for i, line in enumerate(lines):
        parsed = parse_kernel_line(line, node)
        if parsed is not None:
            out.append(to_event(parsed, t0 + i * step))
    return out


def _run(lines: list[str], detector: KernelTextDetector | None = None, **kw: float | str) -> list[Anomaly]:
    d = detector or KernelTextDetector()
    return [a for ev in _events(lines, **kw) for a in d.detect(ev)]  # type: ignore[arg-type]


def _fixture(name: str) -> list[str]:
    return (LOGS / name).read_text().splitlines()


# --- hung tasks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "fs", "name", "task"),
    [
        ("kernel_hung_fuse.log", "fuse", "FUSE", "ruby2.5:22867"),  # trapexit/mergerfs#521
        ("kernel_hung_lustre.log", "lustre", "Lustre", "ll_cfg_requeue:4037"),  # whamcloud IML PR #329
        ("kernel_hung_nfs.log", "nfs", "NFS", "mount.nfs:11252"),  # dCache/dcache#3769
    ],
)
def test_hung_task_in_a_filesystem_is_storage_on_that_node(fixture: str, fs: str, name: str, task: str) -> None:
    anomalies = _run(_fixture(fixture))
    assert [(a.signature, a.category, a.severity) for a in anomalies] == [
        ("hung_task", "node", "warning"),
        (f"hung_task_{fs}", "storage", "error"),
    ]
    storage = anomalies[1]
    assert storage.node == "gpu07" and storage.role == "root" and not storage.isolate
    assert name in storage.meaning and task in storage.meaning and "120 s" in storage.meaning


def test_hung_task_without_filesystem_frame_is_the_node() -> None:
    (a,) = _run(_fixture("kernel_hung_no_fs.log"))  # moosefs/moosefs#566: kswapd0 in page writeback
    assert (a.signature, a.category, a.severity, a.role, a.node) == ("hung_task", "node", "warning", "root", "gpu07")
    assert "kswapd0:328" in a.meaning and "no filesystem frame" in a.meaning


def test_syslog_prefixed_hung_task_names_the_host() -> None:
    # gluster/gluster-health-report#19 (RHEL /var/log/messages form); the D-state line inside the report
    # ("bptm D ... 26120") is the same task, not a second report.
    (a,) = _run(_fixture("kernel_hung_syslog.log"), node="default")
    assert (a.signature, a.category, a.node) == ("hung_task", "node", "gpu01")


def test_d_state_report_without_header_opens_a_report() -> None:
    # trapexit/mergerfs#521 without its INFO header: the D-state line alone is a blocked-task report.
    lines = _fixture("kernel_hung_fuse.log")[3:]
    assert [a.signature for a in _run(lines)] == ["blocked_task", "hung_task_fuse"]


def test_frames_without_a_report_raise_nothing() -> None:
    # A process stack read from /proc/PID/stack, no hung-task header (servers.ustclug.org/2014/08/
    # freeshell-node-3-control-panel-stuck/): NFS frames, but nothing says a task is blocked.
    lines = [
        "[<ffffffffa04f69b4>] rpc_wait_bit_killable+0x24/0x40 [sunrpc]",
        "[<ffffffffa04f698d>] __rpc_wait_for_completion_task+0x2d/0x30 [sunrpc]",
        "[<ffffffffa05b64d3>] nfs4_do_close+0x203/0x270 [nfs]",
    ]
    assert len(_events(lines)) == 3  # published (kind other) ...
    assert _run(lines) == []  # ... but no report is open


def test_report_is_bounded_by_frames_window_and_nodes() -> None:
    sigs = load_kernel_signatures()
    header, nfs_frame = _fixture("kernel_hung_nfs.log")[0], _fixture("kernel_hung_nfs.log")[8]
    # Past the time window the frame no longer belongs to the header.
    d = KernelTextDetector()
    late = _events([header, nfs_frame], step=sigs.report.window_s + 1)
    assert [a.signature for ev in late for a in d.detect(ev)] == ["hung_task"]
    # Past max_frames generic frames, the report is closed.
    generic = _fixture("kernel_hung_no_fs.log")[6]
    d = KernelTextDetector()
    lines = [header] + [generic] * sigs.report.max_frames + [nfs_frame]
    assert [a.signature for a in _run(lines, d)] == ["hung_task"]
    assert d.open_reports == 0
    # One open report per node, at most max_nodes nodes.
    small = sigs.model_copy(update={"report": sigs.report.model_copy(update={"max_nodes": 2})})
    d = KernelTextDetector(signatures=small)
    for n in ("gpu01", "gpu02", "gpu03"):
        _run([header], d, node=n)
    assert d.open_reports == 2
    assert _run([nfs_frame], d, node="gpu01") == []  # the oldest report was dropped
    assert [a.signature for a in _run([nfs_frame], d, node="gpu03")] == ["hung_task_nfs"]


def test_filesystem_patterns_do_not_fire_on_generic_frames() -> None:
    d = KernelTextDetector()
    anomalies = _run(_fixture("kernel_hung_no_fs.log") + _fixture("kernel_hung_syslog.log"), d)
    assert {a.category for a in anomalies} == {"node"}


# --- SXid ----------------------------------------------------------------------------------------


def test_nonfatal_sxid_of_an_ignore_bucket_raises_nothing() -> None:
    # NVIDIA/nvtrust#124: SXid 22013 (MINION_NONFATAL), Non-fatal, with its Data / Severity detail lines.
    events = _events(_fixture("kernel_sxid_nonfatal.log"))
    assert {e.kind for e in events} == {"sxid"}
    d = KernelTextDetector()
    assert [a for e in events for a in d.detect(e)] == []


def test_fatal_sxid_is_interconnect_root_on_the_node() -> None:
    # leptonai/gpud#338 (dmesg -x --time-format iso): the detail line only, no Fatal/Non-fatal word, so the
    # catalog's column decides: 12028 EGRESS_PRIVRSPERR is FATAL, bucket RESET_FABRIC.
    line = (
        "kern  :err   : 2025-01-25T10:34:54,859532+00:00 nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 12028, "
        "Data {0x000001c0, 0x00bd5c8a, 0x00000500, 0x00000064, 0x00000000, 0x40008000, 0x5a001100, 0x00000000, "
        "0x00000000}"
    )
    (ev,) = _events([line])
    (a,) = KernelTextDetector().detect(ev)
    assert (a.signature, a.category, a.severity, a.role, a.isolate, a.node) == (
        "sxid_12028",
        "interconnect",
        "critical",
        "root",
        True,
        "gpu07",
    )
    assert "NVSWITCH_ERR_HW_NPORT_EGRESS_PRIVRSPERR" in a.meaning and "RESET_FABRIC" in a.meaning
    assert [x.event_id for x in SxidDetector().detect(ev)] == [a.event_id]  # the detector inside KernelTextDetector
    assert XidDetector().detect(ev) == []  # SXids are not GPU Xids


def test_the_line_says_non_fatal_wins_over_the_catalog() -> None:
    # NVIDIA/nvtrust#124 line 3: "Non-fatal" on an IGNORE code -> nothing.
    (ev,) = _events(["[   38.178720] nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 Minion Link"])
    assert KernelTextDetector().detect(ev) == []


# --- Blackwell NVLink5 Xids ------------------------------------------------------------------------


def test_nvlink5_xid_fatality_comes_from_the_line() -> None:
    d = XidDetector()
    # leptonai/gpud PR #1160 (kmsg input quoted in the description)
    fatal = "NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"  # noqa: E501
    nonfatal = "NVRM: Xid (PCI:0000:01:00): 144, SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008 0x00000000 0x00000000 0x00000000 0x00000000)"  # noqa: E501
    # leptonai/gpud PR #1174
    rlw = "NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)"  # noqa: E501
    (f,) = [a for ev in _events([fatal]) for a in d.detect(ev)]
    assert (f.signature, f.category, f.severity, f.isolate) == ("xid_149", "interconnect", "critical", True)
    assert "reported Fatal" in f.meaning and "WORKFLOW_NVLINK5_ERR" in f.meaning
    # Non-fatal: evidence only (NVIDIA's decode says IGNORE for most non-fatal NVLink5 conditions).
    for line, code in ((nonfatal, 144), (rlw, 145)):
        (n,) = [a for ev in _events([line]) for a in d.detect(ev)]
        assert (n.signature, n.category, n.severity, n.role, n.isolate) == (
            f"xid_{code}",
            "interconnect",
            "info",
            "collateral",
            False,
        )


def test_xid45_after_an_nvlink_xid_is_a_follow_on() -> None:
    # NVIDIA/open-gpu-kernel-modules#1150
    line = "kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149"
    (ev,) = _events([line])
    assert ev.xid == 45 and XidDetector().detect(ev) == []


def test_fallen_off_the_bus_split_over_lines_is_xid_79() -> None:
    # NVIDIA/NVSentinel#155 (quoted in tests/fixtures/logs/SOURCES.md): newer drivers print no Xid here.
    lines = [
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
        "NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "NVRM: fallen off the bus and is not responding to commands.",
    ]
    (ev,) = _events(lines)
    assert (ev.kind, ev.xid, ev.pci_bus_id) == ("fallen_off_bus", None, None)
    (a,) = XidDetector().detect(ev)
    assert (a.signature, a.category, a.isolate, a.node) == ("xid_79", "gpu_hardware", True, "gpu07")


# --- prefixes: host and time ----------------------------------------------------------------------


def test_syslog_prefix_has_host_and_time_but_no_year() -> None:
    # openzfs/zfs#2628 (syslog with the dmesg uptime after "kernel:")
    p = parse_kernel_line(
        "Aug 26 22:05:06 gpu02 kernel: [2442787.612089]  [<ffffffffa036bafa>] ? exp_find+0xbc/0xc8 [nfsd]", "x"
    )
    assert p is not None and (p.kind, p.node, p.host, p.uptime_s) == ("other", "gpu02", "gpu02", 2442787.612089)
    assert p.time == Stamp(month=8, day=26, hour=22, minute=5, second=6.0)
    assert p.time.epoch() is None  # no year in the line: the caller must supply it
    assert p.time.epoch(year=2014) == datetime(2014, 8, 26, 22, 5, 6, tzinfo=UTC).timestamp()
    assert Stamp(month=2, day=29, hour=0, minute=0, second=0.0).epoch(year=2023) is None


def test_syslog_day_padding_and_missing_host() -> None:
    # NVIDIA/gpu-operator#1146 ("Dec  2", two spaces) and NVIDIA/open-gpu-kernel-modules#1151 (no host field)
    pre = split_prefix((LOGS / "xid48_kern.log").read_text().splitlines()[0])
    assert pre.host == "gpu02" and pre.time is not None and (pre.time.month, pre.time.day) == (12, 2)
    assert pre.uptime_s == 199.234935 and pre.message.startswith("NVRM: GPU 0000:0a:00.0: rm_init_adapter failed")
    q = parse_kernel_line("May 18 19:02:39 kernel: NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.", "x")
    assert q is not None and (q.xid, q.node, q.host) == (79, "x", None)
    assert q.time is not None and (q.time.month, q.time.hour) == (5, 19)


def test_journal_and_rsyslog_iso_prefixes() -> None:
    # cloud-hypervisor/cloud-hypervisor#8284 (journal / rsyslog RFC 3339 with a zone)
    p = parse_kernel_line("2026-05-28T12:21:57.303295+00:00 vm-1 kernel:  ret_from_fork+0x44/0x70", "x")
    assert p is not None and (p.kind, p.host) == ("other", "vm-1") and p.time is not None
    assert p.time.epoch() == datetime(2026, 5, 28, 12, 21, 57, 303295, tzinfo=UTC).timestamp()
    # openzfs/zfs#8994: a negative offset; the line is not one trainmedic reads, but its prefix is.
    line = (
        "2019-07-05T02:16:36.434782-04:00 gpu03 kernel: Lustre: 42858:0:(client.c:2134:ptlrpc_expire_one_request())"
        " Skipped 7 previous similar messages"
    )
    assert parse_kernel_line(line, "x") is None
    q = split_prefix(line)
    assert q.host == "gpu03" and q.time is not None and q.time.utc_offset_s == -4 * 3600
    assert q.time.epoch() == datetime(2019, 7, 5, 6, 16, 36, 434782, tzinfo=UTC).timestamp()
    assert q.message.startswith("Lustre: 42858:0:")


def test_journal_short_precise_prefix_has_host_and_microseconds() -> None:
    # journalctl -o short-precise (built, journalctl(1)): before schemas.timestamps the fraction hid
    # the prefix, so the host went unread and a program's forged line passed for the kernel's.
    line = "Oct 11 06:07:26.123456 gpu01 kernel: NVRM: Xid (PCI:0000:07:00): 79, pid=1234, GPU has fallen off the bus."
    p = parse_kernel_line(line, "x")
    assert p is not None and (p.xid, p.node, p.host) == (79, "gpu01", "gpu01")
    assert p.time == Stamp(month=10, day=11, hour=6, minute=7, second=26.123456)
    assert parse_kernel_line(line.replace(" kernel: ", " alice[4242]: "), "x") is None


def test_dmesg_x_facility_and_iso_time() -> None:
    # leptonai/gpud PR #870 (dmesg -x --time-format iso: facility:level, comma decimals, no host)
    p = parse_kernel_line(
        "syslog:err   : 2025-05-27T04:18:56,089671+00:00 NVRM: Xid (PCI:0000:04:00): 79, GPU has fallen off the bus",
        "x",
    )
    assert p is not None and (p.kind, p.xid, p.node, p.host) == ("xid", 79, "x", None)
    assert p.time is not None and p.time.epoch() == datetime(2025, 5, 27, 4, 18, 56, 89671, tzinfo=UTC).timestamp()


def test_dmesg_t_prefix_has_the_year_and_no_host() -> None:
    # vllm-project/vllm#40652 (tests/fixtures/corpus/dev/gpu_xid119_gsp_timeout_dmesg)
    line = (
        "[Sun Apr 26 23:12:26 2026] NVRM: Xid (PCI:0001:6c:00): 119, pid=10200, name=NvmlTaskRunner, Timeout after"
        " 45s of waiting for RPC response from GPU5 GSP! Expected function 76 (GSP_RM_CONTROL) sequence 24174"
        " (0x20801322 0x808)."
    )
    p = parse_kernel_line(line, "x")
    assert p is not None and (p.xid, p.node, p.host) == (119, "x", None)
    assert p.time == Stamp(month=4, day=26, hour=23, minute=12, second=26.0, year=2026)
    assert p.time.epoch(utc_offset_s=3600) == datetime(2026, 4, 26, 22, 12, 26, tzinfo=UTC).timestamp()


def test_lines_that_are_not_read_stay_none() -> None:
    # jade-hpc-gpu/jade-hpc-gpu.github.io#14: a Lustre client message, not a hung task or a frame.
    line = (
        "[Mon Oct 16 09:50:06 2017] Lustre: 2449:0:(client.c:2141:ptlrpc_expire_one_request()) "
        "Skipped 24 previous similar messages"
    )
    assert parse_kernel_line(line, "x") is None
    assert parse_kernel_line('"echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message.', "x") is None
