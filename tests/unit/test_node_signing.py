"""Node-signed records (issue 41, item 5): a node producer signs what it publishes on the node
topics with its own node's key (bus.publish.Publisher, `node_signer`), and the streams worker's
one decision (bus.identity.check_node_signature) refuses a record whose signature is not its
own node's. Without a broker: the records are taken where the Publisher hands them to librdkafka
(the broker and the real worker: tests/integration/test_node_signatures.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bus.identity import (
    NODE_SIGNATURE_HEADER,
    NodeSigner,
    check_node_signature,
    node_key,
    parse_node_key,
    sign_node_record,
    verify_node_record,
)
from bus.publish import Publisher
from schemas.codec import decode, encode
from schemas.events import NetPortSample, SchedEvent
from schemas.topics import NET_PORTS, SCHED_EVENTS

SITE = "s" * 40
REPO = Path(__file__).resolve().parents[2]


class _Recorder:
    """Stands in for librdkafka's producer: keeps what would be sent."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def produce(self, topic: str, **kw: Any) -> None:
        self.records.append({"topic": topic, **kw})

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        return 0

    def __len__(self) -> int:
        return 0


def _publisher(signer: NodeSigner | None) -> tuple[Publisher, _Recorder]:
    pub = Publisher("127.0.0.1:1", "test-signing", learn_limits=False, node_signer=signer)
    rec = _Recorder()
    pub._producer = rec  # type: ignore[assignment]
    return pub, rec


def _sample(node: str) -> NetPortSample:
    return NetPortSample(event_id=f"ports-{node}", event_time=1.0, node=node, ports=[])


def test_a_node_producer_signs_its_node_records_with_its_own_key() -> None:
    key = node_key(SITE.encode(), "prod", "gpu02")
    pub, rec = _publisher(NodeSigner("gpu02", key))
    try:
        pub.publish(NET_PORTS, _sample("gpu02"))
        pub.publish(SCHED_EVENTS, SchedEvent(event_id="s", event_time=1.0, kind="node", node="gpu02", state="IDLE"))
    finally:
        pub.close(1)
    ports, sched = rec.records
    assert ports["topic"] == NET_PORTS.name and decode(NetPortSample, ports["value"]).node == "gpu02"
    [(name, header)] = ports["headers"]
    assert name == NODE_SIGNATURE_HEADER == "tm-node-sig"
    assert header.startswith(b"gpu02:")
    assert verify_node_record(SITE.encode(), "prod", header, ports["value"], "gpu02") is None
    assert sched["topic"] == SCHED_EVENTS.name and sched["headers"] is None  # not a node topic


def test_a_producer_without_a_node_key_publishes_unsigned_as_before() -> None:
    pub, rec = _publisher(None)
    try:
        pub.publish(NET_PORTS, _sample("gpu02"))
    finally:
        pub.close(1)
    assert rec.records[0]["headers"] is None


def test_the_worker_refuses_a_record_signed_by_another_nodes_key() -> None:
    site = SITE.encode()
    value = encode(_sample("gpu02"))
    own = {NODE_SIGNATURE_HEADER: sign_node_record(node_key(site, "prod", "gpu02"), "gpu02", value)}
    assert check_node_signature(site, "prod", own, value, "gpu02") is None
    # gpu01's credentials speaking for gpu02: named as gpu01 (its own key) ...
    as_gpu01 = {NODE_SIGNATURE_HEADER: sign_node_record(node_key(site, "prod", "gpu01"), "gpu01", value)}
    why = check_node_signature(site, "prod", as_gpu01, value, "gpu02")
    assert why == "node_signature_invalid: record names node 'gpu02' but is signed by node 'gpu01'"
    # ... or claiming to be gpu02 with gpu01's key, or a changed record: the MAC does not verify.
    forged = {NODE_SIGNATURE_HEADER: sign_node_record(node_key(site, "prod", "gpu01"), "gpu02", value)}
    assert check_node_signature(site, "prod", forged, value, "gpu02") == (
        "node_signature_invalid: bad signature for node 'gpu02'"
    )
    tampered = value.replace(b"gpu02", b"gpu03")
    assert str(check_node_signature(site, "prod", own, tampered, "gpu03")).startswith("node_signature_invalid: ")
    # Another cluster's key for the same node name is another key.
    other = {NODE_SIGNATURE_HEADER: sign_node_record(node_key(site, "lab", "gpu02"), "gpu02", value)}
    assert str(check_node_signature(site, "prod", other, value, "gpu02")).startswith("node_signature_invalid: ")


def test_unsigned_records_pass_unless_required_and_nothing_is_checked_without_a_site_secret() -> None:
    site = SITE.encode()
    value = encode(_sample("gpu02"))
    assert check_node_signature(site, "prod", {}, value, "gpu02") is None
    assert check_node_signature(site, "prod", None, value, "gpu02") is None
    assert check_node_signature(site, "prod", {}, value, "gpu02", required=True) == (
        "node_signature_missing: record of node 'gpu02' is not signed (node_signing_required)"
    )
    bad = {NODE_SIGNATURE_HEADER: b"gpu01:" + b"0" * 64}
    assert check_node_signature(None, "prod", bad, value, "gpu02", required=True) is None  # today's behaviour


def test_a_node_key_is_64_hex_digits() -> None:
    key = node_key(SITE.encode(), "prod", "gpu02")
    assert parse_node_key(key.hex() + "\n") == key
    for bad in ("", "zz" * 32, key.hex()[:-2], SITE):
        with pytest.raises(ValueError, match="64 hex digits"):
            parse_node_key(bad)
    assert "key" not in repr(NodeSigner("gpu02", key)).replace("NodeSigner", "")


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    return subprocess.run(
        [sys.executable, "-m", "trainmedic.cli.main", *args],
        env=clean | {"TRAINMEDIC_CONFIG": os.devnull} | env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_ingest_node_key_prints_the_nodes_key_and_produce_refuses_a_malformed_one(tmp_path: Path) -> None:
    got = _cli("ingest", "node-key", "gpu02", "--cluster", "prod", TRAINMEDIC_SITE_SECRET=SITE)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.strip() == node_key(SITE.encode(), "prod", "gpu02").hex()
    none = _cli("ingest", "node-key", "gpu02")
    assert none.returncode != 0 and "no site secret" in none.stdout + none.stderr
    key_file = tmp_path / "node-key"
    key_file.write_text("not-a-key\n")
    bad = _cli(
        "produce",
        "ib",
        "--node",
        "gpu02",
        "--sysfs-root",
        str(tmp_path),
        "--bootstrap",
        "127.0.0.1:1",
        TRAINMEDIC_NODE_KEY_FILE=str(key_file),
    )
    assert bad.returncode != 0
    assert "setting node_key" in bad.stdout + bad.stderr and "64 hex digits" in bad.stdout + bad.stderr
