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
"""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sinks.audit import AuditStore
from streams.policy import ReturnToService

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
