"""The streams worker's seek back to committed offsets (streams/seeking.py) with a real aiokafka
group consumer on the real embedded broker. Faust drops records fetched for partitions paused by
the time they are handed over, and counts on this seek to read them again: a partition never
committed must go back to the start, one committed at 0 to 0, one committed further to its
offset. aiokafka's own seek leaves the first two where they were, past records no agent saw
(shown first, so the test cannot pass on a broker or client that already rewinds)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # type: ignore[import-untyped]
from aiokafka.structs import OffsetAndMetadata  # type: ignore[import-untyped]
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

from schemas.topics import JOB_LOGS
from streams.seeking import rewind_uncommitted, seek_to_committed_or_reset
from trainmedic.stack.broker import EmbeddedBroker

RECORDS = 10
NEVER, AT_ZERO, AT_FOUR = (TopicPartition(JOB_LOGS.name, p) for p in (0, 1, 2))


async def _positions_after_seeks(
    bootstrap: str,
) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int], dict[TopicPartition, Any], list[int]]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for tp in (NEVER, AT_ZERO, AT_FOUR):
            for n in range(RECORDS):
                await producer.send_and_wait(tp.topic, b"%d" % n, partition=tp.partition)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id="seek-test", auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    try:
        consumer.subscribe([JOB_LOGS.name])
        async with asyncio.timeout(60):
            while not {NEVER, AT_ZERO, AT_FOUR} <= consumer.assignment():
                await consumer.getmany(timeout_ms=200)
            await consumer.commit({AT_ZERO: OffsetAndMetadata(0, ""), AT_FOUR: OffsetAndMetadata(4, "")})
            # Every record handed over: the positions are at the end.
            while [await consumer.position(tp) for tp in (NEVER, AT_ZERO, AT_FOUR)] != [RECORDS] * 3:
                await consumer.getmany(timeout_ms=200)

            await consumer.seek_to_committed()
            aiokafkas = {tp: await consumer.position(tp) for tp in (NEVER, AT_ZERO, AT_FOUR)}
            committed = await seek_to_committed_or_reset(consumer)
            ours = {tp: await consumer.position(tp) for tp in (NEVER, AT_ZERO, AT_FOUR)}
            again: list[int] = []
            for _ in range(20):  # bounded: a partition left at its end has nothing to read again
                if len(again) >= RECORDS:
                    break
                for tp, records in (await consumer.getmany(NEVER, timeout_ms=500)).items():
                    again.extend(r.offset for r in records if tp == NEVER)
        return aiokafkas, ours, committed, again
    finally:
        await consumer.stop()


def test_a_partition_never_committed_or_committed_at_zero_goes_back_and_is_read_again(broker: EmbeddedBroker) -> None:
    aiokafkas, ours, committed, again = asyncio.run(_positions_after_seeks(broker.bootstrap))
    assert aiokafkas == {NEVER: RECORDS, AT_ZERO: RECORDS, AT_FOUR: 4}  # aiokafka's seek skips the first two
    assert ours == {NEVER: 0, AT_ZERO: 0, AT_FOUR: 4}
    assert (committed[NEVER], committed[AT_ZERO], committed[AT_FOUR]) == (None, 0, 4)
    assert sorted(again) == list(range(RECORDS))


def test_the_worker_consumer_thread_seeks_with_it_once_however_often_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AIOKafkaConsumerThread, "seek_to_committed", AIOKafkaConsumerThread.seek_to_committed)
    original = AIOKafkaConsumerThread.seek_to_committed
    rewind_uncommitted()
    patched = AIOKafkaConsumerThread.seek_to_committed
    assert patched is not original
    rewind_uncommitted()
    assert AIOKafkaConsumerThread.seek_to_committed is patched


def test_a_faust_without_the_method_stops_the_worker_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(AIOKafkaConsumerThread, "seek_to_committed")
    with pytest.raises(RuntimeError, match="seek_to_committed is not there"):
        rewind_uncommitted()
