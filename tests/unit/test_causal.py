"""Causal attribution on real text: the cause over its collateral, by time, place and context.

Log text is verbatim from the cited sources or from the dev corpus (each case folder cites its
sources in label.yaml). What the tests set themselves is metadata only: when a line was
written (LogLine.ts) and, where a source gives no prefix, which rank/node wrote it; cascades
join real lines of different sources, as the corpus's combined cases do.
"""

from __future__ import annotations

from producers.joblogs import split_rank_prefix
from schemas.events import Incident, LogBatch, LogLine, SchedEvent
from streams.attribution import Attributor
from streams.causal import ranks_words
from streams.detectors.signatures import SignatureDetector
from streams.policy import choose_action, decide, load_policy
from tests.conftest import FIXTURES

CORPUS = FIXTURES / "corpus" / "dev"
T = 1_733_510_412.0  # 2024-12-06 18:40:12 UTC

# Three ranks' NCCL watchdog timeouts, nothing else (https://github.com/hiyouga/LlamaFactory/issues/6269).
TIMEOUTS = [
    ln for ln in (CORPUS / "ic_nccl_watchdog_timeout_only" / "job.out").read_text().splitlines() if "Watchdog" in ln
]
# https://github.com/richard-peng-xia/MMed-RAG/issues/38
CUDA_OOM = (
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacty of "
    "8.00 GiB of which 0 bytes is free. Of the allocated memory 22.44 GiB is allocated by PyTorch, and 3.16 MiB is "
    "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
# https://github.com/hpcaitech/Open-Sora/issues/694
ILLEGAL_ACCESS = "RuntimeError: CUDA error: an illegal memory access was encountered"
# https://github.com/instructlab/training/pull/520: a test that set the collective timeout to 1 ms.
SHORT_TIMEOUT = (
    "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread terminated with exception: "
    "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, "
    "NumelOut=1, Timeout(ms)=1) ran for 90 milliseconds before timing out."
)
# https://github.com/hiyouga/LlamaFactory/issues/2902: two ranks time out in different collectives.
OUT_OF_STEP = [
    "[rank0]:[E1123 00:52:57.664949121 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=1516, OpType=ALLREDUCE, NumelIn=25427968, NumelOut=25427968, Timeout(ms)=600000) ran "
    "for 600017 milliseconds before timing out.",
    "[rank1]:[E1123 00:52:57.704703955 ProcessGroupNCCL.cpp:607] [Rank 1] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=1517, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600026 "
    "milliseconds before timing out.",
]
# m4 (corpus case node_failure_during_validation): rank-local validation.
VALIDATION_START = "** Starting validation **"
VALIDATION_END = "** Finished validation **"
# https://github.com/AFeng-x/SMT/issues/18: a crash with no cause in the text.
EXIT_1 = (
    "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 0 (pid: 2694) of binary: "
    "/usr/bin/python"
)
VALUE_ERROR = next(
    ln for ln in (CORPUS / "user_valueerror_bad_config" / "job.out").read_text().splitlines() if ln.startswith("Value")
)


def line(text: str, ts: float, n: int, rank: int | None = None, node: str | None = None) -> LogLine:
    r = split_rank_prefix(text)
    return LogLine(
        text=r.text, ts=ts, lineno=n, rank=r.rank if r.rank is not None else rank, node=node or r.host, gpu=r.gpu
    )


def diagnose(lines: list[LogLine], job_nodes: list[str] | None = None, sched: list[str] | None = None) -> Incident:
    detector = SignatureDetector()
    batch = LogBatch(event_id="b", event_time=T, job_id="100", source="job.out", job_nodes=job_nodes or [], lines=lines)
    attributor = Attributor(settle_s=0.0, collateral_wait_s=0.0)
    if sched is not None:
        attributor.observe_sched(
            SchedEvent(event_id="s", event_time=T - 60, kind="job", job_id="100", state="RUNNING", nodes=sched), T - 60
        )
    for a in detector.detect(batch):
        attributor.add(a, now=T)
    (inc,) = attributor.flush(now=T + 1)
    return inc


def chosen(inc: Incident) -> str:
    """What the default policy makes of the incident's facts (attribution states no action)."""
    return choose_action(load_policy(), inc)[0]


def test_oom_on_one_rank_before_the_others_timeouts_is_the_cause() -> None:
    lines = [line(CUDA_OOM, T, 1, rank=3)] + [line(t, T + 40, i) for i, t in enumerate(TIMEOUTS, 2)]
    inc = diagnose(lines)
    assert (inc.category, inc.culprit_rank, chosen(inc)) == ("oom", 3, "stop")
    assert inc.explanation.startswith("rank 3 reported cuda_oom at 18:40:12, 40 s before the other ranks'")
    assert "which are collateral, explained by it" in inc.explanation
    assert inc.evidence[0].signature == "cuda_oom"


def test_the_same_cause_later_does_not_win_over_the_earlier() -> None:
    # Two ranks run out of memory; the one that did first is the culprit, whatever the file order.
    lines = [line(CUDA_OOM, T + 5, 1, rank=6), line(CUDA_OOM, T, 2, rank=2)]
    assert diagnose(lines).culprit_rank == 2


def test_timeouts_alone_are_the_network() -> None:
    inc = diagnose([line(t, T, i) for i, t in enumerate(TIMEOUTS, 1)])
    assert (inc.category, chosen(inc), inc.culprit_node) == ("interconnect", "requeue", None)
    assert inc.explanation.startswith("3 x nccl_watchdog_timeout on ranks 0, 3-4 in _REDUCE_SCATTER_BASE, and nothing")
    assert "suspect the network" in inc.explanation


def test_a_timeout_configured_far_below_the_default_is_the_job() -> None:
    inc = diagnose([line(SHORT_TIMEOUT, T, 1)])
    assert inc.category == "user_code" and chosen(inc) == "stop"
    assert "Timeout(ms)=1" in inc.explanation and "far below the 600 s default" in inc.explanation


def test_a_rank_still_validating_is_why_the_others_timed_out() -> None:
    others = [t for t in TIMEOUTS if not t.startswith("[rank0]")]
    lines = [line(VALIDATION_START, T, 1, rank=0)] + [line(t, T + 600, i) for i, t in enumerate(others, 2)]
    inc = diagnose(lines)
    assert (inc.category, inc.culprit_rank, chosen(inc)) == ("user_code", 0, "stop")
    assert "while rank 0 was still validating (since 18:40:12" in inc.explanation


def test_rank_local_work_long_over_is_no_excuse() -> None:
    # Validation began 3 h before a 600 s timeout fired: the others trained on with rank 0 since.
    others = [t for t in TIMEOUTS if not t.startswith("[rank0]")]
    lines = [line(VALIDATION_START, T, 1, rank=0)] + [line(t, T + 3 * 3600, i) for i, t in enumerate(others, 2)]
    assert diagnose(lines).category == "interconnect"


def test_a_finished_validation_is_no_excuse() -> None:
    others = [t for t in TIMEOUTS if not t.startswith("[rank0]")]
    lines = [line(VALIDATION_START, T, 1, rank=0), line(VALIDATION_END, T + 10, 2, rank=0)]
    lines += [line(t, T + 600, i) for i, t in enumerate(others, 3)]
    assert diagnose(lines).category == "interconnect"


def test_ranks_in_different_collectives_are_out_of_step() -> None:
    inc = diagnose([line(t, T, i) for i, t in enumerate(OUT_OF_STEP, 1)])
    assert inc.category == "user_code" and "out of step" in inc.explanation
    assert "SeqNum 1516" in inc.explanation and "SeqNum 1517" in inc.explanation
    assert inc.confidence < 0.6  # context alone: a recommendation even in autonomous mode


def test_the_same_cuda_error_on_every_rank_of_one_node_is_the_node() -> None:
    lines = [line(ILLEGAL_ACCESS, T, 1, rank=8, node="gpu02"), line(ILLEGAL_ACCESS, T + 1, 2, rank=9, node="gpu02")]
    lines += [line(t, T + 600, i, node="gpu01") for i, t in enumerate(TIMEOUTS, 3)]
    inc = diagnose(lines, job_nodes=["gpu01", "gpu02"])
    assert (inc.category, inc.culprit_node, inc.isolate, chosen(inc)) == ("node", "gpu02", True, "drain_and_requeue")
    assert "ranks 8-9, all on gpu02, and on no other node" in inc.explanation
    # The same error on a rank of the other node too: the code, not a node.
    lines.append(line(ILLEGAL_ACCESS, T + 2, 99, rank=0, node="gpu01"))
    assert diagnose(lines, job_nodes=["gpu01", "gpu02"]).category == "user_code"


def test_a_crash_with_no_known_cause_is_unknown_and_never_acts() -> None:
    inc = diagnose([line(EXIT_1, T, 1)])
    assert (inc.category, inc.isolate, chosen(inc)) == ("unknown", False, "none")
    assert "needs a person" in inc.explanation
    decision, action = decide(load_policy().with_mode("autonomous"), inc, T + 2)
    assert action is None and decision.action == "none"


def test_any_recognised_cause_beats_a_crash_marker() -> None:
    assert diagnose([line(CUDA_OOM, T, 1, rank=3), line(EXIT_1, T + 1, 2)]).category == "oom"
    timeouts = [line(t, T, i) for i, t in enumerate(TIMEOUTS, 1)]
    assert diagnose([*timeouts, line(EXIT_1, T + 5, 9)]).category == "interconnect"


def test_an_exception_after_the_timeouts_is_teardown_not_the_cause() -> None:
    timeouts = [line(t, T, i) for i, t in enumerate(TIMEOUTS, 1)]
    assert diagnose([*timeouts, line(VALUE_ERROR, T + 5, 9, rank=2)]).category == "interconnect"
    # The same exception before the timeouts is the cause.
    assert diagnose([line(VALUE_ERROR, T - 5, 0, rank=2), *timeouts]).category == "user_code"


# https://github.com/alan-turing-institute/autocast/issues/381: training ends, then one more
# collective waits for ranks that never enter it ("Post-fit NCCL ALLREDUCE timeout").
FIT_STOPPED = "`Trainer.fit` stopped: `max_epochs=N` reached."
# https://github.com/Lightning-AI/pytorch-lightning/issues/19377 (the timeout line; joined as a cascade)
POST_FIT_TIMEOUT = (
    "[E ProcessGroupNCCL.cpp:475] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=17, "
    "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800995 milliseconds before timing out."
)


def test_a_collective_after_training_finished_is_the_job() -> None:
    inc = diagnose([line(FIT_STOPPED, T, 1), line(POST_FIT_TIMEOUT, T + 1800, 2)])
    assert inc.category == "user_code" and "done with training" in inc.explanation
    assert inc.explanation.startswith("rank 0 timed out in ALLREDUCE while another rank was done with training")


NODE_FAILURE = "srun: error: Node failure on gpu06"  # https://github.com/huggingface/m4-logs (as in the catalog)


def test_a_node_named_by_the_job_but_not_its_own_is_never_isolated() -> None:
    """Issue 14: a job on gpu01-04 printing 'srun: error: Node failure on gpu06' drains nothing."""
    mine = ["gpu01", "gpu02", "gpu03", "gpu04"]
    # The log batch even claims gpu06 as a node of the job: the scheduler's placement stands.
    inc = diagnose([line(NODE_FAILURE, T, 1)], job_nodes=["gpu06"], sched=mine)
    assert (inc.category, inc.culprit_node, inc.culprit_in_job, inc.isolatable) == ("node", "gpu06", False, False)
    assert inc.job_nodes == mine and "not one of the job's nodes" in inc.isolation_note
    decision, action = decide(load_policy().with_mode("autonomous"), inc, T + 2)
    assert action is None and decision.action == "none" and "gpu06" in decision.reason


def test_a_node_of_the_job_named_only_by_its_output_is_not_isolated() -> None:
    """Issue 41 reversed this: the job's own line naming one of its nodes restarts the job; draining
    the node needs evidence the job cannot write (here none), so it is recommended to a person."""
    inc = diagnose([line(NODE_FAILURE.replace("gpu06", "gpu02"), T, 1)], sched=["gpu01", "gpu02"])
    assert (inc.culprit_node, inc.culprit_in_job, inc.isolate, inc.isolatable) == ("gpu02", True, True, False)
    assert inc.provenance == "job" and "never isolates a node on its own" in inc.isolation_note
    decision, action = decide(load_policy().with_mode("autonomous"), inc, T + 2)
    assert action is not None and (action.action, action.node) == ("requeue", "gpu02")
    assert "isolating gpu02 recommended" in decision.reason


def test_no_placement_known_stays_a_recommendation() -> None:
    inc = diagnose([line(NODE_FAILURE, T, 1)])
    assert (inc.culprit_in_job, inc.isolate, inc.isolatable, chosen(inc)) == (None, True, False, "drain_and_requeue")
    decision, action = decide(load_policy().with_mode("autonomous"), inc, T + 2)
    assert action is None and decision.action == "drain_and_requeue" and "recommendation only" in decision.reason


def test_ranks_words() -> None:
    assert ranks_words([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"


PROGRESS = FIXTURES / "progress"  # sources in tests/fixtures/progress/SOURCES.md


def _fixture_line(path: str, needle: str) -> str:
    return next(ln for ln in (FIXTURES / path).read_text().splitlines() if needle in ln)


# activity id -> real lines it must match (and no other activity first).
ACTIVITY_LINES: dict[str, list[str]] = {
    "checkpoint": [
        _fixture_line("progress/megatron.log", "saving checkpoint at iteration"),
        _fixture_line("progress/hf.log", "Saving model checkpoint to"),
        _fixture_line("progress/torchtitan.log", "Saving the checkpoint"),
        _fixture_line("progress/deepspeed.log", "is about to be saved!"),
        _fixture_line("progress/dcp.log", "'func_name': 'save'"),
    ],
    "checkpoint_done": [
        _fixture_line("progress/megatron.log", "successfully saved checkpoint"),
        _fixture_line("progress/torchtitan.log", "Finished saving the checkpoint"),
    ],
    "validation": [
        VALIDATION_START,
        _fixture_line("progress/lightning.log", "Validation DataLoader 0:"),
        _fixture_line("progress/lightning.log", "Validating:"),
    ],
    "validation_done": [VALIDATION_END, _fixture_line("progress/megatron.log", "validation loss at iteration")],
    "finished": [
        # huggingface/transformers Trainer.train's closing log line (src/transformers/trainer.py).
        "Training completed. Do not forget to share your model on huggingface.co/models =)",
        FIT_STOPPED,
    ],
}


def test_every_activity_matches_its_real_lines() -> None:
    from streams.detectors.activity import ActivityTracker, default_activities

    assert set(ACTIVITY_LINES) == set(default_activities())
    for act_id, texts in ACTIVITY_LINES.items():
        for text in texts:
            tracker = ActivityTracker()
            ends = default_activities()[act_id].ends
            if ends:  # an end line closes what was open
                tracker.observe("j", LogLine(text=VALIDATION_START, ts=T - 1, lineno=0, rank=5), None)
                tracker.observe("j", LogLine(text=ACTIVITY_LINES["checkpoint"][0], ts=T - 1, lineno=0, rank=5), None)
                assert tracker.peers("j", 0, None)
            r = split_rank_prefix(text)
            tracker.observe("j", LogLine(text=r.text, ts=T, lineno=1, rank=5), None)
            got = tracker.peers("j", 0, None)
            assert (got == []) if ends else ([a.activity for a in got] == [act_id]), (act_id, text)
