"""Whether a node trainmedic drained may return to service, and the health check that decides.

`trainmedic nodes resume NODE` (the operator API's resume) asks here before it resumes anything:

1. **A lemon stays out.** `return_to_service.lemon_faults` isolating faults blamed on the node
   (its incidents, those whose faults began within `EPISODE_GAP_S` of each other counted once)
   within `lemon_window_days` (the audit's incidents: the culprit is the node and the fault is the
   node's own) keep it drained, relabelled for repair - a node that keeps failing goes to the
   vendor, not back to the next job.
2. **A node drained for a fault of its own needs a passing health check.** The drain's incident
   (named in the reason) says whether the fault was the node's (`isolate`); an incident the audit
   does not have counts as the node's (fail closed). The check is the policy's
   `return_to_service.health_check`, an argv run from this host with "{node}" replaced by the node
   (over SSH: a DCGM diagnostic, NHC; not srun, which a drained node refuses). Exit 0 passes;
   anything else, a timeout or a command that cannot start fails, and the output's tail says why.
   With no check configured such a node is not resumed.

Every verdict, refused or not, is published as a NodeReturn (the audit's node_returns).

`return_node` is the one way a node goes back: the operator API's resume and the automatic path
(trainmedic/ops/auto_return.py) both call it, so both judge, record and act alike.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from bus.publish import Publisher
from schemas.errors import Refused
from schemas.events import NodeReturn, incident_in_reason
from schemas.ids import current_cluster, stable_id
from schemas.topics import NODE_RETURNS
from sinks.audit import AuditStore
from sinks.backends.base import BackendError, NodeState, SchedulerBackend
from streams.policy import ReturnToService

log = logging.getLogger("trainmedic.ops.return_to_service")

OUTPUT_TAIL = 2000
#: What a lemon's drain reason gets, after trainmedic's own "trainmedic inc-...: category".
REPAIR_LABEL = "repair: lemon"


@dataclass(frozen=True)
class CheckResult:
    command: str
    passed: bool
    output: str


@dataclass
class Verdict:
    allowed: bool
    reason: str
    check: CheckResult | None = None
    lemon_incidents: list[str] = field(default_factory=list)


Runner = Callable[[list[str], float], CheckResult]


def run_check(argv: list[str], timeout_s: float) -> CheckResult:
    """Run the check; never raises: what went wrong is the failed result's output."""
    command = shlex.join(argv)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or "") if isinstance(exc.stdout, str) else ""
        return CheckResult(command, False, f"timed out after {timeout_s:g} s\n{out[-OUTPUT_TAIL:]}")
    except OSError as exc:
        return CheckResult(command, False, f"could not start: {exc.strerror or exc}")
    output = (proc.stdout + proc.stderr)[-OUTPUT_TAIL:]
    if proc.returncode != 0:
        return CheckResult(command, False, f"exit status {proc.returncode}\n{output}")
    return CheckResult(command, True, output)


# Incidents of one node whose faults began within this long of each other are one fault: the same
# Xid copied to each job on the node, a drained node repeating it, a cascade seen twice.
EPISODE_GAP_S = 1800.0


def lemon_incidents(store: AuditStore, node: str, since: float) -> list[str]:
    """One incident per fault of `node` since `since` (isolating incidents blamed on it, those of
    one episode counted once), oldest first."""
    rows = store.query(
        "SELECT incident_id, toUnixTimestamp64Milli(first_signal_time) AS began_ms FROM {db}.incidents FINAL "
        "WHERE culprit_node = {n:String} AND event_time >= fromUnixTimestamp64Milli({t:Int64}) "
        "AND ifNull(isolate, false) ORDER BY first_signal_time",
        {"n": node, "t": int(since * 1000)},
    )
    faults: list[str] = []
    last = None
    for r in rows:
        began = int(r["began_ms"]) / 1000
        if last is None or began - last > EPISODE_GAP_S:
            faults.append(str(r["incident_id"]))
        last = began
    return faults


def _drained_for_own_fault(store: AuditStore, incident_id: str) -> tuple[bool, str]:
    rows: list[dict[str, Any]] = store.query(
        "SELECT category, isolate FROM {db}.incidents FINAL WHERE incident_id = {i:String}", {"i": incident_id}
    )
    if not rows:
        return True, f"{incident_id} is not in the audit: counted as a fault of the node"
    row = rows[0]
    if row["isolate"] is False:
        return False, f"{incident_id} ({row['category']}) was no fault of the node"
    return True, f"{incident_id} ({row['category']}) was a fault of the node"


