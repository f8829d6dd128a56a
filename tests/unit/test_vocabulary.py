"""The emitters' vocabularies (streams/catalog/vocabulary.yaml) against their own format strings and the policy.

Both ways: every entry's example is an instance of its format string and is matched by its pattern, first,
with the class it names; every class is used and maps to the action the default policy takes on it.
"""

from __future__ import annotations

import ctypes
import os
import re
from glob import glob
from pathlib import Path

import pytest

from schemas.events import Incident, LogBatch, LogLine
from streams.catalog import CatalogError, default_signatures
from streams.catalog.vocabulary import (
    VocabularyClass,
    VocabularyEntry,
    catalog_tables,
    default_vocabulary,
    default_vocabulary_signatures,
    detector_order,
    format_regex,
    load_vocabulary,
)
from streams.detectors.prefilter import may_match
from streams.detectors.signatures import SignatureDetector
from streams.policy import choose_action, load_policy

VOCAB = default_vocabulary()
ENTRIES = [entry for _em, entry in VOCAB.entries()]
# A tag, a release or a 40-hex commit in a GitHub blob URL, or a versioned archive of NVIDIA's references, or a
# versioned page of IBM Storage Scale's message reference (GPFS is closed source).
_PINNED = re.compile(
    r"^https://github\.com/[^/]+/[^/]+/blob/(?:[0-9a-f]{40}|v?\d[\w.-]*|slurm-\d[\w-]*)/"
    r"|^https://docs\.nvidia\.com/cuda/archive/\d+\.\d+\.\d+/"
    r"|^https://www\.ibm\.com/docs/en/storage-scale/\d+\.\d+\.\d+\?topic="
)


def _ids(entries: list[VocabularyEntry]) -> list[str]:
    return [e.id for e in entries]


def test_every_entry_cites_a_pinned_version() -> None:
    unpinned = [e.id for e in ENTRIES if not _PINNED.match(e.source)]
    assert unpinned == []
    assert all(em.version for em in VOCAB.emitters)


def test_ids_are_disjoint_from_signatures_yaml() -> None:
    assert {e.id for e in ENTRIES}.isdisjoint({s.id for s in default_signatures()})


@pytest.mark.parametrize("entry", ENTRIES, ids=_ids(ENTRIES))
def test_example_is_an_instance_of_the_format_and_matches_the_pattern(entry: VocabularyEntry) -> None:
    assert format_regex(entry.format).search(entry.example), (entry.format, entry.example)
    assert re.search(entry.pattern, entry.example)
    # The detector skips a pattern whose required text the line lacks: the example must get through.
    test = may_match(entry.pattern)
    assert test is None or test(entry.example)


@pytest.mark.parametrize("entry", ENTRIES, ids=_ids(ENTRIES))
def test_example_is_read_with_its_class_first(entry: VocabularyEntry) -> None:
    klass = VOCAB.class_of(entry)
    want = (klass.category, klass.role, klass.isolate)
    # Vocabulary alone: the entry itself, or an earlier entry of the same class, wins its example.
    alone = SignatureDetector(signatures=()).match_line(entry.example)
    assert alone is not None and (alone[0].category, alone[0].role, alone[0].isolate) == want, alone
    # With signatures.yaml in front: whatever wins agrees on category (a report-written twin may be
    # more specific about role or isolation, never about the kind of fault).
    merged = SignatureDetector().match_line(entry.example)
    assert merged is not None and merged[0].category == klass.category, merged


def _incident(category: str, isolate: bool) -> Incident:
    return Incident(
        event_id="inc-v",
        incident_id="inc-v",
        event_time=1.0,
        job_id="7",
        category=category,  # type: ignore[arg-type]
        severity="error",
        confidence=0.9,
        isolate=isolate,
        explanation="x",
        anomaly_ids=["a"],
        first_signal_time=1.0,  # type: ignore[arg-type]
        evidence=[],
    )


@pytest.mark.parametrize("klass", VOCAB.classes, ids=[c.name for c in VOCAB.classes])
def test_every_class_maps_to_the_default_policys_action(klass: VocabularyClass) -> None:
    action, _rule = choose_action(load_policy(), _incident(klass.category, klass.isolate))
    assert action == klass.action


def test_every_class_is_used_and_every_entry_has_a_class() -> None:
    used = {e.klass for e in ENTRIES}
    assert used == {c.name for c in VOCAB.classes}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "vocabulary.yaml"
    path.write_text(text)
    return path


_CLASS = """classes:
  - class: peer_lost
    category: interconnect
    severity: error
    role: collateral
    isolate: false
    locality: fabric
    action: requeue
    meaning: m
"""


