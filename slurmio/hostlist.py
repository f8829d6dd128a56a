"""Slurm hostlist expansion (``gpu[01-03,05],cpu1`` -> names), one implementation for all.

The expansion itself is python-hostlist's (PyPI ``python-hostlist``, NSC's
library that follows Slurm's syntax: zero padding from the lower bound,
several bracket groups as a cartesian product, duplicates and order kept).
This module adds what trainmedic needs around it: Slurm's placeholders
(``(null)``, ``None``, ``N/A``) mean no nodes, an empty name (``a,,b``) and an
absurdly long number are refused, so is an expanded name that is not a Slurm
node name (schemas.ids: no whitespace, control character or stray bracket gets
through as a name), every failure is a `HostlistError`, and
results are cached (a poll expands the same job lists again and again).
The integration tests compare it with ``scontrol show hostnames`` on both
clusters.
"""

from __future__ import annotations

import functools
import re

import hostlist as _pyhostlist

from schemas.errors import UsageError
from schemas.ids import is_node_name

__all__ = ["HostlistError", "MAX_HOSTS", "expand_hostlist"]

_EMPTY = ("", "(null)", "None", "N/A", "none")
# python-hostlist's own limit on one expansion.
MAX_HOSTS = int(getattr(_pyhostlist, "MAX_SIZE", 100_000))
# Real node numbers are a few digits; this keeps int() far from its 4,300-digit limit.
_LONG_NUMBER = re.compile(r"[0-9]{19,}")


class HostlistError(UsageError, ValueError):
    """A Slurm hostlist expression that cannot be expanded."""


def expand_hostlist(text: str | None) -> list[str]:
    """Node names of a Slurm hostlist, in Slurm's order; [] for empty input and placeholders.

    Raises HostlistError on malformed input or more than MAX_HOSTS names.
    """
    if text is None:
        return []
    stripped = text.strip()
    if stripped in _EMPTY:
        return []
    return list(_expand_cached(stripped))


@functools.lru_cache(maxsize=4096)
def _expand_cached(text: str) -> tuple[str, ...]:
    if _LONG_NUMBER.search(text):
        raise HostlistError(f"number too long in hostlist {text[:80]!r}")
    _check_names(text)
    try:
        names = _pyhostlist.expand_hostlist(text, allow_duplicates=True)
    except _pyhostlist.BadHostlist as exc:
        raise HostlistError(f"bad hostlist {text[:200]!r}: {exc}") from None
    for name in names:
        if not is_node_name(name):
            raise HostlistError(f"hostlist {text[:200]!r} names {name[:80]!r}, not a Slurm node name")
    return tuple(names)


def _check_names(text: str) -> None:
    # python-hostlist skips empty names ("a,,b" -> a b); Slurm refuses them, and so do we.
    depth = 0
    start = 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if not text[start:i].strip():
                raise HostlistError(f"empty name in hostlist {text[:200]!r}")
            start = i + 1
