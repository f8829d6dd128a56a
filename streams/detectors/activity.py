"""What each rank of a job is doing (checkpoint, validation, finished), from its log lines.

Not a fault detector: it keeps, per job, each rank's current rank-local activity, so that
a collective timeout can carry what the job's other ranks were doing when it fired (the
context streams/causal.py reasons with). The patterns are data: streams/catalog/activities.yaml.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from schemas.errors import ConfigError
from schemas.events import LogLine, RankActivity
from schemas.vocab import Category
from schemas.yamlsafe import YamlError, load_yaml

CATALOG = Path(__file__).resolve().parent.parent / "catalog" / "activities.yaml"
MAX_JOBS = 4096
MAX_RANKS_PER_JOB = 4096
MAX_PEERS_IN_ANOMALY = 16
MAX_LINE = 300


class ActivityError(ConfigError, ValueError):
    pass


class Activity(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9_]+$")
    pattern: str
    ends: bool
    category: Category
    doing: str = Field(min_length=1)
    source: str = Field(pattern=r"^https://")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except (re.error, OverflowError, RecursionError) as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


def load_activities(path: Path = CATALOG) -> tuple[Activity, ...]:
    try:
        raw = load_yaml(path.read_text(), str(path))
    except (OSError, YamlError) as exc:
        raise ActivityError(f"{path}: cannot read: {exc}") from None
    if not isinstance(raw, list):
        raise ActivityError(f"{path}: expected a list of entries")
    out: list[Activity] = []
    for i, entry in enumerate(raw):
        try:
            out.append(Activity.model_validate(entry))
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ActivityError(f"{path}: entry {i}: field '{'.'.join(map(str, err['loc']))}': {err['msg']}") from None
    if len({a.id for a in out}) != len(out):
        raise ActivityError(f"{path}: duplicate id")
    return tuple(out)


@lru_cache(maxsize=1)
def default_activities() -> dict[str, Activity]:
    return {a.id: a for a in load_activities()}


_RankKey = tuple[int | None, str | None]


class ActivityTracker:
    """Per job, each rank's open rank-local activity (bounded in jobs and ranks)."""

    def __init__(self, activities: tuple[Activity, ...] | None = None) -> None:
        acts = activities if activities is not None else tuple(default_activities().values())
        self._compiled = [(a, re.compile(a.pattern)) for a in acts]
        self._jobs: OrderedDict[str, OrderedDict[_RankKey, RankActivity]] = OrderedDict()

    def observe(self, job_id: str, line: LogLine, node: str | None) -> None:
        for act, regex in self._compiled:
            if regex.search(line.text):
                ranks = self._jobs.setdefault(job_id, OrderedDict())
                self._jobs.move_to_end(job_id)
                key = (line.rank, node)
                ranks.pop(key, None)
                if not act.ends:
                    ranks[key] = RankActivity(
                        rank=line.rank, node=node, activity=act.id, time=line.ts, line=line.text[:MAX_LINE]
                    )
                    while len(ranks) > MAX_RANKS_PER_JOB:
                        ranks.popitem(last=False)
                while len(self._jobs) > MAX_JOBS:
                    self._jobs.popitem(last=False)
                return

    def peers(self, job_id: str, rank: int | None, node: str | None) -> list[RankActivity]:
        """The open activities of the job's ranks other than (rank, node), most recent first."""
        ranks = self._jobs.get(job_id)
        if not ranks:
            return []
        others = [a for (r, n), a in ranks.items() if not (r == rank and (n == node or n is None or node is None))]
        return sorted(others, key=lambda a: -a.time)[:MAX_PEERS_IN_ANOMALY]
