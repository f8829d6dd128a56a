"""The streams worker's fetch pacing (streams/fetching.py) with a real aiokafka consumer on the real
embedded broker. A consumer behind the log (a busy worker's steady state, or a catch-up) is
answered at once, so unpaced it fetches again as soon as it is answered; paced, its fetches are at
least the pace apart and every record still arrives."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # type: ignore[import-untyped]
from aiokafka.client import AIOKafkaClient  # type: ignore[import-untyped]
from aiokafka.consumer.fetcher import Fetcher  # type: ignore[import-untyped]
from aiokafka.protocol.fetch import FetchRequest  # type: ignore[import-untyped]

from schemas.topics import JOB_LOGS, JOB_PROGRESS
from streams.fetching import pace_fetches
from trainmedic.stack.broker import EmbeddedBroker

PACE_S = 0.2
RECORDS = 40
# Each fetch carries a few records of the backlog, so the broker always has more to answer with.
PARTITION_FETCH_BYTES = 1024
PAYLOAD = b"x" * 300
FETCH_WAIT_MS = 40
MIN_FETCHES = 4


async def _backlog_read(bootstrap: str, topic: str) -> list[float]:
    """Fetch-request send times (loop clock) while a backlog of RECORDS records is read, and at
    least MIN_FETCHES of them: the broker does not always split the backlog, and a consumer with
    nothing left fetches again after fetch_max_wait_ms (well under the pace)."""
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []
    original_send = AIOKafkaClient.send

    async def send(self: AIOKafkaClient, node_id: int, request: Any, **kwargs: Any) -> Any:
        if isinstance(request, FetchRequest):
            sent_at.append(loop.time())
        return await original_send(self, node_id, request, **kwargs)

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for n in range(RECORDS):  # one batch each: a fetch returns whole batches
            await producer.send_and_wait(topic, b"%d:" % n + PAYLOAD, key=b"job-1")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=FETCH_WAIT_MS,
        max_partition_fetch_bytes=PARTITION_FETCH_BYTES,
    )
    AIOKafkaClient.send = send
    try:
        await consumer.start()
        seen: list[bytes] = []
        async with asyncio.timeout(60):
            while len(seen) < RECORDS or len(sent_at) < MIN_FETCHES:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    seen.extend(r.value for r in records)
        assert sorted(seen) == sorted(b"%d:" % n + PAYLOAD for n in range(RECORDS))
        return sent_at
    finally:
        AIOKafkaClient.send = original_send
        await consumer.stop()


def test_paced_fetches_are_a_pace_apart_and_lose_nothing(broker: EmbeddedBroker, monkeypatch: Any) -> None:
    monkeypatch.setattr(Fetcher, "_proc_fetch_request", Fetcher._proc_fetch_request)  # restored after the test
    pace_fetches(0)
    unpaced = asyncio.run(_backlog_read(broker.bootstrap, JOB_LOGS.name))
    pace_fetches(PACE_S)
    paced = asyncio.run(_backlog_read(broker.bootstrap, JOB_PROGRESS.name))

    def gaps(times: list[float]) -> list[float]:
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    # Unpaced, the broker answers faster than the pace: the paced bound below is not a given.
    assert min(gaps(unpaced)) < PACE_S / 2, gaps(unpaced)
    assert min(gaps(paced)) >= PACE_S - 0.01, gaps(paced)


def test_a_second_pace_replaces_the_first_instead_of_stacking(monkeypatch: Any) -> None:
    monkeypatch.setattr(Fetcher, "_proc_fetch_request", Fetcher._proc_fetch_request)
    pace_fetches(0)
    original = Fetcher._proc_fetch_request
    pace_fetches(0.05)
    pace_fetches(0.05)
    assert Fetcher._proc_fetch_request._trainmedic_paced is original
    pace_fetches(0)
    assert Fetcher._proc_fetch_request is original


def test_an_aiokafka_without_the_wrapped_method_stops_the_worker_with_a_clear_error(monkeypatch: Any) -> None:
    monkeypatch.setattr(Fetcher, "_proc_fetch_request", lambda self, node_id, request: None)
    with pytest.raises(RuntimeError, match="TRAINMEDIC_FETCH_PACE_MS=0"):
        pace_fetches(0.05)
