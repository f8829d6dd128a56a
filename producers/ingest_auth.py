"""Who may report what at the ingest endpoint (docs/ingest.md, "Identity").

Two kinds of callers, with separate credentials:

- **Cluster services** (NVSentinel) on ``/v1/nvsentinel`` and ``/metrics``: the service token
  (setting ``ingest_service_token``), an access token ``/oauth2/token`` derived from it (HMAC
  with an expiry; never the secret itself), or the shared ingest token (``ingest_token``).
- **Jobs** (NVRx runs inside users' jobs) on ``/v1/nvrx``: a report about job J is accepted only
  when the request proves it comes from J:

  - ``Authorization: MUNGE <credential>``: a MUNGE credential whose payload is the sha256 hex of
    the request body (so it binds this body) and whose uid owns every job the body names, as
    slurmctld says (``scontrol show job``). munged refuses a credential decoded twice
    (EMUNGE_CRED_REPLAYED, munge(7): "Unexpired credentials are tracked by the local munged
    daemon in order to prevent replay attacks"), so a captured credential cannot be reused.
  - ``Authorization: Bearer job:<job id>:<hex>``: the per-job token, HMAC of the site secret,
    the cluster and the job id (bus.identity.job_token), handed to the job by a prolog; every
    report of the body must name that job.
  - the shared ingest token only when ``ingest_allow_shared_token_for_jobs`` says so (a risk:
    whoever holds it can requeue any job).

A refusal is an ``AuthRefused`` (401: no usable credential; 403: a credential that does not
speak for what the body claims). Identity refusals of job reports are also published as dead
letters (reason ``ingest_identity_refused: ...``) so that the audit records them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import pwd
import re
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from bus.identity import check_site_secret, verify_job_token
from schemas.events import DeadLetter, HealthEvent
from schemas.ids import DEFAULT_CLUSTER, stable_id
from slurmio.runners import Runner, SlurmCommandError
from slurmio.scontrol import show_job
from slurmio.versions import known_versions

__all__ = [
    "IDENTITY_REFUSED",
    "AuthRefused",
    "Identity",
    "IngestAuth",
    "MungeCredential",
    "MungeVerifier",
    "SlurmJobOwners",
    "body_digest",
]

log = logging.getLogger("trainmedic.producers.ingest")

IDENTITY_REFUSED = "ingest_identity_refused"
MIN_TOKEN_CHARS = 16
ACCESS_TOKEN_TTL_S = 3600
_ACCESS_PREFIX = "tmat1"
_ACCESS_LABEL = b"trainmedic/v1/ingest-access-token"
_MUNGE_CRED = re.compile(r"^MUNGE:[A-Za-z0-9+/=]{16,8192}:$")
_TEXT_FORM = known_versions()["v0.0.38"]  # `scontrol show job -o`: every Slurm version prints it
# unmunge exit statuses = munge_decode()'s munge_err_t (munge.h): the ones that mean "refuse".
_MUNGE_REFUSALS = {
    8: "not a valid MUNGE credential",
    9: "unsupported credential version",
    10: "unsupported cipher",
    11: "bad credential MAC",
    12: "unsupported compression",
    13: "credential from another security realm",
    14: "invalid credential",
    15: "expired credential",
    16: "credential from the future (clock rewound)",
    17: "replayed credential",
    18: "credential not for this user",
}

Scheme = Literal["service_token", "access_token", "shared_token", "job_token", "munge"]


def _check_token(name: str, token: str) -> bytes:
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the {name} must be at least {MIN_TOKEN_CHARS} characters")
    if any(c.isspace() for c in token) or not token.isprintable():
        raise ValueError(f"the {name} must be printable without whitespace")
    return token.encode()


def body_digest(body: bytes) -> str:
    """What a MUNGE credential's payload must be: the sha256 hex of the exact request body."""
    return hashlib.sha256(body).hexdigest()


