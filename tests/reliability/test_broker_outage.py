"""A producer against a broker outage. The embedded broker keeps everything in memory,
so "the broker comes back" is a NEW broker on the same port with the topics created
again: what the Publisher buffered while it was away must be delivered there; what
did not fit in its bounded buffer must be counted in `dropped` and logged.

TRAINMEDIC_OUTAGE_S sets how long the broker stays away (default 5 s; the
overflow burst that follows keeps it away longer)."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any

import orjson
import pytest

from bus.admin import ensure_topics
from bus.publish import Publisher
from schemas.events import GpuMetrics, GpuSample
from schemas.topics import GPU_SAMPLES
from tests.reliability.harness import read_all, report_row, wait_until
from trainmedic.stack.broker import EmbeddedBroker, free_port

OUTAGE_S = float(os.environ.get("TRAINMEDIC_OUTAGE_S", "5"))
MIN_DROPS = 2
_DROP_LOG = re.compile(r"producer buffer full; dropped gpu\.samples event (\S+)")


def _sample(i: int) -> GpuSample:
    return GpuSample(
        event_id=f"gs-{i}",
        event_time=time.time(),
        node=f"gpu{i % 64:02d}",
        gpus=[GpuMetrics(index=0, utilization_pct=97.0)],
        collector="sim",
    )


class Steady:
    """Publishes continuously from a thread (about `rate` events/s) and remembers what it sent."""

    def __init__(self, pub: Publisher, rate: float = 500.0) -> None:
        self.pub, self.rate = pub, rate
        self.ids: list[tuple[float, str]] = []  # (monotonic time before publish, id)
        self.next = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def take(self) -> int:
        with self.lock:
            self.next += 1
            return self.next

    def publish(self, i: int) -> None:
        self.ids.append((time.monotonic(), f"gs-{i}"))
        self.pub.publish(GPU_SAMPLES, _sample(i))

    def _run(self) -> None:
        while not self.stop.is_set():
            for _ in range(10):
                self.publish(self.take())
            time.sleep(10 / self.rate)


def test_buffered_events_reach_the_new_broker_and_overflow_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="trainmedic.publisher")
    port = free_port()
    first = EmbeddedBroker(port=port).start()
    ensure_topics(first.bootstrap)
    pub = Publisher(first.bootstrap, "outage-test")
    steady = Steady(pub)
    steady.thread.start()
    second: EmbeddedBroker | None = None
    try:
        wait_until("events delivered to the first broker", lambda: sum(pub.delivered.values()) > 200)
        first.stop()
        down_at = time.monotonic()
        # The broker is gone; the steady publisher goes on. Then a burst that overflows the
        # bounded buffer (queue.buffering.max.messages = 100,000): each event beyond it is a drop.
        outage_end = down_at + OUTAGE_S
        while time.monotonic() < outage_end or sum(pub.dropped.values()) < MIN_DROPS:
            if sum(pub.dropped.values()) < MIN_DROPS:
                steady.publish(steady.take())
            else:
                time.sleep(0.05)
        second = EmbeddedBroker(port=port).start()
        ensure_topics(second.bootstrap)
        before = sum(pub.delivered.values())
        # The steady publisher goes on against the new broker while the buffer drains into it.
        wait_until("deliveries to the new broker", lambda: sum(pub.delivered.values()) > before + 1000, timeout=120)
        steady.stop.set()
        steady.thread.join(30)
        assert pub.flush(180) == 0
        sent = sum(pub.sent.values())
        dropped = sum(pub.dropped.values())
        delivered = sum(pub.delivered.values())

        # Every event is accounted for: delivered or counted as dropped, nothing in between.
        assert sent + dropped == len(steady.ids), (sent, dropped, len(steady.ids))
        assert delivered == sent
        # Every drop was logged, with the event's id.
        dropped_ids = {m.group(1) for r in caplog.records if (m := _DROP_LOG.search(r.getMessage()))}
        assert len(dropped_ids) == dropped >= MIN_DROPS

        after = [i for t, i in steady.ids if t >= down_at]  # published while the first broker was gone, or later
        after_set = set(after)
        # The new broker also gets what was in flight to the old one when it died (no answer came,
        # so librdkafka sends it again): only events of `after` count toward what must arrive.
        # ~100,000 records: on a loaded 2-core machine reading them back takes longer than a minute.
        records = read_all(
            second.bootstrap,
            GPU_SAMPLES.name,
            want=len(after) - dropped,
            timeout=240,
            idle_s=15.0,
            counts=lambda v: orjson.loads(v)["event_id"] in after_set,
        )
        arrived = [orjson.loads(v)["event_id"] for v in records]
        assert len(arrived) == len(set(arrived)), "an event arrived twice"
        in_flight = set(arrived) - after_set
        assert in_flight <= {i for _, i in steady.ids}, "the new broker holds events nobody published"
        missing = set(after) - set(arrived) - dropped_ids
        assert not missing, f"{len(missing)} events published during the outage neither arrived nor counted"
        # What the new broker holds = what was sent during and after the outage - what was dropped.
        assert len(set(after) & set(arrived)) == len(after) - dropped
        report_row(
            f"broker down {OUTAGE_S:g} s while producers run",
            sent=len(steady.ids),
            landed=delivered,
            where="broker",
            duplicates=len(arrived) - len(set(arrived)),
            actions_expected=0,
            actions_taken=0,
            note=f"{dropped} over the buffer bound dropped, each counted and logged with its id; "
            f"{len(in_flight)} in flight at the crash sent again to the new broker",
        )
    finally:
        steady.stop.set()
        first.stop(grace_s=0)
        if second is not None:
            second.stop()


def _publisher_with(bootstrap: str, config: dict[str, Any]) -> Publisher:
    return Publisher(bootstrap, "outage-test", config=config)


def test_events_that_expire_while_the_broker_is_away_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="trainmedic.publisher")
    broker = EmbeddedBroker().start()
    ensure_topics(broker.bootstrap)
    broker.stop()
    pub = _publisher_with(broker.bootstrap, {"message.timeout.ms": 2000})
    for i in range(5):
        pub.publish(GPU_SAMPLES, _sample(i))
    pub.flush(15)
    assert sum(pub.dropped.values()) == 5
    assert sum("dropped gpu.samples event gs-" in r.getMessage() for r in caplog.records) == 5


@pytest.mark.timeout(60)
def test_a_smaller_buffer_bound_drops_and_counts_instead_of_blocking(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="trainmedic.publisher")
    broker = EmbeddedBroker().start()
    ensure_topics(broker.bootstrap)
    broker.stop()
    pub = _publisher_with(broker.bootstrap, {"queue.buffering.max.messages": 50})
    for i in range(60):
        pub.publish(GPU_SAMPLES, _sample(i))
    assert sum(pub.dropped.values()) == 10
    assert sum(pub.sent.values()) == 50
