from __future__ import annotations

import os
from pathlib import Path

from producers.follow import FileFollower
from producers.joblogs import JobLayout, split_rank_prefix
from producers.kernel import parse_kernel_line
from tests.conftest import FIXTURES

LOGS = FIXTURES / "logs"


def test_srun_label_and_torchrun_prefixes() -> None:
    assert split_rank_prefix("3: hello") == split_rank_prefix("[rank3]:hello")
    r = split_rank_prefix("12: [rank7]:[E1206 18:44:12.715] boom")
    assert r.rank == 7 and r.text == "[E1206 18:44:12.715] boom"
    r = split_rank_prefix(" iteration      100/    5000 | lm loss: 9.67")
    assert r.rank is None and r.text.startswith(" iteration")


def test_block_layout_maps_ranks_to_nodes() -> None:
    layout = JobLayout(("gpu01", "gpu02"), ranks_per_node=8)
    assert layout.node_of(0) == "gpu01" and layout.node_of(15) == "gpu02"
    assert layout.node_of(16) is None and layout.node_of(None) is None


def test_xid79_fixture() -> None:
    parsed = [p for line in (LOGS / "xid79_kern.log").read_text().splitlines() if (p := parse_kernel_line(line, "x"))]
    xids = [p for p in parsed if p.kind == "xid"]
    assert [(p.xid, p.node, p.pci_bus_id, p.pid) for p in xids] == [(79, "gpu01", "0000:10:00", 0)]
    assert any(p.kind == "fallen_off_bus" and p.pci_bus_id == "0000:10:00.0" for p in parsed)


def test_xid48_fixture_with_unknown_pid() -> None:
    parsed = [p for line in (LOGS / "xid48_kern.log").read_text().splitlines() if (p := parse_kernel_line(line, "x"))]
    xids = [(p.xid, p.node, p.pid, p.process_name) for p in parsed if p.kind == "xid"]
    assert xids == [(48, "gpu02", None, "<unknown>"), (64, "gpu02", None, "<unknown>")]


def test_plain_dmesg_line_uses_the_default_node() -> None:
    p = parse_kernel_line(
        "[  219.470994] NVRM: Xid (PCI:0000:07:00): 79, pid=1234, name=python, GPU has fallen off the bus.", "gpu09"
    )
    assert p is not None and (p.node, p.xid, p.pid, p.process_name) == ("gpu09", 79, 1234, "python")
    assert parse_kernel_line("usb 1-1: new high-speed USB device", "gpu09") is None


def test_follower_handles_partial_lines_truncation_and_rotation(tmp_path: Path) -> None:
    path = tmp_path / "out.log"
    path.write_text("one\ntw")
    f = FileFollower(path)
    assert f.poll() == ["one"]
    with open(path, "a") as fh:
        fh.write("o\nthree\n")
    assert f.poll() == ["two", "three"]
    path.write_text("fresh\n")  # truncated in place (copytruncate)
    assert f.poll() == ["fresh"]
    with open(path, "a") as fh:
        fh.write("last words\n")
    os.rename(path, tmp_path / "out.log.1")
    path.write_text("new file\n")
    assert f.poll() == ["last words", "new file"]


def test_follower_cuts_huge_lines(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    path.write_bytes(b"x" * (2 * 1024 * 1024) + b"\nok\n")
    f = FileFollower(path)
    lines = f.poll()
    assert lines[-1] == "ok" and all(len(line) <= 64 * 1024 for line in lines)
    assert f.truncated_lines >= 1


def test_kmsg_and_journal_records() -> None:
    from producers.kernel import journal_message, kmsg_message

    rec = "4,1234,5678901,-;NVRM: Xid (PCI:0000:07:00): 79, pid=0, GPU has fallen off the bus.\n"
    assert kmsg_message(rec).startswith("NVRM: Xid (PCI:0000:07:00): 79")
    line = '{"MESSAGE": "NVRM: Xid (PCI:0000:07:00): 48, pid=12, name=python, DBE", "_HOSTNAME": "gpu03"}'
    assert journal_message(line) == ("NVRM: Xid (PCI:0000:07:00): 48, pid=12, name=python, DBE", "gpu03")
    raw = '{"MESSAGE": [78, 86, 82, 77], "_HOSTNAME": "gpu03"}'
    assert journal_message(raw) == ("NVRM", "gpu03")
    assert journal_message("not json") is None


def test_interleaved_tracebacks_are_grouped_per_rank() -> None:
    from producers.tracebacks import TracebackGrouper
    from schemas.events import LogLine

    # Two ranks print tracebacks at once (rank prefixes already stripped), plus ordinary lines.
    feed = [
        (0, "Traceback (most recent call last):"),
        (1, "Traceback (most recent call last):"),
        (0, '  File "train.py", line 42, in <module>'),
        (None, " iteration      100/  500000 | lm loss: 2.1"),
        (1, '  File "train.py", line 42, in <module>'),
        (0, "    loss = model(batch)"),
        (0, "ValueError: bad batch shape"),
        (1, "    loss = model(batch)"),
        (1, ""),
        (1, "During handling of the above exception, another exception occurred:"),
        (1, ""),
        (1, "Traceback (most recent call last):"),
        (1, '  File "train.py", line 50, in <module>'),
        (1, "RuntimeError: CUDA error: an illegal memory access was encountered"),
    ]
    g = TracebackGrouper()
    out = []
    for i, (rank, text) in enumerate(feed, 1):
        out += g.feed(LogLine(text=text, ts=1.0, rank=rank, lineno=i), now=1.0)
    assert [(x.rank, x.text) for x in out] == [
        (None, " iteration      100/  500000 | lm loss: 2.1"),
        (0, "ValueError: bad batch shape"),
        (1, "RuntimeError: CUDA error: an illegal memory access was encountered"),
    ]
    assert out[1].context is not None and out[1].context.count("\n") == 3
    assert out[2].context is not None and "During handling" in out[2].context and out[2].lineno == 14
    # A traceback cut off by a dying process still comes out, once it stops growing.
    assert g.feed(LogLine(text="Traceback (most recent call last):", ts=2.0, rank=3, lineno=20), now=2.0) == []
    assert g.feed(LogLine(text='  File "x.py", line 1', ts=2.0, rank=3, lineno=21), now=2.0) == []
    assert g.flush(now=2.5) == []
    (cut,) = g.flush(now=5.0)
    assert cut.lineno == 21 and cut.context is not None and cut.context.startswith("Traceback")


def test_a_program_cannot_forge_a_kernel_xid_through_syslog() -> None:
    # /var/log/messages and syslog hold every program's lines: `logger "NVRM: Xid ..."` run by any
    # local user writes "HOST USER: NVRM: Xid ...". Only the kernel's own lines are node evidence.
    real = "Oct 11 06:07:26 gpu01 kernel: NVRM: Xid (PCI:0000:07:00): 79, pid=1234, GPU has fallen off the bus."
    assert parse_kernel_line(real, "x") is not None
    for forged in (
        real.replace(" kernel: ", " alice: "),
        real.replace(" kernel: ", " alice[4242]: "),
        real.replace("Oct 11 06:07:26", "2024-10-11T06:07:26.123456+00:00").replace(" kernel: ", " root[1]: "),
    ):
        assert parse_kernel_line(forged, "x") is None, forged
