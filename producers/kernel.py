"""Kernel log reader: NVRM Xid / SXid / fallen-off-the-bus lines -> node.kernel."""

from __future__ import annotations

import os
import re
import select
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import orjson

from bus.publish import Publisher
from producers.follow import FileFollower
from producers.metrics import LINES_READ
from producers.position import FilePosition
from schemas.events import KernelEvent
from schemas.ids import NODE_NAME_PATTERN, check_node_name, is_node_name, stable_id
from schemas.timestamps import Stamp, match_prefix, match_uptime
from schemas.topics import NODE_KERNEL

# The prefixes kernel lines come with, in the order they appear at the start of a line:
#   dmesg -x facility/level      "kern  :err   : "
#   syslog / RHEL messages /     "Mar  3 12:00:00 gpu02 kernel: "    (RFC 3164: no year, no zone)
#     journalctl (short,           "Mar 03 12:00:00.123456 gpu02 kernel: "
#     short-precise)
#   ISO 8601 (journalctl -o      "2024-05-01T10:00:00+0000 gpu02 kernel: ", rsyslog RFC 3339
#     short-iso, rsyslog,          "2019-07-05T02:16:36.434714-04:00 host kernel: ", dmesg --time-format iso
#     dmesg --time-format iso)     "2025-01-25T10:34:54,859532+00:00 " (no host)
#   dmesg -T                     "[Mon May  1 10:00:00 2024] "      (no host)
#   dmesg uptime                 "[  219.470994] "                  (seconds since boot)
# The stamps are read by schemas.timestamps (match_prefix, match_uptime), as the job logs' are.
_FACILITY = re.compile(r"[a-z]+\s*:[a-z]+\s*:\s")
# After a syslog or ISO stamp: "HOST kernel: " (or just "kernel: " when the host was not recorded).
_HOST = re.compile(r"(?:(?P<host>[A-Za-z0-9._-]+)\s+)?kernel:\s?")
# "HOST ident[pid]: " after a stamp, the ident not "kernel": a user-space program's line.
_USER_IDENT = re.compile(r"[A-Za-z0-9._-]+\s+(?P<ident>[\w./@-]+)(?:\[[0-9]+\])?:\s")
# Numbers are ASCII [0-9]: \d (and str.isdigit) also accept digits int() refuses, like '²'.
_XID = re.compile(
    r"NVRM: Xid \(PCI:(?P<pci>[0-9A-Fa-f:.]+)\): (?P<xid>[0-9]+),\s*(?:pid=(?P<pid>'?<?[\w]+>?'?),\s*)?"
    r"(?:name=(?P<name>[^,]*),\s*)?"
)
_SXID = re.compile(r"SXid \(PCI:(?P<pci>[0-9A-Fa-f:.]+)\): (?P<xid>[0-9]+)")
_FALLEN = re.compile(
    r"NVRM: (?:The NVIDIA )?GPU (?:at PCI:)?(?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.\d)?):? .*fallen off the bus"
)
# Newer drivers split the message over three lines, the last naming no GPU (NVIDIA/NVSentinel#155):
#   "NVRM: The NVIDIA GPU 0000:b3:00.0" / "NVRM: (PCI ID: 10de:26b5) installed in this system has" /
#   "NVRM: fallen off the bus and is not responding to commands."
_FALLEN_SPLIT = re.compile(r"NVRM: fallen off the bus and is not responding to commands")
# Hung-task and D-state reports and the call-trace frames after them (kernel/hung_task.c, sysrq-w).
# Published as kind "other": streams/detectors/kernel_text.py tells header from frame and names the
# filesystem with streams/catalog/kernel_signatures.yaml (producers never import streams, so this filter
# is deliberately broad: any such header, D-state line or stack frame).
_HUNG_TASK = re.compile(r"INFO: task .+:[0-9]+ blocked for more than [0-9]+ seconds")
_D_STATE = re.compile(
    r"\btask:\S+\s+state:D\b|^\S(?:.*?\S)?\s+D\s+(?:[0-9a-f]{8,16}\s+)?[0-9]+\s+[0-9]+\s+[0-9]+\s+0x[0-9a-f]+\s*$"
)
_FRAME = re.compile(r"[\w.$]+\+0x[0-9a-f]+/0x[0-9a-f]+|\([\w.$]+\) from \[<[0-9a-f]+>\]")
_KERNEL_TEXT_HINTS = ("blocked for more than", "state:D", " D ", "+0x", ") from [<")
# Xid codes and pids are small (pid_max is at most 2**22): a longer number is garbage, and past
# 64 bits it could not even be published (orjson refuses it), so it becomes None.
_MAX_FIELD_INT = 2**31 - 1
_FIELD_DIGITS = len(str(_MAX_FIELD_INT))


