"""Every node with its OWN reason: the one way to list a cluster's nodes.

23.02+ ``sinfo --json`` groups nodes that share a state and a partition and
gives each group ONE reason (and one reason user and time): two nodes drained
for different reasons by different people come out with the same reason.
Measured on the 24.11 cluster here: gpu01 drained "reboot x" and gpu03 drained
"NHC: ECC errors" were one group reading "reboot x". So:

- 22.05 (sinfo layout ``nodes``): ``sinfo --json``, one entry per node;
- 23.11+ (``scontrol_json``): ``scontrol show node --json``, one entry per node;
- 23.02 (groups, no scontrol --json): ``scontrol show node -o``, one line per
  node (its reason time is local-time text there, so none is given).

A reason counts only while the node is down, draining/drained, failing or
rebooting (what ``sinfo -R`` lists): 24.11 keeps the last reason on a node
after ``scontrol update state=resume`` (an IDLE node reads "NHC: ECC errors"
from a drain long over). `in_force` drops such a stale reason.
"""

from __future__ import annotations

import dataclasses

from slurmio.records import NodeInfo
from slurmio.runners import Runner
from slurmio.scontrol import node_from_text
from slurmio.sinfo import read_nodes, read_sinfo
from slurmio.versions import DataParser

__all__ = ["in_force", "read_all_nodes"]

_REASON_STATES = frozenset({"DOWN", "ERROR", "FUTURE", "UNKNOWN"})
_REASON_FLAGS = frozenset(
    {"DRAIN", "FAIL", "NOT_RESPONDING", "REBOOT_REQUESTED", "REBOOT_ISSUED", "POWER_DOWN", "POWERED_DOWN"}
)


def in_force(node: NodeInfo) -> NodeInfo:
    """The node without a reason left over from a state it is no longer in."""
    if node.reason is None or node.state in _REASON_STATES or _REASON_FLAGS.intersection(node.flags):
        return node
    return dataclasses.replace(node, reason=None, reason_time=None, reason_user=None)


def read_all_nodes(runner: Runner, timeout: float, parser: DataParser | None) -> tuple[DataParser, dict[str, NodeInfo]]:
    """The cluster's nodes, each with its own reason, and the data parser that said so.

    ``parser`` is the cluster's data parser when known (e.g. from its last
    ``squeue --json``); None reads ``sinfo --json`` first to learn it.
    """
    if parser is None or parser.sinfo == "nodes":
        doc = read_sinfo(runner(["sinfo", "--json"], timeout))
        if doc.parser.sinfo == "nodes":
            return doc.parser, {k: in_force(n) for k, n in doc.nodes.items()}
        parser = doc.parser
    if parser.scontrol_json:
        listed = read_nodes(runner(["scontrol", "show", "node", "--json"], timeout)).nodes
        return parser, {k: in_force(n) for k, n in listed.items()}
    nodes: dict[str, NodeInfo] = {}
    for line in runner(["scontrol", "show", "node", "-o"], timeout).splitlines():
        if line.startswith("NodeName="):
            node = in_force(node_from_text(line))
            nodes[node.name] = node
    return parser, nodes
