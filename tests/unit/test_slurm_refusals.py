"""Pure logic of coexistence: reservations, stale reasons, what the backends refuse, maintenance reasons.

The reservation lines are verbatim ``scontrol show reservation -o`` output of
the two clusters of infra/slurm (22.05.8 and 24.11.5), captured here.
"""

from __future__ import annotations

import pytest

from schemas.events import incident_in_reason
from sinks.backends.base import ActionRefused, NodeState, refuse_node_action
from slurmio.nodes import in_force
from slurmio.records import NodeInfo
from slurmio.reservations import maintenance_nodes, parse_reservations
from slurmio.versions import SlurmFormatError
from trainmedic.ops.readiness import DEFAULT_MAINTENANCE_REASONS, glob_regex

RESV_2205 = (
    "ReservationName=tm_probe StartTime=2026-12-01T20:50:48 EndTime=2026-12-01T20:55:48 Duration=00:05:00 "
    "Nodes=gpu04 NodeCnt=1 CoreCnt=8 Features=(null) PartitionName=(null) Flags=MAINT,SPEC_NODES TRES=cpu=8 "
    "Users=root Groups=(null) Accounts=(null) Licenses=(null) State=ACTIVE BurstBuffer=(null) Watts=n/a "
    "MaxStartDelay=(null)"
)
RESV_2411 = (
    "ReservationName=tm_probe2 StartTime=2026-12-01T21:02:05 EndTime=2026-12-01T21:07:05 Duration=00:05:00 "
    "Nodes=gpu04 NodeCnt=1 CoreCnt=8 Features=(null) PartitionName=(null) Flags=MAINT,SPEC_NODES TRES=cpu=8 "
    "Users=root Groups=(null) Accounts=(null) Licenses=(null) State=ACTIVE BurstBuffer=(null) MaxStartDelay=(null)"
)


@pytest.mark.parametrize("line", [RESV_2205, RESV_2411])
def test_an_active_maint_reservation_holds_its_nodes(line: str) -> None:
    (r,) = parse_reservations(line + "\n")
    assert (r.nodes, r.active, r.maintenance) == (("gpu04",), True, True)
    assert maintenance_nodes([r]) == {"gpu04": r.name}


def test_no_reservations_inactive_and_plain_ones_hold_nothing() -> None:
    assert parse_reservations("No reservations in the system\n") == []
    inactive = RESV_2411.replace("State=ACTIVE", "State=INACTIVE").replace("gpu04", "gpu[01-03]")
    plain = RESV_2205.replace("Flags=MAINT,SPEC_NODES", "Flags=SPEC_NODES")
    resv = parse_reservations(f"{inactive}\n{plain}\n")
    assert resv[0].nodes == ("gpu01", "gpu02", "gpu03")
    assert maintenance_nodes(resv) == {}


def test_an_unknown_reservation_state_is_refused_by_name() -> None:
    with pytest.raises(SlurmFormatError, match="field State of tm_probe"):
        parse_reservations(RESV_2205.replace("State=ACTIVE", "State=SOMEDAY"))


def test_a_reason_left_on_a_resumed_node_is_dropped() -> None:
    # 24.11 keeps the last reason after `scontrol update state=resume`.
    idle = NodeInfo("gpu03", "IDLE", (), "NHC: ECC errors", 1796159306, "root")
    assert in_force(idle).reason is None and in_force(idle).reason_user is None
    drained = NodeInfo("gpu03", "IDLE", ("DRAIN",), "NHC: ECC errors", 1796159306, "root")
    assert in_force(drained) == drained
    down = NodeInfo("gpu01", "DOWN", (), "admin: bad PSU")
    assert in_force(down) == down


