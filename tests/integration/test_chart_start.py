"""Start what the Helm chart starts: every container of every rendered Deployment, DaemonSet and
Job, run as its pod would run it, until its readiness endpoint answers (Jobs: until exit 0).

The chart is rendered by Helm's own engine (as in test_helm.py) with the default values plus the
options that enable every workload (ingest with TLS, the logs producer, the notifier with a
token endpoint; the dcgm variant of the GPU producer in its own render). For each container the
harness takes the rendered command and args, and the rendered env with Kubernetes' own rules
($(VAR) expansion, valueFrom fieldRef / secretKeyRef / configMapKeyRef); it materialises every
volume the container mounts (Secrets from test values with the mode the kubelet gives them -
defaultMode or the item's mode, plus group read under the pod's fsGroup -, the rendered
ConfigMaps, emptyDirs, hostPaths the test provides) under tmp_path and rewrites the paths the
env and args name inside those mounts; the pod's init containers run first, in order, on the
same volumes, and must exit 0 (several replicas, the streams workers' group, start as that many
copies, each with its own mounts).
Only what the test machine forces is overridden, each said where it happens: the bootstrap (the
test's broker), the metrics address (127.0.0.1 and a free port: the chart's 0.0.0.0 and fixed
ports are checked first), the service ports (free ports), the ClickHouse URL (a chDB folder per
component: one process owns a chDB folder). `trainmedic` is this venv's entry point, as in the
image.

A chart that names a missing command, option or setting fails here: the process exits (usage
error) or never gets ready, and a TRAINMEDIC_* variable that no setting has fails before start
(the settings model ignores unknown variables; `trainmedic config show` lists them).
"""

from __future__ import annotations

import contextlib
import copy
import http.server
import os
import re
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from bus import acls
from bus.publish import Publisher
from schemas.codec import decode
from schemas.events import Evidence, Incident, KernelEvent
from schemas.topics import DEFAULT_PARTITIONS, INCIDENTS, JOB_LOGS
from sinks.notifier import NotifierConfigError, read_token
from tests.conftest import FIXTURES, Cluster, read_topic
from tests.launch import probe, self_signed_certificate, start, stop, wait_ready
from trainmedic.settings import unknown_env
from trainmedic.stack.broker import EmbeddedBroker, free_port

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk (Helm's Go SDK for Python) is not installed: pip install helm-python-sdk"
)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "infra" / "helm" / "trainmedic"
TRAINMEDIC = Path(sys.executable).with_name("trainmedic")  # the image's entrypoint
DCGM_EXPOSITION = FIXTURES / "dcgm" / "dcgm_exporter_metrics.prom"
NODE = "gpu01"  # spec.nodeName: a node of the local Slurm cluster (infra/slurm)
READY_TIMEOUT = 180.0
XID_LINE = (
    "Dec  2 05:00:01 gpu01 kernel: [ 5012.345678] NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus."
)

NOTIFIER_TOKEN = "n0t1f1er-hook-token-0123456789abcdef"


def notifier_values(url: str) -> dict[str, Any]:
    """The notifier on, with one endpoint at `url` whose bearer token is a key of its Secret."""
    return {
        "enabled": True,
        "webhooks": {
            "endpoints": [{"name": "receiver", "url": url, "token_file": "receiver"}],
            "retry": {"attempts": 3, "base_delay_s": 0.1, "max_delay_s": 0.5},
        },
        "tokenSecret": "trainmedic-notifier-tokens",
    }


# Default values plus what turns on every workload.
VALUES: dict[str, Any] = {
    "ingest": {"enabled": True, "tls": {"existingSecret": "trainmedic-ingest-tls"}},
    "nodeProducers": {"logs": {"enabled": True}, "agent": {"enabled": True}},
    # Plain http to loopback is allowed without `insecure`; nothing listens there: no event is
    # published in the generic start (test_notifier_delivers_... gives it a receiver).
    "notifier": notifier_values("http://127.0.0.1:9/hook"),
}
# The components whose start needs Slurm (slurm.access=local, against the local cluster).
NEEDS_SLURM = {
    "slurm-producer/slurm-producer",
    "node-producers/logs",
    "node-producers/agent",
    "executor/executor",
    "api/api",
}

Manifest = dict[str, Any]


