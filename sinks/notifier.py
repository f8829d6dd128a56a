"""The webhook notifier: incidents, guardrail trips and escalations POSTed to webhooks.

A consumer group over `incidents`, `guardrail.trips` and `decisions`. Each event of interest
(every Incident, every GuardrailTrip, and a Decision that stopped a job on its restart budget:
an escalation to a human) is rendered per endpoint (`generic`, `slack` or `pagerduty`) and
POSTed as JSON. Delivery is at least once: a record's offset is committed only after every
endpoint has accepted the event (2xx), refused it (a 4xx other than 408/429: not retried) or
been given up on after the configured attempts; a crash before that re-sends it. Every request
carries an `Idempotency-Key` derived from the event id and the endpoint, identical on every
retry and every redelivery, so receivers can drop the duplicates at-least-once implies.

An event refused or given up on is logged at ERROR (endpoint label, status) and, unless the
config says `dead_letter: false`, published to `deadletter` (component `sinks.notifier`, the
original record as payload) through the project's Publisher. An undecodable record is logged
and skipped: the audit sink already keeps it as a dead letter (all three topics are audited).

HTTP client: httpx (sync `httpx.Client`, a declared dependency of trainmedic[server]); redirects
are not followed (a redirect could carry the bearer token elsewhere): a 3xx is a refusal.

Pure layer (unit-testable without a broker): `kind_of`, `summary`, `render`,
`idempotency_key`, `request_headers`, `deliver`; configuration: `NotifierConfig`,
`parse_config`, `load_config`, `read_token`; service: `Notifier` (`run`/`stop`/`poll_once`).
Run it: `trainmedic run notifier --webhooks notifier.yaml` (docs/notifier.md).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

import httpx
import orjson
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from bus import health
from bus.deadletter import make_dead_letter
from bus.publish import Publisher
from bus.watchdog import WatchedConsumer
from schemas.codec import DecodeError, decode
from schemas.errors import ConfigError
from schemas.events import Decision, Event, GuardrailTrip, Incident
from schemas.ids import DEFAULT_CLUSTER, cluster_scoped, current_cluster, stable_id
from schemas.masking import remember
from schemas.topics import DEADLETTER, DECISIONS, GUARDRAIL_TRIPS, INCIDENTS, Topic
from schemas.vocab import Severity
from schemas.yamlsafe import FILE_LIMITS, YamlError, compose_yaml, construct_yaml, line_of

log = logging.getLogger("trainmedic.notifier")

Kind = Literal["incident", "guardrail_trip", "escalation"]
TemplateName = Literal["generic", "slack", "pagerduty"]
KINDS: tuple[Kind, ...] = get_args(Kind)
TEMPLATES: tuple[str, ...] = get_args(TemplateName)
COMPONENT = "sinks.notifier"
USER_AGENT = "trainmedic-notifier"
# What streams/policy.py `decide` appends to a rule when it stops a job for a human: its restart
# budget is spent, or its restarts made no progress.
ESCALATION_MARK = "stop and escalate"
_BUDGET_RE = re.compile(r"\(((?:restart budget|no progress): .*?): stop and escalate\)")
# The topics and the kind each may carry.
TOPIC_KIND: dict[str, tuple[Topic, Kind]] = {
    INCIDENTS.name: (INCIDENTS, "incident"),
    GUARDRAIL_TRIPS.name: (GUARDRAIL_TRIPS, "guardrail_trip"),
    DECISIONS.name: (DECISIONS, "escalation"),
}
# One line of printable ASCII without spaces: a token must not be able to inject a header.
_TOKEN_RE = re.compile(r"^[\x21-\x7e]+$")
_TOKEN_MAX_BYTES = 64 * 1024
# PagerDuty's summary limit; Slack's limits on section text and field text.
PD_SUMMARY_MAX = 1024
SLACK_TEXT_MAX = 2900
SLACK_FIELD_MAX = 1900


class NotifierConfigError(ConfigError, ValueError):
    """A notifier config or token file that cannot be used; the message names the file and field."""


# --- configuration ---------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether a URL's host is this machine: `localhost` (and `*.localhost`) or a loopback address."""
    h = host.strip("[]").lower().rstrip(".")
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