def judge(
    settings: ReturnToService,
    store: AuditStore,
    node: str,
    incident_id: str,
    now: float | None = None,
    runner: Runner = run_check,
) -> Verdict:
    now = time.time() if now is None else now
    window_s = settings.lemon_window_days * 86400
    lemons = lemon_incidents(store, node, now - window_s)
    if len(lemons) >= settings.lemon_faults:
        return Verdict(
            False,
            f"{node} is a lemon: {len(lemons)} isolating faults in {settings.lemon_window_days:g} days "
            f"({', '.join(lemons)}), limit {settings.lemon_faults} (return_to_service.lemon_faults): it stays "
            "drained, labelled for repair",
            lemon_incidents=lemons,
        )
    own, why = _drained_for_own_fault(store, incident_id)
    if settings.health_check is None:
        if own:
            return Verdict(
                False,
                f"{why}: a node drained for a fault of its own is resumed only after a passing health check, and "
                "none is configured (policy return_to_service.health_check)",
            )
        return Verdict(True, f"{why}; no health check configured")
    argv = [item.replace("{node}", node) for item in settings.health_check]
    result = runner(argv, settings.timeout_s)
    if not result.passed:
        return Verdict(False, f"health check failed on {node}: {result.command}: {result.output.strip()}", result)
    return Verdict(True, f"health check passed on {node}: {result.command}", result)


def repair_reason(reason: str, verdict: Verdict) -> str:
    """The drain reason with the repair label (kept once): trainmedic's incident prefix stays first."""
    if REPAIR_LABEL in reason:
        return reason
    return f"{reason} | {REPAIR_LABEL} ({len(verdict.lemon_incidents)} isolating faults)"


#: Slurm's flags of a reboot asked for and not yet done (the remediation's `scontrol reboot`).
REBOOT_PENDING = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED"})


