"""Culprits from every form the text gives (issue 42, deliverable 3).

Each line is built from its emitter's own format string (cited beside it), not copied from a
posted log: the prefix forms (producers.joblogs.split_rank_prefix) and, through the real
catalogs, detectors, attribution and default policy, what `trainmedic diagnose` reports: the
culprit, the culprit rank, and the culprit resolved to a node of a node list.
"""

from __future__ import annotations

from pathlib import Path
from string import Template
from typing import Any

import pytest

from producers.joblogs import JobLayout, split_rank_prefix
from schemas.events import LogBatch, LogLine
from schemas.ids import node_for_host
from streams.detectors.signatures import SignatureDetector
from trainmedic.ops.diagnose import diagnose_paths
from trainmedic.ops.rankmap import from_nodelist, parse_rank_map

# nccl src/debug.cc ncclDebugLog (NCCL 2.18-2.23): INFO and WARN prefixes.
NCCL_INFO = "%s:%d:%d [%d] NCCL INFO "
NCCL_WARN = "%s:%d:%d [%d] %s:%d NCCL WARN "
# pdsh src/pdsh/dsh.c: each line of a host's output as "host: line" (labels on unless -N);
# DeepSpeed's PDSHRunner (deepspeed/launcher/multinode_runner.py) runs pdsh, so its output too.
PDSH = "%s: %s"
# pdsh's err() "%p: %S: ...": "pdsh@LAUNCHER: REMOTE: ..."
PDSH_ERR = "pdsh@%s: %s: %s"
# Open MPI opal/util/stacktrace.c: "[%s:%05d] " (node name, pid) before each line of its report.
OMPI = "[%s:%05d] %s"
# MPICH Hydra proxies: "[proxy:%d:%d@%s] " (process group, proxy id, host).
HYDRA = "[proxy:%d:%d@%s] %s"
# torch/distributed/elastic/multiprocessing/errors/__init__.py: one failure of ChildFailedError's
# table (the fields and their alignment of _FAILURE_FORMAT_TEMPLATE), and the table around it.
FAILURE = Template(
    "[$idx]:\n"
    "  time      : $time\n"
    "  host      : $hostname\n"
    "  rank      : $rank (local_rank: $local_rank)\n"
    "  exitcode  : $exitcode (pid: $pid)\n"
    "  error_file: <N/A>\n"
    "  traceback : $message"
)
TABLE = Template(
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    "$border\ntrain.py FAILED\n$section\nFailures:\n$others\n$section\n"
    "Root Cause (first observed failure):\n$root\n$border"
)


@pytest.mark.parametrize(
    ("raw", "rank", "host", "gpu", "text"),
    [
        (NCCL_INFO % ("gpu03", 4711, 4790, 2) + "Init COMPLETE", None, "gpu03", 2, "gpu03:4711:4790 [2] NCCL INFO"),
        (
            NCCL_WARN % ("gpu03", 4711, 4790, 2, "transport/net_ib.cc", 1295) + "NET/IB : Got completion",
            None,
            "gpu03",
            2,
            "gpu03:4711",
        ),
        # pdsh's prefix is stripped (the program's line is what the catalogs read); nested prefixes after it.
        (PDSH % ("worker-1", "[rank9]: RuntimeError: CUDA error: unknown error"), 9, "worker-1", None, "RuntimeError"),
        (PDSH % ("gpu02.cluster.local", "Traceback (most recent call last):"), None, "gpu02.cluster.local", None, "Tr"),
        (PDSH_ERR % ("login1", "gpu04", "ssh exited with exit code 255"), None, "gpu04", None, "pdsh@login1"),
        (OMPI % ("gpu02", 5951, "*** Process received signal ***"), None, "gpu02", None, "[gpu02:05951] ***"),
        (HYDRA % (0, 1, "gpu02", "HYDU_sock_write (utils/sock/sock.c:254): write error"), None, "gpu02", None, "[pr"),
    ],
)
def test_writer_forms(raw: str, rank: int | None, host: str, gpu: int | None, text: str) -> None:
    r = split_rank_prefix(raw)
    assert (r.rank, r.host, r.writer, r.gpu) == (rank, host, host, gpu), r
    assert r.text.startswith(text)


