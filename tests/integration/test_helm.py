"""The Helm chart infra/helm/trainmedic, rendered and linted by a REAL Helm engine.

The engine is Helm's own Go SDK (v4), loaded in-process by `helm-python-sdk` (a ctypes binding
to libhelm_c, shipped inside its PyPI wheel): `helm.lint` is `helm lint`, `Chart.render` is
`helm template` (values.schema.json is enforced as `helm template` enforces it). Rendered
manifests are checked against the Kubernetes OpenAPI schemas bundled in `kubernetes-validate`
(offline, strict: unknown fields fail) for the oldest Kubernetes the chart supports and the
newest bundled, and the Prometheus Operator objects (PodMonitor, PrometheusRule) against the
openAPIV3Schema of their CRDs (tests/fixtures/crds/, README there), unknown fields refused as a
strict API server refuses them. No cluster is involved. tests/integration/test_chart_start.py
runs what the chart renders.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from bus import acls
from schemas.topics import DEFAULT_PARTITIONS
from sinks.guardrails import parse_guardrails
from sinks.notifier import NotifierConfigError, load_config
from streams.policy import DEFAULT_POLICY, load_policy
from trainmedic.settings import Settings, unknown_env

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk (Helm's Go SDK for Python) is not installed: pip install helm-python-sdk"
)
kv = pytest.importorskip(
    "kubernetes_validate.utils", reason="kubernetes-validate is not installed: pip install kubernetes-validate"
)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "infra" / "helm" / "trainmedic"
CRDS = REPO / "tests" / "fixtures" / "crds"
# The chart's kubeVersion floor (Chart.yaml) and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.25.0", kv.latest_version())
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]

# `produce slurm` reads squeue/sinfo locally or over SSH; slurmrestd cannot serve it (rest runs without it).
SSH: dict[str, Any] = {
    "slurm": {"access": "ssh", "ssh": {"host": "login1.example.org", "port": 2222, "existingSecret": "tm-ssh"}},
}
REST: dict[str, Any] = {
    "slurm": {"access": "rest", "rest": {"url": "https://slurmrestd.example.org:6820", "existingSecret": "tm-jwt"}},
    "slurmProducer": {"enabled": False},
}
KAFKA_SASL_MTLS: dict[str, Any] = {
    "kafka": {
        "bootstrap": "b1.example.org:9093,b2.example.org:9093",
        "securityProtocol": "sasl_ssl",
        "sasl": {
            "mechanism": "SCRAM-SHA-512",
            "credentials": {"streams": {"username": "tm-streams-west", "existingSecret": "tm-kafka-streams"}},
        },
        "tls": {"existingSecret": "tm-kafka-tls", "certificateKey": "tls.crt", "keyKey": "tls.key"},
        "ports": [9093],
    }
}
# The notifier with a token endpoint (its key in an existing Secret) and a Slack one (none).
NOTIFIER: dict[str, Any] = {
    "enabled": True,
    "webhooks": {
        "endpoints": [
            {"name": "oncall", "url": "https://alerts.example.org/trainmedic", "token_file": "oncall"},
            {"name": "slack", "url": "https://hooks.slack.com/services/T0/B0/XXXX", "template": "slack"},
        ],
        "retry": {"attempts": 4, "base_delay_s": 2, "max_delay_s": 30},
        "max_age_s": 3600,
    },
    "tokenSecret": "tm-notifier-tokens",
}
EVERYTHING: dict[str, Any] = {
    "mode": "autonomous",
    "cluster": "west",
    "clickhouse": {"existingSecret": "tm-clickhouse", "userKey": "user", "passwordKey": "password"},
    "imagePullSecrets": [{"name": "regcred"}],
    "podAnnotations": {"example.org/team": "ml-infra"},
    "api": {
        "replicas": 2,
        "token": {"viewerTokenKey": "viewer"},
        "ingress": {"enabled": True, "className": "nginx", "tlsSecret": "tm-ingress-tls"},
    },
    "auditSink": {"replicas": 2},
    "ingest": {"enabled": True, "tls": {"existingSecret": "tm-ingest-tls"}},
    "metrics": {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
    "networkPolicy": {
        "enabled": True,
        "egressCidrs": ["10.0.0.0/8"],
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
    },
    "nodeProducers": {
        "gpu": {"source": "dcgm"},
        "ib": {"enabled": True, "intervalSeconds": 5},
        "kernel": {"source": "kmsg"},
        "logs": {"enabled": True},
        "hostNetwork": True,
        "nodeName": {"from": "hostname", "map": {"ip-10-0-3-17.ec2.internal": "gpu017"}, "stripDomain": True},
    },
    "streams": {"env": [{"name": "TRAINMEDIC_SETTLE_S", "value": "2"}], "nodeSelector": {"role": "infra"}},
    "notifier": {**NOTIFIER, "egress": {"ports": [443, 8443], "cidrs": ["192.0.2.0/24"]}},
    **KAFKA_SASL_MTLS,
}
# slurm.conf from a ConfigMap instead of the node (no hostPath for it).
SLURM_CONF_FROM_CONFIGMAP: dict[str, Any] = {
    "slurm": {
        "local": {
            "volumes": [
                {"name": "munge-socket", "hostPath": {"path": "/var/run/munge", "type": "Directory"}},
                {"name": "slurm-conf", "configMap": {"name": "slurm-conf"}},
            ],
            "volumeMounts": [
                {"name": "munge-socket", "mountPath": "/run/munge"},
                {"name": "slurm-conf", "mountPath": "/etc/slurm", "readOnly": True},
            ],
        }
    }
}
CASES: dict[str, dict[str, Any]] = {
    "local": {},
    "local-configmap": SLURM_CONF_FROM_CONFIGMAP,
    "ssh": SSH,
    "rest": REST,
    "autonomous": {"mode": "autonomous"},
    "kafka-sasl-mtls": KAFKA_SASL_MTLS,
    "api-insecure": {"api": {"insecure": True, "tls": {"existingSecret": ""}}},
    "api-off": {"api": {"enabled": False}, "auditSink": {"enabled": False}},
    "streams-group": {"streams": {"replicas": 3}},
    "notifier": {"notifier": NOTIFIER},
    "notifier-no-token": {
        "notifier": {"enabled": True, "webhooks": {"endpoints": [{"url": "https://hooks.slack.com/services/T/B/X"}]}}
    },
    # The node agent beside the job-log tailer: both read Slurm through the node's munge and slurm.conf.
    "node-agent": {"nodeProducers": {"agent": {"enabled": True}, "logs": {"enabled": True}}},
    "ssh-everything": {**EVERYTHING, **SSH},
    "local-everything": EVERYTHING,
    "rest-everything": {**EVERYTHING, **REST},
}

# The deployables' commands (docs: the commands contract; `trainmedic run --help`), by container.
COMMANDS = {
    "streams": ["trainmedic", "run", "streams"],
    "executor": ["trainmedic", "run", "executor"],
    "audit-sink": ["trainmedic", "run", "audit-sink"],
    "api": ["trainmedic", "run", "api"],
    "ingest": ["trainmedic", "run", "ingest"],
    "notifier": ["trainmedic", "run", "notifier"],
    "slurm-producer": ["trainmedic", "produce", "slurm"],
    "topics": ["trainmedic", "topics", "create"],
    "audit-migrate": ["trainmedic", "audit", "db", "migrate"],
    "kernel": ["trainmedic", "produce", "kernel"],
    "ib": ["trainmedic", "produce", "ib"],
    "logs": ["trainmedic", "produce", "logs"],
    "agent": ["trainmedic", "run", "node-agent"],
}

Manifest = dict[str, Any]


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any] | None = None) -> list[Manifest]:
    """`helm template tm CHART -n trainmedic` with these values: every object, NOTES.txt left out."""
    files: dict[str, str] = chart.render(values or {}, name="tm", namespace="trainmedic")
    docs: list[Manifest] = []
    for name, text in sorted(files.items()):
        if name.endswith("NOTES.txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def find(docs: list[Manifest], kind: str, suffix: str) -> Manifest:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(matches) == 1, f"expected one {kind} *{suffix}, got {[d['metadata']['name'] for d in matches]}"
    return matches[0]


def pod_spec(workload: Manifest) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Manifest, name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    return dict(found)


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def workloads(docs: list[Manifest]) -> list[Manifest]:
    return [d for d in docs if d["kind"] in ("Deployment", "DaemonSet", "Job")]


def containers(docs: list[Manifest]) -> Iterator[tuple[Manifest, dict[str, Any]]]:
    for w in workloads(docs):
        for c in pod_spec(w)["containers"]:
            yield w, c


def lint_problems(report: dict[str, Any]) -> list[str]:
    """Warnings and errors of a lint report (severity 2 and 3; 1 is info such as 'icon is recommended')."""
    return [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2] + list(report["errors"])


# --- the Prometheus Operator CRDs' schemas -----------------------------------------------------------


def _strict(node: Any) -> Any:
    """The CRD schema as a strict API server applies it: an object schema that lists its properties
    and neither preserves unknown fields nor says what extra keys may be refuses any other key."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if isinstance(out.get("pattern"), str) and "(?i)" in out["pattern"]:
        # Go's RE2 takes an inline flag anywhere (`^(?i)(abort|warn)?$`); Python only at the start.
        out["pattern"] = "(?i)" + out["pattern"].replace("(?i)", "")
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    validators: dict[tuple[str, str], jsonschema.protocols.Validator] = {}
    for path in sorted(CRDS.glob("*.json")):
        crd = json.loads(path.read_text())
        schema = _strict(crd["openAPIV3Schema"])
        schema["properties"]["apiVersion"] = {"const": f"{crd['group']}/{crd['version']}"}
        schema["properties"]["kind"] = {"const": crd["kind"]}
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
        cls.check_schema(schema)
        validators[(f"{crd['group']}/{crd['version']}", crd["kind"])] = cls(schema)
    return validators


