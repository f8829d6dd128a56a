"""HTTP ingest: NVSentinel health events and NVRx reports -> health.external.

`trainmedic produce ingest` runs an aiohttp server (127.0.0.1 by default) with
these routes (the JSON accepted is documented in docs/ingest.md):

- ``POST /v1/nvsentinel``: an NVSentinel ``HealthEvent`` in its protobuf JSON
  form (camelCase), a ``HealthEvents`` batch ``{"version": 1, "events": [...]}``,
  or the CloudEvents 1.0 envelope NVSentinel's event-exporter POSTs
  (``{"specversion": "1.0", "data": {"healthEvent": {...}}}``).
- ``POST /v1/nvrx``: an NVRx (nvidia-resiliency-ext) straggler or fault report,
  one object or ``{"reports": [...]}``; the shape is ours, built on the fields
  of NVRx's straggler ``Report`` (relative and individual GPU/section scores).
- ``POST /oauth2/token``: a minimal OAuth2 client-credentials endpoint, because
  NVSentinel's event-exporter fetches its bearer token that way: the client
  secret is the service token (else the shared ingest token); the access token
  handed back is derived from it with an expiry (HMAC), never the secret itself.
- ``GET /metrics`` (token required): accepted / rejected counters, Prometheus text.
- ``GET /healthz`` (no token): liveness.

Every POST needs credentials (producers/ingest_auth.py): a service's bearer
token for NVSentinel, and for NVRx a credential shown to come from the job the
report names (MUNGE, per-job token); anything else is 401 or 403. A body over ``max_body_bytes``
(1 MiB) is 413. A body that does not validate is 400 with a JSON body naming
the first bad field and the problem, and NOTHING of that request is published
(a batch is all or nothing). Success is 202 with the event ids: the events are
queued in the Kafka producer (acks=all); delivery failures after that are
counted by the Publisher (``dropped``).

Each accepted item becomes one ``HealthEvent`` on ``health.external`` (keyed by
node) with ``origin`` nvsentinel or nvrx. Event ids are derived from the
content, including the source's own timestamp, so a retried POST is the same
event downstream.

Security: no token or secret appears in logs or responses. The
server refuses to listen on a non-loopback address unless TLS cert and key
are given, or ``allow_insecure`` says plaintext tokens on the network are
accepted.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import logging
import math
import os
import re
import ssl
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
from aiohttp import web
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel

from bus.config import admin_config
from bus.metrics import MirroredCounter
from bus.publish import Publisher
from producers.ingest_auth import AuthRefused, IngestAuth, MungeUnavailable, RefusalRecords
from producers.metrics import INGEST_ACCEPTED, INGEST_REJECTED, POLL_FAILURES, ProducerHealth
from schemas.errors import ConfigError, UsageError
from schemas.events import MAX_EVENT_TIME, HealthEvent, NodeNameInput
from schemas.ids import stable_id
from schemas.masking import remember
from schemas.topics import DEADLETTER, HEALTH_EXTERNAL

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "MAX_BODY_BYTES",
    "TOKEN_ENV",
    "IngestConfigError",
    "IngestServer",
    "IngestStats",
    "NVRxReport",
    "NVSentinelHealthEvent",
    "create_app",
    "load_token",
    "run_ingest",
]

log = logging.getLogger("trainmedic.producers.ingest")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
MAX_BODY_BYTES = 1024 * 1024
MAX_ITEMS = 1000  # per request, batch forms
MIN_TOKEN_CHARS = 16
TOKEN_ENV = "TRAINMEDIC_INGEST_TOKEN"
_JSON_TYPES = ("application/json", "application/cloudevents+json")
_MESSAGE_MAX = 65536

# NVSentinel's RecommendedAction enum (data-models/protobufs/health_event.proto);
# protobuf JSON may carry the number instead of the name.
RECOMMENDED_ACTIONS = {
    0: "NONE",
    2: "COMPONENT_RESET",
    5: "CONTACT_SUPPORT",
    6: "RUN_FIELDDIAG",
    15: "RESTART_VM",
    24: "RESTART_BM",
    25: "REPLACE_VM",
    26: "RUN_DCGMEUD",
    39: "RESTART_APP",
    99: "UNKNOWN",
}
PROCESSING_STRATEGIES = {0: "UNSPECIFIED", 1: "EXECUTE_REMEDIATION", 2: "STORE_ONLY"}


class IngestConfigError(ConfigError, ValueError):
    """A setting that makes the ingest server unsafe or unusable; the message names it."""


# --------------------------------------------------------------------- timestamps
def parse_timestamp(value: object) -> float:
    """RFC 3339 text, epoch seconds, or protobuf's {"seconds", "nanos"} -> epoch seconds.

    Raises ValueError for anything else, including numbers out of range.
    """
    if isinstance(value, bool):
        raise ValueError("expected an RFC 3339 timestamp or epoch seconds, got a boolean")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an int past float's range (the JSON parser allows any size)
            raise ValueError("epoch seconds out of range") from None
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"epoch seconds must be finite and >= 0, got {value!r}")
        if seconds > 1e11:
            raise ValueError(f"{value!r} looks like milliseconds; send epoch seconds")
        if seconds > MAX_EVENT_TIME:
            raise ValueError(f"epoch seconds {value!r} are after 2200-01-01")
        return seconds
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.strip())
        except ValueError:
            raise ValueError(f"not an RFC 3339 timestamp: {value[:64]!r}") from None
        if parsed.tzinfo is None:
            raise ValueError(f"timestamp {value[:64]!r} has no time zone (add Z or +hh:mm)")
        # The same range as epoch seconds: events carry times from 1970 to 2200 (schemas.events).
        return parse_timestamp(parsed.timestamp())
    if isinstance(value, dict) and set(value) <= {"seconds", "nanos"} and "seconds" in value:
        secs, nanos = value.get("seconds"), value.get("nanos", 0)
        # protobuf's Timestamp.nanos is 0..999,999,999 (and a huge one overflows nanos / 1e9).
        if isinstance(secs, int | str) and not isinstance(secs, bool) and type(nanos) is int and 0 <= nanos < 10**9:
            try:
                whole = parse_timestamp(int(secs))
            except ValueError:
                pass
            else:
                return parse_timestamp(whole + nanos / 1e9)  # the fraction may still cross the bound
    raise ValueError("expected an RFC 3339 timestamp, epoch seconds or {seconds, nanos}")


# --------------------------------------------------------------------- NVSentinel models
class _Camel(BaseModel):
    # strict: "yes" is not a boolean, "3" is not a number. Unknown fields are
    # ignored so a newer NVSentinel with more fields still gets through.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, alias_generator=to_camel)


class NVSentinelEntity(_Camel):
    entity_type: str = Field(min_length=1, max_length=128)
    entity_value: str = Field(max_length=1024)


class NVSentinelOverrides(_Camel):
    force: bool = False
    skip: bool = False


class NVSentinelHealthEvent(_Camel):
    """NVSentinel's ``HealthEvent`` (data-models/protobufs/health_event.proto), protobuf JSON names.

    Absent fields take their proto3 defaults (protobuf JSON omits them): false,
    empty, recommendedAction NONE.
    """

    version: int | str | None = None
    agent: str = Field(default="", max_length=256)
    component_class: str = Field(default="", max_length=256)
    check_name: str = Field(min_length=1, max_length=256)
    is_fatal: bool = False
    is_healthy: bool = False
    message: str = Field(default="", max_length=_MESSAGE_MAX)
    recommended_action: str | int | None = None
    error_code: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=256)
    entities_impacted: list[NVSentinelEntity] = Field(default_factory=list, max_length=1024)
    metadata: dict[str, str] = Field(default_factory=dict, max_length=1024)
    generated_timestamp: float | None = None
    node_name: NodeNameInput  # a Slurm node name (schemas.ids); a forged one is refused, shown escaped
    quarantine_overrides: NVSentinelOverrides | None = None
    drain_overrides: NVSentinelOverrides | None = None
    processing_strategy: str | int | None = None

    @field_validator("generated_timestamp", mode="before")
    @classmethod
    def _timestamp(cls, value: object) -> float | None:
        return None if value is None else parse_timestamp(value)

    @field_validator("recommended_action", "processing_strategy")
    @classmethod
    def _enum_text(cls, value: str | int | None) -> str | int | None:
        if isinstance(value, str) and not (1 <= len(value) <= 64):
            raise ValueError("must be an enum name of 1-64 characters or its number")
        return value

    def action_name(self) -> str:
        value = self.recommended_action
        if value is None:
            return "NONE"
        if isinstance(value, int):
            return RECOMMENDED_ACTIONS.get(value, str(value))
        return value

    def strategy_name(self) -> str:
        value = self.processing_strategy
        if value is None:
            return "UNSPECIFIED"
        if isinstance(value, int):
            return PROCESSING_STRATEGIES.get(value, str(value))
        return value

    def to_event(self, received_at: float) -> HealthEvent:
        component_ids = [f"{e.entity_type}:{e.entity_value}" for e in self.entities_impacted]
        message = f"{self.agent}: {self.message}".rstrip() if self.agent else self.message
        if self.strategy_name() == "STORE_ONLY":
            # NVSentinel's "observe, do not act" marker has no field in HealthEvent yet.
            message += " [STORE_ONLY]"
        when = self.generated_timestamp
        return HealthEvent(
            # Without the source's timestamp two identical reports are only told apart by arrival.
            event_id=stable_id(
                "nvs",
                self.node_name,
                self.check_name,
                when if when is not None else f"recv:{received_at}",
                self.agent,
                self.component_class,
                self.error_code,
                component_ids,
                self.is_fatal,
                self.is_healthy,
                self.message,
            ),
            event_time=when if when is not None else received_at,
            origin="nvsentinel",
            node=self.node_name,
            check_name=self.check_name,
            component=self.component_class or None,
            component_ids=component_ids,
            error_codes=list(self.error_code),
            is_fatal=self.is_fatal,
            is_healthy=self.is_healthy,
            recommended_action=self.action_name(),
            message=message[:_MESSAGE_MAX],
        )


class NVSentinelBatch(_Camel):
    """NVSentinel's ``HealthEvents`` message: the gRPC batch, as JSON."""

    version: int | str | None = None
    events: list[NVSentinelHealthEvent] = Field(min_length=1, max_length=MAX_ITEMS)


