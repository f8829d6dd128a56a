"""Log-signature detector: catalog patterns over a job's log lines.

The catalog is signatures.yaml (entries written from real failure reports) together with the
emitters' own vocabularies (vocabulary.yaml: NCCL, PyTorch, CUDA, Slurm, ... messages read from their
source), in `detector_order`: a specific entry of either beats a fallback (a bare exit code, any Python
exception). Named groups of a pattern attribute the hit: `node`, `rank` and `gpu` override the line's,
every other group becomes a fact (e.g. a collective's `timeout_ms`). Collateral hits (a
collective timeout) carry what the job's other ranks were last doing (ActivityTracker).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from schemas.events import Anomaly, LogBatch, LogLine
from schemas.ids import is_node_name, node_for_host, stable_id
from streams.catalog import Signature, default_signatures
from streams.catalog.vocabulary import default_vocabulary_signatures, detector_order
from streams.detectors.activity import ActivityTracker
from streams.detectors.prefilter import may_match

MAX_LINE_IN_ANOMALY = 2000
_ATTRIBUTION_GROUPS = ("node", "rank", "gpu")
MAX_FACT_CHARS = 200


@dataclass(frozen=True)
class _Compiled:
    sig: Signature
    regex: re.Pattern[str]
    may_match: Callable[[str], bool] | None  # False: the line lacks text every match contains


class SignatureDetector:
    name = "signatures"

    def __init__(
        self, signatures: Sequence[Signature] | None = None, vocabulary: Sequence[Signature] | None = None
    ) -> None:
        # The vocabulary stays when a caller narrows signatures.yaml (leave-one-source-out): it is
        # derived from the emitters' code, not from any report. Pass vocabulary=() to leave it out.
        sigs = detector_order(
            default_signatures() if signatures is None else signatures,
            default_vocabulary_signatures() if vocabulary is None else vocabulary,
        )
        self._compiled = [_Compiled(s, re.compile(s.pattern), may_match(s.pattern)) for s in sigs]
        self.activity = ActivityTracker()

    def match_line(self, text: str) -> tuple[Signature, re.Match[str]] | None:
        """The first catalog entry matching the line (catalog order is priority)."""
        for c in self._compiled:
            if c.may_match is not None and not c.may_match(text):
                continue
            m = c.regex.search(text)
            if m:
                return c.sig, m
        return None

    def detect(self, batch: LogBatch) -> list[Anomaly]:
        return list(self._detect_lines(batch, batch.lines))

    def _detect_lines(self, batch: LogBatch, lines: Iterable[LogLine]) -> Iterable[Anomaly]:
        for line in lines:
            hit = self.match_line(line.text)
            if hit is None:
                self.activity.observe(batch.job_id, line, line.node)
                continue
            sig, m = hit
            groups = m.groupdict()
            # A host the line names counts only if it is a Slurm node name (schemas.ids): "Node failure on -".
            named = groups.get("node")
            node = named if named and is_node_name(named) else line.node
            if node and batch.job_nodes:
                # A host the text names by its FQDN is the job's node of that short name.
                node = node_for_host(node, batch.job_nodes) or node
            rank = int(groups["rank"]) if groups.get("rank") else line.rank
            gpu = int(groups["gpu"]) if groups.get("gpu") else line.gpu
            facts = {k: v[:MAX_FACT_CHARS] for k, v in groups.items() if v is not None and k not in _ATTRIBUTION_GROUPS}
            yield Anomaly(
                event_id=stable_id("anm", batch.job_id, batch.source, line.lineno, sig.id),
                event_time=line.ts,
                detector=self.name,
                signature=sig.id,
                category=sig.category,
                severity=sig.severity,
                role=sig.role,
                isolate=sig.isolate,
                source="job_log",
                provenance="job",
                job_id=batch.job_id,
                node=node,
                rank=rank,
                gpu=gpu,
                partition=batch.partition,
                job_nodes=list(batch.job_nodes),
                line=line.text[:MAX_LINE_IN_ANOMALY],
                meaning=sig.meaning,
                facts=facts,
                activity=self.activity.peers(batch.job_id, rank, node) if sig.role == "collateral" else [],
            )