class ReturnRefused(Refused, RuntimeError):
    """The node was not resumed. `status` is what the operator API answers (404 no such node, 409
    not resumable or judged unfit, 503 the verdict not recorded, 502 the scheduler refused);
    `event` is the published NodeReturn, when one was."""

    def __init__(self, status: int, detail: str, event: NodeReturn | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.event = status, detail, event


#: The executor's mark in a drain reason: a GPU reset asked of the node agent (sinks/executor.py).
GPU_RESET_MARK = "| gpu reset ("


def gpu_reset_status(store: AuditStore, node: str, incident_id: str) -> str | None:
    """Where the GPU reset asked for `incident_id`'s drain of `node` stands: None when none was
    asked (or the audit has no node_commands table), "issued" while the node agent has not
    answered, else the agent's status (done, failed, refused).

    Scoped by the drain's incident: a reset done for an earlier drain says nothing about this one.
    The latest command is the latest `issued` row by the executor's clock; its result is matched
    by command id, not by time (the agent's clock on the node may differ)."""
    exists = store.query(
        "SELECT 1 AS x FROM system.tables WHERE database = {d:String} AND name = 'node_commands'",
        {"d": store.database},
    )
    if not exists:
        return None
    where = "node = {n:String} AND kind = 'gpu_reset' AND cluster = {c:String}"
    params = {"n": node, "i": incident_id, "c": current_cluster()}
    asked = store.query(
        f"SELECT command_id FROM {{db}}.node_commands FINAL WHERE {where} AND incident_id = {{i:String}} "
        "AND status = 'issued' ORDER BY event_time DESC LIMIT 1",
        params,
    )
    if not asked:
        return None
    answered = store.query(
        f"SELECT status FROM {{db}}.node_commands FINAL WHERE {where} AND command_id = {{m:String}} "
        "AND status != 'issued' ORDER BY event_time DESC LIMIT 1",
        {**params, "m": str(asked[0]["command_id"])},
    )
    return str(answered[0]["status"]) if answered else "issued"


def gpu_reset_pending(store: AuditStore, state: NodeState, incident_id: str) -> str | None:
    """Why the node must not return yet because of its GPU reset; None when no reset is in the way.
    Pending: asked and not answered, or marked in the reason while the audit has no command yet
    (the audit sink writes in batches) - a job must never land on a GPU being reset."""
    status = gpu_reset_status(store, state.name, incident_id)
    marked = GPU_RESET_MARK in (state.reason or "")
    if status == "issued" or (status is None and marked):
        return f"{state.name}: its GPU reset for {incident_id} is not done yet (node_commands)"
    return None


def not_resumable(state: NodeState) -> str | None:
    """Why trainmedic may not resume this node now; None when it may (its own drain, no reboot pending)."""
    ours_down = state.state == "DOWN" and incident_in_reason(state.reason) is not None
    if not state.drained and not ours_down:  # DOWN: back from our reboot on a Slurm without nextstate=DRAIN
        return f"{state.name} is not drained"
    if pending := REBOOT_PENDING & set(state.flags):
        return f"{state.name}: its reboot is not done yet ({', '.join(sorted(pending))})"
    if incident_in_reason(state.reason) is None:
        # Someone else drained it for their own reason: not ours to undo.
        return f"{state.name} was drained by someone else ({state.reason!r})"
    return None


def resumable(backend: SchedulerBackend, node: str) -> tuple[NodeState, str]:
    """The node's state and the incident its drain names, when trainmedic may resume it."""
    try:
        state = backend.node_state(node)
    except (BackendError, ValueError) as exc:
        raise ReturnRefused(404, str(exc)) from None
    if (why := not_resumable(state)) is not None:
        raise ReturnRefused(409, why)
    incident_id = incident_in_reason(state.reason)
    assert incident_id is not None  # not_resumable refused anyone else's reason
    return state, incident_id


Outcome = Literal["resumed", "refused", "recommended"]


@dataclass(frozen=True)
class Returned:
    node: str
    incident_id: str
    verdict: Verdict
    event: NodeReturn

    @property
    def resumed(self) -> bool:
        return self.event.outcome == "resumed"


# One return per node at a time in this process, whoever asks (the API and the automatic path
# share them in `trainmedic up`): two health checks of one node would only race to one resume.
_locks_guard = threading.Lock()
_node_locks: dict[str, threading.Lock] = {}


def _node_lock(node: str) -> threading.Lock:
    with _locks_guard:
        return _node_locks.setdefault(node, threading.Lock())


def return_node(
    backend: SchedulerBackend,
    store: AuditStore,
    publisher: Publisher,
    settings: Callable[[], ReturnToService],
    node: str,
    operator: str,
    comment: str = "",
    *,
    hold: Callable[[], str | None] | None = None,
    runner: Runner = run_check,
) -> Returned:
    """Judge `node` and, on a pass, resume it; raises ReturnRefused when it is not resumed.

    `settings` is read once the node is known to be resumable (the policy file as it is then).
    The verdict is published (and flushed) before anything is done on the scheduler: a resume
    that cannot be recorded is not made. `hold`, asked once the node has passed (and again before
    a lemon is relabelled), says why the caller may not act now (monitor mode, the kill switch,
    the acting lease lost during a check that took minutes): the verdict is then recorded as
    "recommended" - what autonomy would have done - and nothing changes on the cluster.
    """
    lock = _node_lock(node)
    if not lock.acquire(blocking=False):
        raise ReturnRefused(409, f"{node}: a resume is already running")
    try:
        state, incident_id = resumable(backend, node)
        if (pending := gpu_reset_pending(store, state, incident_id)) is not None:
            raise ReturnRefused(409, pending)
        verdict = judge(settings(), store, node, incident_id, runner=runner)
        if verdict.allowed:
            # The check took time: resume only what was judged (same drain, same reason).
            now_state, _ = resumable(backend, node)
            if (now_state.reason, now_state.drained) != (state.reason, state.drained):
                verdict = Verdict(
                    False,
                    f"{node} changed during the health check (reason now {now_state.reason!r}): not resumed; ask again",
                    verdict.check,
                )
        held = hold() if hold is not None and (verdict.allowed or verdict.lemon_incidents) else None
        outcome: Outcome = "refused" if not verdict.allowed else "recommended" if held else "resumed"
        detail = verdict.reason if held is None else f"{verdict.reason} (not acted on: {held})"
        event = NodeReturn(
            event_id=stable_id("ret", node, state.reason, time.time()),
            event_time=time.time(),
            node=node,
            incident_id=incident_id,
            drain_reason=state.reason or "",
            operator=operator,
            comment=comment,
            outcome=outcome,
            check=verdict.check.command if verdict.check else None,
            check_passed=verdict.check.passed if verdict.check else None,
            detail=detail[:8192],
        )
        publisher.publish(NODE_RETURNS, event)
        if publisher.flush(10):
            raise ReturnRefused(503, "Kafka did not confirm; nothing changed")
        if not verdict.allowed:
            if verdict.lemon_incidents and state.reason and held is None:
                try:  # labelled for repair in Slurm itself, where the next operator looks
                    backend.relabel_node(node, repair_reason(state.reason, verdict))
                except BackendError as exc:
                    log.error("could not label %s for repair: %s", node, exc)
            log.warning("resume of %s refused: %s", node, verdict.reason)
            raise ReturnRefused(409, f"{node} stays drained: {verdict.reason}", event)
        if held is not None:
            log.info("%s may return to service (%s), not resumed: %s", node, verdict.reason, held)
            return Returned(node, incident_id, verdict, event)
        try:
            backend.resume_node(node)
        except BackendError as exc:
            raise ReturnRefused(502, f"scheduler refused: {exc}", event) from None
    finally:
        lock.release()
    log.info("resumed %s (drained for %s) by %s: %s", node, incident_id, operator, verdict.reason)
    return Returned(node, incident_id, verdict, event)
