"""The ACL matrix (bus/acls.py) against the code's own topology, and what it generates.

The topology is read from the code, not from its text: the `Topic` objects each component's
modules hold (imported or declared: what they can publish or consume at all), the topics the
streams worker's Faust agents are subscribed to, the audit sink's subscription list and the topic
admin's creation list.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from bus import acls
from schemas.topics import (
    ACTIONS,
    ALL_TOPICS,
    APPROVALS,
    DEADLETTER,
    DECISIONS,
    INCIDENTS,
    MODE_CHANGES,
    NODE_COMMANDS,
    NODE_RETURNS,
    Topic,
)

REPO = Path(__file__).resolve().parents[2]
SECURITY = REPO / "docs" / "security.md"
DECISION_TOPICS = {ACTIONS, APPROVALS, DECISIONS, INCIDENTS, MODE_CHANGES, NODE_RETURNS, NODE_COMMANDS}


def topics_held(module_name: str) -> set[str]:
    """Names of the topics a module holds: Topic objects and tuples or lists of them."""
    found: set[str] = set()
    for value in vars(importlib.import_module(module_name)).values():
        if isinstance(value, Topic):
            found.add(value.name)
        elif isinstance(value, (tuple, list)) and value and all(isinstance(v, Topic) for v in value):
            found |= {v.name for v in value}
    return found


def names(topics: tuple[Topic, ...]) -> set[str]:
    return {t.name for t in topics}


@pytest.mark.parametrize("component", [c for c in acls.COMPONENTS if c.modules], ids=lambda c: c.name)
def test_every_topic_a_component_names_is_in_its_row(component: acls.Component) -> None:
    held = set().union(*(topics_held(m) for m in component.modules))
    if component.creates_topics:
        # bus/admin.py creates ALL_TOPICS: its row may create every topic and touch none.
        assert held == names(ALL_TOPICS)
        assert not component.reads and not component.writes
        return
    row = names(component.reads) | names(component.writes)
    assert held - row == set(), f"{component.name} names topics its ACLs do not allow"
    # The publisher dead-letters what the broker refuses (bus/publish.py), so a writer writes
    # `deadletter` whether or not its own modules name it.
    assert row - held <= {DEADLETTER.name}, f"{component.name}'s row allows topics its code never names"
    if component.writes:
        assert DEADLETTER in component.writes


def test_the_streams_agents_subscribe_only_to_what_the_streams_row_reads() -> None:
    from streams.app import app

    subscribed = {t for agent in app.agents.values() for t in getattr(agent.channel, "topics", ())}
    assert subscribed, "no agent found: the check would pass on nothing"
    assert subscribed <= names(acls.BY_NAME["streams"].reads)


def test_the_audit_sinks_row_is_its_subscription() -> None:
    from sinks.audit import TABLES

    assert names(acls.BY_NAME["audit-sink"].reads) == set(TABLES)
    assert not acls.BY_NAME["audit-sink"].writes


@pytest.mark.parametrize("name", acls.NODE_COMPONENTS)
def test_node_credentials_write_no_decision_topic(name: str) -> None:
    component = acls.BY_NAME[name]
    written = {r.name for r in acls.rules(component) if r.operation in ("Write", "Create")}
    assert not written & names(tuple(DECISION_TOPICS)), written
    assert not component.owns_prefix and not component.creates_topics
    assert all(r.pattern == "literal" for r in acls.rules(component) if r.resource == "topic")


def test_every_topic_has_a_writer_and_every_read_topic_a_writer() -> None:
    written = set().union(*(names(c.writes) for c in acls.COMPONENTS))
    read = set().union(*(names(c.reads) for c in acls.COMPONENTS))
    assert read <= written, f"read but written by nobody: {sorted(read - written)}"
    assert written <= names(ALL_TOPICS)


def test_the_security_doc_carries_the_generated_table() -> None:
    text = SECURITY.read_text()
    m = re.search(r"<!-- acl-matrix:begin -->\n<!--[^\n]*-->\n(.*?)\n<!-- acl-matrix:end -->", text, re.S)
    assert m, "docs/security.md has no acl-matrix block"
    assert m.group(1) == acls.markdown_table(), (
        "docs/security.md is stale: paste `trainmedic topics acls --format table`"
    )


def test_kafka_acls_commands_are_one_principal_per_component_and_parse() -> None:
    lines = acls.kafka_acls_commands("User:tm-{component}", streams_id="west-trainmedic-streams")
    principals: dict[str, set[str]] = {}
    for line in lines:
        argv = shlex.split(line.replace("$BOOTSTRAP", "b:9092").replace("$ADMIN_CONFIG", "admin.properties"))
        assert argv[0] == "kafka-acls.sh" and "--add" in argv
        who = argv[argv.index("--allow-principal") + 1]
        ops = [argv[i + 1] for i, a in enumerate(argv) if a == "--operation"]
        kind = "--topic" if "--topic" in argv else "--group"
        resource = argv[argv.index(kind) + 1]
        principals.setdefault(who, set()).update(f"{kind}:{resource}:{op}" for op in ops)
        assert "*" not in resource and argv[argv.index("--resource-pattern-type") + 1] in ("literal", "prefixed")
    assert set(principals) == {f"User:tm-{c.name}" for c in acls.COMPONENTS if c.kafka}
    assert "--topic:actions:Write" not in principals["User:tm-gpu"]
    assert principals["User:tm-gpu"] == {
        "--topic:gpu.samples:Write",
        "--topic:gpu.samples:DescribeConfigs",
        "--topic:deadletter:Write",
        "--topic:deadletter:DescribeConfigs",
    }
    assert "--topic:west-trainmedic-streams:Create" in principals["User:tm-streams"]
    assert "--group:west-trainmedic-streams:Read" in principals["User:tm-streams"]
    assert "--topic:actions:Write" in principals["User:tm-api"]


def test_the_command_prints_strimzi_users_and_refuses_a_shared_principal() -> None:
    from trainmedic.cli.main import app

    out = CliRunner().invoke(app, ["topics", "acls", "--format", "strimzi", "--component", "kernel"])
    assert out.exit_code == 0, out.output
    (user,) = list(yaml.safe_load_all(out.output))
    assert user["kind"] == "KafkaUser" and user["metadata"]["name"] == "trainmedic-kernel"
    resources = {(a["resource"]["name"], op) for a in user["spec"]["authorization"]["acls"] for op in a["operations"]}
    assert resources == {
        ("node.kernel", "Write"),
        ("node.kernel", "DescribeConfigs"),
        ("deadletter", "Write"),
        ("deadletter", "DescribeConfigs"),
    }
    shared = CliRunner().invoke(app, ["topics", "acls", "--principal", "User:trainmedic"])
    assert shared.exit_code != 0 and "{component}" in shared.output
    unknown = CliRunner().invoke(app, ["topics", "acls", "--component", "gpu2"])
    assert unknown.exit_code != 0 and "unknown component" in unknown.output
