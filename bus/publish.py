"""Publishing events to Kafka: the one publish path (see bus/__init__.py)."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from bus import metrics
from bus.config import admin_config, producer_config
from bus.deadletter import make_dead_letter
from bus.fit import fit_event
from bus.identity import NodeSigner
from schemas.errors import Unavailable
from schemas.events import Event
from schemas.topics import ALL_TOPICS, DEADLETTER, TOPIC_BY_NAME, Topic, fixed_partition, partition_key

log = logging.getLogger("trainmedic.publisher")

# librdkafka's own default for message.max.bytes.
CLIENT_DEFAULT_MAX_BYTES = 1_000_000
_PURGED = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)


def learn_message_limits(bootstrap: str, client_limit: int, timeout_s: float = 2.0) -> dict[str, int]:
    """Topic name -> the smallest of the client's, the broker's and the topic's message size limit.

    Brokers that do not answer DescribeConfigs (the embedded one returns no
    entries) leave the client's own limit, which is always enforced.
    """
    limits = {t.name: client_limit for t in ALL_TOPICS}
    try:
        admin = AdminClient(admin_config(bootstrap))
        meta = admin.list_topics(timeout=timeout_s)
        resources = [ConfigResource(ResourceType.BROKER, str(b)) for b in meta.brokers]
        resources += [ConfigResource(ResourceType.TOPIC, name) for name in limits if name in meta.topics]
        broker_limit = client_limit
        futures = admin.describe_configs(resources, request_timeout=timeout_s)
        # One wait for all of them: a slow broker costs `timeout_s` once, not once per topic.
        concurrent.futures.wait(list(futures.values()), timeout=timeout_s)
        for res, fut in futures.items():
            if not fut.done():
                continue
            entries = fut.result()
            key = "message.max.bytes" if res.restype == ResourceType.BROKER else "max.message.bytes"
            value = entries.get(key)
            if value is None or not str(value.value).isdigit():
                continue
            if res.restype == ResourceType.BROKER:
                broker_limit = min(broker_limit, int(value.value))
            else:
                limits[res.name] = min(limits[res.name], int(value.value))
        limits = {name: min(v, broker_limit) for name, v in limits.items()}
    except (KafkaException, RuntimeError, ValueError, TimeoutError) as exc:  # a limit we cannot learn
        log.info("message size limits not learned from the broker (%s): using the client's %d bytes", exc, client_limit)
    return limits


class NotDelivered(Unavailable, RuntimeError):
    """A synchronous publish the broker did not acknowledge in time."""


def prepare(
    topic: Topic, event: Event, limit: int, key: bytes | None = None
) -> tuple[list[tuple[bytes | None, bytes, str]], list[Event]]:
    """What publishing `event` on `topic` sends: (key, payload, event id) per record, and the
    parts that cannot fit `limit` bytes (to be dead-lettered). Refuses an event of the wrong type.

    `key`: only for a repartition topic (`Topic.keyed_by_router`), which needs it; every other
    topic is keyed by its own rule (schemas.topics.partition_key)."""
    if not isinstance(event, topic.event_type):
        raise TypeError(f"topic {topic.name} carries {topic.event_type.__name__}, not {type(event).__name__}")
    if topic.keyed_by_router != (key is not None):
        raise ValueError(
            f"topic {topic.name}: "
            + ("a repartition topic needs the router's key" if key is None else "is keyed by its own rule, not a key")
        )
    parts, unfit = fit_event(event, limit)
    return [(key if key is not None else partition_key(part), payload, part.event_id) for part, payload in parts], unfit


class Publisher:
    """Thread-safe event publisher with delivery counters.

    librdkafka buffers while the broker is away (bounded by
    queue.buffering.max.messages); a full buffer or an expired message is
    counted in `dropped` and logged with the event's id, never silently lost.
    A background thread serves delivery reports, so a drop is logged when it
    happens, not when the next event is published.

    Every event is made to fit the message size limit (`bus.fit`): an
    oversized batch goes out in parts; what cannot be made to fit becomes a
    dead letter. Publishing never raises on the size of its input, so a
    producer cannot crash-loop re-reading the same oversized lines.

    With `bootstrap_file` (a local `trainmedic up`'s runtime.json), the
    publisher follows the broker when `up` restarts it on another address:
    what was still queued for the old broker is sent to the new one.

    With `node_signer` (a node producer holding its node's key, bus.identity), every record
    on a node topic carries the node's signature (header `tm-node-sig`), which the streams
    worker checks against the node the record names.
    """

    def __init__(
        self,
        bootstrap: str,
        client_id: str = "trainmedic-producer",
        config: dict[str, object] | None = None,
        bootstrap_file: Path | None = None,
        learn_limits: bool = True,
        node_signer: NodeSigner | None = None,
    ) -> None:
        # `config`: librdkafka overrides, e.g. queue.buffering.max.messages (the buffer bound
        # while the broker is away) or message.timeout.ms (how long an event may wait for it).
        self._client_id = client_id
        self._signer = node_signer
        self._overrides = dict(config or {})
        self.bootstrap = bootstrap
        self._producer = self._make_producer(bootstrap)
        self._lock = threading.RLock()
        # Each count also goes to Prometheus (bus.metrics), as `producer` = the client id less `trainmedic-`.
        owner = client_id.removeprefix("trainmedic-")
        self.sent: Counter[str] = metrics.MirroredCounter(metrics.SENT, owner)
        self.delivered: Counter[str] = metrics.MirroredCounter(metrics.DELIVERED, owner)
        self.dropped: Counter[str] = metrics.MirroredCounter(metrics.DROPPED, owner)
        self.dead_lettered: Counter[str] = metrics.MirroredCounter(metrics.DEAD_LETTERED, owner)
        self.split: Counter[str] = metrics.MirroredCounter(metrics.SPLIT, owner)
        self.rebootstraps = 0
        client_limit = int(str(self._overrides.get("message.max.bytes", CLIENT_DEFAULT_MAX_BYTES)))
        self._client_limit = client_limit
        self._limits = learn_message_limits(bootstrap, client_limit) if learn_limits else {}
        self._resend: list[tuple[str, bytes | None, bytes | None, str]] = []
        self._bootstrap_file = bootstrap_file
        self._bootstrap_mtime = _mtime(bootstrap_file)
        self._stop = threading.Event()
        # The thread holds the publisher weakly: a publisher nobody uses any more is still
        # collected (and its librdkafka client with it), as before the thread existed.
        self._poller = threading.Thread(
            target=_serve, args=(weakref.ref(self), self._stop), name=f"{client_id}-delivery", daemon=True
        )
        self._poller.start()

    def _make_producer(self, bootstrap: str) -> Producer:
        # Never let a metadata request create a topic: every topic is made with its partitions by
        # ensure_topics. A restarted memory-only broker auto-created gpu.samples with 4 partitions
        # before `up` (or a test) made it with 12, and every buffered event already assigned a
        # higher partition failed with "Unknown partition" (62,502 lost in one CI run). Without
        # auto-creation they wait, up to message.timeout.ms, for the topic to be made.
        config = {**producer_config(bootstrap, self._client_id), "allow.auto.create.topics": False}
        return Producer({**config, **self._overrides})

    def _headers(self, topic: str, payload: bytes) -> list[tuple[str, str | bytes | None]] | None:
        # Signed where it is sent, so a part of a split event and a record re-sent to a moved
        # broker are signed as what they are.
        headers = self._signer.header(topic, payload) if self._signer is not None else None
        return None if headers is None else [(name, value) for name, value in headers]

    def limit(self, topic: str) -> int:
        return self._limits.get(topic, self._client_limit)

    def _delivery(self, event_id: str) -> Callable[[KafkaError | None, Message], None]:
        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            topic = msg.topic() or "?"
            with self._lock:
                if err is None:
                    self.delivered[topic] += 1
                elif err.code() in _PURGED:
                    # Purged on a switch to a new broker: sent again there, not lost.
                    self._resend.append((topic, msg.key(), msg.value(), event_id))
                else:
                    self.dropped[topic] += 1
                    log.error("dropped %s event %s: %s", topic, event_id, err)

        return on_delivery

    def publish(self, topic: Topic, event: Event) -> None:
        records, unfit = prepare(topic, event, self.limit(topic.name))
        if len(records) > 1:
            with self._lock:
                self.split[topic.name] += 1
            log.warning("%s event %s over the size limit: sent in %d parts", topic.name, event.event_id, len(records))
        for key, payload, event_id in records:
            self._produce(topic.name, payload, key, event_id, fixed_partition(topic))
        for bad in unfit:
            self._dead_letter(topic.name, bad, f"event over the {self.limit(topic.name)}-byte message size limit")

    def publish_sync(self, topic: Topic, event: Event, timeout_s: float = 30.0) -> int:
        """Publish one record and wait for the broker's acknowledgement; its offset.

        For records an action must wait for (the executor's attempt log): raises
        NotDelivered when it was not acknowledged, so the caller does not act."""
        records, unfit = prepare(topic, event, self.limit(topic.name))
        if unfit or len(records) != 1:
            raise NotDelivered(f"{topic.name} event {event.event_id} does not fit one record")
        key, payload, event_id = records[0]
        acked: list[tuple[KafkaError | None, int | None]] = []

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            acked.append((err, msg.offset()))
            self._delivery(event_id)(err, msg)

        try:
            with self._lock:
                self._producer.produce(
                    topic.name,
                    value=payload,
                    key=key,
                    on_delivery=on_delivery,
                    partition=_partition(fixed_partition(topic)),
                    headers=self._headers(topic.name, payload),
                )
                self.sent[topic.name] += 1
        except (BufferError, KafkaException) as exc:
            raise NotDelivered(f"{topic.name} event {event_id} not queued: {exc}") from None
        self._producer.flush(timeout_s)
        err, offset = acked[0] if acked else (None, None)
        if err is not None or offset is None:
            raise NotDelivered(
                f"{topic.name} event {event_id} not acknowledged: {err or f'no answer in {timeout_s:g} s'}"
            )
        return offset

    def _produce(
        self, topic: str, payload: bytes, key: bytes | None, event_id: str, partition: int | None = None
    ) -> None:
        for attempt in range(2):
            try:
                with self._lock:
                    self._producer.produce(
                        topic,
                        value=payload,
                        key=key,
                        on_delivery=self._delivery(event_id),
                        partition=_partition(partition),
                        headers=self._headers(topic, payload),
                    )
                break
            except BufferError:
                if attempt == 0:
                    # The local buffer is at its bound: give deliveries one chance to drain it.
                    self._producer.poll(0.5)
                    continue
                with self._lock:
                    self.dropped[topic] += 1
                log.error("producer buffer full; dropped %s event %s (broker away?)", topic, event_id)
                return
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
                # A limit lower than the one we knew: remember it and dead-letter this one.
                with self._lock:
                    self._limits[topic] = min(self.limit(topic), len(payload) - 1)
                self._dead_letter_raw(topic, payload, event_id, f"refused by the client as too large: {exc}")
                return
        with self._lock:
            self.sent[topic] += 1
        self._producer.poll(0)

    def _dead_letter(self, topic: str, event: Event, reason: str) -> None:
        from schemas.codec import encode

        self._dead_letter_raw(topic, encode(event), event.event_id, reason)

    def _dead_letter_raw(self, topic: str, payload: bytes, event_id: str, reason: str) -> None:
        with self._lock:
            self.dead_lettered[topic] += 1
        log.error("dead-lettered %s event %s: %s", topic, event_id, reason)
        limit = self.limit(DEADLETTER.name)
        # The letter must fit where the event did not: keep as much of the payload as the
        # limit leaves once base64 (4/3) and the letter's other fields are paid for.
        keep = max(0, (limit - 8192) * 3 // 4)
        if keep < len(payload):
            reason = f"{reason} (payload cut to its first {keep} of {len(payload)} bytes)"
        letter = make_dead_letter(
            self._client_id, topic, None, None, f"{reason} (event {event_id})", payload[:keep]
        ).model_copy(update={"event_id": f"dlq-{event_id}"[:200]})
        records, unfit = prepare(DEADLETTER, letter, limit)
        for key, data, letter_id in records:
            self._produce(DEADLETTER.name, data, key, letter_id)
        if unfit:
            with self._lock:
                self.dropped[topic] += 1
            log.error("dropped %s event %s: not even its dead letter fits %d bytes", topic, event_id, limit)

    def publish_raw(self, topic_name: str, payload: bytes, key: bytes | None = None) -> None:
        """For tests and tools that must send bytes that are not a valid event."""
        with self._lock:
            self._producer.produce(topic_name, value=payload, key=key, on_delivery=self._delivery("(raw)"))
        self._producer.poll(0)

    def flush(self, timeout: float = 10.0) -> int:
        """Wait for outstanding deliveries; returns how many are still queued."""
        return int(self._producer.flush(timeout))

    def pending(self) -> int:
        return len(self._producer)

    def rebootstrap(self, bootstrap: str) -> None:
        """Switch to another broker; what the old one had not acknowledged is sent to the new one."""
        with self._lock:
            old, self._producer, self.bootstrap = self._producer, self._make_producer(bootstrap), bootstrap
            self.rebootstraps += 1
        old.purge(in_queue=True, in_flight=True, blocking=False)
        old.flush(1.0)  # serves the purge reports: they land in _resend
        with self._lock:
            resend, self._resend = self._resend, []
        log.warning("broker moved to %s: re-sending %d undelivered events there", bootstrap, len(resend))
        for topic, key, value, event_id in resend:
            if value is not None:
                spec = TOPIC_BY_NAME.get(topic)
                self._produce(topic, value, key, event_id, fixed_partition(spec) if spec else None)

    def _check_bootstrap_file(self) -> None:
        mtime = _mtime(self._bootstrap_file)
        if self._bootstrap_file is None or mtime == self._bootstrap_mtime:
            return
        self._bootstrap_mtime = mtime
        try:
            new = str(json.loads(self._bootstrap_file.read_text())["bootstrap"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # being rewritten, or `up` stopped: keep the current broker and look again
        if new and new != self.bootstrap:
            self.rebootstrap(new)

    def _serve_once(self) -> None:
        try:
            self._producer.poll(0)
            self._check_bootstrap_file()
        except Exception:  # the delivery thread must outlive any one bad report
            log.exception("delivery report thread")

    def close(self, timeout: float = 10.0) -> int:
        self._stop.set()
        return self.flush(timeout)


def _serve(ref: weakref.ref[Publisher], stop: threading.Event) -> None:
    while not stop.wait(0.5):
        pub = ref()
        if pub is None:
            return
        pub._serve_once()
        del pub


def _partition(partition: int | None) -> int:
    # librdkafka's "unassigned" partition (RD_KAFKA_PARTITION_UA): the partitioner decides by key.
    return -1 if partition is None else partition


def _mtime(path: Path | None) -> float | None:
    try:
        return path.stat().st_mtime if path is not None else None
    except OSError:
        return None
