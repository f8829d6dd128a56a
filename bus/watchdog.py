"""Stalled group consumers, found and recovered, or said: the watchdog every consumer that acts
runs beside its poll loop (the executor's actions and lease consumers, the notifier, the node agent).

A consumer's loop can go round, beat and say it is ready while it consumes nothing: liveness
(bus/health.py) sees a loop, not its partitions. Three ways it happens, each seen on the embedded
broker (issue 40):

- ``no_assignment``: subscribed, but no rebalance completes, so the consumer never gets a partition.
  Tansu 0.6 wedges a group for good when the member its JoinGroup named leader leaves (LeaveGroup)
  before it sent its SyncGroup: the group keeps that member as its leader after removing it, and
  answers every other member's SyncGroup with REBALANCE_IN_PROGRESS (tansu-broker
  coordinator/group/administrator.rs: the Forming state's leave does not clear the leader, the
  Formed state's does). After a broker restart every member joins again at once, and the executor
  closes its actions consumer when the lease group evicts it - in the middle of that join: its
  actions group never formed again (3 of 3 runs). A consumer that completed a rebalance with no
  partition (more members than partitions) is settled, not stalled.
- ``no_progress``: assigned, records waiting (the end offset its own fetches saw is past its
  position), and the position does not move from one check to the next.
- ``beyond_end``: the position (or, before the first record, the committed offset) is past the end
  of the log. A broker that lost its log (a memory-only broker restarted) then holds offsets the
  consumer has read past; Tansu answers a fetch there with no record and no error, so the client's
  own out-of-range reset never happens and the consumer waits for records it will never see.

Each is a symptom; a stall is a symptom that lasts. The remedies, in order, as long as it lasts:
at ``stall_s``: ``seek_beginning`` (past the end: read the new log from its start, as
auto.offset.reset=earliest would) or ``resubscribe`` (a new consumer, a new member);
at ``2 * stall_s``: ``reset_group`` for a consumer that still has no partition - its committed
offsets read, the group deleted (DeleteGroups: the one request that clears a wedged group on Tansu;
Kafka refuses it while the group has members, and then nothing changes), the offsets committed
again, a new consumer; ``resubscribe`` again otherwise;
at ``give_up_s``: ``give_up``: `check()` raises ConsumerStalled, so the loop ends and its
supervisor (`up`'s, or Kubernetes through the process's exit) starts it again.
From ``stall_s`` on, `check()` returns why, for the caller's readiness (not ready while stalled).

Only what the client library keeps is read: the assignment and positions (local), the high
watermark the consumer's own fetches saw (`get_watermark_offsets(cached=True)`: the embedded
broker answers ListOffsets wrongly, a fetch rightly), and the committed offsets (one OffsetFetch per
check, only for partitions with no position yet). The checks run every few seconds, from the
consumer's own thread (a confluent-kafka consumer is not to be used from two threads at once).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from confluent_kafka import OFFSET_BEGINNING, Consumer, ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import Counter, Gauge

from bus.config import admin_config
from bus.consume import group_consumer
from schemas.errors import Unavailable

log = logging.getLogger("trainmedic.consumer_watchdog")

Symptom = Literal["no_assignment", "no_progress", "beyond_end"]
Remedy = Literal["seek_beginning", "resubscribe", "reset_group", "give_up"]
TP = tuple[str, int]
RebalanceCallback = Callable[[Consumer, list[TopicPartition]], None]

RECOVERIES = Counter(
    "trainmedic_consumer_stall_recoveries_total",
    "What the consumer watchdog did about a stalled consumer: by consumer, symptom (reason) and remedy (action)",
    ["consumer", "reason", "action"],
)
STALLED = Gauge(
    "trainmedic_consumer_stalled_seconds",
    "How long the consumer has shown a stall symptom (no partition, no progress with records waiting, "
    "past the log's end); 0: none",
    ["consumer"],
)
#: What a process with a watched consumer or a follower exports (trainmedic/stack/metrics_server.py).
FAMILIES = (RECOVERIES, STALLED)


class ConsumerStalled(Unavailable, RuntimeError):
    """The consumer stayed stalled through every remedy for give_up_s: its loop ends, to be restarted."""


@dataclass(frozen=True)
class StallSettings:
    """`stall_s`: how long a symptom lasts before it is a stall (and the first remedy is tried);
    above a group join's usual few seconds. `give_up_s`: how long a stall may last before the loop
    ends; longer than the remedies take (2 * stall_s and a join)."""

    stall_s: float = 20.0
    give_up_s: float = 180.0

    def __post_init__(self) -> None:
        if self.stall_s <= 0:
            raise ValueError(f"consumer_stall_s must be > 0, got {self.stall_s}")
        if self.give_up_s <= 2 * self.stall_s:
            raise ValueError(
                f"consumer_stall_give_up_s ({self.give_up_s:g}) must exceed twice consumer_stall_s "
                f"({self.stall_s:g}): the remedies are tried at 1 and 2 times consumer_stall_s"
            )

    @property
    def check_interval_s(self) -> float:
        """How often the consumer is looked at: a few times within stall_s, at most every 5 s."""
        return min(5.0, self.stall_s / 4)


_settings = StallSettings()


def configure(settings: StallSettings) -> None:
    """The process's thresholds (trainmedic.settings.apply, from the settings model)."""
    global _settings
    _settings = settings


