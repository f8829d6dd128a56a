"""The consumer watchdog's decisions (bus/watchdog.py): when a symptom is a stall, which remedy at
which time, and what the watched consumer does with each - without a broker."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from bus import watchdog
from bus.watchdog import ConsumerStalled, StallJudge, StallSettings, View, WatchedConsumer

A0, A1 = ("actions", 0), ("actions", 1)


def judge() -> StallJudge:
    return StallJudge(stall_s=10.0, give_up_s=60.0)


def assigned(starts: dict[tuple[str, int], int], ends: dict[tuple[str, int], int]) -> View:
    return View(settled=True, assignment=frozenset(ends) | frozenset(starts), starts=starts, ends=ends)


UNASSIGNED = View(settled=False, assignment=frozenset())


def test_a_consumer_that_moves_or_has_nothing_waiting_is_never_stalled() -> None:
    j = judge()
    for t in range(0, 200, 5):
        # Position moves every check on A0; A1 is at its end.
        v = j.observe(float(t), assigned({A0: t, A1: 7}, {A0: 1000, A1: 7}))
        assert v.symptom is None and v.remedy is None and v.stalled_s == 0


def test_a_settled_consumer_with_no_partition_is_not_stalled() -> None:
    """More members than partitions: the rebalance completed and gave this one none."""
    j = judge()
    for t in range(0, 200, 5):
        assert j.observe(float(t), View(settled=True, assignment=frozenset())).symptom is None


def test_no_assignment_resubscribes_then_resets_the_group_then_gives_up() -> None:
    j = judge()
    remedies = {t: j.observe(float(t), UNASSIGNED).remedy for t in range(0, 60, 2)}
    assert {t: r for t, r in remedies.items() if r} == {10: "resubscribe", 20: "reset_group"}
    # Past give_up_s, every look says so (the loop that asked ends at the first).
    assert [j.observe(float(t), UNASSIGNED).remedy for t in (60, 62)] == ["give_up", "give_up"]
    assert j.observe(70.0, UNASSIGNED).stalled_s == 70.0


def test_a_short_symptom_does_nothing_and_a_later_one_starts_over() -> None:
    """A join takes a few seconds: no partition for less than stall_s is no stall."""
    j = judge()
    assert [j.observe(float(t), UNASSIGNED).remedy for t in (0, 4, 8)] == [None, None, None]
    assert j.observe(9.0, assigned({A0: 0}, {A0: 0})).symptom is None
    # A new episode: its own clock and its remedies again from the first.
    assert j.observe(30.0, UNASSIGNED).stalled_s == 0
    assert j.observe(40.0, UNASSIGNED).remedy == "resubscribe"


def test_records_waiting_and_no_move_is_no_progress() -> None:
    j = judge()
    first = j.observe(0.0, assigned({A0: 3, A1: 5}, {A0: 9, A1: 5}))
    assert first.symptom is None  # one look cannot tell a move
    v = j.observe(5.0, assigned({A0: 3, A1: 5}, {A0: 9, A1: 5}))
    assert v.symptom == "no_progress" and v.partitions == {A0} and "actions[0] at 3 of 9" in v.detail
    assert j.observe(15.0, assigned({A0: 3, A1: 5}, {A0: 9, A1: 5})).remedy == "resubscribe"
    assert j.observe(25.0, assigned({A0: 3, A1: 5}, {A0: 9, A1: 5})).remedy == "resubscribe"
    # It moves: the episode is over.
    assert j.observe(30.0, assigned({A0: 4, A1: 5}, {A0: 9, A1: 5})).symptom is None


def test_a_new_consumer_is_not_compared_with_the_one_it_replaced() -> None:
    j = judge()
    j.observe(0.0, assigned({A0: 3}, {A0: 9}))
    j.forget_progress()
    assert j.observe(5.0, assigned({A0: 3}, {A0: 9})).symptom is None


def test_reading_past_the_end_of_the_log_seeks_to_its_beginning() -> None:
    """A broker that lost its log: the committed offset (50) is past the new log's end (3)."""
    j = judge()
    v = j.observe(0.0, assigned({A0: 50, A1: 2}, {A0: 3, A1: 2}))
    assert v.symptom == "beyond_end" and v.partitions == {A0} and "actions[0] at 50 > end 3" in v.detail
    later = j.observe(10.0, assigned({A0: 50, A1: 2}, {A0: 3, A1: 2}))
    assert later.remedy == "seek_beginning" and later.partitions == {A0}
    assert j.observe(12.0, assigned({A0: 0, A1: 2}, {A0: 3, A1: 2})).symptom is None


