"""`trainmedic diagnose`: the same detectors and attribution, offline, over log files.

Files named kern.log*, dmesg*, syslog* (or messages*) are kernel logs; every
other file is a job log (stdout/stderr, per-rank logs). No broker is needed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producers.joblogs import split_rank_prefix
from producers.kernel import parse_kernel_line, to_event
from schemas.events import Anomaly, LogBatch, LogLine
from streams.attribution import Attributor
from streams.detectors.signatures import SignatureDetector
from streams.detectors.xid import XidDetector

OFFLINE_JOB = "offline"
_NO_HOST = "-"
_KERNEL_NAMES = re.compile(r"(^|[_.-])(kern\.log|dmesg|syslog|messages)")
# NCCL's own prefix "host:pid:tid [gpu] NCCL ..." names the node that wrote the line.
_NCCL_HOST = re.compile(r"^(?P<host>[A-Za-z0-9][A-Za-z0-9._-]*):\d+:\d+ \[\d+\] NCCL")


class DiagnoseError(ValueError):
    pass


def is_kernel_log(path: Path) -> bool:
    return bool(_KERNEL_NAMES.search(path.name))


@dataclass
class _Clock:
    """Offline there is no arrival time: file order stands in for it."""

    t: float = 0.0

    def tick(self) -> float:
        self.t += 0.001
        return self.t


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_bytes().decode("utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise DiagnoseError(f"{path}: cannot read: {exc.strerror}") from None


def _kernel_anomalies(path: Path, clock: _Clock, xids: XidDetector) -> list[Anomaly]:
    out = []
    for line in _read_lines(path):
        parsed = parse_kernel_line(line, default_node=_NO_HOST)
        if parsed is None:
            continue
        for a in xids.detect(to_event(parsed, clock.tick())):
            # Plain dmesg output names no host: then the culprit node is unknown, not "unknown-node".
            node = None if a.node == _NO_HOST else a.node
            out.append(a.model_copy(update={"job_id": OFFLINE_JOB, "node": node}))
    return out


def _job_anomalies(path: Path, clock: _Clock, detector: SignatureDetector) -> list[Anomaly]:
    lines = []
    for i, raw in enumerate(_read_lines(path), 1):
        r = split_rank_prefix(raw)
        m = _NCCL_HOST.match(r.text)
        lines.append(
            LogLine(text=r.text[:65536], ts=clock.tick(), rank=r.rank, node=m.group("host") if m else None, lineno=i)
        )
    batch = LogBatch(event_id=f"diag-{path}", event_time=0.0, job_id=OFFLINE_JOB, source=str(path), lines=lines)
    return detector.detect(batch)


def diagnose_paths(paths: Sequence[Path]) -> dict[str, Any]:
    if not paths:
        raise DiagnoseError("no files given")
    clock = _Clock()
    detector, xids = SignatureDetector(), XidDetector()
    anomalies: list[Anomaly] = []
    for path in paths:
        if not path.is_file():
            raise DiagnoseError(f"{path}: no such file")
        anomalies += (
            _kernel_anomalies(path, clock, xids) if is_kernel_log(path) else _job_anomalies(path, clock, detector)
        )
    files = [str(p) for p in paths]
    if not anomalies:
        return {
            "category": "healthy",
            "culprit": None,
            "culprit_rank": None,
            "action": "none",
            "confidence": 0.9,
            "explanation": "no fault signature found",
            "evidence": [],
            "files": files,
        }
    attributor = Attributor(settle_s=0.0, collateral_wait_s=0.0)
    for a in anomalies:
        attributor.add(a, now=0.0)
    incidents = attributor.flush(now=1.0)
    if len(incidents) != 1:  # all anomalies carry the offline job id: one group
        raise DiagnoseError(f"internal: expected one incident, got {len(incidents)}")
    inc = incidents[0]
    return {
        "category": inc.category,
        "culprit": inc.culprit_node,
        "culprit_rank": inc.culprit_rank,
        "action": inc.recommended_action,
        "confidence": inc.confidence,
        "explanation": inc.explanation,
        "evidence": [
            {
                "source": e.source,
                "signature": e.signature,
                "node": e.node,
                "rank": e.rank,
                "role": e.role,
                "line": e.line,
            }
            for e in inc.evidence
        ],
        "files": files,
    }
