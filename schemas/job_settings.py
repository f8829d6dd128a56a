"""What a job's owner (or an operator's job rule) asks of trainmedic for one job (shared by policy
and the executor, which reads the comment again just before it touches the job).

A job carries its setting in its Slurm Comment (`sbatch --comment "exp42 trainmedic=monitor"`):
one token `trainmedic=VALUE`, VALUE a comma list of

    off           trainmedic never acts on the job (it still drains a node whose own fault
                  endangers the jobs it would get next: the node only, the job is left alone)
    monitor       actions on the job are recommendations only (the node drain as above)
    restarts=N    at most N restarts of the job (capped by the policy's restart budget)
    checkpoint_signal=SIG   the job saves a checkpoint when sent SIG (USR1 or USR2; B:USR1 or
                  B:USR2 for the batch shell only, as sbatch --signal writes it): before a migration
                  waits for the job's next checkpoint (streams/migration.py), the executor sends it

Operators set the same values by job name, user, account or partition (the policy's
`job_settings.rules`). Every setting that applies counts, and the strictest wins: off over
monitor, the lowest restart limit - neither the job's owner nor a rule can loosen another.
A setting that cannot be read makes the job's actions recommendations only, and says why:
a typo must not leave a job under autonomy its owner meant to switch off.

The executor's own mark in the Comment (`trainmedic act-... restarts=N`, sinks/executor.py) has
no `=` after `trainmedic`, so it is never read as a setting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from schemas.errors import ConfigError

JobMode = Literal["off", "monitor"]
_STRICTNESS: dict[JobMode | None, int] = {None: 0, "monitor": 1, "off": 2}
# A token of its own: "trainmedic=" at the start or after whitespace, up to the next whitespace.
TOKEN_RE = re.compile(r"(?:^|\s)trainmedic=(\S*)")
# Anything that looks like an attempt at one ("Trainmedic=off", "x,trainmedic=off", "trainmedic = off",
# "trainmedic:off"): read as an error, so a near miss makes the job recommend-only, never autonomous.
_ATTEMPT_RE = re.compile(r"(?<![A-Za-z0-9_])trainmedic\s*[=:]", re.IGNORECASE)
_RESTARTS_RE = re.compile(r"restarts=(\d{1,4})")
# Only the user signals: a signal a job does not handle ends it, and these two are the ones sbatch's
# --signal convention and the frameworks' checkpoint-on-signal hooks use.
_SIGNAL_RE = re.compile(r"checkpoint_signal=((?:B:)?USR[12])")


class JobSettingError(ConfigError, ValueError):
    """A trainmedic= value that cannot be read (a job's comment, a job rule's `set`)."""


@dataclass(frozen=True)
class JobSetting:
    """One source's setting for a job."""

    source: str  # "the job's comment", "job_settings.rules.NAME"
    mode: JobMode | None = None
    max_restarts: int | None = None
    checkpoint_signal: str | None = None


def parse_value(value: str, source: str) -> JobSetting:
    """`off`, `monitor`, `restarts=N`, or a comma list of them. JobSettingError names what is wrong."""
    mode: JobMode | None = None
    max_restarts: int | None = None
    signal: str | None = None
    items = [v.strip() for v in value.split(",")]
    if not value.strip() or any(not v for v in items):
        raise JobSettingError(f"{source}: trainmedic={value!r}: empty item (expected off, monitor or restarts=N)")
    for item in items:
        if item in ("off", "monitor"):
            if mode is not None and mode != item:
                raise JobSettingError(f"{source}: trainmedic={value}: both off and monitor")
            mode = item  # type: ignore[assignment]
        elif m := _RESTARTS_RE.fullmatch(item):
            max_restarts = int(m.group(1))
        elif m := _SIGNAL_RE.fullmatch(item):
            signal = m.group(1)
        else:
            raise JobSettingError(
                f"{source}: trainmedic={value}: {item!r} is not off, monitor, restarts=N (N a whole number) or "
                "checkpoint_signal=SIG (USR1, USR2, B:USR1, B:USR2)"
            )
    return JobSetting(source, mode, max_restarts, signal)


def from_comment(comment: str | None) -> list[JobSetting]:
    """The settings written in a job's Comment (none when it has no trainmedic= token).
    JobSettingError for a value that cannot be read, and for a near miss of the token."""
    text = comment or ""
    exact = {m.start(1) - len("trainmedic=") for m in TOKEN_RE.finditer(text)}
    for m in _ATTEMPT_RE.finditer(text):
        if m.start() not in exact:
            # The whole word it sits in ("exp42,trainmedic=off"), or the rest of the line.
            left = max(text.rfind(" ", 0, m.start()), text.rfind("\t", 0, m.start())) + 1
            word = text[left:].split()[0] if text[left:].split() else m.group()
            raise JobSettingError(
                f"the job's comment: {word!r} is not a setting (write trainmedic=off, trainmedic=monitor or "
                "trainmedic=restarts=N as a word of its own, lower case)"
            )
    return [parse_value(v, "the job's comment") for v in TOKEN_RE.findall(text)]


def checkpoint_signal(comment: str | None) -> str | None:
    """The signal the job's comment says makes it save a checkpoint; None when it declares none or
    its setting cannot be read (a signal the job may not handle is never sent)."""
    try:
        return next((s.checkpoint_signal for s in from_comment(comment) if s.checkpoint_signal), None)
    except JobSettingError:
        return None


def job_mode(comment: str | None) -> tuple[JobMode | None, str | None]:
    """What the comment says of touching the job now (the executor's last check before a call):
    its mode, or the error that makes it recommend-only."""
    try:
        return merge(from_comment(comment)).mode, None
    except JobSettingError as exc:
        return None, str(exc)


@dataclass(frozen=True)
class Effective:
    """The settings that apply to a job, merged: the strictest of each."""

    mode: JobMode | None = None
    max_restarts: int | None = None
    sources: tuple[JobSetting, ...] = ()
    errors: tuple[str, ...] = field(default=())

    @property
    def recommend_only(self) -> bool:
        """Actions on the job may only be recommended (monitor, or an unreadable setting)."""
        return self.mode == "monitor" or bool(self.errors)

    def mode_source(self) -> str:
        return next((s.source for s in self.sources if s.mode == self.mode), "")

    def restarts_source(self) -> str:
        return next((s.source for s in self.sources if s.max_restarts == self.max_restarts), "")

    def describe(self) -> str:
        parts = []
        if self.mode is not None:
            parts.append(f"trainmedic={self.mode} ({self.mode_source()})")
        if self.max_restarts is not None:
            parts.append(f"restarts={self.max_restarts} ({self.restarts_source()})")
        parts.extend(f"unreadable: {e}" for e in self.errors)
        return "; ".join(parts) or "none"


def merge(settings: list[JobSetting], errors: list[str] | None = None) -> Effective:
    mode: JobMode | None = None
    limit: int | None = None
    for s in settings:
        if _STRICTNESS[s.mode] > _STRICTNESS[mode]:
            mode = s.mode
        if s.max_restarts is not None and (limit is None or s.max_restarts < limit):
            limit = s.max_restarts
    return Effective(mode, limit, tuple(settings), tuple(errors or ()))
