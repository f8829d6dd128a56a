"""`trainmedic topics tail` and `topics list` as real processes against the real embedded broker: the
documented way to look at the topics (Debian 12's kcat cannot talk to this broker: docs/operating.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import Any

import orjson
from confluent_kafka.admin import AdminClient

from bus.publish import Publisher
from schemas.events import Incident
from schemas.topics import DEFAULT_PARTITIONS, INCIDENTS
from tests.conftest import REPO
from trainmedic.stack.broker import EmbeddedBroker

TM = [sys.executable, "-m", "trainmedic.cli.main"]


def _incident(n: int, job: str) -> Incident:
    now = time.time()
    return Incident(
        event_id=f"inc-tail{n}",
        event_time=now,
        incident_id=f"inc-tail{n}",
        job_id=job,
        partition="gpu",
        category="gpu_hardware",
        severity="critical",
        culprit_node="gpu02",
        confidence=0.9,
        isolate=True,
        # An ESC that a terminal would act on: the line must carry it escaped.
        explanation=f"test \x1b[31m{n}",
        evidence=[],
        anomaly_ids=[],
        first_signal_time=now,
    )


def _publish(bootstrap: str, incidents: list[Incident]) -> None:
    pub = Publisher(bootstrap, "test-tail")
    for inc in incidents:
        pub.publish(INCIDENTS, inc)
    assert pub.flush(10) == 0


def _env(bootstrap: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    return dict(env, TRAINMEDIC_BOOTSTRAP=bootstrap)


def _tm(*args: str, bootstrap: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TM, *args], env=_env(bootstrap), cwd=REPO, capture_output=True, text=True, timeout=60)


def _lines(stdout: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in stdout.splitlines()]


def test_tail_prints_each_record_as_one_json_line(broker: EmbeddedBroker) -> None:
    before = time.time()
    # Three records of job 5001 in one batch on one partition, one of job 5002.
    _publish(broker.bootstrap, [_incident(0, "5001"), _incident(1, "5001"), _incident(2, "5001"), _incident(3, "5002")])
    after = time.time()

    everything = _tm("topics", "tail", "incidents", "--from-beginning", "--no-follow", bootstrap=broker.bootstrap)
    assert everything.returncode == 0, everything.stderr
    assert "tailing incidents" in everything.stderr and "from the beginning" in everything.stderr
    assert "\x1b" not in everything.stdout  # the record's ESC reaches no terminal raw
    records = _lines(everything.stdout)
    assert sorted(r["value"]["incident_id"] for r in records) == ["inc-tail0", "inc-tail1", "inc-tail2", "inc-tail3"]
    by_id = {r["value"]["incident_id"]: r for r in records}
    assert by_id["inc-tail1"]["value"]["explanation"] == "test \x1b[31m1"  # escaped on the line, intact as JSON
    first = by_id["inc-tail0"]
    assert first["topic"] == "incidents" and first["key"] == "5001"
    assert 0 <= first["partition"] < DEFAULT_PARTITIONS
    # One job's records keep their order on their partition.
    assert [by_id[f"inc-tail{n}"]["offset"] for n in range(3)] == [0, 1, 2]
    assert {by_id[f"inc-tail{n}"]["partition"] for n in range(3)} == {first["partition"]}
    stamp = datetime.fromisoformat(first["timestamp"])
    assert first["timestamp"].endswith("+00:00") and before - 1 <= stamp.timestamp() <= after + 1

    one_job = _tm(
        "topics", "tail", "incidents", "--from-beginning", "--no-follow", "--key", "5002", bootstrap=broker.bootstrap
    )
    assert one_job.returncode == 0, one_job.stderr
    assert [r["value"]["incident_id"] for r in _lines(one_job.stdout)] == ["inc-tail3"]

    # --count stops a following tail once it has printed that many.
    two = _tm(
        "topics", "tail", "incidents", "--from-beginning", "--count", "2", "--key", "5001", bootstrap=broker.bootstrap
    )
    assert two.returncode == 0, two.stderr
    assert [r["value"]["incident_id"] for r in _lines(two.stdout)] == ["inc-tail0", "inc-tail1"]

    # `topics list` counts what a fetch sees: the broker's own end offset for the 3-record batch says 1.
    listed = _tm("topics", "list", "--json", bootstrap=broker.bootstrap)
    assert listed.returncode == 0, listed.stderr
    ends = {t["topic"]: t["end_offsets"] for t in orjson.loads(listed.stdout)}
    assert ends["incidents"][str(first["partition"])] == 3
    assert sum(ends["incidents"].values()) == 4 and sum(ends["decisions"].values()) == 0
    text = _tm("topics", "list", bootstrap=broker.bootstrap)
    assert any(
        line.startswith("incidents ") and "partitions  12" in line and "end offsets total        4" in line
        for line in text.stdout.splitlines()
    ), text.stdout


def test_tail_from_the_end_prints_only_new_records(broker: EmbeddedBroker) -> None:
    # A batch of several records: the embedded broker's "latest" offset is the start of that batch + 1,
    # so a tail positioned there would print the old records 1 and 2 again.
    _publish(broker.bootstrap, [_incident(n, "6001") for n in range(3)])
    proc = subprocess.Popen(
        [*TM, "topics", "tail", "incidents", "--count", "2"],
        env=_env(broker.bootstrap),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        # Printed once its start offsets are known: what is published now lies past them.
        started = proc.stderr.readline()
        assert "from the end" in started, started
        _publish(broker.bootstrap, [_incident(10, "6001"), _incident(11, "6002")])
        # A tail that printed old records would stop at 2 without the new ones.
        timer = threading.Timer(45, proc.kill)
        timer.start()
        out, err = proc.communicate()
        timer.cancel()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert sorted(r["value"]["incident_id"] for r in _lines(out)) == ["inc-tail10", "inc-tail11"]


def test_tail_of_an_unknown_topic_names_the_topics_and_creates_none(broker: EmbeddedBroker) -> None:
    r = _tm("topics", "tail", "incidentz", bootstrap=broker.bootstrap)
    assert r.returncode == 2
    assert "no topic 'incidentz'" in r.stderr and "incidents" in r.stderr
    # The embedded broker creates a topic that a metadata request names: this one must not exist now.
    assert "incidentz" not in AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=10).topics


def test_tail_without_an_address_reads_the_running_up_from_its_data_dir(broker: EmbeddedBroker, tmp_path: Any) -> None:
    _publish(broker.bootstrap, [_incident(0, "7001")])
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    missing = subprocess.run(
        [*TM, "topics", "tail", "incidents", "--data-dir", str(tmp_path)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "no running `trainmedic up` found" in missing.stderr
    (tmp_path / "runtime.json").write_text(orjson.dumps({"bootstrap": broker.bootstrap}).decode())
    found = subprocess.run(
        [*TM, "topics", "tail", "incidents", "--from-beginning", "--no-follow", "--data-dir", str(tmp_path)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode == 0, found.stderr
    assert [r["value"]["incident_id"] for r in _lines(found.stdout)] == ["inc-tail0"]
