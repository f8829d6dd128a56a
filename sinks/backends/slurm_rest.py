"""Slurm backend over slurmrestd (the Slurm REST API), with JWT authentication.

Many sites expose slurmrestd rather than shell access. This backend implements the same
`SchedulerBackend` interface as slurm-cli; the executor verifies every effect through the
same reads (node state and reason after a drain, job state after a requeue or a cancel).

- Auth: ``X-SLURM-USER-NAME`` + ``X-SLURM-USER-TOKEN`` on every request. The token comes from
  a file (re-read on each request, so a rotated token is picked up) or from an environment
  variable, never from a command line.
- Version: the highest API version the server offers (``GET /openapi/v3``, else probing
  ``/slurm/vX/ping/``) among those in slurm_rest_api.yaml; replies are read by slurmio
  (their ``meta`` names the data parser), like the CLI's JSON.
- Gaps: what the API cannot do (slurm_rest_api.yaml ``gap``: requeue of a running job, with
  or without excluded nodes; holding a running job) is logged at start and refused per action
  with `RestApiGap` (a BackendError: the executor reports the action failed with that text),
  before anything is changed. Nothing is emulated by a different operation.
- Fails closed: an unreachable server, a refused token, an error in a reply or an unknown
  reply shape raise BackendError; every request has a timeout.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import httpx

from schemas.errors import Refused
from schemas.masking import remember
from schemas.yamlsafe import YamlError, load_yaml
from sinks.backends.base import BackendError, JobState, NodeState, NotPermitted, refuse_node_action, refuse_relabel
from sinks.backends.slurm_cli import (
    _NOT_PERMITTED,  # what slurmctld answers a user without the rights: the CLI's list, one list
    JobNotFoundError,
    validate_job_id,
    validate_node_name,
    validate_reason,
)
from slurmio.fields import Fields
from slurmio.hostlist import HostlistError, expand_hostlist
from slurmio.nodes import in_force
from slurmio.records import JobInfo, NodeInfo
from slurmio.runners import SlurmCommandError
from slurmio.sinfo import parse_nodes
from slurmio.squeue import parse_jobs
from slurmio.versions import SlurmFormatError, detect, known_versions

__all__ = ["RestApiGap", "SlurmRestBackend", "TokenSource", "load_api_catalog"]

log = logging.getLogger("trainmedic.backend.slurm_rest")

_CATALOG = Path(__file__).with_name("slurm_rest_api.yaml")
_OPERATIONS = (
    "drain_node",
    "resume_node",
    "read_nodes",
    "read_job",
    "annotate_job",
    "exclude_nodes_pending",
    "requeue_running",
    "hold_pending",
    "hold_running",
    "release_job",
    "cancel_job",
)
_VERSION_RE = re.compile(r"^v0\.0\.(\d+)$")
_PING_PATH = re.compile(r"^/slurm/(v0\.0\.\d+)/ping/?$")
_LOOPBACK = ("127.0.0.1", "::1", "localhost")
_NO_SUCH_JOB = 2017  # slurm_errno ESLURM_INVALID_JOB_ID
_RUNNING = ("RUNNING", "CONFIGURING", "SUSPENDED", "COMPLETING")


class RestApiGap(Refused, BackendError):
    """The REST API has no way to do this operation; the message names the gap."""


@dataclass(frozen=True)
class ApiCatalog:
    versions: tuple[str, ...]  # ascending
    how: Mapping[str, str]  # operation -> how it is done
    gaps: Mapping[str, str]  # operation -> why it cannot be ({v} = the API version)


def load_api_catalog(path: Path = _CATALOG) -> ApiCatalog:
    """slurm_rest_api.yaml, checked: every operation named exactly once as `how` or `gap`."""
    try:
        raw = load_yaml(path.read_text(), origin=str(path))
    except (OSError, YamlError) as exc:
        raise RuntimeError(f"cannot load {path}: {exc}") from exc
    if not isinstance(raw, dict) or set(raw) != {"versions", "operations"}:
        raise RuntimeError(f"{path.name}: expected exactly the keys 'versions' and 'operations'")
    versions = raw["versions"]
    if not isinstance(versions, list) or not versions or not all(isinstance(v, str) for v in versions):
        raise RuntimeError(f"{path.name}: versions: expected a non-empty list of API versions")
    for v in versions:
        if not _VERSION_RE.match(v) or v not in known_versions():
            raise RuntimeError(f"{path.name}: versions: {v!r} is not a data parser version slurmio reads")
    ops = raw["operations"]
    if not isinstance(ops, dict) or set(ops) != set(_OPERATIONS):
        got = set(ops) if isinstance(ops, dict) else set()
        raise RuntimeError(
            f"{path.name}: operations: expected {sorted(_OPERATIONS)}; "
            f"missing {sorted(set(_OPERATIONS) - got)}, unknown {sorted(got - set(_OPERATIONS))}"
        )
    how: dict[str, str] = {}
    gaps: dict[str, str] = {}
    for name, spec in ops.items():
        if not isinstance(spec, dict) or len(spec) != 1 or not isinstance(next(iter(spec.values())), str):
            raise RuntimeError(f"{path.name}: operations.{name}: expected one of how: TEXT or gap: TEXT")
        ((kind, text),) = spec.items()
        if kind not in ("how", "gap"):
            raise RuntimeError(f"{path.name}: operations.{name}: {kind!r} is neither 'how' nor 'gap'")
        (how if kind == "how" else gaps)[name] = text.strip()
    ordered = tuple(sorted(versions, key=lambda v: int(_VERSION_RE.match(v).group(1))))  # type: ignore[union-attr]
    return ApiCatalog(ordered, how, gaps)


@dataclass(frozen=True)
class TokenSource:
    """Where the JWT comes from: a file (re-read per request: rotation needs no restart), an
    environment variable, or a value the settings already read."""

    file: Path | None = None
    env: str | None = None
    value: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.file, self.env, self.value)) != 1:
            raise ValueError("give exactly one of a token file, a token environment variable or a token")

    def read(self) -> str:
        if self.file is not None:
            try:
                text = self.file.read_text()
            except OSError as exc:
                raise BackendError(f"slurmrestd token file {self.file}: {exc.strerror or exc}") from None
            where = f"token file {self.file}"
        elif self.env is not None:
            text = os.environ.get(self.env, "")
            where = f"environment variable {self.env}"
        else:
            assert self.value is not None
            text, where = self.value, "token setting"
        token = text.strip().removeprefix("SLURM_JWT=")
        if not token or any(c.isspace() or not c.isprintable() for c in token):
            raise BackendError(f"slurmrestd {where}: empty or not a single-line token")
        remember(token)  # a rotated token too: masked in whatever this process prints
        return token


class SlurmRestBackend:
    """SchedulerBackend on top of slurmrestd's slurmctld API."""

    name = "slurm-rest"

    def __init__(
        self,
        url: str,
        user: str,
        token: TokenSource,
        *,
        timeout: float = 10.0,
        api_version: str | None = None,
        allow_insecure_http: bool = False,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = _check_url(url, allow_insecure_http)
        if not re.fullmatch(r"[a-z_][a-z0-9_.-]{0,31}", user):
            raise ValueError(f"invalid Slurm user name {user!r}")
        self.user = user
        self.token = token
        self.timeout = timeout
        self.catalog = load_api_catalog()
        self._client = httpx.Client(base_url=self.url, timeout=timeout, transport=transport, follow_redirects=False)
        self.version = api_version or self._discover_version()
        if self.version not in self.catalog.versions:
            raise BackendError(
                f"slurmrestd API {self.version} is not one this backend knows ({', '.join(self.catalog.versions)})"
            )
        # The token is checked at start by a small read slurmctld authenticates: /openapi/v3 and
        # ping/ answer 200 even with a forged token (measured on 24.11.5); licenses/ says HTTP 511.
        # (partitions/ would also ask slurmdbd for TRES, which fails where slurmdbd has no JWT.)
        self._call("GET", self._path("licenses/"))
        log.info(
            "slurm-rest: %s as %s, API %s; can: %s; cannot: %s",
            self.url,
            self.user,
            self.version,
            ", ".join(sorted(self.catalog.how)),
            "; ".join(f"{op} ({self._gap_text(op)})" for op in sorted(self.catalog.gaps)),
        )

    # ---- capabilities
    def capabilities(self) -> dict[str, str]:
        """Operation -> 'yes: how' or 'no: the gap', for this server's API version."""
        out = {op: "yes: " + t.replace("{v}", self.version) for op, t in self.catalog.how.items()}
        out.update({op: f"no: {self._gap_text(op)}" for op in self.catalog.gaps})
        return dict(sorted(out.items()))

    def _gap_text(self, op: str) -> str:
        return self.catalog.gaps[op].replace("{v}", self.version)

    def _need(self, op: str) -> None:
        if op in self.catalog.gaps:
            raise RestApiGap(self._gap_text(op))

    # ---- HTTP
    def _headers(self) -> dict[str, str]:
        return {"X-SLURM-USER-NAME": self.user, "X-SLURM-USER-TOKEN": self.token.read(), "Accept": "application/json"}

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        what = f"{method} {path}"
        try:
            resp = self._client.request(method, path, headers=self._headers(), json=body)
        except httpx.TimeoutException:
            raise BackendError(f"slurmrestd {self.url}: {what} timed out after {self.timeout:g}s") from None
        except httpx.HTTPError as exc:
            raise BackendError(f"slurmrestd {self.url} unreachable: {what}: {exc}") from None
        if resp.status_code == 401:
            raise BackendError(
                f"slurmrestd refused the request (HTTP 401 {resp.text.strip()[:80]!r}): {what}; "
                f"the token is missing or not accepted for user {self.user!r}"
            )
        try:
            doc = resp.json()
        except ValueError:
            raise BackendError(f"slurmrestd: {what}: HTTP {resp.status_code}, not JSON: {resp.text[:200]!r}") from None
        if not isinstance(doc, dict):
            raise BackendError(f"slurmrestd: {what}: HTTP {resp.status_code}, expected a JSON object")
        return resp.status_code, doc

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A request whose reply must carry no errors; HTTP 511 is a refused token."""
        status, doc = self._request(method, path, body)
        errors = _errors(doc)
        if errors or status >= 400:
            self._call_failed(f"{method} {path}", status, errors)
        return doc

    def _discover_version(self) -> str:
        """The highest API version both the server and the catalog have."""
        status, doc = self._request("GET", "/openapi/v3")
        offered: set[str] = set()
        if status == 200 and isinstance(doc.get("paths"), dict):
            offered = {m.group(1) for p in doc["paths"] if (m := _PING_PATH.match(str(p)))}
        else:  # no spec served: ask each known version
            for v in reversed(self.catalog.versions):
                code, _ = self._request("GET", f"/slurm/{v}/ping/")
                if code == 200:
                    offered.add(v)
                    break
        usable = [v for v in self.catalog.versions if v in offered]
        if not usable:
            raise BackendError(
                f"slurmrestd {self.url} offers API versions {sorted(offered) or 'none'}; "
                f"this backend knows {', '.join(self.catalog.versions)}"
            )
        return usable[-1]

    def _path(self, template: str, **names: str) -> str:
        return f"/slurm/{self.version}/" + template.format(**names)

    # ---- nodes
    def drain_node(self, node: str, reason: str, *, node_failed: bool = False) -> None:
        """Drain the node; ActionRefused (nothing sent) for a node in maintenance, drained or down."""
        validate_node_name(node)
        validate_reason(reason)
        state = self.node_state(node)
        refuse_node_action("drain", state, self.maintenance_reservation(node), node_failed=node_failed)
        self._call("POST", self._path("node/{n}", n=node), {"state": ["DRAIN"], "reason": reason})

    def resume_node(self, node: str) -> None:
        validate_node_name(node)
        self._call("POST", self._path("node/{n}", n=node), {"state": ["RESUME"]})

    def reboot_node(self, node: str, reason: str) -> str:
        # slurmrestd has no reboot endpoint in the versions we read (v0.0.38-v0.0.42).
        raise RestApiGap(f"not rebooting {node}: slurmrestd offers no reboot; use the CLI or SSH backend")

    def relabel_node(self, node: str, reason: str) -> None:
        validate_node_name(node)
        validate_reason(reason)
        refuse_relabel(node, self.node_state(node))
        self._call("POST", self._path("node/{n}", n=node), {"state": ["DRAIN"], "reason": reason})

    def node_state(self, node: str) -> NodeState:
        validate_node_name(node)
        status, doc = self._request("GET", self._path("node/{n}", n=node))
        nodes = self._nodes(doc, status, f"GET node {node}")
        if node not in nodes:
            raise BackendError(f"slurmrestd: no such node {node!r}")
        return nodes[node]

    def maintenance_reservation(self, node: str) -> str | None:
        """The active MAINT reservation holding the node, if any (BackendError when unreadable)."""
        validate_node_name(node)
        doc = self._call("GET", self._path("reservations/"))
        what = "slurmrestd GET reservations"
        try:
            parser = detect(doc, what)
            raw = doc.get("reservations")
            if not isinstance(raw, list):
                raise SlurmFormatError(f"{what} (data parser {parser.version}): no 'reservations' list")
            now = time.time()
            for i, entry in enumerate(
                sorted((e for e in raw if isinstance(e, dict)), key=lambda e: str(e.get("name")))
            ):
                f = Fields(entry, parser, what, f"reservations[{i}]")
                start, end = f.number("start_time", "number"), f.number("end_time", "number")
                active = (start is None or start <= now) and (end is None or now < end)
                try:
                    nodes = expand_hostlist(f.text("node_list"))
                except HostlistError as exc:
                    raise f.fail("node_list", f"a hostlist ({exc})", entry.get("node_list")) from None
                if active and "MAINT" in f.string_list("flags") and node in nodes:
                    return f.text("name") or "?"
        except SlurmCommandError as exc:  # SlurmFormatError
            raise BackendError(str(exc)) from exc
        return None

    def list_nodes(self) -> list[NodeState]:
        status, doc = self._request("GET", self._path("nodes/"))
        return list(self._nodes(doc, status, "GET nodes").values())

    def _nodes(self, doc: dict[str, Any], status: int, what: str) -> dict[str, NodeState]:
        errors = _errors(doc)
        if errors and not doc.get("nodes"):
            # An unknown node is HTTP 200, "Failure to query node X" with error 0 ("No error"), no
            # nodes list; a refused token says the same description with error 1007 and HTTP 511.
            unknown = status == 200 and all(
                e.get("error_number") == 0 and str(e.get("description", "")).startswith("Failure to query node ")
                for e in errors
            )
            if unknown:
                return {}
            self._call_failed(what, status, errors)
        try:
            parsed = parse_nodes(doc, f"slurmrestd {what}")
        except SlurmCommandError as exc:  # SlurmFormatError: a shape slurmio does not know
            raise BackendError(str(exc)) from exc
        return {name: _node_state(n) for name, n in parsed.nodes.items()}

    def _call_failed(self, what: str, status: int, errors: list[dict[str, Any]]) -> NoReturn:
        said = _error_text(errors)
        if any(p in said for p in _NOT_PERMITTED):
            raise NotPermitted(
                f"slurmrestd: {what}: HTTP {status}: {said} -- Slurm refused this to user {self.user!r} (the "
                "token's): draining or resuming a node needs AdminLevel=Administrator (or root/SlurmUser), "
                "requeue/hold/release/cancel of another user's job AdminLevel=Operator (docs/slurm.md)"
            )
        if status == 511 or any(e.get("error_number") == 1007 for e in errors):
            raise BackendError(
                f"slurmrestd: {what}: slurmctld refused the token for user {self.user!r} "
                f"(HTTP {status}, {_error_text(errors)}): expired or not issued by this cluster"
            )
        raise BackendError(f"slurmrestd: {what}: HTTP {status}: {_error_text(errors) or 'no error text'}")

    # ---- jobs
    def job_state(self, job_id: str) -> JobState:
        job_id = validate_job_id(job_id)
        status, doc = self._request("GET", self._path("job/{j}", j=job_id))
        errors = _errors(doc)
        if any(e.get("error_number") == _NO_SUCH_JOB for e in errors):
            raise JobNotFoundError(f"job {job_id} does not exist (slurmrestd: Invalid job id specified)")
        if errors or status >= 400:
            self._call_failed(f"GET job {job_id}", status, errors)
        try:
            jobs = parse_jobs(doc, f"slurmrestd GET job {job_id}").jobs
        except SlurmCommandError as exc:
            raise BackendError(str(exc)) from exc
        if job_id not in jobs:
            raise JobNotFoundError(f"job {job_id} does not exist (slurmrestd returned no such job)")
        return _job_state(jobs[job_id])

    def annotate_job(self, job_id: str, note: str) -> None:
        job_id = validate_job_id(job_id)
        self._call("POST", self._path("job/{j}", j=job_id), {"comment": validate_reason(note)})

    def requeue_job(self, job_id: str, exclude_nodes: Sequence[str]) -> None:
        job_id = validate_job_id(job_id)
        excluded = [validate_node_name(n) for n in exclude_nodes]
        current = self.job_state(job_id)
        if current.state != "PENDING":
            # Refused before anything changes: there is no REST requeue (slurm_rest_api.yaml).
            self._need("requeue_running")
            raise BackendError(f"job {job_id} is {current.state}; nothing to requeue")  # reached only without a gap
        if not excluded:
            return  # queued already: a requeue changes nothing
        # Keep nodes excluded earlier: a recovery should never re-admit a bad node.
        merged = list(dict.fromkeys([*current.excluded_nodes, *excluded]))
        self._call("POST", self._path("job/{j}", j=job_id), {"excluded_nodes": merged})

    def cancel_job(self, job_id: str) -> None:
        job_id = validate_job_id(job_id)
        self.job_state(job_id)  # exists (an unknown id would be reported only per step)
        doc = self._call("DELETE", self._path("job/{j}", j=job_id))
        # Per-job status: an error object with a non-zero code means this job was not signalled.
        errs = [s.get("error") for s in doc.get("status") or [] if isinstance(s, dict)]
        failed = [e for e in errs if isinstance(e, dict) and e.get("code") not in (0, None)]
        if failed:
            text = failed[0].get("message") or failed[0].get("string")
            self._call_failed(f"DELETE job {job_id}", 200, [{"description": "job signal", "error": str(text)}])

    def signal_job(self, job_id: str, signal: str) -> None:
        # Not read through the REST API yet: refused, nothing sent (the migration waits for the job's own save).
        raise RestApiGap(
            f"not signalling job {job_id}: the REST backend does not send signals; use the CLI or SSH backend"
        )

    def hold_job(self, job_id: str) -> None:
        job_id = validate_job_id(job_id)
        if self.job_state(job_id).state in _RUNNING:
            self._need("hold_running")
        self._call("POST", self._path("job/{j}", j=job_id), {"hold": True})

    def release_job(self, job_id: str) -> None:
        job_id = validate_job_id(job_id)
        self._call("POST", self._path("job/{j}", j=job_id), {"hold": False})

    def close(self) -> None:
        self._client.close()


# --------------------------------------------------------------------- helpers
def _check_url(url: str, allow_insecure_http: bool) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"slurmrestd URL {url!r}: expected http(s)://HOST[:PORT]")
    if parts.scheme == "http" and parts.hostname not in _LOOPBACK and not allow_insecure_http:
        raise ValueError(
            f"slurmrestd URL {url!r}: plain http to a non-loopback host would send the token in clear; use https"
        )
    return f"{parts.scheme}://{parts.netloc}"


def _errors(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    errors = doc.get("errors") or []
    return [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []


def _error_text(errors: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"{e.get('description') or ''}: {e.get('error') or ''} (error {e.get('error_number')})".strip(": ")
        for e in errors
    )


def _hosts(text: str) -> tuple[str, ...]:
    try:
        return tuple(expand_hostlist(text))
    except HostlistError as exc:
        raise BackendError(str(exc)) from exc


def _job_state(job: JobInfo) -> JobState:
    extra = {
        k: str(v)
        for k, v in (
            ("state_reason", job.state_reason),
            ("priority", job.priority),
            ("batch_host", job.batch_host),
            ("required_nodes", job.required_nodes or None),
        )
        if v is not None
    }
    return JobState(
        job_id=job.job_id,
        state=job.state,
        nodes=_hosts(job.nodes),
        excluded_nodes=_hosts(job.excluded_nodes),
        partition=job.partition,
        name=job.name,
        restart_count=job.restart_cnt,
        comment=job.comment,
        held=job.held,
        extra=extra,
    )


def _node_state(node: NodeInfo) -> NodeState:
    node = in_force(node)  # 24.11 keeps a reason after a resume: not in force any more
    return NodeState(
        name=node.name,
        state=node.state,
        flags=node.flags,
        reason=node.reason,
        partitions=node.partitions,
        reason_user=node.reason_user,
        reason_time=node.reason_time,
    )
