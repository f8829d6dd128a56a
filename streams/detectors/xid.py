"""Kernel-event detector: Xid codes classified by the catalog's resolution buckets."""

from __future__ import annotations

from collections.abc import Mapping

from schemas.events import Anomaly, KernelEvent
from schemas.ids import stable_id
from streams.catalog import XidEntry, default_xids


class XidDetector:
    name = "xid"

    def __init__(self, xids: Mapping[int, XidEntry] | None = None) -> None:
        self._xids = default_xids() if xids is None else xids

    def detect(self, event: KernelEvent) -> list[Anomaly]:
        if event.kind == "fallen_off_bus" and event.xid is None:
            entry = self._xids.get(79)
        elif event.kind == "xid" and event.xid is not None:
            entry = self._xids.get(event.xid)
        else:
            return []
        if entry is None:
            return [self._unknown(event)]
        if entry.bucket == "IGNORE" and entry.severity == "info":
            return []
        gpu = f" on GPU {event.gpu_index}" if event.gpu_index is not None else ""
        return [
            Anomaly(
                event_id=stable_id("anm", event.event_id, entry.xid),
                event_time=event.event_time,
                detector=self.name,
                signature=f"xid_{entry.xid}",
                category=entry.category,
                severity=entry.severity,
                role=entry.role,
                isolate=entry.isolate,
                source="kernel",
                node=event.node,
                line=event.text[:2000],
                meaning=f"Xid {entry.xid} ({entry.name}){gpu}: {entry.meaning}; NVIDIA resolution {entry.bucket}",
            )
        ]

    def _unknown(self, event: KernelEvent) -> Anomaly:
        # An Xid we have no entry for is still worth a human's look, never an action.
        return Anomaly(
            event_id=stable_id("anm", event.event_id, event.xid),
            event_time=event.event_time,
            detector=self.name,
            signature=f"xid_{event.xid}",
            category="gpu_hardware",
            severity="warning",
            role="root",
            isolate=False,
            source="kernel",
            node=event.node,
            line=event.text[:2000],
            meaning=f"Xid {event.xid}: not in the catalog; see NVIDIA's Xid catalog",
        )