class Endpoint(BaseModel):
    """One webhook. Fields are declared in the order they are checked (`url` needs `insecure`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # In logs and counters; default: the URL's scheme, host and port (never its path, which for
    # Slack is the secret).
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    template: TemplateName = "generic"
    # Plain http to a host other than this machine: only with this set (tokens would travel in clear).
    insecure: bool = False
    url: str = Field(min_length=1, max_length=2048)
    # A file holding the bearer token (mode 0600 or stricter); relative to the config file's folder.
    token_file: Path | None = None
    # PagerDuty Events API v2 integration key: required by, and only used by, the pagerduty template.
    routing_key: str | None = Field(default=None, validate_default=True)
    timeout_s: float = Field(default=10.0, gt=0, le=120)
    kinds: tuple[Kind, ...] = Field(default=KINDS, min_length=1)

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str, info: ValidationInfo) -> str:
        try:
            parts = urlsplit(url)
            host = parts.hostname
            _ = parts.port  # a port that is not a number fails here
        except ValueError as exc:
            raise ValueError(f"not a valid URL ({exc})") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"scheme {parts.scheme or '(none)'!r} refused: only http:// and https:// URLs")
        if not host:
            raise ValueError("the URL names no host")
        if parts.username is not None or parts.password is not None:
            raise ValueError("credentials in the URL are refused (they would be logged): use token_file")
        if parts.scheme == "http" and not is_loopback(host) and not info.data.get("insecure", False):
            raise ValueError(
                f"plain http to {host}, which is not this machine, would send the token and the events in "
                "clear text: use https, or set `insecure: true` on this endpoint"
            )
        return url

    @field_validator("routing_key")
    @classmethod
    def _check_routing_key(cls, key: str | None, info: ValidationInfo) -> str | None:
        template = info.data.get("template")
        if template == "pagerduty" and not key:
            raise ValueError("the pagerduty template needs the integration's routing_key")
        if key is not None and template != "pagerduty":
            raise ValueError(f"only the pagerduty template uses a routing_key (this endpoint's is {template})")
        if key is not None and not _TOKEN_RE.match(key):
            raise ValueError("must be one word of printable ASCII")
        return key

    @property
    def label(self) -> str:
        """How logs and counters name the endpoint: its name, else scheme://host[:port]."""
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        host = parts.hostname or "?"
        host = f"[{host}]" if ":" in host else host
        return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


class RetrySettings(BaseModel):
    """Exponential backoff: the n-th retry waits base_delay_s * 2**(n-1), at most max_delay_s
    (a 429/503's numeric Retry-After is honoured up to max_delay_s)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: int = Field(default=5, ge=1, le=50)  # requests per event and endpoint, the first included
    base_delay_s: float = Field(default=1.0, gt=0, le=600)
    max_delay_s: float = Field(default=60.0, gt=0, le=3600)

    def delay(self, failed_attempts: int) -> float:
        """The wait after the `failed_attempts`-th failed request (1-based)."""
        return float(min(self.max_delay_s, self.base_delay_s * 2 ** (failed_attempts - 1)))


class NotifierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoints: list[Endpoint] = Field(min_length=1)
    retry: RetrySettings = RetrySettings()
    # Events produced longer ago than this are skipped, not sent (a new consumer group starts at
    # the topics' beginning: without it a first start would page for the whole retention).
    # null: send whatever the group has not committed, however old.
    max_age_s: float | None = Field(default=6 * 3600.0, gt=0)
    # Refused and given-up events are also published to `deadletter`.
    dead_letter: bool = True

    @field_validator("endpoints")
    @classmethod
    def _distinct(cls, endpoints: list[Endpoint]) -> list[Endpoint]:
        for i, ep in enumerate(endpoints):
            for j in range(i):
                if endpoints[j].url == ep.url:
                    raise ValueError(f"endpoints {j} and {i} have the same url")
                if endpoints[j].label == ep.label:
                    raise ValueError(
                        f"endpoints {j} and {i} are both called {ep.label!r} in logs and counts: give them a name"
                    )
        return endpoints

    def topics(self) -> list[str]:
        """The topics the endpoints' kinds need."""
        kinds = {k for ep in self.endpoints for k in ep.kinds}
        return sorted(name for name, (_, kind) in TOPIC_KIND.items() if kind in kinds)

    def worst_case_s(self) -> float:
        """The longest one event can take to be delivered or given up on, all endpoints together."""
        r = self.retry
        waits = sum(r.delay(n) for n in range(1, r.attempts))
        return sum(r.attempts * ep.timeout_s + waits for ep in self.endpoints)


