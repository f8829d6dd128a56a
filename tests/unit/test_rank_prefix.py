"""Rank, host and GPU attribution forms of job-log lines, each on real text.

Lines come verbatim from public sources (URL beside each) or from the dev corpus, whose case
folders cite their sources in label.yaml. Only host names were anonymised there.
"""

from __future__ import annotations

import pytest

from producers.joblogs import split_rank_prefix
from producers.tracebacks import TracebackGrouper
from schemas.events import LogLine
from tests.conftest import FIXTURES

CORPUS = FIXTURES / "corpus" / "dev"


def corpus_line(case: str, file: str, startswith: str) -> str:
    return next(ln for ln in (CORPUS / case / file).read_text().splitlines() if ln.startswith(startswith))


@pytest.mark.parametrize(
    ("raw", "rank", "host", "gpu", "text_starts"),
    [
        # torchrun / c10d "[rankN]:" prefix: the global rank.
        # https://github.com/OpenRLHF/OpenRLHF/issues/1126 ("[PG ID 0 PG GUID 0(default_pg) Rank 6]": rank 6, not PG 0)
        (
            "[rank6]:[E901 05:20:04.907052983 ProcessGroupNCCL.cpp:1899] [PG ID 0 PG GUID 0(default_pg) Rank 6] "
            "Process group watchdog thread terminated with exception: [Rank 6] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=460631, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
            "600029 milliseconds before timing out.",
            6,
            None,
            None,
            "[E901",
        ),
        # A Ray prefix before the c10d one: the rank inside "[PG 1 Rank 1]" is the rank, never the PG.
        # https://github.com/vllm-project/vllm/issues/6042
        (
            "(RayWorkerWrapper pid=4009) [rank1]:[E ProcessGroupNCCL.cpp:1537] [PG 1 Rank 1] Timeout at NCCL work: "
            "158046, last enqueued NCCL work: 158046, last completed NCCL work: 158045.",
            1,
            None,
            None,
            "(RayWorkerWrapper",
        ),
        # torchrun --tee "[defaultN]:" is the LOCAL rank: the GPU index, not a global rank.
        (corpus_line("healthy_bloom_loss_spike_recovered", "job.out", "[default7]:"), None, None, 7, "iteration"),
        # OpenMPI --tag-output "[jobid,rank]<stdout>:" behind a timestamp; NCCL's host:pid:tid [cudaDev] inside.
        (
            corpus_line("ic_ib_local_catastrophic_error", "job.out", "2019-06-02T16:13:44.884Z: [1,12]<stdout>:gpu01"),
            12,
            "gpu01",
            0,
            "2019-06-02T16:13:44.884Z: gpu01:815:864 [0]",
        ),
        # srun --label "N: " with NCCL's host prefix behind it.
        (corpus_line("unknown_segfault_barrier", "job.out", "0: gpu01:"), 0, "gpu01", 0, "gpu01:2128869:2128880"),
        # srun's own task report: host and (one task) rank. https://github.com/hafs-community/HAFS/issues/101
        ("srun: error: gpu01: task 4: Out Of Memory", 4, "gpu01", None, "srun: error"),
        # A range of tasks names the host only. https://github.com/desihub/desispec/issues/2744
        ("srun: error: nid002888: tasks 0-57,59-63: Terminated", None, "nid002888", None, "srun: error"),
        # syslog / journal prefix "Mon DD HH:MM:SS HOST kernel: ...".
        (
            corpus_line("gpu_xid48_dbe_nccl_timeouts", "kern.log", "Dec  2 11:38:27 gpu02 kernel:"),
            None,
            "gpu02",
            None,
            "Dec  2",
        ),
        # A monitoring alert naming the instance (m4 chronicles, cited in the case's label.yaml).
        (
            corpus_line("gpu_m4_xid63_monitoring_instance", "alerts.log", "Xid errors on instance"),
            None,
            "gpu01",
            None,
            "Xid errors",
        ),
        # Plain text: nothing.
        ("Building eval loader...", None, None, None, "Building"),
    ],
)
def test_attribution_forms(raw: str, rank: int | None, host: str | None, gpu: int | None, text_starts: str) -> None:
    r = split_rank_prefix(raw)
    assert (r.rank, r.host, r.gpu) == (rank, host, gpu), r
    assert r.text.startswith(text_starts)


def test_timestamps_are_not_hosts() -> None:
    # c10d's "[E419 10:53:25.421620797 ...]": "10:53:25" must not read as host "10" pid 53.
    # https://github.com/Intellindust-AI-Lab/DEIM/issues/105 (as in tests/unit/test_catalog.py)
    r = split_rank_prefix(
        "[rank2]:[E419 10:53:25.421620797 ProcessGroupNCCL.cpp:1484] [PG ID 2 PG GUID 9 Rank 2] ProcessGroupNCCL's "
        "watchdog got stuck for 480 seconds without making progress in monitoring enqueued collectives."
    )
    assert (r.rank, r.host, r.gpu) == (2, None, None)


# https://github.com/huggingface/trl/issues/1099 (torchrun's ChildFailedError summary, verbatim)
CHILD_FAILED_TABLE = """Failures:
[1]:
  time      : 2023-12-14_14:18:51
  host      : db-test-fms-hf-base-master-0
  rank      : 2 (local_rank: 2)
  exitcode  : -6 (pid: 5334)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 5334
-----------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2023-12-14_14:18:51
  host      : db-test-fms-hf-base-master-0
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 5333)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 5333
=====================================================""".splitlines()


def test_child_failed_table_gives_the_root_cause_its_rank_host_and_gpu() -> None:
    grouper = TracebackGrouper()
    out = [
        o
        for i, t in enumerate(CHILD_FAILED_TABLE)
        for o in grouper.feed(LogLine(text=t, ts=float(i), lineno=i), float(i))
    ]
    by_text = {o.text: o for o in out}
    root = by_text["  exitcode  : -6 (pid: 5333)"]
    assert (root.rank, root.node, root.gpu) == (1, "db-test-fms-hf-base-master-0", 1)
    assert by_text["  traceback : Signal 6 (SIGABRT) received by PID 5333"].rank == 1
    # The other failures are left alone: usually ranks the agent stopped after the first failed.
    other = by_text["  exitcode  : -6 (pid: 5334)"]
    assert (other.rank, other.node) == (None, None)
    assert by_text["====================================================="].rank is None
