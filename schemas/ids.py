"""Stable, content-derived identifiers so every consumer can be idempotent, and the
cluster they belong to.

Several clusters may share one Kafka and one ClickHouse: job ids (and node names)
repeat across clusters, so every id a process derives includes its cluster name.
The name is process-wide - a process serves one cluster - and is set once at start
from the settings (`set_cluster`). The default cluster's ids are those of releases
before the cluster name existed, so a single-cluster site keeps its ids.
"""

from __future__ import annotations

import hashlib
import re

from schemas.errors import ConfigError

DEFAULT_CLUSTER = "default"
# A DNS label: usable in topic-free places such as Kubernetes names, metric labels and ids.
CLUSTER_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

_cluster = DEFAULT_CLUSTER


class ClusterNameError(ConfigError, ValueError):
    pass


def check_cluster(name: str) -> str:
    if not CLUSTER_RE.match(name):
        raise ClusterNameError(
            f"cluster name {name!r} is not a DNS label (lower-case letters, digits and '-', at most 63 characters)"
        )
    return name


def set_cluster(name: str) -> None:
    """The cluster this process serves: every event it makes and every id it derives carries it."""
    global _cluster
    _cluster = check_cluster(name)


def current_cluster() -> str:
    return _cluster


def stable_id(prefix: str, *parts: object) -> str:
    if _cluster != DEFAULT_CLUSTER:
        parts = (_cluster, *parts)
    digest = hashlib.blake2b(
        "\x1f".join(str(p) for p in parts).encode("utf-8", "surrogatepass"), digest_size=10
    ).hexdigest()
    return f"{prefix}-{digest}"


def cluster_scoped(name: str) -> str:
    """A consumer group or app id of this process's cluster: the clusters sharing one Kafka must
    not share a group (its members would split each other's partitions)."""
    return name if _cluster == DEFAULT_CLUSTER else f"{name}.{_cluster}"
