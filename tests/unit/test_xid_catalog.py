"""The Xid / SXid catalogs checked in both directions, as NVSentinel's xid_catalog_consistency_test.go does.

NVSentinel (health-monitors/syslog-health-monitor/pkg/common/xid_catalog_consistency_test.go @ 897a4d21)
holds NVIDIA's resolution buckets and its action mapper together: every bucket the catalog contains must
reach a mapping, and every mapping case must be selected by some bucket. Here the mapping is data
(xid.yaml `buckets`), and "reaches a mapping" is checked against what trainmedic would actually do:
the default policy's decision (streams.policy.decide) on an incident of the code's category and
isolation, its culprit a node of the job.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from schemas.events import Evidence, Incident
from schemas.vocab import ACTIONS, CATEGORIES, Category
from streams.catalog import (
    CATALOG_DIR,
    CatalogError,
    XidBucket,
    XidEntry,
    load_kernel_signatures,
    load_sxid_catalog,
    load_xid_catalog,
    load_xids,
)
from streams.policy import decide, load_policy

XID = load_xid_catalog()
SXID = load_sxid_catalog()
POLICY = load_policy()  # streams/policies/default.yaml: what trainmedic does out of the box


def _recommend(category: Category, isolate: bool) -> str:
    incident = Incident(
        event_id="inc-x",
        event_time=1.0,
        incident_id="inc-x",
        job_id="1",
        job_nodes=["gpu01"],
        category=category,
        severity="error",
        culprit_node="gpu01",
        culprit_in_job=True,
        confidence=0.9,
        isolate=isolate,
        explanation="",
        # The Xid as the node's kernel reported it: provenance that may isolate the node (issue 41).
        evidence=[
            Evidence(
                source="kernel", provenance="kernel", signature="xid", node="gpu01", time=1.0, line="", role="root"
            )
        ],
        anomaly_ids=[],
        first_signal_time=1.0,
    )
    return decide(POLICY, incident, now=1.0)[0].action


def _variants(entry: XidEntry, bucket: XidBucket) -> list[bool]:
    """The isolation a code of this bucket can end up with (the line may say Fatal / Nonfatal)."""
    return [entry.isolate] + [o.isolate for o in (bucket.when_fatal, bucket.when_nonfatal) if o is not None]


def _actions(entry: XidEntry) -> set[str]:
    bucket = XID.buckets[entry.bucket]
    if not entry.emit:
        return {"none"}  # no anomaly is raised: nothing can follow from it
    return {_recommend(entry.category, isolate) for isolate in _variants(entry, bucket)}


def test_every_documented_code_is_in_the_table() -> None:
    # NVIDIA's "Xids" sheet runs 1..172 without gaps (Ampere and newer, driver R575 linkage).
    assert sorted(XID.xids) == list(range(1, 173))
    assert len(load_xids()) == 172  # the old loader API still returns the same table


def test_every_code_has_a_known_category_and_bucket() -> None:
    for code, e in XID.xids.items():
        assert e.category in CATEGORIES, code
        assert e.bucket in XID.buckets, code


def test_every_bucket_in_the_table_maps_to_an_allowed_action() -> None:
    """Catalogue -> mapping: what a code leads to is one of its bucket's declared actions."""
    for code, e in XID.xids.items():
        allowed = set(XID.buckets[e.bucket].actions)
        assert allowed <= set(ACTIONS)
        assert _actions(e) <= allowed, f"Xid {code} ({e.bucket}, {e.category}) leads to {_actions(e)}, not {allowed}"


def test_every_mapping_row_and_action_is_reachable() -> None:
    """Mapping -> catalogue: every bucket row is used by a code, and every action it declares happens."""
    for name, bucket in XID.buckets.items():
        codes = [e for e in XID.xids.values() if e.bucket == name]
        assert codes, f"bucket {name} is used by no Xid"
        reached = set().union(*(_actions(e) for e in codes))
        assert reached == set(bucket.actions), f"bucket {name}: declares {bucket.actions}, reached {reached}"


def test_nvidia_buckets_follow_nvidia_text() -> None:
    # Spot checks against the catalog page (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html).
    x = XID.xids
    assert (x[13].bucket, x[13].category) == ("RESTART_APP", "user_code")
    assert (x[31].bucket, x[31].category) == ("RESTART_APP", "user_code")
    assert (x[43].bucket, x[43].category, x[43].emit) == ("IGNORE", "user_code", False)
    assert (x[48].bucket, x[48].isolate) == ("WORKFLOW_XID_48", True)
    assert (x[74].bucket, x[74].category) == ("WORKFLOW_NVLINK_ERR", "interconnect")
    assert (x[79].bucket, x[79].isolate) == ("RESTART_BM", True)
    assert (x[95].bucket, x[94].bucket) == ("RESET_GPU", "RESTART_APP")
    assert {x[c].bucket for c in range(144, 151)} == {"WORKFLOW_NVLINK5_ERR"}
    assert {x[c].category for c in range(144, 151)} == {"interconnect"}
    assert (x[151].bucket, x[154].bucket, x[159].bucket) == ("RESTART_VM", "XID_154", "CHECK_UVM")
    assert {x[c].bucket for c in range(162, 173)} == {"UNCLASSIFIED"}  # empty Immediate Action cells
    assert not any(x[c].isolate for c in range(162, 173))  # no automatic action where NVIDIA gives none
    assert {x[c].category for c in range(162, 173)} == {"unknown"}