def _small_int(text: str | None) -> int | None:
    """ASCII digits -> int when it fits an int32, else None (never int()'s ValueError)."""
    if not text or len(text) > _FIELD_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= _MAX_FIELD_INT else None


@dataclass(frozen=True)
class ParsedKernelLine:
    kind: str
    node: str
    text: str
    xid: int | None = None
    pci_bus_id: str | None = None
    pid: int | None = None
    process_name: str | None = None
    host: str | None = None  # the host the line's own prefix names (syslog, journal), if any
    time: Stamp | None = None  # the wall-clock stamp of the prefix, if any (syslog's has no year)
    uptime_s: float | None = None  # dmesg's "[  219.470994]" seconds since boot, if any


@dataclass(frozen=True)
class _Prefix:
    host: str | None
    time: Stamp | None
    uptime_s: float | None
    message: str
    # A syslog line written by a program, not the kernel ("gpu01 root[1234]: ..."): in
    # /var/log/messages or syslog any local user can write one with logger(1).
    user_space: bool = False


# Outer framings a collector puts around a kernel line, peeled before the kernel's own prefix:
#   containerd / CRI-O log files (CRI logging format, kubelet pkg/kubelet/kuberuntime/logs/logs.go):
#     "2026-12-07T12:00:00.123456789Z stderr F " (RFC3339Nano time, stream, F(ull)/P(artial) tag)
#   kubectl logs --prefix (kubectl 1.27+ pkg/cmd/logs/logs.go): "[pod/NAME/CONTAINER] "
#   kubectl logs --timestamps: an RFC3339Nano stamp and a space (read by the stamp loop below)
#   RFC 3164 / 5424 priority "<PRI>" and RFC 5424's "1 TIMESTAMP HOST APP PROCID MSGID SD "
#   pdsh (2.34, src/pdsh/dsh.c: "%s: %s" with the remote host) before a syslog or dmesg line
#   Docker's json-file driver ({"log": ..., "time": ...}) and journalctl -o json ({"MESSAGE": ...})
_CRI = re.compile(r"(?P<stamp>[0-9]{4}-[0-9]{2}-[0-9]{2}T\S+) (?:stdout|stderr) [FP] ")
_KUBECTL_PREFIX = re.compile(r"\[pod/[^\]/\s]+/[^\]\s]+\] ")
_PRI = re.compile(r"<[0-9]{1,3}>")
_RFC5424 = re.compile(r"1 (?P<stamp>\S+) (?P<host>\S+) (?P<app>\S+) \S+ \S+ (?:-|(?:\[(?:[^\]\\]|\\.)*\])+)(?: |$)")
# pdsh's label only counts when a kernel-log prefix follows it: "fp16: true" is no host.
_PDSH = re.compile(rf"(?P<host>{NODE_NAME_PATTERN}): (?=\S)")
# Where a kernel line quoted inside other text may start: a stamp's first characters.
_QUOTE_START = re.compile(r"(?<![\w:.-])(?=[A-Z][a-z]{2} |[0-9]{4}-[0-9]{2}-[0-9]{2}T|\[|1[0-9]{9}\.)")
_MAX_LAYERS = 8  # framings nest a few deep at most; the bound keeps a crafted line cheap


@dataclass
class _Peel:
    text: str
    host: str | None = None  # the outermost host a framing named (pdsh, RFC 5424, journald json)
    time: Stamp | None = None  # the outermost stamp a framing named
    app: str | None = None  # RFC 5424's APP-NAME, when the line had one


