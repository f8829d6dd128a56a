"""Throughput detector (streams.detectors.throughput) on real training logs.

Fixtures in tests/fixtures/progress (sources in SOURCES.md there) and the corpus
(tests/fixtures/corpus/dev, sources in each label.yaml).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from producers.joblogs import split_rank_prefix
from producers.progress import ProgressParser
from schemas.events import Anomaly, ProgressBatch, ProgressSample
from streams.detectors.throughput import (
    ThroughputDetector,
    ThroughputSettings,
    classify_slowdown,
    with_evidence,
)
from tests.conftest import FIXTURES

PROGRESS = FIXTURES / "progress"
DEV = FIXTURES / "corpus" / "dev"
_SSD = re.compile(r"^Epoch\[(\d+)\] Batch \[(\d+)\]\tSpeed: ([\d.]+) samples/sec")


def parsed(path: Path, *patterns: str) -> list[ProgressSample]:
    parser = ProgressParser(patterns)
    out = []
    for i, raw in enumerate(path.read_text().splitlines()):
        r = split_rank_prefix(raw)
        s = parser.parse(r.text, ts=1000.0 + i, rank=r.rank)
        if s is not None:
            out.append(s)
    return out


def ssd_samples() -> list[ProgressSample]:
    # mxnet prints samples/sec; at a fixed batch size its inverse is proportional to the time per
    # step, which is what the detector compares (ratios, never absolute values).
    out = []
    for i, line in enumerate((PROGRESS / "throughput_drop.log").read_text().splitlines()):
        m = _SSD.match(line)
        assert m, line
        step = int(m.group(1)) * 1000 + int(m.group(2))
        out.append(ProgressSample(ts=1000.0 + i, step=step, step_time_s=1.0 / float(m.group(3)), format="custom"))
    return out


def detect(found: list[ProgressSample], settings: ThroughputSettings | None = None) -> list[str]:
    batch = ProgressBatch(event_id="b", event_time=1000.0, job_id="j1", samples=found)
    return [a.line for a in ThroughputDetector(settings).observe(batch)]


def test_a_drop_that_persists_is_a_finding() -> None:
    found = ssd_samples()
    # 95-98 samples/sec, then 46.48 and 23.47: two slow reports in a row (duplicated lines of one
    # batch count once). Warm-up 0 and a baseline of 5: the excerpt starts mid-run.
    settings = ThroughputSettings(warmup=0, min_baseline=5, persist=2)
    lines = detect(found, settings)
    assert len(lines) == 1
    assert "below the baseline" in lines[0] and "steps/s" in lines[0]
    # With the default persistence (5 reports) two slow reports are not yet a change point.
    assert detect(found, ThroughputSettings(warmup=0, min_baseline=5)) == []


def test_a_checkpoint_step_is_not_a_finding() -> None:
    # deeplab-lfov: ~1.0 sec/step, 5.495 at the checkpoint step 13000, then 0.743.
    found = parsed(
        PROGRESS / "checkpoint_step_dip.log",
        r"^step (?P<step>\d+) \t loss = (?P<loss>[\d.]+), \((?P<step_time_s>[\d.]+) sec/step\)",
    )
    assert len(found) == 30 and max(s.step_time_s or 0 for s in found) == pytest.approx(5.495)
    assert detect(found) == []
    assert detect(found, ThroughputSettings(persist=2)) == []  # one slow report is a dip at any persistence


def test_torchtitan_profiler_dump_and_gc_dips_are_not_findings() -> None:
    # torchtitan tps 5,856 / 5,593 / 5,868 ... around a profiler dump (pytorch/torchtitan#1287,
    # tests/fixtures/progress/torchtitan.log carries the run's lines).
    found = [s for s in parsed(PROGRESS / "torchtitan.log") if s.tokens_per_s]
    assert found
    assert detect(found, ThroughputSettings(warmup=0, min_baseline=2, persist=2)) == []


IMAGENET = r"^\s*Epoch: \[\d+\]\[(?P<step>\d+)/\d+\]\tTime (?P<step_time_s>[\d.]+) \("
# nvidia-smi -a of a healthy GPU (mlfoundations/open_clip#703): every reason listed, none of the
# hardware ones active. Listing a reason is no evidence of throttling.
NVIDIA_SMI_NOT_ACTIVE = [
    "    Clocks Event Reasons",
    "        Idle                              : Not Active",
    "        Applications Clocks Setting       : Not Active",
    "        SW Power Cap                      : Active",
    "        HW Slowdown                       : Not Active",
    "            HW Thermal Slowdown           : Not Active",
    "            HW Power Brake Slowdown       : Not Active",
    "        Sync Boost                        : Not Active",
    "        SW Thermal Slowdown               : Not Active",
    "        Display Clock Setting             : Not Active",
]


def test_a_data_starved_slowdown_is_storage() -> None:
    # DALI#2608: ~0.17 s per batch, then 8.7, 8.96, 8.58 s with 'Data' (the wait for the batch)
    # nearly all of it.
    path = PROGRESS / "throughput_drop_data_wait.log"
    found = parsed(path, IMAGENET)
    assert [s.step for s in found] == [0, 20, 40, 60, 80, 100, 120, 140]
    batch = ProgressBatch(event_id="b", event_time=1000.0, job_id="j1", samples=found)
    (anomaly,) = ThroughputDetector(ThroughputSettings(warmup=1, min_baseline=3, persist=3)).observe(batch)
    assert (anomaly.category, anomaly.signature, anomaly.role) == ("unknown", "throughput_drop", "root")
    assert "below the baseline" in anomaly.line
    classified = with_evidence(anomaly, path.read_text().splitlines())
    assert classified.category == "storage"
    assert "Data 8.597" in classified.meaning
    # The default persistence (5 reports) has not been reached by 3 slow batches; but the log ends
    # there, still slow: at its end (offline) three slow reports with no recovery are a finding.
    det = ThroughputDetector()
    assert det.observe(batch) == []
    (at_end,) = det.finish("j1")
    assert at_end.event_id == anomaly.event_id  # the same slowdown, the same id
    assert det.finish("j1") == []


def test_without_evidence_a_slowdown_stays_unknown() -> None:
    assert classify_slowdown(NVIDIA_SMI_NOT_ACTIVE) == ("unknown", None, None)
    # The healthy first batches of the DALI log: data is a quarter of the step at most.
    early = (PROGRESS / "throughput_drop_data_wait.log").read_text().splitlines()[:12]
    assert classify_slowdown(early) == ("unknown", None, None)


def finished(found: list[ProgressSample], settings: ThroughputSettings | None = None) -> list[Anomaly]:
    det = ThroughputDetector(settings)
    online = det.observe(ProgressBatch(event_id="b", event_time=1000.0, job_id="j1", samples=found))
    return online + det.finish("j1")


def bloom() -> list[ProgressSample]:
    # BLOOM-176B, 2022-04-28: 105.16-106.25 s per iteration, then 110.17 and 111.14 s to the end of the
    # excerpt ("dropped from 149 to 140 TFLOPs and remained there"; one slow GPU). Each record is
    # wrapped over three lines as published: joined before parsing.
    text = (DEV / "gpu_bloom_throughput_drop_slow_gpu" / "job.out").read_text()
    records = [r for r in re.split(r"\n(?=\[default7\]: iteration)", text) if r.strip()]
    parser = ProgressParser()
    out = []
    for i, record in enumerate(records):
        s = parser.parse(split_rank_prefix(" ".join(record.splitlines())).text, ts=1000.0 + i)
        assert s is not None and s.step_time_s is not None, record
        out.append(s)
    return out


def test_a_small_drop_that_persists_to_the_end_is_unknown_not_healthy() -> None:
    found = bloom()
    assert [s.step_time_s for s in found] == [105.16, 105.17, 106.25, 110.17, 111.14]
    assert detect(found) == []  # 4-5% is far under the 20% of a slowdown
    (a,) = finished(found)
    assert (a.signature, a.category, a.severity, a.role) == ("throughput_drop_small", "unknown", "warning", "root")
    assert "over 2 reports since step 42783" in a.line and "to the end of the log" in a.line
    # Above the notice floor only: a 5% floor leaves the 4.5% drop of the excerpt unnoticed.
    assert finished(found, ThroughputSettings(notice_rel=0.05)) == []


def test_a_transient_dip_at_the_end_or_in_the_middle_is_no_finding() -> None:
    # One slow report at the end (BLOOM's excerpt cut at 110.17 s) is a dip, not a level.
    assert finished(bloom()[:4]) == []
    # deeplab-lfov's checkpoint step (5.5 s among ~1 s steps) then fast again; Megatron GPT-2 345M's
    # step times jumping between 0.84 and 1.11 s with no level; torchtitan's profiler-dump dips.
    dip = parsed(
        PROGRESS / "checkpoint_step_dip.log",
        r"^step (?P<step>\d+) \t loss = (?P<loss>[\d.]+), \((?P<step_time_s>[\d.]+) sec/step\)",
    )
    noisy = parsed(DEV / "healthy_megatron_gpt2_345m" / "job.out")
    titan = [s for s in parsed(PROGRESS / "torchtitan.log") if s.tokens_per_s]
    for found in (dip, noisy, titan):
        assert len(found) >= 5
        assert finished(found) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"persist": 1},
        {"drop_rel": 1.5},
        {"min_baseline": 1},
        {"warmup": -1},
        {"notice_rel": 0.3},
        {"notice_min_reports": 1},
        {"decline_min_reports": 2},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="ThroughputSettings"):
        ThroughputSettings(**kwargs)  # type: ignore[arg-type]


# --- a decline report after report (epfLLM/Megatron-LLM issue 22) -------------------------------------


def test_a_step_time_that_keeps_growing_is_unknown_not_healthy() -> None:
    found = parsed(DEV / "unknown_megatron_llm_iteration_time_grows" / "job.out")
    assert [s.step_time_s for s in found] == [84.6062, 142.4741, 202.4386]
    (a,) = finished(found)
    assert (a.signature, a.category, a.severity) == ("throughput_decline", "unknown", "warning")
    assert "report after report since step 15" in a.line
    # The chain needs its warm-up report: two reports are one drop, a dip.
    assert finished(found[1:]) == []


def test_a_slow_report_that_recovers_or_a_warmup_that_speeds_up_is_no_decline() -> None:
    # The growing step times of issue 22 with a recovered fourth report: no longer a decline to the end.
    found = parsed(DEV / "unknown_megatron_llm_iteration_time_grows" / "job.out")
    recovered = [*found, found[0].model_copy(update={"step": 25, "ts": found[-1].ts + 1})]
    assert finished(recovered) == []
    # The same step times in reverse order: a run speeding up after its warm-up.
    faster = [s.model_copy(update={"step": 10 + 5 * i, "ts": 1000.0 + i}) for i, s in enumerate(reversed(found))]
    assert finished(faster) == []
