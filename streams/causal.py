"""Causal reasoning over one job's evidence: which signal is the cause, which are collateral.

Pure functions over a group's anomalies (streams/attribution.py owns the grouping and state):

1. Tiers: a recognised root cause (OOM, exception, CUDA error, Xid, ...) beats collateral
   symptoms (collective timeouts), which beat bare crash markers (category `unknown`: a
   non-zero exit or a signal with no recognised cause).
2. Time: among root causes of equal weight the earliest wins; a weak root (severity warning
   or lower: a generic exception, a SIGKILL) that comes after the job's first collateral
   symptom is part of the teardown, not the cause.
3. Place: the same device or bus error on several ranks of ONE node, and on no other node of
   the job, is that node's fault (category node), whatever the error's own category.
4. Collective timeouts with no root are judged by their context: a configured timeout far
   below the default, ranks out of step (different sequence numbers and sizes), or other ranks
   still in rank-local work or finished (user_code; hang when the activity says so); with no
   such context they stay what the catalog says (interconnect).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from schemas.events import Anomaly, RankActivity
from schemas.vocab import SEVERITY_RANK, Category, Severity
from streams.detectors.activity import default_activities
from streams.ranks import rank_ranges

_SOURCE_RANK = {"kernel": 3, "scheduler": 2, "gpu": 2, "net": 2, "external": 1, "job_log": 0}
# torch's default NCCL collective timeout (10 min; 30 min for other backends and older torch).
DEFAULT_COLLECTIVE_TIMEOUT_MS = 600_000
# A configured timeout below this share of the default is "far below" it: a setting of the job.
SHORT_TIMEOUT_SHARE = 0.2
# Times below this are line order (offline, a log without timestamps), not wall-clock seconds.
_WALL_CLOCK = 1e9
# Errors that say where they happened but not why: on several ranks of one node only, the node.
_PLACE_CATEGORIES = ("gpu_hardware", "user_code")
# What a symptom with no other explanation points at, by the symptom's category.
_SUSPECT = {
    "interconnect": "suspect the network between the ranks",
    "hang": "the job hangs in a collective or a CUDA call",
    "node": "a node of the job failed; the logs do not say which",
}
# Rank-local work counts as the reason for a timeout only if it began within this share of the
# timeout (plus slack) before the timeout fired; 30 min (torch's non-NCCL default) when unknown.
_ACTIVITY_WINDOW_SHARE = 1.5
_ACTIVITY_SLACK_S = 60.0
_UNKNOWN_TIMEOUT_S = 1800.0
# A bare non-zero exit says nothing about place: every rank of a node exits when its agent stops it.
_NOT_PLACED = ("crash_exit_code",)


@dataclass(frozen=True)
class Verdict:
    top: Anomaly  # the signal the verdict rests on
    ranked: list[Anomaly]  # every anomaly, most telling first (the incident's evidence order)
    category: Category
    severity: Severity
    root: bool  # a cause was found (not only collateral or crash markers)
    culprit_node: str | None
    culprit_rank: int | None
    culprit_gpu: int | None
    isolate: bool  # the fault lives on culprit_node
    confidence: float
    explanation: str


def tier(a: Anomaly) -> int:
    if a.category == "unknown":
        return 0
    return 2 if a.role == "root" else 1


def _is_teardown(a: Anomaly, first_collateral: float | None) -> bool:
    return (
        tier(a) == 2
        and SEVERITY_RANK[a.severity] <= SEVERITY_RANK["warning"]
        and first_collateral is not None
        and a.event_time > first_collateral
    )


def rank_key(a: Anomaly, first_collateral: float | None) -> tuple[int, int, int, float]:
    t = 1 if _is_teardown(a, first_collateral) else tier(a)
    return (t, SEVERITY_RANK[a.severity], _SOURCE_RANK[a.source], -a.event_time)


def when(t: float) -> str | None:
    return time.strftime("%H:%M:%S", time.gmtime(t)) if t >= _WALL_CLOCK else None


def ranks_words(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    return rank_ranges(ranks, sep=", ")


def _who(a: Anomaly) -> str:
    parts = []
    if a.rank is not None:
        parts.append(f"rank {a.rank}")
    if a.node:
        parts.append(("on " if parts else "") + a.node)
    if a.gpu is not None:
        parts.append(f"GPU {a.gpu}")
    return " ".join(parts) or "a process"


def _collateral_desc(collateral: Sequence[Anomaly], exclude_node: str | None) -> str:
    counts = Counter(a.signature for a in collateral)
    desc = ", ".join(f"{n} x {s}" for s, n in counts.most_common())
    ranks = sorted({a.rank for a in collateral if a.rank is not None})
    nodes = sorted({a.node for a in collateral if a.node and a.node != exclude_node})
    where = []
    if ranks:
        where.append(f"ranks {ranks_words(ranks)}")
    if nodes:
        where.append(", ".join(nodes))
    return f"{desc}" + (f" on {' / '.join(where)}" if where else "")


def judge(anomalies: Sequence[Anomaly], job_nodes: Sequence[str] = ()) -> Verdict:
    collateral = [a for a in anomalies if tier(a) == 1]
    first_collateral = min((a.event_time for a in collateral), default=None)
    ranked = sorted(anomalies, key=lambda a: rank_key(a, first_collateral), reverse=True)
    top = ranked[0]
    top_tier = rank_key(top, first_collateral)[0]
    placed = _same_error_on_one_node(anomalies, job_nodes)
    if placed is not None and not (
        top_tier == 2 and top.signature != placed.top.signature and SEVERITY_RANK[top.severity] > SEVERITY_RANK["error"]
    ):
        return placed
    if top_tier == 2:
        return _root_verdict(top, ranked, collateral, first_collateral)
    if top_tier == 1:
        return _collateral_verdict(top, ranked, collateral, job_nodes)
    return _unknown_verdict(top, ranked)


# --- a root cause ---------------------------------------------------------------------------


def _root_verdict(
    top: Anomaly, ranked: list[Anomaly], collateral: list[Anomaly], first_collateral: float | None
) -> Verdict:
    roots = [a for a in ranked if tier(a) == 2 and not _is_teardown(a, first_collateral)]
    confidence = {"critical": 0.9, "error": 0.75, "warning": 0.5, "info": 0.3}[top.severity]
    at = when(top.event_time)
    sentence = f"{_who(top)} reported {top.signature}" + (f" at {at}" if at else " first")
    others = [a for a in collateral if a.node != top.node or a.rank != top.rank]
    if others and first_collateral is not None:
        gap = first_collateral - top.event_time
        if at and gap >= 1:
            lead = f"{gap:.0f} s before"
        elif gap >= 0:
            lead = "before"
        else:
            lead = "with"
        sentence += (
            f", {lead} the other ranks' {_collateral_desc(others, top.node)}, which are collateral, explained by it"
        )
        confidence += 0.05
    elif collateral:
        sentence += f"; also seen: {_collateral_desc(collateral, None)}"
    parts = [sentence, f"{top.signature}: {top.meaning}"]
    rivals = {a.node for a in roots if a.node != top.node and a.severity == top.severity}
    if rivals:
        confidence -= 0.25
        parts.append(f"equally severe root signals also on {', '.join(sorted(n or '?' for n in rivals))}")
    late = [a for a in ranked if _is_teardown(a, first_collateral)]
    if late and top is not late[0]:
        parts.append(
            f"later {', '.join(sorted({a.signature for a in late}))} after the first timeout: part of the teardown"
        )
    node, rank, gpu = _where(top, roots)
    return Verdict(
        top=top,
        ranked=ranked,
        category=top.category,
        severity=top.severity,
        root=True,
        culprit_node=node,
        culprit_rank=rank,
        culprit_gpu=gpu,
        isolate=top.isolate,
        confidence=_clamp(confidence),
        explanation="; ".join(parts),
    )


def _where(top: Anomaly, roots: Sequence[Anomaly]) -> tuple[str | None, int | None, int | None]:
    """The culprit as far as the evidence knows it: what the top signal lacks, the other lines of
    the same error supply when they all agree (a traceback without a rank, then "[Rank 1] ... the
    same CUDA error" from the watchdog of that rank)."""
    same = [a for a in roots if a.signature == top.signature]

    def agreed(values: set[object]) -> object:
        values.discard(None)
        return next(iter(values)) if len(values) == 1 else None

    node = top.node or agreed({a.node for a in same})
    rank = top.rank if top.rank is not None else agreed({a.rank for a in same})
    gpu = top.gpu if top.gpu is not None else agreed({a.gpu for a in same})
    return (
        node if isinstance(node, str) else None,
        rank if isinstance(rank, int) else None,
        gpu if isinstance(gpu, int) else None,
    )


def _place_candidate(a: Anomaly) -> bool:
    """An error that says where it happened but not why (a device or bus error, a crash by signal)."""
    if a.role != "root" or a.signature in _NOT_PLACED:
        return False
    if a.category == "unknown":
        return True
    return a.category in _PLACE_CATEGORIES and SEVERITY_RANK[a.severity] >= SEVERITY_RANK["error"]


def _same_error_on_one_node(anomalies: Sequence[Anomaly], job_nodes: Sequence[str]) -> Verdict | None:
    """The same device/bus error on several ranks of one node and on no other node: the node."""
    by_sig: dict[str, list[Anomaly]] = {}
    for a in anomalies:
        if _place_candidate(a):
            by_sig.setdefault(a.signature, []).append(a)
    for same in sorted(by_sig.values(), key=lambda xs: min(x.event_time for x in xs)):
        nodes = {a.node for a in same}
        ranks = {a.rank for a in same if a.rank is not None}
        if len(nodes) != 1 or None in nodes or len(ranks) < 2:
            continue
        node = next(iter(n for n in nodes if n))
        other_nodes = {n for n in job_nodes if n != node} | {a.node for a in anomalies if a.node and a.node != node}
        if not other_nodes:
            continue  # a one-node job: the code is as likely as the node
        top = min(same, key=lambda a: a.event_time)
        ranked = sorted(anomalies, key=lambda a: (a.signature == top.signature, -a.event_time), reverse=True)
        explanation = (
            f"the same {top.signature} on ranks {ranks_words(sorted(ranks))}, all on {node}, and on no other node "
            f"of the job ({', '.join(sorted(other_nodes))}): a fault of {node}, not of the code; "
            f"{top.signature}: {top.meaning}"
        )
        return Verdict(
            top=top,
            ranked=ranked,
            category="node",
            severity="critical" if top.severity == "critical" else "error",
            root=True,
            culprit_node=node,
            culprit_rank=None,
            culprit_gpu=None,
            isolate=True,
            confidence=0.8,
            explanation=explanation,
        )
    return None


# --- only collateral: judge the timeouts by their context ---------------------------------------


def _collateral_verdict(
    top: Anomaly, ranked: list[Anomaly], collateral: list[Anomaly], job_nodes: Sequence[str]
) -> Verdict:
    reporters = sorted({a.rank for a in collateral if a.rank is not None})
    who = (
        f"ranks {ranks_words(reporters)}" if len(reporters) > 1 else (f"rank {reporters[0]}" if reporters else "ranks")
    )
    ops = sorted({a.facts["op"] for a in collateral if "op" in a.facts})
    op = f" in {'/'.join(ops)}" if ops else ""
    base = dict(top=top, ranked=ranked, severity=top.severity, root=False, culprit_node=None, culprit_gpu=None)

    busy = _busy_peers(collateral, reporters)
    if busy:
        act = busy[0]
        entry = default_activities()[act.activity]
        at = when(act.time)
        peer = f"rank {act.rank}" if act.rank is not None else "another rank"
        if act.node:
            peer += f" on {act.node}"
        return Verdict(
            **base,  # type: ignore[arg-type]
            category=entry.category,
            culprit_rank=act.rank,
            isolate=False,
            confidence=0.65,
            explanation=(
                f"{who} timed out{op} while {peer} was {entry.doing} (since {at or 'earlier in the log'}: "
                f"{act.line!r}): the others waited on rank-local work, a matter of the training code or its "
                "timeout, not of the network"
            ),
        )

    timeouts = [int(a.facts["timeout_ms"]) for a in collateral if a.facts.get("timeout_ms", "").isdigit()]
    if timeouts and min(timeouts) < DEFAULT_COLLECTIVE_TIMEOUT_MS * SHORT_TIMEOUT_SHARE:
        ms = min(timeouts)
        return Verdict(
            **base,  # type: ignore[arg-type]
            category="user_code",
            culprit_rank=None,
            isolate=False,
            confidence=0.7,
            explanation=(
                f"{who} timed out{op} after the configured collective timeout of {ms / 1000:g} s "
                f"(Timeout(ms)={ms}), far below the {DEFAULT_COLLECTIVE_TIMEOUT_MS // 1000} s default: the job's "
                "setting cut off work that takes longer, not a network fault"
            ),
        )

    desync = _out_of_step(collateral)
    if desync:
        return Verdict(
            **base,  # type: ignore[arg-type]
            category="user_code",
            culprit_rank=None,
            isolate=False,
            confidence=0.55,
            explanation=(
                f"{who} timed out in different collectives ({desync}): the ranks are out of step, one entered a "
                "collective the others never called (a code path taken by only some ranks), not a network fault"
            ),
        )

    nodes = sorted({a.node or "?" for a in collateral})
    explanation = (
        f"{_collateral_desc(collateral, None)}{op}, and nothing else explains it: no earlier failure, "
        f"no rank-local work, no short timeout; {_SUSPECT.get(top.category, 'the cause is not in the logs')}"
    )
    if nodes != ["?"]:
        explanation += f"; reported from {', '.join(nodes)}"
    silent = _silent_node(ranked, job_nodes)
    if silent:
        explanation += f"; {silent} is the only node of the job that reported nothing: suspect it"
    return Verdict(
        **base,  # type: ignore[arg-type]
        category=top.category,
        culprit_rank=None,
        isolate=False,
        confidence=0.4,
        explanation=explanation,
    )


def _busy_peers(collateral: Sequence[Anomaly], reporters: Sequence[int]) -> list[RankActivity]:
    """Open rank-local activities of ranks that did not report a timeout, most recent first."""
    seen: dict[tuple[int | None, str | None], RankActivity] = {}
    for a in collateral:
        # The others entered the collective about timeout_ms before it fired: work begun much
        # earlier than that was over by then (they had trained on with that rank since).
        timeout_s = int(a.facts["timeout_ms"]) / 1000 if a.facts.get("timeout_ms", "").isdigit() else None
        window_s = (timeout_s or _UNKNOWN_TIMEOUT_S) * _ACTIVITY_WINDOW_SHARE + _ACTIVITY_SLACK_S
        for act in a.activity:
            if act.rank is not None and act.rank in reporters:
                continue
            if act.time > a.event_time or act.time < a.event_time - window_s:
                continue
            key = (act.rank, act.node)
            if key not in seen or act.time > seen[key].time:
                seen[key] = act
    return sorted(seen.values(), key=lambda x: -x.time)


def _out_of_step(collateral: Sequence[Anomaly]) -> str | None:
    """Ranks timing out in different collectives: different sequence numbers AND sizes or types."""
    works = {(a.facts["seq"], a.facts.get("op"), a.facts.get("numel")) for a in collateral if "seq" in a.facts}
    if len({w[0] for w in works}) < 2 or len({(w[1], w[2]) for w in works}) < 2:
        return None
    return ", ".join(f"SeqNum {s} {o or '?'} of {n or '?'} elements" for s, o, n in sorted(works)[:4])


def _silent_node(anomalies: Sequence[Anomaly], job_nodes: Sequence[str]) -> str | None:
    reporting = {a.node for a in anomalies if a.node}
    silent = [n for n in job_nodes if n not in reporting]
    return silent[0] if len(job_nodes) > 2 and len(silent) == 1 else None


# --- a crash and nothing known ---------------------------------------------------------------


def _unknown_verdict(top: Anomaly, ranked: list[Anomaly]) -> Verdict:
    crashes = Counter(a.signature for a in ranked)
    at = when(top.event_time)
    explanation = (
        f"{_who(top)} crashed ({top.signature}{' at ' + at if at else ''}: {top.line[:200]!r}) and no known cause is "
        f"in the logs ({', '.join(f'{n} x {s}' for s, n in crashes.most_common())}): needs a person"
    )
    return Verdict(
        top=top,
        ranked=ranked,
        category="unknown",
        severity=top.severity,
        root=False,
        culprit_node=None,
        culprit_rank=top.rank,
        culprit_gpu=top.gpu,
        isolate=False,
        confidence=0.3,
        explanation=explanation,
    )


def _clamp(confidence: float) -> float:
    return round(max(0.05, min(confidence, 0.99)), 2)
