"""The webhook notifier (sinks/notifier.py) on the real embedded broker, POSTing to a real HTTP
receiver on 127.0.0.1 (stdlib http.server in a thread) that records every request."""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from bus.config import consumer_config
from bus.publish import Publisher
from schemas.codec import decode
from schemas.events import DeadLetter, Decision, Event, Evidence, GuardrailTrip, Incident
from schemas.topics import DEADLETTER, DECISIONS, DEFAULT_PARTITIONS, GUARDRAIL_TRIPS, INCIDENTS, Topic
from sinks.notifier import (
    Endpoint,
    Notifier,
    NotifierConfig,
    NotifierConfigError,
    RetrySettings,
    deliver,
    idempotency_key,
    kind_of,
    load_config,
    render,
    summary,
)
from tests.conftest import REPO, read_topic, wait_for
from trainmedic.stack.broker import EmbeddedBroker

FAST = RetrySettings(attempts=3, base_delay_s=0.05, max_delay_s=0.2)
TOKEN = "s3cr3t-notifier-token-0123456789"


# --- a real HTTP receiver ---------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def event_id(self) -> str:
        body = self.json()
        return str(body["event"]["event_id"] if "event" in body else body["payload"]["custom_details"]["event_id"])


class Receiver:
    """Records every request; `answer(n, request)` gives the status of the n-th (0-based);
    a request whose index is in `hold` is answered only once that event is set."""

    def __init__(self, answer: Callable[[int, Request], int] = lambda _n, _r: 200) -> None:
        self.answer = answer
        self.requests: list[Request] = []
        self.hold: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                req = Request("POST", self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                with receiver._lock:
                    n = len(receiver.requests)
                    receiver.requests.append(req)
                    gate = receiver.hold.get(n)
                if gate is not None:
                    gate.wait(60)
                status = receiver.answer(n, req)
                with contextlib.suppress(OSError):  # the client may be gone (killed, timed out)
                    self.send_response(status)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def of(self, event_id: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.event_id == event_id]

    def close(self) -> None:
        for gate in self.hold.values():
            gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


# --- events -----------------------------------------------------------------------------


def incident(n: int, job: str = "1234", node: str = "gpu02", explanation: str = "Xid 79 on gpu02") -> Incident:
    now = time.time()
    return Incident(
        event_id=f"inc-{job}-{n}",
        event_time=now,
        incident_id=f"inc-{job}-{n}",
        job_id=job,
        partition="gpu",
        job_nodes=["gpu01", node, "gpu03"],
        category="gpu_hardware",
        severity="critical",
        culprit_node=node,
        culprit_gpu=3,
        confidence=0.95,
        isolate=True,
        explanation=explanation,
        evidence=[
            Evidence(source="kernel", signature="xid_79", node=node, time=now - 2, line="NVRM: Xid 79", role="root")
        ],
        anomaly_ids=[f"anm-{job}-{n}"],
        first_signal_time=now - 2,
    )


def decision(n: int, action: str, rule: str, job: str = "1234") -> Decision:
    now = time.time()
    return Decision(
        event_id=f"dec-{job}-{n}",
        event_time=now,
        decision_id=f"dec-{job}-{n}",
        incident_id=f"inc-{job}-{n}",
        job_id=job,
        partition="gpu",
        category="gpu_hardware",
        culprit_node="gpu02",
        action=action,  # type: ignore[arg-type]
        mode="autonomous",
        executed=True,
        stop_mode="hold",
        rule=rule,
        reason="Xid 79 on gpu02",
        first_signal_time=now - 3,
        incident_time=now - 1,
    )


BUDGET_RULE = "actions.gpu_hardware=drain_and_requeue (restart budget: 3 restarts in 24 h: stop and escalate)"


def trip(n: int, job: str = "1234", node: str | None = "gpu02") -> GuardrailTrip:
    return GuardrailTrip(
        event_id=f"grd-{job}-{n}-blast_radius",
        event_time=time.time(),
        guardrail="blast_radius",
        action_id=f"act-{job}-{n}",
        incident_id=f"inc-{job}-{n}",
        job_id=job,
        node=node,
        partition="gpu",
        action="drain_and_requeue",
        detail="3 of 8 nodes of partition gpu already drained (limit 2)",
    )


def publish(bootstrap: str, *items: tuple[Topic, Event]) -> None:
    pub = Publisher(bootstrap, "test", learn_limits=False)
    for topic, event in items:
        pub.publish(topic, event)
    assert pub.flush(10) == 0


def endpoint(url: str, **fields: Any) -> Endpoint:
    return Endpoint.model_validate({"url": url, "timeout_s": 10.0, **fields})


@contextlib.contextmanager
def running(notifier: Notifier) -> Iterator[Notifier]:
    thread = threading.Thread(target=notifier.run, name="notifier", daemon=True)
    thread.start()
    try:
        yield notifier
    finally:
        notifier.stop()
        thread.join(30)
        assert not thread.is_alive(), "the notifier did not stop"


def committed(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offsets on `topic`, by partition (only those with one)."""
    probe = Consumer(consumer_config(bootstrap, group, "probe"))
    try:
        tps = probe.committed([TopicPartition(topic, p) for p in range(DEFAULT_PARTITIONS)], timeout=10)
    finally:
        probe.close()
    return {tp.partition: tp.offset for tp in tps if tp.offset >= 0}


def token_file(tmp_path: Path, mode: int = 0o600) -> Path:
    path = tmp_path / "hook.token"
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    return path


# --- 1. an incident, its headers and the generic envelope ----------------------------------


def test_incident_reaches_the_webhook_with_its_headers_and_envelope(
    broker: EmbeddedBroker, receiver: Receiver, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trainmedic.notifier")
    ep = endpoint(receiver.url("/hook/SECRETPATH"), token_file=str(token_file(tmp_path)))
    config = NotifierConfig(endpoints=[ep], retry=FAST)
    inc = incident(1)
    with running(Notifier(broker.bootstrap, config, group="t1")) as notifier:
        publish(broker.bootstrap, (INCIDENTS, inc))
        wait_for("the notifier to count the incident sent", lambda: notifier.sent[ep.label] == 1)
    [req] = receiver.requests
    assert (req.method, req.path) == ("POST", "/hook/SECRETPATH")
    assert req.headers["authorization"] == f"Bearer {TOKEN}"
    assert req.headers["content-type"] == "application/json"
    assert req.headers["user-agent"] == "trainmedic-notifier"
    key = req.headers["idempotency-key"]
    assert key == idempotency_key(inc, ep) and key.startswith("ntf-")
    body = req.json()
    assert body["kind"] == "incident" and body["idempotency_key"] == key
    assert decode(Incident, orjson.dumps(body["event"])) == inc
    assert body["summary"] == "trainmedic incident inc-1234-1: gpu_hardware on gpu02 (job 1234), confidence 0.95"
    # Neither the token nor the URL's path (a Slack hook's secret) is logged.
    assert "sent to http://127.0.0.1" in caplog.text
    assert TOKEN not in caplog.text and "SECRETPATH" not in caplog.text


# --- 2. retried after a 500, committed only after the success --------------------------------


def test_a_500_is_retried_with_the_same_key_and_committed_only_after_success(
    broker: EmbeddedBroker, receiver: Receiver
) -> None:
    receiver.answer = lambda n, _r: 500 if n == 0 else 200
    release = receiver.hold[1] = threading.Event()
    ep = endpoint(receiver.url())
    config = NotifierConfig(endpoints=[ep], retry=FAST)
    first = incident(1)
    with running(Notifier(broker.bootstrap, config, group="t2")) as notifier:
        publish(broker.bootstrap, (INCIDENTS, first))
        wait_for("the retry to reach the receiver", lambda: len(receiver.requests) == 2)
        # The retry is held unanswered: nothing may be committed yet.
        assert committed(broker.bootstrap, "t2", INCIDENTS.name) == {}
        release.set()
        wait_for("the success to be counted", lambda: notifier.sent[ep.label] == 1)
        offsets = wait_for("the offset commit", lambda: committed(broker.bootstrap, "t2", INCIDENTS.name))
        assert list(offsets.values()) == [1], offsets
        assert notifier.retried[ep.label] == 1 and notifier.given_up[ep.label] == 0
    a, b = receiver.requests
    assert a.headers["idempotency-key"] == b.headers["idempotency-key"] == idempotency_key(first, ep)
    assert a.body == b.body
    # A new notifier in the same group starts after the committed offset: only the new event comes.
    marker = incident(2)
    with running(Notifier(broker.bootstrap, config, group="t2")):
        publish(broker.bootstrap, (INCIDENTS, marker))
        wait_for("the marker incident", lambda: receiver.of(marker.event_id))
    assert [r.event_id for r in receiver.requests] == [first.event_id, first.event_id, marker.event_id]


# --- 3. guardrail trips and escalations; ordinary decisions are not sent ---------------------


def test_guardrail_trip_and_escalation_are_sent_an_ordinary_decision_is_not(
    broker: EmbeddedBroker, receiver: Receiver
) -> None:
    everything = endpoint(receiver.url("/all"))
    pager = endpoint(receiver.url("/pager"), name="pager", kinds=["escalation"])
    config = NotifierConfig(endpoints=[everything, pager], retry=FAST)
    ordinary = decision(1, "requeue", "actions.user_code=requeue")
    plain_stop = decision(2, "stop", "actions.oom=stop")
    escalation = decision(3, "stop", BUDGET_RULE)
    grd = trip(4)
    with running(Notifier(broker.bootstrap, config, group="t3")) as notifier:
        # One job: one partition of `decisions`, in this order, so the escalation comes last.
        publish(broker.bootstrap, (DECISIONS, ordinary), (DECISIONS, plain_stop), (GUARDRAIL_TRIPS, grd))
        publish(broker.bootstrap, (DECISIONS, escalation))
        wait_for("the escalation at both endpoints", lambda: len(receiver.of(escalation.event_id)) == 2)
        wait_for("the guardrail trip", lambda: receiver.of(grd.event_id))
        wait_for("both counted", lambda: notifier.sent[everything.label] == 2 and notifier.sent["pager"] == 1)
    seen = {(r.path, r.json()["kind"], r.event_id) for r in receiver.requests}
    assert seen == {
        ("/all", "guardrail_trip", grd.event_id),
        ("/all", "escalation", escalation.event_id),
        ("/pager", "escalation", escalation.event_id),
    }
    assert len(receiver.requests) == 3
    esc = receiver.of(escalation.event_id)[0].json()
    assert "job 1234 held for a human" in esc["summary"] and "3 restarts in 24 h" in esc["summary"]
    assert [kind_of(e) for e in (ordinary, plain_stop, escalation, grd)] == [None, None, "escalation", "guardrail_trip"]


# --- 4. the Slack and PagerDuty templates ----------------------------------------------------


def test_slack_and_pagerduty_templates_render_their_documented_shapes() -> None:
    inc = incident(7, explanation="Xid 79 <fell off the bus> & took rank 3 " + "x" * 5000)
    slack = endpoint("https://hooks.slack.com/services/T0/B0/XYZ", template="slack")
    body = render("incident", inc, slack)
    assert set(body) == {"text", "blocks"}
    assert body["text"] == "trainmedic incident inc-1234-7: gpu_hardware on gpu02 (job 1234), confidence 0.95"
    assert "\n" not in body["text"]
    for block in body["blocks"]:
        assert block["type"] in ("section", "context")
        if "text" in block:
            assert block["text"]["type"] == "mrkdwn" and len(block["text"]["text"]) <= 3000
        for f in block.get("fields", []):
            assert f["type"] == "mrkdwn" and len(f["text"]) <= 2000
    fields = next(b["fields"] for b in body["blocks"] if "fields" in b)
    assert len(fields) <= 10 and {"type": "mrkdwn", "text": "*Culprit*\ngpu02, GPU 3"} in fields
    explanation = body["blocks"][1]["text"]["text"]
    assert explanation.startswith("Xid 79 &lt;fell off the bus&gt; &amp; took rank 3") and "<" not in explanation

    pd = endpoint("https://events.pagerduty.com/v2/enqueue", template="pagerduty", routing_key="R0UT1NGKEY")
    body = render("incident", inc, pd)
    assert body["routing_key"] == "R0UT1NGKEY" and body["event_action"] == "trigger"
    assert body["dedup_key"] == idempotency_key(inc, pd) != idempotency_key(inc, slack)
    payload = body["payload"]
    assert {"summary", "source", "severity", "component", "custom_details"} <= set(payload)
    assert payload["summary"] == summary("incident", inc) and len(payload["summary"]) <= 1024
    assert (payload["source"], payload["severity"]) == ("gpu02", "critical")
    assert payload["component"] == "gpu_hardware (GPU 3)" and payload["group"] == "gpu"
    assert payload["custom_details"]["incident_id"] == inc.incident_id
    assert payload["custom_details"]["evidence_count"] == 1 and "evidence" not in payload["custom_details"]
    warning = incident(8).model_copy(update={"severity": "warning"})
    assert render("incident", warning, pd)["payload"]["severity"] == "warning"
    # A guardrail trip is a warning from its node, or its job when it names no node; an escalation is critical.
    assert render("guardrail_trip", trip(9), pd)["payload"]["severity"] == "warning"
    assert render("guardrail_trip", trip(9, node=None), pd)["payload"]["source"] == "job 1234"
    esc = render("escalation", decision(10, "stop", BUDGET_RULE), pd)["payload"]
    assert (esc["severity"], esc["source"], esc["class"]) == ("critical", "gpu02", "escalation")
    orjson.dumps(body)  # JSON as it is


# --- 5. a 400 is refused at once; 503s are retried, then given up on --------------------------


def test_400_is_not_retried_503_is_given_up_after_the_attempts_and_the_next_event_goes(
    broker: EmbeddedBroker, receiver: Receiver
) -> None:
    refused, failing, fine = incident(1), incident(2), incident(3)
    statuses = {refused.event_id: 400, failing.event_id: 503, fine.event_id: 200}
    receiver.answer = lambda _n, r: statuses[r.event_id]
    ep = endpoint(receiver.url())
    config = NotifierConfig(endpoints=[ep], retry=FAST)
    with running(Notifier(broker.bootstrap, config, group="t5")) as notifier:
        publish(broker.bootstrap, (INCIDENTS, refused), (INCIDENTS, failing), (INCIDENTS, fine))  # one partition
        wait_for("the event after the failing one", lambda: notifier.sent[ep.label] == 1)
        assert (len(receiver.of(refused.event_id)), len(receiver.of(failing.event_id))) == (1, 3)
        assert (notifier.refused[ep.label], notifier.given_up[ep.label], notifier.retried[ep.label]) == (1, 1, 2)
        assert {r.headers["idempotency-key"] for r in receiver.of(failing.event_id)} == {idempotency_key(failing, ep)}
        wait_for("both dead letters", lambda: len(read_topic(broker.bootstrap, DEADLETTER.name, 1.0)) == 2)
    letters = sorted(
        (decode(DeadLetter, v) for v in read_topic(broker.bootstrap, DEADLETTER.name, 1.0)),
        key=lambda d: d.original_offset or 0,
    )
    assert [(d.component, d.original_topic) for d in letters] == [("sinks.notifier", "incidents")] * 2
    assert [decode(Incident, base64.b64decode(d.payload_b64)) for d in letters] == [refused, failing]
    assert "refused by endpoint http://127.0.0.1" in letters[0].reason and "status 400" in letters[0].reason
    assert "gave up after 3 attempt(s)" in letters[1].reason and "status 503" in letters[1].reason
    assert len(receiver.requests) == 5


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_deliver_retries_429_timeouts_and_connection_errors(receiver: Receiver) -> None:
    inc = incident(1)
    ep = endpoint(receiver.url(), timeout_s=0.3)
    body, key = render("incident", inc, ep), idempotency_key(inc, ep)
    slow = receiver.hold[2] = threading.Event()  # the third request waits past the client's timeout
    receiver.answer = lambda n, _r: 429 if n == 0 else 200
    retries: list[int] = []
    with httpx.Client() as client:
        assert deliver(client, ep, body, key, None, FAST).status == "sent"
        assert len(receiver.requests) == 2  # 429, then 200
        out = deliver(client, ep, body, key, None, FAST, on_retry=lambda n, _why: retries.append(n))
        slow.set()
        assert (out.status, out.attempts, retries) == ("sent", 2, [1])
        gone = endpoint(f"http://127.0.0.1:{_closed_port()}/hook")
        out = deliver(client, gone, body, key, None, FAST)
        assert (out.status, out.attempts, out.http_status) == ("given_up", 3, None)
        assert "ConnectError" in out.detail
        # A stop while waiting to retry: interrupted, not given up (the record is not committed).
        out = deliver(client, gone, body, key, None, FAST, wait=lambda _s: True)
        assert (out.status, out.attempts) == ("interrupted", 1)


# --- 6. a crash before the commit: redelivered with the same key ------------------------------


def test_a_crash_before_the_commit_resends_with_the_same_key(
    broker: EmbeddedBroker, receiver: Receiver, tmp_path: Path
) -> None:
    receiver.hold[0] = threading.Event()  # the killed notifier's request is never answered
    cfg = tmp_path / "notifier.yaml"
    cfg.write_text(
        f"endpoints:\n  - url: {receiver.url()}\n    token_file: hook.token\n"
        "retry: {attempts: 3, base_delay_s: 0.05}\n"
    )
    token_file(tmp_path)
    log = tmp_path / "notifier.log"
    # The deployable as the units and the chart would run it.
    trainmedic = str(Path(sys.executable).with_name("trainmedic"))
    argv = [trainmedic, "run", "notifier", "--webhooks", str(cfg), "--bootstrap", broker.bootstrap]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*argv, "--group", "t6"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    inc = incident(1)
    try:
        wait_for("the notifier process to start", lambda: "notifier up" in log.read_text() or proc.poll() is not None)
        publish(broker.bootstrap, (INCIDENTS, inc))
        wait_for("its request", lambda: receiver.requests or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert committed(broker.bootstrap, "t6", INCIDENTS.name) == {}
    config = load_config(cfg)
    with running(Notifier(broker.bootstrap, config, group="t6")) as notifier:
        wait_for("the redelivery", lambda: len(receiver.requests) == 2, timeout=90)
        wait_for("the redelivery counted", lambda: notifier.sent[config.endpoints[0].label] == 1)
    first, again = receiver.requests
    assert (
        first.headers["idempotency-key"]
        == again.headers["idempotency-key"]
        == idempotency_key(inc, config.endpoints[0])
    )
    assert first.body == again.body and again.headers["authorization"] == f"Bearer {TOKEN}"


# --- 7. configuration errors name the file and the field --------------------------------------


@pytest.mark.parametrize(
    ("endpoints", "field", "words"),
    [
        ("  - url: https://example.com/h\n    template: teams\n", "endpoints.0.template", "'generic', 'slack'"),
        ("  - url: ftp://example.com/h\n", "endpoints.0.url", "scheme 'ftp' refused"),
        (
            "  - url: http://localhost:8080/ok\n  - url: http://hooks.example.com/h\n",
            "endpoints.1.url",
            "insecure: true",
        ),
        ("  - url: https://example.com/h\n    template: pagerduty\n", "endpoints.0.routing_key", "routing_key"),
        ("  - url: https://u:p@example.com/h\n", "endpoints.0.url", "credentials"),
        ("  - url: https://example.com/h\n    kinds: [incident, page]\n", "endpoints.0.kinds.1", "'escalation'"),
        ("  - url: https://example.com/h\n    token_file: hook.token\n", "endpoints.0.token_file", "mode 0644"),
    ],
)
def test_config_errors_name_the_file_and_the_field(tmp_path: Path, endpoints: str, field: str, words: str) -> None:
    token_file(tmp_path, mode=0o644)
    path = tmp_path / "notifier.yaml"
    path.write_text("retry:\n  attempts: 2\nendpoints:\n" + endpoints)
    with pytest.raises(NotifierConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: line ") and f"field '{field}'" in msg and words in msg, msg


def test_a_valid_config_loads_with_its_token_file_resolved(tmp_path: Path) -> None:
    token = token_file(tmp_path)
    path = tmp_path / "notifier.yaml"
    path.write_text(
        "endpoints:\n"
        "  - url: http://hooks.example.com/h\n    insecure: true\n    token_file: hook.token\n"
        "  - url: https://events.pagerduty.com/v2/enqueue\n    template: pagerduty\n    routing_key: R0UT1NGKEY\n"
        "    kinds: [escalation]\n    timeout_s: 3\n"
        "  - url: http://[::1]:9000/h\n"
        "retry: {attempts: 4, base_delay_s: 0.5, max_delay_s: 2}\n"
    )
    config = load_config(path)
    assert config.endpoints[0].token_file == token
    assert [ep.label for ep in config.endpoints] == [
        "http://hooks.example.com",
        "https://events.pagerduty.com",
        "http://[::1]:9000",
    ]
    assert config.topics() == ["decisions", "guardrail.trips", "incidents"]
    assert [config.retry.delay(n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    with pytest.raises(NotifierConfigError, match="cannot read notifier config"):
        load_config(tmp_path / "absent.yaml")
    # The service itself refuses a token file opened up after the config was loaded.
    os.chmod(token, 0o640)
    with pytest.raises(NotifierConfigError, match="mode 0640"):
        Notifier("127.0.0.1:1", config)


def test_a_stop_for_restarts_without_progress_is_an_escalation_too() -> None:
    rule = (
        "actions.hang=requeue (no progress: 2 restarts in a row without a higher step or a new checkpoint, "
        "limit 2: stop and escalate)"
    )
    stopped = decision(5, "stop", rule)
    assert kind_of(stopped) == "escalation"
    assert "no progress: 2 restarts in a row" in summary("escalation", stopped)
    assert "restart budget: 3 restarts in 24 h" in summary("escalation", decision(6, "stop", BUDGET_RULE))
    assert kind_of(decision(7, "stop", "actions.user_code=stop")) is None