def _json_layer(text: str, out: _Peel) -> str | None:
    """The message of a journalctl -o json entry or a Docker json-file record, or None."""
    entry = _journal_entry(text)
    if entry is None:
        return None
    if "MESSAGE" in entry:
        found = _entry_message(entry)
        if found is None:
            return None
        out.host = out.host or found[1]
        usec = entry.get("__REALTIME_TIMESTAMP")
        if out.time is None and isinstance(usec, str) and usec.isascii() and usec.isdigit():
            out.time = Stamp(1, 1, 0, 0, 0.0, epoch_s=int(usec) / 1e6)
        return found[0]
    log = entry.get("log")
    if isinstance(log, str):
        at = match_prefix(f"{entry.get('time')} ")
        if out.time is None and at is not None:
            out.time = at.stamp
        return log.rstrip("\n")
    return None


def _peel(text: str) -> _Peel:
    """`text` without the collector framings above, with the outermost host and stamp they named."""
    out = _Peel(text)
    for _ in range(_MAX_LAYERS):
        t = out.text
        if t.startswith("{"):
            inner = _json_layer(t, out)
            if inner is None:
                return out
            out.text = inner.strip()
            continue
        m = _CRI.match(t) or _KUBECTL_PREFIX.match(t)
        if m:
            at = match_prefix(f"{m.group('stamp')} ") if "stamp" in m.groupdict() else None
            out.time = out.time or (at.stamp if at else None)
            out.text = t[m.end() :]
            continue
        m = _PRI.match(t)
        if m:
            rest = t[m.end() :]
            r = _RFC5424.match(rest)
            if r:
                at = match_prefix(f"{r.group('stamp')} ")
                out.time = out.time or (at.stamp if at else None)
                if r.group("host") != "-":
                    out.host = out.host or r.group("host")
                out.app = r.group("app")
                rest = rest[r.end() :]
            out.text = rest
            continue
        m = _PDSH.match(t)
        if m and (match_prefix(t, m.end()) or match_uptime(t, m.end()) or _FACILITY.match(t, m.end())):
            out.host = out.host or m.group("host")
            out.text = t[m.end() :]
            continue
        return out
    return out


def _kernel_prefix(text: str, pos: int) -> tuple[_Prefix, bool] | None:
    """The kernel-log prefix starting at `pos` (stamps, host, uptime, in any of the forms above) and
    whether it ends in "HOST kernel:" (the syslog header of the kernel's own line); None if none."""
    f = _FACILITY.match(text, pos)
    if f:
        pos = f.end()
    start = pos
    host: str | None = None
    stamp: Stamp | None = None
    user_space = header = False
    # A kubectl or collector stamp may stand before the syslog one: read stamps until a host or none.
    for _ in range(_MAX_LAYERS):
        at = match_prefix(text, pos)
        if at is None:
            break
        stamp, pos = _dated(stamp, at.stamp), at.end
        if at.form in ("syslog", "iso", "epoch"):  # followed by the host (dmesg's are not)
            h = _HOST.match(text, pos)
            if h:
                host, pos, header = h.group("host"), h.end(), True
                break
            if _USER_IDENT.match(text, pos) is not None:
                user_space = True
                break
    uptime = None
    up = match_uptime(text, pos)
    if up:
        uptime, pos = up
        if not header:  # journalctl -o short-monotonic: "[  219.470994] HOST kernel: "
            h = _HOST.match(text, pos)
            if h and h.end() > pos:
                host, pos, header = h.group("host"), h.end(), True
                up2 = match_uptime(text, pos)
                if up2:
                    pos = up2[1]
    if pos == start and f is None:
        return None
    return _Prefix(host=host, time=stamp, uptime_s=uptime, message=text[pos:], user_space=user_space), header


