"""The automatic return to service's choices without a cluster: which drained nodes are judged,
the hourly cap, the mode a node is in, the history read back from the audit, and what stops a
pass (the whole path runs on real Slurm in tests/integration/test_auto_return_slurm.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from schemas.ids import current_cluster
from sinks.audit import AuditStore
from sinks.backends.base import NodeState, SchedulerBackend
from sinks.guardrails import GuardrailSettings
from streams.policy import DEFAULT_POLICY, AutoReturn, load_policy, parse_policy
from trainmedic.ops.auto_return import (
    AUTO_OPERATOR,
    AutoReturnService,
    History,
    drain_category,
    eligible,
    node_mode,
    room,
)
from trainmedic.ops.return_to_service import CheckResult, gpu_reset_status

NOW = 1_800_000_000.0
OURS = "trainmedic inc-0123456789abcdef0123: gpu_hardware"
AUTO = AutoReturn(enabled=True, after_s=600, retry_s=3600, max_per_hour=2, interval_s=1)


def _node(name: str, reason: str | None = OURS, drained_s: float | None = 3600, **kw: Any) -> NodeState:
    flags = kw.pop("flags", ("DRAIN",))
    return NodeState(
        name,
        kw.pop("state", "IDLE"),
        flags,
        reason,
        kw.pop("partitions", ("gpu",)),
        reason_time=None if drained_s is None else NOW - drained_s,
        **kw,
    )


def _never(state: NodeState) -> str | None:
    return None  # no GPU reset asked for any drain


def test_only_trainmedics_own_drains_old_enough_and_not_left_to_a_person_are_judged() -> None:
    nodes = [
        _node("gpu01"),
        _node("gpu02", reason="NHC: ECC errors"),  # someone else's drain
        _node("gpu03", reason=None, flags=()),  # in service
        _node("gpu04", reason=f"{OURS} | repair: lemon (2 isolating faults)"),
        _node("gpu05", reason=f"{OURS} | repair: CONTACT_SUPPORT"),
        _node("gpu06", flags=("DRAIN", "REBOOT_REQUESTED")),
        _node("gpu07", drained_s=None),  # Slurm gave no reason time
        _node("gpu08", drained_s=599),  # not after_s yet
        _node("gpu09", drained_s=600),
    ]
    todo, skipped = eligible(nodes, AUTO, NOW, {}, _never)
    assert [s.name for s in todo] == ["gpu01", "gpu09"]
    assert "gpu02" not in skipped and "gpu03" not in skipped
    assert skipped["gpu04"] == skipped["gpu05"] == "labelled for repair: left to a person"
    assert "reboot is not done yet (REBOOT_REQUESTED)" in skipped["gpu06"]
    assert "no time" in skipped["gpu07"]
    assert skipped["gpu08"] == "drained 599 s, judged after 600 s"


def test_longest_drained_first_and_not_again_before_retry_s() -> None:
    nodes = [_node("gpu01", drained_s=700), _node("gpu02", drained_s=9000), _node("gpu03", drained_s=5000)]
    todo, _ = eligible(nodes, AUTO, NOW, {}, _never)
    assert [s.name for s in todo] == ["gpu02", "gpu03", "gpu01"]
    todo, skipped = eligible(nodes, AUTO, NOW, {"gpu02": NOW - 3599, "gpu03": NOW - 3600}, _never)
    assert [s.name for s in todo] == ["gpu03", "gpu01"]
    assert skipped["gpu02"] == "judged 3599 s ago, again after 3600 s"


def test_our_down_node_back_from_a_reboot_is_judged_like_a_drained_one() -> None:
    todo, _ = eligible([_node("gpu01", state="DOWN", flags=())], AUTO, NOW, {}, _never)
    assert [s.name for s in todo] == ["gpu01"]


def test_a_pending_gpu_reset_waits_for_the_node_agent() -> None:
    reset = f"{OURS} | gpu reset (RESET_GPU)"
    asked: list[str] = []
    status = {"gpu01": "issued", "gpu02": "done", "gpu04": "failed", "gpu05": None, "gpu06": "issued"}

    def reset_status(state: NodeState) -> str | None:
        asked.append(state.name)
        return status[state.name]

    nodes = [
        _node("gpu01", reason=reset),
        _node("gpu02", reason=reset),
        _node("gpu03", reason=reset, drained_s=1),
        _node("gpu04", reason=reset),
        _node("gpu05", reason=reset),  # marked; the audit sink has not written the command yet
        _node("gpu06"),  # a command for its drain, though the mark did not make it into the reason
    ]
    todo, skipped = eligible(nodes, AUTO, NOW, {}, reset_status)
    assert [s.name for s in todo] == ["gpu02"]
    for node in ("gpu01", "gpu05", "gpu06"):
        assert skipped[node] == "its GPU reset is not done yet (node_commands)"
    assert skipped["gpu04"] == "its GPU reset ended failed: left to a person"
    assert sorted(asked) == ["gpu01", "gpu02", "gpu04", "gpu05", "gpu06"]  # gpu03 was too young to ask about


def test_the_cap_is_a_rolling_hour() -> None:
    assert room([], NOW, 2) == 2
    assert room([NOW - 10, NOW - 3599], NOW, 2) == 0
    assert room([NOW - 10, NOW - 3600], NOW, 2) == 1
    assert room([NOW - 1, NOW - 2, NOW - 3], NOW, 2) == 0


def test_category_of_our_drain_reason() -> None:
    assert drain_category(OURS) == "gpu_hardware"
    assert drain_category(f"{OURS} | reboot (RESTART_BM)") == "gpu_hardware"
    assert drain_category("trainmedic inc-1: not_a_category") is None
    assert drain_category("NHC: ECC errors") is None


def _policy(**modes: Any) -> Any:
    data = yaml.safe_load(DEFAULT_POLICY.read_text())
    data.update(modes)
    return parse_policy(yaml.safe_dump(data), "test")


def test_a_node_is_autonomous_only_where_every_partition_and_its_category_is() -> None:
    rails = GuardrailSettings()
    auto = _policy(mode="autonomous")
    assert node_mode(auto, rails, _node("gpu01")) == ("autonomous", "")
    assert node_mode(_policy(mode="monitor"), rails, _node("gpu01"))[0] == "monitor"
    # One partition of two in monitor: the node is not resumed.
    split = _policy(mode="autonomous", partitions={"debug": {"mode": "monitor"}})
    mode, why = node_mode(split, rails, _node("gpu01", partitions=("gpu", "debug")))
    assert mode == "monitor" and "partition debug" in why
    # The drain's category decides within a partition.
    by_category = _policy(mode="autonomous", categories={"gpu_hardware": "monitor"})
    assert node_mode(by_category, rails, _node("gpu01"))[0] == "monitor"
    assert node_mode(by_category, rails, _node("gpu01", reason="trainmedic inc-1: interconnect"))[0] == "autonomous"
    # The guardrails' autonomy partitions, and a reason without a category, fail closed.
    mode, why = node_mode(auto, GuardrailSettings(autonomy_partitions=["other"]), _node("gpu01"))
    assert mode == "monitor" and "autonomy_partitions" in why
    assert node_mode(auto, rails, _node("gpu01", reason="trainmedic inc-1: ???"))[0] == "monitor"


class _Rows:
    """The audit's answer to the history query (the store's query() only)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows, self.asked = rows, 0
        self.database = "t"

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.asked += 1
        assert parameters is not None and parameters["o"] == AUTO_OPERATOR
        return [r for r in self.rows if r["at_ms"] >= parameters["t"]]


