"""The Helm chart infra/helm/trainmedic, rendered and linted by a REAL Helm engine.

The engine is Helm's own Go SDK (v4), loaded in-process by `helm-python-sdk` (a ctypes binding
to libhelm_c, shipped inside its PyPI wheel): `helm.lint` is `helm lint`, `Chart.render` is
`helm template` (values.schema.json is enforced as `helm template` enforces it). Rendered
manifests are checked against the Kubernetes OpenAPI schemas bundled in `kubernetes-validate`
(offline, strict: unknown fields fail) for the oldest Kubernetes the chart supports and the
newest bundled. No cluster is involved.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sinks.guardrails import parse_guardrails
from streams.policy import DEFAULT_POLICY, load_policy

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk (Helm's Go SDK for Python) is not installed: pip install helm-python-sdk"
)
kv = pytest.importorskip(
    "kubernetes_validate.utils", reason="kubernetes-validate is not installed: pip install kubernetes-validate"
)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "infra" / "helm" / "trainmedic"
# The chart's kubeVersion floor (Chart.yaml) and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.25.0", kv.latest_version())

SSH: dict[str, Any] = {
    "slurm": {"access": "ssh", "ssh": {"host": "login1.example.org", "port": 2222, "existingSecret": "tm-ssh"}}
}
EVERYTHING: dict[str, Any] = {
    "mode": "autonomous",
    "console": {"enabled": True},
    "clickhouse": {"url": "https://ch.example.org:8443", "existingSecret": "tm-clickhouse"},
    "imagePullSecrets": [{"name": "regcred"}],
    "podAnnotations": {"example.org/team": "ml-infra"},
    "nodeProducers": {
        "gpu": {"source": "dcgm"},
        "kernel": {"source": "kmsg"},
        "logs": {"enabled": True, "args": ["--glob", "/shared/slurm-logs/*.out"]},
    },
    "streams": {"env": [{"name": "TRAINMEDIC_SETTLE_S", "value": "2"}], "nodeSelector": {"role": "infra"}},
}
# slurm.conf from a ConfigMap instead of the node (no hostPath for it).
SLURM_CONF_FROM_CONFIGMAP: dict[str, Any] = {
    "slurm": {
        "inCluster": {
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
    "inCluster": {},
    "inCluster-configmap": SLURM_CONF_FROM_CONFIGMAP,
    "ssh": SSH,
    "autonomous": {"mode": "autonomous"},
    "ssh-everything": {**EVERYTHING, **SSH},
    "inCluster-everything": EVERYTHING,
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
    return [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]


def lint_problems(report: dict[str, Any]) -> list[str]:
    """Warnings and errors of a lint report (severity 2 and 3; 1 is info such as 'icon is recommended')."""
    return [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2] + list(report["errors"])


# --- helm lint -------------------------------------------------------------------------------


def test_the_engine_is_helms_own_go_sdk() -> None:
    assert helm.helm_sdk_version().startswith(("v3.", "v4.")), helm.helm_sdk_version()


@pytest.mark.parametrize("case", ["inCluster", "ssh", "autonomous", "ssh-everything"])
def test_helm_lint_strict_passes(case: str) -> None:
    report = helm.lint(CHART, CASES[case], strict=True, namespace="trainmedic")
    assert report["total_charts_linted"] == 1
    assert lint_problems(report) == []


def test_helm_lint_reports_a_mode_outside_the_schema() -> None:
    problems = lint_problems(helm.lint(CHART, {"mode": "sometimes"}))
    assert problems, "helm lint accepted mode=sometimes"
    assert any("mode" in p for p in problems), problems


# --- values.schema.json ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "offending"),
    [
        ({"mode": "sometimes"}, "mode"),
        ({"slurm": {"access": "nfs"}}, "access"),
        ({"slurm": {"access": "ssh", "ssh": {"host": "login1"}}}, "existingSecret"),
        ({"slurm": {"access": "ssh", "ssh": {"existingSecret": "tm-ssh"}}}, "host"),
        ({"kafka": {"bootstrap": "kafka"}}, "bootstrap"),
        ({"policy": {"mode": "autonomous"}}, "mode"),
        ({"policy": {"actions": {"gpu_hardware": "reboot"}}}, "gpu_hardware"),
        ({"policy": {"min_confidence": 1.5}}, "min_confidence"),
        ({"nodeProducers": {"kernel": {"source": "journald"}}}, "source"),
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


# --- helm template + Kubernetes schemas --------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_manifests_validate_against_kubernetes_schemas(chart: Any, case: str) -> None:
    docs = render(chart, CASES[case])
    assert {d["kind"] for d in docs} >= {"ConfigMap", "Deployment", "DaemonSet", "ServiceAccount"}
    for version in KUBE_VERSIONS:
        for doc in docs:
            where = f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version})"
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
            except kv.SchemaNotFoundError as exc:
                pytest.fail(f"{where}: {exc.message}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_objects_are_well_formed(chart: Any, case: str) -> None:
    docs = render(chart, CASES[case])
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), names
    for w in workloads(docs):
        spec = pod_spec(w)
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        volumes = {v["name"] for v in spec["volumes"]}
        for c in spec["containers"]:
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= volumes, f"{w['metadata']['name']}/{c['name']} mounts {mounts - volumes}, not volumes"
            assert c["image"] == "ghcr.io/trainmedic/trainmedic:0.1.0"


# --- what the chart means ----------------------------------------------------------------------


def test_defaults_are_monitor_mode_and_in_cluster_slurm(chart: Any) -> None:
    values = chart.values
    assert values["mode"] == "monitor"
    assert values["slurm"]["access"] == "inCluster"


def test_daemonset_runs_the_node_producers_on_gpu_nodes(chart: Any) -> None:
    ds = find(render(chart), "DaemonSet", "-node-producers")
    spec = pod_spec(ds)
    assert [c["name"] for c in spec["containers"]] == ["gpu", "kernel"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["runtimeClassName"] == "nvidia"
    gpu = container(ds, "gpu")
    assert gpu["command"] == ["trainmedic", "produce", "gpu"]
    assert env_of(gpu)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env_of(gpu)["TRAINMEDIC_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # Monitoring must not take GPUs away from training jobs.
    assert "nvidia.com/gpu" not in str(gpu["resources"])
    assert gpu["securityContext"]["readOnlyRootFilesystem"] is True
    kernel = container(ds, "kernel")
    assert kernel["args"] == ["--path", "/host/var/log/kern.log"]
    assert kernel["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["DAC_READ_SEARCH"]}
    assert "privileged" not in kernel["securityContext"]
    assert {"name": "host-log", "hostPath": {"path": "/var/log", "type": "Directory"}} in spec["volumes"]


def test_kernel_from_kmsg_is_privileged_and_gpu_from_dcgm(chart: Any) -> None:
    ds = find(render(chart, EVERYTHING), "DaemonSet", "-node-producers")
    kernel = container(ds, "kernel")
    assert kernel["args"] == ["--path", "/dev/kmsg"]
    assert kernel["securityContext"]["privileged"] is True
    assert {"name": "kmsg", "hostPath": {"path": "/dev/kmsg", "type": "CharDevice"}} in pod_spec(ds)["volumes"]
    assert container(ds, "gpu")["command"][:3] == ["trainmedic", "produce", "dcgm"]
    assert container(ds, "logs")["args"] == ["--glob", "/shared/slurm-logs/*.out"]


def test_only_the_kernel_reader_runs_as_root(chart: Any) -> None:
    for w in workloads(render(chart, EVERYTHING)):
        assert pod_spec(w)["securityContext"]["runAsNonRoot"] is True
        for c in pod_spec(w)["containers"]:
            if c["name"] == "kernel":
                continue
            assert "runAsUser" not in c["securityContext"], c["name"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]


def _slurm_workloads(docs: list[Manifest]) -> list[Manifest]:
    return [find(docs, "Deployment", "-executor"), find(docs, "Deployment", "-slurm-producer")]


def test_ssh_access_mounts_the_secret_and_sets_the_login_node(chart: Any) -> None:
    for w in _slurm_workloads(render(chart, SSH)):
        spec = pod_spec(w)
        (ssh,) = [v for v in spec["volumes"] if "secret" in v]
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


def test_in_cluster_access_mounts_munge_and_slurm_conf_and_no_secret(chart: Any) -> None:
    docs = render(chart)
    assert not [v for w in workloads(docs) for v in pod_spec(w)["volumes"] if "secret" in v]
    for w in _slurm_workloads(docs):
        spec = pod_spec(w)
        host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        assert host_paths == {"/run/munge", "/etc/slurm"}
        env = env_of(spec["containers"][0])
        assert env["TRAINMEDIC_SLURM_ACCESS"] == "inCluster"
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
    # The streams worker and the executor read the file where the ConfigMap is mounted.
    for suffix in ("-streams", "-executor"):
        w = find(docs, "Deployment", suffix)
        (c,) = pod_spec(w)["containers"]
        assert env_of(c)["TRAINMEDIC_POLICY"] == "/etc/trainmedic/policy/policy.yaml"
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/trainmedic/policy")
        assert "subPath" not in mount, "a subPath mount would never see ConfigMap updates"
        (vol,) = [v for v in pod_spec(w)["volumes"] if v["name"] == mount["name"]]
        assert vol["configMap"]["name"] == find(docs, "ConfigMap", "-policy")["metadata"]["name"]


def test_default_policy_values_mirror_infra_policies_default_yaml(chart: Any, tmp_path: Path) -> None:
    """Read by the worker's and the executor's own parsers, the default ConfigMap says what the file says."""
    text = find(render(chart), "ConfigMap", "-policy")["data"]["policy.yaml"]
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    assert load_policy(path).model_dump(exclude={"guardrails"}) == load_policy(DEFAULT_POLICY).model_dump(
        exclude={"guardrails"}
    )
    assert parse_guardrails(text, "chart") == parse_guardrails(DEFAULT_POLICY.read_text(), str(DEFAULT_POLICY))


def test_clickhouse_credentials_come_from_the_existing_secret(chart: Any) -> None:
    audit = container(find(render(chart, EVERYTHING), "Deployment", "-audit"), "audit")
    env = env_of(audit)
    assert env["TRAINMEDIC_CLICKHOUSE_URL"] == "https://ch.example.org:8443"
    assert env["TRAINMEDIC_CLICKHOUSE_PASSWORD"] == {"secretKeyRef": {"name": "tm-clickhouse", "key": "password"}}
    assert not [d for d in render(chart, EVERYTHING) if d["kind"] == "Secret"], "the chart must not hold secrets"


def test_console_service_selects_the_console_pods(chart: Any) -> None:
    docs = render(chart, EVERYTHING)
    svc = find(docs, "Service", "-console")
    pods = find(docs, "Deployment", "-console")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pods.items()
    assert not [d for d in render(chart) if d["metadata"]["name"].endswith("-console")], "console is off by default"


# --- the Kafka probe, run for real --------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the probe reads Linux's /proc/net/tcp")
def test_kafka_probe_is_ready_only_while_connected_to_the_broker_port(chart: Any) -> None:
    with contextlib.closing(socket.socket()) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        streams = find(render(chart, {"kafka": {"bootstrap": f"127.0.0.1:{port}"}}), "Deployment", "-streams")
        (c,) = pod_spec(streams)["containers"]
        assert c["livenessProbe"]["exec"] == c["readinessProbe"]["exec"] == c["startupProbe"]["exec"]
        probe = c["readinessProbe"]["exec"]["command"]

        def probe_ok() -> bool:
            return subprocess.run(probe, check=False, timeout=10).returncode == 0

        assert not probe_ok(), "no connection yet, the probe must fail"
        with socket.create_connection(("127.0.0.1", port)) as client:
            peer, _ = server.accept()
            with peer:
                assert probe_ok(), f"connected to {port}, the probe must pass: {probe}"
            client.close()
        assert not probe_ok(), "connection closed, the probe must fail"


def test_probe_port_follows_broker_port_override(chart: Any) -> None:
    docs = render(chart, {"kafka": {"bootstrap": "b1:9094,b2:9094", "brokerPort": 9092}})
    (c,) = pod_spec(find(docs, "Deployment", "-executor"))["containers"]
    assert ":2384 01 " in c["livenessProbe"]["exec"]["command"][-1]  # 9092 == 0x2384