def split_prefix(line: str) -> _Prefix:
    """Host, time and uptime of a kernel line's prefix (any of the forms above, inside any of the
    collector framings above), and the message after it. A line that starts with none of them but
    quotes a kernel line ("... <stamp> HOST kernel: <message>", a monitoring alert) is read at the quote.
    """
    peeled = _peel(line.strip())
    text = peeled.text
    found = _kernel_prefix(text, 0)
    if found is None:
        # A quote: the first place a stamp starts that is followed by "HOST kernel:".
        for m in _QUOTE_START.finditer(text, 1):
            q = _kernel_prefix(text, m.start())
            if q is not None and q[1]:
                found = q
                break
    pre = found[0] if found else _Prefix(host=None, time=None, uptime_s=None, message=text)
    if peeled.app is not None and peeled.app not in ("kernel", "-") and not (found and found[1]):
        pre = replace(pre, user_space=True)  # RFC 5424 APP-NAME of a program
    return replace(pre, host=pre.host or peeled.host, time=_dated(peeled.time, pre.time))


def _dated(outer: Stamp | None, inner: Stamp | None) -> Stamp | None:
    """Of a framing's stamp and the one it wraps, the inner (the writer's time), unless only the
    outer names the year: a collector's RFC 3339 stamp is seconds from a yearless syslog one."""
    if inner is None:
        return outer
    if inner.year is None and inner.epoch_s is None and outer is not None and (outer.year or outer.epoch_s):
        return outer
    return inner


# Multi-line kernel messages, joined so that one message is one piece of evidence:
# - the NVIDIA driver prints a message of several lines as several "NVRM: " lines, the first naming the
#   GPU: "NVRM: GPU at PCI:%04x:%02x:%02x: %s" then "NVRM: GPU Board Serial Number: %s" (open GPU kernel
#   modules 570.x, src/nvidia/src/kernel/gpu/rc/kernel_rc.c, before the first Xid), and the lost-GPU
#   notice, one nv_printf of three lines before NV_ERR_GPU_IS_LOST: "NVRM: The NVIDIA GPU %04x:%02x:%02x.%x"
#   / "NVRM: (PCI ID: %04x:%04x) installed in this system has" / "NVRM: fallen off the bus and is not
#   responding to commands."; dmesg prints a record's later lines indented and unstamped, syslog and
#   journald each with its own prefix. A following NVRM line naming no PCI address of its own belongs
#   to the one that did;
# - PCIe AER (Linux 6.x drivers/pci/pcie/aer.c aer_print_error): "PCIe Bus Error: severity=%s, type=%s,
#   (%s)", then, indented under the same device prefix, "  device [%04x:%04x] error status/mask=%08x/%08x",
#   "   [%2d] %-22s%s" per status bit, "  TLP Header: ..." and "  Error of this Agent is reported first".
_NVRM_HEAD = re.compile(r"^NVRM: (?:GPU at PCI:|The NVIDIA GPU )[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}")
_BDF = re.compile(r"[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}")
_AER_HEAD = re.compile(r"^(?P<dev>\S+ [0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]: )(?:AER: )?PCIe Bus Error: severity=")


def _continuation(head: _Prefix, line: _Prefix) -> str | None:
    """The text `line` adds to the multi-line message `head` starts (see above), or None when it is
    no continuation of it."""
    if line.host != head.host:
        return None
    if _NVRM_HEAD.match(head.message):
        msg = line.message
        return msg.strip() if msg.startswith("NVRM: ") and _BDF.search(msg) is None else None
    aer = _AER_HEAD.match(head.message)
    if aer and line.message.startswith(aer.group("dev")):
        rest = line.message[len(aer.group("dev")) :]
        rest = rest.removeprefix("AER: ")  # newer kernels' dev_fmt puts "AER: " before the indent
        return rest.strip() if rest.startswith("  ") else None
    return None


