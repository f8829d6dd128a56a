"""Rank -> node resolution (trainmedic.ops.rankmap): block, cyclic, explicit map, torchrun's local world size."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmedic.ops.rankmap import RankMapError, from_nodelist, load_rank_map, parse_rank_map, ranks_per_node_from_log


def test_block_is_the_default() -> None:
    m = from_nodelist("gpu[01-04]", ranks_per_node=8)
    assert [m.node_of(r) for r in (0, 7, 8, 15, 31)] == ["gpu01", "gpu01", "gpu02", "gpu02", "gpu04"]
    assert m.node_of(32) is None  # past the last node: not guessed
    assert m.node_of(None) is None


def test_cyclic() -> None:
    m = from_nodelist("gpu[01-04]", distribution="cyclic")
    assert [m.node_of(r) for r in (0, 1, 3, 4, 13)] == ["gpu01", "gpu02", "gpu04", "gpu01", "gpu02"]


def test_block_without_a_count_resolves_only_one_node() -> None:
    assert from_nodelist("gpu03").node_of(5) == "gpu03"
    assert from_nodelist("gpu[01-02]").node_of(5) is None


def test_explicit_map(tmp_path: Path) -> None:
    path = tmp_path / "ranks.txt"
    path.write_text("# rank node\n0-3 gpu02\n4: gpu01\n5,gpu01\n\n6 gpu04  # spare\n")
    m = load_rank_map(path)
    assert [m.node_of(r) for r in range(7)] == ["gpu02"] * 4 + ["gpu01", "gpu01", "gpu04"]
    assert m.node_of(7) is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("0 gpu01\n0 gpu02\n", "rank 0 is on gpu01 already"),
        ("zero gpu01\n", "expected 'RANK NODE'"),
        ("# nothing\n", "no 'RANK NODE' line"),
        ("5-2 gpu01\n", "bad rank range"),
    ],
)
def test_bad_maps_say_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(RankMapError, match=needle):
        parse_rank_map(text)


def test_bad_nodelist_distribution_and_count() -> None:
    with pytest.raises(RankMapError, match=r"node list: .*gpu\[01-04"):
        from_nodelist("gpu[01-04")
    with pytest.raises(RankMapError, match="distribution 'plane'"):
        from_nodelist("gpu01", distribution="plane")
    with pytest.raises(RankMapError, match=">= 1"):
        from_nodelist("gpu01", ranks_per_node=0)
    with pytest.raises(RankMapError, match="cannot read"):
        load_rank_map(Path("/nonexistent/ranks.txt"))


def test_local_world_size_from_torchrun_output() -> None:
    # torchrun's agent after rendezvous (meta-pytorch/torchx#492) and a launch command line as
    # people paste it into their logs (pytorch/elastic#97).
    rendezvous = [
        "ray/0 (CommandActor pid=494406)   group_world_size=2",
        "ray/0 (CommandActor pid=494406)   local_ranks=[0]",
    ]
    assert ranks_per_node_from_log(rendezvous) == 1
    assert ranks_per_node_from_log(["            --nnodes=1:4", "            --nproc_per_node=8"]) == 8
    assert ranks_per_node_from_log(["ray/0 (CommandActor pid=494406)   global_ranks=[0]"]) is None
