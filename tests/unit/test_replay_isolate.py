"""policy replay rebuilds an incident's isolate fact from the audit row, newest record first."""

from __future__ import annotations

from trainmedic.replay import _isolate


def test_the_recorded_fact_wins_then_the_old_recommendation_then_the_decision() -> None:
    # Recorded (migration 012): taken as it is, even where the decision became a stop.
    assert _isolate({"isolate": True, "recommended_action": "", "decision_action": "stop"}) is True
    assert _isolate({"isolate": False, "recommended_action": "", "decision_action": "drain_and_requeue"}) is False
    # Rows from when attribution chose the action.
    assert _isolate({"isolate": None, "recommended_action": "drain_and_requeue", "decision_action": "stop"}) is True
    assert _isolate({"isolate": None, "recommended_action": "requeue", "decision_action": "drain_and_requeue"}) is False
    # Neither: what policy decided from it.
    assert _isolate({"isolate": None, "recommended_action": "", "decision_action": "drain_and_requeue"}) is True