def settings() -> StallSettings:
    return _settings


# -- the decision: pure, from what the consumer says of itself -------------------------------------


@dataclass(frozen=True)
class View:
    """A consumer at one check.

    `settled`: a rebalance completed since it subscribed or last lost its partitions (its assign
    callback ran, possibly with none). `starts`: where each assigned partition is read from (the
    position, else the committed offset, else the log's start when known); `ends`: the end offset
    its own fetches last saw. A partition missing from either is not judged."""

    settled: bool
    assignment: frozenset[TP]
    starts: Mapping[TP, int] = field(default_factory=dict)
    ends: Mapping[TP, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    symptom: Symptom | None
    stalled_s: float  # how long the symptom has lasted (0: none)
    remedy: Remedy | None  # what to do now
    detail: str  # the symptom in words
    partitions: frozenset[TP] = frozenset()  # those the symptom is about (beyond_end: to seek)


class StallJudge:
    """Whether a consumer is stalled and what to do about it, from one View per check.

    An episode is a run of checks that each show a symptom (any of them: a re-subscribed consumer
    without a partition yet continues the episode of the one it replaced); it ends at the first check
    without one. Within an episode each remedy is tried once, at its time (module docstring)."""

    def __init__(self, stall_s: float, give_up_s: float) -> None:
        self.stall_s, self.give_up_s = stall_s, give_up_s
        self._since: float | None = None
        self._step = 0
        self._previous: dict[TP, int] = {}  # the starts of the last check, to see progress

    def forget_progress(self) -> None:
        """A new consumer: positions start over, and are not compared with the old one's."""
        self._previous = {}

    def _symptom(self, view: View) -> tuple[Symptom | None, str, frozenset[TP]]:
        if not view.assignment:
            if view.settled:
                return None, "", frozenset()
            return "no_assignment", "subscribed, but no rebalance gives it its partitions", frozenset()
        beyond = frozenset(
            tp for tp in view.assignment if tp in view.starts and tp in view.ends and view.starts[tp] > view.ends[tp]
        )
        if beyond:
            where = ", ".join(f"{t}[{p}] at {view.starts[(t, p)]} > end {view.ends[(t, p)]}" for t, p in sorted(beyond))
            return "beyond_end", f"reading past the end of the log ({where})", beyond
        stuck = frozenset(
            tp
            for tp in view.assignment
            if tp in view.starts
            and tp in view.ends
            and view.starts[tp] < view.ends[tp]
            and self._previous.get(tp) == view.starts[tp]
        )
        if stuck:
            where = ", ".join(f"{t}[{p}] at {view.starts[(t, p)]} of {view.ends[(t, p)]}" for t, p in sorted(stuck))
            return "no_progress", f"records waiting and the position does not move ({where})", stuck
        return None, "", frozenset()

    def observe(self, now: float, view: View) -> Verdict:
        symptom, detail, partitions = self._symptom(view)
        self._previous = {tp: view.starts[tp] for tp in view.assignment if tp in view.starts}
        if symptom is None:
            self._since, self._step = None, 0
            return Verdict(None, 0.0, None, "")
        if self._since is None:
            self._since, self._step = now, 0
        lasted = now - self._since
        remedy: Remedy | None = None
        if lasted >= self.give_up_s:
            remedy = "give_up"
        elif self._step == 0 and lasted >= self.stall_s:
            remedy = "seek_beginning" if symptom == "beyond_end" else "resubscribe"
            self._step = 1
        elif self._step == 1 and lasted >= 2 * self.stall_s:
            remedy = "reset_group" if symptom == "no_assignment" else "resubscribe"
            self._step = 2
        return Verdict(symptom, lasted, remedy, detail, partitions)


def look(consumer: Consumer, settled: bool, committed: bool = True) -> View:
    """What the consumer says of itself now (no request but one OffsetFetch for partitions it has
    no position for yet, unless `committed` is False: a consumer that commits nothing).
    `settled`: what its rebalance callbacks said (View)."""
    c = consumer
    assigned = c.assignment()
    keys = frozenset((tp.topic, tp.partition) for tp in assigned)
    starts: dict[TP, int] = {}
    ends: dict[TP, int] = {}
    if not assigned:
        return View(settled, keys)
    unknown: list[TopicPartition] = []
    for tp in c.position(assigned):
        if tp.offset >= 0:
            starts[(tp.topic, tp.partition)] = tp.offset
        else:
            unknown.append(TopicPartition(tp.topic, tp.partition))
    if unknown and committed:
        try:
            for tp in c.committed(unknown, timeout=2.0):
                if tp.offset >= 0:
                    starts[(tp.topic, tp.partition)] = tp.offset
        except KafkaException as exc:  # the broker away or busy: judged at the next check
            log.debug("committed offsets unread: %s", exc)
    for tp in assigned:
        marks = c.get_watermark_offsets(tp, cached=True)
        if marks is None:
            continue
        low, high = marks
        key = (tp.topic, tp.partition)
        if high >= 0:
            ends[key] = high
        if key not in starts and low >= 0:
            starts[key] = low  # nothing consumed or committed yet: auto.offset.reset=earliest
    return View(settled, keys, starts, ends)


# -- the consumer it watches -----------------------------------------------------------------------


class WatchedConsumer:
    """A group consumer subscribed to `topics` (made by bus.consume.group_consumer), with its
    watchdog. The loop that owns it calls `check()` each time round (cheap: it looks every few
    seconds) and uses `consumer` for poll, commit and seek - the consumer object changes when the
    watchdog replaces it. `on_assign`, `on_revoke`, `on_lost`: the caller's rebalance callbacks."""

    def __init__(
        self,
        bootstrap: str,
        group: str,
        client_id: str,
        topics: Sequence[str],
        *,
        name: str,
        background: bool = False,
        overrides: Mapping[str, Any] | None = None,
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
        on_lost: RebalanceCallback | None = None,
        stall: StallSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.group, self.topics = name, group, list(topics)
        self._bootstrap, self._client_id, self._background = bootstrap, client_id, background
        self._overrides = dict(overrides or {})
        self._on_assign, self._on_revoke, self._on_lost = on_assign, on_revoke, on_lost
        self.stall = stall or settings()
        self._clock = clock
        self._judge = StallJudge(self.stall.stall_s, self.stall.give_up_s)
        self._next_check = clock() + self.stall.check_interval_s
        self._problem: str | None = None
        self.settled = False
        self.recoveries: list[tuple[Symptom, Remedy]] = []
        self._consumer: Consumer = self._subscribe()
        STALLED.labels(name).set(0)

    @property
    def consumer(self) -> Consumer:
        return self._consumer

    # -- subscription ------------------------------------------------------------------------

    def _subscribe(self) -> Consumer:
        consumer = group_consumer(
            self._bootstrap, self.group, self._client_id, background=self._background, **self._overrides
        )
        self.settled = False
        consumer.subscribe(self.topics, on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._lost)
        return consumer

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.settled = True
        if self._on_assign is not None:
            self._on_assign(consumer, partitions)

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.settled = False
        if self._on_revoke is not None:
            self._on_revoke(consumer, partitions)

    def _lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.settled = False
        if self._on_lost is not None:
            self._on_lost(consumer, partitions)

    def close(self) -> None:
        """Leave the group and close the consumer; its stall gauge's series goes too."""
        with contextlib.suppress(KeyError):
            STALLED.remove(self.name)
        self._consumer.close()

    # -- the watchdog ------------------------------------------------------------------------

    def view(self) -> View:
        return look(self._consumer, self.settled)

    def check(self) -> str | None:
        """Look at the consumer when due and apply what the judge says. Returns why it is stalled (for
        the caller's readiness) once a symptom has lasted stall_s, else None. Raises ConsumerStalled
        when it has lasted give_up_s."""
        now = self._clock()
        if now < self._next_check:
            return self._problem
        self._next_check = now + self.stall.check_interval_s
        verdict = self._judge.observe(now, self.view())
        STALLED.labels(self.name).set(verdict.stalled_s)
        if verdict.symptom is None:
            if self._problem is not None:
                log.info("%s: consuming again (group %s)", self.name, self.group)
            self._problem = None
            return None
        if verdict.remedy is not None:
            self._remedy(verdict)
        if verdict.stalled_s >= self.stall.stall_s:
            done = ", ".join(r for _, r in self.recoveries[-2:])
            self._problem = (
                f"{self.name} stalled for {verdict.stalled_s:.0f} s: {verdict.detail} (group {self.group}"
                + (f"; tried: {done}" if done else "")
                + ")"
            )
        return self._problem

    def _remedy(self, verdict: Verdict) -> None:
        assert verdict.symptom is not None and verdict.remedy is not None
        symptom, remedy = verdict.symptom, verdict.remedy
        RECOVERIES.labels(self.name, symptom, remedy).inc()
        self.recoveries.append((symptom, remedy))
        what = f"{self.name}: {verdict.detail} for {verdict.stalled_s:.0f} s (group {self.group})"
        if remedy == "give_up":
            log.error("%s: giving up; the loop ends, to be restarted", what)
            raise ConsumerStalled(f"{what}; still stalled after {', '.join(r for _, r in self.recoveries[:-1])}")
        log.warning("%s: %s", what, remedy.replace("_", " "))
        if remedy == "seek_beginning":
            self.seek_beginning(verdict.partitions)
        elif remedy == "reset_group":
            self.reset_group()
        else:
            self.resubscribe()

    # -- the remedies ------------------------------------------------------------------------

    def seek_beginning(self, partitions: Iterable[TP]) -> None:
        """Read these partitions from the start of their log (what auto.offset.reset=earliest does)."""
        for topic, partition in sorted(partitions):
            try:
                self._consumer.seek(TopicPartition(topic, partition, OFFSET_BEGINNING))
            except KafkaException as exc:  # no longer assigned: its next owner starts from the committed offset
                log.warning("%s: no seek on %s[%d]: %s", self.name, topic, partition, exc)

    def resubscribe(self) -> None:
        """Leave the group and join it again as a new member, with a new consumer."""
        try:
            self._consumer.close()
        except (KafkaException, RuntimeError) as exc:
            log.warning("%s: closing the stalled consumer: %s", self.name, exc)
        self._consumer = self._subscribe()
        self._judge.forget_progress()

    def _committed(self, admin: AdminClient) -> list[TopicPartition]:
        """The group's committed offsets on the topics (none when unreadable). Asked of the admin
        client: the stalled consumer's own coordinator connection may be held by a join or sync."""
        try:
            listed = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(self.group)])
            found = listed[self.group].result(10).topic_partitions or []
        except Exception as exc:  # confluent-kafka raises KafkaException, or the future times out
            log.warning(
                "%s: committed offsets of %s unread (%r): the group is reset without them", self.name, self.group, exc
            )
            return []
        return [
            TopicPartition(tp.topic, tp.partition, tp.offset)
            for tp in found
            if tp.topic in self.topics and tp.offset >= 0
        ]

    def reset_group(self) -> None:
        """Delete the group and commit its offsets again, then join it with a new consumer: what
        clears a group the broker wedged. Where the group cannot be deleted (Kafka, while it has
        members), a re-subscription."""
        # Held while its requests run: a client dropped at once is destroyed and its requests with it.
        admin = AdminClient(admin_config(self._bootstrap))
        saved = self._committed(admin)
        try:
            self._consumer.close()
        except (KafkaException, RuntimeError) as exc:
            log.warning("%s: closing the stalled consumer: %s", self.name, exc)
        try:
            admin.delete_consumer_groups([self.group], request_timeout=10)[self.group].result(15)
        except Exception as exc:  # Kafka refuses a group with members (GROUP_NOT_EMPTY): nothing was deleted
            log.warning("%s: group %s not deleted (%r); re-subscribing only", self.name, self.group, exc)
        else:
            log.warning("%s: group %s deleted; committing its %d offset(s) again", self.name, self.group, len(saved))
            if saved:
                # Assigned nothing, subscribed to nothing: a commit by no member, which an empty group takes.
                restorer = group_consumer(self._bootstrap, self.group, f"{self._client_id}-restore")
                try:
                    restorer.commit(offsets=saved, asynchronous=False)
                except KafkaException as exc:
                    log.error(
                        "%s: the offsets of %s not committed again (%s): read from the start",
                        self.name,
                        self.group,
                        exc,
                    )
                finally:
                    restorer.close()
        self._consumer = self._subscribe()
        self._judge.forget_progress()


