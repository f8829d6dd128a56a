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

The derivations are pure functions, shared by the producers (which sign or hand out), the
ingest server and the streams (which verify). Data only: no I/O, nothing from Kafka.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = [
    "MIN_SITE_SECRET_CHARS",
    "NODE_SIGNATURE_HEADER",
    "check_site_secret",
    "job_token",
    "node_key",
    "sign_node_record",
    "verify_job_token",
    "verify_node_record",
]

MIN_SITE_SECRET_CHARS = 32
NODE_SIGNATURE_HEADER = "tm-node-sig"  # Kafka record header: "<node>:<hex HMAC of the value>"
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