CRD_VALIDATORS = _crd_validators()


def crd_errors(doc: Manifest) -> list[str]:
    validator = CRD_VALIDATORS[(doc["apiVersion"], doc["kind"])]
    return [f"{'.'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for e in validator.iter_errors(doc)]


def validate(doc: Manifest) -> list[str]:
    """Every schema error of one rendered object: the CRD's for Prometheus Operator kinds, else
    Kubernetes' own (each version)."""
    if (doc["apiVersion"], doc["kind"]) in CRD_VALIDATORS:
        return crd_errors(doc)
    problems = []
    for version in KUBE_VERSIONS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            problems.append(f"(Kubernetes {version}) {'.'.join(map(str, exc.path))}: {exc.message}")
        except kv.SchemaNotFoundError as exc:
            problems.append(f"(Kubernetes {version}) {exc.message}")
    return problems


def test_the_crd_schemas_are_vendored_with_their_source() -> None:
    assert set(CRD_VALIDATORS) == {
        ("monitoring.coreos.com/v1", "PodMonitor"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("monitoring.coreos.com/v1", "PrometheusRule"),
    }
    readme = (CRDS / "README.md").read_text()
    for path in CRDS.glob("*.json"):
        crd = json.loads(path.read_text())
        assert path.name in readme
        assert f"v{crd['operatorVersion']}" in readme


def test_every_scrape_carries_the_cluster_label_the_dashboards_filter_by(chart: Any) -> None:
    docs = render(chart, {**EVERYTHING, "cluster": "dgx-east"})
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitors and all(crd_errors(m) == [] for m in monitors)
    for m in monitors:
        for endpoint in m["spec"]["podMetricsEndpoints"]:
            assert {"action": "replace", "targetLabel": "cluster", "replacement": "dgx-east"} in endpoint["relabelings"]


def test_crd_validation_refuses_unknown_fields_and_wrong_types(chart: Any) -> None:
    """The CRD check can fail: a misspelt field, a field in the wrong place and a wrong type each do."""
    docs = render(chart, EVERYTHING)
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    rule = find(docs, "PrometheusRule", "tm-trainmedic")
    assert crd_errors(monitor) == [] and crd_errors(rule) == []
    typo = copy.deepcopy(monitor)
    typo["spec"]["podMetricsEndpoints"][0]["portt"] = "metrics"
    assert any("portt" in e for e in crd_errors(typo)), crd_errors(typo)
    misplaced = copy.deepcopy(monitor)
    misplaced["spec"]["path"] = "/metrics"
    assert any("path" in e for e in crd_errors(misplaced)), crd_errors(misplaced)
    wrong = copy.deepcopy(rule)
    wrong["spec"]["groups"][0]["rules"] = "up == 0"
    assert crd_errors(wrong)


# --- helm lint -------------------------------------------------------------------------------


def test_the_engine_is_helms_own_go_sdk() -> None:
    assert helm.helm_sdk_version().startswith(("v3.", "v4.")), helm.helm_sdk_version()


@pytest.mark.parametrize("case", ["local", "ssh", "rest", "autonomous", "ssh-everything"])
def test_helm_lint_strict_passes(case: str) -> None:
    report = helm.lint(CHART, CASES[case], strict=True, namespace="trainmedic")
    assert report["total_charts_linted"] == 1
    assert lint_problems(report) == []


def test_helm_lint_reports_a_mode_outside_the_schema() -> None:
    problems = lint_problems(helm.lint(CHART, {"mode": "sometimes"}))
    assert problems, "helm lint accepted mode=sometimes"
    assert any("mode" in p for p in problems), problems


def test_chart_version_and_app_version_agree() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    from trainmedic import __version__

    # The default image tag is appVersion: the release whose commands and settings the chart names.
    assert meta["appVersion"] == __version__
    assert re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", meta["version"]), meta["version"]


# --- values.schema.json ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "offending"),
    [
        ({"mode": "sometimes"}, "mode"),
        ({"cluster": "West_1"}, "cluster"),
        ({"slurm": {"access": "nfs"}}, "access"),
        ({"slurm": {"access": "inCluster"}}, "access"),
        ({"slurm": {"access": "ssh", "ssh": {"host": "login1"}}}, "existingSecret"),
        ({"slurm": {"access": "ssh", "ssh": {"existingSecret": "tm-ssh"}}}, "host"),
        (
            {"slurm": {"access": "rest", "rest": {"existingSecret": "tm-jwt"}}, "slurmProducer": {"enabled": False}},
            "url",
        ),
        (
            {"slurm": {"access": "rest", "rest": {"url": "https://slurmrestd:6820", "existingSecret": "tm-jwt"}}},
            "enabled",
        ),
        ({"kafka": {"bootstrap": "kafka"}}, "bootstrap"),
        ({"kafka": {"securityProtocol": "tls"}}, "securityProtocol"),
        ({"kafka": {"securityProtocol": "sasl_ssl"}}, "mechanism"),
        ({"kafka": {"securityProtocol": "ssl", "tls": {"existingSecret": "x", "certificateKey": "c"}}}, "keyKey"),
        ({"clickhouse": {"url": "http://ch:8123"}}, "url"),
        ({"clickhouse": {"existingSecret": ""}}, "existingSecret"),
        ({"api": {"tls": {"existingSecret": ""}}}, "insecure"),
        ({"api": {"token": {"existingSecret": ""}}}, "existingSecret"),
        ({"ingest": {"enabled": True}}, "insecure"),
        ({"notifier": {"enabled": True}}, "endpoints"),
        ({"notifier": {**NOTIFIER, "tokenSecret": ""}}, "tokenSecret"),
        (
            {"notifier": {**NOTIFIER, "webhooks": {"endpoints": [{"url": "https://x", "token_file": "/t"}]}}},
            "token_file",
        ),
        ({"notifier": {"egress": {"port": 443}}}, "port"),
        ({"streams": {"replicas": 0}}, "replicas"),
        ({"streams": {"replicas": DEFAULT_PARTITIONS + 1}}, "replicas"),
        ({"streams": {"replicas": 1.5}}, "replicas"),
        ({"executor": {"replicas": 2}}, "replicas"),
        ({"nodeProducers": {"nodeName": {"from": "hostname"}}}, "hostNetwork"),
        ({"nodeProducers": {"gpu": {"source": "rocm"}}}, "source"),
        ({"nodeProducers": {"nodeName": {"map": {"a": ""}}}}, "map"),
        ({"nodeProducers": {"kernel": {"source": "journald"}}}, "source"),
        ({"nodeProducers": {"gpu": {"metricsPort": 0}}}, "metricsPort"),
        ({"nodeProducers": {"agent": {"resetCommand": "nvidia-smi --gpu-reset"}}}, "resetCommand"),
        ({"nodeProducers": {"agent": {"resetAllCommand": "nvidia-smi -r -i {gpu}"}}}, "resetAllCommand"),
        ({"nodeProducers": {"agent": {"idleTimeoutSeconds": 0}}}, "idleTimeoutSeconds"),
        ({"policy": {"mode": "autonomous"}}, "mode"),
        ({"policy": {"actions": {"gpu_hardware": "reboot"}}}, "gpu_hardware"),
        ({"policy": {"min_confidence": 1.5}}, "min_confidence"),
        ({"topics": {"retentionHours": 2}}, "retentionHours"),
        ({"streams": {"command": ["python", "-m", "x"]}}, "command"),
        ({"modee": "monitor"}, "modee"),
    ],
)
def test_values_schema_rejects(chart: Any, values: dict[str, Any], offending: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(chart.merge_values(values))
    assert offending in str(caught.value)
    # `helm template` refuses them too.
    with pytest.raises(helm.HelmError):
        render(chart, values)


@pytest.mark.parametrize("case", sorted(CASES))
def test_values_schema_accepts(chart: Any, case: str) -> None:
    chart.validate_schema(chart.merge_values(CASES[case]))


def test_api_on_loopback_needs_neither_tls_nor_insecure(chart: Any) -> None:
    chart.validate_schema(chart.merge_values({"api": {"host": "127.0.0.1", "tls": {"existingSecret": ""}}}))


# --- helm template + schemas -----------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_manifests_validate_against_their_schemas(chart: Any, case: str) -> None:
    docs = render(chart, CASES[case])
    assert {d["kind"] for d in docs} >= {"ConfigMap", "Deployment", "Job", "ServiceAccount"}
    problems = [f"{d['kind']}/{d['metadata']['name']} {p}" for d in docs for p in validate(d)]
    assert problems == []


def test_everything_renders_every_kind(chart: Any) -> None:
    kinds = {d["kind"] for d in render(chart, EVERYTHING)}
    assert kinds == {
        "ConfigMap",
        "DaemonSet",
        "Deployment",
        "Ingress",
        "Job",
        "NetworkPolicy",
        "Pod",
        "PodDisruptionBudget",
        "PodMonitor",
        "PrometheusRule",
        "Service",
        "ServiceAccount",
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_objects_are_well_formed(chart: Any, case: str) -> None:
    docs = render(chart, CASES[case])
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), names
    for w in workloads(docs):
        spec = pod_spec(w)
        if w["kind"] != "Job":
            assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        volumes = {v["name"] for v in spec["volumes"]}
        assert len(volumes) == len(spec["volumes"]), f"{w['metadata']['name']}: a volume name twice"
        for c in spec["containers"]:
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= volumes, f"{w['metadata']['name']}/{c['name']} mounts {mounts - volumes}, not volumes"
            image = "trainmedic-node" if w["kind"] == "DaemonSet" else "trainmedic"
            assert c["image"] == f"ghcr.io/trainmedic/{image}:{APP_VERSION}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_container_runs_a_contract_command(chart: Any, case: str) -> None:
    for w, c in containers(render(chart, CASES[case])):
        argv = c["command"] + c.get("args", [])
        if c["name"] == "gpu":
            assert argv[:3] in (["trainmedic", "produce", "gpu"], ["trainmedic", "produce", "dcgm"]), argv
        else:
            assert argv[: len(COMMANDS[c["name"]])] == COMMANDS[c["name"]], f"{w['metadata']['name']}: {argv}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_trainmedic_variable_is_a_setting(chart: Any, case: str) -> None:
    """A TRAINMEDIC_* variable the settings model does not know is a typo or a removed setting."""
    for w, c in containers(render(chart, CASES[case])):
        env = env_of(c)
        assert unknown_env({k: "" for k in env}) == [], f"{w['metadata']['name']}/{c['name']}"
        for name in env:
            field = name.removeprefix("TRAINMEDIC_").lower()
            if name.startswith("TRAINMEDIC_") and field not in Settings.model_fields:
                secret = Settings.model_fields[field.removesuffix("_file")]
                assert "SecretStr" in str(secret.annotation), f"{name}: not a secret setting's file"


@pytest.mark.parametrize("case", sorted(CASES))
def test_probes_and_metrics_ports(chart: Any, case: str) -> None:
    """Each long-running container serves its probe listener on all addresses, on a port of its own
    within the pod, and its probes ask that port: liveness /healthz, readiness /readyz."""
    for w in workloads(render(chart, CASES[case])):
        ports: list[int] = []
        for c in pod_spec(w)["containers"]:
            env = env_of(c)
            if w["kind"] == "Job":
                assert "TRAINMEDIC_METRICS_PORT" not in env and "livenessProbe" not in c
                continue
            port = int(env["TRAINMEDIC_METRICS_PORT"])
            assert env["TRAINMEDIC_METRICS_HOST"] == "0.0.0.0"
            (named,) = [p for p in c["ports"] if p["containerPort"] == port]
            assert named["name"].startswith("metrics") and len(named["name"]) <= 15
            assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": named["name"]}
            assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": named["name"]}
            assert c["startupProbe"]["httpGet"]["port"] == named["name"]
            ports += [p["containerPort"] for p in c["ports"]]
        assert len(ports) == len(set(ports)), f"{w['metadata']['name']}: ports {ports}"


# --- what the chart means ----------------------------------------------------------------------


def test_defaults_are_monitor_mode_and_local_slurm(chart: Any) -> None:
    values = chart.values
    assert values["mode"] == "monitor"
    assert values["slurm"]["access"] == "local"
    docs = render(chart)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"] == [
        "tm-trainmedic-api",
        "tm-trainmedic-audit-sink",
        "tm-trainmedic-executor",
        "tm-trainmedic-slurm-producer",
        "tm-trainmedic-streams",
    ]
    assert not [d for d in docs if d["kind"] in ("Ingress", "NetworkPolicy", "PodMonitor", "PrometheusRule")]


def test_singletons_are_recreated_never_doubled(chart: Any) -> None:
    docs = render(chart, EVERYTHING)
    for suffix in ("-executor", "-slurm-producer"):
        d = find(docs, "Deployment", suffix)
        assert d["spec"]["replicas"] == 1 and d["spec"]["strategy"] == {"type": "Recreate"}, suffix


@pytest.mark.parametrize("replicas", [1, 3, DEFAULT_PARTITIONS])
def test_streams_workers_are_one_consumer_group_rolled_one_at_a_time(chart: Any, replicas: int) -> None:
    """streams.replicas workers, one group id; rolled without ever dropping below the count; each
    pod's Faust data dir and working directory on its own emptyDir, its own probe port."""
    docs = render(chart, {"streams": {"replicas": replicas}})
    d = find(docs, "Deployment", "-streams")
    assert d["spec"]["replicas"] == replicas
    assert d["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    c = container(d, "streams")
    env = env_of(c)
    assert env["TRAINMEDIC_STREAMS_ID"] == "tm-trainmedic-streams"  # the group: the same in every pod
    volumes = {v["name"]: v for v in pod_spec(d)["volumes"]}
    (data,) = [m for m in c["volumeMounts"] if env["TRAINMEDIC_STREAMS_DATA_DIR"].startswith(m["mountPath"] + "/")]
    assert volumes[data["name"]] == {"name": data["name"], "emptyDir": {}}, "a shared volume would mix the stores"
    assert not [v for v in volumes.values() if "persistentVolumeClaim" in v or "hostPath" in v]
    assert [p["containerPort"] for p in c["ports"]] == [int(env["TRAINMEDIC_METRICS_PORT"])]
    pdbs = [p for p in docs if p["kind"] == "PodDisruptionBudget" and p["metadata"]["name"].endswith("-streams")]
    if replicas == 1:
        assert pdbs == [], "a budget on one pod would block node drains forever"
    else:
        (pdb,) = pdbs
        assert pdb["spec"]["maxUnavailable"] == 1  # minAvailable replicas - 1
        assert pdb["spec"]["selector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]


def test_streams_replicas_are_bounded_by_the_topics_partitions(chart: Any) -> None:
    """A worker beyond the partition count would hold no partition: the schema's maximum is the
    count the topics Job creates (no --partitions: DEFAULT_PARTITIONS)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    replicas = schema["properties"]["streams"]["properties"]["replicas"]
    assert (replicas["minimum"], replicas["maximum"], replicas["default"]) == (1, DEFAULT_PARTITIONS, 1)
    assert chart.values["streams"]["replicas"] == 1
    topics = container(find(render(chart), "Job", "-topics"), "topics")
    assert "--partitions" not in topics["args"]
    chart.validate_schema(chart.merge_values({"streams": {"replicas": DEFAULT_PARTITIONS}}))


def test_topics_partitions_reach_the_topics_job_and_every_worker_and_bound_the_replicas(chart: Any) -> None:
    """An upgrade over topics an earlier trainmedic made (4 partitions): topics.partitions 4 goes to
    the topics Job and the streams pods as TRAINMEDIC_TOPIC_PARTITIONS, and more workers are refused."""
    docs = render(chart, {"topics": {"partitions": 4}, "streams": {"replicas": 4}})
    for kind, suffix, name in (("Job", "-topics", "topics"), ("Deployment", "-streams", "streams")):
        assert env_of(container(find(docs, kind, suffix), name))["TRAINMEDIC_TOPIC_PARTITIONS"] == "4", suffix
    default = render(chart)
    assert env_of(container(find(default, "Deployment", "-streams"), "streams"))["TRAINMEDIC_TOPIC_PARTITIONS"] == str(
        DEFAULT_PARTITIONS
    )
    with pytest.raises(helm.HelmError, match="more than topics.partitions"):
        render(chart, {"topics": {"partitions": 4}, "streams": {"replicas": 6}})


def test_hook_jobs_create_the_topics_then_migrate(chart: Any) -> None:
    docs = render(chart)
    topics, migrate = find(docs, "Job", "-topics"), find(docs, "Job", "-audit-migrate")
    for job in (topics, migrate):
        assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
        # Hooks run before the release's ServiceAccount exists.
        assert "serviceAccountName" not in pod_spec(job)
        assert pod_spec(job)["restartPolicy"] == "Never"
    weight = {
        j["metadata"]["name"]: int(j["metadata"]["annotations"]["helm.sh/hook-weight"]) for j in (topics, migrate)
    }
    assert weight["tm-trainmedic-topics"] < weight["tm-trainmedic-audit-migrate"]
    assert container(topics, "topics")["args"] == ["topics", "create"]
    no_audit = render(chart, {"api": {"enabled": False}, "auditSink": {"enabled": False}})
    assert not [d for d in no_audit if d["metadata"]["name"].endswith("-audit-migrate")]


def test_daemonset_runs_the_node_producers_on_gpu_nodes(chart: Any) -> None:
    ds = find(render(chart), "DaemonSet", "-node-producers")
    spec = pod_spec(ds)
    assert [c["name"] for c in spec["containers"]] == ["gpu", "kernel"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["runtimeClassName"] == "nvidia"
    assert "hostNetwork" not in spec
    gpu = container(ds, "gpu")
    assert gpu["command"] + gpu["args"] == ["trainmedic", "produce", "gpu"]
    assert env_of(gpu)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env_of(gpu)["TRAINMEDIC_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # Monitoring must not take GPUs away from training jobs.
    assert "nvidia.com/gpu" not in str(gpu["resources"])
    assert gpu["securityContext"]["readOnlyRootFilesystem"] is True
    kernel = container(ds, "kernel")
    assert kernel["args"] == ["produce", "kernel", "--file", "/host/var/log/kern.log"]
    assert kernel["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["DAC_READ_SEARCH"]}
    assert "privileged" not in kernel["securityContext"]
    assert {"name": "host-log", "hostPath": {"path": "/var/log", "type": "Directory"}} in spec["volumes"]


def test_the_node_agent_is_off_by_default_and_runs_as_root_with_sys_admin_only(chart: Any) -> None:
    assert chart.values["nodeProducers"]["agent"]["enabled"] is False
    assert [c["name"] for c in pod_spec(find(render(chart), "DaemonSet", "-node-producers"))["containers"]] == [
        "gpu",
        "kernel",
    ]
    ds = find(render(chart, CASES["node-agent"]), "DaemonSet", "-node-producers")
    spec = pod_spec(ds)
    assert [c["name"] for c in spec["containers"]] == ["gpu", "kernel", "logs", "agent"]
    agent = container(ds, "agent")
    assert agent["command"] + agent["args"] == [
        "trainmedic",
        "run",
        "node-agent",
        "--state-dir",
        "/var/lib/trainmedic-agent",
        "--reset-command",
        "nvidia-smi --gpu-reset -i {gpu}",
        "--reset-all-command",
        "nvidia-smi --gpu-reset",
        "--idle-timeout",
        "1800",
        "--reset-timeout",
        "300",
    ]
    security = agent["securityContext"]
    assert security["runAsUser"] == 0 and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]} and "privileged" not in security
    assert "nvidia.com/gpu" not in str(agent["resources"])  # it must not take a GPU from the jobs
    env = env_of(agent)
    assert env["SLURM_CONF"] == "/etc/slurm/slurm.conf" and env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["TRAINMEDIC_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    volumes = [v["name"] for v in spec["volumes"]]
    assert volumes.count("munge-socket") == volumes.count("slurm-conf") == 1  # shared with the logs container
    state = next(v for v in spec["volumes"] if v["name"] == "agent-state")
    assert state["hostPath"] == {"path": "/var/lib/trainmedic/node-agent", "type": "DirectoryOrCreate"}
    assert {"name": "agent-state", "mountPath": "/var/lib/trainmedic-agent"} in agent["volumeMounts"]
    alone = pod_spec(
        find(render(chart, {"nodeProducers": {"agent": {"enabled": True}}}), "DaemonSet", "-node-producers")
    )
    assert [v["name"] for v in alone["volumes"]].count("munge-socket") == 1
    with pytest.raises(helm.HelmError, match="metricsPort must differ"):
        render(chart, {"nodeProducers": {"agent": {"enabled": True, "metricsPort": 9481}}})


def test_the_node_agents_pod_is_given_the_time_to_finish_a_gpu_reset_it_began(chart: Any) -> None:
    """Stopped during a reset, the agent finishes it (--reset-timeout), checks the GPU answers NVML
    again (its 60 s verify timeout) and publishes the outcome: the pod's grace period covers that
    plus a margin, where Kubernetes' default 30 s would kill nvidia-smi mid-reset."""
    off = pod_spec(find(render(chart), "DaemonSet", "-node-producers"))
    assert "terminationGracePeriodSeconds" not in off  # no agent: the pod as it was
    on = pod_spec(find(render(chart, CASES["node-agent"]), "DaemonSet", "-node-producers"))
    assert on["terminationGracePeriodSeconds"] == 300 + 60 + 60
    longer = find(
        render(chart, {"nodeProducers": {"agent": {"enabled": True, "resetTimeoutSeconds": 900}}}),
        "DaemonSet",
        "-node-producers",
    )
    assert pod_spec(longer)["terminationGracePeriodSeconds"] == 900 + 120
    assert container(longer, "agent")["args"][-2:] == ["--reset-timeout", "900"]
    fraction = find(
        render(chart, {"nodeProducers": {"agent": {"enabled": True, "resetTimeoutSeconds": 90.5}}}),
        "DaemonSet",
        "-node-producers",
    )
    assert pod_spec(fraction)["terminationGracePeriodSeconds"] == 91 + 120  # whole seconds, rounded up
    # A reset timeout the grace period does not know of is refused.
    with pytest.raises(helm.HelmError, match="set resetTimeoutSeconds, not --reset-timeout"):
        render(chart, {"nodeProducers": {"agent": {"enabled": True, "extraArgs": ["--reset-timeout=900"]}}})
    with pytest.raises(helm.HelmError, match="resetTimeoutSeconds"):
        render(chart, {"nodeProducers": {"agent": {"enabled": True, "resetTimeoutSeconds": 0}}})


def test_kernel_from_kmsg_gpu_from_dcgm_logs_from_the_bus(chart: Any) -> None:
    ds = find(render(chart, EVERYTHING), "DaemonSet", "-node-producers")
    spec = pod_spec(ds)
    kernel = container(ds, "kernel")
    assert kernel["args"] == ["produce", "kernel", "--kmsg"]
    assert kernel["securityContext"]["privileged"] is True
    assert {"name": "kmsg", "hostPath": {"path": "/dev/kmsg", "type": "CharDevice"}} in spec["volumes"]
    assert container(ds, "gpu")["args"] == ["produce", "dcgm", "--url", "http://$(HOST_IP):9400/metrics"]
    assert container(ds, "logs")["args"] == ["produce", "logs", "--discover", "--placements", "bus"]
    ib = container(ds, "ib")
    assert ib["args"] == ["produce", "ib", "--interval", "5"]
    assert "privileged" not in ib["securityContext"] and not ib["securityContext"].get("capabilities", {}).get("add")
    # hostname: the node's own name, which needs the host's network namespace.
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    node_map = find(render(chart, EVERYTHING), "ConfigMap", "-node-map")
    assert json.loads(node_map["data"]["node-map.json"]) == {"ip-10-0-3-17.ec2.internal": "gpu017"}
    for c in spec["containers"]:
        env = env_of(c)
        assert "TRAINMEDIC_NODE" not in env
        assert env["TRAINMEDIC_NODE_MAP"] == {
            "configMapKeyRef": {"name": node_map["metadata"]["name"], "key": "node-map.json"}
        }
        assert env["TRAINMEDIC_NODE_STRIP_DOMAIN"] == "true"
    assert not [d for d in render(chart) if d["metadata"]["name"].endswith("-node-map")]


def test_only_the_kernel_reader_runs_as_root(chart: Any) -> None:
    for w in workloads(render(chart, EVERYTHING)):
        assert pod_spec(w)["securityContext"]["runAsNonRoot"] is True
        assert pod_spec(w)["securityContext"]["runAsUser"] == 10001
        for c in pod_spec(w)["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
            if c["name"] == "kernel":
                continue
            assert "runAsUser" not in c["securityContext"], c["name"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]


def test_what_the_processes_write_is_on_writable_volumes(chart: Any) -> None:
    """readOnlyRootFilesystem: the working directory (producer positions), the Faust data dir and the
    API's modes file are under emptyDir (or claim) mounts."""
    for w, c in containers(render(chart, EVERYTHING)):
        volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
        writable = [
            m["mountPath"]
            for m in c["volumeMounts"]
            if not m.get("readOnly") and ({"emptyDir", "persistentVolumeClaim"} & set(volumes[m["name"]]))
        ]
        env = env_of(c)
        for path in (c["workingDir"], env.get("TRAINMEDIC_STREAMS_DATA_DIR"), env.get("TRAINMEDIC_MODES_FILE")):
            if path is not None:
                assert any(path == p or path.startswith(p + "/") for p in writable), (c["name"], path)


def _slurm_workloads(docs: list[Manifest]) -> list[Manifest]:
    suffixes = ("-executor", "-api", "-slurm-producer")
    return [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith(suffixes)]


def test_ssh_access_mounts_the_secret_and_sets_the_login_node(chart: Any) -> None:
    workloads = _slurm_workloads(render(chart, SSH))
    assert len(workloads) == 3  # the Slurm producer too: it polls over SSH
    for w in workloads:
        spec = pod_spec(w)
        (ssh,) = [v for v in spec["volumes"] if v["name"] == "ssh"]
        assert ssh["secret"]["secretName"] == "tm-ssh"
        assert {i["key"] for i in ssh["secret"]["items"]} == {"id_ed25519", "known_hosts"}
        assert not [v for v in spec["volumes"] if "hostPath" in v], "ssh mode must not need the host's munge"
        (c,) = spec["containers"]
        assert {"name": ssh["name"], "mountPath": "/etc/trainmedic/ssh", "readOnly": True} in c["volumeMounts"]
        env = env_of(c)
        assert env["TRAINMEDIC_SLURM_ACCESS"] == "ssh"
        assert (env["TRAINMEDIC_SLURM_SSH_HOST"], env["TRAINMEDIC_SLURM_SSH_PORT"]) == ("login1.example.org", "2222")
        assert env["TRAINMEDIC_SLURM_SSH_KEY"].startswith("/etc/trainmedic/ssh/")
        assert "SLURM_CONF" not in env


def test_rest_access_reads_the_token_from_a_secret_file(chart: Any) -> None:
    for w in _slurm_workloads(render(chart, REST)):
        (c,) = pod_spec(w)["containers"]
        env = env_of(c)
        assert env["TRAINMEDIC_SLURM_ACCESS"] == "rest"
        assert env["TRAINMEDIC_SLURMRESTD_URL"] == "https://slurmrestd.example.org:6820"
        assert "TRAINMEDIC_SLURMRESTD_TOKEN" not in env
        (vol,) = [v for v in pod_spec(w)["volumes"] if v["name"] == "slurmrestd"]
        assert vol["secret"]["secretName"] == "tm-jwt"


def test_local_access_mounts_munge_and_slurm_conf(chart: Any) -> None:
    for w in _slurm_workloads(render(chart)):
        spec = pod_spec(w)
        host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        assert host_paths == {"/run/munge", "/etc/slurm"}
        env = env_of(spec["containers"][0])
        assert env["TRAINMEDIC_SLURM_ACCESS"] == "local"
        assert env["SLURM_CONF"] == "/etc/slurm/slurm.conf"
        assert not [k for k in env if k.startswith("TRAINMEDIC_SLURM_SSH")]


@pytest.mark.parametrize("mode", ["monitor", "autonomous"])
def test_mode_reaches_the_policy_the_worker_loads(chart: Any, mode: str, tmp_path: Path) -> None:
    docs = render(chart, {"mode": mode, "policy": {"partitions": {"canary": {"mode": "autonomous"}}}})
    text = find(docs, "ConfigMap", "-policy")["data"]["policy.yaml"]
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    policy = load_policy(path)  # the streams worker's own loader and validation
    assert policy.mode == mode
    assert policy.mode_for("canary") == "autonomous"
    # The streams worker, the executor and the API read the file where the ConfigMap is mounted.
    for suffix in ("-streams", "-executor", "-api"):
        w = find(docs, "Deployment", suffix)
        (c,) = pod_spec(w)["containers"]
        assert env_of(c)["TRAINMEDIC_POLICY"] == "/etc/trainmedic/policy/policy.yaml"
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/trainmedic/policy")
        assert "subPath" not in mount, "a subPath mount would never see ConfigMap updates"
        (vol,) = [v for v in pod_spec(w)["volumes"] if v["name"] == mount["name"]]
        assert vol["configMap"]["name"] == find(docs, "ConfigMap", "-policy")["metadata"]["name"]


def test_default_policy_values_mirror_the_packaged_default(chart: Any, tmp_path: Path) -> None:
    """Read by the worker's and the executor's own parsers, the default ConfigMap says what the file says."""
    text = find(render(chart), "ConfigMap", "-policy")["data"]["policy.yaml"]
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    assert load_policy(path).model_dump(exclude={"guardrails"}) == load_policy(DEFAULT_POLICY).model_dump(
        exclude={"guardrails"}
    )
    assert parse_guardrails(text, "chart") == parse_guardrails(DEFAULT_POLICY.read_text(), str(DEFAULT_POLICY))


def test_secrets_come_from_existing_secrets_never_from_values(chart: Any) -> None:
    docs = render(chart, EVERYTHING)
    assert not [d for d in docs if d["kind"] == "Secret"], "the chart must not hold secrets"
    for suffix in ("-audit-sink", "-api", "-audit-migrate"):
        w = next(d for d in workloads(docs) if d["metadata"]["name"].endswith(suffix))
        (c,) = pod_spec(w)["containers"]
        env = env_of(c)
        assert "TRAINMEDIC_CLICKHOUSE_URL" not in env
        assert env["TRAINMEDIC_CLICKHOUSE_URL_FILE"] == "/etc/trainmedic/clickhouse/url"
        assert env["TRAINMEDIC_CLICKHOUSE_USER"] == {"secretKeyRef": {"name": "tm-clickhouse", "key": "user"}}
        (vol,) = [v for v in pod_spec(w)["volumes"] if v["name"] == "clickhouse"]
        assert vol["secret"]["secretName"] == "tm-clickhouse"
        assert {i["key"] for i in vol["secret"]["items"]} == {"url", "password"}
    # No secret setting is ever a plain value.
    secret_envs = {
        f"TRAINMEDIC_{n.upper()}" for n, f in Settings.model_fields.items() if "SecretStr" in str(f.annotation)
    }
    for _w, c in containers(docs):
        assert not secret_envs & {e["name"] for e in c["env"] if "value" in e}, c["name"]


def test_kafka_security_maps_onto_the_client_settings(chart: Any) -> None:
    docs = render(chart, KAFKA_SASL_MTLS)
    for w, c in containers(docs):
        env = env_of(c)
        if w["metadata"]["name"].endswith("-audit-migrate"):
            # The migration has no Kafka client (bus/acls.py: migrate): no Kafka security to load.
            assert not [k for k in env if k.startswith("TRAINMEDIC_KAFKA_")]
            assert not [m for m in c["volumeMounts"] if m["mountPath"].startswith("/etc/trainmedic/kafka")]
            continue
        assert env["TRAINMEDIC_KAFKA_SECURITY_PROTOCOL"] == "sasl_ssl"
        files = {
            env[k] for k in ("TRAINMEDIC_KAFKA_SSL_CA", "TRAINMEDIC_KAFKA_SSL_CERTIFICATE", "TRAINMEDIC_KAFKA_SSL_KEY")
        }
        assert files == {"/etc/trainmedic/kafka-tls/" + f for f in ("ca.crt", "client.crt", "client.key")}
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/etc/trainmedic/kafka-tls" in mounts, c["name"]
        assert env["TRAINMEDIC_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
        assert env["TRAINMEDIC_KAFKA_SASL_USERNAME"].startswith(("trainmedic-", "tm-streams-west")), c["name"]
        assert env["TRAINMEDIC_KAFKA_SASL_PASSWORD_FILE"] == "/etc/trainmedic/kafka-sasl/password"
        assert "/etc/trainmedic/kafka-sasl" in mounts, c["name"]
    streams = container(find(docs, "Deployment", "-streams"), "streams")
    assert env_of(streams)["TRAINMEDIC_KAFKA_SASL_USERNAME"] == "tm-streams-west"
    plain = [env_of(c) for _, c in containers(render(chart))]
    assert all(e.get("TRAINMEDIC_KAFKA_SECURITY_PROTOCOL", "plaintext") == "plaintext" for e in plain)
    assert not [k for e in plain for k in e if k.startswith(("TRAINMEDIC_KAFKA_SASL", "TRAINMEDIC_KAFKA_SSL"))]


# Container name (or Deployment/Job suffix) -> the bus/acls.py component it runs as.
ACL_COMPONENT = {
    "gpu": "gpu",
    "ib": "ib",
    "kernel": "kernel",
    "logs": "logs",
    "agent": "node-agent",
    "streams": "streams",
    "executor": "executor",
    "audit-sink": "audit-sink",
    "api": "api",
    "ingest": "ingest",
    "notifier": "notifier",
    "slurm-producer": "slurm-producer",
    "topics": "topics",
}


def test_every_component_connects_as_its_own_principal_with_only_its_own_password(chart: Any) -> None:
    values = copy.deepcopy(EVERYTHING)
    values["nodeProducers"]["agent"] = {"enabled": True}
    del values["kafka"]["sasl"]["credentials"]  # the chart's default credential per component
    docs = render(chart, values)
    seen: dict[str, str] = {}
    for w, c in containers(docs):
        env = env_of(c)
        if "TRAINMEDIC_KAFKA_SASL_USERNAME" not in env:
            assert w["metadata"]["name"].endswith("-audit-migrate"), c["name"]
            continue
        user = env["TRAINMEDIC_KAFKA_SASL_USERNAME"]
        # Every credential of the defaults is the ACL matrix's default principal for that component.
        assert acls.principal(acls.DEFAULT_PRINCIPAL, ACL_COMPONENT[c["name"]]) == f"User:{user}", c["name"]
        (sasl_mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/trainmedic/kafka-sasl"]
        (volume,) = [v for v in pod_spec(w)["volumes"] if v["name"] == sasl_mount["name"]]
        assert volume["secret"]["secretName"] == f"trainmedic-kafka-{ACL_COMPONENT[c['name']]}", c["name"]
        seen[c["name"]] = user
    assert len(set(seen.values())) == len(seen), f"a principal is shared: {seen}"
    assert set(seen) == set(ACL_COMPONENT), set(ACL_COMPONENT) ^ set(seen)
    # The chart's credentials are exactly the matrix's components with Kafka access.
    creds = yaml.safe_load((CHART / "values.yaml").read_text())["kafka"]["sasl"]["credentials"]
    usernames = {f"User:{c['username']}" for c in creds.values()}
    assert usernames == {acls.principal(acls.DEFAULT_PRINCIPAL, c.name) for c in acls.components()}


def test_sasl_without_a_components_credential_is_refused(chart: Any) -> None:
    values = copy.deepcopy(KAFKA_SASL_MTLS)
    values["kafka"]["sasl"]["credentials"]["gpu"] = {"username": "", "existingSecret": ""}
    with pytest.raises(Exception, match="gpu"):
        render(chart, values)


def test_the_site_secret_reaches_the_streams_and_ingest_only(chart: Any) -> None:
    values = {**copy.deepcopy(EVERYTHING), "siteSecret": {"existingSecret": "tm-site", "nodeSigningRequired": True}}
    docs = render(chart, values)
    holders = set()
    for w, c in containers(docs):
        env = env_of(c)
        if "TRAINMEDIC_SITE_SECRET_FILE" in env:
            holders.add(c["name"])
            (vol,) = [v for v in pod_spec(w)["volumes"] if v["name"] == "site-secret"]
            assert vol["secret"]["secretName"] == "tm-site"
            assert "/etc/trainmedic/site-secret" in {m["mountPath"] for m in c["volumeMounts"]}
        assert not any(v.get("name") == "site-secret" for v in pod_spec(w)["volumes"]) or c["name"] in holders
    assert holders == {"streams", "ingest"}
    streams = env_of(container(find(docs, "Deployment", "-streams"), "streams"))
    assert streams["TRAINMEDIC_NODE_SIGNING_REQUIRED"] == "true"
    assert Settings.model_fields["node_signing_required"] and Settings.model_fields["site_secret"]
    assert not [c for _, c in containers(render(chart)) if "TRAINMEDIC_SITE_SECRET_FILE" in env_of(c)]


def test_each_node_signs_with_its_own_key_from_the_node_never_the_site_secret(chart: Any) -> None:
    values = copy.deepcopy(EVERYTHING)
    values["nodeProducers"]["nodeKey"] = {"hostPath": "/etc/trainmedic/node-key"}
    values["siteSecret"] = {"existingSecret": "tm-site"}
    ds = find(render(chart, values), "DaemonSet", "-node-producers")
    (vol,) = [v for v in pod_spec(ds)["volumes"] if v["name"] == "node-key"]
    assert vol == {"name": "node-key", "hostPath": {"path": "/etc/trainmedic/node-key", "type": "File"}}
    for c in pod_spec(ds)["containers"]:
        env = env_of(c)
        assert "TRAINMEDIC_SITE_SECRET_FILE" not in env
        signs = c["name"] in ("gpu", "ib", "kernel")  # the records streams check (bus/identity.py)
        assert ("TRAINMEDIC_NODE_KEY_FILE" in env) == signs, c["name"]
        if signs:
            (m,) = [m for m in c["volumeMounts"] if m["name"] == "node-key"]
            assert m["readOnly"] and m["mountPath"] == env["TRAINMEDIC_NODE_KEY_FILE"]
    assert not any(v.get("secret", {}).get("secretName") == "tm-site" for v in pod_spec(ds)["volumes"])
    unsigned = find(render(chart, EVERYTHING), "DaemonSet", "-node-producers")
    assert not [c for c in pod_spec(unsigned)["containers"] if "TRAINMEDIC_NODE_KEY_FILE" in env_of(c)]


def test_helm_test_pod_probes_readyz_of_every_component(chart: Any) -> None:
    values = copy.deepcopy(EVERYTHING)
    values["nodeProducers"]["agent"] = {"enabled": True}
    docs = render(chart, values)
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["image"] == f"ghcr.io/trainmedic/trainmedic:{APP_VERSION}"  # the server image the chart runs
    assert pod["spec"]["restartPolicy"] == "Never"
    targets = [a.split(" ", 1) for a in c["args"][2:]]
    probed: dict[str, set[str]] = {}
    for component, url in targets:
        m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)/readyz", url)
        assert m, url
        svc = find(docs, "Service", m.group(1))
        (port,) = [p for p in svc["spec"]["ports"] if p["port"] == int(m.group(2))]
        selected = [
            w
            for w in workloads(docs)
            if w["kind"] != "Job"
            and all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())
        ]
        assert len(selected) == 1, (url, [w["metadata"]["name"] for w in selected])
        (w,) = selected
        assert w["metadata"]["labels"]["app.kubernetes.io/component"] == component
        # The Service's target is a named container port whose readiness probe is /readyz.
        (serving,) = [
            ct for ct in pod_spec(w)["containers"] if port["targetPort"] in {p["name"] for p in ct.get("ports", [])}
        ]
        assert serving["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["targetPort"]}
        probed.setdefault(w["metadata"]["name"], set()).add(serving["name"])
    long_running = {w["metadata"]["name"]: {ct["name"] for ct in pod_spec(w)["containers"]} for w in workloads(docs)}
    long_running = {k: v for k, v in long_running.items() if not k.endswith(("-topics", "-audit-migrate"))}
    assert probed == long_running
    off = render(chart, {**values, "helmTest": {"enabled": False}})
    assert not [d for d in off if d["kind"] == "Pod" or d["metadata"]["name"].endswith("-probes")]


def test_api_serves_tls_from_the_secret_or_insecure_only_when_asked(chart: Any) -> None:
    api = container(find(render(chart), "Deployment", "-api"), "api")
    env = env_of(api)
    assert env["TRAINMEDIC_API_LISTEN"] == "0.0.0.0:8477"
    assert (env["TRAINMEDIC_API_TLS_CERT"], env["TRAINMEDIC_API_TLS_KEY"]) == (
        "/etc/trainmedic/api-tls/tls.crt",
        "/etc/trainmedic/api-tls/tls.key",
    )
    assert "TRAINMEDIC_API_INSECURE" not in env
    assert env["TRAINMEDIC_TOKEN_FILE"] == "/etc/trainmedic/api-token/token"
    insecure = env_of(container(find(render(chart, CASES["api-insecure"]), "Deployment", "-api"), "api"))
    assert insecure["TRAINMEDIC_API_INSECURE"] == "true"
    assert "TRAINMEDIC_API_TLS_CERT" not in insecure


def test_services_and_ingress_select_their_pods(chart: Any) -> None:
    docs = render(chart, EVERYTHING)
    for suffix, port in (("-api", "api"), ("-ingest", "ingest")):
        svc = find(docs, "Service", suffix)
        w = find(docs, "Deployment", suffix)
        assert svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        assert svc["spec"]["ports"][0]["targetPort"] == port
        assert port in {p["name"] for p in pod_spec(w)["containers"][0]["ports"]}
    backend = find(docs, "Ingress", "-api")["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "tm-trainmedic-api", "port": {"name": "api"}}


def test_pod_monitors_scrape_every_metrics_port(chart: Any) -> None:
    docs = render(chart, EVERYTHING)
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    long_running = [w for w in workloads(docs) if w["kind"] != "Job"]
    assert set(monitors) == {w["metadata"]["name"] for w in long_running}
    for w in long_running:
        m = monitors[w["metadata"]["name"]]
        assert m["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ports = {p["name"] for c in pod_spec(w)["containers"] for p in c["ports"] if p["name"].startswith("metrics")}
        assert {e["port"] for e in m["spec"]["podMetricsEndpoints"]} == ports


def test_prometheus_rule_carries_the_alerts_file(chart: Any) -> None:
    rule = find(render(chart, EVERYTHING), "PrometheusRule", "tm-trainmedic")
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def test_disruption_budgets_only_for_multi_replica_workloads(chart: Any) -> None:
    assert not [d for d in render(chart) if d["kind"] == "PodDisruptionBudget"]
    docs = render(chart, EVERYTHING)
    pdbs = {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert pdbs == {"tm-trainmedic-api", "tm-trainmedic-audit-sink"}
    docs = render(chart, {**EVERYTHING, "streams": {**EVERYTHING["streams"], "replicas": 3}})
    pdbs = {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert pdbs == {"tm-trainmedic-api", "tm-trainmedic-audit-sink", "tm-trainmedic-streams"}


def test_network_policies_admit_the_services_and_metrics_and_egress_only_to_dependencies(chart: Any) -> None:
    docs = render(chart, EVERYTHING)
    base = find(docs, "NetworkPolicy", "tm-trainmedic")
    assert base["spec"]["policyTypes"] == ["Ingress", "Egress"]
    ingress_ports = {p["port"] for p in base["spec"]["ingress"][0]["ports"]}
    metric_ports = {
        p["name"] for _, c in containers(docs) for p in c.get("ports", []) if p["name"].startswith("metrics")
    }
    assert metric_ports <= ingress_ports
    assert base["spec"]["ingress"][0]["from"] == EVERYTHING["networkPolicy"]["metricsFrom"]
    egress = [p["port"] for rule in base["spec"]["egress"] for p in rule["ports"]]
    assert 53 in egress and 9093 in egress and 8123 in egress and 6817 in egress
    assert base["spec"]["egress"][1]["to"] == [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    for suffix in ("-api", "-ingest"):
        np = find(docs, "NetworkPolicy", suffix)
        assert np["spec"]["ingress"][0]["ports"] == [{"port": suffix[1:], "protocol": "TCP"}]


def test_node_producers_sharing_a_metrics_port_are_refused(chart: Any) -> None:
    with pytest.raises(helm.HelmError, match="metricsPort must differ"):
        render(chart, {"nodeProducers": {"logs": {"enabled": True, "metricsPort": 9481}}})


# --- the webhook notifier (optional) -------------------------------------------------------------


def _notifier_objects(docs: list[Manifest]) -> list[str]:
    return [f"{d['kind']}/{d['metadata']['name']}" for d in docs if d["metadata"]["name"].endswith("-notifier")]


def test_notifier_is_off_by_default_and_renders_nothing(chart: Any) -> None:
    assert chart.values["notifier"]["enabled"] is False
    assert _notifier_objects(render(chart)) == []
    # Nor its PodMonitor and NetworkPolicy when those are on.
    assert _notifier_objects(render(chart, {k: v for k, v in EVERYTHING.items() if k != "notifier"})) == []
    assert _notifier_objects(render(chart, {"notifier": NOTIFIER})) == [
        "ConfigMap/tm-trainmedic-notifier",
        "Deployment/tm-trainmedic-notifier",
    ]


def test_notifier_runs_its_command_on_copies_of_its_yaml_and_tokens(chart: Any, tmp_path: Path) -> None:
    """The container runs `trainmedic run notifier --webhooks` on the memory emptyDir the init
    container fills with 0400 copies of the ConfigMap's YAML and the Secret's token keys (the
    token_files of the endpoints, nothing else); its probes ask the metrics port."""
    docs = render(chart, {"notifier": NOTIFIER})
    d = find(docs, "Deployment", "-notifier")
    spec = pod_spec(d)
    c = container(d, "notifier")
    assert c["command"] + c["args"] == [
        "trainmedic",
        "run",
        "notifier",
        "--webhooks",
        "/etc/trainmedic/notifier/notifier.yaml",
    ]
    env = env_of(c)
    assert (env["TRAINMEDIC_BOOTSTRAP"], env["TRAINMEDIC_CLUSTER"]) == ("kafka:9092", "default")
    assert (env["TRAINMEDIC_METRICS_HOST"], env["TRAINMEDIC_METRICS_PORT"]) == ("0.0.0.0", "9479")
    assert c["ports"] == [{"name": "metrics", "containerPort": 9479, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert {"name": "notifier", "mountPath": "/etc/trainmedic/notifier", "readOnly": True} in c["volumeMounts"]
    assert not {"notifier-config", "notifier-tokens"} & {m["name"] for m in c["volumeMounts"]}, "only the copies"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["notifier"]["emptyDir"]["medium"] == "Memory"
    assert volumes["notifier-config"]["configMap"] == {"name": "tm-trainmedic-notifier"}
    assert volumes["notifier-tokens"]["secret"] == {
        "secretName": "tm-notifier-tokens",
        "defaultMode": 0o440,
        "items": [{"key": "oncall", "path": "oncall"}],
    }
    (init,) = spec["initContainers"]
    assert (init["image"], init["securityContext"]) == (c["image"], c["securityContext"])
    assert init["command"] == [
        "install",
        "-m",
        "0400",
        "-t",
        "/etc/trainmedic/notifier",
        "/etc/trainmedic/notifier-config/notifier.yaml",
        "/etc/trainmedic/notifier-tokens/oncall",
    ]
    mounts = {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in init["volumeMounts"]}
    assert mounts == {
        "notifier": ("/etc/trainmedic/notifier", False),
        "notifier-config": ("/etc/trainmedic/notifier-config", True),
        "notifier-tokens": ("/etc/trainmedic/notifier-tokens", True),
    }
    # The ConfigMap's YAML is what the notifier's own loader accepts, the token beside it 0400.
    text = find(docs, "ConfigMap", "-notifier")["data"]["notifier.yaml"]
    (tmp_path / "notifier.yaml").write_text(text)
    token = tmp_path / "oncall"
    token.write_text("t0ken-0123456789abcdef\n")
    token.chmod(0o400)
    config = load_config(tmp_path / "notifier.yaml")
    assert [(e.label, e.template) for e in config.endpoints] == [("oncall", "generic"), ("slack", "slack")]
    assert config.endpoints[0].token_file == token
    assert (config.retry.attempts, config.retry.max_delay_s, config.max_age_s) == (4, 30, 3600)
    token.chmod(0o440)  # as the kubelet mounts a Secret key under fsGroup: refused, hence the copies
    with pytest.raises(NotifierConfigError, match="0440"):
        load_config(tmp_path / "notifier.yaml")


def test_notifier_without_tokens_mounts_no_secret(chart: Any) -> None:
    d = find(render(chart, CASES["notifier-no-token"]), "Deployment", "-notifier")
    assert "notifier-tokens" not in {v["name"] for v in pod_spec(d)["volumes"]}
    (init,) = pod_spec(d)["initContainers"]
    assert init["command"][-1] == "/etc/trainmedic/notifier-config/notifier.yaml"
    assert "notifier-tokens" not in {m["name"] for m in init["volumeMounts"]}


def test_notifier_rolls_when_its_webhooks_change(chart: Any) -> None:
    def annotations(notifier: dict[str, Any]) -> dict[str, str]:
        d = find(render(chart, {"notifier": notifier, "podAnnotations": {"a": "b"}}), "Deployment", "-notifier")
        found: dict[str, str] = d["spec"]["template"]["metadata"]["annotations"]
        return found

    changed = copy.deepcopy(NOTIFIER)
    changed["webhooks"]["retry"]["attempts"] = 5
    assert annotations(NOTIFIER)["a"] == "b"
    assert annotations(NOTIFIER)["checksum/webhooks"] == annotations(copy.deepcopy(NOTIFIER))["checksum/webhooks"]
    assert annotations(NOTIFIER)["checksum/webhooks"] != annotations(changed)["checksum/webhooks"]


def test_notifier_is_scraped_and_may_reach_its_webhooks(chart: Any) -> None:
    docs = render(chart, EVERYTHING)
    monitor = find(docs, "PodMonitor", "-notifier")
    labels = find(docs, "Deployment", "-notifier")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    egress = find(docs, "NetworkPolicy", "-notifier")
    assert egress["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert egress["spec"]["policyTypes"] == ["Egress"]
    assert egress["spec"]["egress"] == [
        {
            "ports": [{"port": 443, "protocol": "TCP"}, {"port": 8443, "protocol": "TCP"}],
            "to": [{"ipBlock": {"cidr": "192.0.2.0/24"}}],
        }
    ]
