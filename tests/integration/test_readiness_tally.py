"""Readiness counts each recommendation's fate in ClickHouse (trainmedic.ops.readiness._tallies).

The audit rows are written through the sink's own row mapping into real chDB; the
expected scores are written out by hand from the scenario below, not computed by the
code under test."""

from __future__ import annotations

import pytest

from schemas.events import Approval, Decision, Event, Incident
from sinks.audit import AuditStore
from streams.policy import load_policy
from tests.integration.test_audit import incident_events, insert_events
from trainmedic.ops.readiness import readiness

NOW = 1_800_000_000.0
HOUR = 3600.0


def _recommendation(
    n: int,
    t: float,
    *,
    job: str,
    node: str,
    partition: str | None = "gpu",
    category: str = "gpu_hardware",
    detect_s: float = 2.0,
) -> list[Event]:
    iid = f"inc-{n}"
    first = t - detect_s
    return [
        Incident(
            event_id=iid,
            event_time=t,
            incident_id=iid,
            job_id=job,
            partition=partition,
            job_nodes=[node],
            category=category,  # type: ignore[arg-type]
            severity="critical",
            culprit_node=node,
            confidence=0.9,
            isolate=True,
            explanation="synthetic",
            evidence=[],
            anomaly_ids=[],
            first_signal_time=first,
        ),
        Decision(
            event_id=f"dec-{n}",
            event_time=t + 0.01,
            decision_id=f"dec-{n}",
            incident_id=iid,
            job_id=job,
            partition=partition,
            category=category,  # type: ignore[arg-type]
            culprit_node=node,
            action="drain_and_requeue",
            mode="monitor",
            executed=False,
            rule="mode=monitor",
            reason="synthetic",
            first_signal_time=first,
            incident_time=t,
        ),
    ]


def _verdict(n: int, t: float, verdict: str, reason: str | None = None, partition: str | None = "gpu") -> Approval:
    return Approval(
        event_id=f"apv-{n}-{verdict}",
        event_time=t,
        approval_id=f"apv-{n}-{verdict}",
        decision_id=f"dec-{n}",
        incident_id=f"inc-{n}",
        job_id=f"j{n}",
        partition=partition,
        category="gpu_hardware",
        action="drain_and_requeue",
        verdict=verdict,  # type: ignore[arg-type]
        reason=reason,  # type: ignore[arg-type]
        operator="alice",
    )


@pytest.fixture
def store(chdb_url: str, database: str) -> AuditStore:
    s = AuditStore(chdb_url, database)
    s.migrate()
    return s


def test_every_fate_is_counted_per_partition_and_per_category(store: AuditStore) -> None:
    day = 24 * HOUR
    t = NOW - 5 * day
    events: list[Event] = []
    # gpu partition: 1 and 2 approved, 3 and 4 rejected (two reasons), 5 labelled confirmed.
    for n in range(1, 6):
        events += _recommendation(n, t + n, job=f"j{n}", node=f"gpu{n:02d}", detect_s=float(n))
    events += [_verdict(1, t + 100, "approved"), _verdict(2, t + 100, "approved")]
    # Incident 3: first approved, then the operator changed their mind: the last verdict counts.
    events += [_verdict(3, t + 100, "approved"), _verdict(3, t + 200, "rejected", "wrong_node")]
    events += [_verdict(4, t + 100, "rejected", "not_a_fault"), _verdict(5, t + 100, "confirmed")]
    # 6: confirmed by the facts, a later incident of the same job on the same node within the expiry.
    events += _recommendation(6, t + 6, job="j6", node="gpu06", detect_s=6.0)
    # (an autonomous incident with a done result: not a recommendation, so never scored itself)
    events += incident_events(0, t + 6 + HOUR, job="j6", node="gpu06")
    # 7: unanswered, older than expire_after_h: expired. 8: unanswered, recent: open.
    events += _recommendation(7, t + 7, job="j7", node="gpu07", detect_s=7.0)
    events += _recommendation(8, NOW - HOUR, job="j8", node="gpu08", detect_s=8.0)
    # io partition: one approved. No partition at all: one approved, in the category only.
    events += _recommendation(9, t + 9, job="j9", node="gpu09", partition="io", detect_s=10.0)
    events += [_verdict(9, t + 100, "approved", partition="io")]
    events += _recommendation(10, t + 10, job="j10", node="gpu10", partition=None, detect_s=20.0)
    events += [_verdict(10, t + 100, "approved", partition=None)]
    # Outside the 30-day window: not counted.
    events += _recommendation(11, NOW - 40 * day, job="j11", node="gpu11")
    events += [_verdict(11, NOW - 40 * day + 100, "rejected", "other")]
    # Another category, partition gpu.
    events += _recommendation(12, t + 12, job="j12", node="gpu12", category="interconnect", detect_s=4.0)
    insert_events(store, events)
    # A redelivered approval (same id) must not count twice.
    insert_events(store, [_verdict(1, t + 100, "approved")])

    scores = {(s.category, s.partition): s for s in readiness(store, load_policy(), since_s=NOW - 30 * day, now=NOW)}
    gpu = scores[("gpu_hardware", "gpu")]
    assert (gpu.recommendations, gpu.approved, gpu.rejected, gpu.confirmed, gpu.expired, gpu.open) == (8, 2, 2, 2, 1, 1)
    assert gpu.rejected_reasons == {"wrong_node": 1, "not_a_fault": 1}
    assert gpu.detection_p50_s == 4.5  # 1 .. 8: the mean of the middle two
    assert gpu.action_p50_s is None  # recommendations have no action result
    assert gpu.decided == 6 and gpu.precision == pytest.approx(4 / 6)
    io = scores[("gpu_hardware", "io")]
    assert (io.recommendations, io.approved, io.decided) == (1, 1, 1)
    whole = scores[("gpu_hardware", None)]
    assert (whole.recommendations, whole.approved, whole.rejected, whole.confirmed) == (10, 4, 2, 2)
    assert whole.detection_p50_s == 5.5  # 1 .. 8, 10, 20
    net = scores[("interconnect", None)]
    assert (net.recommendations, net.expired, net.detection_p50_s) == (1, 1, 4.0)
    assert scores[("interconnect", "gpu")].recommendations == 1
    # No partition-less key leaks in as a partition named ''.
    assert ("gpu_hardware", "") not in scores
    # Every acting category has its whole-fleet score, also with no data; none for healthy.
    hang = scores[("hang", None)]
    assert (hang.recommendations, hang.decided, hang.verdict) == (0, 0, "not_yet")
    assert ("healthy", None) not in scores


def test_no_recommendation_in_the_window_gives_empty_scores(store: AuditStore) -> None:
    insert_events(store, _recommendation(1, NOW - 40 * 86400, job="j1", node="gpu01"))
    scores = readiness(store, load_policy(), since_s=NOW - 86400, now=NOW)
    assert scores and all(s.partition is None and s.recommendations == 0 for s in scores)
    assert all(s.detection_p50_s is None and s.rejected_reasons == {} for s in scores)
