"""Issue 41 item 5: a report about job J is accepted only if it is shown to come from J.

Real parts: the local Slurm 22.05 cluster (a job submitted as the ordinary user `tmuser`), its
munged (credentials made with `munge` as tmuser and as another user, `tmop`, decoded by the
server with `unmunge`), the embedded broker, and the audit sink in chDB for the refusal record.
"""

from __future__ import annotations

import base64
import gc
import hashlib
import json
import secrets
import subprocess
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from bus.config import consumer_config
from bus.identity import job_token
from bus.publish import Publisher
from producers.ingest import STATS_KEY, IngestServer, create_app
from producers.ingest_auth import IDENTITY_REFUSED, IngestAuth, MungeVerifier, SlurmJobOwners
from schemas.codec import decode
from schemas.events import DeadLetter, HealthEvent
from schemas.ids import DEFAULT_CLUSTER
from schemas.topics import DEADLETTER, DEFAULT_PARTITIONS, HEALTH_EXTERNAL
from sinks.audit import AuditSink, AuditStore
from tests.conftest import Cluster, read_topic, slurm_cmd, wait_for
from trainmedic.stack.broker import EmbeddedBroker

OWNER, OTHER = "tmuser", "tmop"  # users start.sh creates: the job's owner, and another user


def _report(job_id: str, *, node: str = "gpu01", rank: int = 0) -> dict[str, Any]:
    # A fault report as an NVRx hook inside the job would send: the attack of issue 41 posted these.
    return {
        "kind": "fault",
        "node": node,
        "job_id": job_id,
        "rank": rank,
        "timestamp": 1796000000 + rank,
        "fault_type": "rank_heartbeat_timeout",
        "message": f"rank {rank} missed its heartbeats",
    }


def _post(url: str, body: bytes, authorization: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read() or b"{}")


@dataclass
class Server:
    url: str
    shared: str
    site: str
    bootstrap: str
    socket: str
    stats: Any

    def nvrx(self, body: bytes, authorization: str | None) -> tuple[int, dict[str, Any]]:
        return _post(f"{self.url}/v1/nvrx", body, authorization)


