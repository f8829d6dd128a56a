from __future__ import annotations

import math
from pathlib import Path

import pytest

from producers.joblogs import split_rank_prefix
from producers.progress import ProgressParser, checkpoint_marker, to_float
from schemas.events import ProgressSample
from tests.conftest import FIXTURES

PROGRESS = FIXTURES / "progress"
LOGS = FIXTURES / "logs"


def parse_file(name: str, parser: ProgressParser | None = None) -> list[tuple[str, ProgressSample | None]]:
    p = parser or ProgressParser()
    out = []
    for i, raw in enumerate((PROGRESS / name).read_text().splitlines(), 1):
        r = split_rank_prefix(raw)
        out.append((raw, p.parse(r.text, float(i), r.rank, "gpu01")))
    return out


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("megatron.log", "megatron"),
        ("nemo.log", "nemo"),
        ("lightning.log", "lightning"),
        ("hf.log", "hf"),
        ("torchtitan.log", "torchtitan"),
        ("deepspeed.log", "deepspeed"),
        ("dcp.log", "dcp"),
    ],
)
def test_every_fixture_line_parses(name: str, family: str) -> None:
    for raw, s in parse_file(name):
        assert s is not None, raw
        assert s.format.split(":")[0] == family, raw
        assert s.node == "gpu01"


def test_megatron_values() -> None:
    samples = [s for _, s in parse_file("megatron.log") if s is not None]
    first = samples[0]
    assert (first.step, first.step_time_s, first.loss, first.grad_norm) == (100, pytest.approx(0.8586), 9.674668, 3.75)
    assert first.phase == "train" and first.tokens_per_s is None
    valid = samples[3]
    assert (valid.phase, valid.step, valid.loss) == ("eval", 1000, 6.329505)
    # Megatron-DeepSpeed prints 'grad norm: nan' and samples per second with the sequence length.
    bigscience = next(s for s in samples if s.step == 5426)
    assert bigscience.grad_norm is not None and math.isnan(bigscience.grad_norm)
    assert bigscience.loss is None and bigscience.tokens_per_s == pytest.approx(1.883 * 2048)
    # 'lm_loss' with an underscore (Megatron-DeepSpeed) and 'samples/sec' before 'iteration'.
    assert samples[-1].step == 34 and samples[-1].loss == pytest.approx(11.18665)
    # BERT warm-up: no loss printed yet.
    bert = next(s for s in samples if s.step == 10 and s.step_time_s == pytest.approx(0.3562))
    assert bert.loss is None


def test_megatron_checkpoint_phases() -> None:
    ckpt = [(raw.strip()[:24], s) for raw, s in parse_file("megatron.log") if s is not None and s.phase == "checkpoint"]
    assert [(text, checkpoint_marker(s), s.step) for text, s in ckpt] == [
        ("saving checkpoint at ite", "start", 2000),
        ("saving checkpoint at ite", "start", 400),
        ("successfully saved check", "end", 400),
        ("save-checkpoint ........", "end", None),
        ("saving checkpoint at ite", "start", 600),
    ]


def test_healthy_megatron_log_yields_its_iterations_only() -> None:
    p = ProgressParser()
    samples = []
    for i, raw in enumerate((LOGS / "healthy_training.log").read_text().splitlines(), 1):
        r = split_rank_prefix(raw)
        s = p.parse(r.text, float(i), r.rank)
        if s is not None:
            samples.append(s)
    assert [(s.phase, s.step) for s in samples] == [
        ("train", 100),
        ("train", 200),
        ("train", 1000),
        ("eval", 1000),
        ("train", 1100),
        ("train", 2000),
        ("eval", 2000),
        ("checkpoint", 2000),
    ]
    # 'number of nan iterations:   0' is no NaN loss.
    assert all(s.loss is None or not math.isnan(s.loss) for s in samples)


