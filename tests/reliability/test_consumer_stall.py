"""A consumer that can act does not stall silently after the broker is killed and restarted
(issue 40, item 1).

The embedded broker keeps everything in memory: the new broker on the same port has no topic,
group or committed offset, and the topics are created again as `up` does after a broker restart
(trainmedic/stack/runtime.py, `_restart_broker`). Before the fix, the executor took its acting lease
back but its actions consumer never got a partition again: each new action stayed on the topic,
while the executor said it was ready and acting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from bus import health
from bus.admin import ensure_topics
from bus.publish import Publisher
from bus.watchdog import StallSettings, configure, settings
from schemas.codec import decode
from schemas.events import Action, ActionResult
from schemas.topics import ACTION_RESULTS, ACTIONS
from sinks.backends.simulated import SimulatedScheduler
from sinks.executor import Executor, ExecutorService, ExecutorSettings
from tests.conftest import read_topic, wait_for
from trainmedic.stack.broker import EmbeddedBroker


def _requeue(i: int, job: str) -> Action:
    now = time.time()
    return Action(
        event_id=f"act-st{i}",
        event_time=now,
        action_id=f"act-st{i}",
        decision_id=f"dec-st{i}",
        incident_id=f"inc-st{i}",
        job_id=job,
        node=None,
        partition="gpu",
        action="requeue",
        reason=f"trainmedic inc-st{i}: hang",
        requested_by="policy",
        incident_time=now,
        first_signal_time=now - 1,
    )


def _result(bootstrap: str, action_id: str) -> ActionResult | None:
    results = [decode(ActionResult, v) for v in read_topic(bootstrap, ACTION_RESULTS.name, 1.0)]
    return next((r for r in results if r.action_id == action_id), None)


@pytest.fixture
def quick_watchdog() -> Iterator[StallSettings]:
    """Thresholds of seconds, not the default half-minute: the test waits for the remedies."""
    before = settings()
    configure(StallSettings(stall_s=5.0, give_up_s=60.0))
    yield settings()
    configure(before)


def _recoveries(consumer: str, reason: str, action: str) -> float:
    labels = {"consumer": consumer, "reason": reason, "action": action}
    return REGISTRY.get_sample_value("trainmedic_consumer_stall_recoveries_total", labels) or 0.0


def test_executor_acts_again_after_the_broker_is_killed_and_restarted(
    broker: EmbeddedBroker, quick_watchdog: StallSettings
) -> None:
    """Measured before the fix: the lease came back, the actions group never formed again (Tansu kept
    the closed actions consumer as the group's leader, bus/watchdog.py), and the new action waited
    for minutes while the executor said ready and acting. Now the watchdog finds the consumer with no
    partition, re-subscribes, then resets the group, and the action is carried out. (Whether the
    executor closes its actions consumer before or after that consumer joined the new broker is a
    race; here it joined first in every run. tests/integration/test_consumer_watchdog.py makes the
    wedge on purpose.)"""
    resets = _recoveries("executor-actions", "no_assignment", "reset_group")
    sched = SimulatedScheduler([f"gpu{i:02d}" for i in range(1, 9)], requeue_delay_s=0.0)
    jobs = [sched.submit(f"j{i}", 1) for i in range(2)]
    svc = ExecutorService(
        broker.bootstrap,
        Executor(sched, ExecutorSettings(verify_timeout_s=10, group="restarted")),
        client_id="exec-restarted",
    )
    thread = threading.Thread(target=svc.run, name="executor", daemon=True)
    thread.start()
    pub = Publisher(broker.bootstrap, "test")
    try:
        pub.publish(ACTIONS, _requeue(0, jobs[0]))
        assert pub.flush(10) == 0
        wait_for("the first action's result", lambda: _result(broker.bootstrap, "act-st0"), timeout=60)

        # SIGKILL (stop without grace), then a new, empty broker on the same port with the topics
        # created again, as `up` restarts its embedded broker.
        broker.stop(grace_s=0)
        broker.start()
        ensure_topics(broker.bootstrap)

        pub.publish(ACTIONS, _requeue(1, jobs[1]))
        assert pub.flush(30) == 0
        result = wait_for("the new action's result", lambda: _result(broker.bootstrap, "act-st1"), timeout=45)
        assert result.status == "done"
        assert sched.job_state(jobs[1]).restart_count == 1
        assert sched.calls.count(f"requeue {jobs[1]} exclude=") == 1
        # When the group was wedged, the watchdog's reset cleared it (once).
        assert _recoveries("executor-actions", "no_assignment", "reset_group") - resets <= 1
        wait_for("the executor ready again", lambda: health.report()["loops"]["executor"]["ready"], timeout=10)
    finally:
        svc.stop_event.set()
        thread.join(30)
        pub.close(5)
