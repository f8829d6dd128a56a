"""Kernel-event detector: Xid and NVSwitch SXid codes classified by their catalogs' resolution buckets."""

from __future__ import annotations

import re
from collections.abc import Mapping

from schemas.events import Anomaly, KernelEvent, kernel_provenance
from schemas.ids import stable_id
from schemas.vocab import Role, Severity
from streams.catalog import SxidCatalog, XidBucket, XidEntry, default_sxids, default_xid_catalog

# The NVLink5 Xids (144-150) say in the line whether the condition is fatal:
#   "NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 ...)".
_XID_FATALITY = re.compile(r"NVRM: Xid \([^)]*\): [0-9]+, \S+ (?P<word>Fatal|Nonfatal)\b")
# SXid lines: "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 ..."; detail lines of
# the same event ("..., Data {0x...}", "..., Severity 0 Engine instance ...") carry no such word.
_SXID_FATALITY = re.compile(r"SXid \([^)]*\): [0-9]+, (?P<word>Fatal|Non-fatal)\b")
_SXID_LINK = re.compile(r"SXid \([^)]*\): [0-9]+, (?:Fatal|Non-fatal), Link (?P<link>-?[0-9]+)")


def judge_xid(entry: XidEntry, bucket: XidBucket | None, text: str) -> tuple[Severity, Role, bool, str]:
    """(severity, role, isolate, what the line said) of one Xid: the catalog's entry, or its bucket's
    fatal / non-fatal override when the line says which (the NVLink5 Xids). Every path that reports
    an Xid - the kernel line, NVSentinel's message - judges it here."""
    m = _XID_FATALITY.search(text)
    if bucket is not None and m:
        override = bucket.when_fatal if m.group("word") == "Fatal" else bucket.when_nonfatal
        if override is not None:
            return override.severity, override.role, override.isolate, f", reported {m.group('word')}"
    return entry.severity, entry.role, entry.isolate, ""


class XidDetector:
    """GPU Xids (kind xid, fallen_off_bus) through xid.yaml's buckets."""

    name = "xid"

    def __init__(
        self, xids: Mapping[int, XidEntry] | None = None, buckets: Mapping[str, XidBucket] | None = None
    ) -> None:
        catalog = default_xid_catalog() if xids is None or buckets is None else None
        self._xids = xids if xids is not None else catalog.xids if catalog else {}
        self._buckets = buckets if buckets is not None else catalog.buckets if catalog else {}

    def detect(self, event: KernelEvent) -> list[Anomaly]:
        if event.kind == "fallen_off_bus" and event.xid is None:
            entry = self._xids.get(79)
        elif event.kind == "xid" and event.xid is not None:
            entry = self._xids.get(event.xid)
        else:
            return []
        if entry is None:
            return [self._unknown(event)]
        bucket = self._buckets.get(entry.bucket)
        severity, role, isolate, said = judge_xid(entry, bucket, event.text)
        if not entry.emit:
            return []
        gpu = f" on GPU {event.gpu_index}" if event.gpu_index is not None else ""
        guidance = f" ({bucket.guidance})" if bucket is not None else ""
        return [
            Anomaly(
                event_id=stable_id("anm", event.event_id, entry.xid),
                event_time=event.event_time,
                detector=self.name,
                signature=f"xid_{entry.xid}",
                category=entry.category,
                severity=severity,
                role=role,
                isolate=isolate,
                source="kernel",
                provenance=kernel_provenance(event),
                node=event.node,
                gpu=event.gpu_index,  # the culprit GPU a reset_gpu remediation resets
                line=event.text[:2000],
                meaning=(
                    f"Xid {entry.xid} ({entry.name}){gpu}{said}: {entry.meaning}; "
                    f"NVIDIA resolution {entry.bucket}{guidance}"
                )[:4000],
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
            provenance=kernel_provenance(event),
            node=event.node,
            line=event.text[:2000],
            meaning=f"Xid {event.xid}: not in the catalog; see NVIDIA's Xid catalog",
        )


class SxidDetector:
    """NVSwitch SXids (kind sxid) through sxid.yaml: interconnect on the node that logged them."""

    name = "sxid"

    def __init__(self, sxids: SxidCatalog | None = None) -> None:
        self._sxids = sxids if sxids is not None else default_sxids()

    def detect(self, event: KernelEvent) -> list[Anomaly]:
        if event.kind != "sxid" or event.xid is None:
            return []
        code = event.xid
        entry = self._sxids.sxids.get(code)
        m = _SXID_FATALITY.search(event.text)
        fatal = (m.group("word") == "Fatal") if m else (entry.fatal if entry else False)
        link = _SXID_LINK.search(event.text)
        where = f" on NVSwitch {event.pci_bus_id}" if event.pci_bus_id else ""
        where += f" link {link.group('link')}" if link else ""
        if entry is None:
            name, bucket_name, guidance = "not in the catalog", "unknown", "see NVIDIA's SXid table"
        else:
            bucket = self._sxids.buckets[entry.bucket]
            if not fatal and not bucket.emit:
                return []
            name, bucket_name, guidance = entry.name or "unnamed", entry.bucket, bucket.guidance
        return [
            Anomaly(
                event_id=stable_id("anm", event.event_id, "sxid", code),
                event_time=event.event_time,
                detector=self.name,
                signature=f"sxid_{code}",
                category="interconnect",
                severity="critical" if fatal else "warning",
                role="root",
                # A fatal NVSwitch error takes the node's NVLink fabric down: drain it. Non-fatal: a look.
                isolate=fatal,
                source="kernel",
                provenance=kernel_provenance(event),
                node=event.node,
                line=event.text[:2000],
                meaning=(
                    f"NVSwitch SXid {code} ({name}){where}, {'fatal' if fatal else 'non-fatal'}: "
                    f"NVIDIA resolution {bucket_name} ({guidance})"
                ),
            )
        ]