@dataclass(frozen=True)
class Identity:
    """Who a request was shown to come from."""

    scheme: Scheme
    kind: Literal["service", "job", "shared"]
    subject: str  # "service", "job 1234", "uid 994 (tmuser)", "shared token"


class AuthRefused(Exception):
    """A request refused for its credentials: 401 (none usable) or 403 (does not speak for the body)."""

    def __init__(self, status: int, reason: str, detail: str, *, audit: bool = False) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason
        self.detail = detail
        self.audit = audit  # a job report's identity refusal: recorded as a dead letter


# --------------------------------------------------------------------- MUNGE
@dataclass(frozen=True)
class MungeCredential:
    uid: int
    payload: bytes


class MungeUnavailable(Exception):
    """munged cannot be asked (no socket, timeout): the server's problem, not the caller's."""


class MungeVerifier:
    """Decodes a credential with ``unmunge`` (munge's own decoder; no Python binding is installed)."""

    def __init__(self, socket: str | None = None, *, binary: str = "unmunge", timeout_s: float = 5.0) -> None:
        self.socket = socket
        self.binary = binary
        self.timeout_s = timeout_s

    def __call__(self, credential: str) -> MungeCredential:
        argv = [self.binary, "--numeric", "--keys=UID"]
        if self.socket:
            argv += ["--socket", self.socket]
        try:
            proc = subprocess.run(
                argv,
                input=credential.encode() + b"\n",
                capture_output=True,
                timeout=self.timeout_s,
                check=False,
                shell=False,
            )
        except subprocess.TimeoutExpired:
            raise MungeUnavailable(f"unmunge timed out after {self.timeout_s:g}s") from None
        except OSError as exc:
            raise MungeUnavailable(f"unmunge could not be run: {exc}") from None
        if proc.returncode in _MUNGE_REFUSALS:
            raise AuthRefused(401, "bad_munge_credential", _MUNGE_REFUSALS[proc.returncode], audit=True)
        if proc.returncode != 0:
            raise MungeUnavailable(f"unmunge exited {proc.returncode}: {proc.stderr.decode(errors='replace')[:200]}")
        meta, sep, payload = proc.stdout.partition(b"\n\n")
        uid = None
        for line in meta.decode(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "UID" and value.strip().isdigit():
                uid = int(value.strip())
        if uid is None or not sep:
            raise MungeUnavailable("unmunge printed no UID")
        return MungeCredential(uid=uid, payload=payload)


class SlurmJobOwners:
    """Job id -> the user name slurmctld has for it (``scontrol show job -o``), None if unknown."""

    def __init__(self, runner: Runner, timeout_s: float = 10.0) -> None:
        self.runner = runner
        self.timeout_s = timeout_s

    def __call__(self, job_id: str) -> str | None:
        base = re.split(r"[_+]", job_id, maxsplit=1)[0]  # an array task or het component: its job's owner
        try:
            job = show_job(self.runner, base, self.timeout_s, _TEXT_FORM)
        except (SlurmCommandError, ValueError) as exc:
            raise MungeUnavailable(f"cannot read job {base} from Slurm: {exc}") from None
        return job.user if job is not None else None


def _user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


# --------------------------------------------------------------------- the policy
class IngestAuth:
    """The credentials the ingest server accepts, and what each may speak for."""

    def __init__(
        self,
        *,
        shared_token: str | None = None,
        service_token: str | None = None,
        site_secret: str | None = None,
        cluster: str = DEFAULT_CLUSTER,
        allow_shared_token_for_jobs: bool = False,
        munge: Callable[[str], MungeCredential] | None = None,
        job_owner: Callable[[str], str | None] | None = None,
        access_ttl_s: int = ACCESS_TOKEN_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._shared = _check_token("ingest token", shared_token) if shared_token else None
        self._service = _check_token("ingest service token", service_token) if service_token else None
        self._site = check_site_secret(site_secret) if site_secret else None
        if not (self._shared or self._service or self._site):
            raise ValueError("the ingest server needs at least one of: ingest token, service token, site secret")
        if allow_shared_token_for_jobs and self._shared is None:
            raise ValueError("ingest_allow_shared_token_for_jobs is set but there is no shared ingest token")
        self.cluster = cluster
        self.allow_shared_token_for_jobs = allow_shared_token_for_jobs
        self.munge = munge if job_owner is not None else None  # MUNGE needs both: who, and whose job
        self.job_owner = job_owner
        self.access_ttl_s = access_ttl_s
        self.clock = clock
        # The OAuth2 client secret: the service token where there is one, else the shared token.
        self._client_secret = self._service or self._shared

    # -- services ----------------------------------------------------------------------------
    def client_secret_ok(self, presented: str) -> bool:
        return self._client_secret is not None and hmac.compare_digest(presented.encode(), self._client_secret)

    def _access_mac(self, expiry: int) -> str:
        assert self._client_secret is not None
        key = hmac.new(self._client_secret, _ACCESS_LABEL, hashlib.sha256).digest()
        return hmac.new(key, str(expiry).encode(), hashlib.sha256).hexdigest()

    def issue_access_token(self) -> tuple[str, int]:
        """A short-lived access token (``tmat1.<expiry>.<hex HMAC>``), valid on service endpoints."""
        expiry = int(self.clock()) + self.access_ttl_s
        return f"{_ACCESS_PREFIX}.{expiry}.{self._access_mac(expiry)}", self.access_ttl_s

    def _access_ok(self, presented: str) -> bool:
        prefix, _, rest = presented.partition(".")
        expiry_text, _, mac = rest.partition(".")
        if prefix != _ACCESS_PREFIX or not expiry_text.isdigit() or len(expiry_text) > 12 or not mac:
            return False
        if self._client_secret is None or int(expiry_text) < self.clock():
            return False
        return hmac.compare_digest(mac.encode(), self._access_mac(int(expiry_text)).encode())

    def _bearer(self, authorization: str) -> str | None:
        scheme, _, credentials = authorization.partition(" ")
        return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None

    def service(self, authorization: str) -> Identity:
        """The identity of a service request (NVSentinel, /metrics); AuthRefused(401) otherwise."""
        token = self._bearer(authorization)
        if token is not None:
            raw = token.encode()
            if self._service is not None and hmac.compare_digest(raw, self._service):
                return Identity("service_token", "service", "service")
            if self._shared is not None and hmac.compare_digest(raw, self._shared):
                # Where jobs may hold the shared token too, a report under it may come from a job
                # posing as NVSentinel: it counts as a job's evidence (schemas/events.py).
                kind: Literal["service", "shared"] = "shared" if self.allow_shared_token_for_jobs else "service"
                return Identity("shared_token", kind, "shared token")
            if self._access_ok(token):
                return Identity("access_token", "service", "service (access token)")
        raise AuthRefused(401, "unauthorized", "missing or wrong bearer token")

    # -- jobs --------------------------------------------------------------------------------
    def job_precheck(self, authorization: str) -> None:
        """Cheap checks before the body is read: a credential of a job scheme, well formed.

        Raises AuthRefused; the full check (body binding, job ownership) is ``job_report``.
        """
        scheme, _, credentials = authorization.partition(" ")
        credentials = credentials.strip()
        if scheme.lower() == "munge":
            if self.munge is None:
                raise AuthRefused(401, "unauthorized", "MUNGE credentials are not enabled on this server")
            if not _MUNGE_CRED.match(credentials):
                raise AuthRefused(401, "unauthorized", "malformed MUNGE credential")
            return
        token = self._bearer(authorization)
        if token is None:
            raise AuthRefused(401, "unauthorized", "missing or malformed Authorization header")
        raw = token.encode()
        if token.startswith("job:"):
            if self._site is None:
                raise AuthRefused(401, "unauthorized", "per-job tokens are not enabled on this server")
            if verify_job_token(self._site, self.cluster, token) is None:
                raise AuthRefused(401, "unauthorized", "invalid job token", audit=True)
            return
        if self._shared is not None and hmac.compare_digest(raw, self._shared):
            if not self.allow_shared_token_for_jobs:
                raise AuthRefused(
                    403,
                    "identity_refused",
                    "the shared ingest token does not speak for jobs: send a per-job token or a MUNGE credential",
                    audit=True,
                )
            return
        if (self._service is not None and hmac.compare_digest(raw, self._service)) or self._access_ok(token):
            raise AuthRefused(403, "identity_refused", "service credentials do not speak for jobs", audit=True)
        raise AuthRefused(401, "unauthorized", "missing or wrong bearer token")

    def job_report(self, authorization: str, body: bytes, events: Sequence[HealthEvent]) -> Identity:
        """Who the job report comes from, once it is shown to speak for every job it names.

        May block (unmunge, scontrol): call it off the event loop. Raises AuthRefused, or
        MungeUnavailable when munged or Slurm cannot be asked.
        """
        self.job_precheck(authorization)
        jobs = {e.job_id for e in events}
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() == "munge":
            return self._munge_report(credentials.strip(), body, jobs)
        token = credentials.strip()
        if token.startswith("job:"):
            assert self._site is not None
            job_id = verify_job_token(self._site, self.cluster, token)
            others = sorted(str(j) for j in jobs if j != job_id)
            if others:
                raise AuthRefused(
                    403, "identity_refused", f"a token of job {job_id} cannot report about job {others[0]}", audit=True
                )
            return Identity("job_token", "job", f"job {job_id}")
        return Identity("shared_token", "shared", "shared token")  # allowed by job_precheck

    def _munge_report(self, credential: str, body: bytes, jobs: set[str | None]) -> Identity:
        if None in jobs:
            raise AuthRefused(403, "identity_refused", "a job credential needs job_id in every report", audit=True)
        assert self.munge is not None and self.job_owner is not None
        decoded = self.munge(credential)
        if not hmac.compare_digest(decoded.payload.strip(), body_digest(body).encode()):
            raise AuthRefused(
                403,
                "identity_refused",
                "the MUNGE credential's payload is not the sha256 of this request body",
                audit=True,
            )
        user = _user_name(decoded.uid)
        subject = f"uid {decoded.uid} ({user or 'unknown user'})"
        for job_id in sorted(str(j) for j in jobs):
            owner = self.job_owner(job_id)
            if owner is None:
                raise AuthRefused(403, "identity_refused", f"job {job_id} is not known to Slurm", audit=True)
            if user is None or owner != user:
                raise AuthRefused(
                    403, "identity_refused", f"{subject} does not own job {job_id} (owner {owner})", audit=True
                )
        return Identity("munge", "job", subject)


# --------------------------------------------------------------------- refusals for the audit
class RefusalRecords:
    """Dead letters for identity refusals, at most `burst` per `per_s` (a flood is counted, not stored)."""

    def __init__(self, burst: int = 20, per_s: float = 10.0) -> None:
        self.burst = burst
        self.per_s = per_s
        self.skipped = 0
        self._times: list[float] = []
        self._lock = threading.Lock()

    def make(self, path: str, peer: str, refusal: AuthRefused, body: bytes) -> DeadLetter | None:
        now = time.monotonic()
        with self._lock:
            self._times = [t for t in self._times if now - t < self.per_s]
            if len(self._times) >= self.burst:
                self.skipped += 1
                return None
            self._times.append(now)
        when = time.time()
        raw = body[:65536]
        return DeadLetter(
            event_id=stable_id("dlq", "producers.ingest", path, peer, body_digest(body), refusal.detail, when),
            event_time=when,
            component="producers.ingest",
            original_topic=f"http:{path}",
            reason=f"{IDENTITY_REFUSED}: {refusal.status} {refusal.detail} (from {peer})"[:2000],
            payload_b64=base64.b64encode(raw).decode(),
        )
