"""The executor's acting lease: partition 0 of action.attempts, owned through a consumer group.

Exactly one executor replica may act on the scheduler at a time, or two replicas
would each count only their own drains and together exceed the guardrails. Every
replica joins the lease group (`<executor group>.lease`) on the action.attempts
topic; the one its group assigns ATTEMPTS_PARTITION to holds the lease. Only the
holder consumes actions, writes attempt records and calls the scheduler; the
others stand by and take over through an ordinary rebalance when it leaves, dies
or stops polling.

Losing the lease is noticed in two ways. The rebalance callbacks clear `owned`
when the replica polls. And, because a replica that was paused (SIGSTOP, a stuck
scheduler call, a network cut) has not polled yet and still believes it holds
the lease, `confirm()` asks the broker before every scheduler call: a
synchronous offset commit in the lease group, which the group coordinator
refuses (UNKNOWN_MEMBER_ID, ILLEGAL_GENERATION, REBALANCE_IN_PROGRESS) once the
member has been evicted or a new generation exists. The executor writes the
attempt record *before* it confirms, so whatever a replica did while it still
held the lease is on the topic before its successor (which reads the topic back
when it gains the lease) can start.

Why not the transactional producer with the group's metadata
(`send_offsets_to_transaction`), the textbook fence: measured on the embedded
Tansu 0.6 broker, a transaction whose offsets carried the metadata of a member
evicted by session timeout still committed (Tansu does not check the member or
generation of TxnOffsetCommit), while a plain commit by the same member failed
with UNKNOWN_MEMBER_ID. The commit check fences on Tansu and on Kafka alike.
What no broker-side fence covers is a scheduler call already in flight when the
lease is lost: the previous holder's attempt is counted (it was recorded before
the call), so the guardrails' limits still hold; the call itself may land a
moment after the successor started.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from bus.watchdog import WatchedConsumer
from schemas.errors import Refused
from schemas.topics import ACTION_ATTEMPTS, ATTEMPTS_PARTITION

log = logging.getLogger("trainmedic.executor.lease")


class Fenced(Refused, RuntimeError):
    """This replica does not (or no longer) hold the acting lease: it must not act."""


class ActingLease:
    def __init__(self, bootstrap: str, group: str, client_id: str, max_poll_interval_s: float) -> None:
        self._bootstrap, self._client_id = bootstrap, client_id
        # A holder that stops polling this long leaves the group: its successor takes over.
        self._overrides: dict[str, Any] = {"max.poll.interval.ms": int(max_poll_interval_s * 1000)}
        self.group = group
        self._lock = threading.Lock()
        self._owned = False
        self.epoch = 0  # +1 each time the lease is gained: what was read back belongs to one epoch
        self._offset = 0  # committed by confirm(): the attempts this holder has seen written
        self._consumer: WatchedConsumer | None = None
        self._partitions: list[int] = []
        self._elsewhere = True  # until the group assigns the lease partition to this replica
        self.heard = False  # the group has assigned this replica something (or nothing) at least once

    @property
    def elsewhere(self) -> bool:
        """Another replica may hold the lease now (this one was assigned other partitions, lost its
        assignment, or has not been assigned yet), as opposed to a rebalance still in progress."""
        return self._elsewhere

    @property
    def owned(self) -> bool:
        """What this replica last heard from its group (may be stale until confirmed)."""
        return self._owned

    def assignment(self) -> list[int]:
        """The lease topic's partitions this replica was last assigned (observability; kept from the
        callbacks: another thread calling into the consumer while it serves a rebalance can deadlock)."""
        return list(self._partitions)

    def join(self) -> None:
        # Watched (bus/watchdog.py): a lease group that never completes a rebalance leaves every
        # replica standing by for good; the watchdog re-joins, resets the group, or ends the loop.
        self._consumer = WatchedConsumer(
            self._bootstrap,
            self.group,
            self._client_id,
            [ACTION_ATTEMPTS.name],
            name="executor-lease",
            overrides=self._overrides,
            on_assign=self._assigned,
            on_revoke=self._revoked,
            on_lost=self._lost,
        )

    def _assigned(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._partitions = sorted(p.partition for p in partitions)
        self._elsewhere = ATTEMPTS_PARTITION not in self._partitions
        self.heard = True
        if not self._elsewhere:
            with self._lock:
                self._owned = True
                self.epoch += 1
            log.info("acting lease gained (%s partition %d, epoch %d)", self.group, ATTEMPTS_PARTITION, self.epoch)

    def _revoked(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._partitions = []
        if self._owned:
            log.info("acting lease revoked by a rebalance of %s", self.group)
        self._owned = False

    def _lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._partitions = []
        self._elsewhere = True
        if self._owned:
            log.warning("acting lease lost: %s evicted this replica (session or poll timeout)", self.group)
        self._owned = False

    def poll(self, timeout: float) -> None:
        """Serve the group's callbacks. Records of the topic are not this consumer's business."""
        assert self._consumer is not None, "join() first"
        self._consumer.check()  # raises ConsumerStalled when no remedy helped
        msg = self._consumer.consumer.poll(timeout)
        if msg is not None and (err := msg.error()) is not None and err.code() != KafkaError._PARTITION_EOF:
            log.warning("lease group %s: %s", self.group, err)

    def confirm(self, offset: int | None = None) -> None:
        """Raise Fenced unless the group coordinator still takes this replica for the lease holder.

        `offset`: the end of the attempts log after this holder's last record (committed, so the
        lease group's offset tells how far the holder had written when it was last confirmed).
        """
        if not self._owned or self._consumer is None:
            raise Fenced(f"this replica does not hold the acting lease ({self.group})")
        if offset is not None:
            self._offset = max(self._offset, offset)
        try:
            self._consumer.consumer.commit(
                offsets=[TopicPartition(ACTION_ATTEMPTS.name, ATTEMPTS_PARTITION, self._offset)], asynchronous=False
            )
        except KafkaException as exc:
            self._owned, self._elsewhere = False, True
            raise Fenced(f"the lease group {self.group} no longer counts this replica as the holder: {exc}") from None

    def rejoin(self) -> None:
        """Leave the group and join again as a new member: after a failed confirm the local view
        is stale; a fresh join either gives the lease back (read back again) or leaves it to another."""
        self.close()
        self.join()

    def close(self) -> None:
        self._owned, self._elsewhere = False, True
        self._partitions = []
        if self._consumer is not None:
            try:
                self._consumer.close()
            except (KafkaException, RuntimeError) as exc:
                log.warning("closing the lease consumer: %s", exc)
            self._consumer = None
