"""The Recovery Console's HTTP side: the page, its static files, the SSE stream
and the read endpoints the page needs. Mounted into the operator API
(trainmedic/web/api.py), in the process that owns the audit store.

GET /api/goodput serves the goodput panel (GPU-hours lost per incident, time to detect / act /
recover, each job's effective training time: docs/audit.md "Goodput"; and saved by migration:
sinks/prediction_audit.py).

The page also calls endpoints the API already has: GET /api/nodes, GET
/api/modes and POST /api/recommendations/{id}/approve|reject (the same path as
`trainmedic recommendations approve`), with the same bearer token.

Authentication of the event stream. Every endpoint wants `Authorization:
Bearer TOKEN`, which EventSource cannot send. /api/events alone also accepts the
token as the `token` query parameter, compared in constant time like the header.
A cookie was the alternative; it was not chosen because the rest of the API
reads the header only, so the page holds the token in memory anyway (for
approve/reject, nodes, modes): an HttpOnly cookie would add a second credential
path, and CSRF exposure for the POST endpoints if they ever accepted it, without
taking the token out of the page. The query string's risk is logging: uvicorn's
access log is off in ApiServer, the API binds loopback unless --insecure, the
page is served with `Referrer-Policy: no-referrer`, and a TLS proxy in front of
a non-loopback API must not log query strings.
"""

from __future__ import annotations

import hmac
import math
import mimetypes
import re
import time
from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, Response, StreamingResponse

from schemas.errors import NotFound
from sinks.audit import AuditStore
from trainmedic.limits import bounded_since
from trainmedic.web.console.live import LiveFeed

STATIC_DIR = Path(__file__).resolve().parent / "static"

# Served with every console file: no inline script, nothing from elsewhere, no referrer
# (the SSE URL carries the token), not framable.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}

# An incident is open until it has an outcome: a result, a rejection, or a decision to do nothing.
OPEN_STATUSES = ("pending_decision", "awaiting_approval", "acting")

# Every part bounded by the window (children: an hour of clock skew before it, as
# sinks/audit_queries.py CHILD_SKEW_S), so partitions and the time sort key prune.
_INCIDENTS_SQL = """
SELECT
    i.incident_id AS incident_id,
    i.event_time AS detected_at,
    i.first_signal_time AS first_signal_time,
    nullIf(i.job_id, '') AS job_id,
    nullIf(i.partition, '') AS partition,
    i.job_nodes AS job_nodes,
    toString(i.category) AS category,
    toString(i.severity) AS severity,
    nullIf(i.culprit_node, '') AS culprit_node,
    i.confidence AS confidence,
    i.explanation AS explanation,
    i.provenance AS provenance,
    i.detection_latency_s AS detection_latency_s,
    d.decision_id AS decision_id,
    d.kind AS decision_kind,
    d.action AS decision_action,
    d.mode AS decision_mode,
    d.reason AS decision_reason,
    ap.verdict AS verdict,
    ap.reject_reason AS reject_reason,
    ap.operator AS operator,
    r.status AS result_status,
    r.action AS result_action,
    r.steps AS result_steps,
    r.error AS result_error,
    r.verified_at AS verified_at,
    r.action_latency_s AS action_latency_s,
    g.trips AS guardrail_trips
FROM {db}.incidents AS i FINAL
LEFT JOIN (
    SELECT
        incident_id,
        argMax(decision_id, event_time) AS decision_id,
        toString(argMax(kind, event_time)) AS kind,
        toString(argMax(action, event_time)) AS action,
        toString(argMax(mode, event_time)) AS mode,
        argMax(reason, event_time) AS reason
    FROM {db}.decisions FINAL
    WHERE event_time >= toDateTime64({since:Float64} - 3600, 3, 'UTC')
    GROUP BY incident_id
) AS d ON d.incident_id = i.incident_id
LEFT JOIN (
    SELECT
        incident_id,
        toString(argMax(verdict, event_time)) AS verdict,
        argMax(reason, event_time) AS reject_reason,
        argMax(operator, event_time) AS operator
    FROM {db}.approvals FINAL
    WHERE event_time >= toDateTime64({since:Float64} - 3600, 3, 'UTC')
    GROUP BY incident_id
) AS ap ON ap.incident_id = i.incident_id
LEFT JOIN (
    SELECT
        incident_id,
        toString(argMax(status, event_time)) AS status,
        toString(argMax(action, event_time)) AS action,
        arrayStringConcat(argMax(steps, event_time), '; ') AS steps,
        argMax(error, event_time) AS error,
        argMax(verified_at, event_time) AS verified_at,
        argMax(action_latency_s, event_time) AS action_latency_s
    FROM {db}.action_results FINAL
    WHERE event_time >= toDateTime64({since:Float64} - 3600, 3, 'UTC')
    GROUP BY incident_id
) AS r ON r.incident_id = i.incident_id
LEFT JOIN (
    SELECT incident_id, count() AS trips FROM {db}.guardrail_trips FINAL
    WHERE event_time >= toDateTime64({since:Float64} - 3600, 3, 'UTC') GROUP BY incident_id
) AS g ON g.incident_id = i.incident_id
WHERE i.event_time >= toDateTime64({since:Float64}, 3, 'UTC')
ORDER BY detected_at DESC, incident_id
LIMIT {limit:UInt32}
SETTINGS join_use_nulls = 1
"""

