"""Every alert of infra/helm/trainmedic/files/alerts.yaml, run by Prometheus's own rule engine
(`promtool test rules`): it fires on the first event (the first dropped event, the first failed
action, a producer instance down) and stays quiet while all is well.

The series are what the processes export: the counters the alerts read start at 0 (the role
registries create them so, tests/unit/test_metric_roles.py), so a first event is a step from 0
to 1; `test_a_series_born_at_its_first_event_is_missed` shows why that matters. The rules are
tested without their annotations (the alerts' labels are compared; annotation templates are
checked by `promtool check rules`). promtool comes from tests/tools/install-promtool.sh
(.ci/run installs it into .venv/tools/prometheus); PROMTOOL names another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

ALERTS = REPO / "infra" / "helm" / "trainmedic" / "files" / "alerts.yaml"
INSTALLED = Path(sys.prefix) / "tools" / "prometheus" / "usr" / "bin" / "promtool"


def promtool() -> str | None:
    named = os.environ.get("PROMTOOL")
    if named:
        return named
    return str(INSTALLED) if INSTALLED.is_file() else shutil.which("promtool")


pytestmark = pytest.mark.skipif(
    promtool() is None,
    reason="promtool is not installed: run tests/tools/install-promtool.sh (CI's .ci/run does) or set PROMTOOL",
)

NODE = {"job": "trainmedic-kernel", "instance": "gpu07:9481"}
CENTRAL = {"job": "trainmedic-executor", "instance": "central:9479"}


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    """An input series: `name{labels}` with promtool's expanding notation (`0x10 1x5`: eleven
    0s then six 1s, one a minute)."""
    shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{shown}}}", "values": values}


@dataclass
class Case:
    """`fires`: the series of the first event and the labels the alert then has at `at`;
    `quiet`: series of a healthy system, no alert at `at`."""

    fires: list[dict[str, str]]
    labels: list[dict[str, str]]
    quiet: list[dict[str, str]]
    at: str
    extra: dict[str, Any] = field(default_factory=dict)


def beat(loop: str, values: str, **labels: str) -> dict[str, str]:
    return series("trainmedic_loop_last_beat_timestamp_seconds", values, loop=loop, **labels)


# Timestamps: promtool's clock starts at 0, so a loop that beats every minute has the values
# 0+60x... and one stuck since minute 5 keeps 300.
GOING, STUCK_AT_5M = "0+60x40", "0+60x5 300x35"
FIRST = "0x10 1x10"  # a counter at 0 since the start, its first event at minute 11
NONE_YET = "0x20"

CASES: dict[str, Case] = {
    "TrainmedicStreamsDown": Case(
        fires=[
            series("up", "1 1 0x10", job="trainmedic-streams", instance="central:9478"),
            beat("streams", GOING, job="trainmedic-streams", instance="central:9478"),
        ],
        labels=[{"severity": "critical", "job": "trainmedic-streams", "instance": "central:9478"}],
        quiet=[
            series("up", "1x12", job="trainmedic-streams", instance="central:9478"),
            beat("streams", GOING, job="trainmedic-streams", instance="central:9478"),
        ],
        at="10m",
    ),
    "TrainmedicStreamsNotReady": Case(
        fires=[series("trainmedic_loop_ready", "1 1 0x10", loop="streams", **CENTRAL)],
        labels=[{"severity": "critical", "loop": "streams", **CENTRAL}],
        quiet=[series("trainmedic_loop_ready", "1x12", loop="streams", **CENTRAL)],
        at="10m",
    ),
    "TrainmedicExecutorDown": Case(
        # Not scraped at all: only absent() can tell.
        fires=[series("up", "1x12", job="trainmedic-streams", instance="central:9478")],
        labels=[{"severity": "critical", "loop": "executor"}],
        quiet=[series("up", "1x12", **CENTRAL), beat("executor", GOING, **CENTRAL)],
        at="10m",
    ),
    "TrainmedicExecutorNotReady": Case(
        fires=[series("trainmedic_loop_ready", "1 1 0x10", loop="executor", **CENTRAL)],
        labels=[{"severity": "critical", "loop": "executor", **CENTRAL}],
        quiet=[series("trainmedic_loop_ready", "1x12", loop="executor", **CENTRAL)],
        at="10m",
    ),
    "TrainmedicNoActingExecutor": Case(
        fires=[series("trainmedic_executor_acting", "1 1 0x10", **CENTRAL)],
        labels=[{"severity": "critical"}],
        quiet=[
            series("trainmedic_executor_acting", "1x12", **CENTRAL),
            series("trainmedic_executor_acting", "0x12", job="trainmedic-executor", instance="standby:9479"),
        ],
        at="10m",
    ),
    "TrainmedicAuditSinkDown": Case(
        fires=[series("up", "1x15", **CENTRAL)],
        labels=[{"severity": "warning", "loop": "audit-sink"}],
        quiet=[beat("audit-sink", GOING, job="trainmedic-audit-sink", instance="central:9480")],
        at="12m",
    ),
    "TrainmedicProducerDown": Case(
        # One node's kernel producer down among healthy ones, and a chart-scraped one: each by instance.
        fires=[
            series("up", "1 1 0x10", **NODE),
            series("up", "1x12", job="trainmedic-kernel", instance="gpu08:9481"),
            series("up", "1 1 0x10", job="monitoring/trainmedic-node-producers", instance="10.0.3.7:9482"),
        ],
        labels=[
            {"severity": "warning", **NODE},
            {"severity": "warning", "job": "monitoring/trainmedic-node-producers", "instance": "10.0.3.7:9482"},
        ],
        quiet=[
            series("up", "1x12", **NODE),
            series("up", "1x12", job="trainmedic-gpu", instance="gpu07:9480"),
            series("up", "1x12", job="trainmedic-slurm-producer", instance="central:9483"),
        ],
        at="10m",
    ),
    "TrainmedicProducerStale": Case(
        fires=[
            beat("producer-kernel", STUCK_AT_5M, **NODE),
            beat("producer-kernel", GOING, job=NODE["job"], instance="gpu08:9481"),
        ],
        labels=[{"severity": "warning", "loop": "producer-kernel", **NODE}],
        quiet=[beat("producer-kernel", GOING, **NODE)],
        at="15m",
    ),
    "TrainmedicLoopStuck": Case(
        fires=[beat("executor", STUCK_AT_5M, **CENTRAL)],
        labels=[{"severity": "warning", "loop": "executor", **CENTRAL}],
        # A stuck producer loop is TrainmedicProducerStale's, not this one's: one alert per cause.
        quiet=[beat("executor", GOING, **CENTRAL), beat("producer-kernel", STUCK_AT_5M, **NODE)],
        at="15m",
    ),
    "TrainmedicConsumerStalled": Case(
        fires=[
            series(
                "trainmedic_consumer_stalled_seconds", "0 0 30 90 150 210 270", consumer="executor-actions", **CENTRAL
            )
        ],
        labels=[{"severity": "warning", "consumer": "executor-actions", **CENTRAL}],
        quiet=[series("trainmedic_consumer_stalled_seconds", "0x6", consumer="executor-actions", **CENTRAL)],
        at="6m",
    ),
    "TrainmedicLoopNotReady": Case(
        fires=[series("trainmedic_loop_ready", "1 0x15", loop="producer-gpu", **NODE)],
        labels=[{"severity": "warning", "loop": "producer-gpu", **NODE}],
        quiet=[
            series("trainmedic_loop_ready", "1x15", loop="producer-gpu", **NODE),
            # The streams worker's and the executor's are their own, critical alerts.
            series("trainmedic_loop_ready", "0x15", loop="streams", **CENTRAL),
        ],
        at="14m",
    ),
    "TrainmedicPipelineStale": Case(
        fires=[
            series("trainmedic_consumer_last_processed_timestamp_seconds", STUCK_AT_5M, loop="streams.detect_kernel"),
            series(
                "trainmedic_producer_events_delivered_total", "0+10x40", producer="kernel", topic="node.kernel", **NODE
            ),
        ],
        labels=[{"severity": "critical"}],
        quiet=[
            series("trainmedic_consumer_last_processed_timestamp_seconds", GOING, loop="streams.detect_kernel"),
            series(
                "trainmedic_producer_events_delivered_total", "0+10x40", producer="kernel", topic="node.kernel", **NODE
            ),
        ],
        at="25m",
    ),
    "TrainmedicAuditStale": Case(
        fires=[
            series("trainmedic_consumer_last_processed_timestamp_seconds", STUCK_AT_5M, loop="audit-sink"),
            series(
                "trainmedic_producer_events_delivered_total", "0+10x40", producer="kernel", topic="node.kernel", **NODE
            ),
        ],
        labels=[{"severity": "warning"}],
        quiet=[
            series("trainmedic_consumer_last_processed_timestamp_seconds", GOING, loop="audit-sink"),
            series(
                "trainmedic_producer_events_delivered_total", "0+10x40", producer="kernel", topic="node.kernel", **NODE
            ),
        ],
        at="30m",
    ),
    "TrainmedicDeadLetters": Case(
        fires=[series("trainmedic_dead_letters_total", FIRST, component="streams.detect_kernel", **CENTRAL)],
        labels=[{"severity": "warning", "component": "streams.detect_kernel"}],
        quiet=[series("trainmedic_dead_letters_total", NONE_YET, component="streams.detect_kernel", **CENTRAL)],
        at="12m",
    ),
    "TrainmedicProducerDeadLetters": Case(
        fires=[
            series("trainmedic_producer_events_dead_lettered_total", FIRST, producer="logs", topic="job.logs", **NODE)
        ],
        labels=[{"severity": "warning", "producer": "logs", "topic": "job.logs"}],
        quiet=[
            series(
                "trainmedic_producer_events_dead_lettered_total", NONE_YET, producer="logs", topic="job.logs", **NODE
            )
        ],
        at="12m",
    ),
    "TrainmedicProducerDroppingEvents": Case(
        fires=[
            series("trainmedic_producer_events_dropped_total", FIRST, producer="kernel", topic="node.kernel", **NODE)
        ],
        labels=[{"severity": "critical", "producer": "kernel", "topic": "node.kernel", "instance": NODE["instance"]}],
        quiet=[
            series(
                "trainmedic_producer_events_dropped_total", NONE_YET, producer="kernel", topic="node.kernel", **NODE
            ),
            series("trainmedic_producer_events_sent_total", "0+100x20", producer="kernel", topic="node.kernel", **NODE),
        ],
        at="12m",
    ),
    "TrainmedicProducerPollsFailing": Case(
        fires=[
            series("trainmedic_producer_poll_failures_total", "0x5 1+1x30", producer="slurm", reason="command", **NODE)
        ],
        labels=[{"severity": "warning", "producer": "slurm", "reason": "command", "instance": NODE["instance"]}],
        quiet=[series("trainmedic_producer_poll_failures_total", "0x30", producer="slurm", reason="command", **NODE)],
        at="25m",
    ),
    "TrainmedicDcgmScrapesFailing": Case(
        fires=[series("trainmedic_producer_scrape_failures_total", "0x5 1+1x30", producer="dcgm", **NODE)],
        labels=[{"severity": "warning", "instance": NODE["instance"]}],
        quiet=[series("trainmedic_producer_scrape_failures_total", "0x30", producer="dcgm", **NODE)],
        at="25m",
    ),
    "TrainmedicModesInDoubt": Case(
        fires=[series("trainmedic_modes_in_doubt", "0 1x15", **CENTRAL)],
        labels=[{"severity": "warning"}],
        quiet=[series("trainmedic_modes_in_doubt", "0x15", **CENTRAL)],
        at="13m",
    ),
    "TrainmedicAuditInsertFailures": Case(
        fires=[
            series(
                "trainmedic_audit_insert_failures_total", "0x2 1+1x20", table="incidents", reason="disk_full", **CENTRAL
            )
        ],
        labels=[{"severity": "warning", "table": "incidents", "reason": "disk_full", "instance": CENTRAL["instance"]}],
        quiet=[
            series("trainmedic_audit_insert_failures_total", "0x20", table="incidents", reason="disk_full", **CENTRAL)
        ],
        at="15m",
    ),
    "TrainmedicActionsFailed": Case(
        fires=[series("trainmedic_actions_total", FIRST, action="drain_and_requeue", status="failed", **CENTRAL)],
        labels=[{"severity": "warning", "action": "drain_and_requeue"}],
        quiet=[
            series("trainmedic_actions_total", NONE_YET, action="drain_and_requeue", status="failed", **CENTRAL),
            series("trainmedic_actions_total", "0+1x20", action="drain_and_requeue", status="done", **CENTRAL),
        ],
        at="12m",
    ),
    "TrainmedicGuardrailTrips": Case(
        fires=[series("trainmedic_guardrail_trips_total", FIRST, guardrail="blast_radius", **CENTRAL)],
        labels=[{"severity": "warning", "guardrail": "blast_radius"}],
        quiet=[
            series("trainmedic_guardrail_trips_total", NONE_YET, guardrail="blast_radius", **CENTRAL),
            # A deliberate setting's refusals are TrainmedicGuardrailRefusals' (info).
            series("trainmedic_guardrail_trips_total", "0+1x20", guardrail="kill_switch", **CENTRAL),
        ],
        at="12m",
    ),
    "TrainmedicGuardrailRefusals": Case(
        fires=[series("trainmedic_guardrail_trips_total", FIRST, guardrail="kill_switch", **CENTRAL)],
        labels=[{"severity": "info", "guardrail": "kill_switch"}],
        quiet=[series("trainmedic_guardrail_trips_total", NONE_YET, guardrail="kill_switch", **CENTRAL)],
        at="12m",
    ),
    "TrainmedicKillSwitchEngaged": Case(
        fires=[series("trainmedic_kill_switch", "0 1x70", **CENTRAL)],
        labels=[{"severity": "info"}],
        quiet=[series("trainmedic_kill_switch", "0x70", **CENTRAL)],
        at="65m",
    ),
    "TrainmedicExecutorFenced": Case(
        fires=[series("trainmedic_executor_fenced_total", FIRST, **CENTRAL)],
        labels=[{"severity": "warning", **CENTRAL}],
        quiet=[series("trainmedic_executor_fenced_total", NONE_YET, **CENTRAL)],
        at="12m",
    ),
    "TrainmedicRecommendationsUnanswered": Case(
        fires=[
            series(
                "trainmedic_recommendations_pending",
                "2x70",
                partition="gpu",
                job="trainmedic-api",
                instance="central:9481",
            )
        ],
        labels=[{"severity": "warning", "partition": "gpu", "job": "trainmedic-api", "instance": "central:9481"}],
        quiet=[
            series(
                "trainmedic_recommendations_pending",
                "0x70",
                partition="gpu",
                job="trainmedic-api",
                instance="central:9481",
            )
        ],
        at="65m",
    ),
}


def alert_names() -> list[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule["alert"] for group in doc["groups"] for rule in group["rules"]]


def run_promtool(tmp_path: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    """`promtool test rules` over the alert rules (annotations left out) and these tests."""
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(doc))
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    tool = promtool()
    assert tool is not None
    return subprocess.run(
        [tool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def test_every_alert_has_a_case() -> None:
    assert set(CASES) == set(alert_names())


def test_promtool_checks_the_rules_file_with_its_annotations() -> None:
    tool = promtool()
    assert tool is not None
    done = subprocess.run([tool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in done.stdout


@pytest.mark.parametrize("alert", alert_names())
def test_the_alert_fires_on_the_first_event_and_stays_quiet_while_all_is_well(alert: str, tmp_path: Path) -> None:
    case = CASES[alert]
    tests = [
        {
            "name": f"{alert} fires",
            "interval": "1m",
            "input_series": case.fires,
            "alert_rule_test": [
                {"eval_time": case.at, "alertname": alert, "exp_alerts": [{"exp_labels": lab} for lab in case.labels]}
            ],
        },
        {
            "name": f"{alert} is quiet",
            "interval": "1m",
            "input_series": case.quiet,
            "alert_rule_test": [{"eval_time": case.at, "alertname": alert, "exp_alerts": []}],
        },
    ]
    done = run_promtool(tmp_path, tests)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_series_born_at_its_first_event_is_missed(tmp_path: Path) -> None:
    # Why the processes export their counters at 0 from the start: the same first dropped event,
    # on a series that did not exist before it (`_`: no sample), raises nothing.
    labels = {"producer": "kernel", "topic": "node.kernel", **NODE}
    tests = [
        {
            "interval": "1m",
            "input_series": [series("trainmedic_producer_events_dropped_total", "_x10 1x10", **labels)],
            "alert_rule_test": [
                {"eval_time": "12m", "alertname": "TrainmedicProducerDroppingEvents", "exp_alerts": []}
            ],
        }
    ]
    done = run_promtool(tmp_path, tests)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_promtool_run_can_fail(tmp_path: Path) -> None:
    # A case whose expectation is wrong is reported as a failure, not passed over.
    wrong = [
        {
            "interval": "1m",
            "input_series": [series("trainmedic_executor_fenced_total", NONE_YET, **CENTRAL)],
            "alert_rule_test": [
                {"eval_time": "12m", "alertname": "TrainmedicExecutorFenced", "exp_alerts": [{"exp_labels": CENTRAL}]}
            ],
        }
    ]
    done = run_promtool(tmp_path, wrong)
    assert done.returncode != 0 and "TrainmedicExecutorFenced" in done.stdout + done.stderr