@pytest.mark.parametrize(
    ("state", "resv", "refusal"),
    [
        (NodeState("gpu02", "IDLE"), "maint-1", "in maintenance reservation maint-1"),
        (NodeState("gpu03", "IDLE", ("DRAIN",), "NHC: ECC errors", reason_user="root"), None, "already drained"),
        (NodeState("gpu03", "IDLE", ("DRAIN",), "trainmedic inc-1: gpu_hardware"), None, "already drained"),
        (NodeState("gpu01", "DOWN", (), "admin: bad PSU"), None, "it is DOWN"),
        (NodeState("gpu01", "IDLE", ("NOT_RESPONDING",)), None, r"IDLE\+NOT_RESPONDING"),
    ],
)
def test_never_acted_on(state: NodeState, resv: str | None, refusal: str) -> None:
    with pytest.raises(ActionRefused, match=refusal):
        refuse_node_action("drain", state, resv)


def test_a_node_in_service_may_be_drained() -> None:
    refuse_node_action("drain", NodeState("gpu02", "MIXED", ("COMPLETING",)), None)
    refuse_node_action("drain", NodeState("gpu02", "ALLOCATED"), None)


# States read from the real clusters with a node's slurmd stopped (SIGSTOP): 22.05 and 24.11 both
# show ALLOCATED+NOT_RESPONDING after ~15 s, then DOWN+NOT_RESPONDING, reason "Not responding".
@pytest.mark.parametrize(
    "state",
    [
        NodeState("gpu03", "ALLOCATED", ("NOT_RESPONDING",)),
        NodeState("gpu03", "IDLE", ("NOT_RESPONDING",)),
        NodeState("gpu03", "DOWN", ("NOT_RESPONDING",), reason="Not responding", reason_user="root"),
        NodeState("gpu03", "DOWN", (), reason="Not responding", reason_user="slurm"),
    ],
)
def test_a_node_slurm_failed_itself_is_drained_when_the_incident_rests_on_that_report(state: NodeState) -> None:
    with pytest.raises(ActionRefused, match="out of service is left alone"):
        refuse_node_action("drain", state, None)
    refuse_node_action("drain", state, None, node_failed=True)


@pytest.mark.parametrize(
    ("state", "resv"),
    [
        (NodeState("gpu03", "DOWN", (), reason="PSU swap", reason_user="admin"), None),  # an operator's DOWN
        (NodeState("gpu03", "DOWN", ("NOT_RESPONDING", "DRAIN"), reason="NHC: bad fan"), None),  # drained
        (NodeState("gpu03", "DOWN", ("NOT_RESPONDING", "REBOOT_ISSUED")), None),  # rebooting
        (NodeState("gpu03", "DOWN", ("NOT_RESPONDING", "POWERED_DOWN")), None),  # powered down by Slurm
        (NodeState("gpu03", "ALLOCATED", ("NOT_RESPONDING", "MAINTENANCE")), None),
        (NodeState("gpu03", "IDLE", ("NOT_RESPONDING",)), "maint_gpu03"),  # planned maintenance
        (NodeState("gpu03", "ERROR", ("NOT_RESPONDING",)), None),
    ],
)
def test_a_node_someone_else_owns_stays_alone_even_when_slurm_reported_it_failed(
    state: NodeState, resv: str | None
) -> None:
    with pytest.raises(ActionRefused):
        refuse_node_action("drain", state, resv, node_failed=True)


def test_whose_drain_it_is() -> None:
    assert incident_in_reason("trainmedic inc-0123456789abcdef0123: gpu_hardware") == "inc-0123456789abcdef0123"
    assert incident_in_reason("NHC: ECC errors") is None
    assert incident_in_reason("admin said trainmedic inc-1") is None
    assert incident_in_reason(None) is None


def test_maintenance_globs_become_anchored_regexes() -> None:
    import re

    regexes = [re.compile(glob_regex(p)) for p in DEFAULT_MAINTENANCE_REASONS]
    for reason in ("reboot for the new driver", "Maintenance window", "upgrade: BIOS", "maint"):
        assert any(r.match(reason.lower()) for r in regexes), reason
    for reason in ("NHC: ECC errors", "admin: reboot loop", "xid 79"):
        assert not any(r.match(reason.lower()) for r in regexes), reason
    assert glob_regex("a.b?c*") == r"^a\.b.c.*$"
