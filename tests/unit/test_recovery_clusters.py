"""A restarted worker takes back only its own cluster's records (clusters may share Kafka)."""

from __future__ import annotations

import pytest

import streams.recovery
from schemas.codec import encode
from schemas.events import SchedEvent
from schemas.ids import DEFAULT_CLUSTER, set_cluster
from schemas.topics import SCHED_EVENTS


def test_read_history_keeps_this_clusters_records_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def job(job_id: str, cluster: str) -> bytes:
        return encode(
            SchedEvent(
                event_id=f"s-{job_id}-{cluster}",
                event_time=5.0,
                kind="job",
                job_id=job_id,
                state="RUNNING",
                nodes=["gpu01"],
                cluster=cluster,
            )
        )

    records = {SCHED_EVENTS.name: [(5.0, job("100", "east")), (5.0, job("100", "west")), (6.0, job("101", "east"))]}
    monkeypatch.setattr(streams.recovery, "read_records", lambda _b, topic, _since: records.get(topic, []))
    set_cluster("east")
    try:
        history = streams.recovery.read_history("k:9092", 10.0, 6.0, 86400.0)
    finally:
        set_cluster(DEFAULT_CLUSTER)
    assert [(e.job_id, e.cluster) for e in history.sched] == [("100", "east"), ("101", "east")]
    assert history.undecodable == 0
