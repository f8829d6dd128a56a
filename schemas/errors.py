"""The one root of trainmedic's exceptions, and what each kind means as a CLI exit status.

Every exception class in the project derives from `TrainmedicError`, most through one of
the subclasses below, chosen by what the failure means to whoever ran the command. The CLI
maps them in one place (trainmedic/cli/base.py): an expected error prints one line,
``error: MESSAGE``, on stderr and exits with its class's `exit_code`; no traceback.

Exit status (docs/cli.md has the same table):

====  ===========  ==================================================================
code  name         meaning
====  ===========  ==================================================================
0     OK           done; a query's answer is yes / healthy
1     NO           a finding, or a query's answer is no: `diagnose` found a fault,
                   `audit job`/`audit node` found nothing, the demo attributed wrongly
2     USAGE        the command cannot be done as given: bad option or input, a wrong
                   configuration (policy, settings), or a request the service refused
                   (unknown id, bad token, already decided, not ready for autonomy)
3     UNAVAILABLE  something trainmedic needs did not answer (broker, ClickHouse or
                   chDB, Slurm, the operator API), or a long-running part died (a lone
                   producer or executor loop, `up` after repeated crashes): retrying or
                   restarting may help
====  ===========  ==================================================================

Classes keep a builtin base where callers catch them by it (``class PolicyError(ConfigError,
ValueError)``), so adopting the root changed no ``except`` clause.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar


class ExitCode(IntEnum):
    OK = 0
    NO = 1
    USAGE = 2
    UNAVAILABLE = 3


class TrainmedicError(Exception):
    """Root of every trainmedic exception; unclassified ones exit 2 (the command could not be done)."""

    exit_code: ClassVar[ExitCode] = ExitCode.USAGE


class UsageError(TrainmedicError):
    """A bad option, argument or input file."""

    exit_code = ExitCode.USAGE


class ConfigError(UsageError):
    """A configuration (policy, guardrails, catalog, settings, addresses) is invalid or missing."""


class Refused(TrainmedicError):
    """The request was understood and refused: unknown id, bad token, already decided, a guardrail."""

    exit_code = ExitCode.USAGE


class NotFound(TrainmedicError):
    """The answer is no: what was asked about is not there (exit 1, like a finding)."""

    exit_code = ExitCode.NO


class Unavailable(TrainmedicError):
    """Something needed did not answer (broker, audit store, Slurm, API) or a running part died."""

    exit_code = ExitCode.UNAVAILABLE
