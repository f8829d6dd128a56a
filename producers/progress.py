"""Training-progress parsing: one log line (rank prefixes already stripped) -> ProgressSample.

Formats (real examples in tests/fixtures/progress/, sources in SOURCES.md there):

- ``megatron``: Megatron-LM / Megatron-DeepSpeed ``iteration N/ M | ... | elapsed time per
  iteration (ms): ... | lm loss: ... | grad norm: ... |`` and ``validation loss at iteration N``;
- ``nemo``: NeMo 2's progress printer ``Training epoch 0, iteration 120/149 | ... |
  global_step: 120 | reduced_train_loss: 1.233 | train_step_timing in s: 0.03146``;
- ``lightning``: PyTorch Lightning (and NeMo 1) tqdm bars ``Epoch 0:  22%|██| 4/18 [00:17<01:02,
  4.47s/it, loss=10.07, v_num=1]`` (the step is ``global_step`` when the bar shows it, else
  epoch x batches per epoch + batch), and ``Validation DataLoader 0:`` bars as ``eval``;
- ``hf``: HF Trainer ``{'loss': 2.1, 'grad_norm': 1.3, ...}`` lines and its bare tqdm bars
  ``47%|███| 7000/14754 [33:22<36:36,  3.53it/s]``;
- ``torchtitan``: ``step: 10  loss:  9.1234  grad_norm: ...  memory: ...  tps: 4,567  mfu: ...``;
- ``deepspeed``: pipeline engine ``steps: 100 loss: 2.3 iter time (s): 0.85 samples/sec: ...``,
  engine ``[Rank 0] step=40, skipped=2, ...`` and timer ``global_step=34, RunningAvgSamplesPerSec=``;
- ``custom``: user regexes with named groups (see `ProgressParser`).

Checkpoint saves come back as ``phase="checkpoint"`` samples whose ``format`` carries a marker,
``"<format>:checkpoint_start"`` or ``"<format>:checkpoint_end"`` (see `checkpoint_marker`), because
ProgressSample has no field for it yet. A hang detector pauses between the two; formats that
print no end line (HF, Lightning) are ended by the next training step.

A line carrying carriage returns (a tqdm bar redrawn in place, as the tailer reads it from a
file) is read as its last non-empty segment: the bar's latest state. The tailer should cut such
lines at ``\r`` as well, or tqdm-only progress reaches us once per 64 KiB of redraws.

Speed: every parser sits behind a plain substring test, so a line that is no progress report
costs a dozen ``in`` checks and no regex.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Literal

from schemas.events import ProgressSample

CHECKPOINT_START = "checkpoint_start"
CHECKPOINT_END = "checkpoint_end"
Phase = Literal["train", "checkpoint", "eval"]
CheckpointMarker = Literal["start", "end"]

MAX_BAR_CHARS = 4096
CUSTOM_GROUPS = frozenset({"step", "step_time_s", "step_time_ms", "loss", "grad_norm", "tokens_per_s"})
# Integers go on the wire as int64 (orjson refuses anything past 64 bits).
MAX_INT = 2**63 - 1


def checkpoint_marker(sample: ProgressSample) -> CheckpointMarker | None:
    """Whether a sample opens or closes a checkpoint save (None for other samples)."""
    if sample.phase != "checkpoint":
        return None
    return "end" if sample.format.endswith(CHECKPOINT_END) else "start"


def to_float(text: str) -> float | None:
    """A number as frameworks print it: '9.674668E+00', '4,567', 'nan', 'NAN', 'nan.0', '-inf'."""
    text = text.strip().rstrip(",|").replace(",", "")
    try:
        return float(text)
    except ValueError:
        low = text.lower()
        # Lightning/NeMo print a NaN metric as 'nan.0' (str(float) of a tensor item, then '.0').
        if low.startswith("nan"):
            return math.nan
        if low.startswith("inf") or low.startswith("+inf"):
            return math.inf
        if low.startswith("-inf"):
            return -math.inf
        return None


def _fit(value: int) -> int | None:
    # A count past int64 is garbage and could not be published: drop the field, keep the sample.
    return value if 0 <= value <= MAX_INT else None


def _to_int(digits: str | None) -> int | None:
    """A pattern's digit group -> int, None when it does not fit an int64. The length test
    comes first: int() refuses 4,300+ digits with a ValueError."""
    if digits is None or len(digits) > len(str(MAX_INT)):
        return None
    return _fit(int(digits))


def _to_step(text: str | None) -> int | None:
    if text is None:
        return None
    v = to_float(text)
    if v is None or not math.isfinite(v) or v < 0:
        return None
    return _fit(int(v))


def _nonneg(v: float | None) -> float | None:
    # Step times and rates must be >= 0 and finite to be usable (and to pass the schema).
    if v is None or not math.isfinite(v) or v < 0:
        return None
    return v


# --- checkpoint lines -------------------------------------------------------------------------

# (pattern, format, marker, where the step number is); the first match wins.
_STEP_ITERATION = re.compile(r"iteration\s+(\d+)")
_STEP_GLOBAL = re.compile(r"global_step(\d+)")
_STEP_HF_DIR = re.compile(r"checkpoint-(\d+)")
_STEP_LIGHTNING = re.compile(r"global step (\d+)")
_STEP_AT = re.compile(r"at step (\d+)")
_CHECKPOINT_RULES: tuple[tuple[re.Pattern[str], str, CheckpointMarker, re.Pattern[str] | None], ...] = (
    # Megatron-LM: 'saving checkpoint at iteration    2000 to /ckpt [in torch_dist format]'.
    (re.compile(r"saving checkpoint at iteration\s+\d+"), "megatron", "start", _STEP_ITERATION),
    # ... 'successfully saved checkpoint at iteration 400 to ...' (newer: 'from iteration').
    (re.compile(r"successfully saved checkpoint (?:at|from) iteration\s+\d+"), "megatron", "end", _STEP_ITERATION),
    # ... the '(min, max) time across ranks' row printed once the save is over.
    (re.compile(r"^\s*save-checkpoint \.+: \("), "megatron", "end", None),
    # DeepSpeed's checkpoint engine: create(), save() per file, commit().
    (re.compile(r"\[Torch\] Checkpoint \S+ is about to be saved!"), "deepspeed", "start", _STEP_GLOBAL),
    (re.compile(r"\[Torch\] Checkpoint \S+ is ready now!"), "deepspeed", "end", _STEP_GLOBAL),
    (re.compile(r"\[Torch\] Sav(?:ing|ed) "), "deepspeed", "start", _STEP_GLOBAL),
    (re.compile(r"Saving model checkpoint: "), "deepspeed", "start", _STEP_GLOBAL),
    (re.compile(r"zero checkpoint saved"), "deepspeed", "start", _STEP_GLOBAL),
    # HF Trainer._save_checkpoint and the save_pretrained messages that follow it.
    (re.compile(r"Saving model checkpoint to "), "hf", "start", _STEP_HF_DIR),
    (
        re.compile(r"(?:Configuration|Model weights|tokenizer config file|Special tokens file) saved in "),
        "hf",
        "start",
        _STEP_HF_DIR,
    ),
    (re.compile(r"Deleting older checkpoint"), "hf", "start", _STEP_HF_DIR),
    # Lightning ModelCheckpoint(verbose=True): logged just before it writes the file.
    (re.compile(r"saving model to .* as top \d+"), "lightning", "start", _STEP_LIGHTNING),
    # torchtitan CheckpointManager.save.
    (re.compile(r"Saving (?:the|a) checkpoint"), "torchtitan", "start", _STEP_AT),
    (re.compile(r"Finished saving the checkpoint"), "torchtitan", "end", None),
    # torch.distributed.checkpoint's method logger: {'func_name': 'save', ..., 'event': 'start'}.
    (re.compile(r"'func_name': '(?:async_)?save',.*'event': 'start'"), "dcp", "start", None),
    (re.compile(r"'func_name': '(?:async_)?save',.*'event': '(?:end|exception)'"), "dcp", "end", None),
)

# --- progress lines ---------------------------------------------------------------------------

_MEGATRON_ITER = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
# Megatron-LM prints milliseconds; Megatron-DeepSpeed (BLOOM's logs) prints seconds.
_MEGATRON_MS = re.compile(r"elapsed time per iteration \((ms|s)\):\s*([^\s|]+)")
_MEGATRON_LM_LOSS = re.compile(r"\blm[ _]loss:\s*([^\s|]+)")
_MEGATRON_ANY_LOSS = re.compile(r"\|\s*([A-Za-z_ ]*?loss):\s*([^\s|]+)")
_MEGATRON_GRAD = re.compile(r"grad norm:\s*([^\s|]+)")
_MEGATRON_SPS = re.compile(r"samples per second:\s*([^\s|]+)")
_MEGATRON_SEQLEN = re.compile(r"actual seqlen:\s*(\d+)")
_MEGATRON_VALID = re.compile(r"validation loss at iteration\s+(\d+)")
_MEGATRON_VALID_LOSS = re.compile(r"\blm[ _]loss value:\s*([^\s|]+)")

_NEMO_STEP = re.compile(r"global_step:\s*([^\s|]+)")
_NEMO_ITER = re.compile(r"iteration\s+(\d+)/")
_NEMO_LOSS = re.compile(r"reduced_train_loss:\s*([^\s|]+)")
_NEMO_TIME = re.compile(r"train_step_timing in s:\s*([^\s|]+)")

# tqdm bar: '[prefix: ]NN%|bar| n/total [elapsed<remaining, rate, key=value, ...]'.
_TQDM = re.compile(r"^\s*(?P<desc>[^|]*?)\s*(?P<pct>\d+)%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)\s*\[(?P<info>[^\]]*)\]")
_LIGHTNING_DESC = re.compile(r"^Epoch (\d+):[\s:]*$")
_LIGHTNING_EVAL_DESC = re.compile(r"^Validati(?:on|ng)\b")

_HF_PAIR = re.compile(r"'(\w+)':\s*([^,}]+)")

_TITAN = re.compile(r"\bstep:\s*(\d+)\s+loss:\s*(\S+)")
_TITAN_GRAD = re.compile(r"\bgrad_norm:\s*(\S+)")
_TITAN_TPS = re.compile(r"\btps:\s*([\d,.]+)")

_DS_PIPE = re.compile(r"\bsteps:\s*(\d+)\s+loss:\s*(\S+).*?\biter time \(s\):\s*(\S+)")
_DS_ENGINE = re.compile(r"\[Rank \d+\] step=(\d+), skipped=\d+")
_DS_TIMER = re.compile(r"\bglobal_step=(\d+), RunningAvgSamplesPerSec=")
_DS_TIMER_OLD = re.compile(r"\] \d+/(\d+), SamplesPerSec=")


class ProgressParser:
    """Parses one log line at a time; stateless, so one instance may serve every job.

    custom_patterns: regexes tried before the built-in formats, each with at least one of the
    named groups ``step``, ``step_time_s`` or ``step_time_ms``, ``loss``, ``grad_norm``,
    ``tokens_per_s``. A pattern with another named group, or none of these, is refused with a
    ValueError naming it, so that a typo fails at start rather than matching nothing.
    """

    def __init__(self, custom_patterns: Sequence[str] = ()) -> None:
        self._custom: list[re.Pattern[str]] = []
        for p in custom_patterns:
            try:
                rx = re.compile(p)
            # re also raises OverflowError (a{4294967296}) and RecursionError (deep nesting).
            except (re.error, OverflowError, RecursionError) as e:
                raise ValueError(f"progress pattern {p!r}: {e}") from e
            names = set(rx.groupindex)
            unknown = names - CUSTOM_GROUPS
            if unknown:
                raise ValueError(
                    f"progress pattern {p!r}: unknown group(s) {sorted(unknown)}; allowed: {sorted(CUSTOM_GROUPS)}"
                )
            if not names:
                raise ValueError(f"progress pattern {p!r}: needs a named group, one of {sorted(CUSTOM_GROUPS)}")
            self._custom.append(rx)
        self._parsers: tuple[Callable[[str, float, int | None, str | None], ProgressSample | None], ...] = (
            self._megatron,
            self._nemo,
            self._tqdm,
            self._hf_dict,
            self._torchtitan,
            self._deepspeed,
        )

    def parse(self, text: str, ts: float, rank: int | None = None, node: str | None = None) -> ProgressSample | None:
        if "\r" in text:
            # A tqdm bar rewrites itself with carriage returns; the last state is what counts.
            text = next((seg for seg in reversed(text.split("\r")) if seg.strip()), "")
        for rx in self._custom:
            m = rx.search(text)
            if m:
                return self._from_custom(m, ts, rank, node)
        if "heckpoint" in text or "saving model to" in text or "saved in" in text:
            hit = self._checkpoint(text, ts, rank, node)
            if hit is not None:
                return hit
        for parser in self._parsers:
            s = parser(text, ts, rank, node)
            if s is not None:
                return s
        return None

    # -- checkpoint --------------------------------------------------------------------------

    @staticmethod
    def _checkpoint(text: str, ts: float, rank: int | None, node: str | None) -> ProgressSample | None:
        for rx, fmt, marker, step_rx in _CHECKPOINT_RULES:
            if rx.search(text) is None:
                continue
            sm = step_rx.search(text) if step_rx is not None else None
            step = _to_int(sm.group(1)) if sm else None
            return ProgressSample(
                ts=ts,
                rank=rank,
                node=node,
                step=step,
                phase="checkpoint",
                format=f"{fmt}:{CHECKPOINT_START if marker == 'start' else CHECKPOINT_END}",
            )
        return None

    # -- formats -----------------------------------------------------------------------------

    @staticmethod
    def _megatron(text: str, ts: float, rank: int | None, node: str | None) -> ProgressSample | None:
        if "elapsed time per iteration" in text:
            m = _MEGATRON_ITER.search(text)
            if m is None:
                return None
            ms = _MEGATRON_MS.search(text)
            step_time = _nonneg(to_float(ms.group(2))) if ms else None
            if step_time is not None and ms is not None and ms.group(1) == "s":
                step_time *= 1000.0
            loss: float | None = None
            lm = _MEGATRON_LM_LOSS.search(text)
            if lm:
                loss = to_float(lm.group(1))
            else:
                for name, value in _MEGATRON_ANY_LOSS.findall(text):
                    if "scale" not in name:
                        loss = to_float(value)
                        break
            g = _MEGATRON_GRAD.search(text)
            tokens: float | None = None
            sps, seqlen_m = _MEGATRON_SPS.search(text), _MEGATRON_SEQLEN.search(text)
            seqlen = _to_int(seqlen_m.group(1)) if seqlen_m else None
            if sps and seqlen is not None:
                rate = to_float(sps.group(1))
                # float * int64 cannot overflow (it may give inf, which _nonneg drops).
                tokens = _nonneg(rate * seqlen) if rate is not None else None
            return ProgressSample(
                ts=ts,
                rank=rank,
                node=node,
                step=_to_int(m.group(1)),
                step_time_s=step_time / 1000.0 if step_time is not None else None,
                loss=loss,
                grad_norm=to_float(g.group(1)) if g else None,
                tokens_per_s=tokens,
                format="megatron",
            )
        if "validation loss at iteration" in text:
            v = _MEGATRON_VALID.search(text)
            if v is None:
                return None
            vl = _MEGATRON_VALID_LOSS.search(text)
            return ProgressSample(
                ts=ts,
                rank=rank,
                node=node,
                step=_to_int(v.group(1)),
                loss=to_float(vl.group(1)) if vl else None,
                phase="eval",
                format="megatron",
            )
        return None

    @staticmethod
    def _nemo(text: str, ts: float, rank: int | None, node: str | None) -> ProgressSample | None:
        if "train_step_timing in s:" not in text and "reduced_train_loss:" not in text:
            return None
        gs = _NEMO_STEP.search(text)
        it = _NEMO_ITER.search(text)
        step = _to_step(gs.group(1)) if gs else (_to_int(it.group(1)) if it else None)
        if step is None:
            return None
        loss = _NEMO_LOSS.search(text)
        t = _NEMO_TIME.search(text)
        return ProgressSample(
            ts=ts,
            rank=rank,
            node=node,
            step=step,
            step_time_s=_nonneg(to_float(t.group(1))) if t else None,
            loss=to_float(loss.group(1)) if loss else None,
            format="nemo",
        )

    @staticmethod
    def _tqdm(text: str, ts: float, rank: int | None, node: str | None) -> ProgressSample | None:
        # Bars are short; the bound keeps the lazy description match linear on pathological lines.
        if "%|" not in text or len(text) > MAX_BAR_CHARS:
            return None
        m = _TQDM.match(text)
        if m is None:
            return None
        desc = m.group("desc")
        lightning = False
        epoch: int | None = None
        if desc:
            e = _LIGHTNING_DESC.match(desc)
            if e is None:
                if _LIGHTNING_EVAL_DESC.match(desc):
                    # 'Validation DataLoader 0:', 'Validating:': the job is alive, evaluating.
                    return ProgressSample(ts=ts, rank=rank, node=node, phase="eval", format="lightning")
                # 'Map:', 'Loading checkpoint shards:', 'Training:' (before the first step): not steps.
                return None
            lightning = True
            epoch = _to_int(e.group(1))
        n, total = _to_int(m.group("n")), _to_int(m.group("total"))
        step_time: float | None = None
        postfix: dict[str, str] = {}
        for item in m.group("info").split(", ")[1:]:
            item = item.strip()
            if "=" in item:
                k, _, v = item.partition("=")
                postfix[k.strip()] = v
            elif item.endswith("s/it"):
                step_time = _nonneg(to_float(item[:-4]))
            elif item.endswith("it/s"):
                rate = to_float(item[:-4])
                # 1.0 / 5e-324 is inf: the quotient needs the same check as a printed time.
                step_time = _nonneg(1.0 / rate) if rate and math.isfinite(rate) and rate > 0 else None
        if "train_step_timing in s" in postfix:
            step_time = _nonneg(to_float(postfix["train_step_timing in s"]))
        if not lightning:
            step: int | None = n
        elif "global_step" in postfix:
            step = _to_step(postfix["global_step"])
        elif epoch is None or n is None or total is None:
            step = None
        else:
            # Lightning's bar counts batches within the epoch; epoch * batches + n keeps it monotonic.
            step = _fit(epoch * total + n) if total else n
        loss: float | None = None
        for key in ("reduced_train_loss", "train_loss", "train_loss_step", "loss"):
            if key in postfix:
                loss = to_float(postfix[key])
                break
        return ProgressSample(
            ts=ts,
            rank=rank,
            node=node,
            step=step,
            step_time_s=step_time,
            loss=loss,
            grad_norm=to_float(postfix["grad_norm"]) if "grad_norm" in postfix else None,
            format="lightning" if lightning else "hf",
        )

    @staticmethod
    def _hf_dict(text: str, ts: float, rank: int | None, node: str | None) -> ProgressSample | None:
        start = text.find("{'")
        if start < 0 or "loss'" not in text:
            return None
        values = {k: v for k, v in _HF_PAIR.findall(text, start)}
        if "loss" in values:
            loss, phase = to_float(values["loss"]), "train"
        elif "eval_loss" in values:
            loss, phase = to_float(values["eval_loss"]), "eval"
        else:
            return None
        if loss is None:
            return None  # a dict that merely names a loss ('loss': 'ce'), not a log record
        step = _to_step(values["step"]) if "step" in values else None
        return ProgressSample(
            ts=ts,
            rank=rank,
            node=node,
            step=step,
            loss=loss,
            grad_norm=to_float(values["grad_norm"]) if "grad_norm" in values else None,
            phase="eval" if phase == "eval" else "train",
            format="hf",
        )

    @staticmethod
    def _torchtitan(text: str, ts: float, rank: int | None, node: str | None) -> ProgressSample | None:
        if "step:" not in text or "loss:" not in text:
            return None
        m = _TITAN.search(text)
        if m is None:
            return None
        g = _TITAN_GRAD.search(text)
        tps = _TITAN_TPS.search(text)
        return ProgressSample(
            ts=ts,
            rank=rank,
            node=node,
            step=_to_int(m.group(1)),
            loss=to_float(m.group(2)),
            grad_norm=to_float(g.group(1)) if g else None,
            tokens_per_s=_nonneg(to_float(tps.group(1))) if tps else None,
            format="torchtitan",
        )

    @staticmethod
    def _deepspeed(text: str, ts: float, rank: int | None, node: str | None) -> ProgressSample | None:
        if "iter time (s)" in text:
            m = _DS_PIPE.search(text)
            if m is None:
                return None
            return ProgressSample(
                ts=ts,
                rank=rank,
                node=node,
                step=_to_int(m.group(1)),
                loss=to_float(m.group(2)),
                step_time_s=_nonneg(to_float(m.group(3))),
                format="deepspeed",
            )
        if "skipped=" in text:
            m = _DS_ENGINE.search(text)
        elif "SamplesPerSec=" in text:
            m = _DS_TIMER.search(text) or _DS_TIMER_OLD.search(text)
        else:
            return None
        if m is None:
            return None
        return ProgressSample(ts=ts, rank=rank, node=node, step=_to_int(m.group(1)), format="deepspeed")

    # -- custom ------------------------------------------------------------------------------

    @staticmethod
    def _from_custom(m: re.Match[str], ts: float, rank: int | None, node: str | None) -> ProgressSample | None:
        g = m.groupdict()
        step_time = _nonneg(to_float(g["step_time_s"])) if g.get("step_time_s") else None
        if step_time is None and g.get("step_time_ms"):
            ms = _nonneg(to_float(g["step_time_ms"]))
            step_time = ms / 1000.0 if ms is not None else None
        return ProgressSample(
            ts=ts,
            rank=rank,
            node=node,
            step=_to_step(g.get("step")),
            step_time_s=step_time,
            loss=to_float(g["loss"]) if g.get("loss") else None,
            grad_norm=to_float(g["grad_norm"]) if g.get("grad_norm") else None,
            tokens_per_s=_nonneg(to_float(g["tokens_per_s"])) if g.get("tokens_per_s") else None,
            format="custom",
        )