_CATEGORIES_SQL = """
SELECT toString(category) AS category, count() AS incidents
FROM {db}.incidents FINAL
WHERE event_time >= toDateTime64({since:Float64}, 3, 'UTC')
GROUP BY category
ORDER BY incidents DESC, category
"""


def incident_status(row: dict[str, Any]) -> str:
    """Where an incident stands: the same rules as console.js's statusOf."""
    if row.get("result_status"):
        return str(row["result_status"])  # done, failed, skipped
    if row.get("verdict") == "rejected":
        return "rejected"
    if row.get("verdict") == "approved":
        return "acting"
    if not row.get("decision_id"):
        return "pending_decision"
    if row.get("decision_action") == "none":
        return "no_action"
    if row.get("decision_kind") == "action":
        return "acting"
    return "awaiting_approval"


def _since(text: str) -> timedelta:
    try:
        return bounded_since(text)  # the audit CLI's parser, with the API's upper bound
    except ValueError as exc:
        raise HTTPException(status_code=422, detail=f"since: {exc}") from None


def _jsonable(value: Any) -> Any:
    """Query results as JSON-ready data: datetimes as ISO 8601 UTC, NaN as null."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime):
        # clickhouse-connect returns DateTime64(3, 'UTC') as naive datetimes holding UTC.
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _audit_queries() -> Any:
    """sinks.audit_queries (timeline and latency views), or 503 naming what is missing."""
    try:
        import sinks.audit_queries as queries
    except ImportError as exc:
        raise HTTPException(status_code=503, detail=f"audit queries unavailable: {exc}") from None
    return queries


AUDIT_RETRY_AFTER_S = 10


def audit_behind(problem: str) -> HTTPException:
    """The answer of a read of the audit while its inserts fail: what it would list lacks every event
    since, and an empty or short list would read as "nothing happened". 503, like the other "not
    now" answers of the API, naming the failure; Retry-After: the sink retries within 30 s."""
    return HTTPException(
        status_code=503,
        detail=f"the audit is behind: {problem}",
        headers={"Retry-After": str(AUDIT_RETRY_AFTER_S)},
    )


def audit_current(audit_problem: Callable[[], str | None] | None) -> Callable[[], None]:
    """A dependency of the endpoints that read the audit: 503 (audit_behind) while its inserts fail."""

    def check() -> None:
        problem = audit_problem() if audit_problem is not None else None
        if problem is not None:
            raise audit_behind(problem)

    return check