def join_continuations(lines: Sequence[str]) -> list[tuple[int, str]]:
    """Each logical kernel message of `lines`: (index of its first line, that line with the messages of
    its continuation lines appended, space-separated). Continuation lines are not returned apart."""
    out: list[tuple[int, str]] = []
    head: _Prefix | None = None
    for i, raw in enumerate(lines):
        if not ("NVRM" in raw or "PCIe Bus Error" in raw or (head is not None and "  " in raw)):
            head = None  # the cheap path: most kernel lines start no message of either kind
            out.append((i, raw))
            continue
        pre = split_prefix(raw)
        more = _continuation(head, pre) if head is not None else None
        if more is not None:
            j, text = out[-1]
            out[-1] = (j, f"{text.rstrip()} {more}")
            continue
        head = pre if (_NVRM_HEAD.match(pre.message) or _AER_HEAD.match(pre.message)) else None
        out.append((i, raw))
    return out


def parse_kernel_line(line: str, default_node: str) -> ParsedKernelLine | None:
    """Parse one kernel log line; None when it is not a line trainmedic reads.

    Read: NVIDIA fault lines (Xid, SXid, fallen off the bus) and, as kind "other", hung-task / D-state
    report lines and call-trace frames. The node is the host the prefix names if that is a Slurm node
    name (schemas.ids), else `default_node`;
    `time`/`uptime_s` carry the prefix's stamp (schemas.timestamps.Stamp: a syslog one has no year).
    """
    nvidia = "NVRM" in line or "SXid" in line
    if not nvidia and not any(h in line for h in _KERNEL_TEXT_HINTS):
        return None
    pre = split_prefix(line)
    if pre.user_space:
        return None  # only the kernel's own lines are evidence about the node: a program's can be forged
    base = ParsedKernelLine(
        kind="other",
        node=pre.host if pre.host and is_node_name(pre.host) else default_node,
        text=line.strip(),
        host=pre.host,
        time=pre.time,
        uptime_s=pre.uptime_s,
    )
    if not nvidia:
        msg = pre.message
        return base if _HUNG_TASK.search(msg) or _D_STATE.search(msg) or _FRAME.search(msg) else None
    m = _XID.search(line)
    if m:
        pid_raw = (m.group("pid") or "").strip("'")
        return replace(
            base,
            kind="xid",
            xid=_small_int(m.group("xid")),
            pci_bus_id=m.group("pci"),
            pid=_small_int(pid_raw),
            process_name=(m.group("name") or None),
        )
    m = _SXID.search(line)
    if m:
        return replace(base, kind="sxid", xid=_small_int(m.group("xid")), pci_bus_id=m.group("pci"))
    m = _FALLEN.search(line)
    if m:
        return replace(base, kind="fallen_off_bus", pci_bus_id=m.group("pci"))
    if _FALLEN_SPLIT.search(line):
        return replace(base, kind="fallen_off_bus")
    return None


def to_event(
    parsed: ParsedKernelLine,
    seen_at: float,
    gpu_index: int | None = None,
    reader: Literal["kmsg", "journald", "file"] | None = None,
) -> KernelEvent:
    """The event to publish. Its node is a Slurm node name: a line's own host that is none (a
    garbled syslog host or _HOSTNAME) was replaced by the default node when parsed."""
    return KernelEvent(
        # The line's own text (with its kernel timestamp) identifies it: a re-read is a duplicate.
        event_id=stable_id("kern", parsed.node, parsed.text),
        event_time=seen_at,
        node=parsed.node,
        kind=parsed.kind,  # type: ignore[arg-type]
        xid=parsed.xid,
        pci_bus_id=parsed.pci_bus_id,
        gpu_index=gpu_index,
        pid=parsed.pid,
        process_name=parsed.process_name,
        text=parsed.text[:65536],
        # The evidence's provenance (schemas/events.py kernel_provenance): the ring buffer or
        # journald's kernel transport is the kernel's; a file ranks below it.
        reader=reader,
    )


