"""kube-prometheus-stack's Prometheus selects only the PodMonitors and PrometheusRules labelled
`release: <its Helm release>`: the chart's rendered objects carry that label by default, a
site's own value replaces it, and `labels: {}` leaves none (a Prometheus that selects otherwise)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.test_helm import CHART, helm, render

ENABLED: dict[str, Any] = {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def monitoring_labels(chart: Any, metrics: dict[str, Any]) -> list[dict[str, str]]:
    docs = render(chart, {"metrics": metrics})
    objects = [d for d in docs if d["kind"] in ("PodMonitor", "PrometheusRule")]
    assert {d["kind"] for d in objects} == {"PodMonitor", "PrometheusRule"}
    return [d["metadata"]["labels"] for d in objects]


def test_the_monitoring_objects_carry_the_release_label_by_default(chart: Any) -> None:
    assert all(labels.get("release") == "kube-prometheus-stack" for labels in monitoring_labels(chart, ENABLED))
    # The values file says why and what to set, next to the default.
    values = (CHART / "values.yaml").read_text()
    assert "podMonitorSelector" in values and "ruleSelector" in values and "silently ignored" in values


def test_a_sites_release_replaces_it_and_none_leaves_it_out(chart: Any) -> None:
    own = {k: {**v, "labels": {"release": "prom"}} for k, v in ENABLED.items()}
    assert all(labels.get("release") == "prom" for labels in monitoring_labels(chart, own))
    none = {k: {**v, "labels": {"release": None, "team": "ml"}} for k, v in ENABLED.items()}
    assert all("release" not in labels and labels["team"] == "ml" for labels in monitoring_labels(chart, none))
