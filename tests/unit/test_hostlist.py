"""slurmio's Slurm hostlist expander (python-hostlist plus Slurm's placeholders and limits).

Expected values are what `scontrol show hostnames` of Slurm 22.05.8 prints
for the same input (checked by hand on the local cluster; the Slurm producer's
integration test compares a few against scontrol live on 22.05 and 24.11).
"""

from __future__ import annotations

import pytest

from slurmio.hostlist import HostlistError, expand_hostlist


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-03,05]", ["gpu01", "gpu02", "gpu03", "gpu05"]),
        ("gpu[01-04]", ["gpu01", "gpu02", "gpu03", "gpu04"]),
        ("gpu[01,03-04]", ["gpu01", "gpu03", "gpu04"]),
        ("gpu01,cpu[1-2]", ["gpu01", "cpu1", "cpu2"]),
        ("n[1-2],m", ["n1", "n2", "m"]),
        ("a,b,a", ["a", "b", "a"]),  # Slurm keeps duplicates and order
        ("n[5]", ["n5"]),
        ("n[0-0]", ["n0"]),
        ("n1[0-2]", ["n10", "n11", "n12"]),
    ],
)
def test_common_forms(text: str, expected: list[str]) -> None:
    assert expand_hostlist(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Padding is the width of the lower bound, as in Slurm.
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[009-011]", ["n009", "n010", "n011"]),
        ("n[01-2]", ["n01", "n02"]),
        ("n[1-010]", [f"n{i}" for i in range(1, 11)]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ],
)
def test_zero_padding(text: str, expected: list[str]) -> None:
    assert expand_hostlist(text) == expected


def test_several_groups_are_a_cartesian_product_in_slurm_order() -> None:
    assert expand_hostlist("a[1-2]b[3-4]") == ["a1b3", "a1b4", "a2b3", "a2b4"]
    assert expand_hostlist("rack[1-2]-node[01-02]") == [
        "rack1-node01",
        "rack1-node02",
        "rack2-node01",
        "rack2-node02",
    ]


def test_text_after_a_group() -> None:
    assert expand_hostlist("x[1-2]-ib") == ["x1-ib", "x2-ib"]


@pytest.mark.parametrize("text", [None, "", "  ", "(null)", "None", "N/A"])
def test_empty_and_placeholders(text: str | None) -> None:
    assert expand_hostlist(text) == []


def test_large_list() -> None:
    names = expand_hostlist("gpu[0001-2048]")
    assert len(names) == 2048
    assert names[0] == "gpu0001" and names[-1] == "gpu2048"


@pytest.mark.parametrize(
    "text",
    [
        "n[3-1]",  # descending
        "n[1-2",  # unclosed
        "n1-2]",  # unbalanced
        "n[[1-2]]",  # nested
        "n[a-b]",  # not numbers
        "n[1-]",
        "n[]",
        "n[1-2],,m",  # empty name
        "n[0-99999999]",  # absurdly large
    ],
)
def test_malformed_raises(text: str) -> None:
    with pytest.raises(HostlistError):
        expand_hostlist(text)


def test_result_is_a_fresh_list() -> None:
    # The expander caches; callers must not be able to change the cached value.
    first = expand_hostlist("gpu[01-02]")
    first.append("evil")
    assert expand_hostlist("gpu[01-02]") == ["gpu01", "gpu02"]