def test_history_merges_the_audit_with_what_the_audit_has_not_written_yet() -> None:
    store = _Rows(
        [
            {"event_id": "ret-a", "node": "gpu01", "at_ms": int((NOW - 100) * 1000), "outcome": "resumed"},
            {"event_id": "ret-b", "node": "gpu02", "at_ms": int((NOW - 50) * 1000), "outcome": "refused"},
            {"event_id": "ret-c", "node": "gpu03", "at_ms": int((NOW - 7200) * 1000), "outcome": "resumed"},
        ]
    )
    history = History()
    history.note("ret-a", "gpu01", NOW - 100, "resumed")  # the same verdict, also in the audit
    history.note("ret-d", "gpu04", NOW - 5, "recommended")  # not in the audit yet
    history.read_audit(cast(AuditStore, store), NOW - 3600)
    assert history.last_judged() == {"gpu01": NOW - 100, "gpu02": NOW - 50, "gpu04": NOW - 5}
    assert sorted(history.returns()) == [NOW - 100, NOW - 5]  # a refusal returns nothing
    history.forget_before(NOW - 60)
    assert set(history.last_judged()) == {"gpu02", "gpu04"}


class _Backend:
    """A scheduler that must not be asked: the pass stops before listing nodes."""

    name = "none"

    def list_nodes(self) -> list[NodeState]:
        raise AssertionError("nodes listed")