class KernelLogProducer:
    """Follows a kernel log file and publishes each NVIDIA fault line."""

    def __init__(
        self,
        publisher: Publisher,
        path: Path,
        node: str | None = None,
        from_start: bool = False,
        gpu_index_of: Callable[[str], int | None] | None = None,
        resume: FilePosition | None = None,
        lookback_bytes: int = 0,
    ) -> None:
        self.publisher = publisher
        # Refused at start, not at the first fault line: a bad name would make every event unpublishable.
        self.node = check_node_name(node or socket.gethostname(), "node name of the kernel producer")
        self.follower = FileFollower(Path(path), from_start=from_start, resume=resume, lookback_bytes=lookback_bytes)
        self.gpu_index_of = gpu_index_of
        self.published = 0

    @property
    def position_key(self) -> str:
        return f"file:{self.follower.path}"

    def positions(self) -> dict[str, FilePosition]:
        pos = self.follower.position()
        return {self.position_key: pos} if pos is not None else {}

    def poll_once(self) -> int:
        now = time.time()
        count = 0
        lines = self.follower.poll()
        if lines:
            LINES_READ.labels("kernel").inc(len(lines))
        # A multi-line driver message is joined within one read (the lines of one record arrive together).
        for _, line in join_continuations(lines):
            parsed = parse_kernel_line(line, self.node)
            if parsed is None:
                continue
            # The node is the one this producer runs on, never the host a line names: in a
            # syslog-style file a local user's `logger -t kernel` line looks like the kernel's.
            parsed = replace(parsed, node=self.node)
            gpu = self.gpu_index_of(parsed.pci_bus_id) if self.gpu_index_of and parsed.pci_bus_id else None
            self.publisher.publish(NODE_KERNEL, to_event(parsed, now, gpu, reader="file"))
            count += 1
        self.published += count
        return count


def kmsg_message(record: str) -> str:
    """The message of a /dev/kmsg record ("pri,seq,usec,flags[,..];message")."""
    head, sep, message = record.partition(";")
    return message.rstrip("\n") if sep and "," in head else record.rstrip("\n")


def kmsg_seq_usec(record: str) -> tuple[int, int] | None:
    """(sequence number, microseconds since boot) of a /dev/kmsg record."""
    head = record.partition(";")[0].split(",")
    if len(head) < 3 or not (head[1].isascii() and head[1].isdigit() and head[2].isascii() and head[2].isdigit()):
        return None
    return int(head[1]), int(head[2])


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def uptime_s() -> float:
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def read_kmsg(
    path: str = "/dev/kmsg", after_seq: int | None = None, lookback_s: float = 0.0, idle_s: float | None = None
) -> Iterator[tuple[str, int | None]]:
    """(message, sequence number) of kernel records, from the ring buffer on, then as they arrive.

    Records up to `after_seq` (the last one handled before a restart, same boot) are skipped;
    without it, only records of the last `lookback_s` seconds of the ring buffer are read.
    With `idle_s`, ("", None) comes after each `idle_s` without a record, so the caller's loop
    goes round (its liveness beat, its stop check) on a quiet kernel too.
    """
    oldest_usec = max(0.0, uptime_s() - lookback_s) * 1e6
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            if idle_s is not None and not _readable(fd, idle_s):
                yield "", None
                continue
            try:
                raw = os.read(fd, 8192)
            except BrokenPipeError:
                continue  # records were overwritten before we read them: the next read resyncs
            record = raw.decode("utf-8", errors="replace")
            head = kmsg_seq_usec(record)
            if head is not None:
                seq, usec = head
                if (after_seq is not None and seq <= after_seq) or (after_seq is None and usec < oldest_usec):
                    continue
            yield kmsg_message(record), head[0] if head else None
    finally:
        os.close(fd)


def journal_message(line: str) -> tuple[str, str | None] | None:
    """(message, hostname) from one `journalctl -o json` line; None when it is not an entry."""
    entry = _journal_entry(line)
    return None if entry is None else _entry_message(entry)


def _entry_message(entry: dict[str, Any]) -> tuple[str, str | None] | None:
    msg = entry.get("MESSAGE") if isinstance(entry, dict) else None
    if isinstance(msg, list):  # journald stores non-UTF-8 messages as byte arrays
        if not all(type(b) is int and 0 <= b <= 255 for b in msg):
            return None  # not a byte array (bytes() would raise): not an entry we can read
        msg = bytes(msg).decode("utf-8", errors="replace")
    if not isinstance(msg, str):
        return None
    host = entry.get("_HOSTNAME")
    return msg, host if isinstance(host, str) else None


