"""A job's GPU samples gathered for a few seconds, then sent as one record on `gpu.samples.by_job`.

The streams re-key each node's GPU samples to the jobs running on the node, for the jobs' hang
and straggler detectors. One record per sample made the repartition topic the worker's busiest
output and second-busiest input: every record costs a produce, a fetch, Faust's per-event work
and a decode, whatever it carries. A job's samples of a few seconds go out as one record instead
(a 16-node job: one record where there were 16). The samples are spliced in as they were read
(`orjson.Fragment`), not encoded again.

What it costs: a GPU reading reaches the hang and straggler detectors up to `BATCH_EVERY_S`
later. Both judge windows of tens of seconds; a lost GPU goes out at once (`urgent`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import orjson

from schemas.events import SCHEMA_VERSION, GpuSample
from schemas.ids import current_cluster, stable_id
from streams.detectors.straggler import GPU_SAMPLE_EVERY_S

#: How long a job's samples are gathered: the straggler detector keeps one reading per node this
#: often, so a batch carries about one reading of each of the job's nodes.
BATCH_EVERY_S = GPU_SAMPLE_EVERY_S
#: Samples per record at most, in bytes: a 512-node job's readings go out in several records.
MAX_BATCH_BYTES = 256_000


@dataclass
class _Pending:
    samples: list[bytes] = field(default_factory=list)
    first_id: str = ""
    newest: float = 0.0
    size: int = 0


class GpuBatches:
    """Job id -> the GPU samples gathered for it since its last record."""

    def __init__(self, max_bytes: int = MAX_BATCH_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._pending: dict[str, _Pending] = {}
        self._full: list[tuple[str, bytes]] = []  # records made when a job's batch reached max_bytes

    def add(self, job_id: str, sample: GpuSample, payload: bytes) -> None:
        """`payload`: the sample as read, in the current schema version (schemas.codec.decode_as_read)."""
        p = self._pending.get(job_id)
        if p is not None and p.samples and p.size + len(payload) > self.max_bytes:
            self._full.append((job_id, self._record(job_id, p)))
            p = None
        if p is None:
            p = self._pending[job_id] = _Pending(first_id=sample.event_id)
        p.samples.append(payload)
        p.size += len(payload) + 1
        p.newest = max(p.newest, sample.event_time)

    @staticmethod
    def urgent(sample: GpuSample) -> bool:
        """A sample that must not wait for the next batch: a GPU lost."""
        return any(g.lost for g in sample.gpus)

    def take(self, job_id: str | None = None) -> list[tuple[str, bytes]]:
        """(job id, record payload) of every job's gathered samples, or only `job_id`'s; what is
        taken is gone from here."""
        out = self._full
        self._full = []
        if job_id is not None:
            out, self._full = [r for r in out if r[0] == job_id], [r for r in out if r[0] != job_id]
            p = self._pending.pop(job_id, None)
            return out + ([(job_id, self._record(job_id, p))] if p is not None else [])
        pending, self._pending = self._pending, {}
        return out + [(job, self._record(job, p)) for job, p in pending.items()]

    @staticmethod
    def _record(job_id: str, p: _Pending) -> bytes:
        return orjson.dumps(
            {
                "schema_version": SCHEMA_VERSION,
                "event_id": stable_id("gpub", job_id, p.first_id),
                "event_time": p.newest,
                "produced_at": time.time(),
                "cluster": current_cluster(),
                "job_id": job_id,
                "samples": [orjson.Fragment(s) for s in p.samples],
            }
        )
