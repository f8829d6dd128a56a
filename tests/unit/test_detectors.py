from __future__ import annotations

from producers.joblogs import split_rank_prefix
from schemas.events import KernelEvent, LogBatch, LogLine
from streams.detectors.signatures import SignatureDetector
from streams.detectors.xid import XidDetector
from tests.conftest import FIXTURES

LOGS = FIXTURES / "logs"


def batch_from(path: str, job_id: str = "7") -> LogBatch:
    lines = []
    for i, raw in enumerate((LOGS / path).read_text().splitlines(), 1):
        r = split_rank_prefix(raw)
        lines.append(LogLine(text=r.text, ts=float(i), rank=r.rank, lineno=i))
    return LogBatch(event_id="b", event_time=0.0, job_id=job_id, source=path, lines=lines)


def test_nccl_watchdog_fixture() -> None:
    anomalies = SignatureDetector().detect(batch_from("nccl_watchdog_timeout.log"))
    # The watchdog's timeouts, and PyTorch's "Some NCCL operations have failed or timed out" that
    # follows them on each rank taken down (streams/catalog/vocabulary.yaml): both collateral.
    by_sig: dict[str, list[int]] = {}
    for a in anomalies:
        by_sig.setdefault(a.signature, []).append(-1 if a.rank is None else a.rank)
    assert set(by_sig) == {"nccl_watchdog_timeout", "torch_nccl_operations_failed"}
    assert sorted(by_sig["nccl_watchdog_timeout"]) == [0, 3, 4]
    assert sorted(by_sig["torch_nccl_operations_failed"]) == [0, 2]
    assert all(a.role == "collateral" and a.category == "interconnect" for a in anomalies)


def test_healthy_fixture_has_no_anomaly() -> None:
    assert SignatureDetector().detect(batch_from("healthy_training.log")) == []


def test_catalog_entries_match_real_texts() -> None:
    d = SignatureDetector()
    cases = {
        # Texts from public issues; sources in tests/fixtures/logs/SOURCES.md.
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1691, "
        "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3": "nccl_unhandled_system_error",
        "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, "
        "remote process exited or there was a network error, NCCL version 2.21.5": "nccl_remote_error",
        "NCCL WARN NET/IB : Got completion with error 12, opcode 0, len 0, vendor err 129": "nccl_ib_completion_error",
        "H100-2:19989:20082 [1] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer "
        "fe80::966d:ae03:8b:df78%ib0<53249> with error 4, opcode 32564, len 32564, vendor err 81 (Send)": "nccl_ib_completion_error",
        "[PG ID 2 PG GUID 3 Rank 2] Process group watchdog thread terminated with exception: CUDA error: an illegal "
        "memory access was encountered": "cuda_illegal_memory_access",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB.": "cuda_oom",
        "OSError: [Errno 28] No space left on device": "storage_no_space",
        "srun: error: Node failure on gpu03": "srun_node_failure",
    }
    for text, signature in cases.items():
        hit = d.match_line(text)
        assert hit is not None and hit[0].id == signature, text


def test_node_failure_names_its_node() -> None:
    b = LogBatch(
        event_id="b",
        event_time=0.0,
        job_id="7",
        source="s",
        lines=[LogLine(text="srun: error: Node failure on gpu03", ts=1.0, lineno=1)],
    )
    (a,) = SignatureDetector().detect(b)
    assert a.node == "gpu03" and a.isolate and a.category == "node"


def _kev(xid: int) -> KernelEvent:
    return KernelEvent(
        event_id=f"k{xid}",
        event_time=1.0,
        node="gpu02",
        kind="xid",
        xid=xid,
        text=f"NVRM: Xid (PCI:0000:07:00): {xid}, ...",
    )


def test_xid_buckets() -> None:
    d = XidDetector()
    (a79,) = d.detect(_kev(79))
    assert (a79.category, a79.severity, a79.isolate, a79.node) == ("gpu_hardware", "critical", True, "gpu02")
    (a48,) = d.detect(_kev(48))
    assert a48.isolate and "RESET_GPU" in a48.meaning
    (a13,) = d.detect(_kev(13))
    assert a13.category == "user_code" and not a13.isolate
    assert d.detect(_kev(45)) == []  # informational follow-on
    (unknown,) = d.detect(_kev(9999))
    assert unknown.severity == "warning" and not unknown.isolate


def test_watchdog_timeout_carries_its_facts() -> None:
    """Named groups beyond node/rank/gpu become facts attribution reasons with."""
    (a, *_) = SignatureDetector().detect(batch_from("nccl_watchdog_timeout.log"))
    assert a.facts == {"seq": "7753", "op": "_REDUCE_SCATTER_BASE", "numel": "544997376", "timeout_ms": "600000"}


def test_gpu_and_host_of_the_line_reach_the_anomaly() -> None:
    # https://github.com/Lightning-AI/lit-llama/issues/380 (as in tests/unit/test_catalog.py)
    raw = "gpu01:34050:34121 [3] transport/net_ib.cc:93 NCCL WARN NET/IB : Got async event : port error"
    r = split_rank_prefix(raw)
    line = LogLine(text=r.text, ts=1.0, lineno=1, node=r.host, gpu=r.gpu)
    (a,) = SignatureDetector().detect(LogBatch(event_id="b", event_time=0.0, job_id="7", source="s", lines=[line]))
    assert (a.node, a.gpu, a.signature) == ("gpu01", 3, "ib_port_error")


def test_collateral_carries_what_the_other_ranks_were_doing() -> None:
    """A rank that started validation (and did not finish) is context for the others' timeouts;
    the line itself is no anomaly. Texts: the m4 corpus case and LlamaFactory #6269 (fixture)."""
    d = SignatureDetector()
    start = LogLine(text="** Starting validation **", ts=1.0, lineno=1, rank=7)
    batch = LogBatch(event_id="b0", event_time=0.0, job_id="7", source="s", lines=[start])
    assert d.detect(batch) == []
    timeouts = d.detect(batch_from("nccl_watchdog_timeout.log"))
    assert timeouts and all([(x.rank, x.activity) for x in a.activity] == [(7, "validation")] for a in timeouts)
    # A finished validation closes it.
    end = LogLine(text="** Finished validation **", ts=2.0, lineno=2, rank=7)
    d.detect(LogBatch(event_id="b1", event_time=0.0, job_id="7", source="s", lines=[end]))
    assert all(a.activity == [] for a in d.detect(batch_from("nccl_watchdog_timeout.log")))
    # Another job's ranks are not context.
    assert all(a.activity == [] for a in d.detect(batch_from("nccl_watchdog_timeout.log", job_id="8")))
