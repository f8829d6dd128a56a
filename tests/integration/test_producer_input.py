"""Producers against the real broker: oversized input never crash-loops a tailer, a restart
neither skips nor re-reads lines, one bad job does not stop the others, and a producer follows
the broker of a restarted `trainmedic up`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bus.admin import ensure_topics
from bus.publish import Publisher
from producers.joblogs import JobLogProducer
from schemas.codec import decode
from schemas.events import DeadLetter, KernelEvent, LogBatch
from schemas.topics import DEADLETTER, JOB_LOGS, NODE_KERNEL
from tests.conftest import read_topic, wait_for
from trainmedic.stack.broker import EmbeddedBroker

TRAINMEDIC = str(Path(sys.executable).with_name("trainmedic"))


def _lines(bootstrap: str, seconds: float = 3.0) -> list[tuple[str, str, int]]:
    """(event id, text, line number) of every line on job.logs."""
    out = []
    for raw in read_topic(bootstrap, JOB_LOGS.name, seconds):
        batch = decode(LogBatch, raw)
        out += [(batch.event_id, ln.text, ln.lineno) for ln in batch.lines]
    return out


def test_twenty_lines_of_65kb_are_published_in_pieces_and_the_tailer_lives_on(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    out = tmp_path / "job.out"
    out.write_text("".join(chr(ord("a") + i) * 66_000 + "\n" for i in range(20)))
    pub = Publisher(broker.bootstrap, "test-big")
    tailer = JobLogProducer(pub, "77", [out])
    assert tailer.poll_once() == 20
    with open(out, "a") as fh:
        fh.write("step 1 after the big ones\n")
    assert tailer.poll_once() == 1  # still alive, still reading
    assert pub.flush(30) == 0 and sum(pub.dropped.values()) == 0
    assert pub.split[JOB_LOGS.name] >= 1

    def lines21() -> list[tuple[str, str, int]] | None:
        got = _lines(broker.bootstrap)
        return got if len(got) >= 21 else None

    texts = [t for _, t, _ in wait_for("21 lines on job.logs", lines21)]
    assert len(texts) == 21 and texts[-1] == "step 1 after the big ones"
    assert all(len(t) == 64 * 1024 for t in texts[:20])  # cut to the follower's line bound, not lost


def test_what_cannot_fit_becomes_a_dead_letter_naming_the_event(broker: EmbeddedBroker) -> None:
    pub = Publisher(broker.bootstrap, "test-small", config={"message.max.bytes": 20_000})
    ev = KernelEvent(event_id="kern-big", event_time=time.time(), node="gpu01", kind="xid", xid=79, text="x" * 60_000)
    pub.publish(NODE_KERNEL, ev)  # no raise: the producer's loop goes on
    assert pub.flush(10) == 0
    letters = wait_for("the dead letter", lambda: read_topic(broker.bootstrap, DEADLETTER.name, 2.0))
    letter = decode(DeadLetter, letters[0])
    assert letter.original_topic == NODE_KERNEL.name and "kern-big" in letter.reason and "size limit" in letter.reason
    assert pub.dead_lettered[NODE_KERNEL.name] == 1 and read_topic(broker.bootstrap, NODE_KERNEL.name, 1.0) == []


def _produce_logs(bootstrap: str, out: Path, state: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            TRAINMEDIC,
            "produce",
            "logs",
            "--job",
            "9",
            "--path",
            str(out),
            "--bootstrap",
            bootstrap,
            "--state-dir",
            str(state),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _writer(out: Path, stop: threading.Event, written: list[str]) -> None:
    i = 0
    while not stop.is_set():
        with open(out, "a") as fh:
            line = f"iteration {i} loss 1.{i:04d}"
            fh.write(line + "\n")
        written.append(line)
        i += 1
        time.sleep(0.01)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_producer_restarted_while_lines_are_written_reads_every_line_once(
    broker: EmbeddedBroker, tmp_path: Path, how: signal.Signals
) -> None:
    out, state = tmp_path / "job.out", tmp_path / "state"
    out.touch()
    stop, written = threading.Event(), list[str]()
    writer = threading.Thread(target=_writer, args=(out, stop, written))
    proc = _produce_logs(broker.bootstrap, out, state)
    writer.start()
    try:
        wait_for("lines published", lambda: len(_lines(broker.bootstrap, 1.0)) > 50, timeout=60)
        wait_for("a saved position", lambda: (state / "logs-job-9.json").exists(), timeout=30)
        proc.send_signal(how)
        proc.wait(timeout=30)
        time.sleep(1.0)  # lines keep coming while the producer is away
        proc = _produce_logs(broker.bootstrap, out, state)
        time.sleep(2.0)  # pacing: the writer goes on while the new producer catches up (the load's shape)
    finally:
        stop.set()
        writer.join()
    try:
        want = set(written)
        got = wait_for(
            "every written line",
            lambda: (x := _lines(broker.bootstrap, 2.0)) and want <= {t for _, t, _ in x} and x,
            timeout=60,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    by_text: dict[str, set[tuple[str, int]]] = {}
    count: dict[str, int] = {}
    for eid, text, lineno in got:
        by_text.setdefault(text, set()).add((eid, lineno))
        count[text] = count.get(text, 0) + 1
    assert set(by_text) == want  # nothing skipped, nothing invented
    # A line re-read after a SIGKILL keeps its line number, and what detectors derive from a
    # line is identified by (job, file, line number): consumers drop the duplicate.
    assert all(len({lineno for _, lineno in v}) == 1 for v in by_text.values())
    if how == signal.SIGTERM:
        assert all(n == 1 for n in count.values()), "a graceful restart must not re-read a line"


def test_a_producer_follows_the_broker_of_a_restarted_up(tmp_path: Path) -> None:
    runtime = tmp_path / "runtime.json"
    first = EmbeddedBroker().start()
    ensure_topics(first.bootstrap)
    runtime.write_text(json.dumps({"bootstrap": first.bootstrap}))
    pub = Publisher(first.bootstrap, "test-move", bootstrap_file=runtime)
    second: EmbeddedBroker | None = None
    try:
        ev = KernelEvent(event_id="kern-1", event_time=time.time(), node="gpu01", kind="xid", xid=79, text="Xid 79")
        pub.publish(NODE_KERNEL, ev)
        assert pub.flush(10) == 0
        first.stop()
        for i in range(2, 6):  # written while no broker answers
            pub.publish(NODE_KERNEL, ev.model_copy(update={"event_id": f"kern-{i}", "text": f"Xid 79 #{i}"}))
        second = EmbeddedBroker().start()
        ensure_topics(second.bootstrap)
        tmp = runtime.with_suffix(".tmp")
        tmp.write_text(json.dumps({"bootstrap": second.bootstrap}))
        os.replace(tmp, runtime)
        pub.publish(NODE_KERNEL, ev.model_copy(update={"event_id": "kern-6", "text": "Xid 79 #6"}))
        got = wait_for(
            "the events on the new broker",
            lambda: (
                (x := {decode(KernelEvent, r).event_id for r in read_topic(second.bootstrap, NODE_KERNEL.name, 1.0)})
                and len(x) >= 5
                and x
            ),
            timeout=60,
        )
        assert got == {f"kern-{i}" for i in range(2, 7)}
        assert pub.rebootstraps == 1 and sum(pub.dropped.values()) == 0
    finally:
        pub.close(1)
        if second is not None:
            second.stop(grace_s=0)


def test_the_kernel_file_producer_names_its_own_node_never_the_lines_host(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    # `logger -t kernel` writes "HOST kernel: ..." into syslog/messages just as the kernel does:
    # whatever host such a line names, the evidence is about the node the producer runs on.
    from producers.kernel import KernelLogProducer

    log = tmp_path / "messages"
    log.write_text("Oct 11 06:07:26 gpu07 kernel: NVRM: Xid (PCI:0000:07:00): 79, pid=1, GPU has fallen off the bus.\n")
    pub = Publisher(broker.bootstrap, "test-kernel")
    assert KernelLogProducer(pub, log, node="gpu01", from_start=True).poll_once() == 1
    assert pub.flush(10) == 0
    events = wait_for("the kernel event", lambda: read_topic(broker.bootstrap, NODE_KERNEL.name, 2.0))
    assert [decode(KernelEvent, e).node for e in events] == ["gpu01"]
