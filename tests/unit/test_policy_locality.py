"""Interconnect actions by locality (issue 42, deliverable 5): node-local interconnect hardware with a
named node -> drain_and_requeue; a fabric fault, or a node-local one whose node the evidence does not
name -> requeue (a person finds the node). Read from the catalogs' `locality` and the policy's
`isolate_named_node_only`."""

from __future__ import annotations

import pytest

from schemas.events import Evidence, Incident
from streams.catalog import Signature, default_signatures
from streams.catalog.vocabulary import VocabularyClass, default_vocabulary, default_vocabulary_signatures
from streams.policy import decide, load_policy, parse_policy

PORT_ERROR = "gpu02:1234:1290 [0] NCCL WARN NET/IB : Got async event : port error"


def incident(signature: str, isolate: bool, culprit: str | None, provenance: str = "kernel") -> Incident:
    return Incident(
        event_id="inc-ic",
        incident_id="inc-ic",
        event_time=10.0,
        job_id="100",
        partition="gpu",
        job_nodes=["gpu01", "gpu02"],
        category="interconnect",
        severity="critical",
        culprit_node=culprit,
        culprit_in_job=True if culprit else None,
        confidence=0.9,
        isolate=isolate,
        explanation="x",
        anomaly_ids=["a"],
        first_signal_time=9.0,  # type: ignore[arg-type]
        evidence=[
            Evidence(
                source="kernel" if provenance == "kernel" else "job_log",
                provenance=provenance,  # type: ignore[arg-type]
                signature=signature,
                node=culprit,
                time=9.0,
                line=PORT_ERROR,
                role="root",
            )
        ],
    )


def _signature(sig_id: str) -> Signature:
    return next(s for s in (*default_signatures(), *default_vocabulary_signatures()) if s.id == sig_id)


def test_every_interconnect_entry_and_class_says_its_locality_and_isolates_only_when_node_local() -> None:
    entries = [s for s in (*default_signatures(), *default_vocabulary_signatures()) if s.category == "interconnect"]
    assert entries and all(s.locality in ("node_local", "fabric") for s in entries)
    assert all(s.isolate == (s.locality == "node_local") for s in entries)
    assert _signature("ib_port_error").locality == "node_local"
    assert _signature("ib_link_down").locality == "node_local"
    assert _signature("nccl_ib_completion_error").locality == "fabric"
    assert _signature("nccl_watchdog_timeout").locality == "fabric"
    classes = {c.name: c for c in default_vocabulary().classes}
    assert (classes["network_port_down"].locality, classes["network_error"].locality) == ("node_local", "fabric")


def test_a_catalog_entry_without_locality_or_contradicting_it_is_refused() -> None:
    base = dict(id="x", pattern="x", category="interconnect", severity="error", role="root", meaning="m", source="s")
    with pytest.raises(ValueError, match="needs locality: node_local or fabric"):
        Signature(**base)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="isolate is true exactly when node_local"):
        Signature(**base, isolate=True, locality="fabric")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="isolate is true exactly when node_local"):
        VocabularyClass.model_validate(
            {
                "class": "c",
                "category": "interconnect",
                "severity": "error",
                "role": "root",
                "isolate": False,
                "locality": "node_local",
                "action": "requeue",
                "meaning": "m",
            }
        )
    # Other categories need none.
    assert Signature(**{**base, "category": "oom"}).locality is None  # type: ignore[arg-type]


def test_node_local_interconnect_fault_with_a_named_node_drains_that_node() -> None:
    policy = load_policy().with_mode("autonomous")
    d, a = decide(policy, incident("ib_port_error", isolate=True, culprit="gpu02"), 11.0)
    assert d.action == "drain_and_requeue" and d.culprit_node == "gpu02"
    assert a is not None and (a.action, a.node) == ("drain_and_requeue", "gpu02")


def test_node_local_interconnect_fault_with_no_node_named_is_a_requeue_for_a_person() -> None:
    policy = load_policy().with_mode("autonomous")
    d, a = decide(policy, incident("ib_port_error", isolate=True, culprit=None), 11.0)
    assert d.action == "requeue"
    assert "no node named" in d.rule and "for a person" in d.rule
    assert a is not None and a.action == "requeue" and a.node is None


def test_fabric_fault_is_a_requeue_even_with_a_node_in_the_text() -> None:
    policy = load_policy().with_mode("autonomous")
    d, a = decide(policy, incident("nccl_ib_completion_error", isolate=False, culprit="gpu02"), 11.0)
    assert d.action == "requeue" and a is not None and a.action == "requeue"


def test_the_rule_is_the_policys_data() -> None:
    """Without interconnect in isolate_named_node_only, an unnamed node-local fault stays a drain
    recommendation (the rule gpu_hardware keeps: a plain requeue could land on the same bad GPU)."""
    policy = load_policy()
    assert policy.isolate_named_node_only == ["interconnect"]
    actions = "\n".join(f"  {c}: {a}" for c, a in policy.actions.items())
    text = f"mode: autonomous\nisolate_named_node_only: []\nactions:\n{actions}\n"
    other = parse_policy(text)
    d, a = decide(other, incident("ib_port_error", isolate=True, culprit=None), 11.0)
    assert d.action == "drain_and_requeue" and a is None and "recommendation only" in d.rule
    gpu = incident("xid_79", isolate=True, culprit=None).model_copy(update={"category": "gpu_hardware"})
    d, _ = decide(policy.with_mode("autonomous"), gpu, 11.0)
    assert d.action == "drain_and_requeue"
