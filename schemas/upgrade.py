"""Upgrading an event of the previous schema version to the current one.

A rolling upgrade runs old and new releases side by side: consumers are upgraded
first, so for a while they read records that old producers wrote (and the topics
keep such records for their retention). Every consumer therefore accepts the
current version and the one before it (docs/schemas.md). A previous-version
payload is upgraded here, as a JSON dict, and then validated as the current type:
the models describe one version only.

Each step takes one version to the next for one event type; `UPGRADERS` is keyed by
(type name, from version). Every type has a step from each accepted older version,
even when nothing but the version number changes, so a type added to
schemas.events without one fails `upgrade` loudly instead of decoding by accident -
unless `INTRODUCED` says it did not exist in that version (no payload of it can be older).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas.errors import UsageError
from schemas.events import EVENT_TYPES, SCHEMA_VERSION, Incident
from schemas.ids import DEFAULT_CLUSTER

JsonObject = dict[str, Any]
Upgrader = Callable[[JsonObject], JsonObject]

PREVIOUS_VERSION = SCHEMA_VERSION - 1
ACCEPTED_VERSIONS: tuple[int, ...] = (PREVIOUS_VERSION, SCHEMA_VERSION)


class UpgradeError(UsageError, ValueError):
    """A previous-version payload that is not valid in its own version; `field` names where."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"field '{field}': {problem}")


def _v1_to_v2(data: JsonObject) -> JsonObject:
    # Version 1 had no cluster field: its producers served one cluster, and derived their
    # ids as the default cluster's are derived (schemas.ids.stable_id). The model's default
    # is the reading process's cluster, which need not be that one, so it is set here.
    if "cluster" in data:
        raise UpgradeError("cluster", "Extra inputs are not permitted in version 1")
    return {**data, "schema_version": 2, "cluster": DEFAULT_CLUSTER}


#: The action kinds of version 1, frozen: `drain` came after it.
V1_ACTIONS: tuple[str, ...] = ("drain_and_requeue", "requeue", "stop", "none")


def _incident_v1_to_v2(data: JsonObject) -> JsonObject:
    out = _v1_to_v2(data)
    # Version 2 leaves the action to policy (streams.policy.choose_action), which reads the fact
    # attribution states instead: whether the fault lives on the culprit's node (`isolate`). A
    # version 1 incident said so by recommending a drain.
    if "recommended_action" not in out:
        raise UpgradeError("recommended_action", "Field required in version 1")
    action = out.pop("recommended_action")
    if action not in V1_ACTIONS:
        raise UpgradeError("recommended_action", f"Input should be one of {', '.join(map(repr, V1_ACTIONS))}")
    out["isolate"] = action == "drain_and_requeue"
    return out


#: Types that did not exist before a version: no payload of theirs is older, so no upgrade.
INTRODUCED: dict[str, int] = {
    "job_attempt": 2,
    "node_command": 2,
    "node_command_result": 2,
    "gpu_sample_batch": 2,
    "net_port_sample": 2,
    "migration": 2,
}


def existed(type_name: str, version: int) -> bool:
    return INTRODUCED.get(type_name, 1) <= version


UPGRADERS: dict[tuple[str, int], Upgrader] = {
    **{(t.type_name, 1): _v1_to_v2 for t in EVENT_TYPES if existed(t.type_name, 1)},
    (Incident.type_name, 1): _incident_v1_to_v2,
}


def upgrade(type_name: str, data: JsonObject) -> JsonObject:
    """`data` (a JSON object of `type_name` at an accepted version) as the current version."""
    for version in range(data["schema_version"], SCHEMA_VERSION):
        step = UPGRADERS.get((type_name, version))
        if step is None:
            since = f" ({type_name} exists since version {INTRODUCED[type_name]})" if type_name in INTRODUCED else ""
            raise UpgradeError("schema_version", f"no upgrade of a version {version} {type_name}{since}")
        data = step(data)
    return data
