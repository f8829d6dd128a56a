"""Fleet incidents: nodes under one shared component failing together are one incident on it.

Per-job attribution sees one job's nodes. A leaf switch (Slurm's topology.conf) or a rack (the
policy's `fleet.domains`) serves many jobs; when several of its nodes fail interconnect checks
within a window (`fleet.min_nodes`, `fleet.window_s`, `fleet.categories`), the cause is the shared
component. This stage therefore lives apart from attribution, keyed by topology domain: the
streams worker forwards each node incident of a watched category to every domain of its culprit
node (topic incidents.by_domain, keyed by domain), and the worker owning a domain's partition
keeps its recent faults in a Faust table (`domain_faults`) and publishes one fleet incident per
window. Policy recommends the component for repair (streams/policy.py `_fleet_decision`); the
nodes' own incidents decided their drains, each under the guardrails.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from schemas.events import Evidence, Incident
from schemas.ids import stable_id
from slurmio.hostlist import expand_hostlist
from slurmio.topology import TopologyError, parse_topology_conf
from streams.policy import FleetPolicy

log = logging.getLogger("trainmedic.streams.fleet")


@dataclass
class Topology:
    """Node -> the domains it belongs to, and each domain's nodes."""

    nodes_of: dict[str, list[str]] = field(default_factory=dict)
    domains_of_node: dict[str, list[str]] = field(default_factory=dict)

    def add(self, domain: str, nodes: list[str]) -> None:
        self.nodes_of[domain] = nodes
        for node in nodes:
            self.domains_of_node.setdefault(node, []).append(domain)

    def domains_of(self, node: str | None) -> list[str]:
        return list(self.domains_of_node.get(node or "", ()))


def build_topology(fleet: FleetPolicy) -> Topology:
    """The topology the policy names: topology.conf's leaf switches ("switch:NAME"), then its own
    domains. TopologyError when the file cannot be read or parsed."""
    topo = Topology()
    if fleet.topology_file is not None:
        try:
            text = fleet.topology_file.read_text()
        except OSError as exc:
            raise TopologyError(f"{fleet.topology_file}: cannot read: {exc.strerror}") from None
        for switch, nodes in parse_topology_conf(text, str(fleet.topology_file)).items():
            topo.add(f"switch:{switch}", nodes)
    for name, hostlist in fleet.domains.items():
        topo.add(name, expand_hostlist(hostlist))
    return topo


class TopologyCache:
    """The topology of the policy in force, rebuilt when the policy's fleet section or the file changes.
    A topology that cannot be read leaves the previous one in force (logged)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._topology = Topology()

    def get(self, fleet: FleetPolicy) -> Topology:
        mtime = None
        if fleet.topology_file is not None:
            try:
                mtime = os.stat(fleet.topology_file).st_mtime
            except OSError:
                mtime = -1.0
        key = (fleet.model_dump_json(), mtime)
        if key != self._key:
            self._key = key
            try:
                self._topology = build_topology(fleet)
                log.info(
                    "topology: %d domains over %d nodes",
                    len(self._topology.nodes_of),
                    len(self._topology.domains_of_node),
                )
            except TopologyError as exc:
                log.error("topology refused, keeping the previous one: %s", exc)
        return self._topology


def watched(fleet: FleetPolicy, incident: Incident) -> bool:
    """A node's own incident of a watched category: what a domain counts."""
    return (
        incident.domain is None
        and incident.culprit_node is not None
        and incident.isolate
        and incident.category in fleet.categories
    )


class DomainCorrelator:
    """Per domain, the recent faults ([time, node, incident id]) and until when a fleet incident
    already covers it; kept in `store` (the worker's Faust table, keyed by domain)."""

    def __init__(self, store: MutableMapping[str, Any] | None = None) -> None:
        self._store: MutableMapping[str, Any] = store if store is not None else {}

    def observe(self, domain: str, incident: Incident, fleet: FleetPolicy, domain_nodes: list[str]) -> Incident | None:
        """Count the incident against its domain; the fleet incident when the domain crosses the line."""
        at = incident.first_signal_time
        value = dict(self._store.get(domain) or {"faults": [], "covered_until": 0.0, "evidence": {}})
        faults = [f for f in value["faults"] if f[2] != incident.incident_id]
        faults.append([at, incident.culprit_node, incident.incident_id])
        # Within one window of the newest fault, whichever arrived last (a late incident is older).
        newest = max(float(f[0]) for f in faults)
        faults = sorted((f for f in faults if newest - float(f[0]) <= fleet.window_s), key=lambda f: float(f[0]))
        if not any(f[2] == incident.incident_id for f in faults):
            self._store[domain] = {**value, "faults": faults}
            return None  # this one is older than the window of the faults seen since
        evidence = {k: v for k, v in value["evidence"].items() if any(f[2] == k for f in faults)}
        # One piece per failed node, from the node itself where there is one: policy reads the
        # failed nodes from it (they keep their own drains; a drain set takes the others).
        roots = [e for e in incident.evidence if e.role == "root"]
        root = next((e for e in roots if e.node == incident.culprit_node), roots[0] if roots else None)
        if root is not None:
            evidence[incident.incident_id] = root.model_dump(mode="json")
        value = {**value, "faults": faults, "evidence": evidence}
        nodes = sorted({str(f[1]) for f in faults})
        fleet_incident = None
        if len(nodes) >= fleet.min_nodes and at >= float(value["covered_until"]):
            fleet_incident = self._incident(domain, faults, evidence, incident, fleet, domain_nodes)
            value["covered_until"] = at + fleet.window_s
        self._store[domain] = value
        return fleet_incident

    @staticmethod
    def _incident(
        domain: str,
        faults: list[list[Any]],
        evidence: dict[str, Any],
        latest: Incident,
        fleet: FleetPolicy,
        domain_nodes: list[str],
    ) -> Incident:
        ids = [str(f[2]) for f in faults]
        nodes = sorted({str(f[1]) for f in faults})
        first = min(float(f[0]) for f in faults)
        incident_id = stable_id("inc", "fleet", domain, ids[0])
        return Incident(
            event_id=incident_id,
            incident_id=incident_id,
            event_time=max(latest.event_time, first),
            partition=latest.partition,
            domain=domain,
            domain_nodes=domain_nodes,
            domain_failed_nodes=nodes,
            category=latest.category,
            severity="critical",
            culprit_node=None,
            # Several nodes, one shared component: stronger than any one node's incident.
            confidence=min(1.0, 0.5 + 0.15 * len(nodes)),
            isolate=False,
            explanation=(
                f"{len(nodes)} nodes under {domain} ({', '.join(nodes)}) failed {latest.category} checks within "
                f"{fleet.window_s:g} s (incidents {', '.join(ids)}): the shared component, not each node"
            ),
            evidence=[Evidence.model_validate(e) for e in evidence.values()],
            anomaly_ids=[],
            first_signal_time=first,
        )
