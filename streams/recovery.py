"""Rebuild the streams worker's state from the Kafka log after a (re)start.

Attribution (which jobs already had an incident, which node runs which job) and
the restart budget live in worker memory. A worker that restarts after a crash
would otherwise treat a redelivered or late anomaly of an already handled fault
as a new fault: a second incident and a second drain. The topics themselves are
the durable record of what the worker decided, so it reads back the recent
incidents, actions and job states before it consumes anything new.

Kafka's offsets-for-times positions each partition near `since`; brokers that
do not index time (the embedded Tansu answers offset 0) are read from the start
and filtered by record time here, which costs time but gives the same result.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TypeVar

from confluent_kafka import Consumer, KafkaException, TopicPartition

from schemas.clients import consumer_config
from schemas.codec import DecodeError, decode
from schemas.events import Action, Event, Incident, SchedEvent
from schemas.topics import ACTIONS, INCIDENTS, SCHED_EVENTS

log = logging.getLogger("trainmedic.streams.recovery")
E = TypeVar("E", bound=Event)


@dataclass
class History:
    """What the worker had already seen and done, oldest first per kind."""

    incidents: list[Incident] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    sched: list[SchedEvent] = field(default_factory=list)
    undecodable: int = 0


def read_records(bootstrap: str, topic: str, since: float, timeout_s: float = 30.0) -> list[tuple[float, bytes]]:
    """Every record of `topic` with a timestamp >= since, as (record time, value)."""
    consumer = Consumer(
        {
            # Assigned, not subscribed: no group join, nothing committed.
            **consumer_config(bootstrap, f"trainmedic-recovery-{uuid.uuid4().hex[:8]}", "trainmedic-recovery"),
            "enable.partition.eof": True,
        }
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
        consumer.assign(todo)
        remaining = {tp.partition for tp in todo}
        out: list[tuple[float, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading back {topic}: partitions {sorted(remaining)} not read to their end")
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == -191:  # _PARTITION_EOF
                    remaining.discard(msg.partition())
                    continue
                raise KafkaException(err)
            ts_type, ts_ms = msg.timestamp()
            at = ts_ms / 1000.0 if ts_type and ts_ms > 0 else time.time()
            value = msg.value()
            if at >= since and value is not None:
                out.append((at, value))
        return out
    finally:
        consumer.close()


def _decoded(kind: type[E], records: list[tuple[float, bytes]], history: History) -> list[E]:
    out: list[E] = []
    for _, value in sorted(records, key=lambda r: r[0]):
        try:
            out.append(decode(kind, value))
        except DecodeError:
            # Already dead-lettered by whoever consumed it live; nothing to rebuild from it.
            history.undecodable += 1
    return out


def read_history(bootstrap: str, now: float, incidents_s: float, actions_s: float, sched_s: float) -> History:
    """The recent incidents, actions and job states: each kind as far back as it still matters."""
    history = History()
    history.incidents = _decoded(Incident, read_records(bootstrap, INCIDENTS.name, now - incidents_s), history)
    history.actions = _decoded(Action, read_records(bootstrap, ACTIONS.name, now - actions_s), history)
    history.sched = _decoded(SchedEvent, read_records(bootstrap, SCHED_EVENTS.name, now - sched_s), history)
    return history
