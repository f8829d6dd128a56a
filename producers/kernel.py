"""Kernel log reader: NVRM Xid / SXid / fallen-off-the-bus lines -> node.kernel."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from producers.follow import FileFollower
from producers.publisher import Publisher
from schemas.events import KernelEvent
from schemas.ids import stable_id
from schemas.topics import NODE_KERNEL

# "Mar  3 12:00:00 gpu02 kernel: ..." or ISO "2024-03-03T12:00:00.123+00:00 gpu02 kernel: ..."
_SYSLOG = re.compile(
    r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT\S+)\s+(?P<host>[A-Za-z0-9._-]+)\s+kernel:\s?"
)
# Numbers are ASCII [0-9]: \d (and str.isdigit) also accept digits int() refuses, like '²'.
_XID = re.compile(
    r"NVRM: Xid \(PCI:(?P<pci>[0-9A-Fa-f:.]+)\): (?P<xid>[0-9]+),\s*(?:pid=(?P<pid>'?<?[\w]+>?'?),\s*)?"
    r"(?:name=(?P<name>[^,]*),\s*)?"
)
_SXID = re.compile(r"SXid \(PCI:(?P<pci>[0-9A-Fa-f:.]+)\): (?P<xid>[0-9]+)")
_FALLEN = re.compile(
    r"NVRM: GPU (?:at PCI:)?(?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.\d)?):? .*fallen off the bus"
)
# Xid codes and pids are small (pid_max is at most 2**22): a longer number is garbage, and past
# 64 bits it could not even be published (orjson refuses it), so it becomes None.
_MAX_FIELD_INT = 2**31 - 1
_FIELD_DIGITS = len(str(_MAX_FIELD_INT))
# KernelEvent.node's bound; Linux host names are at most 64 characters.
MAX_NODE_CHARS = 128


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


def parse_kernel_line(line: str, default_node: str) -> ParsedKernelLine | None:
    """Parse one kernel log line; None when it is not an NVIDIA fault line."""
    if "NVRM" not in line and "SXid" not in line:
        return None
    node = default_node
    host = _SYSLOG.match(line)
    if host:
        node = host.group("host")
    text = line.strip()
    m = _XID.search(line)
    if m:
        pid_raw = (m.group("pid") or "").strip("'")
        return ParsedKernelLine(
            kind="xid",
            node=node,
            text=text,
            xid=_small_int(m.group("xid")),
            pci_bus_id=m.group("pci"),
            pid=_small_int(pid_raw),
            process_name=(m.group("name") or None),
        )
    m = _SXID.search(line)
    if m:
        return ParsedKernelLine(
            kind="sxid", node=node, text=text, xid=_small_int(m.group("xid")), pci_bus_id=m.group("pci")
        )
    m = _FALLEN.search(line)
    if m:
        return ParsedKernelLine(kind="fallen_off_bus", node=node, text=text, pci_bus_id=m.group("pci"))
    return None


def to_event(parsed: ParsedKernelLine, seen_at: float, gpu_index: int | None = None) -> KernelEvent:
    """The event to publish. A node name over KernelEvent's 128 characters (a garbled syslog
    host or _HOSTNAME) is cut to fit rather than raising: the fault line is still worth
    publishing, and the cut name matches no real node, so no action lands on a wrong one."""
    return KernelEvent(
        # The line's own text (with its kernel timestamp) identifies it: a re-read is a duplicate.
        event_id=stable_id("kern", parsed.node, parsed.text),
        event_time=seen_at,
        node=parsed.node[:MAX_NODE_CHARS],
        kind=parsed.kind,  # type: ignore[arg-type]
        xid=parsed.xid,
        pci_bus_id=parsed.pci_bus_id,
        gpu_index=gpu_index,
        pid=parsed.pid,
        process_name=parsed.process_name,
        text=parsed.text[:65536],
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
    ) -> None:
        self.publisher = publisher
        self.node = node or socket.gethostname()
        self.follower = FileFollower(Path(path), from_start=from_start)
        self.gpu_index_of = gpu_index_of
        self.published = 0

    def poll_once(self) -> int:
        now = time.time()
        count = 0
        for line in self.follower.poll():
            parsed = parse_kernel_line(line, self.node)
            if parsed is None:
                continue
            gpu = self.gpu_index_of(parsed.pci_bus_id) if self.gpu_index_of and parsed.pci_bus_id else None
            self.publisher.publish(NODE_KERNEL, to_event(parsed, now, gpu))
            count += 1
        self.published += count
        return count


def kmsg_message(record: str) -> str:
    """The message of a /dev/kmsg record ("pri,seq,usec,flags[,..];message")."""
    head, sep, message = record.partition(";")
    return message.rstrip("\n") if sep and "," in head else record.rstrip("\n")


def read_kmsg(path: str = "/dev/kmsg") -> Iterator[str]:
    """Kernel messages as they arrive; each read() of /dev/kmsg returns one record."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.lseek(fd, 0, os.SEEK_END)  # new messages only; the ring buffer's past is dmesg's job
        while True:
            try:
                record = os.read(fd, 8192)
            except BrokenPipeError:
                continue  # records were overwritten before we read them: the next read resyncs
            yield kmsg_message(record.decode("utf-8", errors="replace"))
    finally:
        os.close(fd)


def journal_message(line: str) -> tuple[str, str | None] | None:
    """(message, hostname) from one `journalctl -o json` line; None when it is not an entry."""
    try:
        entry = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    msg = entry.get("MESSAGE") if isinstance(entry, dict) else None
    if isinstance(msg, list):  # journald stores non-UTF-8 messages as byte arrays
        if not all(type(b) is int and 0 <= b <= 255 for b in msg):
            return None  # not a byte array (bytes() would raise): not an entry we can read
        msg = bytes(msg).decode("utf-8", errors="replace")
    if not isinstance(msg, str):
        return None
    host = entry.get("_HOSTNAME")
    return msg, host if isinstance(host, str) else None


def read_journal() -> Iterator[tuple[str, str | None]]:
    proc = subprocess.Popen(
        ["journalctl", "-k", "-f", "-o", "json", "--since", "now"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            parsed = journal_message(line)
            if parsed is not None:
                yield parsed
    finally:
        proc.terminate()


class KernelStreamProducer:
    """Publishes NVIDIA fault lines from a stream of kernel messages (kmsg, journald)."""

    def __init__(
        self, publisher: Publisher, node: str | None = None, gpu_index_of: Callable[[str], int | None] | None = None
    ) -> None:
        self.publisher = publisher
        self.node = node or socket.gethostname()
        self.gpu_index_of = gpu_index_of
        self.published = 0

    def handle(self, message: str, host: str | None = None) -> bool:
        parsed = parse_kernel_line(message, host or self.node)
        if parsed is None:
            return False
        gpu = self.gpu_index_of(parsed.pci_bus_id) if self.gpu_index_of and parsed.pci_bus_id else None
        self.publisher.publish(NODE_KERNEL, to_event(parsed, time.time(), gpu))
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
