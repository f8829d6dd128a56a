"""The consumer watchdog on the real (embedded) broker: a group the broker wedged is reset and its
consumer gets its partitions; a consumer whose committed offset is past the end of the log, as
after a memory-only broker lost it, reads the log again from its start; a follower (assigned, no
group) reads the new log of a restarted broker; a reset of the group keeps its committed offsets."""

from __future__ import annotations

from confluent_kafka import Producer, TopicPartition

from bus.admin import ensure_topics
from bus.config import producer_config
from bus.consume import Follower, group_consumer
from bus.watchdog import StallSettings, WatchedConsumer, configure, settings
from schemas.topics import DECISIONS, MODE_CHANGES
from tests.conftest import wait_for
from trainmedic.stack.broker import EmbeddedBroker

QUICK = StallSettings(stall_s=5.0, give_up_s=60.0)  # a join takes about 3 s
TOPIC = DECISIONS.name


def _produce(bootstrap: str, values: list[str], topic: str = TOPIC) -> int:
    """The values, one key (so one partition); that partition."""
    partitions: list[int] = []
    producer = Producer(producer_config(bootstrap, "watchdog-test"))
    for value in values:
        producer.produce(
            topic, key=b"one-key", value=value.encode(), on_delivery=lambda _e, m: partitions.append(m.partition() or 0)
        )
    assert producer.flush(10) == 0
    return partitions[0]


def _take(watch: WatchedConsumer, n: int, timeout: float = 45.0) -> list[str]:
    """Poll (and check) until n records came, committing each; their values."""
    got: list[str] = []

    def more() -> bool:
        watch.check()
        msg = watch.consumer.poll(0.2)
        if msg is not None and msg.error() is None:
            got.append((msg.value() or b"").decode())
            watch.consumer.commit(message=msg, asynchronous=False)
        return len(got) >= n

    wait_for(f"{n} records", more, timeout=timeout, interval=0.0)
    return got


def test_a_group_whose_leader_left_mid_join_is_reset_and_its_consumer_gets_its_partitions(
    broker: EmbeddedBroker,
) -> None:
    """Tansu 0.6 keeps a member that left a forming group as its leader: no other member's
    SyncGroup succeeds again (docs/environment.md). Made here on purpose: A holds the group, B's
    join puts it back to forming with A as leader, and A leaves before it joins again (A is not
    polled, so it cannot serve its revocation and rejoin). The broker restart of issue 40 made the
    same state by chance."""
    _produce(broker.bootstrap, ["w1", "w2"])
    a = group_consumer(broker.bootstrap, "wedged", "leader")
    a.subscribe([TOPIC], on_assign=lambda _c, _ps: None)
    wait_for("A to hold the group", lambda: a.poll(0.2) is None and a.assignment(), timeout=30)
    b = WatchedConsumer(broker.bootstrap, "wedged", "follower", [TOPIC], name="test-wedged", stall=QUICK)
    try:

        def joining() -> bool:
            b.consumer.poll(0.1)
            return bool(b.consumer.memberid())

        wait_for("B's first JoinGroup", joining, timeout=30)
        a.close()  # LeaveGroup while the group forms with A as its leader
        assert sorted(_take(b, 2)) == ["w1", "w2"]
        # A new member did not help; deleting the group did.
        assert b.recoveries == [("no_assignment", "resubscribe"), ("no_assignment", "reset_group")]
    finally:
        b.close()


def test_a_committed_offset_past_the_log_end_is_read_again_from_the_start(broker: EmbeddedBroker) -> None:
    """The broker answers a fetch past the end with nothing, and no error: a plain consumer waits
    there for good (measured). The watchdog sees the position past the end its fetches report."""
    partition = _produce(broker.bootstrap, ["a", "b", "c"])
    # What a restarted memory-only broker can hold: the group's offset from before, its log new.
    stale = group_consumer(broker.bootstrap, "past-the-end", "stale")
    stale.commit(offsets=[TopicPartition(TOPIC, partition, 50)], asynchronous=False)
    stale.close()
    watch = WatchedConsumer(broker.bootstrap, "past-the-end", "watched", [TOPIC], name="test-past-end", stall=QUICK)
    try:
        assert _take(watch, 3) == ["a", "b", "c"]
        assert watch.recoveries == [("beyond_end", "seek_beginning")]
    finally:
        watch.close()


def test_a_reset_group_keeps_its_committed_offsets(broker: EmbeddedBroker) -> None:
    partition = _produce(broker.bootstrap, ["1", "2", "3", "4"])
    watch = WatchedConsumer(broker.bootstrap, "kept", "watched", [TOPIC], name="test-reset", stall=QUICK)
    try:
        assert _take(watch, 4) == ["1", "2", "3", "4"]
        old = watch.consumer
        watch.reset_group()
        assert watch.consumer is not old
        committed = watch.consumer.committed([TopicPartition(TOPIC, partition)], timeout=10)
        assert committed[0].offset == 4
        _produce(broker.bootstrap, ["5", "6"])
        assert _take(watch, 2) == ["5", "6"]  # not 1-4 again
        assert watch.recoveries == []  # asked for, not a stall
    finally:
        watch.close()


def test_a_follower_reads_the_new_log_of_a_restarted_broker(broker: EmbeddedBroker) -> None:
    """Before: its position (3) stayed past the new log's end (2) and it read nothing more."""
    before = settings()
    configure(QUICK)
    try:
        _produce(broker.bootstrap, ["a", "b", "c"], MODE_CHANGES.name)
        follower = Follower(broker.bootstrap, MODE_CHANGES.name, "watchdog-test")
    finally:
        configure(before)
    try:
        first: list[bytes] = []

        def first_log() -> bool:
            first.extend(follower.poll())
            return len(first) >= 3

        wait_for("the first log", first_log, timeout=30)
        broker.stop(grace_s=0)  # SIGKILL; then an empty broker on the same port, its topics again
        broker.start()
        ensure_topics(broker.bootstrap)
        _produce(broker.bootstrap, ["x", "y"], MODE_CHANGES.name)
        after: list[bytes] = []

        def new_log() -> bool:
            after.extend(follower.poll())
            return len(after) >= 2

        wait_for("the new log's records", new_log, timeout=45)
        assert after == [b"x", b"y"]
    finally:
        follower.close()
