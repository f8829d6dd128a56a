"""Each process serves on /metrics only the metric families of its own roles, and the counters
the alerts read are there at 0 for their known label sets before anything happened.

Each role runs in a process of its own (`python -c`, its probe listener on port 0), as
`trainmedic run ...` / `produce ...` start it, and is scraped over HTTP: in this test process
every role's families are imported and counted by other tests, which a fresh one is not.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import get_args

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from producers.metrics import POLL_FAILURE_REASONS
from schemas.vocab import Guardrail
from sinks.metrics import ACTED, TRIPPED
from streams.metrics import DEAD_LETTER_COMPONENTS
from tests.conftest import REPO
from trainmedic.stack.metrics_server import PUBLISHERS, ROLES, MetricsError, role_families

T = "trainmedic_"
COMMON = {f"{T}build", f"{T}loop_last_beat_timestamp_seconds", f"{T}consumer_last_processed_timestamp_seconds"}
COMMON |= {f"{T}loop_ready"}
# prometheus_client's standard collectors, as every process served them before it had roles.
COMMON |= {f"process_{x}" for x in ("cpu_seconds", "max_fds", "open_fds", "resident_memory_bytes")}
COMMON |= {"process_start_time_seconds", "process_virtual_memory_bytes", "python_info"}
COMMON |= {"python_gc_collections", "python_gc_objects_collected", "python_gc_objects_uncollectable"}
PUBLISHER = {f"{T}producer_events_{x}" for x in ("sent", "delivered", "dropped", "dead_lettered", "split")}
WATCHDOG = {f"{T}consumer_stall_recoveries", f"{T}consumer_stalled_seconds"}
POLLS, LINES = f"{T}producer_poll_failures", f"{T}producer_lines_read"
# What each role's code uses, written out here (not read from the code under test).
EXPECTED: dict[str, set[str]] = {
    "gpu": PUBLISHER | {POLLS},
    "ib": PUBLISHER | {POLLS},
    "dcgm": PUBLISHER | {f"{T}producer_scrape_failures"},
    "kernel": PUBLISHER | {LINES},
    "logs": PUBLISHER | WATCHDOG | {POLLS, LINES},
    "slurm": PUBLISHER | {POLLS},
    "ingest": PUBLISHER | {POLLS, f"{T}producer_ingest_accepted", f"{T}producer_ingest_rejected"},
    "streams": WATCHDOG
    | {
        f"{T}{x}"
        for x in (
            "stream_events",
            "stream_published",
            "dead_letters",
            "consumer_record_age_seconds",
            "incidents",
            "decisions",
            "detection_latency_seconds",
            "signals_behind_seconds",
            "attribution_pending_groups",
            "stream_foreign_events",
            "modes_in_doubt",
            "mode",
            "autonomous_categories",
        )
    },
    "executor": PUBLISHER
    | WATCHDOG
    | {
        f"{T}{x}"
        for x in (
            "actions",
            "action_latency_seconds",
            "guardrail_trips",
            "action_attempts",
            "executor_acting",
            "executor_fenced",
            "sink_record_age_seconds",
            "executor_foreign_actions",
            "kill_switch",
        )
    },
    "audit-sink": {f"{T}audit_rows", f"{T}audit_insert_failures"},
    # trainmedic_recommendations_pending is counted at scrape time from the audit, which this
    # process has not opened: the family is registered but yields nothing yet.
    "api": set(PUBLISHER),
    "notifier": PUBLISHER | WATCHDOG,
    "node-agent": PUBLISHER | WATCHDOG | {f"{T}node_commands"},
    "embedded-broker": {
        f"{T}embedded_broker_{x}" for x in ("records", "largest_partition_records", "resident_bytes", "cpu_seconds")
    },
}
# The series at 0 from the start that the alerts' increase() needs, per role: (family, labels).
ZERO: dict[str, list[tuple[str, dict[str, str]]]] = {
    "kernel": [
        (f"{T}producer_events_dropped_total", {"producer": "kernel", "topic": "node.kernel"}),
        (f"{T}producer_events_dropped_total", {"producer": "kernel", "topic": "deadletter"}),
        (f"{T}producer_events_dead_lettered_total", {"producer": "kernel", "topic": "node.kernel"}),
    ],
    "gpu": [
        (f"{T}producer_events_dropped_total", {"producer": "gpu", "topic": "gpu.samples"}),
        (f"{T}producer_poll_failures_total", {"producer": "gpu", "reason": "sample"}),
    ],
    "dcgm": [(f"{T}producer_scrape_failures_total", {"producer": "dcgm"})],
    "slurm": [
        (f"{T}producer_poll_failures_total", {"producer": "slurm", "reason": r})
        for r in ("command", "parse", "diff", "flush", "state_save", "unexpected")
    ]
    + [(f"{T}producer_events_dead_lettered_total", {"producer": "slurm", "topic": "sched.events"})],
    "logs": [
        *((f"{T}producer_poll_failures_total", {"producer": "logs", "reason": r}) for r in ("list", "describe")),
        (f"{T}producer_events_dropped_total", {"producer": "logs", "topic": "job.logs"}),
        (f"{T}producer_events_dropped_total", {"producer": "logs", "topic": "job.progress"}),
    ],
    "ingest": [(f"{T}producer_poll_failures_total", {"producer": "ingest", "reason": "kafka"})],
    "streams": [(f"{T}dead_letters_total", {"component": c}) for c in ("streams", "streams.detect_kernel")],
    "executor": [
        *((f"{T}actions_total", {"action": a, "status": "failed"}) for a in ("drain_and_requeue", "requeue", "stop")),
        *(
            (f"{T}guardrail_trips_total", {"guardrail": g})
            for g in ("kill_switch", "partition_not_allowed", "blast_radius", "node_cooldown", "culprit_not_in_job")
        ),
        (f"{T}producer_events_dropped_total", {"producer": "executor", "topic": "action.results"}),
        (f"{T}producer_events_dropped_total", {"producer": "auto-return", "topic": "node.returns"}),
    ],
    "api": [(f"{T}producer_events_dropped_total", {"producer": "api", "topic": "actions"})],
}

_SERVE = """
import sys
from trainmedic.stack.metrics_server import MetricsServer
server = MetricsServer("127.0.0.1", 0, roles=sys.argv[1:]).start()
print(server.url, flush=True)
sys.stdin.read()
"""


def scrape(role: str) -> str:
    """/metrics of a fresh process of `role`, over HTTP."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, role], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), f"the {role} process did not start its listener"
        return str(urllib.request.urlopen(url, timeout=20).read().decode())
    finally:
        proc.communicate("", timeout=20)