def read_token(path: Path) -> str:
    """The bearer token in `path`. As trainmedic/web/api.py's token files: a file that group or others
    may read or write is refused (fail closed: the token may already have leaked)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise NotifierConfigError(f"{path}: cannot read token file: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise NotifierConfigError(f"{path}: token file is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise NotifierConfigError(
            f"{path}: mode {mode:04o} lets other users read or change the token; refused. If nobody else "
            f"could have read it, `chmod 600 {path}`; otherwise rotate the token"
        )
    if st.st_size > _TOKEN_MAX_BYTES:
        raise NotifierConfigError(f"{path}: {st.st_size} bytes is no token file")
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise NotifierConfigError(f"{path}: cannot read token file: {exc}") from None
    if not token:
        raise NotifierConfigError(f"{path}: token file is empty")
    if not _TOKEN_RE.match(token):
        raise NotifierConfigError(f"{path}: the token must be one line of printable ASCII without spaces")
    remember(token)  # masked in whatever this process prints (schemas/masking.py)
    return token


def parse_config(text: str | bytes, origin: str = "<notifier config>", base: Path | None = None) -> NotifierConfig:
    """A notifier config from YAML; token files (relative ones resolved against `base`) are read
    and checked now. Errors: NotifierConfigError 'ORIGIN: line N: field 'a.0.b': problem'."""
    try:
        root = compose_yaml(text, origin, FILE_LIMITS)
        data = construct_yaml(root, origin)
    except YamlError as exc:
        raise NotifierConfigError(str(exc)) from None
    if not isinstance(data, dict):
        raise NotifierConfigError(f"{origin}: line 1: expected a mapping with 'endpoints'")
    try:
        config = NotifierConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        field = ".".join(str(p) for p in loc) or "<root>"
        msg = str(err["msg"]).removeprefix("Value error, ")
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise NotifierConfigError(f"{origin}: line {line_of(root, loc)}: field '{field}': {msg}{more}") from None
    endpoints = []
    for i, ep in enumerate(config.endpoints):
        if ep.token_file is not None:
            path = ep.token_file if ep.token_file.is_absolute() or base is None else base / ep.token_file
            try:
                read_token(path)
            except NotifierConfigError as exc:
                loc = ("endpoints", i, "token_file")
                raise NotifierConfigError(
                    f"{origin}: line {line_of(root, loc)}: field 'endpoints.{i}.token_file': {exc}"
                ) from None
            ep = ep.model_copy(update={"token_file": path})
        remember(ep.routing_key, ep.url)  # the key, and any password or token the URL's query holds
        endpoints.append(ep)
    return config.model_copy(update={"endpoints": endpoints})


def load_config(path: Path | str) -> NotifierConfig:
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise NotifierConfigError(f"{p}: cannot read notifier config: {exc.strerror}") from None
    return parse_config(text, str(p), base=p.parent)


# --- what is sent ------------------------------------------------------------------------


def is_escalation(decision: Decision) -> bool:
    """The policy stopped the job for a human: its restart budget is spent, or its restarts made no progress."""
    return decision.action in ("stop", "drain_and_stop") and ESCALATION_MARK in decision.rule


def kind_of(event: Event) -> Kind | None:
    """The notification kind of an event, None when it is not one to notify."""
    if isinstance(event, Incident):
        return "incident"
    if isinstance(event, GuardrailTrip):
        return "guardrail_trip"
    if isinstance(event, Decision) and is_escalation(event):
        return "escalation"
    return None


def idempotency_key(event: Event, endpoint: Endpoint) -> str:
    """Stable per (event, endpoint): the same on every retry, redelivery and restart."""
    return stable_id("ntf", event.event_id, endpoint.url)


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _job(job_id: str | None) -> str:
    return f"job {job_id}" if job_id else "no job"


def _prefix(event: Event) -> str:
    return "trainmedic" if event.cluster == DEFAULT_CLUSTER else f"trainmedic ({event.cluster})"


def summary(kind: Kind, event: Event) -> str:
    """One readable line, e.g. 'trainmedic incident inc-...: gpu_hardware on gpu02 (job 1234), confidence 0.95'."""
    p = _prefix(event)
    if kind == "incident" and isinstance(event, Incident):
        where = event.culprit_node or "no node named"
        text = (
            f"{p} incident {event.incident_id}: {event.category} on {where} ({_job(event.job_id)}), "
            f"confidence {event.confidence:.2f}"
        )
    elif kind == "guardrail_trip" and isinstance(event, GuardrailTrip):
        target = ", ".join(x for x in (_job(event.job_id), f"node {event.node}" if event.node else "") if x)
        text = (
            f"{p} guardrail {event.guardrail} refused {event.action} for incident {event.incident_id} "
            f"({target}): {event.detail}"
        )
    elif kind == "escalation" and isinstance(event, Decision):
        how = "held" if event.stop_mode == "hold" else "cancelled"
        done = f"{_job(event.job_id)} {how}" if event.executed else f"stopping {_job(event.job_id)} recommended"
        m = _BUDGET_RE.search(event.rule)
        budget = m.group(1) if m else "restart budget spent"
        text = (
            f"{p} escalation: {done} for a human after incident {event.incident_id}: {event.category} on "
            f"{event.culprit_node or 'no node named'}, {budget}"
        )
    else:
        raise TypeError(f"a {type(event).__name__} is no {kind} notification")
    return _one_line(text, PD_SUMMARY_MAX)


def severity(kind: Kind, event: Event) -> Severity:
    """PagerDuty's severity (critical/error/warning/info): an incident's own; a guardrail trip
    warning (the automation did not act); an escalation critical (a job waits for a human)."""
    if isinstance(event, Incident):
        return event.severity
    return "critical" if kind == "escalation" else "warning"


def _source(event: Event) -> str:
    node = getattr(event, "culprit_node", None) or getattr(event, "node", None)
    job = getattr(event, "job_id", None)
    return str(node) if node else (f"job {job}" if job else f"cluster {event.cluster}")


def _component(kind: Kind, event: Event) -> str:
    if isinstance(event, GuardrailTrip):
        return f"guardrail {event.guardrail}"
    gpu = getattr(event, "culprit_gpu", None)
    category = str(getattr(event, "category", kind))
    return f"{category} (GPU {gpu})" if gpu is not None else category


def _details(event: Event) -> dict[str, Any]:
    """The event's fields for custom_details; an incident's evidence list is counted, not copied."""
    if isinstance(event, Incident):
        out = event.model_dump(mode="json", exclude={"evidence", "anomaly_ids"})
        out["evidence_count"] = len(event.evidence)
        return out
    return event.model_dump(mode="json")


def _facts(kind: Kind, event: Event) -> tuple[str, list[tuple[str, str]]]:
    """A longer text and (label, value) pairs for chat templates."""
    culprit = ""
    if isinstance(event, Incident | Decision):
        culprit = ", ".join(
            x
            for x in (
                event.culprit_node or "",
                f"rank {event.culprit_rank}" if event.culprit_rank is not None else "",
                f"GPU {event.culprit_gpu}" if event.culprit_gpu is not None else "",
            )
            if x
        )
    if isinstance(event, Incident):
        return event.explanation, [
            ("Job", event.job_id or "-"),
            ("Partition", event.partition or "-"),
            ("Culprit", culprit or "-"),
            ("Category", event.category),
            ("Severity", event.severity),
            ("Confidence", f"{event.confidence:.2f}"),
        ]
    if isinstance(event, GuardrailTrip):
        return event.detail, [
            ("Guardrail", event.guardrail),
            ("Action", event.action),
            ("Job", event.job_id or "-"),
            ("Node", event.node or "-"),
            ("Partition", event.partition or "-"),
            ("Incident", event.incident_id),
        ]
    if isinstance(event, Decision):
        return f"{event.rule}. {event.reason}", [
            ("Job", event.job_id or "-"),
            ("Partition", event.partition or "-"),
            ("Culprit", culprit or "-"),
            ("Category", event.category),
            ("Stop", f"{event.stop_mode} ({'done' if event.executed else 'recommended, mode ' + event.mode})"),
            ("Incident", event.incident_id),
        ]
    raise TypeError(f"a {type(event).__name__} is no {kind} notification")


def _mrkdwn(text: str, limit: int) -> str:
    """Slack's three escapes, after cutting to the limit (an escape is never cut in two)."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def render(kind: Kind, event: Event, endpoint: Endpoint) -> dict[str, Any]:
    """The JSON body for `endpoint`'s template (docs/notifier.md shows one of each)."""
    key = idempotency_key(event, endpoint)
    line = summary(kind, event)
    if endpoint.template == "generic":
        return {
            "kind": kind,
            "idempotency_key": key,
            "summary": line,
            "severity": severity(kind, event),
            "event": event.model_dump(mode="json"),
        }
    if endpoint.template == "slack":
        text, facts = _facts(kind, event)
        return {
            "text": line,
            "blocks": [
                {"type": "section", "text": {"type": "mrkdwn", "text": _mrkdwn(line, SLACK_TEXT_MAX)}},
                {"type": "section", "text": {"type": "mrkdwn", "text": _mrkdwn(text or "-", SLACK_TEXT_MAX)}},
                {
                    "type": "section",
                    "fields": [
                        {"type": "mrkdwn", "text": f"*{label}*\n{_mrkdwn(value, SLACK_FIELD_MAX)}"}
                        for label, value in facts
                    ],
                },
                {
                    "type": "context",
                    "elements": [
                        {
                            "type": "mrkdwn",
                            "text": _mrkdwn(f"{kind} {event.event_id} | cluster {event.cluster} | key {key}", 300),
                        }
                    ],
                },
            ],
        }
    if endpoint.template == "pagerduty":
        payload: dict[str, Any] = {
            "summary": line,
            "source": _source(event),
            "severity": severity(kind, event),
            "timestamp": datetime.fromtimestamp(event.event_time, UTC).isoformat(),
            "component": _component(kind, event),
            "class": kind,
            "custom_details": _details(event),
        }
        if partition := getattr(event, "partition", None):
            payload["group"] = partition
        return {
            "routing_key": endpoint.routing_key,
            "event_action": "trigger",
            "dedup_key": key,
            "client": "trainmedic",
            "payload": payload,
        }
    raise ValueError(f"unknown template {endpoint.template!r} (templates: {', '.join(TEMPLATES)})")


