"""Slurm's topology.conf (topology/tree): which nodes hang under which leaf switch.

    SwitchName=leaf1 Nodes=gpu[01-16]
    SwitchName=leaf2 Nodes=gpu[17-32] LinkSpeed=...
    SwitchName=spine Switches=leaf[1-2]

A leaf switch (one with `Nodes=`) is the domain whose nodes share a fault: several of them failing
interconnect checks at once points at the switch, not at each node. Spine switches (`Switches=`)
are read for their names only: a spine fault shows as several leaves. Comments (#) and blank
lines are skipped; an unreadable line is a TopologyError naming the file and the line.

`scontrol show topology` prints the same lines with `Level=`, and every upper switch with the
`Nodes=` under it: a switch above level 0 is skipped, so its output (saved where the streams
workers can read it, when topology.conf itself is not) reads the same.
"""

from __future__ import annotations

import re

from schemas.errors import ConfigError
from slurmio.hostlist import HostlistError, expand_hostlist

__all__ = ["TopologyError", "parse_topology_conf"]

_PAIR = re.compile(r"(\w+)=(\S+)")


class TopologyError(ConfigError, ValueError):
    pass


def parse_topology_conf(text: str, origin: str = "topology.conf") -> dict[str, list[str]]:
    """Leaf switch name -> its nodes, in file order."""
    leaves: dict[str, list[str]] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        pairs = {k.lower(): v for k, v in _PAIR.findall(line)}
        name = pairs.get("switchname")
        if not name:
            raise TopologyError(f"{origin}: line {lineno}: expected SwitchName=NAME ... (got {raw.strip()!r})")
        if pairs.get("level", "0") != "0":
            continue  # scontrol's upper switches, with every node below them
        if "nodes" not in pairs:
            if "switches" not in pairs:
                raise TopologyError(f"{origin}: line {lineno}: switch {name} has neither Nodes= nor Switches=")
            continue
        try:
            nodes = expand_hostlist(pairs["nodes"])
        except HostlistError as exc:
            raise TopologyError(f"{origin}: line {lineno}: Nodes={pairs['nodes']}: {exc}") from None
        if name in leaves:
            raise TopologyError(f"{origin}: line {lineno}: switch {name} is defined twice")
        leaves[name] = nodes
    return leaves
