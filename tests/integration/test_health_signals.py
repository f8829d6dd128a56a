"""Every node and external health signal reaches a decision, through the real broker, the
real streams worker, the real ingest endpoint and the real chDB audit:

- an Xid in a node's kernel log (the real kernel producer) and the same Xid through NVML
  (a gpu.samples record) are one incident with one piece of evidence;
- an NVSentinel fatal health event, POSTed to the ingest endpoint as NVSentinel's own
  example (docs/DATA_FLOW.md, "Example HealthEvent: GPU XID Error", github.com/NVIDIA/NVSentinel),
  on a node of a running job is an incident on that job, culprit that node;
- an NVRx heartbeat-timeout report is a hang incident on its job;
- what NVSentinel and NVRx said is in the audit as received (health_events).
"""

from __future__ import annotations

import copy
import gc
import json
import secrets
import time
import urllib.request
from pathlib import Path
from typing import Any

from bus.identity import job_token
from bus.publish import Publisher
from producers.ingest import IngestServer, create_app
from producers.ingest_auth import IngestAuth
from producers.kernel import KernelLogProducer
from schemas.events import GpuMetrics, GpuSample, SchedEvent
from schemas.ids import DEFAULT_CLUSTER
from schemas.topics import GPU_SAMPLES, SCHED_EVENTS
from sinks.audit import AuditStore
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import wait_for, wait_placed
from tests.integration.scenario import incidents_of, running_stack, wait_incident, xid79_line
from tests.integration.test_ingest import NVSENTINEL_XID48
from trainmedic.stack.broker import EmbeddedBroker


def _post(url: str, payload: Any, token: str) -> dict[str, Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 202
        body: dict[str, Any] = json.loads(resp.read())
        return body


def _running(sched: SimulatedScheduler, job: str) -> SchedEvent:
    state = sched.job_state(job)
    return SchedEvent(
        event_id=f"run-{job}",
        event_time=time.time(),
        kind="job",
        job_id=job,
        state="RUNNING",
        nodes=list(state.nodes),
        partition="gpu",
    )


def _evidence(inc: dict[str, object]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads(str(inc["evidence"]))
    return found


def _anomalies(store: AuditStore, ids: list[str]) -> list[dict[str, object]]:
    return store.query(
        "SELECT event_id, detector, source, signature FROM {db}.anomalies FINAL WHERE has({ids:Array(String)}, event_id)",
        {"ids": ids},
    )


def test_kernel_nvml_nvsentinel_and_nvrx_signals_each_reach_one_incident_on_their_job(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler([f"gpu{n:02d}" for n in range(1, 7)])
    xid_job, nvs_job, nvrx_job = (sched.submit(name, 2) for name in ("xid", "nvsentinel", "nvrx"))
    with running_stack(broker.bootstrap, chdb_url, database, sched, "monitor", tmp_path) as stack:
        store = stack.store
        assert store is not None
        pub = Publisher(broker.bootstrap, "test-producer")
        for job in (xid_job, nvs_job, nvrx_job):
            pub.publish(SCHED_EVENTS, _running(sched, job))
        assert pub.flush(10) == 0
        wait_placed(broker.bootstrap, (xid_job, nvs_job, nvrx_job))  # the placements first

        # 1. One Xid 79 on one node, seen in its kernel log and through NVML.
        culprit = sched.job_state(xid_job).nodes[1]
        kern = tmp_path / "kern.log"
        kern.write_text(xid79_line(culprit) + "\n")
        KernelLogProducer(pub, kern, node=culprit, from_start=True).poll_once()
        pub.publish(
            GPU_SAMPLES,
            GpuSample(
                event_id=f"nvml-{culprit}-1",
                event_time=time.time(),
                node=culprit,
                collector="nvml",
                gpus=[GpuMetrics(index=0), GpuMetrics(index=2, xid_events=[79])],
            ),
        )
        assert pub.flush(10) == 0

        # 2. and 3. through the ingest endpoint, as NVSentinel and an NVRx hook post them.
        token, site = secrets.token_urlsafe(24), secrets.token_urlsafe(32)
        ingest_pub = Publisher(broker.bootstrap, "test-ingest")
        auth = IngestAuth(shared_token=token, site_secret=site)
        server = IngestServer(create_app(ingest_pub, auth), "127.0.0.1", 0).start()
        try:
            nvs_node = sched.job_state(nvs_job).nodes[0]
            event = copy.deepcopy(NVSENTINEL_XID48)
            event["nodeName"] = nvs_node
            event["generatedTimestamp"] = time.time()
            nvs_id = _post(f"{server.url}/v1/nvsentinel", event, token)["event_id"]
            nvrx_node = sched.job_state(nvrx_job).nodes[1]
            hang = {
                "kind": "fault",
                "node": nvrx_node,
                "job_id": nvrx_job,
                "rank": 3,
                "timestamp": time.time(),
                "fault_type": "rank_heartbeat_timeout",
                "message": "rank 3 missed its heartbeats for 60 s",
            }
            # NVRx runs inside the job: its report carries the job's own token (issue 41), not the shared one.
            nvrx_token = job_token(site.encode(), DEFAULT_CLUSTER, nvrx_job)
            nvrx_id = _post(f"{server.url}/v1/nvrx", hang, nvrx_token)["event_id"]
        finally:
            server.stop()
            ingest_pub.flush(10)

        inc = wait_incident(store, xid_job)
        assert (inc["culprit_node"], inc["category"]) == (culprit, "gpu_hardware")
        xids = [e for e in _evidence(inc) if e["signature"] == "xid_79"]
        assert len(xids) == 1 and xids[0]["gpu"] == 2, xids  # one piece of evidence: NVML's names the GPU
        taken = list(inc["anomaly_ids"])  # type: ignore[call-overload]
        assert sorted(str(a["source"]) for a in _anomalies(store, taken)) == ["gpu", "kernel"]

        inc = wait_incident(store, nvs_job)
        assert (inc["culprit_node"], inc["category"]) == (nvs_node, "gpu_hardware")
        assert any(e["source"] == "external" and e["signature"] == "xid_48" for e in _evidence(inc))

        inc = wait_incident(store, nvrx_job)
        assert (inc["category"], inc["culprit_node"], inc["culprit_rank"]) == ("hang", nvrx_node, 3)

        rows = wait_for(
            "both reports in health_events",
            lambda: (
                r
                if len(
                    r := store.query(
                        "SELECT event_id, origin, node, job_id FROM {db}.health_events FINAL ORDER BY origin"
                    )
                )
                == 2
                else None
            ),
        )
        assert [(r["event_id"], r["origin"], r["node"], r["job_id"]) for r in rows] == [
            (nvrx_id, "nvrx", nvrx_node, nvrx_job),
            (nvs_id, "nvsentinel", nvs_node, ""),
        ]

        # Nothing more comes of the reports: one incident per job, after the hold has settled.
        time.sleep(4.0)  # absence: past the collateral wait (3 s) and settle, no second incident
        assert [len(incidents_of(store, j)) for j in (xid_job, nvs_job, nvrx_job)] == [1, 1, 1]
        decisions = store.query("SELECT job_id, kind FROM {db}.decisions FINAL ORDER BY job_id")
        assert {str(d["job_id"]) for d in decisions} == {xid_job, nvs_job, nvrx_job}
        assert {d["kind"] for d in decisions} == {"recommendation"}  # monitor mode
    gc.collect()
