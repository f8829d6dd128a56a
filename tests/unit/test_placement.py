"""The placement every streams worker shares: job events -> node -> jobs."""

from __future__ import annotations

from schemas.events import SchedEvent
from streams.placement import Placement, PlacementIndex, placement_change


def _job(job: str, state: str, nodes: list[str], t: float) -> SchedEvent:
    return SchedEvent(
        event_id=f"{job}-{state}-{t}", event_time=t, kind="job", job_id=job, state=state, nodes=nodes, partition="gpu"
    )


def test_running_places_a_job_and_its_end_removes_it() -> None:
    index = PlacementIndex()
    change = placement_change(_job("7", "RUNNING", ["gpu01", "gpu02"], 10.0))
    assert isinstance(change, Placement)
    assert change.nodes == ("gpu01", "gpu02") and change.partition == "gpu"
    index.put(change)
    assert index.jobs_on("gpu02") == ["7"] and index.jobs_on("gpu03") == []
    for state in ("COMPLETED", "FAILED", "REQUEUED", "PENDING", "GONE", "NODE_FAIL"):
        assert placement_change(_job("7", state, [], 11.0)) == "ended", state
    index.drop("7")
    assert index.jobs_on("gpu01") == [] and len(index) == 0


def test_events_that_do_not_move_a_job_change_nothing() -> None:
    assert placement_change(_job("7", "RUNNING", [], 1.0)) is None  # no node list: nothing to place
    assert placement_change(_job("7", "CONFIGURING", ["gpu01"], 1.0)) is None
    assert placement_change(_job("7", "SUSPENDED", ["gpu01"], 1.0)) is None
    node = SchedEvent(event_id="n", event_time=1.0, kind="node", node="gpu01", state="DRAIN")
    assert placement_change(node) is None


def test_shared_nodes_list_every_job_and_a_requeue_moves_the_job() -> None:
    index = PlacementIndex()
    index.put(Placement("a", ("gpu01", "gpu02"), None, 1.0, "e1"))
    index.put(Placement("b", ("gpu02", "gpu03"), None, 2.0, "e2"))
    assert index.jobs_on("gpu02") == ["a", "b"]
    index.put(Placement("a", ("gpu04",), None, 3.0, "e3"))  # requeued, runs elsewhere
    assert index.jobs_on("gpu01") == [] and index.jobs_on("gpu02") == ["b"] and index.jobs_on("gpu04") == ["a"]


def test_an_older_placement_never_replaces_a_newer_one() -> None:
    index = PlacementIndex()
    assert index.put(Placement("a", ("gpu04",), None, 3.0, "new"))
    assert not index.put(Placement("a", ("gpu01",), None, 1.0, "old"))
    assert index.jobs_on("gpu04") == ["a"] and index.jobs_on("gpu01") == []


def test_the_table_round_trip_and_its_changelog_records_rebuild_the_same_index() -> None:
    placed = Placement("a", ("gpu01", "gpu02"), "gpu", 5.0, "e1")
    assert Placement.from_dict(placed.to_dict()) == placed
    index = PlacementIndex()
    index.apply("a", placed.to_dict())
    index.apply("b", Placement("b", ("gpu02",), None, 6.0, "e2").to_dict())
    index.apply("a", None)  # the tombstone of an ended run
    assert index.jobs_on("gpu01") == [] and index.jobs_on("gpu02") == ["b"]
    rebuilt = PlacementIndex()  # a table's contents applied after its recovery give the same answer
    for job_id, value in [("b", Placement("b", ("gpu02",), None, 6.0, "e2").to_dict()), ("a", None)]:
        rebuilt.apply(job_id, value)
    assert rebuilt.jobs_on("gpu02") == ["b"] and rebuilt.get("a") is None