def _write(tmp_path: Path, name: str, data: object) -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def _xid_data() -> dict[str, list[dict[str, object]]]:
    raw = yaml.safe_load((CATALOG_DIR / "xid.yaml").read_text())
    assert isinstance(raw, dict)
    return raw


def test_loader_rejects_a_malformed_row_naming_it(tmp_path: Path) -> None:
    data = _xid_data()
    data["xids"][78]["category"] = "gpu_hardwar"  # xid 79
    with pytest.raises(CatalogError, match=r"xids entry 78 \(xid 79\): field 'category'"):
        load_xid_catalog(_write(tmp_path, "x.yaml", data))


def test_loader_rejects_a_duplicate_code(tmp_path: Path) -> None:
    data = _xid_data()
    data["xids"].append(dict(data["xids"][12]))
    with pytest.raises(CatalogError, match="duplicate xid 13"):
        load_xid_catalog(_write(tmp_path, "x.yaml", data))


def test_loader_rejects_a_bucket_without_mapping(tmp_path: Path) -> None:
    data = _xid_data()
    data["xids"][0]["bucket"] = "RESET_FABRIC"
    with pytest.raises(CatalogError, match=r"xid 1\): bucket 'RESET_FABRIC' has no row in 'buckets'"):
        load_xid_catalog(_write(tmp_path, "x.yaml", data))


def test_loader_rejects_an_unused_mapping_row(tmp_path: Path) -> None:
    data = _xid_data()
    data["buckets"].append({**data["buckets"][0], "bucket": "RESET_FABRIC"})
    with pytest.raises(CatalogError, match="buckets RESET_FABRIC are used by no Xid"):
        load_xid_catalog(_write(tmp_path, "x.yaml", data))


def test_loader_rejects_an_unknown_action(tmp_path: Path) -> None:
    data = _xid_data()
    data["buckets"][0]["actions"] = ["reboot"]
    with pytest.raises(CatalogError, match=r"buckets entry 0 \(bucket 'RESTART_APP'\): field 'actions.0'"):
        load_xid_catalog(_write(tmp_path, "x.yaml", data))


def test_loader_rejects_a_file_that_is_not_the_two_sections(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="expected exactly the sections buckets, xids"):
        load_xid_catalog(_write(tmp_path, "x.yaml", [{"xid": 1}]))


# --- SXid ------------------------------------------------------------------------------------------


def test_sxid_table_both_directions() -> None:
    assert len(SXID.sxids) == 398  # every row of NVSentinel's sxiderrorsmapping.csv @ 6f8b0fcf
    used = {e.bucket for e in SXID.sxids.values()}
    assert used == set(SXID.buckets)
    # In NVIDIA's table only IGNORE rows are non-fatal, and only they raise nothing when non-fatal.
    for code, e in SXID.sxids.items():
        assert e.fatal == (e.bucket != "IGNORE"), code
        assert SXID.buckets[e.bucket].emit == (e.bucket != "IGNORE"), code


def test_sxid_loader_rejects_a_malformed_row(tmp_path: Path) -> None:
    raw = yaml.safe_load((CATALOG_DIR / "sxid.yaml").read_text())
    raw["sxids"][3]["fatal"] = "sometimes"  # sxid 10004
    with pytest.raises(CatalogError, match=r"sxids entry 3 \(sxid 10004\): field 'fatal'"):
        load_sxid_catalog(_write(tmp_path, "s.yaml", raw))
    raw = yaml.safe_load((CATALOG_DIR / "sxid.yaml").read_text())
    raw["sxids"].append(dict(raw["sxids"][0]))
    with pytest.raises(CatalogError, match="duplicate sxid 10001"):
        load_sxid_catalog(_write(tmp_path, "s.yaml", raw))


# --- hung-task / filesystem signatures ---------------------------------------------------------------


def test_kernel_signatures_load_and_reject_bad_patterns(tmp_path: Path) -> None:
    sigs = load_kernel_signatures()
    assert {f.id for f in sigs.filesystems} == {"gpfs", "lustre", "nfs", "fuse"}
    assert sigs.report.storage.category == "storage" and sigs.report.no_filesystem.category == "node"
    raw = yaml.safe_load((CATALOG_DIR / "kernel_signatures.yaml").read_text())
    raw["filesystems"][1]["frame"] = "[unclosed"
    with pytest.raises(CatalogError, match=r"field 'filesystems.1.frame'.*not a valid regular expression"):
        load_kernel_signatures(_write(tmp_path, "k.yaml", raw))
    raw = yaml.safe_load((CATALOG_DIR / "kernel_signatures.yaml").read_text())
    raw["headers"][0]["pattern"] = "INFO: task blocked"
    with pytest.raises(CatalogError, match="needs named groups 'task' and 'pid'"):
        load_kernel_signatures(_write(tmp_path, "k.yaml", raw))