def test_loader_refuses_an_example_that_is_not_an_instance_of_its_format(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        _CLASS
        + """emitters:
  - emitter: nccl
    version: v1
    entries:
      - id: closed
        class: peer_lost
        format: 'socketProgress: Connection closed by remote peer %s'
        pattern: 'Connection closed'
        source: https://github.com/NVIDIA/nccl/blob/v2.23.4-1/src/misc/socket.cc#L50
        example: 'Connection closed by a peer'
""",
    )
    with pytest.raises(CatalogError, match="not an instance of the format"):
        load_vocabulary(path)


def test_loader_refuses_an_unknown_or_unused_class(tmp_path: Path) -> None:
    entry = """emitters:
  - emitter: nccl
    version: v1
    entries:
      - id: closed
        class: {klass}
        format: 'socketProgress: Connection closed by remote peer %s'
        pattern: 'Connection closed by remote peer'
        source: https://github.com/NVIDIA/nccl/blob/v2.23.4-1/src/misc/socket.cc#L50
        example: 'socketProgress: Connection closed by remote peer gpu01<4567>'
"""
    with pytest.raises(CatalogError, match="no class 'network_lost'"):
        load_vocabulary(_write(tmp_path, _CLASS + entry.format(klass="network_lost")))
    unused = _CLASS + _CLASS.removeprefix("classes:\n").replace("peer_lost", "spare")
    with pytest.raises(CatalogError, match="used by no entry: spare"):
        load_vocabulary(_write(tmp_path, unused + entry.format(klass="peer_lost")))
    assert load_vocabulary(_write(tmp_path, _CLASS + entry.format(klass="peer_lost"))).classes[0].name == "peer_lost"


@pytest.mark.parametrize(
    ("fmt", "line", "matches"),
    [
        ("Node failure on %s", "srun: error: Node failure on gpu02", True),
        (
            "RmInitAdapter failed! (0x%x:0x%x:%d)",
            "NVRM: GPU 0000:0a:00.0: RmInitAdapter failed! (0x24:0x72:1568)",
            True,
        ),
        ("Loss became infinite or NaN at iteration={}!", "Loss became infinite or NaN at iteration=7!", True),
        ("Timeout after %llus of waiting", "Timeout after 6s of waiting", True),
        ("Timeout after %llus of waiting", "Timeout after six seconds of waiting", False),
        ("[Errno %d] %s", "[Errno 28] No space left on device", True),
        ("[Errno %d] %s", "Errno 28: No space left on device", False),
    ],
)
def test_format_regex(fmt: str, line: str, matches: bool) -> None:
    assert bool(format_regex(fmt).search(line)) is matches


def test_fallbacks_come_after_every_specific_entry() -> None:
    order = detector_order(default_signatures(), default_vocabulary_signatures())
    first_fallback = next(i for i, s in enumerate(order) if s.fallback)
    assert all(s.fallback for s in order[first_fallback:])
    assert order[-1].id == "python_exception_line" and order[first_fallback].id == "crash_exit_code"


def test_the_vocabulary_reads_what_the_report_written_entries_are_left_out_of() -> None:
    """Leave-one-source-out narrows signatures.yaml only: a node failure and its node, a CUDA error
    from a new emitter wording, are still read from the emitters' own vocabulary."""
    detector = SignatureDetector(signatures=[s for s in default_signatures() if s.fallback])
    lines = [
        "srun: error: Node failure on gpu02",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        "gpu03:4567:4601 [2] transport/net_ib.cc:171 NCCL WARN NET/IB : mlx5_2:1 Got async error event: port error",
    ]
    batch = LogBatch(
        event_id="b",
        event_time=0.0,
        job_id="7",
        source="s",
        lines=[LogLine(text=t, ts=float(i), lineno=i + 1) for i, t in enumerate(lines)],
    )
    got = [(a.signature, a.category, a.node, a.isolate) for a in detector.detect(batch)]
    assert got == [
        ("slurm_node_failure_on", "node", "gpu02", True),
        ("cuda_error_ecc_uncorrectable", "gpu_hardware", None, True),
        ("nccl_ib_async_port_error", "interconnect", "gpu03", True),
    ]


def test_generic_texts_need_their_cuda_context() -> None:
    """CUDA's generic texts, "unknown error" and "out of memory" are read as CUDA's only after a CUDA caller's prefix."""
    detector = SignatureDetector(signatures=())
    hit = detector.match_line("ValueError: unknown error in config parser")
    assert hit is not None and hit[0].id == "python_exception_line"
    assert detector.match_line("cache: out of memory, evicting 12 entries") is None
    hit = detector.match_line("RuntimeError: CUDA error: unknown error")
    assert hit is not None and hit[0].id == "cuda_error_unknown"


_DOC = Path(__file__).resolve().parents[2] / "docs" / "catalogs.md"


