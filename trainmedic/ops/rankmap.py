"""Rank -> node resolution for `trainmedic diagnose`: which node ran the rank a log blames.

Three ways, as Slurm places tasks:

- **block** (Slurm's default, ``--distribution=block``): ranks fill a node before the next one,
  ``node = nodes[rank // ranks_per_node]``;
- **cyclic** (``--distribution=cyclic``): round robin, ``node = nodes[rank % len(nodes)]``;
- an **explicit map file** for anything else (arbitrary ``--distribution``, heterogeneous jobs,
  a hostfile): one ``RANK NODE`` per line (``RANK: NODE`` and ``RANK,NODE`` too, ``FIRST-LAST NODE``
  for a range), ``#`` comments and blank lines ignored.

The node list is a Slurm hostlist expression (``gpu[01-04]``), expanded by slurmio, the
project's one Slurm layer. Under torchrun inside srun (one srun task per node, torchrun
starting ``--nproc_per_node`` workers), ranks per node is torchrun's local world size:
`ranks_per_node_from_log` reads it from the log when the launcher printed it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast, get_args

from schemas.errors import UsageError
from schemas.ids import node_for_host
from slurmio.hostlist import HostlistError, expand_hostlist

Distribution = Literal["block", "cyclic"]
DISTRIBUTIONS: tuple[str, ...] = get_args(Distribution)
MAX_RANK = 10_000_000

_MAP_LINE = re.compile(r"^\s*(\d+)(?:\s*-\s*(\d+))?\s*[:,=\s]\s*(\S+)\s*$")
# torchrun's agent prints its rendezvous result ('local_ranks=[0, 1, 2, 3]'), jobs print their
# environment (LOCAL_WORLD_SIZE=8) or their command line (--nproc_per_node=8, --nproc-per-node 8).
_LOCAL_WORLD = re.compile(
    r"\bLOCAL_WORLD_SIZE\b['\"]?\s*[:=]\s*['\"]?(\d{1,4})\b|--nproc[_-]per[_-]node[=\s]+(\d{1,4})\b"
)
_LOCAL_RANKS = re.compile(r"\blocal_ranks=\[(\d+(?:,\s*\d+)*)\]")


class RankMapError(UsageError, ValueError):
    """A node list, distribution or rank map that cannot be used; the message names it."""


@dataclass(frozen=True)
class RankMap:
    nodes: tuple[str, ...] = ()
    ranks_per_node: int | None = None
    distribution: Distribution = "block"
    explicit: Mapping[int, str] = field(default_factory=dict)

    def node_of(self, rank: int | None) -> str | None:
        """The node that ran `rank`, or None when it cannot be told (no map, rank out of range)."""
        if rank is None or rank < 0:
            return None
        if self.explicit:
            return self.explicit.get(rank)
        if not self.nodes:
            return None
        if self.distribution == "cyclic":
            return self.nodes[rank % len(self.nodes)]
        if self.ranks_per_node is None:
            # One node: every rank is on it. More: block needs the count per node.
            return self.nodes[0] if len(self.nodes) == 1 else None
        i = rank // self.ranks_per_node
        return self.nodes[i] if i < len(self.nodes) else None

    def resolve_host(self, host: str) -> str | None:
        """The node of this placement that `host` names: the same name, else the same short name
        (the first DNS label: gpu01.cluster.local and gpu01 are one node), or None."""
        return node_for_host(host, self.nodes)

    def describe(self) -> str:
        if self.explicit:
            return f"rank map of {len(self.explicit)} ranks"
        per = f", {self.ranks_per_node} ranks per node" if self.ranks_per_node else ""
        return f"{self.distribution} distribution over {len(self.nodes)} nodes{per}"


def from_nodelist(nodelist: str, ranks_per_node: int | None = None, distribution: str = "block") -> RankMap:
    if distribution not in DISTRIBUTIONS:
        raise RankMapError(f"distribution {distribution!r}: expected one of {', '.join(DISTRIBUTIONS)}")
    if ranks_per_node is not None and ranks_per_node < 1:
        raise RankMapError(f"ranks per node must be >= 1, got {ranks_per_node}")
    try:
        nodes = tuple(expand_hostlist(nodelist))
    except HostlistError as exc:
        raise RankMapError(f"node list: {exc}") from None
    if not nodes:
        raise RankMapError(f"node list {nodelist!r} names no node")
    return RankMap(nodes=nodes, ranks_per_node=ranks_per_node, distribution=cast(Distribution, distribution))


def parse_rank_map(text: str, source: str = "rank map") -> RankMap:
    explicit: dict[int, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _MAP_LINE.match(line)
        if m is None:
            raise RankMapError(f"{source}:{n}: expected 'RANK NODE' (or 'FIRST-LAST NODE'), got {raw.strip()!r}")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) else first
        if last < first or last > MAX_RANK:
            raise RankMapError(f"{source}:{n}: bad rank range {first}-{last}")
        for rank in range(first, last + 1):
            if rank in explicit and explicit[rank] != m.group(3):
                raise RankMapError(f"{source}:{n}: rank {rank} is on {explicit[rank]} already, not {m.group(3)}")
            explicit[rank] = m.group(3)
    if not explicit:
        raise RankMapError(f"{source}: no 'RANK NODE' line")
    nodes = tuple(dict.fromkeys(explicit[r] for r in sorted(explicit)))
    return RankMap(nodes=nodes, explicit=explicit)


def load_rank_map(path: Path) -> RankMap:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise RankMapError(f"{path}: cannot read the rank map: {exc.strerror}") from None
    return parse_rank_map(text, str(path))


def ranks_per_node_from_log(lines: Iterable[str]) -> int | None:
    """torchrun's local world size as the log prints it, or None (the first mention wins)."""
    for text in lines:
        if "local_ranks=" in text:
            m = _LOCAL_RANKS.search(text)
            if m:
                return len(m.group(1).split(","))
        if "LOCAL_WORLD_SIZE" not in text and "nproc" not in text:
            continue
        m = _LOCAL_WORLD.search(text)
        if m:
            value = int(m.group(1) or m.group(2))
            if value >= 1:
                return value
    return None