@pytest.mark.parametrize(
    "raw",
    [
        "[INFO] loading checkpoint",  # a log level, no pid
        "[train.py:123] step 10",  # a Python logger's file:line
        "fp16: true",  # a printed config
        "sha256: 9f86d081884c7d65",
        "Epoch 1: loss 0.25",
        "ValueError: bad config value",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "2024-09-09 09:36:56: step 3",
    ],
)
def test_lines_that_name_no_writer(raw: str) -> None:
    r = split_rank_prefix(raw)
    assert (r.writer, r.text) == (None, raw)


def test_resolve_host_by_short_name() -> None:
    m = from_nodelist("gpu[01-04]", ranks_per_node=8)
    assert m.resolve_host("gpu03") == "gpu03"
    assert m.resolve_host("gpu03.cluster.local") == "gpu03"
    assert m.resolve_host("gpu09.cluster.local") is None
    assert m.resolve_host("gpu0") is None
    # Two nodes of one short name (two domains in a rank map): not guessed.
    two = parse_rank_map("0 gpu01.a.example\n1 gpu01.b.example\n")
    assert two.resolve_host("gpu01") is None
    assert two.resolve_host("gpu01.b.example") == "gpu01.b.example"


def _diagnose(
    tmp_path: Path, text: str, nodelist: str | None = None, ranks_per_node: int | None = None
) -> dict[str, Any]:
    log = tmp_path / "job.out"
    log.write_text(text + "\n")
    return diagnose_paths([log], nodelist=nodelist, ranks_per_node=ranks_per_node)


def test_pdsh_prefixed_dmesg_names_the_node(tmp_path: Path) -> None:
    # `pdsh -w gpu[01-04] dmesg | grep NVRM`: the kernel's line behind pdsh's host prefix.
    xid = "[ 8123.456789] NVRM: Xid (PCI:0000:41:00): 79, pid=2931, GPU has fallen off the bus."
    r = _diagnose(tmp_path, PDSH % ("gpu03", xid), nodelist="gpu[01-04]")
    assert (r["category"], r["culprit"], r["culprit_node_resolved"]) == ("gpu_hardware", "gpu03", "gpu03")
    assert r["action"] == "drain_and_requeue"
    assert r["provenance"] == "job"  # job-written evidence: offline it is reported, online it cannot isolate alone


def test_nccl_warn_writer_resolved_by_short_name(tmp_path: Path) -> None:
    host = "gpu02.cluster.local"
    text = (
        NCCL_WARN % (host, 1234, 5690, 3, "include/alloc.h", 103) + "Cuda failure 'uncorrectable ECC error encountered'"
    )
    r = _diagnose(tmp_path, text, nodelist="gpu[01-04]")
    assert (r["category"], r["culprit"], r["culprit_node_resolved"]) == ("gpu_hardware", host, "gpu02")
    assert "gpu02.cluster.local is node gpu02" in r["explanation"]
    # Not in the node list: kept as the text gives it, and said.
    r = _diagnose(tmp_path, text, nodelist="gpu[05-08]")
    assert r["culprit_node_resolved"] == host
    assert "not in the node list" in r["explanation"]


def test_a_writer_is_no_culprit_of_a_fault_that_is_not_the_nodes(tmp_path: Path) -> None:
    # The labelling rule: user code, OOM, storage name no culprit even when a host appears.
    lines = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>', "ValueError: bad value"]
    r = _diagnose(tmp_path, "\n".join(PDSH % ("worker-1", ln) for ln in lines))
    assert (r["category"], r["culprit"], r["culprit_node_resolved"]) == ("user_code", None, None)
    assert any(e["node"] == "worker-1" for e in r["evidence"])


def test_slurm_node_failure_resolved(tmp_path: Path) -> None:
    # slurm src/srun/ (srun's node-fail handler): error("Node failure on %s", nodelist).
    r = _diagnose(tmp_path, "srun: error: Node failure on gpu03.cluster.local", nodelist="gpu[01-04]")
    assert (r["category"], r["culprit"], r["culprit_node_resolved"]) == ("node", "gpu03.cluster.local", "gpu03")


