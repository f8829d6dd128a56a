"""What the embedded broker (Tansu) does with Kafka ACLs and SASL: nothing. Held here so that the
ACL matrix's "not tested against an authorizer" (docs/security.md) stays true, and says so the
day the broker starts enforcing them (then test bus/acls.py's ACLs against it for real).

CreateAcls and the SASL handshake run in a child process: librdkafka aborts the whole process on
the broker's CreateAcls answer.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from confluent_kafka import Producer

from bus.config import producer_config
from tests.conftest import read_topic
from trainmedic.stack.broker import EmbeddedBroker

CREATE_ACL = textwrap.dedent(
    """
    import sys
    from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, AdminClient,
        ResourcePatternType, ResourceType)
    admin = AdminClient({"bootstrap.servers": sys.argv[1]})
    deny = AclBinding(ResourceType.TOPIC, "actions", ResourcePatternType.LITERAL, "User:ANONYMOUS", "*",
        AclOperation.WRITE, AclPermissionType.DENY)
    for fut in admin.create_acls([deny], request_timeout=5).values():
        fut.result()
    print("ACL CREATED")
    """
)
SASL_WRITE = textwrap.dedent(
    """
    import sys
    from confluent_kafka import Producer
    errors = []
    p = Producer({"bootstrap.servers": sys.argv[1], "security.protocol": "sasl_plaintext",
        "sasl.mechanism": "PLAIN", "sasl.username": "trainmedic-gpu", "sasl.password": "x",
        "message.timeout.ms": 3000, "error_cb": lambda e: errors.append(str(e))})
    p.produce("gpu.samples", b"{}", on_delivery=lambda e, m: errors.append(str(e)) if e else print("DELIVERED"))
    p.flush(6)
    print("ERRORS", errors)
    """
)


def _child(code: str, bootstrap: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, bootstrap], capture_output=True, text=True, timeout=30)


def test_the_embedded_broker_takes_no_acl_and_no_sasl_and_lets_anyone_write_actions(broker: EmbeddedBroker) -> None:
    created = _child(CREATE_ACL, broker.bootstrap)
    assert "ACL CREATED" not in created.stdout, "Tansu now takes ACLs: test bus/acls.py's ACLs against it"
    assert "CreateAcls" in created.stderr or created.returncode != 0, created.stderr[-2000:]

    sasl = _child(SASL_WRITE, broker.bootstrap)
    assert "DELIVERED" not in sasl.stdout, "Tansu now authenticates SASL PLAIN: test the per-component principals"
    assert "SASL" in sasl.stderr + sasl.stdout

    # An unauthenticated client - what a GPU node's producer is to this broker - writes `actions`.
    assert broker.alive()
    p = Producer(producer_config(broker.bootstrap, "not-the-executor"))
    p.produce("actions", b"forged", key=b"1001")
    assert p.flush(10) == 0
    assert b"forged" in read_topic(broker.bootstrap, "actions")