def served(text: str) -> dict[str, Metric]:
    """The families of a scrape by their names as defined (a counter without `_total`, the build
    info without `_info`), less the `_created` companions of counters and histograms."""
    families: dict[str, Metric] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removesuffix("_info") if family.name == f"{T}build_info" else family.name
        families[name.removesuffix("_total")] = family
    return {
        n: f for n, f in families.items() if not (n.endswith("_created") and n.removesuffix("_created") in families)
    }


def test_every_role_is_tested() -> None:
    assert set(EXPECTED) == set(ROLES)


@pytest.mark.parametrize("role", ROLES)
def test_a_process_serves_only_its_roles_families_and_the_alerted_series_at_zero(role: str) -> None:
    families = served(scrape(role))
    others = set(families) - COMMON - EXPECTED[role]
    assert not others, f"{role} serves families of other roles: {sorted(others)}"
    assert set(families) == COMMON | EXPECTED[role], sorted((COMMON | EXPECTED[role]) - set(families))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    for name, labels in ZERO.get(role, []):
        key = (name, tuple(sorted(labels.items())))
        assert key in samples, f"{role}: no {name}{labels} before its first event"
        assert samples[key] == 0
    # A series of another producer's label set would be another role's, not this one's.
    for name, label_items in samples:
        producer = dict(label_items).get("producer")
        if producer is not None:
            assert producer in PUBLISHERS.get(role, {role: ()}) or producer == role, (role, name, label_items)


def test_the_up_process_serves_its_components_together() -> None:
    families = set(served(scrape_many("executor", "audit-sink", "api")))
    assert families == COMMON | EXPECTED["executor"] | EXPECTED["audit-sink"] | EXPECTED["api"]


def scrape_many(*roles: str) -> str:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, *roles], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        return str(urllib.request.urlopen(proc.stdout.readline().strip(), timeout=20).read().decode())
    finally:
        proc.communicate("", timeout=20)


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(MetricsError, match="unknown metrics role 'kernal'"):
        role_families("kernal")


def _string_args(path: Path, func: str, position: int) -> set[str]:
    """The string literals passed as argument `position` to calls of `func` (a name or attribute)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and len(node.args) > position:
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            arg = node.args[position]
            if callee == func and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
    return found


def test_the_known_label_sets_are_the_codes() -> None:
    # Every poll-failure reason a producer counts with is one made at 0 from its start.
    counted: dict[str, set[str]] = {}
    for path in (REPO / "producers").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "labels"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "POLL_FAILURES"
                and all(isinstance(a, ast.Constant) for a in node.args)
            ):
                producer, reason = (a.value for a in node.args if isinstance(a, ast.Constant))
                counted.setdefault(str(producer), set()).add(str(reason))
    counted["slurm"] = _string_args(REPO / "producers" / "slurm.py", "_fail", 0)
    assert counted == {p: set(r) for p, r in POLL_FAILURE_REASONS.items()}
    # Every dead-letter component of the streams worker.
    app = REPO / "streams" / "app.py"
    components = _string_args(app, "accept", 3) | _string_args(app, "accept_as_read", 3)
    components |= _string_args(app, "dead_letter", 0) | _string_args(app, "make_dead_letter", 0)
    assert components == set(DEAD_LETTER_COMPONENTS)
    # Every guardrail a check returns as its trip (`return "blast_radius", why`) is made at 0.
    tripped = {
        node.value.elts[0].value
        for path in (REPO / "sinks" / "guardrails.py", REPO / "sinks" / "executor.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Return)
        and isinstance(node.value, ast.Tuple)
        and node.value.elts
        and isinstance(node.value.elts[0], ast.Constant)
        and node.value.elts[0].value in get_args(Guardrail)
    }
    assert {"kill_switch", "blast_radius", "node_cooldown", "partition_not_allowed"} <= tripped <= set(TRIPPED)
    assert "none" not in ACTED and {"drain_and_requeue", "requeue", "stop"} <= set(ACTED)


def test_every_process_names_its_role() -> None:
    # `run X` and `produce X` each start their listener with role X.
    checked = []
    for path, func, index in (
        (REPO / "trainmedic" / "cli" / "run.py", "start_probes", 1),
        (REPO / "trainmedic" / "cli" / "produce.py", "_probes", 1),
    ):
        tree = ast.parse(path.read_text())
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and getattr(c.func, "id", None) == func]
            roles = {a.value for c in calls for a in c.args[index : index + 1] if isinstance(a, ast.Constant)}
            if roles:
                command = fn.name.replace("_", "-")
                assert roles == {command} and command in ROLES, (path.name, fn.name, roles)
                checked.append(command)
    # run: executor, audit-sink, api, ingest, notifier, node-agent; produce: gpu, dcgm, ib, kernel, logs, slurm.
    assert len(checked) == 12, checked
