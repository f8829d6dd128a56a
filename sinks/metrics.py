"""Prometheus metrics of the executor, the audit sink and the node agent.

`executor_families()`, `audit_sink_families()` and `node_agent_families()` are what each of
those processes exports, the counters the alerts read created at 0 for their known label sets
(an alert's `increase()` needs a sample before the first failure or trip)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import get_args

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from schemas.vocab import ACTIONS as ACTION_KINDS
from schemas.vocab import Guardrail, ResultStatus

LATENCY_BUCKETS = (0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600)

ACTIONS = Counter("trainmedic_actions_total", "Actions handled by the executor", ["action", "status"])
ACTION_LATENCY = Histogram(
    "trainmedic_action_latency_seconds", "Incident published -> effect verified", buckets=LATENCY_BUCKETS
)
GUARDRAIL_TRIPS = Counter("trainmedic_guardrail_trips_total", "Actions refused by a guardrail", ["guardrail"])
ATTEMPTS = Counter(
    "trainmedic_action_attempts_total", "Scheduler calls recorded on action.attempts before they were made", ["call"]
)
EXECUTOR_ACTING = Gauge("trainmedic_executor_acting", "1 while this executor replica holds the acting lease")
EXECUTOR_FENCED = Counter(
    "trainmedic_executor_fenced_total", "Times this replica found it had lost the acting lease while working"
)
AUDIT_ROWS = Counter("trainmedic_audit_rows_total", "Rows inserted into the audit", ["table"])
AUDIT_INSERT_FAILURES = Counter(
    "trainmedic_audit_insert_failures_total",
    "Failed audit inserts (each is retried), by the table that failed and why: disk_full, unavailable, rejected, "
    "other (sinks/audit.py insert_failure_reason)",
    ["table", "reason"],
)
RECORD_AGE = Gauge(
    "trainmedic_sink_record_age_seconds",
    "Age of the last record consumed (now - its Kafka timestamp): consumer lag in time",
    ["component", "topic"],
)
FOREIGN_ACTIONS = Counter(
    "trainmedic_executor_foreign_actions_total",
    "Actions for another cluster the executor passed over without acting",
    ["cluster"],
)
NODE_COMMANDS = Counter(
    "trainmedic_node_commands_total", "Commands the node agent finished (sinks/node_agent.py)", ["kind", "status"]
)
KILL_SWITCH = Gauge(
    "trainmedic_kill_switch",
    "1 while the guardrails' kill switch is on (the executor takes no scheduler action); read at each scrape",
)

#: What the executor acts on (a decision of `none` publishes no action) and how it ends.
ACTED = tuple(a for a in ACTION_KINDS if a != "none")
STATUSES: tuple[str, ...] = get_args(ResultStatus)
#: The guardrails that trip (restart_budget stays in the vocabulary only for old records).
TRIPPED = tuple(g for g in get_args(Guardrail) if g != "restart_budget")


def executor_families() -> tuple[Collector, ...]:
    """What the executor exports; every action and status, every guardrail, at 0."""
    for action in ACTED:
        for status in STATUSES:
            ACTIONS.labels(action, status)
    for guardrail in TRIPPED:
        GUARDRAIL_TRIPS.labels(guardrail)
    return (
        ACTIONS,
        ACTION_LATENCY,
        GUARDRAIL_TRIPS,
        ATTEMPTS,
        EXECUTOR_ACTING,
        EXECUTOR_FENCED,
        RECORD_AGE,
        FOREIGN_ACTIONS,
        KILL_SWITCH,
    )


def audit_sink_families() -> tuple[Collector, ...]:
    """What the audit sink exports (it creates its tables' failure series at 0 itself, sinks/audit.py)."""
    return (AUDIT_ROWS, AUDIT_INSERT_FAILURES)


def node_agent_families() -> tuple[Collector, ...]:
    return (NODE_COMMANDS,)


def watch_kill_switch(engaged: Callable[[], bool]) -> None:
    """The kill-switch gauge follows `engaged` (the executor's guardrail settings), read at scrape time."""

    def value() -> float:
        try:
            return 1.0 if engaged() else 0.0
        except Exception:  # a scrape must answer; the guardrails log their own reload errors
            logging.getLogger("trainmedic.metrics").exception("kill switch state not readable")
            return float("nan")

    KILL_SWITCH.set_function(value)