class AssignedWatch:
    """The watchdog of a consumer that assigns itself its partitions (bus.consume.Follower: every
    record of a topic, no group). Without a group only the log can stall it: after a memory-only
    broker restart its positions are past the end of the new log, and it would wait there for good
    while the topic fills again from offset 0. Remedy: read the new log from its start. A follower
    that does not move with records waiting is logged (nothing else would help it)."""

    def __init__(self, name: str, stall: StallSettings | None = None, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.stall = stall or settings()
        self._clock = clock
        self._judge = StallJudge(self.stall.stall_s, self.stall.give_up_s)
        self._next_check = clock() + self.stall.check_interval_s
        self.recoveries: list[tuple[Symptom, Remedy]] = []

    def check(self, consumer: Consumer) -> None:
        now = self._clock()
        if now < self._next_check:
            return
        self._next_check = now + self.stall.check_interval_s
        verdict = self._judge.observe(now, look(consumer, settled=True, committed=False))
        if verdict.symptom is None or verdict.remedy is None:
            return
        if verdict.symptom == "beyond_end":
            log.warning("%s: %s for %.0f s: seek beginning", self.name, verdict.detail, verdict.stalled_s)
            RECOVERIES.labels(self.name, "beyond_end", "seek_beginning").inc()
            self.recoveries.append(("beyond_end", "seek_beginning"))
            for topic, partition in sorted(verdict.partitions):
                consumer.seek(TopicPartition(topic, partition, OFFSET_BEGINNING))
            self._judge.forget_progress()
        elif verdict.remedy != "give_up":
            log.warning("%s: %s for %.0f s", self.name, verdict.detail, verdict.stalled_s)