def munge_as(user: str, cluster: Cluster, payload: bytes) -> str:
    """A MUNGE credential made by `user` (uid and all) with the cluster's munged."""
    socket = str(cluster.state_dir / "munge" / "munge.socket.2")
    proc = subprocess.run(
        ["runuser", "-u", user, "--", "munge", "--socket", socket],
        input=payload,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.decode().strip()


@pytest.fixture
def users_job(slurm_cluster: Cluster) -> Iterator[str]:
    """A running job of the ordinary user tmuser (not root), on the real cluster."""
    proc = subprocess.run(
        [
            "runuser",
            "-u",
            OWNER,
            "--",
            "sbatch",
            "--parsable",
            "--chdir=/tmp",
            "-o",
            "/dev/null",
            "--wrap",
            "sleep 300",
        ],
        capture_output=True,
        text=True,
        env=slurm_cluster.env(),
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    try:
        owner = SlurmJobOwners(slurm_cluster.runner())(job_id)
        assert owner == OWNER, f"job {job_id} belongs to {owner}"
        yield job_id
    finally:
        slurm_cmd(slurm_cluster, "scancel", job_id)


@pytest.fixture
def server(broker: EmbeddedBroker, slurm_cluster: Cluster) -> Iterator[Server]:
    shared, site = secrets.token_urlsafe(24), secrets.token_urlsafe(32)
    socket = str(slurm_cluster.state_dir / "munge" / "munge.socket.2")
    auth = IngestAuth(
        shared_token=shared,
        site_secret=site,
        munge=MungeVerifier(socket),
        job_owner=SlurmJobOwners(slurm_cluster.runner()),
    )
    publisher = Publisher(broker.bootstrap, "test-ingest-identity")
    app = create_app(publisher, auth)
    srv = IngestServer(app, "127.0.0.1", 0).start()
    yield Server(srv.url, shared, site, broker.bootstrap, socket, app[STATS_KEY])
    srv.stop()
    publisher.flush(10)
    del app, publisher
    gc.collect()


def _refusals(bootstrap: str, want: int) -> list[DeadLetter]:
    """The identity refusals on the deadletter topic, once there are `want` of them (one consumer, from the start)."""
    consumer = Consumer(consumer_config(bootstrap, f"t-{uuid.uuid4().hex[:8]}", "test-refusals"))
    consumer.assign([TopicPartition(DEADLETTER.name, p, OFFSET_BEGINNING) for p in range(DEFAULT_PARTITIONS)])
    letters: list[DeadLetter] = []

    def probe() -> bool:
        for msg in consumer.consume(num_messages=100, timeout=0.2):
            if not msg.error() and (letter := decode(DeadLetter, msg.value() or b"")).reason.startswith(
                IDENTITY_REFUSED
            ):
                letters.append(letter)
        return len(letters) >= want

    try:
        wait_for(f"{want} identity refusals on {DEADLETTER.name}", probe, timeout=30, interval=0)
    finally:
        consumer.close()
    return letters


def _health_events(bootstrap: str) -> list[HealthEvent]:
    return [decode(HealthEvent, raw) for raw in read_topic(bootstrap, HEALTH_EXTERNAL.name, seconds=2.0)]


def test_munge_credential_of_the_jobs_owner_is_accepted_and_its_replay_refused(
    server: Server, users_job: str, slurm_cluster: Cluster
) -> None:
    body = orjson.dumps(_report(users_job))
    credential = munge_as(OWNER, slurm_cluster, hashlib.sha256(body).hexdigest().encode())

    status, answer = server.nvrx(body, f"MUNGE {credential}")
    assert status == 202, answer
    (event,) = [e for e in _health_events(server.bootstrap) if e.event_id == answer["event_id"]]
    assert (event.job_id, event.authenticated_as, event.check_name) == (users_job, "job", "nvrx_fault")

    # The same credential again (a captured request, replayed): munged refuses it (EMUNGE_CRED_REPLAYED).
    status, answer = server.nvrx(body, f"MUNGE {credential}")
    assert (status, answer["error"], answer["detail"]) == (401, "bad_munge_credential", "replayed credential")
    assert len(_refusals(server.bootstrap, 1)) == 1
    assert server.stats.accepted == {"nvrx": 1}


def test_forged_report_about_another_users_job_is_refused_and_audited(
    server: Server, users_job: str, slurm_cluster: Cluster, chdb_url: str, database: str
) -> None:
    body = orjson.dumps(_report(users_job, rank=3))
    digest = hashlib.sha256(body).hexdigest().encode()

    # 1. The attack of issue 41: the shared ingest token, posted about another user's job.
    status, answer = server.nvrx(body, f"Bearer {server.shared}")
    assert (status, answer["error"]) == (403, "identity_refused"), answer
    # 2. A genuine MUNGE credential of another user, bound to this very body: not the job's owner.
    status, answer = server.nvrx(body, f"MUNGE {munge_as(OTHER, slurm_cluster, digest)}")
    assert (status, answer["error"]) == (403, "identity_refused"), answer
    assert f"does not own job {users_job} (owner {OWNER})" in answer["detail"]
    # 3. The owner's credential made for another body: it does not bind this request.
    other_body = hashlib.sha256(b"something else").hexdigest().encode()
    status, answer = server.nvrx(body, f"MUNGE {munge_as(OWNER, slurm_cluster, other_body)}")
    assert (status, answer["error"]) == (403, "identity_refused"), answer
    # 4. A per-job token of another job.
    status, answer = server.nvrx(body, "Bearer " + job_token(server.site.encode(), DEFAULT_CLUSTER, "999999"))
    assert (status, answer["error"]) == (403, "identity_refused"), answer

    assert not [e for e in _health_events(server.bootstrap) if e.job_id == users_job], "a forged report got through"
    assert server.stats.rejected["identity_refused"] == 4

    # Each refusal is a dead letter, and the audit stores it.
    letters = _refusals(server.bootstrap, 4)
    assert all(orjson.loads(base64.b64decode(x.payload_b64))["job_id"] == users_job for x in letters)
    assert all(server.shared not in x.reason and server.shared not in x.payload_b64 for x in letters)
    store = AuditStore(chdb_url, database)
    store.migrate()
    sink = AuditSink(server.bootstrap, store, group="audit-ingest-identity", batch_wait_s=0.2)
    thread = threading.Thread(target=sink.run, daemon=True)
    thread.start()
    try:
        rows = wait_for(
            "the refusals in the audit's dead_letters",
            lambda: (
                r
                if len(
                    r := store.query(
                        "SELECT component, reason FROM {db}.dead_letters FINAL WHERE reason LIKE {p:String}",
                        {"p": f"{IDENTITY_REFUSED}%"},
                    )
                )
                >= 4
                else None
            ),
            timeout=40,
        )
    finally:
        sink.stop_event.set()
        thread.join(30)
        store.close()
    assert {r["component"] for r in rows} == {"producers.ingest"}
    assert any(f"does not own job {users_job}" in r["reason"] for r in rows)


def test_a_job_token_speaks_for_its_job_only(broker: EmbeddedBroker) -> None:
    site = secrets.token_urlsafe(32)
    publisher = Publisher(broker.bootstrap, "test-ingest-identity")
    app = create_app(publisher, IngestAuth(site_secret=site))
    srv = IngestServer(app, "127.0.0.1", 0).start()
    try:
        token_a = job_token(site.encode(), DEFAULT_CLUSTER, "1001")
        url = f"{srv.url}/v1/nvrx"
        status, answer = _post(url, orjson.dumps(_report("1002")), f"Bearer {token_a}")
        assert (status, answer["error"]) == (403, "identity_refused"), answer
        assert "a token of job 1001 cannot report about job 1002" in answer["detail"]
        # A batch that slips another job in beside its own is refused whole.
        both = orjson.dumps({"reports": [_report("1001"), _report("1002", rank=1)]})
        assert _post(url, both, f"Bearer {token_a}")[0] == 403
        tampered = token_a[:-4] + ("0000" if not token_a.endswith("0000") else "1111")
        assert _post(url, orjson.dumps(_report("1001")), f"Bearer {tampered}")[0] == 401
        status, answer = _post(url, orjson.dumps(_report("1001")), f"Bearer {token_a}")
        assert status == 202, answer
        # No service credential is configured: NVSentinel's endpoint takes no job token.
        assert _post(f"{srv.url}/v1/nvsentinel", b"{}", f"Bearer {token_a}")[0] == 401
        assert len(_refusals(broker.bootstrap, 3)) == 3
    finally:
        srv.stop()
        publisher.flush(10)
