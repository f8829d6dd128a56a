"""The HTTP ingest (producers/ingest.py): a real aiohttp server on 127.0.0.1 and
the real embedded broker behind its Publisher.

The NVSentinel payloads are NVSentinel's own examples: the HealthEvent of
docs/DATA_FLOW.md ("Example HealthEvent: GPU XID Error") and the CloudEvent of
its event-exporter design (docs/designs, "CloudEvents Schema"), both in
github.com/NVIDIA/NVSentinel; see docs/ingest.md.
"""

from __future__ import annotations

import base64
import copy
import gc
import json
import logging
import secrets
import shutil
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from bus.config import consumer_config
from bus.identity import job_token
from bus.publish import Publisher
from producers.ingest import (
    STATS_KEY,
    IngestConfigError,
    IngestServer,
    IngestStats,
    check_bind,
    create_app,
    load_token,
    run_ingest,
)
from producers.ingest_auth import IngestAuth
from schemas.codec import decode
from schemas.events import HealthEvent
from schemas.ids import DEFAULT_CLUSTER
from schemas.topics import HEALTH_EXTERNAL
from tests.conftest import wait_for
from tests.launch import self_signed_certificate
from trainmedic.stack.broker import EmbeddedBroker

# NVIDIA/NVSentinel docs/DATA_FLOW.md, "Example HealthEvent: GPU XID Error".
NVSENTINEL_XID48: dict[str, Any] = {
    "version": 1,
    "agent": "gpu-health-monitor",
    "componentClass": "GPU",
    "checkName": "XID_ERROR_48",
    "isFatal": True,
    "isHealthy": False,
    "message": "GPU 0 reported XID 48 (Double Bit ECC Error)",
    "recommendedAction": "REPLACE_VM",
    "errorCode": ["XID-48"],
    "entitiesImpacted": [{"entityType": "GPU", "entityValue": "GPU-12345678-abcd-1234-abcd-123456789abc"}],
    "metadata": {
        "gpu_uuid": "GPU-12345678-abcd-1234-abcd-123456789abc",
        "gpu_index": "0",
        "driver_version": "535.104.05",
        "severity": "CRITICAL",
    },
    "generatedTimestamp": "2025-10-28T10:15:30Z",
    "nodeName": "gpu-node-42",
    "quarantineOverrides": None,
    "drainOverrides": None,
}

# The envelope NVSentinel's event-exporter POSTs (CloudEvents 1.0), from its design document.
NVSENTINEL_CLOUDEVENT: dict[str, Any] = {
    "specversion": "1.0",
    "id": "fe5302cf-1887-48a9-8e6e-117d366a7344",
    "time": "2024-11-18T10:30:00.123456Z",
    "source": "nvsentinel://us-west-1-prod-cluster/healthevents",
    "type": "com.nvidia.nvsentinel.health.v1",
    "data": {
        "metadata": {"cluster": "us-west-1-prod-cluster", "environment": "production"},
        "healthEvent": {
            "version": "1",
            "agent": "syslog-health-monitor",
            "componentClass": "GPU",
            "checkName": "XID_ERROR_48",
            "isFatal": True,
            "isHealthy": False,
            "message": "GPU 3 reported XID 48: Double Bit ECC Error",
            "recommendedAction": "REPLACE_GPU",
            "errorCode": ["XID_48"],
            "entitiesImpacted": [
                {"entityType": "PCI", "entityValue": "0000:17:00.0"},
                {"entityType": "GPU_UUID", "entityValue": "GPU-a1b2c3d4-e5f6-7890-abcd-ef1234567890"},
            ],
            "metadata": {"chassis_serial": "SN123456789"},
            "generatedTimestamp": "2024-11-18T10:30:00.123456Z",
            "nodeName": "gpu-node-42",
            "quarantineOverrides": {"force": True, "skip": False},
            "drainOverrides": {"force": False, "skip": False},
        },
    },
}

NVRX_STRAGGLER: dict[str, Any] = {
    "kind": "straggler",
    "node": "gpu02",
    "rank": 5,
    "job_id": "1234",
    "timestamp": "2025-10-28T10:16:00Z",
    "message": "rank 5 is slower than its peers",
    "scores": {"gpu_relative": 0.52, "gpu_individual": 0.93, "section_relative": {"fwd_bwd": 0.61}},
}


