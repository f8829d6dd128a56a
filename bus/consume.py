"""The one way to consume: a group consumer with the shared settings, and a read-back of a
topic's recent records (what a restarted component takes back from the log).

Decoding stays with the caller (`schemas.codec.decode` into the topic's event type), so a
record it cannot read is dead-lettered where its reader knows why.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition

from bus.config import consumer_config
from schemas.errors import Unavailable


def group_consumer(
    bootstrap: str, group: str, client_id: str, *, background: bool = False, **overrides: Any
) -> Consumer:
    """A consumer in `group` with the shared settings; `overrides` are librdkafka keys.
    `background`: nothing on a fault's path waits on it, so it fetches less often
    (`bus.config.BACKGROUND_FETCH_WAIT_MS`)."""
    return Consumer({**consumer_config(bootstrap, group, client_id, background=background), **overrides})


def _read_to_end(
    consumer: Consumer, assignment: list[TopicPartition], timeout_s: float, what: str
) -> Iterator[Message]:
    """The records of `assignment` from its offsets on, until the broker says each partition is at
    its end (the consumer is made with enable.partition.eof)."""
    consumer.assign(assignment)
    remaining = {(tp.topic, tp.partition) for tp in assignment}
    deadline = time.monotonic() + timeout_s
    while remaining:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: partitions {sorted(remaining)} not read to their end in {timeout_s:.0f} s")
        msg = consumer.poll(0.5)
        if msg is None:
            continue
        err = msg.error()
        if err is None:
            yield msg
        elif err.code() == KafkaError._PARTITION_EOF:
            remaining.discard((msg.topic(), msg.partition()))
        else:
            raise KafkaException(err)


def read_records(bootstrap: str, topic: str, since: float, timeout_s: float = 30.0) -> list[tuple[float, bytes]]:
    """Every record of `topic` with a timestamp >= since, as (record time, value)."""
    # Assigned, not subscribed: no group join, nothing committed.
    consumer = group_consumer(
        bootstrap,
        f"trainmedic-recovery-{uuid.uuid4().hex[:8]}",
        "trainmedic-recovery",
        **{"enable.partition.eof": True},
    )
    try:
        meta = consumer.list_topics(topic, timeout=timeout_s)
        if topic not in meta.topics or meta.topics[topic].error is not None:
            return []
        partitions = sorted(meta.topics[topic].partitions)
        starts = consumer.offsets_for_times(
            [TopicPartition(topic, p, int(since * 1000)) for p in partitions], timeout=timeout_s
        )
        todo: list[TopicPartition] = []
        for tp in starts:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=timeout_s)
            start = tp.offset if tp.offset >= 0 else high  # -1: nothing that recent
            if start < high:
                todo.append(TopicPartition(topic, tp.partition, start))
        if not todo:
            return []
        out: list[tuple[float, bytes]] = []
        for msg in _read_to_end(consumer, todo, timeout_s, f"reading back {topic}"):
            ts_type, ts_ms = msg.timestamp()
            at = ts_ms / 1000.0 if ts_type and ts_ms > 0 else time.time()
            value = msg.value()
            if at >= since and value is not None:
                out.append((at, value))
        return out
    finally:
        consumer.close()


def fetched_end_offsets(
    bootstrap: str, listed: dict[tuple[str, int], int], timeout_s: float = 10.0
) -> dict[tuple[str, int], int]:
    """Each partition's end offset as a fetch answers it, from the end offsets a ListOffsets
    request answered (`listed`, which it never lowers).

    The embedded broker answers ListOffsets with the first offset of the partition's last batch
    + 1, but a fetch's high watermark rightly (measured: batches of 1 and 7 records, listed 2,
    fetched 8). So each non-empty partition is read from its listed end - 1, the start of its last
    batch, until the broker says it is at the end. On Kafka the two agree and this costs one fetch."""
    todo = {tp: end for tp, end in listed.items() if end > 0}
    if not todo:
        return dict(listed)
    consumer = group_consumer(
        bootstrap,
        f"trainmedic-ends-{uuid.uuid4().hex[:8]}",
        "trainmedic-ends",
        **{"enable.partition.eof": True},
    )
    try:
        last_batches = [TopicPartition(topic, partition, end - 1) for (topic, partition), end in todo.items()]
        for _ in _read_to_end(consumer, last_batches, timeout_s, "reading end offsets"):
            pass
        ends = dict(listed)
        for tp in todo:
            _, high = consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
            ends[tp] = max(ends[tp], high)
        return ends
    finally:
        consumer.close()


class Follower:
    """Every record of a topic, from its beginning, then as they come - in every process that
    needs the whole topic (each placement discoverer, each streams worker's mode changes).

    Assigned, not subscribed: no group shares the partitions out and nothing is committed,
    so every follower reads everything, and a restarted one reads it again.
    """

    def __init__(
        self, bootstrap: str, topic: str, client_id: str, timeout_s: float = 10.0, *, background: bool = True
    ) -> None:
        self.topic = topic
        self._consumer = group_consumer(
            bootstrap,
            f"{client_id}-{uuid.uuid4().hex[:8]}",
            client_id,
            background=background,
            # Each partition says when its backlog is read.
            **{"enable.partition.eof": True},
        )
        try:
            meta = self._consumer.list_topics(topic, timeout=timeout_s).topics[topic]
        except KafkaException as exc:
            self._consumer.close()
            raise MissingTopic(f"cannot read topic {topic}: {exc}") from exc
        if meta.error is not None or not meta.partitions:
            self._consumer.close()
            raise MissingTopic(f"topic {topic} is missing ({meta.error})")
        self._partitions = set(meta.partitions)
        self._at_end: set[int] = set()
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in meta.partitions])
        # A memory-only broker restarted under it leaves its positions past the new log's end, where
        # the broker answers with nothing: the watchdog reads the new log from its start. Imported
        # here: bus.watchdog builds on this module.
        from bus.watchdog import AssignedWatch

        self._watch = AssignedWatch(f"follower-{client_id}")

    @property
    def caught_up(self) -> bool:
        """Every partition was read to the end it had when first reached."""
        return self._at_end >= self._partitions

    def poll(self, max_records: int = 50_000, timeout_s: float = 0.05) -> list[bytes]:
        """The records that arrived since the last poll (values only, in partition order)."""
        out: list[bytes] = []
        self._watch.check(self._consumer)
        while len(out) < max_records:
            msgs = self._consumer.consume(num_messages=min(5000, max_records - len(out)), timeout=timeout_s)
            if not msgs:
                break
            for msg in msgs:
                if (err := msg.error()) is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        self._at_end.add(msg.partition() or 0)
                    continue  # transport errors are librdkafka's to retry
                if (value := msg.value()) is not None:
                    out.append(value)
        return out

    def close(self) -> None:
        self._consumer.close()


class MissingTopic(Unavailable, ValueError):
    """The topic cannot be read: absent, or the broker does not answer."""
