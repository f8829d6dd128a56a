"""The operator API served by `trainmedic up` (127.0.0.1 by default, token required).

It lives in the process that owns the audit store (chDB allows one process per
folder), so approvals and queries go through it. `trainmedic recommendations approve/reject`
and the console use the same endpoints.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Query
from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bus.publish import NotDelivered, Publisher
from schemas.errors import TrainmedicError
from schemas.events import Action, Approval, Decision, ModeChange, incident_in_reason
from schemas.ids import NodeNameError, check_node_name, current_cluster, stable_id
from schemas.masking import remember
from schemas.topics import ACTIONS, APPROVALS, MODE_CHANGES
from schemas.vocab import DRAINS, Category, Mode, RejectReason
from schemas.yamlsafe import API_LIMITS
from sinks.audit import AuditStore
from sinks.backends.base import SchedulerBackend
from streams.modes import apply_change
from streams.policy import (
    Policy,
    PolicyError,
    ReadinessSettings,
    ReturnToService,
    fleet_drain_set,
    load_overlay,
    make_action,
    parse_policy,
    save_overlay,
    with_drain_set,
)
from trainmedic.limits import MAX_LOOKBACK_DAYS
from trainmedic.ops.migrations import CancelRefused, cancel_migration
from trainmedic.ops.readiness import readiness, verdict_for
from trainmedic.ops.replay import replay
from trainmedic.ops.return_to_service import ReturnRefused, return_node
from trainmedic.web.console import LiveFeed, console_router
from trainmedic.web.console.routes import audit_behind, audit_current
from trainmedic.web.last_good_policy import LastGoodPolicy, PolicyState
from trainmedic.web.masked_errors import mask_errors, masked

log = logging.getLogger("trainmedic.web.api")
READINESS_WINDOW_S = 30 * 86400.0


class ApiError(TrainmedicError, RuntimeError):
    pass


def load_or_create_token(path: Path) -> str:
    """The operator token: kept in a 0600 file next to the data, never printed or logged.

    An existing file that group or others may read or write is refused (fail closed):
    the token may already have leaked, and fixing the mode silently would hide that."""
    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise ApiError(
                f"{path}: mode {mode:04o} lets other users read or change the token; refused. If nobody "
                f"else could have read it, `chmod 600 {path}`; otherwise delete it and a new one is made"
            )
        token = path.read_text().strip()
        if len(token) < 16:
            raise ApiError(f"{path}: token too short (at least 16 characters)")
        remember(token)
        return token
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # Created 0600 in one step: no moment where the file exists with the umask's mode.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    remember(token)
    return token


class ApproveBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    operator: str = Field(min_length=1, max_length=128)
    comment: str = Field(default="", max_length=4096)


class RejectBody(ApproveBody):
    reason: RejectReason


# How long the API's publisher tries to deliver a record before it gives up (librdkafka's
# message.timeout.ms): shorter than the waits that answer "nothing changed".
API_MESSAGE_TIMEOUT_MS = 8000


def _decision_from_row(row: dict[str, Any]) -> Decision:
    try:
        return _decision(row)
    except ValidationError as exc:
        # A record written before its fields were checked (a forged node name): refused, not a 500.
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise HTTPException(
            status_code=409, detail=f"{row['decision_id']}: its audit record cannot be acted on: {where}: {err['msg']}"
        ) from None


def _decision(row: dict[str, Any]) -> Decision:
    return Decision(
        event_id=row["decision_id"],
        event_time=row["event_time"].timestamp(),
        decision_id=row["decision_id"],
        incident_id=row["incident_id"],
        job_id=row["job_id"] or None,  # the audit stores '' for "none"
        partition=row["partition"] or None,  # the audit stores '' for "none"
        category=row["category"],
        culprit_node=row["culprit_node"] or None,  # the audit stores '' for "none"
        action=row["action"],
        mode=row["mode"],
        executed=row["kind"] == "action",
        rule=row["rule"],
        reason=row["reason"],
        first_signal_time=row["first_signal_time"].timestamp(),
        incident_time=row["incident_time"].timestamp(),
    )


class ModeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Mode
    partition: str | None = Field(default=None, max_length=128)
    category: Category | None = None
    operator: str = Field(min_length=1, max_length=128)
    reason: str = Field(default="", max_length=4096)
    force: bool = False


class ReplayBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy_yaml: str = Field(max_length=1_000_000)
    policy_name: str = Field(default="<replay policy>", max_length=256)
    since_days: float = Field(default=7.0, gt=0, le=MAX_LOOKBACK_DAYS)


class LabelBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    verdict: Literal["approved", "rejected", "confirmed"]
    reason: RejectReason | None = None
    operator: str = Field(min_length=1, max_length=128)
    comment: str = Field(default="", max_length=4096)

    @model_validator(mode="after")
    def _reason_for_rejections(self) -> LabelBody:
        if self.verdict == "rejected" and self.reason is None:
            raise ValueError("a rejection needs a reason")
        return self


class ResumeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    operator: str = Field(min_length=1, max_length=128)
    comment: str = Field(default="", max_length=4096)


def create_api(
    store: AuditStore,
    publisher: Publisher,
    token: str,
    backend: SchedulerBackend,
    policy_path: Path,
    modes_path: Path,
    feed: LiveFeed | None = None,
    viewer_token: str | None = None,
    health: Callable[[], dict[str, Any]] | None = None,
    audit_problem: Callable[[], str | None] | None = None,
) -> FastAPI:
    """`token` is the operator's: everything. `viewer_token` (optional) reads only: the console,
    recommendations, modes, readiness, nodes and replays, but no approval, label, mode change
    or resume (403 "operator role required"). `audit_problem`: why the audit is behind (its
    inserts failing; the stack's sink says), None while it is current: the endpoints that list
    from the audit answer 503 naming it meanwhile, instead of a list that lacks what happened."""
    api = mask_errors(FastAPI(title="trainmedic", version="1", docs_url=None, redoc_url=None))
    PENDING.store = store
    lock = threading.Lock()
    policies = LastGoodPolicy(policy_path)
    decided: dict[str, str] = {}  # decision id -> verdict, for decisions answered in this run

    def role_of(authorization: str | None) -> str:
        given = (authorization or "").removeprefix("Bearer ").strip().encode()
        # Both comparisons always run: which token matched must not show in the timing.
        operator = bool(given) and hmac.compare_digest(given, token.encode())
        viewer = bool(given) and viewer_token is not None and hmac.compare_digest(given, viewer_token.encode())
        if operator:
            return "operator"
        if viewer:
            return "viewer"
        raise HTTPException(status_code=401, detail="missing or wrong token", headers={"WWW-Authenticate": "Bearer"})

    def operator_only(authorization: Annotated[str | None, Header()] = None) -> None:
        if role_of(authorization) != "operator":
            raise HTTPException(status_code=403, detail="operator role required (this token may only read)")

    def any_role(authorization: Annotated[str | None, Header()] = None) -> None:
        role_of(authorization)

    auth = [Depends(operator_only)]
    read = [Depends(any_role)]
    audit_read = [*read, Depends(audit_current(audit_problem))]

    def own_decision(decision_id: str) -> list[dict[str, Any]]:
        """The decision's audit row, if it is this cluster's: an approval here acts on this cluster's
        scheduler, so another cluster's decision (sharing the audit) is unknown here."""
        rows = store.query(
            "SELECT * FROM {db}.decisions FINAL WHERE decision_id = {d:String} AND cluster = {c:String}",
            {"d": decision_id, "c": current_cluster()},
        )
        if not rows:
            if audit_problem is not None and (problem := audit_problem()) is not None:
                raise audit_behind(problem)  # the decision may be one the audit has not recorded yet
            raise HTTPException(status_code=404, detail=f"no decision {decision_id} of cluster {current_cluster()}")
        return rows

    def recommendation(decision_id: str) -> Decision:
        rows = own_decision(decision_id)
        if rows[0]["kind"] != "recommendation":
            raise HTTPException(status_code=409, detail=f"{decision_id} was already acted on by policy")
        verdict = decided.get(decision_id) or _recorded_verdict(store, decision_id)
        if verdict:
            raise HTTPException(status_code=409, detail=f"{decision_id} was already {verdict}")
        return _decision_from_row(rows[0])

    def publish_verdict(d: Decision, verdict: str, body: ApproveBody, reason: str | None) -> Approval:
        approval = Approval(
            event_id=stable_id("apr", d.decision_id),
            event_time=time.time(),
            approval_id=stable_id("apr", d.decision_id),
            decision_id=d.decision_id,
            incident_id=d.incident_id,
            job_id=d.job_id,
            partition=d.partition,
            category=d.category,
            action=d.action,
            verdict=verdict,  # type: ignore[arg-type]
            reason=reason,  # type: ignore[arg-type]
            comment=body.comment,
            operator=body.operator,
        )
        publisher.publish(APPROVALS, approval)
        return approval

    # Prometheus metrics are not served here: they have their own unauthenticated listener
    # (trainmedic/stack/metrics_server.py), so this API stays token-only.

    def stack_health() -> dict[str, Any]:
        """The parts' health, with what runs on a fallback under `degraded` (still ok): a policy
        file that failed to load while the last good policy stays in force. Not a 503: a load
        balancer would then take away the API, and with it the brake (`mode set monitor`)."""
        report = dict(health() if health is not None else {"ok": True})
        problem = policies.refresh().problem()
        if problem is not None:
            report["degraded"] = {**report.get("degraded", {}), "policy": problem}
        return report

    def policy_in_force() -> tuple[Policy, PolicyState]:
        """The policy file read now, falling back on the last good policy; 503 when none ever loaded."""
        state = policies.reload()
        if state.policy is None:
            raise no_policy(state)
        return state.policy, state

    def prediction_window_s() -> float:
        """The window that scores predictions (readiness.expire_after_h): the policy in force, else the default."""
        state = policies.reload()
        settings = state.policy.readiness if state.policy is not None else ReadinessSettings()
        return settings.expire_after_h * 3600

    @api.get("/api/health", response_model=None)
    def get_health() -> dict[str, Any] | JSONResponse:
        """Unauthenticated liveness for load balancers and `up`'s supervision: 503 while a part is down."""
        report: dict[str, Any] = masked(stack_health())  # its reasons may quote an exception
        if not report.get("ok"):
            return JSONResponse(status_code=503, content=report)
        return report

    @api.get("/api/recommendations", dependencies=audit_read)
    def recommendations() -> list[dict[str, Any]]:
        rows = store.query(
            "SELECT decision_id, incident_id, job_id, partition, category, culprit_node, action, reason, event_time "
            "FROM {db}.decisions FINAL WHERE kind = 'recommendation' AND cluster = {c:String} "
            "ORDER BY event_time DESC LIMIT 200",
            {"c": current_cluster()},
        )
        return [
            {**r, "event_time": r["event_time"].isoformat(), "verdict": decided.get(r["decision_id"])} for r in rows
        ]

    def predicted(incident_id: str) -> bool:
        rows = store.query("SELECT kind FROM {db}.incidents FINAL WHERE incident_id = {i:String}", {"i": incident_id})
        return bool(rows) and rows[0]["kind"] == "predicted"

    def fleet_action(action: Action) -> Action:
        """An approved fleet drain: the incident's drain set, as policy would have sent it."""
        rows = store.query(
            "SELECT domain, domain_nodes, domain_failed_nodes FROM {db}.incidents FINAL WHERE incident_id = {i:String}",
            {"i": action.incident_id},
        )
        if not rows or not rows[0]["domain"]:
            raise HTTPException(status_code=409, detail=f"{action.incident_id}: no node to drain is known")
        nodes = fleet_drain_set(list(rows[0]["domain_nodes"]), list(rows[0]["domain_failed_nodes"]))
        if not rows[0]["domain_failed_nodes"] or not nodes:
            raise HTTPException(status_code=409, detail=f"{action.incident_id}: the fleet incident has no drain set")
        return with_drain_set(action, str(rows[0]["domain"]), nodes)

    @api.post("/api/recommendations/{decision_id}/approve", status_code=202, dependencies=auth)
    def approve(decision_id: str, body: ApproveBody) -> dict[str, str]:
        with lock:
            d = recommendation(decision_id)
            if d.action == "none":
                raise HTTPException(status_code=409, detail=f"{decision_id} recommends no action")
            publish_verdict(d, "approved", body, None)
            # The same path as an autonomous decision: an action event for the executor,
            # with the same stable id, so approving twice cannot act twice.
            action = make_action(d, d.incident_id, requested_by=f"operator:{body.operator}", now=time.time())
            if d.job_id is None and d.culprit_node is None and d.action in DRAINS:
                action = fleet_action(action)
            elif d.action in DRAINS and predicted(d.incident_id):
                # A predicted failure's drain counts against the predictive cap, approved or not.
                action = action.model_copy(update={"predicted": True})
            publisher.publish(ACTIONS, action)
            if publisher.flush(10):
                raise HTTPException(status_code=503, detail="Kafka did not confirm the approval; retry")
            decided[decision_id] = "approved"
        log.info("approved %s by %s -> %s", decision_id, body.operator, action.action_id)
        return {"decision_id": decision_id, "action_id": action.action_id, "status": "approved"}

    @api.post("/api/recommendations/{decision_id}/reject", dependencies=auth)
    def reject(decision_id: str, body: RejectBody) -> dict[str, str]:
        with lock:
            d = recommendation(decision_id)
            publish_verdict(d, "rejected", body, body.reason)
            if publisher.flush(10):
                raise HTTPException(status_code=503, detail="Kafka did not confirm the rejection; retry")
            decided[decision_id] = "rejected"
        log.info("rejected %s by %s (%s)", decision_id, body.operator, body.reason)
        return {"decision_id": decision_id, "status": "rejected"}

    @api.get("/api/modes", dependencies=read)
    def modes() -> dict[str, Any]:
        policy, state = policy_in_force()
        shown = policy.with_overlay(load_overlay(modes_path))
        return with_policy_error(shown.model_dump(mode="json", include={"mode", "categories", "partitions"}), state)

    def refuse_autonomy(body: ModeBody, old: Mode | None, verdict_text: str, state: PolicyState) -> HTTPException:
        """Audit the refusal and say why; the 409 names a broken policy file, since the verdict
        then comes from the last good policy, not from the file the operator sees."""
        refusal = ModeChange(
            event_id=stable_id("mode", body.partition, body.category, body.mode, "refused", time.time()),
            event_time=time.time(),
            partition=body.partition,
            category=body.category,
            old_mode=old,
            new_mode=body.mode,
            operator=body.operator,
            reason=body.reason,
            outcome="refused",
            readiness=verdict_text,
        )
        publisher.publish(MODE_CHANGES, refusal)
        publisher.flush(10)
        detail = f"not ready for autonomy: {verdict_text} (use --force to override)"
        if (problem := state.problem()) is not None:
            detail += f"; the policy file failed to load: {problem}"
        return HTTPException(status_code=409, detail=detail)

    @api.post("/api/modes", dependencies=auth)
    def set_mode(body: ModeBody) -> dict[str, Any]:
        with lock:
            overlay = load_overlay(modes_path)
            state = policies.reload()
            current = state.policy.with_overlay(overlay) if state.policy is not None else None
            old = current.mode_for(body.partition, body.category) if current is not None else None
            verdict_text, ready = "", True
            if body.mode == "autonomous":
                # Only autonomy needs a policy (its readiness verdict): the brake, monitor, works
                # even when no policy file was ever valid.
                if current is None:
                    raise no_policy(state)
                scores = readiness(store, current, since_s=time.time() - READINESS_WINDOW_S)
                ready, verdict_text = verdict_for(scores, body.category, body.partition)
                if not ready and not body.force:
                    raise refuse_autonomy(body, old, verdict_text, state)
            apply_change(overlay, body.partition, body.category, body.mode)
            # Audit first: a change that cannot be recorded is not made.
            change = ModeChange(
                event_id=stable_id("mode", body.partition, body.category, body.mode, time.time()),
                event_time=time.time(),
                partition=body.partition,
                category=body.category,
                old_mode=old,
                new_mode=body.mode,
                operator=body.operator,
                reason=body.reason,
                forced=body.force and not ready,
                readiness=verdict_text,
            )
            try:
                # Acknowledged or definitively failed when this returns (the API's publisher gives up on
                # a record after API_MESSAGE_TIMEOUT_MS): "nothing changed" is then true, not a guess.
                publisher.publish_sync(MODE_CHANGES, change, timeout_s=API_MESSAGE_TIMEOUT_MS / 1000 + 5)
            except NotDelivered as exc:
                raise HTTPException(
                    status_code=503, detail=f"Kafka did not confirm the mode change; nothing changed ({exc})"
                ) from None
            save_overlay(modes_path, overlay)
        log.info(
            "mode %s -> %s for partition=%s category=%s by %s",
            old,
            body.mode,
            body.partition,
            body.category,
            body.operator,
        )
        answer = {"old_mode": old, "new_mode": body.mode, "partition": body.partition, "category": body.category}
        return with_policy_error(answer, state)

    @api.get("/api/readiness", dependencies=audit_read)
    def get_readiness(
        since_days: Annotated[float, Query(gt=0, le=MAX_LOOKBACK_DAYS)] = 30.0,
    ) -> list[dict[str, Any]]:
        policy = policy_in_force()[0].with_overlay(load_overlay(modes_path))
        return [s.as_dict() for s in readiness(store, policy, since_s=time.time() - since_days * 86400)]

    @api.post("/api/replay", dependencies=audit_read)
    def post_replay(body: ReplayBody) -> dict[str, Any]:
        try:
            # Bounded: no aliases in a request body; size and depth capped (schemas/yamlsafe.py).
            policy = parse_policy(body.policy_yaml, body.policy_name, API_LIMITS)
        except PolicyError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        return replay(store, policy, since_s=time.time() - body.since_days * 86400)

    @api.post("/api/recommendations/{decision_id}/label", dependencies=auth)
    def label(decision_id: str, body: LabelBody) -> dict[str, str]:
        """A verdict after the fact (e.g. the node failed its diagnostics): the latest label counts."""
        d = _decision_from_row(own_decision(decision_id)[0])
        approval = Approval(
            event_id=stable_id("lbl", d.decision_id, body.verdict, time.time()),
            event_time=time.time(),
            approval_id=stable_id("lbl", d.decision_id, body.verdict, time.time()),
            decision_id=d.decision_id,
            incident_id=d.incident_id,
            job_id=d.job_id,
            partition=d.partition,
            category=d.category,
            action=d.action,
            verdict=body.verdict,
            reason=body.reason,
            comment=body.comment,
            operator=body.operator,
        )
        publisher.publish(APPROVALS, approval)
        if publisher.flush(10):
            raise HTTPException(status_code=503, detail="Kafka did not confirm the label; retry")
        return {"decision_id": decision_id, "verdict": body.verdict}

    @api.get("/api/nodes", dependencies=read)
    def nodes() -> list[dict[str, Any]]:
        out = []
        for n in backend.list_nodes():
            ours = incident_in_reason(n.reason)
            out.append(
                {
                    "node": n.name,
                    "state": n.state,
                    "flags": list(n.flags),
                    "drained": n.drained,
                    "reason": n.reason,
                    "incident_id": ours,
                    "drained_by_trainmedic": bool(n.drained and ours),
                    "partitions": list(n.partitions),
                }
            )
        return out

    @api.post("/api/nodes/{node}/resume", dependencies=auth)
    def resume(node: str, body: ResumeBody) -> dict[str, Any]:
        try:
            check_node_name(node)  # before the scheduler or the audit sees it
        except NodeNameError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        # The health check (minutes) runs outside the API's lock, so approvals and mode changes
        # (the brake) are never held up behind it; return_node allows one return per node at a time.
        try:
            done = return_node(
                backend,
                store,
                publisher,
                lambda: return_settings(policies),
                node,
                body.operator,
                body.comment,
            )
        except ReturnRefused as exc:
            raise HTTPException(status_code=exc.status, detail=exc.detail) from None
        return {"node": node, "incident_id": done.incident_id, "status": "resumed", "check": done.verdict.reason}

    @api.post("/api/migrations/{job_id}/cancel", dependencies=auth)
    def cancel(job_id: str, body: ResumeBody) -> dict[str, Any]:
        """Cancel a job's pending checkpoint-aligned migration; the node it drained is resumed."""
        try:
            done = cancel_migration(backend, store, publisher, job_id, body.operator, body.comment)
        except CancelRefused as exc:
            raise HTTPException(status_code=exc.status, detail=exc.detail) from None
        return {
            "job_id": job_id,
            "migration_id": done.migration_id,
            "node": done.node,
            "resumed": done.resumed,
            "detail": done.detail,
        }

    # The Recovery Console: its page, its live event stream and the reads it needs.
    api.include_router(
        console_router(
            store,
            [token, *([viewer_token] if viewer_token else [])],
            feed,
            stack_health,
            bootstrap=getattr(publisher, "bootstrap", None),
            audit_problem=audit_problem,
            prediction_window_s=prediction_window_s,
        )
    )
    return api


def no_policy(state: PolicyState) -> HTTPException:
    return HTTPException(status_code=503, detail=f"no valid policy has been loaded: {state.error}")


def with_policy_error(answer: dict[str, Any], state: PolicyState) -> dict[str, Any]:
    """`policy_error` added when the policy file failed to load (what is in force then is the
    last good policy); absent otherwise, so the usual answer is unchanged."""
    problem = state.problem()
    return answer if problem is None else {**answer, "policy_error": problem}


def return_settings(policies: LastGoodPolicy) -> ReturnToService:
    """A resume's health-check settings: the last good policy's; refused (503) when none ever loaded."""
    state = policies.reload()
    if state.policy is None:
        raise ReturnRefused(503, f"no valid policy has been loaded: {state.error}")
    return state.policy.return_to_service


def _recorded_verdict(store: AuditStore, decision_id: str) -> str | None:
    """A verdict from an earlier run, if the audit has an approvals table yet."""
    try:
        rows = store.query(
            "SELECT verdict FROM {db}.approvals FINAL WHERE decision_id = {d:String}", {"d": decision_id}
        )
    except Exception:  # the approvals table arrives with a later migration
        return None
    return str(rows[0]["verdict"]) if rows else None


class PendingRecommendations(Collector):
    """trainmedic_recommendations_pending{partition}: recommendations of the last 7 days with no
    verdict, counted in the audit when Prometheus scrapes (the API's process only)."""

    QUERY = (
        "SELECT partition, count() AS n FROM {db}.decisions FINAL "
        "WHERE kind = 'recommendation' AND cluster = {c:String} AND event_time > now() - INTERVAL 7 DAY "
        "AND decision_id NOT IN (SELECT decision_id FROM {db}.approvals FINAL) GROUP BY partition"
    )

    def __init__(self) -> None:
        self.store: AuditStore | None = None

    def release(self, store: AuditStore) -> None:
        """Before `store` closes: a scrape after that would only log that the client is closed."""
        if self.store is store:
            self.store = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.store is None:
            return
        family = GaugeMetricFamily(
            "trainmedic_recommendations_pending",
            "Recommendations of the last 7 days that no operator has approved or rejected yet",
            labels=["partition"],
        )
        try:
            rows = self.store.query(self.QUERY, {"c": current_cluster()})
        except Exception as exc:  # the audit away: no sample, rather than a wrong zero
            log.warning("pending recommendations not counted: %s", exc)
            return
        for row in rows:
            family.add_metric([str(row["partition"] or "")], float(row["n"]))
        yield family


PENDING = PendingRecommendations()
REGISTRY.register(PENDING)


class ApiServer:
    """uvicorn in a thread, stoppable."""

    def __init__(
        self, api: FastAPI, host: str, port: int, tls_cert: Path | None = None, tls_key: Path | None = None
    ) -> None:
        self.app, self.host, self.port = api, host, port
        self.tls = tls_cert is not None
        config = uvicorn.Config(
            api,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            ssl_certfile=str(tls_cert) if tls_cert else None,
            ssl_keyfile=str(tls_key) if tls_key else None,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="api", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def start(self, timeout: float = 15.0) -> ApiServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ApiError(f"the API did not start on {self.host}:{self.port} (port in use?)")
            time.sleep(0.05)
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
