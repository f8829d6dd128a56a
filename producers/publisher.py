"""Publishing events to Kafka with confluent-kafka (acks=all, batching)."""

from __future__ import annotations

import logging
import threading
from collections import Counter

from confluent_kafka import KafkaError, Message, Producer

from schemas.clients import producer_config
from schemas.codec import encode
from schemas.events import Event
from schemas.topics import Topic, partition_key

log = logging.getLogger("trainmedic.publisher")


class Publisher:
    """Thread-safe event publisher with delivery counters.

    librdkafka buffers while the broker is away (bounded by
    queue.buffering.max.messages); a full buffer or an expired message is
    counted in `dropped` and logged, never silently lost.
    """

    def __init__(
        self, bootstrap: str, client_id: str = "trainmedic-producer", config: dict[str, object] | None = None
    ) -> None:
        # `config`: librdkafka overrides, e.g. queue.buffering.max.messages (the buffer bound
        # while the broker is away) or message.timeout.ms (how long an event may wait for it).
        self._producer = Producer({**producer_config(bootstrap, client_id), **(config or {})})
        self._lock = threading.Lock()
        self.sent: Counter[str] = Counter()
        self.delivered: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        topic = msg.topic() or "?"
        with self._lock:
            if err is None:
                self.delivered[topic] += 1
            else:
                self.dropped[topic] += 1
                log.error("dropped an event for %s: %s", topic, err)

    def publish(self, topic: Topic, event: Event) -> None:
        if not isinstance(event, topic.event_type):
            raise TypeError(f"topic {topic.name} carries {topic.event_type.__name__}, not {type(event).__name__}")
        payload = encode(event)
        for attempt in range(2):
            try:
                self._producer.produce(
                    topic.name, value=payload, key=partition_key(event), on_delivery=self._on_delivery
                )
                break
            except BufferError:
                if attempt == 0:
                    # The local buffer is at its bound: give deliveries one chance to drain it.
                    self._producer.poll(0.5)
                    continue
                with self._lock:
                    self.dropped[topic.name] += 1
                log.error("producer buffer full; dropped one %s event %s (broker away?)", topic.name, event.event_id)
                return
        with self._lock:
            self.sent[topic.name] += 1
        self._producer.poll(0)

    def publish_raw(self, topic_name: str, payload: bytes, key: bytes | None = None) -> None:
        """For tests and tools that must send bytes that are not a valid event."""
        self._producer.produce(topic_name, value=payload, key=key, on_delivery=self._on_delivery)
        self._producer.poll(0)

    def flush(self, timeout: float = 10.0) -> int:
        """Wait for outstanding deliveries; returns how many are still queued."""
        return int(self._producer.flush(timeout))