def _journal_entry(line: str) -> dict[str, Any] | None:
    try:
        entry = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return entry if isinstance(entry, dict) else None


def journal_argv(cursor: str | None, lookback_s: float) -> list[str]:
    """Resume after the saved cursor; without one, this boot's last `lookback_s` seconds."""
    argv = ["journalctl", "-k", "-f", "-o", "json"]
    if cursor:
        return [*argv, "--after-cursor", cursor]
    return [*argv, "-b", "--since", f"-{max(0, int(lookback_s))}s"]


def read_journal(
    cursor: str | None = None, lookback_s: float = 0.0, idle_s: float | None = None
) -> Iterator[tuple[str, str | None, str | None]]:
    """(message, hostname, journal cursor) of kernel entries; with `idle_s`, ("", None, None)
    after each `idle_s` without output (as read_kmsg)."""
    proc = subprocess.Popen(journal_argv(cursor, lookback_s), stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        for line in _lines_of(proc.stdout.fileno(), idle_s):
            if line is None:
                yield "", None, None
                continue
            entry = _journal_entry(line)
            parsed = None if entry is None else _entry_message(entry)
            if entry is not None and parsed is not None:
                c = entry.get("__CURSOR")
                yield parsed[0], parsed[1], c if isinstance(c, str) else None
    finally:
        proc.terminate()


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` has data (or its end) within the timeout. poll(), not select(): select()
    refuses a descriptor numbered 1024 or more, which a busy process reaches."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(timeout_s * 1000))


def _lines_of(fd: int, idle_s: float | None) -> Iterator[str | None]:
    """Lines from a pipe until its end; None after each `idle_s` without data. Read unbuffered
    by hand: a buffered reader can hold whole lines that select() no longer sees."""
    partial = b""
    while True:
        if idle_s is not None and not _readable(fd, idle_s):
            yield None
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            if partial:
                yield partial.decode("utf-8", errors="replace")
            return
        *lines, partial = (partial + chunk).split(b"\n")
        for raw in lines:
            yield raw.decode("utf-8", errors="replace") + "\n"


class KernelStreamProducer:
    """Publishes NVIDIA fault lines from a stream of kernel messages (kmsg, journald)."""

    def __init__(
        self,
        publisher: Publisher,
        node: str | None = None,
        gpu_index_of: Callable[[str], int | None] | None = None,
        reader: Literal["kmsg", "journald"] = "kmsg",
    ) -> None:
        self.publisher = publisher
        self.node = check_node_name(node or socket.gethostname(), "node name of the kernel producer")
        self.gpu_index_of = gpu_index_of
        self.reader: Literal["kmsg", "journald"] = reader
        self.published = 0

    def handle(self, message: str, host: str | None = None) -> bool:
        if not message:
            return False  # an idle wake-up of the reader (read_kmsg / read_journal idle_s), no line
        LINES_READ.labels("kernel").inc()
        # journald's _HOSTNAME when it is a node name; a garbled one is this producer's node.
        parsed = parse_kernel_line(message, host if host and is_node_name(host) else self.node)
        if parsed is None:
            return False
        gpu = self.gpu_index_of(parsed.pci_bus_id) if self.gpu_index_of and parsed.pci_bus_id else None
        self.publisher.publish(NODE_KERNEL, to_event(parsed, time.time(), gpu, reader=self.reader))
        self.published += 1
        return True


def pci_key(bus_id: str) -> str:
    """'00000000:3B:00.0' (NVML) and '0000:3b:00' (kernel Xid lines) -> '3b:00'."""
    parts = bus_id.lower().split(".")[0].split(":")
    return ":".join(parts[-2:])


def nvml_gpu_index(collector: Any) -> Callable[[str], int | None]:
    """Map a kernel line's PCI bus id to the GPU index NVML reports for it."""
    by_pci = {pci_key(g.pci_bus_id): g.index for g in collector.gpus if g.pci_bus_id}
    return lambda bus_id: by_pci.get(pci_key(bus_id))