def test_partitions_whose_offsets_are_unknown_are_not_judged() -> None:
    j = judge()
    for t in range(0, 100, 5):
        assert j.observe(float(t), assigned({A0: 3}, {A1: 9})).symptom is None


def test_settings_are_checked() -> None:
    assert StallSettings(20.0, 180.0).check_interval_s == 5.0
    assert StallSettings(4.0, 60.0).check_interval_s == 1.0
    with pytest.raises(ValueError, match="consumer_stall_s"):
        StallSettings(0.0, 60.0)
    with pytest.raises(ValueError, match="twice consumer_stall_s"):
        StallSettings(30.0, 60.0)


# -- the watched consumer, on a consumer that never gets a partition -------------------------------


class FakeConsumer:
    """What WatchedConsumer uses of a confluent-kafka consumer; this one never gets a partition."""

    made: list[FakeConsumer] = []

    def __init__(self, group: str) -> None:
        self.group = group
        self.topics: list[str] = []
        self.callbacks: dict[str, Any] = {}
        self.closed = False
        self.commits: list[list[TopicPartition]] = []
        self.seeks: list[TopicPartition] = []
        FakeConsumer.made.append(self)

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.topics, self.callbacks = topics, callbacks

    def assignment(self) -> list[TopicPartition]:
        return []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.commits.append(offsets)

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append(tp)

    def close(self) -> None:
        self.closed = True


class FakeAdmin:
    deleted: list[str] = []

    def __init__(self, config: dict[str, Any]) -> None:
        pass

    def list_consumer_group_offsets(self, groups: list[Any]) -> dict[str, Any]:
        class Listed:
            topic_partitions = [
                TopicPartition("actions", 0, 40),
                TopicPartition("actions", 1, 41),
                TopicPartition("actions", 2, -1001),  # nothing committed
                TopicPartition("other", 0, 9),  # not a topic of this consumer
            ]

        return {g.group_id: Done(Listed()) for g in groups}

    def delete_consumer_groups(self, groups: list[str], request_timeout: float) -> dict[str, Any]:
        FakeAdmin.deleted.extend(groups)
        return {g: Done(None) for g in groups}


class Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self, timeout: float) -> Any:
        return self.value


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    FakeConsumer.made, FakeAdmin.deleted = [], []
    monkeypatch.setattr(watchdog, "group_consumer", lambda _b, group, _c, **_kw: FakeConsumer(group))
    monkeypatch.setattr(watchdog, "AdminClient", FakeAdmin)
    yield


def run_until(clock: Clock, check: Callable[[], str | None], until: float) -> list[str | None]:
    out = []
    while clock.now < until:
        clock.now += 1.0
        out.append(check())
    return out


def test_the_watched_consumer_applies_each_remedy_then_gives_up(fakes: None) -> None:
    clock = Clock()
    w = WatchedConsumer(
        "b:1", "g", "c", ["actions"], name="unit", stall=StallSettings(stall_s=4.0, give_up_s=20.0), clock=clock
    )
    first: Any = w.consumer
    problems = run_until(clock, w.check, clock.now + 7)
    assert problems[:3] == [None, None, None]  # not yet a stall: ready as far as the watchdog knows
    assert w.recoveries == [("no_assignment", "resubscribe")]
    assert isinstance(first, FakeConsumer) and first.closed
    assert w.consumer is not first and FakeConsumer.made[-1].topics == ["actions"]
    assert problems[-1] is not None and "unit stalled for" in problems[-1] and "no rebalance" in problems[-1]
    run_until(clock, w.check, clock.now + 5)
    assert w.recoveries[-1] == ("no_assignment", "reset_group") and FakeAdmin.deleted == ["g"]
    # The group's offsets were committed again, by a consumer that joined nothing, before the new one.
    restorer = FakeConsumer.made[-2]
    assert restorer.commits == [[TopicPartition("actions", 0, 40), TopicPartition("actions", 1, 41)]]
    assert restorer.closed and restorer.topics == []
    with pytest.raises(ConsumerStalled, match="still stalled after resubscribe, reset_group"):
        run_until(clock, w.check, clock.now + 30)


def test_a_rebalance_that_completes_ends_the_stall(fakes: None) -> None:
    clock = Clock()
    w = WatchedConsumer("b:1", "g", "c", ["actions"], name="unit2", stall=StallSettings(4.0, 20.0), clock=clock)
    assert run_until(clock, w.check, clock.now + 6)[-1] is not None
    # The new consumer's rebalance completes, with no partition for it: settled.
    FakeConsumer.made[-1].callbacks["on_assign"](w.consumer, [])
    assert w.settled
    assert run_until(clock, w.check, clock.now + 30) == [None] * 30