@pytest.mark.parametrize(
    "path", [PROGRESS / "non_progress.log", LOGS / "nccl_watchdog_timeout.log", LOGS / "xid79_kern.log"]
)
def test_non_progress_lines_give_none(path: Path) -> None:
    p = ProgressParser()
    for raw in path.read_text().splitlines():
        assert p.parse(split_rank_prefix(raw).text, 0.0) is None, raw


def test_nemo_and_lightning_values() -> None:
    nemo = [s for _, s in parse_file("nemo.log") if s is not None]
    assert (nemo[0].step, nemo[0].loss, nemo[0].step_time_s) == (120, 1.233, 0.03146)
    lightning = {raw: s for raw, s in parse_file("lightning.log")}
    values = [s for s in lightning.values() if s is not None]
    assert (values[1].step, values[1].step_time_s, values[1].loss) == (1, 8.77, None)
    assert (values[2].step, values[2].loss) == (1, 10.473)
    # Epoch 1 of a 997-batch epoch: the step keeps counting across epochs.
    assert values[11].step == 997 + 996 and values[11].step_time_s == pytest.approx(1 / 6.51)
    # NeMo's bar carries global_step and its own step timing.
    nemo_bar = values[13]
    assert (nemo_bar.step, nemo_bar.loss, nemo_bar.step_time_s) == (794, 3.09, 41.36)
    # Validation bars: the job is alive and evaluating, no training step.
    evals = [(raw.split(":")[0], s.step) for raw, s in lightning.items() if s is not None and s.phase == "eval"]
    assert evals == [("Validation DataLoader 0", None), ("Validating", None)]
    assert values[17].step == 932 and values[17].loss == 0.223


def test_nan_loss_is_kept() -> None:
    nan_bar = next(s for raw, s in parse_file("lightning.log") if "nan.0" in raw)
    assert nan_bar is not None and nan_bar.loss is not None and math.isnan(nan_bar.loss)
    assert (nan_bar.step, nan_bar.step_time_s) == (9000, 0.615)
    hf_nan = [s for raw, s in parse_file("hf.log") if "'grad_norm': nan" in raw]
    assert hf_nan and all(s is not None and s.grad_norm is not None and math.isnan(s.grad_norm) for s in hf_nan)
    for text, expected in (("NAN", math.nan), ("nan.0", math.nan), ("inf", math.inf), ("-inf", -math.inf)):
        v = to_float(text)
        assert v is not None and (math.isnan(v) if math.isnan(expected) else v == expected)
    assert to_float("4,567") == 4567.0 and to_float("9.674668E+00") == 9.674668 and to_float("?") is None


def test_hf_values_and_checkpoint() -> None:
    rows = parse_file("hf.log")
    dict_line = rows[0][1]
    assert dict_line is not None and (dict_line.step, dict_line.loss, dict_line.grad_norm) == (
        None,
        2.119,
        37.657958984375,
    )
    bar = rows[7][1]
    assert bar is not None and (bar.format, bar.step, bar.step_time_s) == ("hf", 477, 15.33)
    ckpt = [(checkpoint_marker(s), s.step) for _, s in rows if s is not None and s.phase == "checkpoint"]
    # The tqdm bar sharing its line with 'Saving model checkpoint to' is a checkpoint start, not a step.
    assert ckpt == [("start", 7000)] * 5 + [("start", 10)] * 3


def test_torchtitan_and_deepspeed_values() -> None:
    titan = [s for _, s in parse_file("torchtitan.log") if s is not None]
    assert (titan[0].rank, titan[0].step, titan[0].loss, titan[0].tokens_per_s) == (0, 200, 6.1384, 5856.0)
    with_grad = next(s for s in titan if s.step == 14)
    assert with_grad.grad_norm == 0.8319
    ckpt = [checkpoint_marker(s) for s in titan if s.phase == "checkpoint"]
    assert ckpt == ["start", "end", "start"]
    ds = [s for _, s in parse_file("deepspeed.log") if s is not None]
    pipe = ds[1]
    assert (pipe.step, pipe.loss, pipe.step_time_s) == (1, 0.0614, 531.283)
    assert [s.step for s in ds[:11]] == [1, 1, 2, 2, 3, 3, 4, 4, 40, 40, 34]
    assert [(checkpoint_marker(s), s.step) for s in ds[11:]] == [("start", 10)] * 5