def _service(tmp_path: Path, *, acting: bool = True, kill: bool = False, enabled: bool = True) -> AutoReturnService:
    data = yaml.safe_load(DEFAULT_POLICY.read_text())
    data["return_to_service"] = {"automatic": {"enabled": enabled, "after_s": 0}}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(data))
    load_policy(path)

    def runner(argv: list[str], timeout_s: float) -> CheckResult:
        raise AssertionError("a health check ran")

    return AutoReturnService(
        cast(SchedulerBackend, _Backend()),
        cast(AuditStore, _Rows([])),
        "127.0.0.1:1",
        path,
        acting=lambda: acting,
        guardrails=lambda: GuardrailSettings(kill_switch=kill),
        mode_override="autonomous",
        runner=runner,
    )


@pytest.mark.parametrize(
    ("kw", "said"),
    [
        ({"enabled": False}, "off"),
        ({"acting": False}, "standing by"),
        ({"kill": True}, "kill switch"),
    ],
)
def test_nothing_is_looked_at_when_off_standing_by_or_killed(tmp_path: Path, kw: dict[str, Any], said: str) -> None:
    svc = _service(tmp_path, **kw)
    assert svc.step() == []
    assert said in svc.status


def test_a_node_that_passed_is_held_when_the_brakes_came_on_during_its_check(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    node = _node("gpu01")
    assert svc._hold(node) is None
    svc.guardrails = lambda: GuardrailSettings(kill_switch=True)
    assert svc._hold(node) == "the guardrails' kill switch is on"
    svc.guardrails = GuardrailSettings
    svc.acting = lambda: False
    assert svc._hold(node) == "this replica no longer holds the executor's acting lease"
    svc.acting = lambda: True
    svc._mode_override = "monitor"
    hold = svc._hold(node)
    assert hold is not None and "monitor mode" in hold


class _Audit:
    """The audit as judge() reads it: the node's isolating faults, and its drain's incident."""

    database = "trainmedic"

    def __init__(self, faults: int) -> None:
        self.faults = faults

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        if "system.tables" in sql:  # no node_commands table: no GPU reset asked
            return []
        if "culprit_node" in sql:  # lemon_incidents: one fault a day, oldest first
            return [{"incident_id": f"inc-{i}", "began_ms": int((NOW + i * 86400) * 1000)} for i in range(self.faults)]
        return [{"category": "gpu_hardware", "isolate": True}]


class _Publisher:
    def __init__(self, undelivered: int = 0) -> None:
        self.events: list[Any] = []
        self.undelivered = undelivered

    def publish(self, topic: Any, event: Any) -> None:
        self.events.append(event)

    def flush(self, timeout: float = 10.0) -> int:
        return self.undelivered


def _return(faults: int, hold: str | None, undelivered: int = 0) -> tuple[Any, Any, Any]:
    from sinks.backends.simulated import SimulatedScheduler
    from streams.policy import ReturnToService
    from trainmedic.ops.return_to_service import ReturnRefused, return_node

    sched = SimulatedScheduler(["gpu01"])
    sched.drain_node("gpu01", OURS)
    publisher = _Publisher(undelivered)
    settings = ReturnToService(health_check=["true"], lemon_faults=2)
    try:
        outcome: Any = return_node(
            sched,
            cast(AuditStore, _Audit(faults)),
            cast(Any, publisher),
            lambda: settings,
            "gpu01",
            AUTO_OPERATOR,
            hold=lambda: hold,
            runner=lambda argv, timeout_s: CheckResult(" ".join(argv), True, ""),
        )
    except ReturnRefused as exc:
        outcome = exc
    return outcome, sched.node_state("gpu01"), publisher.events


def test_a_pass_is_resumed_or_only_recommended_when_held() -> None:
    done, state, events = _return(faults=0, hold=None)
    assert done.resumed and not state.drained
    assert [(e.outcome, e.check_passed) for e in events] == [("resumed", True)]
    done, state, events = _return(faults=0, hold="partition gpu is in monitor mode")
    assert not done.resumed and state.drained and state.reason == OURS
    assert [(e.outcome, e.check_passed) for e in events] == [("recommended", True)]
    assert events[0].detail.endswith("(not acted on: partition gpu is in monitor mode)")


def test_a_lemon_is_relabelled_only_when_the_path_may_act() -> None:
    refused, state, events = _return(faults=2, hold=None)
    assert refused.status == 409 and "is a lemon" in refused.detail
    assert state.drained and state.reason is not None and "| repair: lemon" in state.reason
    assert [e.outcome for e in events] == ["refused"]
    refused, state, events = _return(faults=2, hold="the guardrails' kill switch is on")
    assert refused.status == 409 and state.drained and state.reason == OURS  # not relabelled
    assert [e.outcome for e in events] == ["refused"] and "kill switch" in events[0].detail


def test_a_verdict_kafka_did_not_confirm_changes_nothing() -> None:
    refused, state, _ = _return(faults=0, hold=None, undelivered=1)
    assert refused.status == 503 and state.drained and state.reason == OURS


def test_a_gpu_reset_stands_as_the_latest_command_of_the_drains_incident(chdb_url: str, database: str) -> None:
    store = AuditStore(chdb_url, database)
    try:
        store.client.command(f"CREATE DATABASE IF NOT EXISTS {database}")
        assert gpu_reset_status(store, "gpu01", "inc-b") is None  # no node_commands table yet
        store.migrate()
        columns = ["event_id", "event_time", "command_id", "node", "kind", "incident_id", "status", "finished_at"]
        columns.append("cluster")

        def row(event: str, at: float, command: str, incident: str, status: str, finished: float | None) -> list[Any]:
            def ts(x: float) -> datetime:
                return datetime.fromtimestamp(x, tz=UTC)

            done_at = ts(finished) if finished else None
            return [event, ts(at), command, "gpu01", "gpu_reset", incident, status, done_at, current_cluster()]

        assert gpu_reset_status(store, "gpu01", "inc-a") is None  # no command at all
        store.insert("node_commands", [row("c1", NOW, "cmd-1", "inc-a", "issued", None)], columns)
        assert gpu_reset_status(store, "gpu01", "inc-a") == "issued"  # no result yet
        # The agent's clock is behind the executor's: its result still answers its command.
        store.insert("node_commands", [row("r1", NOW - 60, "cmd-1", "inc-a", "done", NOW - 60)], columns)
        assert gpu_reset_status(store, "gpu01", "inc-a") == "done"
        # The node drained again for incident b: a's done reset says nothing about b's drain.
        assert gpu_reset_status(store, "gpu01", "inc-b") is None
        store.insert("node_commands", [row("c2", NOW + 600, "cmd-2", "inc-b", "issued", None)], columns)
        assert gpu_reset_status(store, "gpu01", "inc-b") == "issued"
        store.insert("node_commands", [row("r2", NOW + 660, "cmd-2", "inc-b", "failed", NOW + 660)], columns)
        assert gpu_reset_status(store, "gpu01", "inc-b") == "failed"
        assert gpu_reset_status(store, "gpu02", "inc-b") is None  # another node
    finally:
        store.close()


class _AuditResetPending(_Audit):
    """A GPU reset asked for the drain's incident and not answered yet."""

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        if "system.tables" in sql:
            return [{"x": 1}]
        if "status = 'issued'" in sql:
            return [{"command_id": "cmd-1"}]
        if "status != 'issued'" in sql:
            return []  # no answer from the node agent yet
        return super().query(sql, parameters)


def test_no_resume_at_all_while_the_drains_gpu_reset_is_pending() -> None:
    """Manual or automatic: a job must never land on a GPU the node agent is about to reset."""
    from sinks.backends.simulated import SimulatedScheduler
    from streams.policy import ReturnToService
    from trainmedic.ops.return_to_service import ReturnRefused, return_node

    sched = SimulatedScheduler(["gpu01"])
    sched.drain_node("gpu01", OURS)
    publisher = _Publisher()
    with pytest.raises(ReturnRefused) as refused:
        return_node(
            sched,
            cast(AuditStore, _AuditResetPending(0)),
            cast(Any, publisher),
            lambda: ReturnToService(health_check=["true"]),
            "gpu01",
            "alice",
            runner=lambda argv, timeout_s: CheckResult(" ".join(argv), True, ""),
        )
    assert refused.value.status == 409 and "GPU reset" in refused.value.detail
    assert sched.node_state("gpu01").drained and publisher.events == []
