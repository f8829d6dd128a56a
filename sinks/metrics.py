"""Prometheus metrics of the executor and the audit sink."""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

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


def watch_kill_switch(engaged: Callable[[], bool]) -> None:
    """The kill-switch gauge follows `engaged` (the executor's guardrail settings), read at scrape time."""

    def value() -> float:
        try:
            return 1.0 if engaged() else 0.0
        except Exception:  # a scrape must answer; the guardrails log their own reload errors
            logging.getLogger("trainmedic.metrics").exception("kill switch state not readable")
            return float("nan")

    KILL_SWITCH.set_function(value)
