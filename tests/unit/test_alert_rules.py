"""The alert rules file (infra/helm/trainmedic/files/alerts.yaml) is one Prometheus would load,
and every metric its expressions read is one trainmedic exports.

Each expression is parsed by promql-parser (the Rust PromQL parser, as Prometheus's grammar);
the metric names are taken from its syntax tree, not by pattern, and looked up among the
names some process serves on /metrics: the registries of the processes' roles
(trainmedic/stack/metrics_server.py; a counter `x` is scraped as `x_total`). What each alert
does with real series is tests/unit/test_alert_rules_promtool.py's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client.metrics_core import Metric

from tests.conftest import REPO
from trainmedic.stack.metrics_server import ROLES, role_registry

ALERTS = REPO / "infra" / "helm" / "trainmedic" / "files" / "alerts.yaml"
# Where the runbooks are read: the chart's home (Chart.yaml), on its main branch.
RUNBOOKS = "https://github.com/trainmedic/trainmedic/blob/main/docs/metrics.md#"
# Series Prometheus makes itself, not the targets.
PROMETHEUS_OWN = {"up"}
# Collectors that produce their family only when they can count (a custom collector asked at
# scrape time): found by name in the module that defines them instead.
SCRAPE_TIME_COLLECTORS = {"trainmedic_recommendations_pending": REPO / "trainmedic" / "web" / "api.py"}
SEVERITIES = {"critical", "warning", "info"}
_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def scraped_names(family: Metric) -> set[str]:
    """The sample names a family shows on /metrics (also for a labelled family with no sample yet)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
        "info": ("_info",),
        "gauge": ("",),
        "unknown": ("",),
    }[family.type]
    return {family.name + s for s in suffixes} | {s.name for s in family.samples}


def exported_metrics() -> set[str]:
    """Every name some process serves: the union of the roles' registries."""
    return {name for role in ROLES for family in role_registry([role]).collect() for name in scraped_names(family)}


def metric_names(expr: str) -> set[str]:
    """Every metric an expression selects, from promql-parser's syntax tree."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next((m.value for m in node.matchers.matchers if m.name == "__name__"), None)
            assert name, f"a selector without a metric name in {expr!r}"
            names.add(name)

    promql_parser.walk(promql_parser.parse(expr), visit)  # type: ignore[no-untyped-call]
    return names


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_the_file_is_a_prometheus_rules_file() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"}
    names = [g["name"] for g in doc["groups"]]
    assert len(names) == len(set(names)) and all(names)
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"}
        assert group["rules"], group["name"]
    alerts = [r["alert"] for r in rules()]
    assert len(alerts) == len(set(alerts)), "alert names repeat"


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_every_alert_has_severity_summary_description_and_runbook(rule: dict[str, Any]) -> None:
    assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"])
    assert rule["labels"]["severity"] in SEVERITIES
    notes = rule["annotations"]
    for key in ("summary", "description", "runbook_url", "remedy"):
        assert isinstance(notes.get(key), str) and notes[key].strip(), f"{rule['alert']}: no {key}"
    # runbook_url (what Alertmanager's and Grafana's templates link) is a URL of the section of
    # docs/metrics.md that exists, in the repository the chart names as its home.
    assert f"home: {RUNBOOKS.split('/blob/')[0]}\n" in (ALERTS.parents[1] / "Chart.yaml").read_text()
    anchor = re.fullmatch(re.escape(RUNBOOKS) + r"([a-z0-9-]+)", notes["runbook_url"])
    assert anchor, f"{rule['alert']}: runbook_url is not {RUNBOOKS}SECTION: {notes['runbook_url']!r}"
    headings = re.findall(r"^#+ (.+)$", (REPO / "docs" / "metrics.md").read_text(), re.M)
    slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-") for h in headings}
    assert anchor.group(1) in slugs, f"{rule['alert']}: docs/metrics.md has no section #{anchor.group(1)}"
    if "for" in rule:
        assert _DURATION.match(rule["for"]), rule["for"]


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_every_metric_an_alert_reads_is_exported(rule: dict[str, Any]) -> None:
    exported = exported_metrics()
    used = metric_names(rule["expr"])
    assert used, f"{rule['alert']} reads no metric"
    for name in used - PROMETHEUS_OWN:
        if name in SCRAPE_TIME_COLLECTORS:
            source = SCRAPE_TIME_COLLECTORS[name]
            assert f'"{name}"' in source.read_text(), f"{name} is not defined in {source.relative_to(REPO)}"
            continue
        assert name in exported, f"{rule['alert']}: {name} is not a metric trainmedic exports"


def test_the_name_check_can_fail() -> None:
    # The check reads names from the tree (a label value or a function is not a metric) and
    # refuses a name no module exports.
    assert metric_names('absent(foo{job="up"}) or rate(bar_total[5m]) > time()') == {"foo", "bar_total"}
    assert "trainmedic_actions_total" in exported_metrics()
    assert "trainmedic_actions" not in exported_metrics()  # a counter is scraped as _total only
    with pytest.raises(ValueError):
        promql_parser.parse("sum by (x (rate(y[5m]))")


def test_alert_rules_live_where_the_chart_reads_them() -> None:
    # The chart wraps this file with .Files.Get: it must be inside the chart, under files/.
    assert ALERTS.is_relative_to(REPO / "infra" / "helm" / "trainmedic" / "files")
    assert Path(ALERTS).stat().st_size > 0
