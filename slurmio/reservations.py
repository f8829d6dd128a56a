"""Reservations from ``scontrol show reservation -o``: which nodes are in planned maintenance.

A reservation with the ``MAINT`` flag is how Slurm sites mark planned
maintenance. Slurm itself flags such nodes ``MAINTENANCE`` only when its
periodic reservation check runs (not at once), so trainmedic reads the
reservations directly: the Slurm producer (to tell a planned drain from a
fault) and the executor backends (never to act on a node in maintenance).

The ``-o`` text form is read on every version (22.05 has no ``--json`` for
scontrol; 24.11 still prints the same one-line records): ``Nodes=`` is a
hostlist, ``Flags=`` a comma list, ``State=`` ACTIVE or INACTIVE.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurmio.hostlist import HostlistError, expand_hostlist
from slurmio.runners import Runner
from slurmio.scontrol import parse_scontrol_line
from slurmio.versions import SlurmFormatError

__all__ = ["SHOW_RESERVATIONS", "Reservation", "maintenance_nodes", "parse_reservations", "read_reservations"]

SHOW_RESERVATIONS = ("scontrol", "show", "reservation", "-o")
_NONE = ("", "(null)", "None", "N/A")


@dataclass(frozen=True)
class Reservation:
    name: str
    nodes: tuple[str, ...]
    flags: tuple[str, ...]
    active: bool

    @property
    def maintenance(self) -> bool:
        return "MAINT" in self.flags


def parse_reservations(text: str, what: str = "scontrol show reservation -o") -> list[Reservation]:
    """Every reservation in the output; ``No reservations in the system`` is none."""
    out: list[Reservation] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.lower().startswith("no reservations"):
            continue
        f = parse_scontrol_line(line)
        name = f.get("ReservationName", "")
        if not name:
            raise SlurmFormatError(f"{what}: field ReservationName: missing in {line[:80]!r}")
        state = f.get("State", "").upper()
        if state not in ("ACTIVE", "INACTIVE"):
            raise SlurmFormatError(f"{what}: field State of {name}: expected ACTIVE or INACTIVE, got {state[:40]!r}")
        nodelist = f.get("Nodes", "").strip()
        try:
            nodes = tuple(expand_hostlist(nodelist)) if nodelist not in _NONE else ()
        except HostlistError as exc:
            raise SlurmFormatError(f"{what}: field Nodes of {name}: {exc}") from None
        flags = tuple(sorted({w.strip().upper() for w in f.get("Flags", "").split(",") if w.strip() not in _NONE}))
        out.append(Reservation(name=name, nodes=nodes, flags=flags, active=state == "ACTIVE"))
    return out


def read_reservations(runner: Runner, timeout: float) -> list[Reservation]:
    """The cluster's reservations; SlurmCommandError (SlurmFormatError for a bad shape) on failure."""
    return parse_reservations(runner(list(SHOW_RESERVATIONS), timeout))


def maintenance_nodes(reservations: list[Reservation]) -> dict[str, str]:
    """Node -> the active MAINT reservation that holds it (the first by name when several do)."""
    out: dict[str, str] = {}
    for r in sorted(reservations, key=lambda r: r.name):
        if r.active and r.maintenance:
            for n in r.nodes:
                out.setdefault(n, r.name)
    return out