def test_catalogs_md_holds_the_tables_generated_from_the_yaml() -> None:
    text = _DOC.read_text()
    begin, end = "<!-- vocabulary-tables:begin -->\n", "<!-- vocabulary-tables:end -->"
    doc = text[text.index(begin) + len(begin) : text.index(end)]
    assert doc == catalog_tables(VOCAB), "regenerate with: python -m streams.catalog.vocabulary"


def test_every_emitter_says_how_it_was_derived_and_what_is_missing() -> None:
    assert [em.emitter for em in VOCAB.emitters if not em.derived.strip() or not em.gaps.strip()] == []
    assert len({em.emitter for em in VOCAB.emitters}) == len(VOCAB.emitters)


def test_catalog_tables_follow_the_yaml(tmp_path: Path) -> None:
    text = (
        _CLASS
        + """emitters:
  - emitter: nccl
    version: v1
    derived: 'read | at the tag'
    entries:
      - id: closed
        class: peer_lost
        format: 'socketProgress: Connection closed by remote peer %s'
        pattern: 'Connection closed by remote peer'
        source: https://github.com/NVIDIA/nccl/blob/v2.23.4-1/src/misc/socket.cc#L50
        example: 'socketProgress: Connection closed by remote peer gpu01<4567>'
"""
    )
    tables = catalog_tables(load_vocabulary(_write(tmp_path, text)))
    assert "| nccl | v1 | 1 | read \\| at the tag | - |" in tables
    assert "| peer_lost | interconnect | collateral | no | requeue | 1 |" in tables
    assert tables.endswith("1 entries from 1 emitter blocks in 1 classes.\n")


def _cudart() -> tuple[ctypes.CDLL, Path] | None:
    """The CUDA runtime and its headers where a toolkit is installed (CUDA_HOME, /usr/local/cuda*)."""
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob("/usr/local/cuda-*"), reverse=True)]
    for root in filter(None, roots):
        header = Path(root) / "include" / "driver_types.h"
        libs = sorted(glob(f"{root}/lib*/libcudart.so*")) or sorted(glob(f"{root}/targets/*/lib/libcudart.so*"))
        if header.is_file() and libs:
            lib = ctypes.CDLL(libs[0])
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            return lib, header
    return None


def test_every_cuda_error_of_the_installed_runtime_is_read_as_cuda() -> None:
    """The derivation repeated against the installed toolkit: every cudaError_t of its driver_types.h, as
    `CUDA error: <cudaGetErrorString text>` (PyTorch's form) and as its enum name, is read by a CUDA entry."""
    found = _cudart()
    if found is None:
        pytest.skip("no CUDA toolkit (driver_types.h and libcudart) installed")
    lib, header = found
    body = re.search(r"enum\s+(?:__device_builtin__\s+)?cudaError\s*\{(.*?)\};", header.read_text(), re.S)
    assert body is not None
    codes = [(name, int(value)) for name, value in re.findall(r"(cudaError\w+)\s*=\s*(\d+)", body.group(1))]
    assert len(codes) > 100
    cuda_ids = {e.id for em in VOCAB.emitters if em.emitter == "cuda" for e in em.entries}
    detector = SignatureDetector(signatures=())
    unread = []
    for name, code in codes:
        if name == "cudaErrorApiFailureBase":  # a base value of the API-failure range, not a returned error
            continue
        text = lib.cudaGetErrorString(code).decode()
        for line in (f"RuntimeError: CUDA error: {text}", f"{name}: {text}"):
            hit = detector.match_line(line)
            if hit is None or hit[0].id not in cuda_ids:
                unread.append((name, line, hit and hit[0].id))
    assert unread == []


@pytest.mark.parametrize(
    ("line", "want"),
    [
        # Plain-English texts of the generated lists are read only in their emitter's context.
        ("ERROR: the operation cannot be performed in the present state", None),
        (
            "RuntimeError: CUDA error: the operation cannot be performed in the present state",
            "cuda_error_illegal_state",
        ),
        ("smartd: CRC error count increased on /dev/sda", None),
        ("gpu01:1234:1290 [0] NCCL WARN NET/OFI Couldn't create fabric. RC: -264, ERROR: CRC error", "libfabric_ecrc"),
        ("make: *** fatal error", None),
        # rdma-core's own printer of ibv_wc_status_str (libibverbs/examples/rc_pingpong.c).
        ("Failed status transport retry counter exceeded (12) for wr_id 2", "ib_wc_retry_exc_err"),
        ("Failed status Work Request Flushed Error (5) for wr_id 1", "ib_wc_wr_flush_err"),
        # An RM status in NV_ASSERT_OK's line (nvassert.c), by its name; a driver-internal status is no entry.
        (
            "NVRM: nvAssertOkFailedNoLog: Assertion failed: GPU lost from the bus [NV_ERR_GPU_IS_LOST] (0x0000000F)"
            " returned from status @ kernel_gsp.c:2310",
            "nvrm_status_gpu_is_lost",
        ),
        ("NVRM: nvAssertOkFailedNoLog: Assertion failed: Call timed out [NV_ERR_TIMEOUT] (0x00000065)", None),
    ],
)
def test_generated_entries_read_their_emitters_lines_only(line: str, want: str | None) -> None:
    hit = SignatureDetector(signatures=()).match_line(line)
    got = hit[0].id if hit is not None and hit[0].id != "python_exception_line" else None
    assert got == want


