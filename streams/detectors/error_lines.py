"""Error-level lines, read through their emitters' own vocabularies (streams/catalog/error_lines.yaml).

A line is error-level when an emitter's error form matches it (an NCCL WARN, an NVRM error, a kernel
error or AER line, a Python exception, a CUDA error, a `slurmstepd`/`srun` error, an MPI or
launcher error). Some error-level lines are no fault: known noise, or the emitter saying the run
was ended by its operator's or scheduler's decision. Offline diagnosis uses this to call a log
`healthy` only on positive evidence: an error-level line that neither a fault signature nor a
not-fault entry explains makes the verdict `unknown` ("needs a person"), with that line quoted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from streams.catalog.error_lines import Emitter, NotFault, default_error_lines


@dataclass(frozen=True)
class ErrorLine:
    emitter: str
    entry: str  # the id of the error form or not-fault entry that matched
    not_fault: NotFault | None  # set when the line is a known non-fault

    @property
    def ends_by_decision(self) -> bool:
        return self.not_fault is not None and self.not_fault.kind == "ended_by_decision"


class ErrorLineReader:
    def __init__(self, emitters: Sequence[Emitter] | None = None) -> None:
        ems = default_error_lines() if emitters is None else emitters
        # Not-fault entries first: a known harmless or decision line is that, whatever error form it has.
        self._not_faults = [(em.emitter, nf, re.compile(nf.pattern)) for em in ems for nf in em.not_faults]
        self._levels = [(em.emitter, el.id, re.compile(el.pattern)) for em in ems for el in em.error_level]

    def read(self, text: str) -> ErrorLine | None:
        """What the line is, when it is error-level or a known non-fault; None for an ordinary line."""
        for emitter, nf, rx in self._not_faults:
            if rx.search(text):
                return ErrorLine(emitter, nf.id, nf)
        for emitter, ident, rx in self._levels:
            if rx.search(text):
                return ErrorLine(emitter, ident, None)
        return None