def render(values: dict[str, Any]) -> list[Manifest]:
    with helm.Chart.load(CHART) as chart:
        files: dict[str, str] = chart.render(values, name="tm", namespace="trainmedic")
    return [d for name, text in sorted(files.items()) if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


@dataclass(frozen=True)
class Target:
    """One container of one rendered workload."""

    kind: str
    workload: str  # component label
    container: dict[str, Any]
    volumes: dict[str, dict[str, Any]]
    docs: list[Manifest] = field(repr=False)
    init_containers: list[dict[str, Any]] = field(default_factory=list, repr=False)
    pod_security: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def id(self) -> str:
        return f"{self.workload}/{self.container['name']}"


def targets(docs: list[Manifest]) -> dict[str, Target]:
    out: dict[str, Target] = {}
    for d in docs:
        if d["kind"] not in ("Deployment", "DaemonSet", "Job"):
            continue
        spec = d["spec"]["template"]["spec"]
        component = d["metadata"]["labels"]["app.kubernetes.io/component"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            t = Target(
                d["kind"],
                component,
                c,
                volumes,
                docs,
                spec.get("initContainers", []),
                spec.get("securityContext", {}),
            )
            out[t.id] = t
    return out


DOCS = render(VALUES)
TARGETS = targets(DOCS)


# --- test values for what the chart takes from outside -----------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (the API's and ingest's TLS Secrets)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = self_signed_certificate(tmp_path_factory.mktemp("tls"))
    return cert.read_text(), key.read_text()


OPERATOR_TOKEN = "o" * 32
INGEST_TOKEN = "i" * 32


@dataclass
class Pod:
    """What the test lends a container: Secret values, hostPaths, the node's identity."""

    tmp: Path
    certificate: tuple[str, str]
    chdb: Path  # this component's chDB folder
    host_paths: dict[str, Path] = field(default_factory=dict)

    def secret(self, name: str, key: str) -> str:
        table = {
            ("trainmedic-clickhouse", "url"): f"chdb://{self.chdb}",
            ("trainmedic-api-token", "token"): OPERATOR_TOKEN,
            ("trainmedic-ingest-token", "token"): INGEST_TOKEN,
            ("trainmedic-api-tls", "tls.crt"): self.certificate[0],
            ("trainmedic-api-tls", "tls.key"): self.certificate[1],
            ("trainmedic-ingest-tls", "tls.crt"): self.certificate[0],
            ("trainmedic-ingest-tls", "tls.key"): self.certificate[1],
            ("trainmedic-notifier-tokens", "receiver"): NOTIFIER_TOKEN,
            # KAFKA_SASL_MTLS below: each component's own password (kafka.sasl.credentials).
            **{(f"trainmedic-kafka-{c.name}", "password"): f"kafka-password-{c.name}" for c in acls.components()},
            ("tm-kafka-tls", "ca.crt"): self.certificate[0],
            ("tm-kafka-tls", "tls.crt"): self.certificate[0],
            ("tm-kafka-tls", "tls.key"): self.certificate[1],
        }
        if (name, key) not in table:
            pytest.fail(f"the chart reads Secret {name} key {key}: the test has no value for it (a new Secret?)")
        return table[(name, key)]


FIELD_REFS = {"spec.nodeName": NODE, "status.hostIP": "127.0.0.1", "metadata.namespace": "trainmedic"}
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values: defined names only, $$ escapes."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _configmap(docs: list[Manifest], name: str) -> dict[str, str]:
    found = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
    if not found:
        pytest.fail(f"the chart mounts ConfigMap {name}, which it does not render")
    data: dict[str, str] = found[0]["data"]
    return data


@dataclass
class Init:
    """An init container as this machine runs it: before the container, on the same volumes."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path


@dataclass
class Prepared:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    ready_url: str
    ports: dict[str, int]  # service port name -> the free port given instead
    mounts: dict[str, Path]
    init: list[Init] = field(default_factory=list)


def _secret_mode(t: Target, secret: dict[str, Any], item: dict[str, Any]) -> int:
    """The mode the kubelet gives a Secret key's file: the item's mode, else defaultMode (0644 by
    the API's default); under the pod's fsGroup, group read is added whatever they say
    (kubernetes/kubernetes#57923)."""
    mode = int(item.get("mode", secret.get("defaultMode", 0o644)))
    if t.pod_security.get("fsGroup") is not None:
        mode |= 0o440
    return mode


def _mounts(t: Target, c: dict[str, Any], pod: Pod) -> dict[str, Path]:
    """Container c's volume mounts (mount path -> local folder), materialised; a volume is one
    local folder per pod, whichever of its containers mounts it."""
    mounts: dict[str, Path] = {}
    for m in c.get("volumeMounts", []):
        vol = t.volumes[m["name"]]
        local = pod.tmp / "mounts" / m["name"]
        if "emptyDir" in vol or "persistentVolumeClaim" in vol:
            local.mkdir(parents=True, exist_ok=True)
        elif "secret" in vol:
            name = vol["secret"]["secretName"]
            assert vol["secret"].get("items"), f"{t.id}: Secret {name} mounted whole: name the keys it needs"
            for item in vol["secret"]["items"]:
                (local / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                (local / item["path"]).unlink(missing_ok=True)
                (local / item["path"]).write_text(pod.secret(name, item["key"]) + "\n")
                (local / item["path"]).chmod(_secret_mode(t, vol["secret"], item))
        elif "configMap" in vol:
            local.mkdir(parents=True, exist_ok=True)
            for key, text in _configmap(t.docs, vol["configMap"]["name"]).items():
                (local / key).write_text(text)
        elif "hostPath" in vol:
            path = vol["hostPath"]["path"]
            if path not in pod.host_paths:
                pytest.fail(f"{t.id} mounts the host's {path}: the test provides no stand-in for it")
            local = pod.host_paths[path]
        else:
            pytest.fail(f"{t.id}: volume {m['name']} of a kind the harness does not know: {vol}")
        mounts[m["mountPath"]] = local
    return mounts


def _localiser(mounts: dict[str, Path]) -> Callable[[str], str]:
    def localise(value: str) -> str:
        for mount_path in sorted(mounts, key=len, reverse=True):
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                return str(mounts[mount_path]) + value[len(mount_path) :]
        return value

    return localise


def _init(t: Target, c: dict[str, Any], pod: Pod) -> Init:
    """An init container: its command from the image (found on this machine's PATH), its mounts
    and plain env values localised."""
    mounts = _mounts(t, c, pod)
    localise = _localiser(mounts)
    env: dict[str, str] = {}
    for e in c.get("env", []):
        assert "value" in e, f"{t.id}: init container {c['name']}: env {e['name']} from a source the harness lacks"
        env[e["name"]] = localise(expand(str(e["value"]), env))
    argv = [localise(expand(a, env)) for a in c["command"] + c.get("args", [])]
    found = shutil.which(argv[0])
    assert found, f"{t.id}: init container {c['name']} runs {argv[0]}, which this machine lacks"
    env.update(PATH=os.environ.get("PATH", "/usr/bin:/bin"), LC_ALL="C.UTF-8")
    cwd = Path(localise(c["workingDir"])) if "workingDir" in c else pod.tmp
    return Init(c["name"], [found, *argv[1:]], env, cwd)


def run_init(p: Prepared, log: Path) -> None:
    """The pod's init containers, in order: each must exit 0 before the containers start."""
    for i in p.init:
        done = subprocess.run(i.argv, env=i.env, cwd=i.cwd, capture_output=True, text=True, timeout=60)
        log.with_name(f"{log.stem}-init-{i.name}.log").write_text(done.stdout + done.stderr)
        assert done.returncode == 0, f"init container {i.name} exited {done.returncode}: {done.stderr}"


def prepare(t: Target, pod: Pod, bootstrap: str) -> Prepared:
    """The container's argv, env and working directory on this machine (see the module docstring)."""
    c = t.container
    mounts = _mounts(t, c, pod)
    localise = _localiser(mounts)
    init = [_init(t, ic, pod) for ic in t.init_containers]

    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            value = expand(str(e["value"]), env)
        else:
            ref = e["valueFrom"]
            if "fieldRef" in ref:
                value = FIELD_REFS[ref["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in ref:
                value = pod.secret(ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
            elif "configMapKeyRef" in ref:
                value = _configmap(t.docs, ref["configMapKeyRef"]["name"])[ref["configMapKeyRef"]["key"]]
            else:
                pytest.fail(f"{t.id}: env {e['name']} from {ref}: not a source the harness resolves")
        env[e["name"]] = localise(value)
    unknown = unknown_env(env)
    assert not unknown, f"{t.id}: the chart sets TRAINMEDIC_* variables no setting has: {unknown}"

    argv = [expand(a, env) for a in c["command"] + c.get("args", [])]
    assert argv[0] == "trainmedic", f"{t.id}: the image's entrypoint is trainmedic, not {argv[0]}"
    argv = [str(TRAINMEDIC)] + [localise(a) for a in argv[1:]]

    # The machine's overrides.
    ports: dict[str, int] = {}
    ready_url = ""
    if "TRAINMEDIC_METRICS_PORT" in env:
        assert env["TRAINMEDIC_METRICS_HOST"] == "0.0.0.0", f"{t.id}: probes must listen on the pod's address"
        (metrics,) = [p for p in c["ports"] if p["containerPort"] == int(env["TRAINMEDIC_METRICS_PORT"])]
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": metrics["name"]}
        port = free_port()
        env["TRAINMEDIC_METRICS_HOST"], env["TRAINMEDIC_METRICS_PORT"] = "127.0.0.1", str(port)
        ready_url = f"http://127.0.0.1:{port}/readyz"
    for p in c.get("ports", []):
        if p["name"].startswith("metrics"):
            continue
        ports[p["name"]] = free_port()
        if env.get("TRAINMEDIC_API_LISTEN", "").endswith(f":{p['containerPort']}"):
            env["TRAINMEDIC_API_LISTEN"] = env["TRAINMEDIC_API_LISTEN"].rsplit(":", 1)[0] + f":{ports[p['name']]}"
        elif "--port" in argv and argv[argv.index("--port") + 1] == str(p["containerPort"]):
            argv[argv.index("--port") + 1] = str(ports[p["name"]])
        else:
            pytest.fail(f"{t.id}: port {p['name']} ({p['containerPort']}) is not what the process is told to serve")
    assert env["TRAINMEDIC_BOOTSTRAP"] == "kafka:9092"
    env["TRAINMEDIC_BOOTSTRAP"] = bootstrap
    env.update(
        PATH=os.environ.get("PATH", "/usr/bin:/bin"),
        # The image's user has its home in the working directory (Containerfile: useradd --home-dir).
        HOME=localise("/var/lib/trainmedic"),
        LC_ALL="C.UTF-8",
        TMPDIR=str(mounts.get("/tmp", pod.tmp)),
    )
    cwd = Path(localise(c["workingDir"]))
    assert cwd != Path(c["workingDir"]), f"{t.id}: its working directory {c['workingDir']} is not a mounted volume"
    return Prepared(argv, env, cwd, ready_url, ports, mounts, init)


def run_job(p: Prepared, log: Path, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    run_init(p, log)
    proc = subprocess.run(p.argv, env=p.env, cwd=p.cwd, capture_output=True, text=True, timeout=timeout)
    log.write_text(proc.stdout + proc.stderr)
    return proc


@contextlib.contextmanager
def running(p: Prepared, log: Path) -> Iterator[dict[str, object]]:
    """Started, ready (its own /readyz says 200) for the body, then stopped with SIGTERM: exit 0."""
    run_init(p, log)
    launched = start(p.argv, p.env, log, cwd=p.cwd)
    try:
        ready = wait_ready(launched, p.ready_url, READY_TIMEOUT)
        status, live = probe(p.ready_url.replace("/readyz", "/healthz"))
        assert status == 200 and live and live["live"], f"ready but not live: {live}"
        with urllib.request.urlopen(p.ready_url.replace("/readyz", "/metrics"), timeout=10) as resp:
            assert "trainmedic_build_info{" in resp.read().decode()  # what the PodMonitor scrapes
        yield ready
    finally:
        code = stop(launched)
    assert code == 0, f"{' '.join(p.argv)} exited {code} on SIGTERM:\n{launched.output()}"


# --- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture
def pod(tmp_path: Path, certificate: tuple[str, str]) -> Pod:
    logs = tmp_path / "job-logs"
    logs.mkdir()
    host_log = tmp_path / "host-var-log"
    host_log.mkdir()
    (host_log / "kern.log").write_text(XID_LINE + "\n")
    empty = tmp_path / "host-empty"
    empty.mkdir()
    return Pod(
        tmp_path,
        certificate,
        chdb=tmp_path / "chdb",
        host_paths={
            "/var/log": host_log,
            "/shared/slurm-logs": logs,
            "/run/munge": empty,
            "/etc/slurm": empty,
            "/var/lib/trainmedic/node-agent": tmp_path / "host-node-agent",
        },
    )


def _slurm(request: pytest.FixtureRequest, pod: Pod) -> None:
    """The host's /etc/slurm is the local cluster's configuration folder (its munge socket is in it)."""
    cluster: Cluster = request.getfixturevalue("slurm_cluster")
    conf = Path(cluster.slurm_conf)
    assert conf.name == "slurm.conf"
    pod.host_paths["/etc/slurm"] = conf.parent


def _migrated(pod: Pod, bootstrap: str, component: str) -> None:
    """The audit migration Job, as rendered, on this component's chDB folder (the hook runs first)."""
    pod.chdb = pod.tmp / "chdb" / component
    job = prepare(TARGETS["audit-migrate/audit-migrate"], _subpod(pod, "migrate"), bootstrap)
    done = run_job(job, pod.tmp / "migrate.log")
    assert done.returncode == 0, done.stdout + done.stderr


def _subpod(pod: Pod, name: str) -> Pod:
    return Pod(pod.tmp / name, pod.certificate, pod.chdb, pod.host_paths)


# --- the tests -------------------------------------------------------------------------------------------

# The GPU producer and the node agent need NVML: started by their own tests below.
NEEDS_NVML = {"node-producers/gpu", "node-producers/agent"}
LONG_RUNNING = sorted(i for i, t in TARGETS.items() if t.kind != "Job" and i not in NEEDS_NVML)
# Marked, so `-m "not slurm"` leaves them out where no local Slurm cluster can run.
LONG_RUNNING_PARAMS = [pytest.param(i, marks=[pytest.mark.slurm] if i in NEEDS_SLURM else []) for i in LONG_RUNNING]


def test_every_rendered_container_is_started_here() -> None:
    """Every workload the chart can render is in this file: a new one must be started too."""
    assert set(TARGETS) == {
        "topics/topics",
        "audit-migrate/audit-migrate",
        "streams/streams",
        "executor/executor",
        "audit-sink/audit-sink",
        "api/api",
        "ingest/ingest",
        "notifier/notifier",
        "slurm-producer/slurm-producer",
        "node-producers/gpu",
        "node-producers/kernel",
        "node-producers/logs",
        "node-producers/agent",
    }
    assert set(LONG_RUNNING) | NEEDS_NVML >= NEEDS_SLURM


def test_topics_job_creates_every_topic_mode_changes_included(pod: Pod) -> None:
    bare = EmbeddedBroker().start()  # no topics: the Job makes them
    try:
        p = prepare(TARGETS["topics/topics"], pod, bare.bootstrap)
        done = run_job(p, pod.tmp / "topics.log")
        assert done.returncode == 0, done.stdout + done.stderr
        from confluent_kafka.admin import AdminClient

        from schemas.topics import ALL_TOPICS

        topics = AdminClient({"bootstrap.servers": bare.bootstrap}).list_topics(timeout=10).topics
        assert "mode.changes" in topics, "without mode.changes every worker stays in monitor mode"
        assert {t.name for t in ALL_TOPICS} <= set(topics)
        again = run_job(p, pod.tmp / "topics-again.log")  # pre-upgrade runs it again
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        bare.stop(grace_s=0)


def test_audit_migrate_job_exits_zero_and_again(pod: Pod, broker: EmbeddedBroker) -> None:
    for _ in range(2):  # pre-install, then pre-upgrade
        _migrated(pod, broker.bootstrap, "audit")
    assert (pod.tmp / "chdb" / "audit").is_dir()


@pytest.mark.parametrize("target", LONG_RUNNING_PARAMS)
def test_workload_starts_until_ready(
    target: str, pod: Pod, broker: EmbeddedBroker, request: pytest.FixtureRequest
) -> None:
    t = TARGETS[target]
    if target in NEEDS_SLURM:
        _slurm(request, pod)
    if target in ("audit-sink/audit-sink", "api/api", "executor/executor"):
        _migrated(pod, broker.bootstrap, t.workload)
    p = prepare(t, pod, broker.bootstrap)
    log = pod.tmp / f"{t.workload}-{t.container['name']}.log"
    with running(p, log) as ready:
        assert ready["ready"] is True
        if target == "api/api":
            _api_answers_over_tls(p, pod)
        elif target == "ingest/ingest":
            _ingest_answers_over_tls(p, pod)
        elif target == "node-producers/kernel":
            _kernel_line_published(broker.bootstrap)
        elif target == "executor/executor":
            # The audit from the chart's ClickHouse Secret: the automatic return to service's loop
            # runs beside the executor (off in the default policy, and said so).
            assert "auto-return" in ready["loops"], ready  # type: ignore[operator]


def test_node_agent_starts_until_ready_on_its_nodes_nvml(
    pod: Pod, broker: EmbeddedBroker, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The agent container as rendered (root, SYS_ADMIN, its state hostPath, the node's Slurm),
    with NVML answered by the fake pynvml module in its process (tests/fakes/nvml_site)."""
    _slurm(request, pod)
    p = prepare(TARGETS["node-producers/agent"], pod, broker.bootstrap)
    assert p.argv[1:3] == ["run", "node-agent"]
    nvml = tmp_path / "nvml.json"
    nvml.write_text('{"gpus": 8}')
    p.env |= {"PYTHONPATH": f"{REPO / 'tests' / 'fakes' / 'nvml_site'}:{REPO}", "TRAINMEDIC_FAKE_NVML": str(nvml)}
    with running(p, pod.tmp / "agent.log") as ready:
        assert ready["ready"] is True, ready


_ASSIGNED = re.compile(r"Setting newly assigned partitions(.*?) for group ", re.S)


def _assigned(log: Path, topic: str) -> set[int]:
    """The partitions of `topic` in the worker's latest assignment, as Faust logs it (a table of
    `| topic | {0-1,3} |` rows); empty before its first."""
    tables = _ASSIGNED.findall(log.read_text(errors="replace"))
    out: set[int] = set()
    if not tables:
        return out
    for row in re.findall(rf"^\|\s*{re.escape(topic)}\s*\|\s*\{{([0-9,\- ]*)\}}", tables[-1], re.M):
        for part in row.replace(" ", "").split(","):
            low, _, high = part.partition("-")
            out |= set(range(int(low), int(high or low) + 1))
    return out


STREAMS_GROUP = 2  # streams.replicas of the consumer-group start below


def test_streams_replicas_start_as_one_consumer_group(pod: Pod, broker: EmbeddedBroker) -> None:
    """streams.replicas=2: as many copies of the rendered worker as the Deployment asks, each with
    its own emptyDirs (a pod's own Faust data dir) and its own probe port (in the cluster the same
    port in each pod's own network namespace); the second joins the first's group, both are
    ready once the group has rebalanced, and they split the input topics' partitions."""
    values = copy.deepcopy(VALUES)
    values["streams"] = {"replicas": STREAMS_GROUP}
    docs = render(values)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-streams")]
    replicas = deployment["spec"]["replicas"]
    assert replicas == STREAMS_GROUP
    t = targets(docs)["streams/streams"]
    copies = [prepare(t, _subpod(pod, f"streams-{i}"), broker.bootstrap) for i in range(replicas)]
    assert len({p.env["TRAINMEDIC_STREAMS_ID"] for p in copies}) == 1, "one group id in every pod"
    assert len({p.env["TRAINMEDIC_STREAMS_DATA_DIR"] for p in copies}) == replicas, "a data dir per pod"
    assert len({p.ready_url for p in copies}) == replicas
    with contextlib.ExitStack() as stack:
        for i, p in enumerate(copies):
            ready = stack.enter_context(running(p, pod.tmp / f"streams-{i}.log"))
            assert ready["ready"] is True
        for p in copies:  # the first is still ready after the second's join
            status, body = probe(p.ready_url)
            assert status == 200 and body and body["ready"], (p.ready_url, body)
        # One group: the input topics' partitions are split between the workers, none twice.
        logs = [pod.tmp / f"streams-{i}.log" for i in range(replicas)]
        deadline = time.monotonic() + 30
        while True:
            assigned = [_assigned(log, JOB_LOGS.name) for log in logs]
            if all(assigned) and sorted(n for a in assigned for n in a) == list(range(DEFAULT_PARTITIONS)):
                break
            assert time.monotonic() < deadline, f"{JOB_LOGS.name} partitions not split between the workers: {assigned}"
            time.sleep(0.5)


def _tls(pod: Pod) -> ssl.SSLContext:
    ca = pod.tmp / "ca.pem"
    ca.write_text(pod.certificate[0])
    return ssl.create_default_context(cafile=str(ca))


def _api_answers_over_tls(p: Prepared, pod: Pod) -> None:
    req = urllib.request.Request(
        f"https://127.0.0.1:{p.ports['api']}/api/recommendations", headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    )
    with urllib.request.urlopen(req, context=_tls(pod), timeout=10) as resp:
        assert resp.status == 200


def _ingest_answers_over_tls(p: Prepared, pod: Pod) -> None:
    with urllib.request.urlopen(f"https://127.0.0.1:{p.ports['ingest']}/healthz", context=_tls(pod), timeout=10) as r:
        assert r.status == 200


def _kernel_line_published(bootstrap: str, node: str = NODE) -> None:
    """The file from the hostPath was read, and the event names the node the downward API gave."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        events = [decode(KernelEvent, v) for v in read_topic(bootstrap, "node.kernel", seconds=2.0)]
        if events:
            assert {e.node for e in events} == {node}, events
            assert [e.xid for e in events] == [79], events
            return
    pytest.fail("the kernel producer published nothing from kern.log within 60 s")


def test_node_name_from_the_hosts_own_name(pod: Pod, broker: EmbeddedBroker) -> None:
    """nodeName.from=hostname (with hostNetwork): no TRAINMEDIC_NODE, the producer names the host."""
    values = copy.deepcopy(VALUES)
    values["nodeProducers"] |= {"hostNetwork": True, "nodeName": {"from": "hostname"}}
    t = targets(render(values))["node-producers/kernel"]
    p = prepare(t, pod, broker.bootstrap)
    assert "TRAINMEDIC_NODE" not in p.env
    with running(p, pod.tmp / "kernel.log"):
        _kernel_line_published(broker.bootstrap, node=socket.gethostname())


def test_node_name_mapped_onto_the_slurm_name(pod: Pod, broker: EmbeddedBroker) -> None:
    """nodeName.map (the node-map ConfigMap -> TRAINMEDIC_NODE_MAP): the Kubernetes name gpu01
    is reported as the Slurm NodeName the map gives."""
    values = copy.deepcopy(VALUES)
    values["nodeProducers"] |= {"nodeName": {"from": "kubernetes", "map": {NODE: "gpu04"}}}
    t = targets(render(values))["node-producers/kernel"]
    p = prepare(t, pod, broker.bootstrap)
    assert p.env["TRAINMEDIC_NODE"] == NODE and p.env["TRAINMEDIC_NODE_MAP"] == '{"gpu01":"gpu04"}'
    with running(p, pod.tmp / "kernel.log"):
        _kernel_line_published(broker.bootstrap, node="gpu04")


def test_gpu_producer_without_a_gpu_exits_naming_nvml(pod: Pod, broker: EmbeddedBroker) -> None:
    """No GPU here: `produce gpu` must stop with NVML's reason, not a usage error of the chart's
    command line (a missing option or command would say `No such option` / `Usage:`)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - any NVML failure means: no GPU to read here
        pass
    else:
        pynvml.nvmlShutdown()
        p = prepare(TARGETS["node-producers/gpu"], pod, broker.bootstrap)
        with running(p, pod.tmp / "gpu.log"):
            return
    p = prepare(TARGETS["node-producers/gpu"], pod, broker.bootstrap)
    assert p.argv[1:] == ["produce", "gpu"]
    done = run_job(p, pod.tmp / "gpu.log", timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "NVML" in out, out
    assert "No such option" not in out and "Usage:" not in out and "No such command" not in out, out


class _Exporter(http.server.BaseHTTPRequestHandler):
    body = DCGM_EXPOSITION.read_bytes()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass


@pytest.fixture
def dcgm_exporter() -> Iterator[int]:
    """A stand-in dcgm-exporter on 127.0.0.1 (the node's IP in the test) serving a captured exposition."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def test_dcgm_variant_scrapes_the_nodes_exporter_until_ready(
    pod: Pod, broker: EmbeddedBroker, dcgm_exporter: int
) -> None:
    values = copy.deepcopy(VALUES)
    # The chart's default URL with the stand-in's port: $(HOST_IP) is still expanded from the downward API.
    values["nodeProducers"]["gpu"] = {"source": "dcgm", "dcgm": {"url": f"http://$(HOST_IP):{dcgm_exporter}/metrics"}}
    t = targets(render(values))["node-producers/gpu"]
    p = prepare(t, pod, broker.bootstrap)
    assert p.argv[1:] == ["produce", "dcgm", "--url", f"http://127.0.0.1:{dcgm_exporter}/metrics"]
    with running(p, pod.tmp / "dcgm.log") as ready:
        assert ready["ready"] is True


def test_the_harness_refuses_a_variable_no_setting_has(pod: Pod, broker: EmbeddedBroker) -> None:
    """The processes ignore an unknown TRAINMEDIC_* variable (`config show` lists it): this file
    must fail on one instead of starting the container."""
    values = copy.deepcopy(VALUES)
    values["streams"] = {"env": [{"name": "TRAINMEDIC_STREAMS_DATADIR", "value": "/var/lib/trainmedic/x"}]}
    t = targets(render(values))["streams/streams"]
    with pytest.raises(AssertionError, match="TRAINMEDIC_STREAMS_DATADIR"):
        prepare(t, pod, broker.bootstrap)
    shown = subprocess.run(
        [str(TRAINMEDIC), "config", "show", "--json"],
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(pod.tmp), "TRAINMEDIC_STREAMS_DATADIR": "x"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "TRAINMEDIC_STREAMS_DATADIR" in orjson.loads(shown.stdout)["unknown_env"]


KAFKA_SASL_MTLS: dict[str, Any] = {
    "kafka": {
        "securityProtocol": "sasl_ssl",
        # Each component's own credential: the chart's defaults (kafka.sasl.credentials).
        "sasl": {"mechanism": "SCRAM-SHA-512"},
        "tls": {"existingSecret": "tm-kafka-tls", "certificateKey": "tls.crt", "keyKey": "tls.key"},
    }
}
SASL_TARGETS = targets(render({**copy.deepcopy(VALUES), **KAFKA_SASL_MTLS}))


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_kafka_sasl_and_mtls_reach_each_process_settings(target: str, pod: Pod) -> None:
    """No broker here speaks SASL/TLS: each container's rendered Kafka security env, with its
    Secret files, is loaded and applied by the settings model as the process would
    (`trainmedic config show` builds the client security and refuses an incomplete one)."""
    p = prepare(SASL_TARGETS[target], pod, "kafka.example.org:9093")
    shown = subprocess.run(
        [str(TRAINMEDIC), "config", "show", "--json"], env=p.env, cwd=p.cwd, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    settings = {s["name"]: s for s in orjson.loads(shown.stdout)["settings"]}
    if SASL_TARGETS[target].kind == "Job" and "migrate" in target:
        # No Kafka client, so no Kafka principal (bus/acls.py): the chart gives it no Kafka security.
        assert settings["kafka_security_protocol"]["value"] == "plaintext"
        assert settings["kafka_sasl_password"]["origin"] == "default"
        return
    assert settings["kafka_security_protocol"]["value"] == "sasl_ssl"
    assert settings["kafka_sasl_mechanism"]["value"] == "SCRAM-SHA-512"
    assert settings["kafka_sasl_password"]["origin"].startswith("file named by TRAINMEDIC_KAFKA_SASL_PASSWORD_FILE")
    # Its own principal, named as the ACL matrix names it (bus/acls.py).
    assert f"User:{settings['kafka_sasl_username']['value']}" in {
        acls.principal(acls.DEFAULT_PRINCIPAL, c.name) for c in acls.components()
    }
    for name in ("kafka_ssl_ca", "kafka_ssl_certificate", "kafka_ssl_key"):
        assert Path(settings[name]["value"]).is_file(), (name, settings[name])


class _Receiver(http.server.BaseHTTPRequestHandler):
    """A webhook receiver: records every POST (path, lower-cased headers, JSON body), answers 200."""

    got: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.got.append((self.path, {k.lower(): v for k, v in self.headers.items()}, orjson.loads(body)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[tuple[str, dict[str, str], dict[str, Any]]]]]:
    got: list[tuple[str, dict[str, str], dict[str, Any]]] = []
    handler = type("Receiver", (_Receiver,), {"got": got})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", got
    server.shutdown()
    server.server_close()


def test_notifier_delivers_an_incident_with_the_token_from_its_secret(
    pod: Pod, broker: EmbeddedBroker, webhook: tuple[str, list[tuple[str, dict[str, str], dict[str, Any]]]]
) -> None:
    """notifier.enabled with a receiver: the Secret key as the kubelet mounts it under fsGroup
    (0440) is refused by the notifier as it is, so the init container copies the YAML and the
    token into the memory emptyDir 0400; the notifier gets ready there, POSTs a published
    incident with the bearer token, and exits 0 on SIGTERM."""
    url, got = webhook
    values = copy.deepcopy(VALUES)
    values["notifier"] = notifier_values(url)
    t = targets(render(values))["notifier/notifier"]
    p = prepare(t, pod, broker.bootstrap)
    copies = p.mounts["/etc/trainmedic/notifier"]
    assert p.argv[1:] == ["run", "notifier", "--webhooks", str(copies / "notifier.yaml")]
    assert [i.name for i in p.init] == ["webhooks"]
    mounted = pod.tmp / "mounts" / "notifier-tokens" / "receiver"
    assert stat.S_IMODE(mounted.stat().st_mode) == 0o440
    with pytest.raises(NotifierConfigError, match="0440"):
        read_token(mounted)
    incident_id = "inc-chart-notifier-1"
    with running(p, pod.tmp / "notifier.log") as ready:
        assert ready["ready"] is True
        assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in copies.iterdir()} == {
            "notifier.yaml": 0o400,
            "receiver": 0o400,
        }
        now = time.time()
        incident = Incident(
            event_id=incident_id,
            event_time=now,
            incident_id=incident_id,
            job_id="4242",
            partition="gpu",
            category="gpu_hardware",
            severity="critical",
            culprit_node=NODE,
            confidence=0.9,
            explanation=f"Xid 79 on {NODE}",
            evidence=[
                Evidence(source="kernel", signature="xid_79", node=NODE, time=now - 2, line=XID_LINE, role="root")
            ],
            anomaly_ids=["anm-4242-1"],
            first_signal_time=now - 2,
        )
        pub = Publisher(broker.bootstrap, "test", learn_limits=False)
        pub.publish(INCIDENTS, incident)
        assert pub.flush(10) == 0
        deadline = time.monotonic() + 60
        while not [g for g in got if g[2].get("event", {}).get("event_id") == incident_id]:
            assert time.monotonic() < deadline, f"no POST of {incident_id} within 60 s: {got}"
            time.sleep(0.2)
    ((path, headers, body),) = [g for g in got if g[2].get("event", {}).get("event_id") == incident_id]
    assert path == "/hook" and body["kind"] == "incident"
    assert headers["authorization"] == f"Bearer {NOTIFIER_TOKEN}"
