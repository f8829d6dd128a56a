"""Kernel evidence beyond Xid: NVSwitch SXids, and hung-task / D-state reports with the filesystem they name.

Called like XidDetector: one KernelEvent in, anomalies out. A hung-task report spans several kernel
lines (header, D-state line, "Call Trace:", one frame per line), each published as its own event, so
this detector keeps, per node, the one report still open: at most `report.max_nodes` nodes, a report
closing after `report.max_frames` frames or `report.window_s` seconds. Patterns, limits and verdicts
are data (streams/catalog/kernel_signatures.yaml).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

from schemas.events import Anomaly, KernelEvent, kernel_provenance
from schemas.ids import stable_id
from streams.catalog import KernelSignatures, ReportVerdict, default_kernel_signatures
from streams.detectors.xid import SxidDetector

_SECONDS = re.compile(r"blocked for more than (?P<s>[0-9]{1,9}) seconds")


@dataclass
class _Report:
    """One node's open hung-task / D-state report."""

    opened_at: float
    task: str
    pid: str
    header_id: str
    blocked_s: str | None
    frames: int = 0
    filesystem: str | None = None


class KernelTextDetector:
    name = "kernel_text"

    def __init__(self, signatures: KernelSignatures | None = None, sxid: SxidDetector | None = None) -> None:
        self._sig = signatures or default_kernel_signatures()
        self._headers = [(h.id, re.compile(h.pattern), h.meaning) for h in self._sig.headers]
        self._frame = re.compile(self._sig.frame)
        self._filesystems = [(f.id, f.name, re.compile(f.frame)) for f in self._sig.filesystems]
        self._sxid = sxid or SxidDetector()
        self._open: OrderedDict[str, _Report] = OrderedDict()

    @property
    def open_reports(self) -> int:
        return len(self._open)

    def detect(self, event: KernelEvent) -> list[Anomaly]:
        if event.kind == "sxid":
            return self._sxid.detect(event)
        if event.kind != "other":
            return []
        text = event.text
        for header_id, pattern, meaning in self._headers:
            m = pattern.search(text)
            if m:
                return self._header(event, header_id, meaning, m.group("task"), m.group("pid"))
        if self._frame.search(text):
            return self._frame_line(event)
        return []

    def _header(self, event: KernelEvent, header_id: str, meaning: str, task: str, pid: str) -> list[Anomaly]:
        report = self._live(event)
        if report is not None and header_id != "hung_task" and (report.pid == pid or report.frames == 0):
            return []  # the D-state line inside a hung-task report names the same task: same report
        seconds = _SECONDS.search(event.text)
        report = _Report(
            opened_at=event.event_time,
            task=task.strip(),
            pid=pid,
            header_id=header_id,
            blocked_s=seconds.group("s") if seconds else None,
        )
        self._open.pop(event.node, None)
        self._open[event.node] = report
        while len(self._open) > self._sig.report.max_nodes:
            self._open.popitem(last=False)
        what = f"task {report.task}:{report.pid}"
        if report.blocked_s:
            what += f" blocked for more than {report.blocked_s} s"
        return [
            self._anomaly(
                event,
                "hung_task" if header_id == "hung_task" else "blocked_task",
                self._sig.report.no_filesystem,
                f"{what} ({meaning}); no filesystem frame seen in its trace: the node itself is suspect",
            )
        ]

    def _frame_line(self, event: KernelEvent) -> list[Anomaly]:
        report = self._live(event)
        if report is None:
            return []
        report.frames += 1
        if report.frames >= self._sig.report.max_frames:
            del self._open[event.node]
        if report.filesystem is not None:
            return []
        for fs_id, fs_name, pattern in self._filesystems:
            if pattern.search(event.text):
                report.filesystem = fs_id
                what = f"task {report.task}:{report.pid}"
                if report.blocked_s:
                    what += f" blocked for more than {report.blocked_s} s"
                return [
                    self._anomaly(
                        event,
                        f"hung_task_{fs_id}",
                        self._sig.report.storage,
                        f"{what} waiting in {fs_name}: its call trace is in the {fs_name} client "
                        f"(frame: {event.text.strip()[-160:]}); storage on this node",
                    )
                ]
        return []

    def _live(self, event: KernelEvent) -> _Report | None:
        """The node's open report, if it is still within its window."""
        report = self._open.get(event.node)
        if report is None:
            return None
        if not 0 <= event.event_time - report.opened_at <= self._sig.report.window_s:
            del self._open[event.node]
            return None
        return report

    def _anomaly(self, event: KernelEvent, signature: str, verdict: ReportVerdict, meaning: str) -> Anomaly:
        return Anomaly(
            event_id=stable_id("anm", event.event_id, signature),
            event_time=event.event_time,
            detector=self.name,
            signature=signature,
            category=verdict.category,
            severity=verdict.severity,
            role=verdict.role,
            isolate=False,
            source="kernel",
            provenance=kernel_provenance(event),
            node=event.node,
            line=event.text[:2000],
            meaning=meaning,
        )
