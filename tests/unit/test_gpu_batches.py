"""A job's GPU samples gathered into one gpu.samples.by_job record (streams/gpu_batches.py)."""

from __future__ import annotations

import orjson
import pytest

from schemas import generate
from schemas.codec import decode, decode_as_read, encode
from schemas.events import SCHEMA_VERSION, GpuMetrics, GpuSample, GpuSampleBatch
from schemas.topics import GPU_SAMPLES_BY_JOB
from streams.gpu_batches import GpuBatches


def gpu(i: int, **changes: object) -> GpuMetrics:
    return GpuMetrics(index=i, uuid=f"GPU-{i}", utilization_pct=97.0, power_w=650.0, sm_clock_mhz=1980.0, **changes)  # type: ignore[arg-type]


def sample(node: str, t: float, lost: bool = False) -> GpuSample:
    return GpuSample(
        event_id=f"{node}-{t}",
        event_time=1_700_000_000 + t,
        node=node,
        collector="sim",
        gpus=[gpu(0, lost=lost), gpu(1)],
    )


def add(batches: GpuBatches, job: str, s: GpuSample) -> None:
    batches.add(job, s, encode(s))


def test_a_jobs_samples_go_out_as_one_record_that_decodes_as_the_samples() -> None:
    batches = GpuBatches()
    samples = [sample("n1", 0.0), sample("n2", 1.0), sample("n3", 0.5)]
    for s in samples:
        add(batches, "job-1", s)
    add(batches, "job-2", sample("n9", 0.2))
    records = dict(batches.take())
    assert sorted(records) == ["job-1", "job-2"]
    batch = decode(GpuSampleBatch, records["job-1"])
    assert batch.job_id == "job-1" and batch.samples == samples
    assert batch.event_time == max(s.event_time for s in samples)
    assert batch.schema_version == SCHEMA_VERSION
    assert GPU_SAMPLES_BY_JOB.event_type is GpuSampleBatch
    # Taken is gone: the next flush has nothing.
    assert batches.take() == []


def test_take_of_one_job_leaves_the_others() -> None:
    batches = GpuBatches()
    add(batches, "job-1", sample("n1", 0.0))
    add(batches, "job-2", sample("n2", 0.0))
    assert [job for job, _ in batches.take("job-1")] == ["job-1"]
    assert batches.take("job-1") == []
    assert [job for job, _ in batches.take()] == ["job-2"]


def test_a_large_jobs_samples_are_split_under_the_byte_bound_in_order() -> None:
    one = len(encode(sample("n0", 0.0)))
    batches = GpuBatches(max_bytes=3 * one + 10)
    samples = [sample(f"n{i}", float(i)) for i in range(10)]
    for s in samples:
        add(batches, "big", s)
    records = batches.take()
    assert len(records) == 4  # 3 + 3 + 3 + 1
    decoded = [decode(GpuSampleBatch, payload) for _, payload in records]
    assert [s for b in decoded for s in b.samples] == samples
    assert all(len(b.samples) <= 3 for b in decoded)
    # Each record's id is its own, and the same samples make the same ids.
    assert len({b.event_id for b in decoded}) == 4


def test_a_record_of_the_same_samples_has_the_same_id() -> None:
    ids = []
    for _ in range(2):
        batches = GpuBatches()
        add(batches, "job-1", sample("n1", 0.0))
        add(batches, "job-1", sample("n2", 0.0))
        ids.append(decode(GpuSampleBatch, batches.take()[0][1]).event_id)
    assert ids[0] == ids[1]


def test_a_lost_gpu_is_urgent() -> None:
    assert GpuBatches.urgent(sample("n1", 0.0, lost=True))
    assert not GpuBatches.urgent(sample("n1", 0.0))


def test_a_previous_version_sample_is_passed_on_in_the_current_version() -> None:
    # A version 1 producer's sample (schemas/json/v1/examples): spliced as read, it would not be
    # a valid member of a version 2 batch; decode_as_read gives its upgraded encoding instead.
    old = (generate.PREVIOUS_DIR / "examples" / "gpu_sample.json").read_bytes()
    event, payload = decode_as_read(GpuSample, old)
    assert payload != old and orjson.loads(payload)["schema_version"] == SCHEMA_VERSION
    batches = GpuBatches()
    batches.add("job-1", event, payload)
    assert decode(GpuSampleBatch, batches.take()[0][1]).samples == [event]
    current = encode(event)
    assert decode_as_read(GpuSample, current)[1] is current  # passed on as read, not encoded again


def test_bad_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        GpuBatches(max_bytes=0)
