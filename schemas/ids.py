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
from collections.abc import Iterable

from schemas.errors import ConfigError, UsageError

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


# --- Slurm node names ----------------------------------------------------------------------
# The one grammar of a node name, held wherever one enters (ingest, producers, API, CLI, the
# events' models, the scheduler backends). From Slurm's own definition:
# - slurm.conf(5), NodeName: "Typically this would be the string that /bin/hostname -s
#   returns. It may also be the fully qualified domain name ... (e.g. "foo1.bar.com")": a host
#   name, so letters, digits, '-' and '.' (RFC 1123), and '_', which sites use and Slurm takes.
# - src/common/hostlist.c: hostlist_create() splits on "\t, " (tab, comma, space), and '[' ']'
#   are range syntax (gpu[01-04]): none of them can be part of one name. A hostlist expression
#   is valid where the code takes hostlists (slurmio.hostlist); its expanded names must match this.
# - hostlist.c: "hostnames will probably be truncated if longer than MAXHOSTNAMELEN" (64, as
#   Linux's HOST_NAME_MAX): at most 64 characters.
# A name starts with a letter or digit: one starting with '-' would read as an option to the
# scheduler's and ssh's commands, and '.' is no host name's start. No control character, no
# whitespace: nothing that can forge a line of a terminal table or a log.
NODE_NAME_MAX = 64
NODE_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"  # unanchored, to embed in other patterns
NODE_NAME_RE = re.compile(NODE_NAME_PATTERN)


class NodeNameError(UsageError, ValueError):
    """Not a Slurm node name; the message shows the value with its control characters escaped."""


def is_node_name(name: object) -> bool:
    return isinstance(name, str) and NODE_NAME_RE.fullmatch(name) is not None


def node_for_host(host: str, nodes: Iterable[str]) -> str | None:
    """The one of `nodes` that `host` names: the same name, else the one with the same short name
    (the first DNS label: a log's `socket.getfqdn()` "gpu01.cluster.local" is Slurm's "gpu01"), or
    None when none or several do."""
    names = tuple(nodes)
    if host in names:
        return host
    short = host.split(".", 1)[0]
    found = [n for n in names if n.split(".", 1)[0] == short]
    return found[0] if len(found) == 1 else None


def check_node_name(name: str, what: str = "node name") -> str:
    """`name` if it is a Slurm node name; else NodeNameError naming `what` and the value (repr:
    control characters escaped, cut at 80 characters)."""
    if is_node_name(name):
        return name
    shown = repr(name[:80]) + ("..." if len(name) > 80 else "") if isinstance(name, str) else repr(name)
    raise NodeNameError(
        f"invalid {what} {shown}: a Slurm node name is 1-{NODE_NAME_MAX} letters, digits, '.', '_' or '-', "
        "starting with a letter or digit"
    )


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
