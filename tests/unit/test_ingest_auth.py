"""Credentials derived from the site secret (bus/identity.py) and the ingest credential policy
(producers/ingest_auth.py), without a broker, munged or Slurm (those: tests/integration/test_ingest_identity.py)."""

from __future__ import annotations

import hashlib

import pytest

from bus.identity import job_token, node_key, sign_node_record, verify_job_token, verify_node_record
from producers.ingest_auth import AuthRefused, IngestAuth, MungeCredential
from schemas.events import HealthEvent

SITE = "s" * 40
SHARED = "shared-token-0123456789"


def _event(job_id: str | None) -> HealthEvent:
    return HealthEvent(
        event_id="e", event_time=1.0, origin="nvrx", node="gpu01", check_name="nvrx_fault", job_id=job_id
    )


def test_job_tokens_are_per_job_and_per_cluster() -> None:
    a = job_token(SITE.encode(), "prod", "1001")
    assert a.startswith("job:1001:") and len(a.rsplit(":", 1)[1]) == 64
    assert verify_job_token(SITE.encode(), "prod", a) == "1001"
    assert verify_job_token(SITE.encode(), "other", a) is None
    assert verify_job_token(SITE.encode(), "prod", a.replace("job:1001:", "job:1002:")) is None
    assert verify_job_token(("t" * 40).encode(), "prod", a) is None


def test_a_node_key_cannot_sign_for_another_node() -> None:
    value = b'{"node":"gpu02","lines":[]}'
    own = sign_node_record(node_key(SITE.encode(), "prod", "gpu02"), "gpu02", value)
    assert verify_node_record(SITE.encode(), "prod", own, value, "gpu02") is None
    # gpu01's key, a record claiming gpu02: signed honestly as gpu01, or passed off as gpu02.
    as_gpu01 = sign_node_record(node_key(SITE.encode(), "prod", "gpu01"), "gpu01", value)
    assert "signed by node 'gpu01'" in str(verify_node_record(SITE.encode(), "prod", as_gpu01, value, "gpu02"))
    forged = sign_node_record(node_key(SITE.encode(), "prod", "gpu01"), "gpu02", value)
    assert "bad signature" in str(verify_node_record(SITE.encode(), "prod", forged, value, "gpu02"))
    assert "bad signature" in str(verify_node_record(SITE.encode(), "prod", own, value + b" ", "gpu02"))


def test_access_tokens_are_derived_and_expire() -> None:
    now = [1000.0]
    auth = IngestAuth(service_token="service-token-0123456789", clock=lambda: now[0], access_ttl_s=60)
    token, ttl = auth.issue_access_token()
    assert ttl == 60 and "service-token" not in token
    assert auth.service(f"Bearer {token}").scheme == "access_token"
    now[0] += 61
    with pytest.raises(AuthRefused) as refused:
        auth.service(f"Bearer {token}")
    assert refused.value.status == 401


def test_the_shared_token_speaks_for_services_and_for_jobs_only_when_allowed() -> None:
    auth = IngestAuth(shared_token=SHARED)
    assert auth.service(f"Bearer {SHARED}").kind == "service"
    with pytest.raises(AuthRefused) as refused:
        auth.job_report(f"Bearer {SHARED}", b"{}", [_event("1")])
    assert (refused.value.status, refused.value.audit) == (403, True)
    risky = IngestAuth(shared_token=SHARED, allow_shared_token_for_jobs=True)
    assert risky.job_report(f"Bearer {SHARED}", b"{}", [_event("1")]).kind == "shared"


def test_munge_checks_the_body_and_the_owner() -> None:
    body = b'{"job_id": "7"}'

    def munge(_cred: str) -> MungeCredential:
        return MungeCredential(uid=0, payload=hashlib.sha256(body).hexdigest().encode() + b"\n")

    cred = "MUNGE MUNGE:" + "A" * 40 + ":"
    auth = IngestAuth(shared_token=SHARED, munge=munge, job_owner={"7": "root", "8": "alice"}.get)
    assert auth.job_report(cred, body, [_event("7")]).subject == "uid 0 (root)"
    for events, why in (
        ([_event("8")], "does not own job 8"),
        ([_event("9")], "not known"),
        ([_event(None)], "job_id"),
    ):
        with pytest.raises(AuthRefused, match=why):
            auth.job_report(cred, body, events)
    with pytest.raises(AuthRefused, match="sha256"):
        auth.job_report(cred, body + b" ", [_event("7")])
    # Without a way to learn job owners, MUNGE is off.
    with pytest.raises(AuthRefused, match="not enabled"):
        IngestAuth(shared_token=SHARED, munge=munge).job_precheck(cred)
