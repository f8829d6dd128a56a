"""policy replay rebuilds an incident's isolate fact from the audit row, newest record first."""

from __future__ import annotations

import pytest

from trainmedic.ops.replay import _isolate


def test_the_recorded_fact_wins_then_the_old_recommendation_then_the_decision() -> None:
    # Recorded (migration 012): taken as it is, even where the decision became a stop.
    assert _isolate({"isolate": True, "recommended_action": "", "decision_action": "stop"}) is True
    assert _isolate({"isolate": False, "recommended_action": "", "decision_action": "drain_and_requeue"}) is False
    # Rows from when attribution chose the action.
    assert _isolate({"isolate": None, "recommended_action": "drain_and_requeue", "decision_action": "stop"}) is True
    assert _isolate({"isolate": None, "recommended_action": "requeue", "decision_action": "drain_and_requeue"}) is False
    # Neither: what policy decided from it.
    assert _isolate({"isolate": None, "recommended_action": "", "decision_action": "drain_and_requeue"}) is True


def test_replay_requeues_the_job_whose_drain_the_blast_radius_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the executor does (issue 40): a drain over max_drains_per_window is a trip, but the job
    is still requeued, so the replayed action is taken, not dropped."""
    from schemas.events import Evidence, Incident
    from streams.policy import load_policy
    from trainmedic.ops import replay as replay_mod

    def incident(i: int, node: str) -> Incident:
        return Incident(
            event_id=f"inc-{i}",
            incident_id=f"inc-{i}",
            event_time=1000.0 + i,
            job_id=str(100 + i),
            partition="gpu",
            category="gpu_hardware",
            severity="critical",
            culprit_node=node,
            confidence=0.95,
            isolate=True,
            explanation="x",
            anomaly_ids=["a"],
            first_signal_time=999.0 + i,  # type: ignore[arg-type]
            evidence=[Evidence(source="kernel", signature="xid_79", node=node, time=999.0 + i, line="l", role="root")],
        )

    row = {"decision_kind": "", "decision_action": "", "recovery_s": None, "action_latency_s": None}
    recorded = [(incident(i, f"gpu0{i}"), row) for i in (1, 2)]
    monkeypatch.setattr(replay_mod, "_load", lambda _store, _since: recorded)
    policy = load_policy().with_mode("autonomous").model_copy(update={"guardrails": {"max_drains_per_window": 1}})
    report = replay_mod.replay(None, policy, 0.0)  # type: ignore[arg-type]
    assert report["actions_after"] == 2 and report["guardrail_trips"] == 1
    capped = next(c for c in report["changes"] if c["incident_id"] == "inc-2")
    assert capped["replayed"] == "action: drain_and_requeue"
    assert (
        capped["guardrail"].startswith("blast_radius: ")
        and "the job is requeued without the node" in capped["guardrail"]
    )
