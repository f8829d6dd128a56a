"""Credentials derived from the one site secret: per-job ingest tokens and per-node signing keys.

A site has one secret (the setting ``site_secret``), known to the ingest server, the streams
workers and whoever hands credentials out (a Slurm prolog, the node producers' deployment).
Every credential is an HMAC-SHA256 of the site secret, with a label per use, so a key of one
kind is never valid as another:

- a job's ingest token: ``HMAC(HMAC(site, "trainmedic/v1/job-token"), cluster "\\n" job id)``,
  handed to the job by a prolog (``trainmedic ingest job-token JOBID``); it lets the job report
  about itself and about no other job;
- a node's signing key: ``HMAC(HMAC(site, "trainmedic/v1/node-key"), cluster "\\n" node)``,
  given to that node's producers only; a record signed with it is accepted only for that node.

A node's producers hold only its key (the setting ``node_key``, written by
``trainmedic ingest node-key NODE``) and sign each record they publish on a node topic
(``NODE_SIGNED_TOPICS``) with it (``NodeSigner``, used by ``bus.publish.Publisher``); the streams
worker, which holds the site secret, checks them (``check_node_signature``).

The derivations are pure functions, shared by the producers (which sign or hand out), the
ingest server and the streams (which verify). Data only: no I/O, nothing from Kafka.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas.topics import GPU_SAMPLES, NET_PORTS, NODE_KERNEL

__all__ = [
    "MIN_SITE_SECRET_CHARS",
    "NODE_SIGNATURE_HEADER",
    "NODE_SIGNED_TOPICS",
    "NodeSigner",
    "check_node_signature",
    "check_site_secret",
    "job_token",
    "node_key",
    "parse_node_key",
    "sign_node_record",
    "verify_job_token",
    "verify_node_record",
]

MIN_SITE_SECRET_CHARS = 32
NODE_SIGNATURE_HEADER = "tm-node-sig"  # Kafka record header: "<node>:<hex HMAC of the value>"
# The topics whose records speak for one node (the record's `node` field): its producers sign them.
NODE_SIGNED_TOPICS = frozenset({GPU_SAMPLES.name, NODE_KERNEL.name, NET_PORTS.name})
# Dead-letter reasons of the streams worker (the reason text starts with one of them).
SIGNATURE_INVALID = "node_signature_invalid"
SIGNATURE_MISSING = "node_signature_missing"
_JOB_LABEL = b"trainmedic/v1/job-token"
_NODE_LABEL = b"trainmedic/v1/node-key"


def check_site_secret(secret: str) -> bytes:
    """The site secret as bytes; ValueError naming the problem if it is too weak or malformed."""
    if len(secret) < MIN_SITE_SECRET_CHARS:
        raise ValueError(f"the site secret must be at least {MIN_SITE_SECRET_CHARS} characters")
    if any(c.isspace() for c in secret) or not secret.isprintable():
        raise ValueError("the site secret must be printable without whitespace")
    return secret.encode()


def _derive(site_secret: bytes, label: bytes, *parts: str) -> bytes:
    purpose = hmac.new(site_secret, label, hashlib.sha256).digest()
    return hmac.new(purpose, "\n".join(parts).encode(), hashlib.sha256).digest()


def job_token(site_secret: bytes, cluster: str, job_id: str) -> str:
    """The job's ingest credential, as sent: ``job:<job id>:<64 hex>``."""
    return f"job:{job_id}:{_derive(site_secret, _JOB_LABEL, cluster, job_id).hex()}"


def verify_job_token(site_secret: bytes, cluster: str, presented: str) -> str | None:
    """The job id the presented ``job:<id>:<hex>`` token is valid for, or None (constant-time compare)."""
    prefix, sep, rest = presented.partition(":")
    job_id, sep2, _mac = rest.partition(":")
    if prefix != "job" or not sep or not sep2 or not job_id or len(job_id) > 64:
        return None
    expected = job_token(site_secret, cluster, job_id)
    return job_id if hmac.compare_digest(presented.encode(), expected.encode()) else None


def node_key(site_secret: bytes, cluster: str, node: str) -> bytes:
    """The node's signing key: what its producers hold instead of the site secret."""
    return _derive(site_secret, _NODE_LABEL, cluster, node)


def sign_node_record(key: bytes, node: str, value: bytes) -> bytes:
    """The header value a node producer attaches to a record: ``<node>:<hex HMAC(key, value)>``."""
    return f"{node}:{hmac.new(key, value, hashlib.sha256).hexdigest()}".encode()


def verify_node_record(site_secret: bytes, cluster: str, header: bytes, value: bytes, record_node: str) -> str | None:
    """None when ``header`` is a valid signature of ``value`` by ``record_node``'s key, else why not.

    The node is taken from the header only to find the key; the record must name the same node,
    so one node's key cannot speak for another node.
    """
    try:
        text = header.decode("ascii")
    except UnicodeDecodeError:
        return "signature header is not ASCII"
    signer, sep, mac = text.rpartition(":")
    if not sep or not signer or len(mac) != 64:
        return "malformed signature header"
    expected = hmac.new(node_key(site_secret, cluster, signer), value, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac.encode(), expected.encode()):
        return f"bad signature for node {signer[:64]!r}"
    if signer != record_node:
        return f"record names node {record_node[:64]!r} but is signed by node {signer[:64]!r}"
    return None


def parse_node_key(text: str) -> bytes:
    """A node key as ``trainmedic ingest node-key`` prints it (64 hex digits); ValueError otherwise."""
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != hashlib.sha256().digest_size:
        raise ValueError("a node key is 64 hex digits, as `trainmedic ingest node-key NODE` prints it")
    return key


@dataclass(frozen=True)
class NodeSigner:
    """A node producer's signing: its node name and that node's key (never the site secret)."""

    node: str
    key: bytes = field(repr=False)

    def header(self, topic: str, value: bytes) -> list[tuple[str, bytes]] | None:
        """The record headers to send with ``value`` on ``topic``: the signature on a node topic."""
        if topic not in NODE_SIGNED_TOPICS:
            return None
        return [(NODE_SIGNATURE_HEADER, sign_node_record(self.key, self.node, value))]


def check_node_signature(
    site_secret: bytes | None,
    cluster: str,
    headers: Mapping[str, bytes] | None,
    value: bytes,
    record_node: str,
    required: bool = False,
) -> str | None:
    """The streams worker's decision on one node record: None to accept it, else the dead-letter
    reason (``node_signature_invalid: ...`` or ``node_signature_missing: ...``).

    Without a site secret nothing is checked (a site that has not set one up). With one, a record
    carrying a signature must verify for the node the record itself names; an unsigned record is
    accepted unless ``required``."""
    if site_secret is None:
        return None
    header = (headers or {}).get(NODE_SIGNATURE_HEADER)
    if header is None:
        if required:
            return f"{SIGNATURE_MISSING}: record of node {record_node[:64]!r} is not signed (node_signing_required)"
        return None
    why = verify_node_record(site_secret, cluster, header, value, record_node)
    return None if why is None else f"{SIGNATURE_INVALID}: {why}"
