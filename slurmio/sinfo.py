"""Nodes from ``sinfo --json`` and from node documents (``scontrol show node --json``,
slurmrestd), for data parser versions v0.0.38 (22.05) to v0.0.42 (24.11).

22.05's sinfo lists one entry per node: ``state: "idle"`` plus
``state_flags: ["DRAIN"]``. 23.02+ group nodes that share a state and a
partition: ``sinfo: [{node: {state: ["IDLE", "DRAIN"]}, nodes: {nodes: [...]},
reason: {description, time, user}, partition: {name}}]``; a node in several
partitions is in several groups, merged here. Node documents (23.11+
``scontrol show node --json``) keep one entry per node with a state list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slurmio.fields import Fields
from slurmio.hostlist import HostlistError, expand_hostlist
from slurmio.records import NodeInfo
from slurmio.versions import DataParser, SlurmFormatError, detect, load_document, vocabulary

__all__ = ["NodesDocument", "parse_nodes", "parse_sinfo", "read_nodes", "read_sinfo", "split_node_state"]


@dataclass(frozen=True)
class NodesDocument:
    parser: DataParser
    nodes: dict[str, NodeInfo]


def read_sinfo(text: str | bytes, what: str = "sinfo --json") -> NodesDocument:
    return parse_sinfo(load_document(text, what), what)


def read_nodes(text: str | bytes, what: str = "scontrol show node --json") -> NodesDocument:
    return parse_nodes(load_document(text, what), what)


def parse_sinfo(doc: Mapping[str, Any], what: str = "sinfo --json") -> NodesDocument:
    """``sinfo --json`` of any supported version -> node name -> NodeInfo."""
    parser = detect(doc, what)
    if parser.sinfo == "nodes":
        return parse_nodes(doc, what, parser)
    raw = doc.get("sinfo")
    if not isinstance(raw, list):
        raise SlurmFormatError(f"{what} (data parser {parser.version}): no 'sinfo' list of node groups")
    nodes: dict[str, NodeInfo] = {}
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise SlurmFormatError(f"{what} (data parser {parser.version}): sinfo[{i}] is not an object")
        for node in _group_nodes(Fields(entry, parser, what, f"sinfo[{i}]")):
            seen = nodes.get(node.name)
            if seen is not None:
                node = _merge(seen, node)
            nodes[node.name] = node
    return NodesDocument(parser, nodes)


def parse_nodes(
    doc: Mapping[str, Any], what: str = "scontrol show node --json", parser: DataParser | None = None
) -> NodesDocument:
    """A document with a top-level ``nodes`` list (22.05 sinfo, 23.11+ scontrol / slurmrestd)."""
    parser = parser or detect(doc, what)
    raw = doc.get("nodes")
    if not isinstance(raw, list):
        raise SlurmFormatError(f"{what} (data parser {parser.version}): no 'nodes' list")
    nodes: dict[str, NodeInfo] = {}
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise SlurmFormatError(f"{what} (data parser {parser.version}): nodes[{i}] is not an object")
        node = _node(Fields(entry, parser, what, f"nodes[{i}]"))
        nodes[node.name] = node
    return NodesDocument(parser, nodes)


def split_node_state(f: Fields, name: str, words: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """Base state and flags of a node state; exactly one base state or SlurmFormatError."""
    base_states = vocabulary().node_base_states
    bases = [w for w in words if w in base_states]
    if len(bases) != 1:
        raise f.fail(name, f"exactly one base state of {sorted(base_states)}", list(words))
    return bases[0], tuple(sorted(set(words) - {bases[0]}))


def _node(f: Fields) -> NodeInfo:
    p = f.parser
    name = f.text("name")
    if not name:
        raise f.fail("name", "a node name", f.record.get("name"))
    words = f.state_words("state", p.node_state)
    if p.node_state == "string":
        # 22.05: the flags are their own list (some builds also put them after a '+').
        words = (*words, *(w.upper() for w in f.string_list("state_flags")))
    base, flags = split_node_state(f, "state", words)
    return NodeInfo(
        name=name,
        state=base,
        flags=flags,
        reason=f.text("reason"),
        reason_time=f.number("reason_changed_at", p.node_reason_time) or None,
        reason_user=f.text("reason_set_by_user"),
        partitions=f.string_list("partitions"),
    )


def _group_nodes(f: Fields) -> list[NodeInfo]:
    node = f.mapping("node")
    if node is None:
        raise f.fail("node", "an object with the group's state", None)
    base, flags = split_node_state(node, "state", node.state_words("state", f.parser.node_state))
    members = f.mapping("nodes")
    if members is None:
        raise f.fail("nodes", "an object listing the group's nodes", None)
    names: list[str] = []
    for text in members.string_list("nodes"):
        try:
            names.extend(expand_hostlist(text))
        except HostlistError as exc:
            raise members.fail("nodes", f"node names ({exc})", text) from None
    reason = f.mapping("reason")
    partition = f.mapping("partition")
    part_name = partition.text("name") if partition is not None else None
    return [
        NodeInfo(
            name=n,
            state=base,
            flags=flags,
            reason=reason.text("description") if reason is not None else None,
            # a plain integer in every grouped version, unlike a node document's reason_changed_at
            reason_time=(reason.integer("time") or None) if reason is not None else None,
            reason_user=reason.text("user") if reason is not None else None,
            partitions=(part_name,) if part_name else (),
        )
        for n in names
    ]


def _merge(a: NodeInfo, b: NodeInfo) -> NodeInfo:
    return NodeInfo(
        name=a.name,
        state=a.state,
        flags=a.flags,
        reason=a.reason or b.reason,
        reason_time=a.reason_time or b.reason_time,
        reason_user=a.reason_user or b.reason_user,
        partitions=tuple(dict.fromkeys((*a.partitions, *b.partitions))),
    )
