"""Table recovery on the real embedded broker reads each changelog to its end.

The broker answers ListOffsets with the first offset of a partition's last batch + 1; a Faust
table recovering to that offset stopped early and lost the rest of the last batch (measured:
changelog batches of 5+5+5 records recovered 11 keys, one batch of 15 recovered 1).
streams/changelog_ends.py gives Faust the end offset a fetch reports instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from bus.admin import end_offsets
from bus.consume import fetched_end_offsets
from trainmedic.stack.broker import EmbeddedBroker

REPO = Path(__file__).resolve().parents[2]

# A Faust app with one table and nothing else; once its recovery is done (timers start after
# it), it prints the table's keys and exits. The worker's fix is applied as streams/app.py does.
APP = """
import os
import faust
from streams.changelog_ends import fix_highwaters

fix_highwaters(os.environ["BOOTSTRAP"])
app = faust.App("recov", broker="kafka://" + os.environ["BOOTSTRAP"], store="memory://",
                datadir=os.environ["DATADIR"], web_enabled=False, topic_partitions=1,
                recovery_consistency_check=False,
                # Faust's default session timeout (60 s) made the group join take half a minute.
                broker_session_timeout=3, broker_heartbeat_interval=1, broker_rebalance_timeout=20)
table = app.Table("t", partitions=1)
source = app.topic("recov-source", value_serializer="raw")

@app.agent(source)
async def idle(stream):
    async for _ in stream:
        pass

@app.timer(interval=1.0)
async def report():
    keys = ",".join(sorted(table.keys(), key=lambda k: int(k[1:])))
    print(f"KEYS {keys}", flush=True)
    os._exit(0)
"""


def _create(bootstrap: str, *topics: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, 1, 1) for topic in topics]).values():
        future.result(10)


def _write_batches(bootstrap: str, topic: str, sizes: list[int], *, json_keys: bool = False) -> int:
    _create(bootstrap, topic)
    # A long linger and a flush after each group: one produce request, so one batch, per group.
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5000})
    n = 0
    for size in sizes:
        for _ in range(size):
            key = f'"k{n}"' if json_keys else f"k{n}"
            producer.produce(topic, key=key.encode(), value=str(n).encode(), partition=0)
            n += 1
        assert producer.flush(10) == 0
    return n


def test_fetched_end_offset_counts_the_whole_last_batch(broker: EmbeddedBroker) -> None:
    written = _write_batches(broker.bootstrap, "ends-probe", [1, 7])
    listed = {k: v for k, v in end_offsets(broker.bootstrap).items() if k[0] == "ends-probe"}
    assert listed[("ends-probe", 0)] <= written  # the embedded broker answers 2 here
    ends = fetched_end_offsets(broker.bootstrap, {**listed, ("ends-empty", 0): 0})
    assert ends == {("ends-probe", 0): written, ("ends-empty", 0): 0}


def test_a_table_recovers_every_record_of_a_changelog_written_in_batches(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    written = _write_batches(broker.bootstrap, "recov-t-changelog", [5, 5, 5], json_keys=True)
    # Its source topic there before the worker subscribes, or its first assignment is empty.
    _create(broker.bootstrap, "recov-source")
    (tmp_path / "recov_app.py").write_text(APP)
    env = dict(os.environ, BOOTSTRAP=broker.bootstrap, DATADIR=str(tmp_path / "data"), PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-m", "faust", "-A", "recov_app", "worker", "-l", "warn"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    # Faust logs what a worker prints (stderr, "[WARNING] KEYS ...").
    keys = [line.split("KEYS ", 1)[1].strip() for line in (out.stdout + out.stderr).splitlines() if "KEYS " in line]
    assert keys, f"the worker printed no table (rc {out.returncode}): {out.stderr[-2000:]}"
    assert keys[0].split(",") == [f"k{i}" for i in range(written)]