def request_headers(key: str, token: str | None) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "Idempotency-Key": key,
    }
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


# --- delivery ---------------------------------------------------------------------------

Status = Literal["sent", "refused", "given_up", "interrupted"]


@dataclass(frozen=True)
class Outcome:
    """How one event went to one endpoint. `refused`: a non-retryable answer (4xx other than
    408/429, 3xx); `given_up`: every attempt failed retryably; `interrupted`: stopping while
    waiting to retry (not committed: sent again after the restart)."""

    status: Status
    attempts: int
    http_status: int | None = None
    detail: str = ""


def retryable(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("Retry-After", "")
    return float(value) if value.isdigit() else None


def _answer(resp: httpx.Response) -> str:
    body = _one_line(resp.text, 200) if resp.content else ""
    return f"HTTP {resp.status_code}" + (f": {body}" if body else "")


def _no_wait(seconds: float) -> bool:
    time.sleep(seconds)
    return False


def deliver(
    client: httpx.Client,
    endpoint: Endpoint,
    body: dict[str, Any],
    key: str,
    token: str | None,
    retry: RetrySettings,
    wait: Callable[[float], bool] = _no_wait,
    on_retry: Callable[[int, str], None] | None = None,
) -> Outcome:
    """POST `body` to `endpoint` until it is accepted, refused or the attempts are spent.

    `wait(seconds)` sleeps between attempts and returns True to stop (threading.Event.wait);
    `on_retry(failed_attempts, why)` is told of each retry. Never raises for HTTP or transport
    failures: they are the Outcome."""
    data = orjson.dumps(body)
    headers = request_headers(key, token)
    status: int | None = None
    detail = ""
    for attempt in range(1, retry.attempts + 1):
        hint: float | None = None
        try:
            resp = client.post(endpoint.url, content=data, headers=headers, timeout=endpoint.timeout_s)
        except httpx.TimeoutException as exc:
            status, detail = None, f"no answer in {endpoint.timeout_s:g} s ({type(exc).__name__})"
        except httpx.HTTPError as exc:  # connection refused or reset, DNS, TLS, protocol errors
            status, detail = None, f"{type(exc).__name__}: {_one_line(str(exc), 200)}"
        else:
            status, detail = resp.status_code, _answer(resp)
            if 200 <= resp.status_code < 300:
                return Outcome("sent", attempt, status)
            if not retryable(resp.status_code):
                return Outcome("refused", attempt, status, detail)
            hint = _retry_after(resp)
        if attempt == retry.attempts:
            break
        delay = retry.delay(attempt)
        if hint is not None:
            delay = max(delay, min(hint, retry.max_delay_s))
        if on_retry is not None:
            on_retry(attempt, detail)
        if wait(delay):
            return Outcome("interrupted", attempt, status, detail)
    return Outcome("given_up", retry.attempts, status, detail)


# --- the service ------------------------------------------------------------------------


class Notifier:
    """Consumer group over the notified topics, POSTing each event of interest to the endpoints.

    Records are handled in order, one endpoint after another; a batch's offsets are committed
    once every record of it is handled (sent, refused or given up on everywhere). `stop()`
    interrupts a retry wait; the record being retried is not committed and is sent again (same
    Idempotency-Key) by whoever consumes it next. Counters per endpoint label: `sent`,
    `retried` (retries, not events), `refused`, `given_up`; and `undecodable`, `foreign`
    (another cluster's events), `stale` (older than max_age_s), `dead_lettered`.
    """

    def __init__(
        self,
        bootstrap: str,
        config: NotifierConfig,
        group: str = "trainmedic-notifier",
        publisher: Publisher | None = None,
        client: httpx.Client | None = None,
        batch_max: int = 50,
    ) -> None:
        self.config = config
        self.batch_max = batch_max
        # Read now: a token file that is missing or too open stops the start, not the first page.
        self._tokens = [read_token(ep.token_file) if ep.token_file else None for ep in config.endpoints]
        self.topics = config.topics()
        worst = config.worst_case_s()
        # librdkafka evicts a member that does not poll for max.poll.interval.ms: leave room for a
        # whole batch of events that all end up given up on.
        poll_ms = int(min(86_400_000, max(300_000, (worst * batch_max + 60) * 1000)))
        self._bootstrap, self._group, self._poll_ms = bootstrap, cluster_scoped(group), poll_ms
        self._watch: WatchedConsumer | None = None  # subscribed at the first poll
        self._own_publisher = publisher is None and config.dead_letter
        self._publisher = (
            publisher
            if publisher is not None
            else (Publisher(bootstrap, "trainmedic-notifier") if config.dead_letter else None)
        )
        self._own_client = client is None
        self._client = client or httpx.Client(follow_redirects=False, headers={"User-Agent": USER_AGENT})
        self.stop_event = threading.Event()
        self.sent: Counter[str] = Counter()
        self.retried: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.given_up: Counter[str] = Counter()
        self.undecodable = 0
        self.foreign = 0
        self.stale = 0
        self.dead_lettered = 0
        self._pending: dict[tuple[str, int], int] = {}
        self._letters_unflushed = False
        self._health: health.Loop | None = None
        self._closed = False
        # A beat is due at least every request timeout or retry wait.
        longest = max(ep.timeout_s for ep in config.endpoints) + config.retry.max_delay_s
        self._stale_after_s = max(120.0, 2 * longest)

    # -- the loop ------------------------------------------------------------------------

    def _start(self) -> health.Loop:
        if self._health is None:
            loop = health.loop("notifier", stale_after_s=self._stale_after_s)
            self._health = loop
            # Watched (bus/watchdog.py): a notifier that gets no partition, or does not move with
            # events waiting, says so (not ready) and recovers, or its loop ends to be restarted.
            self._watch = WatchedConsumer(
                self._bootstrap,
                self._group,
                "trainmedic-notifier",
                self.topics,
                name="notifier",
                background=True,
                overrides={"max.poll.interval.ms": self._poll_ms},
                on_assign=lambda _c, _ps: loop.set_ready(True, "consuming: partitions assigned"),
            )
            log.info(
                "notifier: %d endpoint(s) (%s) on %s",
                len(self.config.endpoints),
                ", ".join(f"{ep.label} {ep.template}" for ep in self.config.endpoints),
                ", ".join(self.topics),
            )
        return self._health

    def poll_once(self, timeout_s: float = 0.5) -> int:
        """Consume up to batch_max records, handle them, commit what was handled; how many were."""
        loop = self._start()
        loop.beat()
        assert self._watch is not None
        # Raises ConsumerStalled when no remedy helped: run() ends, its supervisor restarts it.
        stalled = self._watch.check()
        if stalled is not None:
            loop.set_ready(False, stalled)
        elif not loop.ready and self._watch.settled:
            loop.set_ready(True, "consuming: partitions assigned")
        msgs = self._watch.consumer.consume(num_messages=self.batch_max, timeout=timeout_s)
        handled = 0
        for i, msg in enumerate(msgs):
            if (err := msg.error()) is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("notifier consumer error: %s", err)
                continue
            if self.stop_event.is_set() or not self._handle(msg):
                self._rewind(msgs[i:])
                break
            self._pending[(msg.topic() or "", msg.partition() or 0)] = (msg.offset() or 0) + 1
            handled += 1
        if handled:
            loop.beat(processed=handled)
        self._commit()
        return handled

    def run(self) -> None:
        self._start()
        try:
            while not self.stop_event.is_set():
                self.poll_once()
        finally:
            self.close()

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        """Commit what was handled, leave the group, close the clients. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._commit()
        finally:
            if self._health is not None:
                self._health.stop()
            try:
                if self._watch is not None:
                    self._watch.close()
            except (KafkaException, RuntimeError) as exc:
                log.warning("notifier: closing the consumer: %s", exc)
            if self._own_client:
                self._client.close()
            if self._own_publisher and self._publisher is not None:
                self._publisher.close()

    def _rewind(self, rest: list[Message]) -> None:
        """Put the consumer back on the first unhandled record of each partition in `rest`."""
        first: dict[tuple[str, int], int] = {}
        for msg in rest:
            if msg.error() is None:
                first.setdefault((msg.topic() or "", msg.partition() or 0), msg.offset() or 0)
        assert self._watch is not None
        for (topic, partition), offset in first.items():
            try:
                self._watch.consumer.seek(TopicPartition(topic, partition, offset))
            except KafkaException as exc:  # not assigned any more: its next owner starts there anyway
                log.info("notifier: no seek back on %s/%d: %s", topic, partition, exc)

    def _commit(self) -> None:
        if self._publisher is not None and self._letters_unflushed:
            self._letters_unflushed = False
            if (left := self._publisher.flush(30)) != 0:
                log.error("notifier: %d dead letter(s) not acknowledged yet (still queued)", left)
        if not self._pending or self._watch is None:
            return
        offsets = [TopicPartition(t, p, o) for (t, p), o in self._pending.items()]
        self._pending = {}
        try:
            self._watch.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            log.warning(
                "notifier: commit failed (%s): those records come again and are re-sent with the same Idempotency-Key",
                exc,
            )

    # -- one record ----------------------------------------------------------------------

    def _handle(self, msg: Message) -> bool:
        """Handle one record; False when interrupted (not to be committed)."""
        topic_name = msg.topic() or ""
        topic, _ = TOPIC_KIND[topic_name]
        try:
            event: Event = decode(topic.event_type, msg.value() or b"")
        except DecodeError as exc:
            # Kept as a dead letter by the audit sink, which reads the same topics.
            self.undecodable += 1
            log.error(
                "notifier: undecodable %s record at %s/%s skipped: %s", topic_name, msg.partition(), msg.offset(), exc
            )
            return True
        kind = kind_of(event)
        if kind is None:
            return True
        if event.cluster != current_cluster():
            self.foreign += 1  # that cluster's notifier (its own group) sends it
            return True
        age = time.time() - event.produced_at
        if self.config.max_age_s is not None and age > self.config.max_age_s:
            self.stale += 1
            log.warning(
                "notifier: %s %s is %.0f s old (max_age_s %g): not sent",
                kind,
                event.event_id,
                age,
                self.config.max_age_s,
            )
            return True
        for ep, token in zip(self.config.endpoints, self._tokens, strict=True):
            if kind not in ep.kinds:
                continue
            outcome = self._send(kind, event, ep, token)
            if outcome.status == "interrupted":
                log.info(
                    "notifier: stopping; %s %s to %s is sent again after the restart", kind, event.event_id, ep.label
                )
                return False
            if outcome.status != "sent":
                self._give_up(msg, kind, event, ep, outcome)
        return True

    def _wait(self, seconds: float) -> bool:
        if self._health is not None:
            self._health.beat()
        return self.stop_event.wait(seconds)

    def _send(self, kind: Kind, event: Event, ep: Endpoint, token: str | None) -> Outcome:
        key = idempotency_key(event, ep)

        def on_retry(failed: int, why: str) -> None:
            self.retried[ep.label] += 1
            log.warning(
                "notifier: %s %s to %s: attempt %d of %d failed (%s); retrying",
                kind,
                event.event_id,
                ep.label,
                failed,
                self.config.retry.attempts,
                why,
            )

        outcome = deliver(
            self._client, ep, render(kind, event, ep), key, token, self.config.retry, self._wait, on_retry
        )
        if outcome.status == "sent":
            self.sent[ep.label] += 1
            log.info("notifier: %s %s sent to %s (key %s)", kind, event.event_id, ep.label, key)
        return outcome

    def _give_up(self, msg: Message, kind: Kind, event: Event, ep: Endpoint, outcome: Outcome) -> None:
        status = str(outcome.http_status) if outcome.http_status is not None else "no HTTP status"
        if outcome.status == "refused":
            self.refused[ep.label] += 1
            what = "refused by"
        else:
            self.given_up[ep.label] += 1
            what = f"gave up after {outcome.attempts} attempt(s) on"
        reason = f"notification {kind} {event.event_id} {what} endpoint {ep.label} (status {status}): {outcome.detail}"
        log.error("notifier: %s", reason)
        if self._publisher is None:
            return
        letter = make_dead_letter(
            COMPONENT, msg.topic() or "", msg.partition(), msg.offset(), reason, msg.value()
        ).model_copy(update={"event_id": stable_id("dlq", COMPONENT, idempotency_key(event, ep))})
        self._publisher.publish(DEADLETTER, letter)
        self._letters_unflushed = True
        self.dead_lettered += 1