class _CloudEventData(_Camel):
    health_event: NVSentinelHealthEvent


class NVSentinelCloudEvent(_Camel):
    """The CloudEvents 1.0 envelope of NVSentinel's event-exporter (only `data.healthEvent` is used)."""

    specversion: Literal["1.0"]
    data: _CloudEventData


# --------------------------------------------------------------------- NVRx models
Score = Annotated[float, Field(ge=0.0, le=1.0)]
_JOB_ID = r"^[0-9]{1,20}([_+][0-9]{1,10})?$"
JOB_ID_RE = re.compile(_JOB_ID)


class NVRxScores(BaseModel):
    """Per-rank performance scores in 0..1, named after NVRx's straggler ``Report``:
    gpu_relative_perf_scores, gpu_individual_perf_scores, section_relative_perf_scores,
    section_individual_perf_scores (1.0 = as fast as the reference, 0.5 = half as fast)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    gpu_relative: Score | None = None
    gpu_individual: Score | None = None
    section_relative: dict[Annotated[str, Field(min_length=1, max_length=128)], Score] = Field(
        default_factory=dict, max_length=256
    )
    section_individual: dict[Annotated[str, Field(min_length=1, max_length=128)], Score] = Field(
        default_factory=dict, max_length=256
    )

    def named(self) -> list[tuple[str, float]]:
        out = [
            (k, v)
            for k, v in (("gpu_relative", self.gpu_relative), ("gpu_individual", self.gpu_individual))
            if v is not None
        ]
        out += [(f"section_relative.{k}", v) for k, v in sorted(self.section_relative.items())]
        out += [(f"section_individual.{k}", v) for k, v in sorted(self.section_individual.items())]
        return out


class NVRxReport(BaseModel):
    """One rank's NVRx report: a straggler verdict with scores, or a fault (hang, rank failure, ...)."""

    # Our own shape: unknown fields are typos, so they are refused.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    kind: Literal["straggler", "fault"]
    node: NodeNameInput  # a Slurm node name (schemas.ids)
    timestamp: float
    job_id: str | None = Field(default=None, pattern=_JOB_ID)
    rank: int | None = Field(default=None, ge=0, le=10_000_000)
    message: str = Field(default="", max_length=_MESSAGE_MAX)
    scores: NVRxScores | None = Field(default=None, validate_default=True)
    threshold: Score = 0.75  # NVRx identify_stragglers' default
    fault_type: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,64}$", validate_default=True)
    fatal: bool = True

    @field_validator("timestamp", mode="before")
    @classmethod
    def _timestamp(cls, value: object) -> float:
        return parse_timestamp(value)

    @field_validator("scores")
    @classmethod
    def _scores_for_stragglers(cls, value: NVRxScores | None, info: ValidationInfo) -> NVRxScores | None:
        if info.data.get("kind") == "straggler" and (value is None or not value.named()):
            raise ValueError("a straggler report needs at least one score")
        return value

    @field_validator("fault_type")
    @classmethod
    def _type_for_faults(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("kind") == "fault" and not value:
            raise ValueError("a fault report needs fault_type (e.g. hang, rank_failure)")
        return value

    def to_event(self) -> HealthEvent:
        scores = self.scores.named() if self.scores else []
        slow = [name for name, value in scores if value < self.threshold]
        score_text = " ".join(f"{name}={value:.3f}" for name, value in scores)
        ids = [f"rank:{self.rank}"] if self.rank is not None else []
        if self.kind == "straggler":
            check = "nvrx_straggler"
            component = "GPU" if self.scores and self.scores.gpu_relative is not None else "section"
            ids += [f"section:{n.split('.', 1)[1]}" for n in slow if n.startswith("section_")]
            codes = list(dict.fromkeys(f"STRAGGLER_{n.split('.', 1)[0].upper()}" for n in slow))
            fatal, healthy = False, not slow
        else:
            check, component = "nvrx_fault", "rank"
            codes = [str(self.fault_type)]
            fatal, healthy = self.fatal, False
        text = self.message
        if score_text:
            text = f"{text} (scores: {score_text}; threshold {self.threshold:g})".lstrip()
        return HealthEvent(
            event_id=stable_id(
                "nvrx",
                self.kind,
                self.node,
                self.job_id,
                self.rank,
                self.timestamp,
                self.fault_type,
                score_text,
                self.message,
            ),
            event_time=self.timestamp,
            origin="nvrx",
            node=self.node,
            check_name=check,
            component=component,
            component_ids=ids,
            error_codes=codes,
            is_fatal=fatal,
            is_healthy=healthy,
            message=text[:_MESSAGE_MAX],
            job_id=self.job_id,
            rank=self.rank,
        )


class NVRxBatch(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    reports: list[NVRxReport] = Field(min_length=1, max_length=MAX_ITEMS)


# --------------------------------------------------------------------- parsing bodies
class _BadRequest(UsageError):
    def __init__(self, reason: str, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.reason = reason
        self.field = field
        self.problem = problem


def _validate(model: type[BaseModel], data: Mapping[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "<body>"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        problem = str(err["msg"]).removeprefix("Value error, ")
        raise _BadRequest("invalid_field", where, f"{problem}{more}") from None


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _BadRequest("invalid_json", "<body>", f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _BadRequest("invalid_json", "<body>", f"expected a JSON object, got {type(data).__name__}")
    return data


def parse_nvsentinel(body: bytes, received_at: float) -> list[HealthEvent]:
    data = _json_object(body)
    if "specversion" in data:
        cloud: NVSentinelCloudEvent = _validate(NVSentinelCloudEvent, data)
        items = [cloud.data.health_event]
    elif "events" in data:
        items = list(_validate(NVSentinelBatch, data).events)
    else:
        items = [_validate(NVSentinelHealthEvent, data)]
    return [item.to_event(received_at) for item in items]


def parse_nvrx(body: bytes, received_at: float) -> list[HealthEvent]:
    # received_at is unused: an NVRx report must carry its own timestamp (its id depends on it).
    data = _json_object(body)
    reports = list(_validate(NVRxBatch, data).reports) if "reports" in data else [_validate(NVRxReport, data)]
    return [r.to_event() for r in reports]


# --------------------------------------------------------------------- the app
@dataclass
class IngestStats:
    """Counters: accepted events by origin, rejected requests by reason."""

    # Mirrored to Prometheus (trainmedic_producer_ingest_*) for the probe listener's /metrics.
    accepted: Counter[str] = field(default_factory=lambda: MirroredCounter(INGEST_ACCEPTED, "ingest"))
    rejected: Counter[str] = field(default_factory=lambda: MirroredCounter(INGEST_REJECTED, "ingest"))
    requests: int = 0

    def prometheus(self) -> str:
        lines = [
            "# HELP trainmedic_ingest_accepted_total Events accepted and queued for Kafka, by origin.",
            "# TYPE trainmedic_ingest_accepted_total counter",
        ]
        lines += [f'trainmedic_ingest_accepted_total{{origin="{k}"}} {v}' for k, v in sorted(self.accepted.items())]
        lines += [
            "# HELP trainmedic_ingest_rejected_total Requests refused, by reason.",
            "# TYPE trainmedic_ingest_rejected_total counter",
        ]
        lines += [f'trainmedic_ingest_rejected_total{{reason="{k}"}} {v}' for k, v in sorted(self.rejected.items())]
        lines += [
            "# HELP trainmedic_ingest_requests_total Requests to the ingest endpoints.",
            "# TYPE trainmedic_ingest_requests_total counter",
            f"trainmedic_ingest_requests_total {self.requests}",
        ]
        return "\n".join(lines) + "\n"


STATS_KEY = web.AppKey("stats", IngestStats)


def _error(status: int, reason: str, **extra: Any) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="trainmedic-ingest"'} if status == 401 else None
    return web.json_response({"error": reason, **extra}, status=status, headers=headers)


class _RefusalLog:
    """At most one log line per refusal reason per `every_s`, carrying how many were refused since:
    a client hammering the endpoint with bad requests must not flood the log."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = defaultdict(int)

    def __call__(self, level: int, reason: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        self._since[reason] += 1
        if now - self._last.get(reason, -self.every_s) < self.every_s:
            return
        count, self._since[reason] = self._since[reason], 0
        self._last[reason] = now
        suffix = f" ({count} refused for {reason} since the last line)" if count > 1 else ""
        log.log(level, msg + suffix, *args)


def create_app(
    publisher: Publisher, token: str | IngestAuth, *, max_body_bytes: int = MAX_BODY_BYTES
) -> web.Application:
    """The ingest application; `app[STATS_KEY]` holds its counters.

    `token` is the shared ingest token (services only), or an IngestAuth naming every credential
    accepted (producers/ingest_auth.py)."""
    try:
        auth = token if isinstance(token, IngestAuth) else IngestAuth(shared_token=token)
    except ValueError as exc:
        raise IngestConfigError(str(exc)) from None
    stats = IngestStats()
    refused = _RefusalLog()
    records = RefusalRecords()

    def authorized(request: web.Request) -> bool:
        try:
            auth.service(request.headers.get("Authorization", ""))
        except AuthRefused:
            return False
        return True

    async def refuse(request: web.Request, denial: AuthRefused, body: bytes = b"") -> web.Response:
        stats.rejected["unauthorized" if denial.status == 401 else "identity_refused"] += 1
        refused(
            logging.WARNING,
            denial.reason,
            "ingest %s from %s: %d (%s)",
            request.path,
            request.remote or "?",
            denial.status,
            denial.detail,
        )
        if denial.audit and (letter := records.make(request.path, request.remote or "?", denial, body)):
            try:
                await asyncio.get_running_loop().run_in_executor(None, publisher.publish, DEADLETTER, letter)
            except Exception as exc:
                log.error("ingest: recording a refusal failed: %s", exc)
        if denial.status == 401:
            return _error(401, denial.reason, detail=denial.detail)
        return web.json_response({"error": denial.reason, "detail": denial.detail}, status=denial.status)

    def endpoint(
        origin: str, parse: Callable[[bytes, float], list[HealthEvent]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        jobs = origin == "nvrx"  # in-job reporters: each request must be shown to come from its job

        async def handler(request: web.Request) -> web.Response:
            stats.requests += 1
            header = request.headers.get("Authorization", "")
            try:
                if jobs:
                    auth.job_precheck(header)
                else:
                    identity = auth.service(header)
            except AuthRefused as denial:
                return await refuse(request, denial, await _claimed(request) if denial.audit else b"")
            if request.content_length is not None and request.content_length > max_body_bytes:
                stats.rejected["too_large"] += 1
                return _error(413, "too_large", limit_bytes=max_body_bytes)
            # No Content-Type at all is fine; a non-JSON one is a client mistake worth naming.
            declared = "Content-Type" in request.headers
            if declared and request.content_type not in _JSON_TYPES and not request.content_type.endswith("+json"):
                stats.rejected["media_type"] += 1
                return _error(415, "unsupported_media_type", content_type=request.content_type)
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                stats.rejected["too_large"] += 1
                return _error(413, "too_large", limit_bytes=max_body_bytes)
            if len(body) > max_body_bytes:
                stats.rejected["too_large"] += 1
                return _error(413, "too_large", limit_bytes=max_body_bytes)
            try:
                events = parse(body, time.time())
            except _BadRequest as bad:
                stats.rejected[bad.reason] += 1
                refused(
                    logging.INFO,
                    bad.reason,
                    "ingest %s from %s: 400 %s: %s",
                    request.path,
                    request.remote or "?",
                    bad.field,
                    bad.problem,
                )
                return _error(400, bad.reason, field=bad.field, problem=bad.problem)
            if jobs:
                try:
                    # unmunge and scontrol block: off the event loop.
                    identity = await asyncio.get_running_loop().run_in_executor(
                        None, auth.job_report, header, body, events
                    )
                except AuthRefused as denial:
                    return await refuse(request, denial, body)
                except MungeUnavailable as exc:
                    stats.rejected["identity_unavailable"] += 1
                    log.error("ingest %s: cannot check the caller's identity: %s", request.path, exc)
                    return _error(503, "identity_unavailable")
            events = [e.model_copy(update={"authenticated_as": identity.kind}) for e in events]
            try:
                # Publisher.publish can block while librdkafka's queue is full: not on the event loop.
                await asyncio.get_running_loop().run_in_executor(None, _publish_all, publisher, events)
            except Exception as exc:
                stats.rejected["publish_error"] += 1
                log.error("ingest %s: publishing failed: %s", request.path, exc)
                return _error(503, "publish_failed")
            stats.accepted[origin] += len(events)
            ids = [e.event_id for e in events]
            body_out: dict[str, Any] = {"accepted": len(ids), "event_ids": ids}
            if len(ids) == 1:
                body_out["event_id"] = ids[0]
            return web.json_response(body_out, status=202)

        return handler

    async def token_endpoint(request: web.Request) -> web.Response:
        # OAuth2 client credentials (RFC 6749 4.4): secret in HTTP Basic or in the form.
        stats.requests += 1
        if request.content_length is not None and request.content_length > 16384:
            stats.rejected["too_large"] += 1
            return _error(413, "too_large", limit_bytes=16384)
        form = await request.post()
        presented = str(form.get("client_secret") or "")
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "basic":
            try:
                presented = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                presented = ""
        if form.get("grant_type") != "client_credentials":
            stats.rejected["bad_grant"] += 1
            return web.json_response({"error": "unsupported_grant_type"}, status=400)
        if not auth.client_secret_ok(presented):
            stats.rejected["unauthorized"] += 1
            refused(
                logging.WARNING,
                "invalid_client",
                "ingest /oauth2/token from %s: 401 (wrong client secret)",
                request.remote or "?",
            )
            return web.json_response({"error": "invalid_client"}, status=401)
        access, expires_in = auth.issue_access_token()  # derived from the secret, never the secret
        return web.json_response(
            {"access_token": access, "token_type": "Bearer", "expires_in": expires_in},
            headers={"Cache-Control": "no-store", "Pragma": "no-cache"},
        )

    async def metrics(request: web.Request) -> web.Response:
        if not authorized(request):
            stats.rejected["unauthorized"] += 1
            return _error(401, "unauthorized")
        return web.Response(text=stats.prometheus(), content_type="text/plain")

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    # client_max_size bounds what request.read()/post() accept, chunked bodies included.
    app = web.Application(client_max_size=max_body_bytes)
    app[STATS_KEY] = stats
    app.router.add_post("/v1/nvsentinel", endpoint("nvsentinel", parse_nvsentinel))
    app.router.add_post("/v1/nvrx", endpoint("nvrx", parse_nvrx))
    app.router.add_post("/oauth2/token", token_endpoint)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app


async def _claimed(request: web.Request) -> bytes:
    """What a refused job report claimed (its body, for the refusal's record); empty if unreadable."""
    try:
        return await request.read()
    except web.HTTPException:
        return b""


def _publish_all(publisher: Publisher, events: list[HealthEvent]) -> None:
    for event in events:
        publisher.publish(HEALTH_EXTERNAL, event)


# --------------------------------------------------------------------- serving
def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name could resolve anywhere


def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise IngestConfigError("--tls-cert and --tls-key go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise IngestConfigError(f"--tls-cert {cert} / --tls-key {key}: {exc}") from None
    return context


def check_bind(host: str, tls: bool, allow_insecure: bool) -> None:
    """Refuse plaintext bearer tokens on a network-facing address."""
    if _is_loopback(host) or tls or allow_insecure:
        return
    raise IngestConfigError(
        f"refusing to listen on {host} without TLS: bearer tokens would cross the network in clear text; "
        "give --tls-cert and --tls-key, or --insecure to accept that"
    )


def load_token(token_file: Path | None = None, env: Mapping[str, str] | None = None) -> str:
    """The token from a file (its first line) or $TRAINMEDIC_INGEST_TOKEN; never from argv (ps shows argv)."""
    if token_file is not None:
        try:
            lines = Path(token_file).read_text().splitlines()
        except OSError as exc:
            raise IngestConfigError(f"--token-file {token_file}: {exc}") from None
        token = lines[0].strip() if lines else ""
        if not token:
            raise IngestConfigError(f"--token-file {token_file}: the first line is empty")
        remember(token)  # masked in whatever this process prints (schemas/masking.py)
        return token
    token = (os.environ if env is None else env).get(TOKEN_ENV, "").strip()
    if not token:
        raise IngestConfigError(f"no ingest token: set {TOKEN_ENV} or give --token-file")
    remember(token)
    return token


class IngestServer:
    """Serves an app on its own event loop in a background thread (for the CLI and tests)."""

    def __init__(
        self,
        app: web.Application,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> IngestServer:
        self._thread = threading.Thread(target=self._serve, name="trainmedic-ingest", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"ingest server did not start within {timeout:g}s")
        if self._error is not None:
            raise IngestConfigError(f"cannot listen on {self.host}:{self.port}: {self._error}")
        return self

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._bind())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            if self._runner is not None:
                loop.run_until_complete(self._runner.cleanup())
            loop.close()

    async def _bind(self) -> None:
        runner = web.AppRunner(self.app, access_log=None)  # one (rate-limited) line per refusal, not two
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, ssl_context=self.ssl_context)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)


def run_ingest(
    publisher: Publisher,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | IngestAuth = "",
    *,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    allow_insecure: bool = False,
    max_body_bytes: int = MAX_BODY_BYTES,
    stop_event: threading.Event | None = None,
    on_ready: Callable[[IngestServer], None] | None = None,
) -> IngestStats:
    """Serve until `stop_event` is set (or KeyboardInterrupt); returns the counters.

    Raises IngestConfigError before listening when a setting is unsafe or wrong.
    """
    context = tls_context(tls_cert, tls_key)
    check_bind(host, context is not None, allow_insecure)
    app = create_app(publisher, token, max_body_bytes=max_body_bytes)
    server = IngestServer(app, host, port, context).start()
    log.info("ingest listening on %s (POST /v1/nvsentinel, /v1/nvrx)", server.url)
    if on_ready is not None:
        on_ready(server)
    stop = stop_event or threading.Event()
    liveness = ProducerHealth("ingest", 1.0, KAFKA_CHECK_TIMEOUT_S)
    kafka = AdminClient(admin_config(publisher.bootstrap))
    next_check = 0.0
    try:
        while True:
            # Ready while listening (it is, from here on) and Kafka answers a metadata request.
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + KAFKA_CHECK_EVERY_S
                why = _kafka_unreachable(kafka)
                if why is None:
                    liveness.ok(0, f"listening on {server.url}, Kafka reachable")
                else:
                    POLL_FAILURES.labels("ingest", "kafka").inc()
                    liveness.failed(why)
            else:
                liveness.idle()
            if stop.wait(1.0):
                break
    finally:
        liveness.stop()
        server.stop()
        publisher.flush(10.0)
    return app[STATS_KEY]


KAFKA_CHECK_EVERY_S = 10.0
KAFKA_CHECK_TIMEOUT_S = 5.0


def _kafka_unreachable(kafka: AdminClient) -> str | None:
    """None when the brokers answer a metadata request, else why not."""
    try:
        kafka.list_topics(timeout=KAFKA_CHECK_TIMEOUT_S)
    except KafkaException as exc:
        return f"Kafka does not answer: {exc}"
    return None