def test_checkpoint_lines_rendered_from_framework_sources() -> None:
    # No public log with these exact messages was found; they are the frameworks' own format
    # strings (Megatron-LM megatron/training/checkpointing.py, DeepSpeed
    # torch_checkpoint_engine.py commit(), torch.distributed.checkpoint's method logger 'end').
    p = ProgressParser()
    cases = {
        "  successfully saved checkpoint from iteration     845 to /ckpt [ t 1/1, p 1/1 ]": ("end", 845),
        "saving checkpoint at iteration      50 to /ckpt in torch_dist format": ("start", 50),
        "[INFO] [torch_checkpoint_engine.py:29:commit] [Torch] Checkpoint global_step10 is ready now!": ("end", 10),
        "{'checkpoint_id': '/tmp/test', 'func_name': 'save', 'args': \"()\", 'event': 'end', 'time': 1}": ("end", None),
    }
    for text, (marker, step) in cases.items():
        s = p.parse(text, 0.0)
        assert s is not None and (checkpoint_marker(s), s.step) == (marker, step), text


def test_carriage_returns_keep_the_last_bar_state() -> None:
    lines = [raw for raw, _ in parse_file("lightning.log")[1:5]]
    s = ProgressParser().parse("\r".join(lines) + "\r", 0.0)
    assert s is not None and (s.step, s.loss) == (2, 10.224)


def test_custom_patterns() -> None:
    p = ProgressParser(
        [
            r"iter: (?P<step>\d+)/\d+, loss: (?P<loss>[\d.]+),.*batch_cost: (?P<step_time_s>[\d.]+)",
            r"loss=(?P<loss>[\d.]+),.*wps=(?P<tokens_per_s>[\d.]+),.*num_updates=(?P<step>\d+)",
        ]
    )
    samples = [s for _, s in parse_file("custom.log", p)]
    assert all(s is not None and s.format == "custom" for s in samples)
    got = [(s.step, s.loss, s.step_time_s, s.tokens_per_s) for s in samples if s is not None]
    assert got[0] == (20, 2.0859, 0.5344, None)
    assert got[3] == (2200, 7.137, None, 133180.0)
    ms = ProgressParser([r"it (?P<step>\d+) took (?P<step_time_ms>[\d.]+) ms"]).parse("it 7 took 250 ms", 0.0)
    assert ms is not None and ms.step_time_s == 0.25
    # Custom patterns come first: the user's reading of a line wins over a built-in one.
    megatron_line = (PROGRESS / "megatron.log").read_text().splitlines()[0]
    over = ProgressParser([r"iteration\s+(?P<step>\d+)/"]).parse(megatron_line, 0.0)
    assert over is not None and over.format == "custom" and over.loss is None


@pytest.mark.parametrize("bad", [r"(?P<stepp>\d+)", r"step (\d+)", r"(?P<step>\d+"])
def test_bad_custom_patterns_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="progress pattern"):
        ProgressParser([bad])


def test_megatron_deepspeed_seconds_per_iteration() -> None:
    # BLOOM's Megatron-DeepSpeed log (tests/fixtures/corpus/dev/healthy_bloom_loss_spike_recovered) prints seconds.
    path = FIXTURES / "corpus" / "dev" / "healthy_bloom_loss_spike_recovered" / "job.out"
    line = next(ln for ln in path.read_text().splitlines() if "elapsed time per iteration (s)" in ln)
    text = split_rank_prefix(line).text
    sample = ProgressParser().parse(text, 1.0, 0, None)
    assert sample is not None and sample.format == "megatron"
    seconds = float(text.split("elapsed time per iteration (s):")[1].split("|")[0])
    assert sample.step_time_s == seconds
