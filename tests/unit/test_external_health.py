"""streams/detectors/external.py: NVSentinel and NVRx health verdicts -> anomalies.

Every HealthEvent here is made by producers/ingest.py's own models from payloads shaped as
NVSentinel (github.com/NVIDIA/NVSentinel) and NVRx (github.com/NVIDIA/nvidia-resiliency-ext) define
them; the source of each payload is cited beside it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from producers.ingest import NVRxReport, NVSentinelHealthEvent
from schemas.errors import ConfigError
from schemas.events import Anomaly, HealthEvent, KernelEvent
from schemas.ids import stable_id
from schemas.vocab import CATEGORIES
from streams.catalog import CATALOG_DIR, load_xid_catalog
from streams.detectors.external import ExternalHealthDetector, load_external_health_catalog
from streams.detectors.xid import XidDetector

RECEIVED = 1_761_646_600.0

# NVIDIA/NVSentinel docs/DATA_FLOW.md, "Example HealthEvent: GPU XID Error" (as in tests/integration/test_ingest.py).
NVSENTINEL_XID48: dict[str, Any] = {
    "version": 1,
    "agent": "gpu-health-monitor",
    "componentClass": "GPU",
    "checkName": "XID_ERROR_48",
    "isFatal": True,
    "isHealthy": False,
    "message": "GPU 0 reported XID 48 (Double Bit ECC Error)",
    "recommendedAction": "REPLACE_VM",
    "errorCode": ["XID-48"],
    "entitiesImpacted": [{"entityType": "GPU", "entityValue": "GPU-12345678-abcd-1234-abcd-123456789abc"}],
    "metadata": {
        "gpu_uuid": "GPU-12345678-abcd-1234-abcd-123456789abc",
        "gpu_index": "0",
        "driver_version": "535.104.05",
        "severity": "CRITICAL",
    },
    "generatedTimestamp": "2025-10-28T10:15:30Z",
    "nodeName": "gpu-node-42",
    "quarantineOverrides": None,
    "drainOverrides": None,
}

# The syslog health monitor's Xid event, field for field as
# health-monitors/syslog-health-monitor/pkg/xid/xid_handler.go (createHealthEventFromResponse) builds it:
# CheckName SysLogsXIDError (main.go's -checks default), ErrorCode [DecodedXIDStr], entities PCI and GPU
# (the UUID learnt from "NVRM: GPU at PCI:0000:00:08.0: GPU-123", pkg/xid/xid_handler_test.go),
# Message "<mnemonic>; Resolution: <resolution>", IsFatal = recommended action != NONE.
SYSLOG_XID79: dict[str, Any] = {
    "version": 1,
    "agent": "syslog-health-monitor",
    "checkName": "SysLogsXIDError",
    "componentClass": "GPU",
    "generatedTimestamp": "2025-10-28T10:20:00Z",
    "entitiesImpacted": [
        {"entityType": "PCI", "entityValue": "0000:00:08.0"},
        {"entityType": "GPU", "entityValue": "GPU-123"},
    ],
    "message": "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS; Resolution: RESTART_BM",
    "isFatal": True,
    "isHealthy": False,
    "nodeName": "gpu-node-42",
    "recommendedAction": "RESTART_BM",
    "errorCode": ["79"],
    "metadata": {"JOURNAL_MESSAGE": "NVRM: Xid (PCI:0000:00:08): 79, pid=0, GPU has fallen off the bus."},
}

# NVSentinel's e2e HealthEvent template (tests/helpers/healthevent.go, NewHealthEvent: gpu-health-monitor,
# GPU, GpuXidError, fatal, entity GPU "0"), as tests/platform_connector_test.go
# (TestPlatformConnectorWithProcessingStrategy) sends it: WithErrorCode(ERRORCODE_79 = "79"),
# WithMessage("XID error occurred"), WithProcessingStrategy(STORE_ONLY = 2).
E2E_XID79_STORE_ONLY: dict[str, Any] = {
    "version": 1,
    "agent": "gpu-health-monitor",
    "componentClass": "GPU",
    "checkName": "GpuXidError",
    "isFatal": True,
    "isHealthy": False,
    "message": "XID error occurred",
    "errorCode": ["79"],
    "entitiesImpacted": [{"entityType": "GPU", "entityValue": "0"}],
    "nodeName": "gpu-node-7",
    "processingStrategy": 2,
}

# The GPU health monitor's DCGM event (health-monitors/gpu-health-monitor/gpu_health_monitor/platform_connector/
# platform_connector.py): checkName from the watch (DCGM_HEALTH_WATCH_THERMAL -> GpuThermalWatch), errorCode
# [failure code], entities GPU = index, PCI, GPU_UUID; isFatal = recommended action != NONE. The thermal case is
# the one of gpu_health_monitor/tests/test_platform_connector/test_platform_connector.py ("THERMAL watch with
# DCGM_FR_TEMP_VIOLATION (recommendedAction=NONE -> non-fatal)").
DCGM_THERMAL_NONFATAL: dict[str, Any] = {
    "version": 1,
    "agent": "gpu-health-monitor",
    "componentClass": "GPU",
    "checkName": "GpuThermalWatch",
    "generatedTimestamp": {"seconds": 1761646800, "nanos": 0},
    "isFatal": False,
    "isHealthy": False,
    "errorCode": ["DCGM_FR_TEMP_VIOLATION"],
    "entitiesImpacted": [
        {"entityType": "GPU", "entityValue": "3"},
        {"entityType": "PCI", "entityValue": "0000:4e:00.0"},
        {"entityType": "GPU_UUID", "entityValue": "GPU-46a3bbe2-3e87-3dde-b464-a03eba0c21d7"},
    ],
    "message": "Temperature above threshold",
    "recommendedAction": 0,
    "nodeName": "gpu-node-42",
}

# Same monitor, a memory watch failure its DCGM error map sends with an action (fatal).
DCGM_MEM_FATAL: dict[str, Any] = {
    **DCGM_THERMAL_NONFATAL,
    "checkName": "GpuMemWatch",
    "isFatal": True,
    "errorCode": ["DCGM_FR_VOLATILE_DBE_DETECTED"],
    "message": "Volatile double-bit ECC error detected",
    "recommendedAction": "COMPONENT_RESET",
}

# The recovery the GPU health monitor sends once the watch passes again (platform_connector.py: isHealthy true,
# errorCode [], "GPU <watch> watch reported no errors", recommendedAction NONE).
DCGM_THERMAL_HEALTHY: dict[str, Any] = {
    **DCGM_THERMAL_NONFATAL,
    "isHealthy": True,
    "errorCode": [],
    "message": "GPU Thermal watch reported no errors",
}

# health-monitors/syslog-health-monitor/pkg/gpufallen/gpufallen_handler.go: always fatal, RESTART_BM,
# ErrorCode ["GPU_FALLEN_OFF_BUS"], entity PCI.
SYSLOG_GPU_FALLEN: dict[str, Any] = {
    "version": 1,
    "agent": "syslog-health-monitor",
    "checkName": "SysLogsGPUFallenOff",
    "componentClass": "GPU",
    "generatedTimestamp": "2025-10-28T10:21:00Z",
    "entitiesImpacted": [{"entityType": "PCI", "entityValue": "0000:00:08.0"}],
    "message": "NVRM: GPU 0000:00:08.0: GPU has fallen off the bus.",
    "isFatal": True,
    "isHealthy": False,
    "nodeName": "gpu-node-42",
    "recommendedAction": "RESTART_BM",
    "errorCode": ["GPU_FALLEN_OFF_BUS"],
}

# health-monitors/syslog-health-monitor/pkg/sxid/sxid_handler.go: entities NVSWITCH, PCI, NVLINK, GPU (index),
# ErrorCode [SXid], fatal unless the line says Non-fatal (then RecommendedAction NONE, else CONTACT_SUPPORT).
SYSLOG_SXID_FATAL: dict[str, Any] = {
    "version": 1,
    "agent": "syslog-health-monitor",
    "checkName": "SysLogsSXIDError",
    "componentClass": "NVSWITCH",
    "generatedTimestamp": "2025-10-28T10:22:00Z",
    "entitiesImpacted": [
        {"entityType": "NVSWITCH", "entityValue": "3"},
        {"entityType": "PCI", "entityValue": "0000:c8:00.0"},
        {"entityType": "NVLINK", "entityValue": "44"},
        {"entityType": "GPU", "entityValue": "5"},
    ],
    "message": "NVLink fatal error (Egress)",
    "isFatal": True,
    "isHealthy": False,
    "nodeName": "gpu-node-42",
    "recommendedAction": "CONTACT_SUPPORT",
    "errorCode": ["24007"],
}

# health-monitors/csp-health-monitor/pkg/triggerengine/trigger.go (mapMaintenanceEventToHealthEvent): agent
# csp-health-monitor, CheckName "CSPMaintenance", componentClass = resource type, fatal on the quarantine trigger,
# message "CSP maintenance scheduled".
CSP_MAINTENANCE: dict[str, Any] = {
    "agent": "csp-health-monitor",
    "componentClass": "EC2",
    "checkName": "CSPMaintenance",
    "isFatal": True,
    "isHealthy": False,
    "message": "CSP maintenance scheduled",
    "recommendedAction": "RESTART_VM",
    "entitiesImpacted": [{"entityType": "EC2", "entityValue": "i-0abc1234def567890"}],
    "nodeName": "gpu-node-9",
    "generatedTimestamp": "2025-10-28T11:00:00Z",
}


def nvs(payload: dict[str, Any]) -> HealthEvent:
    return NVSentinelHealthEvent.model_validate(payload).to_event(RECEIVED)


@pytest.fixture(scope="module")
def detector() -> ExternalHealthDetector:
    return ExternalHealthDetector()


def one(anomalies: list[Anomaly]) -> Anomaly:
    assert len(anomalies) == 1, anomalies
    return anomalies[0]


# --------------------------------------------------------------------- NVSentinel Xids
def test_fatal_syslog_xid_becomes_xid_signature_on_the_node(detector: ExternalHealthDetector) -> None:
    event = nvs(SYSLOG_XID79)
    a = one(detector.detect(event))
    assert a.signature == "xid_79"
    assert (a.category, a.severity, a.role, a.isolate) == ("gpu_hardware", "critical", "root", True)
    assert a.source == "external" and a.detector == "external"
    assert a.node == "gpu-node-42" and a.job_id is None and a.rank is None
    assert a.gpu is None  # the syslog monitor's "GPU" entity is a UUID, not an index
    assert a.event_time == event.event_time
    assert a.event_id == stable_id("anm", event.event_id, "xid_79")
    assert a.line == event.message
    assert a.meaning.startswith("NVSentinel SysLogsXIDError on gpu-node-42 (fatal, recommended RESTART_BM): Xid 79")
    assert a.facts == {
        "origin": "nvsentinel",
        "check": "SysLogsXIDError",
        "codes": "79",
        "recommended_action": "RESTART_BM",
        "fatal": "true",
        "component": "GPU",
    }


def test_nvsentinel_xid_classified_exactly_as_the_kernel_xid(detector: ExternalHealthDetector) -> None:
    """The same Xid from our kernel producer and from NVSentinel: same node, signature and verdict."""
    kernel = KernelEvent(
        event_id="k-1",
        event_time=RECEIVED,
        node="gpu-node-42",
        kind="xid",
        xid=79,
        text="NVRM: Xid (PCI:0000:00:08): 79, pid=0, GPU has fallen off the bus.",
    )
    ours = one(XidDetector().detect(kernel))
    theirs = one(detector.detect(nvs(SYSLOG_XID79)))
    for attr in ("signature", "node", "category", "severity", "role", "isolate"):
        assert getattr(theirs, attr) == getattr(ours, attr), attr
    assert theirs.source != ours.source  # what lets attribution merge them as one fault


def test_docs_example_xid48_and_its_code_spellings(detector: ExternalHealthDetector) -> None:
    a = one(detector.detect(nvs(NVSENTINEL_XID48)))
    xid48 = load_xid_catalog().xids[48]
    assert a.signature == "xid_48"
    assert (a.category, a.severity, a.isolate) == (xid48.category, xid48.severity, xid48.isolate)
    # ADR-012's CloudEvent spelling XID_48; and the check name alone when no code carries the number.
    for codes in (["XID_48"], ["48"], []):
        payload = {**NVSENTINEL_XID48, "errorCode": codes}
        assert one(detector.detect(nvs(payload))).signature == "xid_48", codes


def test_fallen_off_bus_is_xid_79(detector: ExternalHealthDetector) -> None:
    a = one(detector.detect(nvs(SYSLOG_GPU_FALLEN)))
    assert (a.signature, a.isolate, a.severity) == ("xid_79", True, "critical")


def test_xid_the_catalog_says_to_ignore_gives_nothing(detector: ExternalHealthDetector) -> None:
    ignored = sorted(x.xid for x in load_xid_catalog().xids.values() if not x.emit)
    assert ignored, "xid.yaml has IGNORE Xids"
    payload = {**SYSLOG_XID79, "errorCode": [str(ignored[0])], "recommendedAction": "NONE", "isFatal": False}
    assert detector.detect(nvs(payload)) == []


def test_unknown_xid_is_a_warning_without_isolation(detector: ExternalHealthDetector) -> None:
    a = one(detector.detect(nvs({**SYSLOG_XID79, "errorCode": ["9999"]})))
    assert (a.signature, a.severity, a.isolate, a.category) == ("xid_9999", "warning", False, "gpu_hardware")


def test_store_only_never_isolates(detector: ExternalHealthDetector) -> None:
    event = nvs(E2E_XID79_STORE_ONLY)
    assert event.message.endswith(" [STORE_ONLY]")
    a = one(detector.detect(event))
    assert a.signature == "xid_79"
    assert a.isolate is False and a.severity == "warning"
    assert a.gpu == 0  # the template's GPU entity is the index "0"
    assert a.facts["processing_strategy"] == "STORE_ONLY"
    # The same event executed (EXECUTE_REMEDIATION = 1) does isolate: the marker is what stops it.
    assert one(detector.detect(nvs({**E2E_XID79_STORE_ONLY, "processingStrategy": 1}))).isolate is True
    # NVSwitch events are always STORE_ONLY (platform_connector.py): a fatal SXid stays a look.
    sxid = one(detector.detect(nvs({**SYSLOG_SXID_FATAL, "processingStrategy": "STORE_ONLY"})))
    assert sxid.isolate is False and sxid.severity == "warning"


# --------------------------------------------------------------------- other NVSentinel checks
def test_non_fatal_dcgm_check_is_a_warning(detector: ExternalHealthDetector) -> None:
    a = one(detector.detect(nvs(DCGM_THERMAL_NONFATAL)))
    assert a.signature == "nvsentinel_gputhermalwatch"
    assert (a.category, a.severity, a.role, a.isolate) == ("gpu_hardware", "warning", "root", False)
    assert a.gpu == 3
    assert a.meaning.startswith("NVSentinel GpuThermalWatch on gpu-node-42 GPU 3 (non-fatal, recommended NONE): ")
    assert a.facts["codes"] == "DCGM_FR_TEMP_VIOLATION"


def test_fatal_dcgm_check_isolates_per_recommended_action(detector: ExternalHealthDetector) -> None:
    a = one(detector.detect(nvs(DCGM_MEM_FATAL)))
    assert (a.signature, a.category, a.severity, a.isolate, a.gpu) == (
        "nvsentinel_gpumemwatch",
        "gpu_hardware",
        "critical",
        True,
        3,
    )
    # RESTART_APP: NVSentinel says the hardware is fine - no drain, still critical.
    app = one(detector.detect(nvs({**DCGM_MEM_FATAL, "recommendedAction": 39})))
    assert (app.severity, app.isolate) == ("critical", False)
    # DCGM unreachable: the monitoring is blind, never a drain even when fatal.
    blind = one(detector.detect(nvs({**DCGM_MEM_FATAL, "checkName": "GpuDcgmUnresponsive", "errorCode": []})))
    assert (blind.category, blind.isolate) == ("node", False)


def test_sxid_mirrors_the_kernel_sxid_detector(detector: ExternalHealthDetector) -> None:
    a = one(detector.detect(nvs(SYSLOG_SXID_FATAL)))
    assert (a.signature, a.category, a.severity, a.isolate, a.gpu) == (
        "sxid_24007",
        "interconnect",
        "critical",
        True,
        5,
    )
    nonfatal = {**SYSLOG_SXID_FATAL, "isFatal": False, "recommendedAction": "NONE"}
    b = one(detector.detect(nvs(nonfatal)))
    assert (b.severity, b.isolate) == ("warning", False)


def test_csp_maintenance_drains_the_node(detector: ExternalHealthDetector) -> None:
    a = one(detector.detect(nvs(CSP_MAINTENANCE)))
    assert (a.signature, a.category, a.severity, a.isolate, a.node) == (
        "nvsentinel_cspmaintenance",
        "node",
        "critical",
        True,
        "gpu-node-9",
    )


def test_healthy_report_gives_nothing(detector: ExternalHealthDetector) -> None:
    assert detector.detect(nvs(DCGM_THERMAL_HEALTHY)) == []
    assert detector.detect(nvs({**SYSLOG_XID79, "isHealthy": True, "isFatal": False})) == []


def test_unknown_check_is_a_warning_by_component_class(detector: ExternalHealthDetector) -> None:
    # health-monitors' NIC checks ("SysLogsNICDriverError") and anything newer are not in the catalog.
    nic = {**DCGM_MEM_FATAL, "checkName": "SysLogsNICDriverError", "componentClass": "NIC", "entitiesImpacted": []}
    a = one(detector.detect(nvs(nic)))
    assert (a.signature, a.category, a.severity, a.isolate) == (
        "nvsentinel_syslogsnicdrivererror",
        "interconnect",
        "warning",
        False,
    )
    other = one(detector.detect(nvs({**nic, "checkName": "SomeNewCheck", "componentClass": "Storage"})))
    assert (other.signature, other.category, other.severity, other.isolate) == (
        "nvsentinel_somenewcheck",
        "node",
        "warning",
        False,
    )


def test_redelivery_gives_the_same_anomaly_id(detector: ExternalHealthDetector) -> None:
    first = one(detector.detect(nvs(SYSLOG_XID79)))
    again = one(detector.detect(nvs(copy.deepcopy(SYSLOG_XID79))))
    assert first.event_id == again.event_id
    later = one(detector.detect(nvs({**SYSLOG_XID79, "generatedTimestamp": "2025-10-28T10:30:00Z"})))
    assert later.event_id != first.event_id
    report = NVRxReport(kind="fault", node="gpu03", timestamp=1761646600, job_id="1234", rank=12, fault_type="hang")
    assert one(detector.detect(report.to_event())).event_id == one(detector.detect(report.to_event())).event_id


def test_line_is_truncated(detector: ExternalHealthDetector) -> None:
    a = one(detector.detect(nvs({**DCGM_THERMAL_NONFATAL, "message": "x" * 5000})))
    assert len(a.line) == 2000


# --------------------------------------------------------------------- NVRx
def test_nvrx_hang_is_a_hang_on_the_job_and_rank(detector: ExternalHealthDetector) -> None:
    # docs/ingest.md's fault example.
    report = NVRxReport.model_validate(
        {
            "kind": "fault",
            "node": "gpu03",
            "rank": 12,
            "job_id": "1234",
            "timestamp": 1761646600,
            "fault_type": "hang",
            "message": "rank 12 missed heartbeats for 600 s",
        }
    )
    event = report.to_event()
    a = one(detector.detect(event))
    assert (a.signature, a.category, a.severity, a.role, a.isolate) == (
        "hang_nvrx_heartbeat",
        "hang",
        "error",
        "root",
        False,
    )
    assert (a.job_id, a.node, a.rank, a.source) == ("1234", "gpu03", 12, "external")
    assert a.event_id == stable_id("anm", event.event_id, "hang_nvrx_heartbeat")
    assert a.line == "rank 12 missed heartbeats for 600 s"
    assert a.facts["origin"] == "nvrx" and a.facts["codes"] == "hang"


@pytest.mark.parametrize(
    ("fault", "signature"),
    [
        # NVRx's own names (fault_tolerance/config.py FaultToleranceConfig).
        ("rank_heartbeat_timeout", "hang_nvrx_heartbeat"),
        ("initial_rank_heartbeat_timeout", "hang_nvrx_heartbeat"),
        ("heartbeat_timeout", "hang_nvrx_heartbeat"),
        ("rank_section_timeouts", "hang_nvrx_section"),
        ("rank_out_of_section_timeout", "hang_nvrx_section"),
        ("section_timeout", "hang_nvrx_section"),
        ("Rank_Heartbeat_Timeout", "hang_nvrx_heartbeat"),
    ],
)
def test_nvrx_timeouts_by_their_nvrx_names(detector: ExternalHealthDetector, fault: str, signature: str) -> None:
    report = NVRxReport(kind="fault", node="gpu03", timestamp=1761646600, job_id="1234", rank=3, fault_type=fault)
    a = one(detector.detect(report.to_event()))
    assert (a.signature, a.category, a.role) == (signature, "hang", "root")


def test_nvrx_rank_failure_is_a_crash_marker(detector: ExternalHealthDetector) -> None:
    for fault in ("rank_failure", "process_died"):
        report = NVRxReport(kind="fault", node="gpu04", timestamp=1761646700, job_id="1234", rank=7, fault_type=fault)
        a = one(detector.detect(report.to_event()))
        assert (a.signature, a.category, a.role, a.isolate) == ("nvrx_rank_failure", "unknown", "collateral", False)
        assert (a.job_id, a.rank) == ("1234", 7)


def test_nvrx_non_fatal_fault_never_isolates(detector: ExternalHealthDetector) -> None:
    fatal = NVRxReport(
        kind="fault", node="gpu04", timestamp=1761646700, job_id="1", rank=0, fault_type="unhealthy_node"
    )
    a = one(detector.detect(fatal.to_event()))
    assert (a.category, a.isolate, a.severity) == ("gpu_hardware", True, "error")
    survived = fatal.model_copy(update={"fatal": False})
    b = one(detector.detect(survived.to_event()))
    assert (b.isolate, b.severity) == (False, "warning")


def test_nvrx_unknown_fault_type(detector: ExternalHealthDetector) -> None:
    report = NVRxReport(kind="fault", node="gpu04", timestamp=1761646700, job_id="1", rank=0, fault_type="cosmic.ray")
    a = one(detector.detect(report.to_event()))
    assert (a.signature, a.category, a.severity, a.isolate) == ("nvrx_cosmic_ray", "unknown", "warning", False)


def test_nvrx_straggler_mirrors_the_straggler_detector(detector: ExternalHealthDetector) -> None:
    # docs/ingest.md's straggler example (the scores of NVRx's straggler Report).
    report = NVRxReport.model_validate(
        {
            "kind": "straggler",
            "node": "gpu02",
            "rank": 5,
            "job_id": "1234",
            "timestamp": "2025-10-28T10:16:00Z",
            "message": "rank 5 is slower than its peers",
            "scores": {"gpu_relative": 0.52, "gpu_individual": 0.93, "section_relative": {"fwd_bwd": 0.61}},
        }
    )
    event = report.to_event()
    assert event.error_codes == ["STRAGGLER_GPU_RELATIVE", "STRAGGLER_SECTION_RELATIVE"]
    a = one(detector.detect(event))
    # streams/detectors/straggler.py: signature straggler, category node, warning, root, isolate.
    assert (a.signature, a.category, a.severity, a.role, a.isolate) == ("straggler", "node", "warning", "root", True)
    assert (a.job_id, a.node, a.rank) == ("1234", "gpu02", 5)
    assert "STRAGGLER_GPU_RELATIVE" in a.meaning
    # Every score above the threshold: NVRx calls the rank healthy, no anomaly.
    assert report.scores is not None
    fine = report.model_copy(
        update={"scores": report.scores.model_copy(update={"gpu_relative": 0.99, "section_relative": {}})}
    )
    assert fine.to_event().is_healthy
    assert detector.detect(fine.to_event()) == []


# --------------------------------------------------------------------- the catalog
def test_catalog_is_consistent() -> None:
    cat = load_external_health_catalog()
    nvs_rules, nvrx = cat.nvsentinel, cat.nvrx
    categories = [c.category for c in nvs_rules.checks] + [c.category for c in nvs_rules.components]
    categories += [nvs_rules.default_category, nvrx.unknown_fault.category, nvrx.straggler.category]
    categories += [f.category for f in nvrx.faults]
    assert set(categories) <= set(CATEGORIES)
    # NVSentinel's RecommendedAction enum (health_event.proto), every value mapped.
    from producers.ingest import RECOMMENDED_ACTIONS

    assert set(cat.actions) == set(RECOMMENDED_ACTIONS.values())
    # The hang entries are hangs, rooted on the rank; a rank that died is only a crash marker.
    assert cat.faults["hang"].category == "hang" and cat.faults["hang"].role == "root"
    assert cat.faults["rank_failure"].category == "unknown" and cat.faults["rank_failure"].role == "collateral"
    # The Xid checks' fallen-off-the-bus code is an Xid the Xid catalog knows.
    assert nvs_rules.xid.fallen_off_bus.xid in load_xid_catalog().xids


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "external_health.yaml"
    path.write_text(text)
    return path


def test_bad_category_names_the_entry(tmp_path: Path) -> None:
    text = (CATALOG_DIR / "external_health.yaml").read_text()
    bad = text.replace("{check: GpuMemWatch, category: gpu_hardware", "{check: GpuMemWatch, category: gpu_hw", 1)
    assert bad != text
    with pytest.raises(ConfigError) as err:
        load_external_health_catalog(_write(tmp_path, bad))
    msg = str(err.value)
    assert "nvsentinel.checks entry" in msg and "'GpuMemWatch'" in msg and "category" in msg


def test_bad_fault_names_the_entry(tmp_path: Path) -> None:
    text = (CATALOG_DIR / "external_health.yaml").read_text()
    bad = text.replace(
        "      signature: hang_nvrx_section\n      category: hang\n      severity: error",
        "      signature: hang_nvrx_section\n      category: hang\n      severity: dire",
        1,
    )
    assert bad != text
    with pytest.raises(ConfigError) as err:
        load_external_health_catalog(_write(tmp_path, bad))
    assert "nvrx.faults entry 1 (fault 'section_timeout')" in str(err.value) and "severity" in str(err.value)


def test_duplicate_alias_and_bad_regex_refused(tmp_path: Path) -> None:
    text = (CATALOG_DIR / "external_health.yaml").read_text()
    dup = text.replace("aliases: [process_died,", "aliases: [hang, process_died,", 1)
    assert dup != text
    with pytest.raises(ConfigError, match=r"nvrx.faults entry 2: duplicate 'hang'"):
        load_external_health_catalog(_write(tmp_path, dup))
    regex = text.replace("check_pattern: '^XID_ERROR_(?P<code>[0-9]{1,4})$'", "check_pattern: '^XID_ERROR_([0-9]+$'", 1)
    assert regex != text
    with pytest.raises(ConfigError, match="check_pattern"):
        load_external_health_catalog(_write(tmp_path, regex))
    with pytest.raises(ConfigError):
        load_external_health_catalog(_write(tmp_path, "nvsentinel: [\n"))