def test_monitoring_instance_label_names_the_node(tmp_path: Path) -> None:
    # A Prometheus alert's instance label (host:exporter port) around a quoted syslog kernel line.
    xid = (
        "Dec  2 11:38:27 gpu04 kernel: NVRM: Xid (PCI:0000:b7:00): 48, pid=0, An uncorrectable double bit error "
        "(DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0."
    )
    r = _diagnose(tmp_path, f'FIRING: GPUXidError instance="gpu04:9400" message: {xid}')
    assert (r["category"], r["culprit"]) == ("gpu_hardware", "gpu04")


def _table(root_rank: int, root_host: str, other_rank: int) -> str:
    def failure(idx: int, rank: int, pid: int) -> str:
        return FAILURE.substitute(
            idx=idx,
            time="2024-09-09_09:36:56",
            hostname=root_host,
            rank=rank,
            local_rank=rank % 8,
            exitcode=-9,
            pid=pid,
            message=f"Signal 9 (SIGKILL) received by PID {pid}",
        )

    return TABLE.substitute(
        border="=" * 50,
        section="-" * 50,
        others=failure(1, other_rank, 3310),
        root=failure(0, root_rank, 3309),
    )


def test_child_failed_table_names_the_root_cause_rank(tmp_path: Path) -> None:
    # The agent's traceback before the table names no rank: the table's root cause does.
    agent = 'Traceback (most recent call last):\n  File "/usr/bin/torchrun", line 8, in <module>\n    sys.exit(main())'
    r = _diagnose(tmp_path, agent + "\n" + _table(15, "gpu02.cluster.local", 14), nodelist="gpu[01-02]")
    # A kill with nothing else is a crash with no known cause: the rank, no node to isolate.
    assert (r["category"], r["culprit_rank"], r["culprit"], r["action"]) == ("unknown", 15, None, "none")


def test_child_failed_table_rank_resolves_through_the_placement(tmp_path: Path) -> None:
    # The root cause's rank, not the other failure's, placed by the node list: block, 8 per node.
    r = _diagnose(tmp_path, _table(3, "gpu01", 11), nodelist="gpu[01-02]", ranks_per_node=8)
    assert (r["culprit_rank"], r["culprit_node_resolved"]) == (3, "gpu01")
    r = _diagnose(tmp_path, _table(11, "gpu02", 3), nodelist="gpu[01-02]", ranks_per_node=8)
    assert (r["culprit_rank"], r["culprit_node_resolved"]) == (11, "gpu02")


def test_node_for_host() -> None:
    nodes = ["gpu01", "gpu02", "gpu03"]
    assert node_for_host("gpu02", nodes) == "gpu02"
    assert node_for_host("gpu02.cluster.local", nodes) == "gpu02"
    assert node_for_host("gpu04.cluster.local", nodes) is None
    assert node_for_host("gpu0", nodes) is None


def test_producer_layout_names_the_jobs_node() -> None:
    layout = JobLayout(job_nodes=("gpu01", "gpu02"), ranks_per_node=8)
    r = split_rank_prefix(PDSH % ("gpu02.cluster.local", "RuntimeError: CUDA error: unknown error"))
    assert layout.node_named(r.host) == "gpu02"
    assert layout.node_named("login1.cluster.local") == "login1.cluster.local"  # not the job's: as written
    assert JobLayout().node_named("gpu02.cluster.local") == "gpu02.cluster.local"


def test_online_detector_resolves_an_fqdn_to_the_jobs_node() -> None:
    # The streams worker's log detector on a batch whose job runs on gpu[01-03] (the producer's layout).
    batch = LogBatch(
        event_id="b1",
        event_time=1.0,
        job_id="42",
        source="job.out",
        job_nodes=["gpu01", "gpu02", "gpu03"],
        lines=[
            LogLine(text="srun: error: Node failure on gpu03.cluster.local", ts=1.0, lineno=1),
            LogLine(
                text=NCCL_WARN % ("gpu01.cluster.local", 1234, 5690, 3, "include/alloc.h", 103)
                + "Cuda failure 'uncorrectable ECC error encountered'",
                ts=2.0,
                lineno=2,
                node="gpu01.cluster.local",
            ),
        ],
    )
    found = {a.signature: a.node for a in SignatureDetector().detect(batch)}
    assert found["srun_node_failure"] == "gpu03"
    assert found["cuda_uncorrectable_ecc"] == "gpu01"