@dataclass
class Ingest:
    url: str
    token: str
    publisher: Publisher
    stats: IngestStats
    bootstrap: str
    site_secret: str = ""

    def job_token(self, job_id: str) -> str:
        """The per-job token a prolog hands to job `job_id` (NVRx reports need one, not the shared token)."""
        return job_token(self.site_secret.encode(), DEFAULT_CLUSTER, job_id)


@pytest.fixture(autouse=True)
def _release_publishers(broker: EmbeddedBroker) -> Iterator[None]:
    # aiohttp apps are reference cycles holding their Publisher: collect them so the
    # producer closes its connection before the broker stops (else it waits 5 s for it).
    yield
    gc.collect()


@pytest.fixture
def ingest(broker: EmbeddedBroker) -> Iterator[Ingest]:
    token, site = secrets.token_urlsafe(24), secrets.token_urlsafe(32)
    publisher = Publisher(broker.bootstrap, "test-ingest")
    app = create_app(publisher, IngestAuth(shared_token=token, site_secret=site))
    server = IngestServer(app, "127.0.0.1", 0).start()
    # A proxy: pytest keeps fixture values until the broker has stopped; the real reference must go earlier.
    yield Ingest(server.url, token, weakref.proxy(publisher), app[STATS_KEY], broker.bootstrap, site)
    server.stop()
    publisher.flush(10)  # serves pending delivery callbacks, which hold the Publisher alive


def _post(
    url: str,
    payload: Any,
    token: str | None,
    *,
    content_type: str = "application/json",
    scheme: str = "Bearer",
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, Any]]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"{scheme} {token}"
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _consume_until(bootstrap: str, want: set[str]) -> list[HealthEvent]:
    """Records of health.external in arrival order, until every id in `want` was seen."""
    consumer = Consumer(consumer_config(bootstrap, f"t-{uuid.uuid4().hex[:8]}", "test-ingest"))
    consumer.subscribe([HEALTH_EXTERNAL.name])
    got: list[HealthEvent] = []

    def probe() -> bool:
        msg = consumer.poll(0.5)
        if msg is not None and not msg.error():
            got.append(decode(HealthEvent, msg.value() or b""))
        return want <= {e.event_id for e in got}

    try:
        wait_for(f"{sorted(want)} on {HEALTH_EXTERNAL.name}", probe, timeout=60, interval=0)
    finally:
        consumer.close()
    return got


def _records_in_topic(bootstrap: str) -> int:
    consumer = Consumer(consumer_config(bootstrap, f"t-{uuid.uuid4().hex[:8]}", "test-ingest-count"))
    try:
        meta = consumer.list_topics(HEALTH_EXTERNAL.name, timeout=10)
        total = 0
        for p in meta.topics[HEALTH_EXTERNAL.name].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(HEALTH_EXTERNAL.name, p), timeout=10)
            total += high - low
        return total
    finally:
        consumer.close()