@pytest.mark.parametrize(
    ("line", "want"),
    [
        # PyTorch: the watchdog's teardown lines are collateral of the timeout they follow; a CUDA error inside the
        # watchdog's exception is still read as CUDA's.
        (
            "[rank1]:[E1206 18:44:12.7 ProcessGroupNCCL.cpp:1632] [PG ID 0 PG GUID 0(default_pg) Rank 1] Some NCCL"
            " operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU"
            " operations might run on corrupted/incomplete data.",
            "torch_nccl_operations_failed",
        ),
        (
            "[PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread terminated with exception: CUDA"
            " error: an illegal memory access was encountered",
            "cuda_error_illegal_address",
        ),
        ("RuntimeError: Socket Timeout", "torch_store_socket_timeout"),
        # The store's client retrying a server that is not up yet is noise; only its final timeout is read.
        ("[c10d] The client socket has failed to connect to [gpu01]:29500 (errno: 111 - Connection refused).", None),
        # SIGTERM to the elastic agent is a decision (error_lines.yaml), not a crash of unknown cause.
        ("torch.distributed.elastic.multiprocessing.api.SignalException: Process 17912 got signal: 15", None),
        # Slurm: the signals srun itself sends at cancellation are not read; the node of an unkillable step is named.
        ("srun: error: gpu03: task 12: Terminated", None),
        ("srun: error: gpu03: task 12: Segmentation fault (core dumped)", "slurm_srun_task_killed_by_signal"),
        ("slurmstepd: error: *** JOB 123 ON gpu04 CANCELLED AT 2024-05-01T12:00:00 DUE TO TIME LIMIT ***", None),
        # Kernel: only the fatal machine check and the memory-failure handler; the MCE notice is also printed for
        # corrected errors.
        ("mce: [Hardware Error]: Machine check events logged", None),
        ("Memory failure: 0x4f3a12: recovery action for dirty LRU page: Recovered", "kernel_memory_failure"),
        # errno: the network values only in Python's "[Errno N] text" form.
        ("curl: (7) Failed to connect to 10.0.0.5 port 2379: Connection refused", None),
        ("ConnectionRefusedError: [Errno 111] Connection refused", "errno_econnrefused"),
        ("MemoryError", "python_memory_error"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", "torch_cuda_out_of_memory"),
        # Lustre: a connection lost with recovery pending is a warning; one whose operations fail is an error.
        (
            "Lustre: fs1-OST0002-osc-ffff8a: Connection to fs1-OST0002 (at 10.0.0.61@o2ib) was lost; in progress"
            " operations using this service will wait for recovery to complete",
            None,
        ),
        (
            "LustreError: 167-0: fs1-OST0002-osc-ffff8a: This client was evicted by fs1-OST0002; in progress"
            " operations using this service will fail.",
            "lustre_operations_will_fail",
        ),
    ],
)
def test_second_round_entries_read_their_emitters_lines_only(line: str, want: str | None) -> None:
    hit = SignatureDetector(signatures=()).match_line(line)
    got = hit[0].id if hit is not None and hit[0].id != "python_exception_line" else None
    assert got == want


def test_the_second_rounds_node_faults_name_their_node() -> None:
    """An unkillable step and a failed prolog isolate the node the line names; an srun task killed by a signal
    names its node and rank but isolates nothing (the signal's sender is unknown)."""
    detector = SignatureDetector(signatures=())
    lines = [
        "slurmstepd: error: *** STEP 123456.0 STEPD TERMINATED ON gpu04 AT 2024-05-01T12:10:00 DUE TO JOB NOT"
        " ENDING WITH SIGNALS ***",
        "srun: error: gpu02: task 9: Killed",
    ]
    batch = LogBatch(
        event_id="b",
        event_time=0.0,
        job_id="7",
        source="s",
        lines=[LogLine(text=t, ts=float(i), lineno=i + 1) for i, t in enumerate(lines)],
    )
    got = [(a.signature, a.category, a.node, a.isolate) for a in detector.detect(batch)]
    assert got == [
        ("slurm_stepd_terminated_unkillable", "node", "gpu04", True),
        ("slurm_srun_task_killed_by_signal", "unknown", "gpu02", False),
    ]