def _static_files(static_dir: Path) -> dict[str, Path]:
    """The files the console may serve, by URL path under /static/ (no traversal possible)."""
    return {
        p.relative_to(static_dir).as_posix(): p
        for p in sorted(static_dir.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def console_router(
    store: AuditStore,
    token: str | Sequence[str],
    feed: LiveFeed | None,
    health: Callable[[], dict[str, Any]] | None = None,
    *,
    static_dir: Path = STATIC_DIR,
    bootstrap: str | None = None,
    audit_problem: Callable[[], str | None] | None = None,
    prediction_window_s: Callable[[], float] | None = None,
) -> APIRouter:
    """The console's routes: include with `api.include_router(console_router(store, token, feed))`.
    `audit_problem`: why the audit is behind (its inserts failing), None while it is current; the
    routes that read the audit answer 503 (audit_behind) while it says something.
    `prediction_window_s`: the policy's readiness.expire_after_h in seconds, read per request (the
    window that scores predictions, sinks/prediction_audit.py); None: the built-in policy's."""
    router = APIRouter()
    files = _static_files(static_dir)
    # The console only reads: the operator's and the viewer's token both open it. Approve
    # and reject go to the operator API, which checks the role.
    expected = [t.encode() for t in ([token] if isinstance(token, str) else token)]

    def token_ok(given: str | None) -> bool:
        raw = (given or "").encode()
        return bool(given) and sum(hmac.compare_digest(raw, e) for e in expected) > 0

    def bearer(authorization: str | None) -> str | None:
        return (authorization or "").removeprefix("Bearer ").strip() or None

    def unauthorized() -> HTTPException:
        return HTTPException(status_code=401, detail="missing or wrong token", headers={"WWW-Authenticate": "Bearer"})

    def authorized(authorization: Annotated[str | None, Header()] = None) -> None:
        if not token_ok(bearer(authorization)):
            raise unauthorized()

    auth = [Depends(authorized)]
    audit_read = [*auth, Depends(audit_current(audit_problem))]

    def page(name: str) -> FileResponse:
        path = files.get(name)
        if path is None:
            raise HTTPException(status_code=404, detail=f"no console file {name}")
        media = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        if media.startswith("text/") or media in ("application/javascript", "image/svg+xml"):
            media += "; charset=utf-8"
        return FileResponse(path, media_type=media, headers=SECURITY_HEADERS)

    @router.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return page("index.html")

    @router.get("/static/{name:path}", include_in_schema=False)
    def static(name: str) -> FileResponse:
        return page(name)

    @router.get("/api/events")
    async def events(
        request: Request,
        token: Annotated[str | None, Query(max_length=512)] = None,
        authorization: Annotated[str | None, Header()] = None,
        last_event_id: Annotated[str | None, Header()] = None,
        last_id: Annotated[int | None, Query(ge=0)] = None,
    ) -> StreamingResponse:
        """Server-Sent Events: every new incident, decision, approval, action result and guardrail trip."""
        # EventSource cannot send headers: the token may come as ?token= here (and only here).
        if not (token_ok(token) or token_ok(bearer(authorization))):
            raise unauthorized()
        if feed is None or not feed.alive:
            raise HTTPException(status_code=503, detail="the live feed is not running")
        # EventSource resends the last id it saw when it reconnects by itself; the page passes
        # ?last_id= when it opens a new EventSource after an error.
        if last_event_id and last_event_id.strip().isdigit():
            last_id = int(last_event_id)
        return StreamingResponse(
            feed.stream(last_id, request.is_disconnected),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no", "Referrer-Policy": "no-referrer"},
        )

    @router.get("/api/console/status", dependencies=auth)
    def status() -> dict[str, Any]:
        # `stack`: the supervisor's view of every part of `up` (the same as /api/health).
        stack = health() if health is not None else None
        if feed is None:
            return {"feed": None, "stack": stack}
        return {
            "stack": stack,
            "feed": {
                "alive": feed.alive,
                "ready": feed.ready.is_set(),
                "since": feed.since,
                "clients": feed.clients,
                "last_id": feed.last_seq,
                "skipped_old": feed.skipped_old,
                "undecodable": feed.undecodable,
                "dropped_clients": feed.dropped_clients,
            },
        }

    @router.get("/api/incidents", dependencies=audit_read)
    def incidents(
        since: Annotated[str, Query(max_length=16)] = "7d",
        limit: Annotated[int, Query(ge=1, le=1000)] = 200,
        open_only: Annotated[bool, Query(alias="open")] = False,
    ) -> list[dict[str, Any]]:
        """Recent incidents with their decision (and decision id, for approve/reject), verdict and outcome."""
        cutoff = time.time() - _since(since).total_seconds()
        rows = store.query(_INCIDENTS_SQL, {"since": cutoff, "limit": limit})
        out = []
        for row in rows:
            row["status"] = incident_status(row)
            row["open"] = row["status"] in OPEN_STATUSES
            if open_only and not row["open"]:
                continue
            out.append(_jsonable(row))
        return out

    @router.get("/api/incidents/{incident_id}/bundle", dependencies=audit_read)
    def incident_bundle(incident_id: Annotated[str, PathParam(min_length=1, max_length=64)]) -> Response:
        """The incident's evidence bundle (trainmedic/ops/bundle.py) as a .tar.gz download."""
        from trainmedic.ops.bundle import build_bundle, bundle_bytes

        try:
            built = build_bundle(store, incident_id, bootstrap)
        except NotFound as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
        name = re.sub(r"[^A-Za-z0-9_-]", "_", incident_id)
        return Response(
            bundle_bytes(built),
            media_type="application/gzip",
            headers={**SECURITY_HEADERS, "Content-Disposition": f'attachment; filename="{name}.tar.gz"'},
        )

    @router.get("/api/jobs/{job_id}/timeline", dependencies=audit_read)
    def job_timeline(job_id: Annotated[str, PathParam(min_length=1, max_length=64)]) -> dict[str, Any]:
        """Everything that happened to a job, in order (sinks/audit_queries.py job_timeline)."""
        result: dict[str, Any] = _jsonable(_audit_queries().job_timeline(store, job_id))
        if not result["timeline"] and not result["incidents"] and not result.get("attempts"):
            raise HTTPException(status_code=404, detail=f"nothing recorded for job {job_id}")
        return result

    @router.get("/api/charts", dependencies=audit_read)
    def charts(since: Annotated[str, Query(max_length=16)] = "7d") -> dict[str, Any]:
        """Chart data: latency percentiles (all time) and incidents by category (within `since`)."""
        window = _since(since)
        categories = store.query(_CATEGORIES_SQL, {"since": time.time() - window.total_seconds()})
        out: dict[str, Any] = {"since": since, "categories": categories, "latency": None, "latency_error": None}
        try:
            out["latency"] = _audit_queries().latency(store)
        except Exception as exc:  # the views arrive with migration 003: say so rather than fail the page
            out["latency_error"] = f"latency percentiles unavailable: {exc}".splitlines()[0][:300]
        result: dict[str, Any] = _jsonable(out)
        return result

    @router.get("/api/goodput", dependencies=audit_read)
    def goodput(
        since: Annotated[str, Query(max_length=16)] = "7d",
        job: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 10,
    ) -> dict[str, Any]:
        """Goodput of the window (sinks/audit_queries.py goodput): fleet totals, the worst jobs, the incidents."""
        window = _since(since)
        out = _audit_queries().goodput(store, since=window, job=job, limit=limit)
        from sinks.prediction_audit import migration_goodput
        from streams.policy import ReadinessSettings

        hours = ReadinessSettings().expire_after_h
        window_s = prediction_window_s() if prediction_window_s is not None else hours * 3600
        out["saved_by_migration"] = migration_goodput(
            store, time.time() - window.total_seconds(), window_s, None, job=job
        )
        result: dict[str, Any] = _jsonable(out)
        result["since"] = since
        return result

    @router.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204)

    return router
