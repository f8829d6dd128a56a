"""The audit sink in a process of its own, so that a test can SIGKILL it, and the
audit check in a process of its own, because chDB lets one process open a folder
(and a process open one folder).

    python -m tests.reliability.sink_runner run --bootstrap B --chdb DIR --database DB --group G
        [--batch-max N] [--pause-after-first-insert S] [--detach TABLE ... --attach-when FILE]
    python -m tests.reliability.sink_runner count --chdb DIR --database DB [--optimize]

`run` uses the real AuditStore (chDB in DIR) and the real AuditSink; it prints one
line per successful insert (`INSERTED table rows`) so the test knows where the sink
is. `--pause-after-first-insert` holds the sink after its first insert, before the
batch's offsets are committed: the window a SIGKILL "mid-batch" hits. `--detach`
makes tables unavailable (real ClickHouse errors on insert) until FILE exists.
SIGTERM stops the sink cleanly. `count` prints one JSON object per table.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from sinks.audit import TABLES, AuditSink, AuditStore

AUDIT_TABLES = {table: columns[0] for _, table, _, columns in TABLES.values()}


class ObservedStore(AuditStore):
    """The real store; reports each successful insert and can pause after the first."""

    pause_after_first_insert_s = 0.0
    _inserts = 0

    def insert(self, table: str, rows: Sequence[list[Any]], columns: list[str]) -> None:
        super().insert(table, rows, columns)
        if table == "schema_migrations":
            return
        self._inserts += 1
        print(f"INSERTED {table} {len(rows)}", flush=True)
        if self._inserts == 1 and self.pause_after_first_insert_s:
            print("PAUSED after the first insert, before the commit", flush=True)
            time.sleep(self.pause_after_first_insert_s)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    store = ObservedStore(f"chdb://{Path(args.chdb).resolve()}", args.database)
    store.pause_after_first_insert_s = args.pause_after_first_insert
    store.migrate()
    for table in args.detach:
        store._command(f"DETACH TABLE {args.database}.{table}")
        print(f"DETACHED {table}", flush=True)
    sink = AuditSink(args.bootstrap, store, group=args.group, batch_max=args.batch_max, batch_wait_s=0.3)

    def stop(_sig: int, _frame: FrameType | None) -> None:
        sink.stop_event.set()

    signal.signal(signal.SIGTERM, stop)

    if args.detach:

        def attach_later() -> None:
            while not Path(args.attach_when).exists():
                if sink.stop_event.wait(0.1):
                    return
            for table in args.detach:
                store._command(f"ATTACH TABLE {args.database}.{table}")
                print(f"ATTACHED {table}", flush=True)

        threading.Thread(target=attach_later, daemon=True).start()
    print("READY", flush=True)
    try:
        sink.run()
    finally:
        print(f"STOPPED inserted={dict(sink.inserted)}", flush=True)
        store.close()
    return 0


def _count(args: argparse.Namespace) -> int:
    store = AuditStore(f"chdb://{Path(args.chdb).resolve()}", args.database)
    out: dict[str, dict[str, int]] = {}
    for table, key in AUDIT_TABLES.items():
        final = store.query(f"SELECT count() AS n FROM {{db}}.{table} FINAL")[0]["n"]
        raw = store.query(f"SELECT count() AS n, uniqExact({key}) AS u FROM {{db}}.{table}")[0]
        row = {"final": int(final), "raw": int(raw["n"]), "distinct": int(raw["u"])}
        if args.optimize:
            store._command(f"OPTIMIZE TABLE {args.database}.{table} FINAL")
            row["after_optimize"] = int(store.query(f"SELECT count() AS n FROM {{db}}.{table}")[0]["n"])
        out[table] = row
    print(json.dumps(out), flush=True)
    store.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sink_runner")
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--bootstrap", required=True)
    run.add_argument("--chdb", required=True)
    run.add_argument("--database", required=True)
    run.add_argument("--group", required=True)
    run.add_argument("--batch-max", type=int, default=2000)
    run.add_argument("--pause-after-first-insert", type=float, default=0.0)
    run.add_argument("--detach", action="append", default=[])
    run.add_argument("--attach-when", default="")
    count = sub.add_parser("count")
    count.add_argument("--chdb", required=True)
    count.add_argument("--database", required=True)
    count.add_argument("--optimize", action="store_true")
    args = parser.parse_args(argv)
    return _run(args) if args.cmd == "run" else _count(args)


if __name__ == "__main__":
    sys.exit(main())
