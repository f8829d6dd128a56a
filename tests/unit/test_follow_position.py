"""A followed file resumes where it stopped: same file, rotated while away, truncated, look-back."""

from __future__ import annotations

import os
from pathlib import Path

from producers.follow import FileFollower
from producers.position import Checkpointer, FilePosition, PositionStore


def test_resume_in_the_same_file_reads_only_what_came_after(tmp_path: Path) -> None:
    path = tmp_path / "job.out"
    path.write_text("one\ntwo\nthr")
    first = FileFollower(path)
    assert first.poll() == ["one", "two"]
    pos = first.position()
    assert pos is not None and pos.lineno == 2
    first.close()
    with open(path, "a") as fh:
        fh.write("ee\nfour\n")  # written while the producer was away
    again = FileFollower(path, resume=pos)
    assert again.poll() == ["three", "four"]
    assert again.lineno == 4  # line numbers continue: the same event ids as before a restart


def test_rotated_while_away_reads_the_rest_of_the_old_file_then_the_new(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    path.write_text("a\nb\n")
    f = FileFollower(path)
    assert f.poll() == ["a", "b"]
    pos = f.position()
    f.close()
    with open(path, "a") as fh:
        fh.write("c\n")
    os.rename(path, tmp_path / "kern.log.1")
    path.write_text("d\n")
    resumed = FileFollower(path, resume=pos)
    assert resumed.poll() == ["c", "d"]


def test_truncated_while_away_starts_over(tmp_path: Path) -> None:
    path = tmp_path / "job.out"
    path.write_text("a\nb\nc\n")
    f = FileFollower(path)
    f.poll()
    pos = f.position()
    path.write_text("x\n")  # same inode, shorter than the saved offset
    assert FileFollower(path, resume=pos).poll() == ["x"]


def test_unknown_inode_starts_from_the_current_file(tmp_path: Path) -> None:
    path = tmp_path / "job.out"
    path.write_text("fresh\n")
    gone = FilePosition(inode=1, offset=3, lineno=7)
    f = FileFollower(path, from_start=False, resume=gone)
    assert f.poll() == ["fresh"]


def test_no_position_and_not_from_start_reads_back_the_look_back_window(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    path.write_text("".join(f"old line {i}\n" for i in range(1000)) + "recent xid line\n")
    f = FileFollower(path, from_start=False, lookback_bytes=40)
    lines = f.poll()
    assert lines[-1] == "recent xid line" and len(lines) <= 3
    assert all(line.startswith(("old line", "recent")) for line in lines)  # no cut first line
    assert FileFollower(path, from_start=False).poll() == []


def test_checkpointer_saves_only_when_everything_before_is_acknowledged(tmp_path: Path) -> None:
    store = PositionStore(tmp_path / "p.json")
    acked = {"ok": False}
    pos = {"file:/x": FilePosition(5, 10, 2)}
    cp = Checkpointer(store, lambda: pos, lambda _t: acked["ok"], every_s=0)
    assert not cp.save(timeout=0)
    assert not (tmp_path / "p.json").exists()
    acked["ok"] = True
    assert cp.save(timeout=0)
    assert PositionStore(tmp_path / "p.json").file("file:/x") == FilePosition(5, 10, 2)


def test_unreadable_position_file_starts_afresh(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text("{not json")
    assert PositionStore(tmp_path / "p.json").file("file:/x") is None


def test_journal_resumes_after_its_cursor_or_looks_back_this_boot() -> None:
    from producers.kernel import journal_argv

    assert journal_argv("s=abc;i=12", 600)[-2:] == ["--after-cursor", "s=abc;i=12"]
    argv = journal_argv(None, 600)
    assert "-b" in argv and argv[-2:] == ["--since", "-600s"]


def test_kmsg_record_header() -> None:
    from producers.kernel import kmsg_seq_usec

    assert kmsg_seq_usec("6,1234,5678901,-;NVRM: Xid (PCI:0000:07:00): 79") == (1234, 5678901)
    assert kmsg_seq_usec("no header at all") is None
