"""The console's live feed: Kafka topics fanned out to Server-Sent Events clients.

One confluent-kafka consumer per process, in a background thread, reads the
operator-facing topics and hands every decoded event to each connected browser.
Nothing here reads the audit database: live updates come from Kafka only.

Where it starts reading. The console should show what happens from now on (the
page loads the past from the audit). `auto.offset.reset=latest` would say that,
but the embedded broker answers "latest" wrongly (docs/environment.md: the first
offset of the last batch + 1, so a few old records would replay or new ones be
skipped). Committed offsets do not help either: a group of its own per process
has none at start, and a shared group would split the partitions between
console processes, while each process must see every event. So the feed assigns
every partition of its topics from the earliest offset and drops records whose
Kafka timestamp (the producer's CreateTime) is older than the moment the feed
was created. The topics it reads carry decisions, not signals (a few records
per incident), so the scan at start-up is short even on a long-lived cluster.
Partitions are assigned directly (no group join: no ~3 s wait on the embedded
broker, no rebalance); the group id is still unique per process and nothing is
ever committed.

Fan-out. Each SSE client gets a bounded queue. The consumer thread appends
under a short lock and never waits: a client whose queue is full is marked
dropped and its stream ends with an `event: dropped` line; the browser's
EventSource reconnects with Last-Event-ID and the feed replays from a ring
of recent events, or tells the page to reload its snapshot when the ring no
longer reaches back that far.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_NOT_AVAILABLE, Consumer, KafkaError, Message, TopicPartition

from bus.consume import group_consumer
from schemas.codec import DecodeError, decode
from schemas.topics import (
    ACTION_RESULTS,
    APPROVALS,
    DECISIONS,
    GUARDRAIL_TRIPS,
    INCIDENTS,
    MODE_CHANGES,
    NODE_RETURNS,
    Topic,
)

log = logging.getLogger("trainmedic.web.console.live")

# The topics of the issue, plus mode changes and node returns, which tell the page
# when to reload /api/modes and /api/nodes (an event-driven reload, not a poll).
LIVE_TOPICS: tuple[Topic, ...] = (
    INCIDENTS,
    DECISIONS,
    ACTION_RESULTS,
    APPROVALS,
    GUARDRAIL_TRIPS,
    MODE_CHANGES,
    NODE_RETURNS,
)


@dataclass(frozen=True)
class LiveEvent:
    """One event as sent to browsers: `seq` is the SSE id, `kind` the SSE event name."""

    seq: int
    kind: str  # the event's type_name: incident, decision, action_result, ...
    topic: str
    data: bytes  # JSON object: the event's fields

    def sse(self) -> bytes:
        return b"id: %d\nevent: %s\ndata: %s\n\n" % (self.seq, self.kind.encode(), self.data)


@dataclass(eq=False)  # identity: subscribers live in a set
class Subscriber:
    """One SSE client: a bounded queue filled by the consumer thread, drained by the event loop."""

    loop: asyncio.AbstractEventLoop
    maxsize: int
    queue: deque[LiveEvent] = field(default_factory=deque)
    dropped: bool = False
    closed: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def offer(self, event: LiveEvent) -> bool:
        """Queue an event without ever waiting; False when the client was (or is now) dropped."""
        with self.lock:
            if self.dropped or self.closed:
                return False
            if len(self.queue) >= self.maxsize:
                self.dropped = True
                self.queue.clear()
            else:
                self.queue.append(event)
        self._notify()
        return not self.dropped

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self._notify()

    def take(self) -> list[LiveEvent]:
        with self.lock:
            out = list(self.queue)
            self.queue.clear()
            self.wake.clear()
        return out

    def _notify(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the client is gone too
            self.loop.call_soon_threadsafe(self.wake.set)


class LiveFeed:
    """A Kafka consumer thread fanning events out to SSE subscribers."""

    def __init__(
        self,
        bootstrap: str,
        *,
        group_prefix: str = "trainmedic-console",
        topics: Iterable[Topic] = LIVE_TOPICS,
        since: float | None = None,
        client_queue: int = 256,
        replay: int = 1000,
        heartbeat_s: float = 15.0,
        metadata_refresh_s: float = 30.0,
    ) -> None:
        self.bootstrap = bootstrap
        # A group of its own per process; never committed to (see the module docstring).
        self.group = f"{group_prefix}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.topics = {t.name: t for t in topics}
        self.since = time.time() if since is None else since
        self.client_queue = client_queue
        self.heartbeat_s = heartbeat_s
        self.metadata_refresh_s = metadata_refresh_s
        self.ready = threading.Event()  # set once every partition is assigned
        self.stop_event = threading.Event()
        self._ring: deque[LiveEvent] = deque(maxlen=replay)
        self._subscribers: set[Subscriber] = set()
        self._lock = threading.Lock()
        self._seq = 0
        self._thread: threading.Thread | None = None
        self.skipped_old = 0
        self.undecodable = 0
        self.dropped_clients = 0

    # --- the consumer thread ----------------------------------------------------------

    def start(self) -> LiveFeed:
        self._thread = threading.Thread(target=self._run, name="console-feed", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the consumer and end every open stream (call before stopping the HTTP server)."""
        self.stop_event.set()
        with self._lock:
            subs = list(self._subscribers)
        for sub in subs:
            sub.close()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        consumer = group_consumer(
            self.bootstrap, self.group, "trainmedic-console", background=True, **{"enable.partition.eof": False}
        )
        assigned: set[tuple[str, int]] = set()
        next_refresh = 0.0
        try:
            while not self.stop_event.is_set():
                if time.monotonic() >= next_refresh:
                    self._assign_new(consumer, assigned)
                    next_refresh = time.monotonic() + (self.metadata_refresh_s if self.ready.is_set() else 1.0)
                for msg in consumer.consume(num_messages=500, timeout=0.2):
                    if (err := msg.error()) is not None:
                        if err.code() != KafkaError._PARTITION_EOF:
                            log.warning("console feed: consumer error: %s", err)
                        continue
                    self._handle(msg)
        except Exception:
            log.exception("console feed: consumer thread failed")
            raise
        finally:
            consumer.close()

    def _assign_new(self, consumer: Consumer, assigned: set[tuple[str, int]]) -> None:
        try:
            meta = consumer.list_topics(timeout=5)
        except Exception as exc:
            log.warning("console feed: cannot read topic metadata: %s", exc)
            return
        new = [
            TopicPartition(name, p, OFFSET_BEGINNING)
            for name in self.topics
            if name in meta.topics and meta.topics[name].error is None
            for p in meta.topics[name].partitions
            if (name, p) not in assigned
        ]
        if new:
            consumer.incremental_assign(new)
            assigned.update((tp.topic, tp.partition) for tp in new)
        if not self.ready.is_set() and {n for n, _ in assigned} == set(self.topics):
            self.ready.set()
            self._emit("feed", "feed", orjson.dumps({"ready": True}))
        elif not self.ready.is_set():
            missing = sorted(set(self.topics) - {n for n, _ in assigned})
            log.info("console feed: waiting for topics %s", ", ".join(missing))

    def _record_time(self, msg: Message) -> float | None:
        kind, ms = msg.timestamp()
        return None if kind == TIMESTAMP_NOT_AVAILABLE or ms < 0 else ms / 1000.0

    def _handle(self, msg: Message) -> None:
        topic = self.topics.get(msg.topic() or "")
        if topic is None:
            return
        ts = self._record_time(msg)
        if ts is not None and ts < self.since:
            self.skipped_old += 1
            return
        try:
            event = decode(topic.event_type, msg.value() or b"")
        except DecodeError as exc:
            self.undecodable += 1
            log.warning("console feed: skipped undecodable %s record at offset %s: %s", topic.name, msg.offset(), exc)
            return
        if ts is None and event.produced_at < self.since:  # no broker timestamp: the producer's clock
            self.skipped_old += 1
            return
        self._emit(event.type_name, topic.name, orjson.dumps(event.model_dump(mode="json")))

    def _emit(self, kind: str, topic: str, data: bytes) -> LiveEvent:
        with self._lock:
            self._seq += 1
            ev = LiveEvent(self._seq, kind, topic, data)
            self._ring.append(ev)
            subs = list(self._subscribers)
        for sub in subs:
            if not sub.offer(ev) and sub.dropped and not sub.closed:
                log.warning("console feed: dropped a slow client (queue of %d full)", sub.maxsize)
                self.dropped_clients += 1
                self._unsubscribe(sub)
        return ev

    # Public for tests and for producers of console-only notices.
    publish = _emit

    # --- subscribers (called on the event loop) ----------------------------------------------

    def subscribe(self, last_id: int | None = None) -> tuple[Subscriber, list[LiveEvent] | None, int]:
        """A new subscriber, the events it missed since last_id (None: cannot replay, reload the
        snapshot) and the id of the last event before it subscribed."""
        sub = Subscriber(loop=asyncio.get_running_loop(), maxsize=self.client_queue)
        with self._lock:
            self._subscribers.add(sub)
            at = self._seq
            if last_id is None:
                return sub, [], at
            if last_id > at:  # an id from before a restart of this process
                return sub, None, at
            oldest = self._ring[0].seq if self._ring else at + 1
            if last_id + 1 < oldest:
                return sub, None, at
            return sub, [e for e in self._ring if e.seq > last_id], at

    def _unsubscribe(self, sub: Subscriber) -> None:
        with self._lock:
            self._subscribers.discard(sub)

    @property
    def clients(self) -> int:
        with self._lock:
            return len(self._subscribers)

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._seq

    async def stream(self, last_id: int | None, is_disconnected: Callable[[], Any]) -> AsyncIterator[bytes]:
        """The SSE byte stream of one client."""
        sub, missed, at = self.subscribe(last_id)
        try:
            yield b"retry: 2000\n\n"
            hello = {"ready": self.ready.is_set(), "since": self.since, "last_id": at}
            if missed is None:
                # Too far behind to replay: the page reloads its snapshot from the audit.
                yield b"id: %d\nevent: hello\ndata: %s\n\n" % (at, orjson.dumps(hello))
                yield b"event: reset\ndata: {}\n\n"
            elif missed:
                yield b"event: hello\ndata: %s\n\n" % orjson.dumps(hello)
                for ev in missed:
                    yield ev.sse()
            else:
                # The id tells EventSource where this client stands, so that a reconnect
                # after a drop replays what it missed even if no event came before.
                yield b"id: %d\nevent: hello\ndata: %s\n\n" % (at, orjson.dumps(hello))
            while not self.stop_event.is_set():
                try:
                    await asyncio.wait_for(sub.wake.wait(), timeout=self.heartbeat_s)
                except TimeoutError:
                    if await is_disconnected():
                        return
                    yield b": keepalive\n\n"
                    continue
                for ev in sub.take():
                    yield ev.sse()
                if sub.dropped:
                    yield b'event: dropped\ndata: {"reason": "the client fell behind"}\n\n'
                    return
                if sub.closed:
                    return
        finally:
            sub.close()
            self._unsubscribe(sub)
