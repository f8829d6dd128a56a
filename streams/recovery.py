"""Rebuild the streams worker's state from the Kafka log after a (re)start.

Attribution (which jobs already had an incident, which node runs which job, the
evidence still waiting for its incident) lives in worker memory. The restart budget
and the placements are Faust tables with changelogs; the actions and job events are
read back too, as a floor for a broker whose wrong end offsets cut a table's
recovery short (the embedded Tansu, docs/scaling.md). A worker that restarts after a crash
would otherwise treat a redelivered or late anomaly of an already handled fault
as a new fault: a second incident and a second drain. The topics themselves are
the durable record of what the worker decided, so it reads back the recent
incidents, anomalies and job states before it consumes anything new, and so does
a worker that receives another's partitions (streams/app.py `_take_over`).

Kafka's offsets-for-times positions each partition near `since`; brokers that
do not index time (the embedded Tansu answers offset 0) are read from the start
and filtered by record time here, which costs time but gives the same result.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TypeVar

from bus.consume import read_records
from schemas.codec import DecodeError, decode
from schemas.events import Action, Anomaly, Event, Incident, Migration, SchedEvent
from schemas.ids import current_cluster
from schemas.topics import ACTIONS, ANOMALIES, INCIDENTS, MIGRATIONS, SCHED_EVENTS

log = logging.getLogger("trainmedic.streams.recovery")
E = TypeVar("E", bound=Event)


@dataclass
class History:
    """What the worker had already seen and done, oldest first per kind."""

    incidents: list[Incident] = field(default_factory=list)
    sched: list[SchedEvent] = field(default_factory=list)
    # The evidence of the hold window with each record's time (when it reached the topic, i.e.
    # about when the worker consumed it): what a worker that died had consumed (and perhaps
    # committed) but not yet published in an incident lives only here.
    anomalies: list[tuple[float, Anomaly]] = field(default_factory=list)
    undecodable: int = 0


def _decoded(kind: type[E], records: list[tuple[float, bytes]], history: History) -> list[E]:
    out: list[E] = []
    for _, value in sorted(records, key=lambda r: r[0]):
        try:
            event = decode(kind, value)
        except DecodeError:
            # Already dead-lettered by whoever consumed it live; nothing to rebuild from it.
            history.undecodable += 1
            continue
        if event.cluster == current_cluster():  # other clusters' workers take back their own
            out.append(event)
    return out


def read_actions(bootstrap: str, since: float) -> list[Action]:
    """The actions published since `since`: the restart budget's floor (streams/app.py reads them
    when its table has recovered)."""
    return _decoded(Action, read_records(bootstrap, ACTIONS.name, since), History())


def read_migrations(bootstrap: str, since: float) -> tuple[list[Migration], list[Incident]]:
    """The migration states published since `since`, and the predicted incidents they began with:
    the migrations table's floor (streams/app.py reads them when the table has recovered)."""
    history = History()
    states = _decoded(Migration, read_records(bootstrap, MIGRATIONS.name, since), history)
    begun = {m.incident_id for m in states}
    incidents = [
        i for i in _decoded(Incident, read_records(bootstrap, INCIDENTS.name, since), history) if i.incident_id in begun
    ]
    return states, incidents


def read_history(bootstrap: str, now: float, incidents_s: float, sched_s: float) -> History:
    """The recent incidents, anomalies and job states: each kind as far back as it still
    matters. Anomalies of the hold window (`incidents_s`), and incidents of twice that: an anomaly
    absorbed by an incident up to one hold before it must find that incident when replayed."""
    history = History()
    history.incidents = _decoded(Incident, read_records(bootstrap, INCIDENTS.name, now - 2 * incidents_s), history)
    for at, value in sorted(read_records(bootstrap, ANOMALIES.name, now - incidents_s), key=lambda r: r[0]):
        try:
            anomaly = decode(Anomaly, value)
        except DecodeError:
            history.undecodable += 1
            continue
        if anomaly.cluster == current_cluster():
            history.anomalies.append((at, anomaly))
    history.sched = _decoded(SchedEvent, read_records(bootstrap, SCHED_EVENTS.name, now - sched_s), history)
    return history
