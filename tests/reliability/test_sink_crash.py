"""The audit sink against crashes and a ClickHouse outage: the real broker, the real
chDB, the sink in a child process (chDB: one folder per process).

What must hold: every event lands in the audit exactly once, whatever happened to
the sink; a failed insert is retried with growing delays and its offsets are not
committed until it succeeds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from schemas.events import Event
from schemas.topics import ANOMALIES, INCIDENTS
from sinks.audit import AuditStore, AuditStoreError
from tests.reliability.harness import (
    Produced,
    SinkProcess,
    all_committed,
    anomaly,
    audit_counts,
    committed,
    incident,
    produce,
    report_row,
    wait_until,
)
from trainmedic.stack.broker import EmbeddedBroker, free_port

N_ANOMALIES = 3000
N_INCIDENTS = 200


def _events(prefix: str) -> list[tuple[str, Event]]:
    pairs: list[tuple[str, Event]] = [
        (ANOMALIES.name, anomaly(i, str(1000 + i % 50), f"gpu{i % 64:02d}", prefix=prefix)) for i in range(N_ANOMALIES)
    ]
    pairs += [(INCIDENTS.name, incident(i, prefix=prefix)) for i in range(N_INCIDENTS)]
    return pairs


def _produce_incidents_first(broker: EmbeddedBroker, prefix: str) -> Produced:
    """The incidents delivered before any anomaly exists: a running sink's first batch then holds
    incidents (and perhaps anomalies), so it is the batch a detached incidents table fails. Were
    the first batch all anomalies, the sink would rightly insert and commit it before the outage."""
    events = _events(prefix)
    produced = produce(broker.bootstrap, [e for e in events if e[0] == INCIDENTS.name])
    later = produce(broker.bootstrap, [e for e in events if e[0] == ANOMALIES.name])
    produced.end.update(later.end)
    produced.delivered += later.delivered
    return produced


def _sink_args(broker: EmbeddedBroker, folder: Path, group: str, *extra: str) -> list[str]:
    return ["--bootstrap", broker.bootstrap, "--chdb", str(folder), "--database", "audit", "--group", group, *extra]


def _assert_exactly_once(folder: Path) -> dict[str, dict[str, int]]:
    counts = audit_counts(folder, "audit")
    for table, n in (("anomalies", N_ANOMALIES), ("incidents", N_INCIDENTS)):
        c = counts[table]
        assert c["final"] == n, f"{table}: {c['final']} rows FINAL, {n} events sent: {c}"
        assert c["distinct"] == n, f"{table}: {c}"
        assert c["raw"] >= n, f"{table}: {c}"
        assert c["after_optimize"] == n, f"{table}: duplicates left after OPTIMIZE FINAL: {c}"
    return counts


def _report(fault: str, counts: dict[str, dict[str, int]], note: str) -> None:
    tables = ("anomalies", "incidents")
    report_row(
        fault,
        sent=N_ANOMALIES + N_INCIDENTS,
        landed=sum(counts[t]["final"] for t in tables),
        duplicates=sum(counts[t]["after_optimize"] - counts[t]["distinct"] for t in tables),
        actions_expected=0,
        actions_taken=0,
        note=note,
    )


def test_sigkill_mid_batch_then_restart_lands_every_event_once(broker: EmbeddedBroker, tmp_path: Path) -> None:
    folder, group = tmp_path / "chdb", "audit-crash"
    produced = produce(broker.bootstrap, _events("kill"))

    first = SinkProcess(
        tmp_path / "sink1.log",
        *_sink_args(broker, folder, group, "--batch-max", "500"),
        "--pause-after-first-insert",
        "60",
    )
    first.wait_for(r"^PAUSED after the first insert")
    # Rows of the first batch are in chDB; its offsets are not committed: SIGKILL now.
    first.kill()
    inserted_before_kill = sum(first.inserted(t) for t in ("anomalies", "incidents"))
    assert inserted_before_kill > 0
    assert all(off < 0 for off in committed(broker.bootstrap, group, [ANOMALIES.name, INCIDENTS.name]).values())

    second = SinkProcess(tmp_path / "sink2.log", *_sink_args(broker, folder, group, "--batch-max", "500"))
    wait_until("every offset committed by the restarted sink", lambda: all_committed(broker.bootstrap, group, produced))
    assert second.stop() == 0
    # The killed batch was redelivered; the restarted sink read back the ids it already holds and
    # dropped those rows before inserting: one insert per event ...
    inserted_total = inserted_before_kill + sum(second.inserted(t) for t in ("anomalies", "incidents"))
    assert inserted_total == N_ANOMALIES + N_INCIDENTS
    # ... and one row per event.
    _report(
        "audit sink SIGKILLed mid-batch, restarted",
        _assert_exactly_once(folder),
        f"the killed batch ({inserted_before_kill} rows) was redelivered and dropped by event id, not inserted again",
    )


def test_clickhouse_outage_retries_with_backoff_and_commits_no_failed_row_until_it_is_back(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """The sink cannot switch to another ClickHouse URL, so the outage is made on the store
    it has: the incidents table is DETACHed (every insert into it fails with ClickHouse's own
    error) until the test says so. Anomalies of the same batch insert fine on every retry:
    the partial retries must not leave duplicates behind FINAL."""
    folder, group, back = tmp_path / "chdb", "audit-outage", tmp_path / "clickhouse-is-back"
    sink = SinkProcess(
        tmp_path / "sink.log",
        *_sink_args(broker, folder, group, "--detach", "incidents", "--attach-when", str(back)),
    )
    sink.wait_for(r"^READY")
    produced = _produce_incidents_first(broker, "outage")
    delays = sink.wait_for(r"audit insert failed, retrying in ([\d.]+) s", count=3, timeout=60)
    # Backoff: each retry waits longer than the one before.
    waits = [float(d) for d in delays]
    assert waits == sorted(waits) and waits[-1] > waits[0], waits
    assert "UNKNOWN_TABLE" in sink.text() or "doesn't exist" in sink.text() or "does not exist" in sink.text()
    # Nothing of the failing table is committed: a restart now would get every incident again.
    # (A batch the consumer happened to fill with anomalies alone inserts and commits: the
    # outage is of one table, and which partitions a batch holds is the consumer's timing.)
    offsets = committed(broker.bootstrap, group, [ANOMALIES.name, INCIDENTS.name])
    assert offsets and all(off < 0 for (topic, _), off in offsets.items() if topic == INCIDENTS.name), offsets
    assert not all_committed(broker.bootstrap, group, produced)

    back.touch()  # ClickHouse is back
    sink.wait_for(r"^ATTACHED incidents")
    wait_until("every offset committed after the outage", lambda: all_committed(broker.bootstrap, group, produced))
    assert sink.stop() == 0
    assert re.search(r"^INSERTED incidents \d+$", sink.text(), re.M)
    _report(
        "ClickHouse refuses inserts, then comes back",
        _assert_exactly_once(folder),
        f"retried with backoff {waits[0]:g} s -> {waits[-1]:g} s; no offset committed meanwhile",
    )


def test_outage_then_sigkill_then_restart_with_a_working_store(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The sink dies while ClickHouse is still down; a new sink with a working store lands it all once."""
    folder, group = tmp_path / "chdb", "audit-outage-kill"
    never = tmp_path / "never"
    # Both tables away (the whole store down): no batch can land, so nothing may be committed.
    sink = SinkProcess(
        tmp_path / "sink1.log",
        *_sink_args(
            broker, folder, group, "--detach", "incidents", "--detach", "anomalies", "--attach-when", str(never)
        ),
    )
    sink.wait_for(r"^READY")
    produced = _produce_incidents_first(broker, "outkill")
    sink.wait_for(r"audit insert failed, retrying in", count=2)
    sink.kill()
    assert all(off < 0 for off in committed(broker.bootstrap, group, [ANOMALIES.name, INCIDENTS.name]).values())
    # DETACH TABLE (not PERMANENTLY) does not outlive the process: the restarted store works.
    again = SinkProcess(tmp_path / "sink2.log", *_sink_args(broker, folder, group))
    wait_until("every offset committed by the new sink", lambda: all_committed(broker.bootstrap, group, produced))
    assert again.stop() == 0
    _report("sink SIGKILLed during a ClickHouse outage", _assert_exactly_once(folder), "new sink, working store")


def test_unreachable_clickhouse_server_is_refused_at_start_naming_the_url() -> None:
    """A server URL that refuses connections: the store fails at construction with the URL in
    the message (no sink starts on a store it cannot write to)."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(AuditStoreError, match=re.escape(url)):
        AuditStore(url, "audit")