def test_nvsentinel_and_nvrx_events_are_published(ingest: Ingest) -> None:
    status, body = _post(f"{ingest.url}/v1/nvsentinel", NVSENTINEL_XID48, ingest.token)
    assert status == 202, body
    xid_id = body["event_id"]
    # A retried POST is the same event: consumers deduplicate on the id.
    assert _post(f"{ingest.url}/v1/nvsentinel", NVSENTINEL_XID48, ingest.token)[1]["event_id"] == xid_id

    status, body = _post(
        f"{ingest.url}/v1/nvsentinel", NVSENTINEL_CLOUDEVENT, ingest.token, content_type="application/cloudevents+json"
    )
    assert status == 202, body
    cloud_id = body["event_id"]

    status, body = _post(f"{ingest.url}/v1/nvrx", NVRX_STRAGGLER, ingest.job_token("1234"))
    assert status == 202, body
    nvrx_id = body["event_id"]

    assert ingest.publisher.flush(10) == 0
    events = {e.event_id: e for e in _consume_until(ingest.bootstrap, {xid_id, cloud_id, nvrx_id})}
    xid = events[xid_id]
    assert (xid.origin, xid.node, xid.check_name, xid.component) == ("nvsentinel", "gpu-node-42", "XID_ERROR_48", "GPU")
    assert (xid.is_fatal, xid.is_healthy, xid.recommended_action) == (True, False, "REPLACE_VM")
    assert xid.error_codes == ["XID-48"]
    assert xid.component_ids == ["GPU:GPU-12345678-abcd-1234-abcd-123456789abc"]
    assert xid.event_time == datetime.fromisoformat("2025-10-28T10:15:30+00:00").timestamp()
    assert "XID 48" in xid.message and "gpu-health-monitor" in xid.message

    cloud = events[cloud_id]
    assert cloud.component_ids == ["PCI:0000:17:00.0", "GPU_UUID:GPU-a1b2c3d4-e5f6-7890-abcd-ef1234567890"]
    assert cloud.recommended_action == "REPLACE_GPU"

    nvrx = events[nvrx_id]
    assert (nvrx.origin, nvrx.node, nvrx.job_id, nvrx.rank, nvrx.check_name) == (
        "nvrx",
        "gpu02",
        "1234",
        5,
        "nvrx_straggler",
    )
    assert not nvrx.is_healthy and "gpu_relative=0.520" in nvrx.message
    assert "STRAGGLER_GPU_RELATIVE" in nvrx.error_codes and "section:fwd_bwd" in nvrx.component_ids

    assert ingest.stats.accepted == {"nvsentinel": 3, "nvrx": 1}
    req = urllib.request.Request(f"{ingest.url}/metrics", headers={"Authorization": f"Bearer {ingest.token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    assert 'trainmedic_ingest_accepted_total{origin="nvsentinel"} 3' in text


def test_rejected_requests_publish_nothing(ingest: Ingest, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"{ingest.url}/v1/nvsentinel"

    status, body = _post(url, {**NVSENTINEL_XID48, "isFatal": "yes"}, ingest.token)
    assert (status, body["field"]) == (400, "isFatal"), body
    assert "boolean" in body["problem"]

    missing = {k: v for k, v in NVSENTINEL_XID48.items() if k != "nodeName"}
    status, body = _post(url, missing, ingest.token)
    assert (status, body["field"], body["problem"]) == (400, "nodeName", "Field required")

    # A batch is all or nothing: the valid first event is not published either.
    batch = {"version": 1, "events": [NVSENTINEL_XID48, {**NVSENTINEL_XID48, "isHealthy": 1}]}
    status, body = _post(url, batch, ingest.token)
    assert (status, body["field"]) == (400, "events.1.isHealthy"), body

    cloud = copy.deepcopy(NVSENTINEL_CLOUDEVENT)
    cloud["data"]["healthEvent"]["generatedTimestamp"] = "yesterday"
    status, body = _post(url, cloud, ingest.token)
    assert (status, body["field"]) == (400, "data.healthEvent.generatedTimestamp"), body

    status, body = _post(url, b'{"nodeName": "gpu01", ', ingest.token)
    assert (status, body["error"], body["field"]) == (400, "invalid_json", "<body>")

    job = ingest.job_token("1234")
    status, body = _post(f"{ingest.url}/v1/nvrx", {**NVRX_STRAGGLER, "scores": {"gpu_relative": 1.7}}, job)
    assert (status, body["field"]) == (400, "scores.gpu_relative"), body
    status, body = _post(f"{ingest.url}/v1/nvrx", {**NVRX_STRAGGLER, "jobid": "1234"}, job)
    assert (status, body["field"]) == (400, "jobid"), body

    # Valid bodies without the right token.
    assert _post(url, NVSENTINEL_XID48, None)[0] == 401
    assert _post(url, NVSENTINEL_XID48, "not-the-token-at-all")[0] == 401
    assert _post(url, NVSENTINEL_XID48, ingest.token, scheme="Basic")[0] == 401
    assert _post(url, NVSENTINEL_XID48, ingest.token + "x")[0] == 401

    huge = {**NVSENTINEL_XID48, "message": "x" * (1024 * 1024 + 1)}
    status, body = _post(url, huge, ingest.token)
    assert (status, body["error"]) == (413, "too_large")

    assert _post(url, NVSENTINEL_XID48, ingest.token, content_type="text/html")[0] == 415

    marker = {**NVSENTINEL_XID48, "checkName": "MARKER", "nodeName": "marker-node"}
    status, body = _post(url, marker, ingest.token)
    assert status == 202, body
    records = _consume_until(ingest.bootstrap, {body["event_id"]})
    assert records[0].event_id == body["event_id"] and records[0].check_name == "MARKER"
    assert ingest.publisher.flush(10) == 0
    assert _records_in_topic(ingest.bootstrap) == 1

    assert ingest.stats.accepted == {"nvsentinel": 1}
    assert ingest.stats.rejected == {
        "invalid_field": 6,
        "invalid_json": 1,
        "unauthorized": 4,
        "too_large": 1,
        "media_type": 1,
    }
    assert not any(ingest.token in r.getMessage() for r in caplog.records), "the token was logged"


def test_a_forged_node_name_is_refused_escaped_and_nothing_is_published(
    ingest: Ingest, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 40 item 5: a node name with a newline and ANSI escapes (the forged row of `recommendations
    list`) is a 400 naming the field, the value shown escaped; counted; nothing of it reaches Kafka."""
    caplog.set_level(logging.DEBUG)
    forged = "gpu01\n\x1b[31mdec-forged  job 1  gpu_hardware\x1b[0m"
    escaped = "'gpu01\\n\\x1b[31mdec-forged  job 1  gpu_hardware\\x1b[0m'"
    cloud = copy.deepcopy(NVSENTINEL_CLOUDEVENT)
    cloud["data"]["healthEvent"]["nodeName"] = forged
    posts: list[tuple[str, Any, str]] = [
        ("nvsentinel", {**NVSENTINEL_XID48, "nodeName": forged}, "nodeName"),
        # All or nothing: the valid first event of the batch is not published either.
        (
            "nvsentinel",
            {"version": 1, "events": [NVSENTINEL_XID48, {**NVSENTINEL_XID48, "nodeName": forged}]},
            "events.1.nodeName",
        ),
        ("nvsentinel", cloud, "data.healthEvent.nodeName"),
        ("nvrx", {**NVRX_STRAGGLER, "node": forged}, "node"),
        ("nvrx", {**NVRX_STRAGGLER, "node": "gpu[01-02]"}, "node"),  # a hostlist is no one node
    ]
    for path, payload, field in posts:
        # NVRx reports come with their job's token (ingest identity), NVSentinel's with the shared one.
        token = ingest.job_token(NVRX_STRAGGLER["job_id"]) if path == "nvrx" else ingest.token
        status, body = _post(f"{ingest.url}/v1/{path}", payload, token)
        assert (status, body["error"], body["field"]) == (400, "invalid_field", field), body
        assert body["problem"].startswith("invalid node name '") and "Slurm node name" in body["problem"], body
    # The problem shows the value with its control characters escaped, as text: no raw ESC or newline.
    status, body = _post(f"{ingest.url}/v1/nvsentinel", {**NVSENTINEL_XID48, "nodeName": forged}, ingest.token)
    assert escaped in body["problem"] and "\x1b" not in body["problem"] and "\n" not in body["problem"]

    marker = {**NVSENTINEL_XID48, "checkName": "MARKER", "nodeName": "gpu-node-43"}
    status, body = _post(f"{ingest.url}/v1/nvsentinel", marker, ingest.token)
    assert status == 202, body
    records = _consume_until(ingest.bootstrap, {body["event_id"]})
    assert [r.check_name for r in records] == ["MARKER"]
    assert ingest.publisher.flush(10) == 0
    assert _records_in_topic(ingest.bootstrap) == 1

    assert ingest.stats.rejected == {"invalid_field": len(posts) + 1}
    req = urllib.request.Request(f"{ingest.url}/metrics", headers={"Authorization": f"Bearer {ingest.token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert f'trainmedic_ingest_rejected_total{{reason="invalid_field"}} {len(posts) + 1}' in resp.read().decode()
    # The refusal's log line names the value escaped too: no control character reaches a terminal.
    refusals = [r.getMessage() for r in caplog.records if "nodeName" in r.getMessage()]
    assert refusals and not any("\x1b" in m or "\n" in m for m in refusals), refusals


def test_oauth2_token_endpoint_for_nvsentinel_exporter(ingest: Ingest) -> None:
    form = urllib.parse.urlencode({"grant_type": "client_credentials", "scope": "events:write"}).encode()
    req = urllib.request.Request(
        f"{ingest.url}/oauth2/token",
        data=form,
        method="POST",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    req.add_unredirected_header(
        "Authorization",
        "Basic " + base64.b64encode(f"nvsentinel-exporter:{ingest.token}".encode()).decode(),
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        grant = json.loads(resp.read())
    # The access token is derived from the secret with an expiry (issue 41): never the secret itself.
    access = grant["access_token"]
    assert grant["token_type"] == "Bearer" and grant["expires_in"] == 3600
    assert access != ingest.token and ingest.token not in access
    assert _post(f"{ingest.url}/v1/nvsentinel", NVSENTINEL_XID48, access)[0] == 202
    # A service credential does not speak for jobs; a forged access token is nothing.
    assert _post(f"{ingest.url}/v1/nvrx", NVRX_STRAGGLER, access)[0] == 403
    forged = access.rsplit(".", 1)[0] + "." + "0" * 64
    assert _post(f"{ingest.url}/v1/nvsentinel", NVSENTINEL_XID48, forged)[0] == 401

    wrong = urllib.parse.urlencode(
        {"grant_type": "client_credentials", "client_id": "x", "client_secret": "wrong-secret"}
    ).encode()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(f"{ingest.url}/oauth2/token", data=wrong), timeout=30)
    assert err.value.code == 401
    with err.value:
        assert ingest.token not in err.value.read().decode()


def test_run_ingest_serves_until_stopped(broker: EmbeddedBroker) -> None:
    token, site = secrets.token_urlsafe(24), secrets.token_urlsafe(32)
    publisher = Publisher(broker.bootstrap, "test-ingest")
    ready: list[IngestServer] = []
    stop = threading.Event()
    result: list[IngestStats] = []
    thread = threading.Thread(
        target=lambda: result.append(
            run_ingest(
                publisher,
                "127.0.0.1",
                0,
                IngestAuth(shared_token=token, site_secret=site),
                stop_event=stop,
                on_ready=ready.append,
            )
        ),
        daemon=True,
    )
    thread.start()
    server = wait_for("the ingest server", lambda: ready[0] if ready else None, timeout=30)
    fault = {**NVRX_STRAGGLER, "kind": "fault", "fault_type": "hang"}
    status, body = _post(f"{server.url}/v1/nvrx", fault, job_token(site.encode(), DEFAULT_CLUSTER, "1234"))
    assert status == 202, body
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert result[0].accepted == {"nvrx": 1}
    (event,) = _consume_until(broker.bootstrap, {body["event_id"]})
    assert (event.check_name, event.error_codes, event.is_fatal) == ("nvrx_fault", ["hang"], True)


def test_unsafe_settings_are_refused(broker: EmbeddedBroker, tmp_path: Path) -> None:
    publisher = Publisher(broker.bootstrap, "test-ingest")
    token = secrets.token_urlsafe(24)
    with pytest.raises(IngestConfigError, match="without TLS"):
        run_ingest(publisher, "0.0.0.0", 0, token)
    with pytest.raises(IngestConfigError, match="without TLS"):
        check_bind("gpu-login.example.org", tls=False, allow_insecure=False)
    check_bind("0.0.0.0", tls=False, allow_insecure=True)
    check_bind("::1", tls=False, allow_insecure=False)
    with pytest.raises(IngestConfigError, match="at least"):
        create_app(publisher, "short")
    with pytest.raises(IngestConfigError, match="TRAINMEDIC_INGEST_TOKEN"):
        load_token(env={})
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    assert load_token(token_file) == token
    assert load_token(env={"TRAINMEDIC_INGEST_TOKEN": token}) == token


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate")
def test_tls(broker: EmbeddedBroker, tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path)
    token = secrets.token_urlsafe(24)
    publisher = Publisher(broker.bootstrap, "test-ingest")
    ready: list[IngestServer] = []
    stop = threading.Event()
    thread = threading.Thread(
        target=run_ingest,
        args=(publisher, "127.0.0.1", 0, token),
        kwargs={"tls_cert": cert, "tls_key": key, "stop_event": stop, "on_ready": ready.append},
        daemon=True,
    )
    thread.start()
    server = wait_for("the TLS ingest server", lambda: ready[0] if ready else None, timeout=30)
    assert server.url.startswith("https://")
    client = ssl.create_default_context(cafile=str(cert))
    status, body = _post(f"{server.url}/v1/nvsentinel", NVSENTINEL_XID48, token, context=client)
    stop.set()
    thread.join(timeout=30)
    assert status == 202, body
