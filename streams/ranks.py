"""Rank lists as operators read them: [12, 13, 14, 15, 20] -> '12-15,20'.

Its own module so that attribution (and `trainmedic diagnose`, which the node install runs) does not
load the straggler detector and its numpy.
"""

from __future__ import annotations

from collections.abc import Iterable


def rank_ranges(ranks: Iterable[int], sep: str = ",") -> str:
    """[12, 13, 14, 15, 20] -> '12-15,20' (sep ', ' for prose)."""
    out: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return sep.join(out)
