"""What the embedded broker's stored history costs (not a test): prints figures and writes
bench/results/broker-history.{json,md}, and the result in the common format,
bench/results/broker_history/<date>-<commit>.json (bench/results.py).

Tansu 0.6's memory storage keeps every batch ever produced (retention is not applied and
DeleteRecords is unimplemented: `tansu-storage/src/dynostore.rs`), and each fetch of a partition
that has new data lists all of that partition's stored batches to find its offset
(`DynoStore::fetch`). So the broker's CPU per fetch, and its memory, grow with the history it
holds. Two measurements against the broker `trainmedic up` starts (`trainmedic.stack.broker`):

- fetch cost: one partition filled with single-record batches (each produce flushed, as
  independent node producers send them), then the broker's CPU for a fetch of the newest record,
  at each history size; with the broker's resident memory.
- soak: a 12-partition topic fed at a steady rate of single-record batches while a consumer
  follows it with the streams worker's fetch wait (100 ms); the broker's CPU in each interval.
  The load is constant, so a rising CPU is the history alone.

Run: .venv/bin/python -m bench.broker_history [--sizes 1000,5000,20000,50000] [--soak-s 240]
     [--soak-rate 300] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import threading
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from bench import figures, results
from bench.machine import machine
from bus.config import PROMPT_FETCH_WAIT_MS, admin_config, consumer_config, producer_config
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.broker_watch import process_usage

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PAYLOAD = b"x" * 600  # about a GPU summary of one node
TAIL_FETCHES = 20


def cpu_s(pid: int) -> float:
    usage = process_usage(pid)
    if usage is None:
        raise RuntimeError(f"the broker (pid {pid}) is gone")
    return usage[0]


def rss_mb(pid: int) -> float:
    usage = process_usage(pid)
    if usage is None:
        raise RuntimeError(f"the broker (pid {pid}) is gone")
    return usage[1] / 2**20


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = AdminClient(admin_config(bootstrap))
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(15)


def fill(producer: Producer, topic: str, partition: int, n: int) -> None:
    for _ in range(n):
        producer.produce(topic, PAYLOAD, partition=partition)
        producer.flush(10)  # one batch per record


def tail_fetch_cost(bootstrap: str, pid: int, topic: str, stored: int) -> float:
    """Broker CPU (ms) per fetch of the newest record of a partition holding `stored` batches."""
    consumer = Consumer(consumer_config(bootstrap, f"bench-history-{stored}", "bench-history"))
    try:
        consumer.assign([TopicPartition(topic, 0, stored - 1)])
        before = cpu_s(pid)
        for _ in range(TAIL_FETCHES):
            consumer.seek(TopicPartition(topic, 0, stored - 1))
            msg = consumer.poll(10)
            if msg is None or msg.error():
                raise RuntimeError(f"no record at offset {stored - 1}: {msg.error() if msg else 'timed out'}")
        return (cpu_s(pid) - before) * 1000 / TAIL_FETCHES
    finally:
        consumer.close()


def fetch_cost(sizes: list[int]) -> list[dict[str, float]]:
    broker = EmbeddedBroker().start()
    try:
        assert broker.pid is not None
        create_topic(broker.bootstrap, "history", 1)
        producer = Producer(producer_config(broker.bootstrap, "bench-history") | {"linger.ms": 0})
        rows: list[dict[str, float]] = []
        stored = 0
        for size in sizes:
            fill(producer, "history", 0, size - stored)
            stored = size
            ms = tail_fetch_cost(broker.bootstrap, broker.pid, "history", stored)
            row = {
                "stored_batches": stored,
                "broker_cpu_ms_per_fetch": round(ms, 2),
                "rss_mb": round(rss_mb(broker.pid), 1),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        broker.stop()


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def soak(seconds: float, rate: float, partitions: int, interval_s: float) -> list[dict[str, float]]:
    broker = EmbeddedBroker().start()
    stop = threading.Event()
    try:
        assert broker.pid is not None
        pid = broker.pid
        create_topic(broker.bootstrap, "soak", partitions)
        producer = Producer(producer_config(broker.bootstrap, "bench-soak") | {"linger.ms": 0})
        consumer = Consumer(consumer_config(broker.bootstrap, "bench-soak", "bench-soak"))
        consumer.assign([TopicPartition("soak", p, 0) for p in range(partitions)])
        read = [0]
        delays: list[float] = []  # produce -> consumed, seconds, since the last row
        lock = threading.Lock()

        def follow() -> None:
            while not stop.is_set():
                msgs = consumer.consume(1000, 0.5)
                now = time.time()
                got = [now - m.timestamp()[1] / 1000 for m in msgs if not m.error()]
                with lock:
                    read[0] += len(got)
                    delays.extend(got)

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        rows: list[dict[str, float]] = []
        start = time.monotonic()
        sent = 0
        mark_t, mark_cpu, mark_sent = start, cpu_s(pid), 0
        while (now := time.monotonic()) - start < seconds:
            due = int((now - start) * rate)
            while sent < due:
                producer.produce("soak", PAYLOAD, partition=sent % partitions)
                producer.flush(10)
                sent += 1
            if now - mark_t >= interval_s:
                cpu = cpu_s(pid)
                with lock:
                    window = sorted(delays)
                    delays.clear()
                row = {
                    "t_s": round(now - start, 1),
                    "stored_batches": sent,
                    "produced_per_s": round((sent - mark_sent) / (now - mark_t), 1),
                    "broker_cpu_pct": round((cpu - mark_cpu) / (now - mark_t) * 100, 1),
                    "read": read[0],
                    "delay_p50_ms": round(window[len(window) // 2] * 1000, 1) if window else -1.0,
                    "delay_p95_ms": round(window[int(len(window) * 0.95)] * 1000, 1) if window else -1.0,
                    "rss_mb": round(rss_mb(pid), 1),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
                mark_t, mark_cpu, mark_sent = now, cpu, sent
            time.sleep(0.002)
        stop.set()
        reader.join(5)
        consumer.close()
        return rows
    finally:
        stop.set()
        broker.stop()


def write(out: Path, result: dict[str, Any], started: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "broker-history.json").write_text(json.dumps(result, indent=1) + "\n")
    results.record(
        "broker_history",
        figures.broker_history(result),
        root=out,
        started=started,
        machine=result["machine"],
        details=result,
        report=out / "broker-history.md",
    )
    f, s = result["fetch_cost"], result["soak"]
    lines = [
        "# The embedded broker's stored history (bench/broker_history.py)",
        "",
        f"{result['when']}, {result['machine']['cpu']}, {result['machine']['cores']} cores. Tansu 0.6 memory storage "
        "(the broker `trainmedic up` starts). Single-record batches of 600 bytes.",
        "",
        "## Broker CPU per fetch of a partition's newest record, by the batches it holds",
        "",
        "| stored batches | broker CPU per fetch | broker resident memory |",
        "|---|---|---|",
        *(f"| {r['stored_batches']:,} | {r['broker_cpu_ms_per_fetch']} ms | {r['rss_mb']} MB |" for r in f["rows"]),
        "",
        f"Fit: **{f['us_per_stored_batch']} us of broker CPU per stored batch per fetch**, "
        f"{f['kb_per_stored_batch']} KB of memory per stored batch.",
        "",
        f"## Soak: {s['partitions']} partitions, {s['rate']:.0f} single-record batches/s, a consumer following "
        f"with a {PROMPT_FETCH_WAIT_MS} ms fetch wait",
        "",
        "| t (s) | stored batches | produced/s | broker CPU | produce -> read p50 / p95 | resident memory |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['t_s']} | {r['stored_batches']:,} | {r['produced_per_s']} | {r['broker_cpu_pct']} % "
            f"| {r['delay_p50_ms']} / {r['delay_p95_ms']} ms | {r['rss_mb']} MB |"
            for r in s["rows"]
        ),
        "",
        f"The load is constant; the broker's CPU went from {s['rows'][0]['broker_cpu_pct']} % to "
        f"{s['rows'][-1]['broker_cpu_pct']} % of a core as its history grew, and a record's way from producer "
        f"to consumer (p95) from {s['rows'][0]['delay_p95_ms']} to {s['rows'][-1]['delay_p95_ms']} ms. "
        "That delay includes up to 500 ms of this bench's own batching (its consumer's consume() waits out a "
        "0.5 s timeout): read its change, not its level.",
        "",
    ]
    (out / "broker-history.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,5000,20000,50000", help="history sizes (batches) to measure at")
    ap.add_argument("--soak-s", type=float, default=240.0)
    ap.add_argument("--soak-rate", type=float, default=300.0, help="single-record batches per second")
    ap.add_argument("--soak-partitions", type=int, default=12)
    ap.add_argument("--interval-s", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    sizes = sorted({int(x) for x in args.sizes.split(",")})
    if len(sizes) < 2 or sizes[0] < 1:
        ap.error("--sizes needs at least two positive sizes")
    started = results.now()
    rows = fetch_cost(sizes)
    xs = [r["stored_batches"] for r in rows]
    result = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "fetch_cost": {
            "rows": rows,
            "us_per_stored_batch": round(slope(xs, [r["broker_cpu_ms_per_fetch"] for r in rows]) * 1000, 3),
            "kb_per_stored_batch": round(slope(xs, [r["rss_mb"] for r in rows]) * 1024, 2),
        },
        "soak": {
            "partitions": args.soak_partitions,
            "rate": args.soak_rate,
            "rows": soak(args.soak_s, args.soak_rate, args.soak_partitions, args.interval_s),
        },
    }
    write(args.out, result, started)
    print(f"wrote {args.out / 'broker-history.md'}")


if __name__ == "__main__":
    main()
