"""Property-based tests (hypothesis) for every decoder and parser.

The contract checked everywhere: whatever text, bytes or JSON reaches a parser, it
either returns a value of its documented type or raises its documented error.
Any other exception escapes a producer's or consumer's loop as a crash, so it is
a bug even when the input is absurd.

Runs are derandomized and keep no example database: a unit run must fail or pass
the same way on every machine. Exploration with fresh randomness is bench/fuzz.py's
job (atheris). Inputs that are known to break a contract today are listed once, at
the end (`KNOWN_CONTRACT_BREAKS`), so each bug has one named, deterministic test.
"""

from __future__ import annotations

import contextlib
import math
import re
import string
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta, timezone
from typing import Annotated, Any, Literal, NoReturn, Union, get_args, get_origin

import orjson
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from producers.gpu_dcgm import DCGM_FIELDS, ScrapeError, parse_exposition
from producers.gpu_nvml import decode_throttle_reasons
from producers.ingest import _BadRequest, parse_nvrx, parse_nvsentinel, parse_timestamp
from producers.jobdiscovery import parse_scontrol_job
from producers.joblogs import split_rank_prefix
from producers.kernel import KernelStreamProducer, journal_message, kmsg_message, parse_kernel_line, to_event
from producers.progress import ProgressParser
from producers.slurm import (
    HostlistError,
    SlurmCommandError,
    _load_document,
    expand_hostlist,
    parse_sinfo,
    parse_squeue,
)
from producers.tracebacks import HEADER, TracebackGrouper
from schemas.codec import DecodeError, decode, encode
from schemas.events import (
    EVENT_TYPES,
    MAX_EVENT_TIME,
    Event,
    KernelEvent,
    LogBatch,
    LogLine,
    ProgressBatch,
    ProgressSample,
)
from schemas.topics import ALL_TOPICS
from schemas.vocab import ACTIONS, CATEGORIES, MODES
from sinks.audit_queries import parse_since
from sinks.backends.slurm_cli import parse_scontrol_line
from sinks.guardrails import GuardrailConfigError, GuardrailSettings, parse_guardrails
from streams.catalog import Signature
from streams.detectors.signatures import SignatureDetector
from streams.detectors.xid import XidDetector
from streams.policy import PolicyError, parse_policy

# derandomize + no database: deterministic in CI and nothing written next to the repo.
PROPS = settings(
    deadline=None,
    derandomize=True,
    database=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def props(max_examples: int) -> settings:
    return settings(PROPS, max_examples=max_examples)


# --- shared strategies -------------------------------------------------------------------------

# orjson refuses integers outside (-2**63, 2**64): the wire carries no more than that.
I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
JSON_SCALARS: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
JSON: st.SearchStrategy[Any] = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
# What Python's json module can hand a parser: also integers of any size.
PY_JSON: st.SearchStrategy[Any] = st.recursive(
    JSON_SCALARS | st.integers(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
# Event times the schema accepts (it bounds them; 2e9 s is in 2033).
EVENT_TIME = st.floats(min_value=0, max_value=2e9)
# Log lines never contain a newline: the follower splits on it.
LINE_TEXT = st.text(st.characters(blacklist_characters="\n", blacklist_categories=["Cs"]), max_size=120)


def templated(templates: Sequence[str], fill: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """Lines shaped like a real format ("§" marks a slot): random text rarely reaches the
    deeper branches of a parser, a template with odd values in its slots does."""

    def fill_in(template: str) -> st.SearchStrategy[str]:
        pieces = template.split("§")
        return st.lists(fill, min_size=len(pieces) - 1, max_size=len(pieces) - 1).map(
            lambda values: pieces[0] + "".join(v + p for v, p in zip(values, pieces[1:], strict=True))
        )

    return st.sampled_from(list(templates)).flatmap(fill_in)


NUMBER_TEXT: st.SearchStrategy[str] = st.one_of(
    st.integers(min_value=0, max_value=10**6).map(str),
    st.floats().map(repr),
    st.sampled_from(["nan", "NAN", "nan.0", "-inf", "+inf", "inf", "4,567", "1e-320", "5e-324", "1e400", "-1", ""]),
    st.text(alphabet="0123456789.,-+eE", max_size=8),
)


# --- a hypothesis strategy for any event model, from its pydantic fields ----------------------


def _bounds(metadata: Sequence[object]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, FieldInfo):
            out.update(_bounds(item.metadata))
            continue
        for attr in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern"):
            value = getattr(item, attr, None)
            if value is not None:
                out[attr] = value
    return out


def value_strategy(annotation: Any, metadata: Sequence[object] = ()) -> st.SearchStrategy[Any]:
    """Valid values of one field. Floats are finite: the non-finite case is its own test."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return value_strategy(args[0], [*metadata, *args[1:]])
    if origin is Literal:
        return st.sampled_from(args)
    if origin is Union or origin is types.UnionType:
        return st.one_of(*(value_strategy(a, metadata) for a in args))
    b = _bounds(metadata)
    if origin is list:
        return st.lists(
            value_strategy(args[0]), min_size=b.get("min_length", 0), max_size=max(3, b.get("min_length", 0))
        )
    if origin is dict:
        return st.dictionaries(value_strategy(args[0]), value_strategy(args[1]), max_size=3)
    if annotation is type(None):
        return st.none()
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        low = b["gt"] + 1 if "gt" in b else b.get("ge", -(2**63))
        return st.integers(min_value=low, max_value=b.get("le", 2**63 - 1))
    if annotation is float:
        return st.floats(
            min_value=b.get("ge", b.get("gt")),
            max_value=b.get("le", b.get("lt")),
            exclude_min="gt" in b,
            exclude_max="lt" in b,
            allow_nan=False,
            allow_infinity=False,
        )
    if annotation is str:
        if "pattern" in b:
            return st.from_regex(b["pattern"], fullmatch=True)
        low = b.get("min_length", 0)
        return st.text(min_size=low, max_size=max(low, min(b.get("max_length", 16), 16)))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_strategy(annotation)
    raise TypeError(f"no strategy for field type {annotation!r}: extend value_strategy")


def model_strategy(model: type[BaseModel]) -> st.SearchStrategy[Any]:
    fields = {name: value_strategy(f.annotation, f.metadata) for name, f in model.model_fields.items()}
    return st.builds(model, **fields)


def _type_id(event_type: type[Event]) -> str:
    return event_type.type_name


def test_event_types_are_the_topics_types() -> None:
    # The codec properties below walk EVENT_TYPES; that must be every type a topic carries.
    assert {t.event_type for t in ALL_TOPICS} == set(EVENT_TYPES)


# --- schemas/codec.py ----------------------------------------------------------------------------


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=_type_id)
@props(25)
@given(payload=st.binary(max_size=200) | st.text(max_size=200) | JSON.map(orjson.dumps))
def test_decode_arbitrary_payload_decodes_or_raises_decode_error(event_type: type[Event], payload: bytes | str) -> None:
    try:
        event = decode(event_type, payload)
    except DecodeError as exc:
        assert exc.event_type == event_type.type_name and exc.field
        return
    assert isinstance(event, event_type)


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=_type_id)
@props(25)
@given(data=st.data())
def test_decode_mutated_valid_event_decodes_or_raises_decode_error(
    event_type: type[Event], data: st.DataObject
) -> None:
    # One field of a valid event replaced, dropped or added: the realistic malformed payload.
    doc = orjson.loads(encode(data.draw(model_strategy(event_type))))
    key = data.draw(st.sampled_from(sorted(doc)) | st.text(max_size=8))
    how = data.draw(st.sampled_from(["replace", "drop"]))
    if how == "drop":
        doc.pop(key, None)
    else:
        doc[key] = data.draw(JSON)
    try:
        event = decode(event_type, orjson.dumps(doc))
    except DecodeError as exc:
        assert exc.field
        return
    # What decodes must encode again: a consumer re-publishes what it accepted.
    assert decode(event_type, encode(event)) == event


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=_type_id)
@props(30)
@given(data=st.data())
def test_encode_decode_round_trip(event_type: type[Event], data: st.DataObject) -> None:
    event = data.draw(model_strategy(event_type))
    wire = encode(event)
    back = decode(event_type, wire)
    assert back == event
    assert encode(back) == wire


@pytest.mark.parametrize(("loss", "grad_norm"), [(math.nan, 1.0), (math.inf, math.nan), (-math.inf, math.inf)])
def test_non_finite_loss_survives_the_wire(loss: float, grad_norm: float) -> None:
    # ProgressSample keeps NaN/inf because a diverged loss is a signal; orjson alone writes
    # them as null, which a consumer would read as "no loss reported".
    batch = ProgressBatch(
        event_id="p",
        event_time=1.0,
        job_id="1",
        samples=[ProgressSample(ts=1.0, loss=loss, grad_norm=grad_norm, format="megatron")],
    )
    (sample,) = decode(ProgressBatch, encode(batch)).samples
    for sent, got in ((loss, sample.loss), (grad_norm, sample.grad_norm)):
        assert got is not None
        assert math.isnan(got) if math.isnan(sent) else got == sent


# --- producers/kernel.py -------------------------------------------------------------------------

NODE = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,15}", fullmatch=True)
KERNEL_TEXT = st.one_of(
    LINE_TEXT,
    templated(
        [
            "NVRM: Xid (PCI:§): §, pid=§, name=§, §",
            "§ kernel: NVRM: Xid (PCI:0000:§:00): §, §",
            "nvidia-nvswitch§: SXid (PCI:§): §, §",
            "NVRM: GPU at PCI:§: GPU has fallen off the bus.",
            "Mar  3 12:00:00 § kernel: [ 1.0] NVRM: §",
        ],
        st.one_of(NUMBER_TEXT, LINE_TEXT, st.sampled_from(["0000:3b:00", "'<unknown>'", "\u00b2", "python"])),
    ),
)


def _publishable(event: Event) -> None:
    """A parser's output must survive the producer's encode and the consumer's decode."""
    assert decode(type(event), encode(event)) == event


@props(300)
@given(line=KERNEL_TEXT, default_node=NODE)
def test_parse_kernel_line_never_raises(line: str, default_node: str) -> None:
    parsed = parse_kernel_line(line, default_node)
    if parsed is None:
        return
    assert parsed.kind in ("xid", "sxid", "fallen_off_bus", "other")
    assert parsed.text == line.strip()


@props(100)
@given(
    syslog=st.booleans(),
    node=NODE,
    bus=st.integers(min_value=0, max_value=255),
    code=st.integers(min_value=0, max_value=2**31 - 1),
    pid=st.integers(min_value=0, max_value=2**22) | st.just("'<unknown>'"),
    name=st.from_regex(r"[A-Za-z0-9_.<>-]{1,15}", fullmatch=True),
    tail=LINE_TEXT,
)
def test_xid_line_parses_back_to_its_values(
    syslog: bool, node: str, bus: int, code: int, pid: int | str, name: str, tail: str
) -> None:
    prefix = f"Mar  3 12:00:00 {node} kernel: " if syslog else "[  219.470994] "
    line = f"{prefix}NVRM: Xid (PCI:0000:{bus:02x}:00): {code}, pid={pid}, name={name}, {tail}"
    parsed = parse_kernel_line(line, "default-node")
    assert parsed is not None
    assert (parsed.kind, parsed.xid, parsed.pci_bus_id) == ("xid", code, f"0000:{bus:02x}:00")
    assert parsed.node == (node if syslog else "default-node")
    assert parsed.pid == (pid if isinstance(pid, int) else None)
    assert parsed.process_name == name
    _publishable(to_event(parsed, 1.0))


@props(50)
@given(bus=st.integers(min_value=0, max_value=255), code=st.integers(min_value=0, max_value=2**31 - 1))
def test_sxid_and_fallen_off_bus_lines_parse_back(bus: int, code: int) -> None:
    sxid = parse_kernel_line(f"nvidia-nvswitch3: SXid (PCI:0000:{bus:02x}:00.0): {code}, Non-fatal", "n")
    assert sxid is not None and (sxid.kind, sxid.xid, sxid.pci_bus_id) == ("sxid", code, f"0000:{bus:02x}:00.0")
    fallen = parse_kernel_line(f"NVRM: GPU at PCI:0000:{bus:02x}:00: GPU has fallen off the bus.", "n")
    assert fallen is not None and (fallen.kind, fallen.pci_bus_id) == ("fallen_off_bus", f"0000:{bus:02x}:00")


@props(200)
@given(line=KERNEL_TEXT, default_node=NODE)
def test_parsed_kernel_lines_are_publishable(line: str, default_node: str) -> None:
    parsed = parse_kernel_line(line, default_node)
    if parsed is not None:
        _publishable(to_event(parsed, 1.0))


@props(100)
@given(record=st.text(max_size=200))
def test_kmsg_message_never_raises(record: str) -> None:
    assert isinstance(kmsg_message(record), str)


@props(100)
@given(
    fields=st.lists(st.integers(min_value=0, max_value=2**40).map(str), min_size=3, max_size=5),
    message=st.text(st.characters(blacklist_characters="\n", blacklist_categories=["Cs"]), max_size=80),
)
def test_kmsg_record_gives_its_message(fields: list[str], message: str) -> None:
    assert kmsg_message(",".join([*fields, "-"]) + ";" + message + "\n") == message


JOURNAL = st.one_of(
    st.text(max_size=100),
    JSON.map(lambda v: orjson.dumps(v).decode()),
    st.fixed_dictionaries({"MESSAGE": JSON}, optional={"_HOSTNAME": JSON}).map(lambda v: orjson.dumps(v).decode()),
)


@props(200)
@given(line=JOURNAL)
def test_journal_message_never_raises(line: str) -> None:
    # Documented: None when the line is not an entry; a non-UTF-8 message arrives as a byte list.
    result = journal_message(line)
    if result is not None:
        message, host = result
        assert isinstance(message, str) and (host is None or isinstance(host, str))


@props(100)
@given(message=st.text(max_size=80), host=st.text(max_size=20) | st.none())
def test_journal_entry_gives_message_and_host(message: str, host: str | None) -> None:
    entry: dict[str, Any] = {"MESSAGE": message}
    if host is not None:
        entry["_HOSTNAME"] = host
    assert journal_message(orjson.dumps(entry).decode()) == (message, host)
    raw = list(message.encode())
    assert journal_message(orjson.dumps({"MESSAGE": raw}).decode()) == (message, None)


# --- producers/joblogs.py ------------------------------------------------------------------------

RANK = st.integers(min_value=0, max_value=999_999)
_TORCHRUN_HEAD = re.compile(r"\[(?:rank|default)\d")


@props(300)
@given(line=LINE_TEXT | templated(["§: §", "[rank§]:§", "§: [default§]: §", " §: §"], NUMBER_TEXT | LINE_TEXT))
def test_split_rank_prefix_never_raises_and_keeps_a_suffix(line: str) -> None:
    r = split_rank_prefix(line)
    assert line.endswith(r.text)
    # Stripped: a rank prefix, or pdsh's "host: " (the host kept as the writer).
    pdsh = r.writer is not None and line.startswith(f"{r.writer}: ")
    assert (r.rank is None and not pdsh) == (r.text == line)
    assert r.rank is None or r.rank >= 0


@props(150)
@given(rank=RANK, text=LINE_TEXT, indent=st.sampled_from(["", " ", "  "]))
def test_srun_label_gives_the_rank(rank: int, text: str, indent: str) -> None:
    # A torchrun prefix right after the label is the innermost rank: tested below.
    assume(not _TORCHRUN_HEAD.match(text))
    r = split_rank_prefix(f"{indent}{rank}: {text}")
    assert (r.rank, r.text) == (rank, text)


@props(150)
@given(rank=RANK, text=LINE_TEXT, kind=st.sampled_from(["rank", "default"]))
def test_torchrun_prefix_gives_the_rank(rank: int, text: str, kind: str) -> None:
    assume(not re.search(r"Rank \d", text))  # a c10d "[Rank N]" inside the text names a rank of its own
    r = split_rank_prefix(f"[{kind}{rank}]:{text}")
    # The prefix swallows one whitespace character after the colon, no more.
    expected = text[1:] if re.match(r"\s", text) else text
    # "[rankN]:" is the global rank; "[defaultN]:" (torchrun --tee) the local rank, i.e. the GPU.
    assert (r.rank, r.gpu if kind == "default" else None, r.text) == (
        (rank, None, expected) if kind == "rank" else (None, rank, expected)
    )


@props(100)
@given(outer=RANK, inner=RANK, text=LINE_TEXT)
def test_torchrun_inside_srun_the_inner_rank_wins(outer: int, inner: int, text: str) -> None:
    r = split_rank_prefix(f"{outer}: [rank{inner}]: {text}")
    assert r.rank == inner and r.text == text


# --- producers/progress.py -----------------------------------------------------------------------

PROGRESS_TEMPLATES = [
    " iteration §/ § | consumed samples: § | elapsed time per iteration (ms): § | lm loss: § | grad norm: § |"
    " samples per second: § | actual seqlen: § |",
    " iteration §/ § | elapsed time per iteration (ms): § | § loss: § | loss scale: § |",
    " validation loss at iteration § | lm loss value: § |",
    "Training epoch 0, iteration §/§ | global_step: § | reduced_train_loss: § | train_step_timing in s: §",
    "Epoch §:  §%|##| §/§ [00:17<01:02, §s/it, loss=§, v_num=1]",
    "Epoch §: §%|##| §/§ [00:17<01:02, §it/s, global_step=§, train_step_timing in s=§]",
    "§%|###| §/§ [33:22<36:36,  §it/s]",
    "Validation DataLoader 0: §%|#| §/§ [00:01<00:00, §it/s]",
    "{'loss': §, 'grad_norm': §, 'learning_rate': 1e-05, 'epoch': 0.1, 'step': §}",
    "{'eval_loss': §, 'eval_runtime': §}",
    "step: §  loss: §  grad_norm: §  memory: 1GiB  tps: §  mfu: 1%",
    "steps: § loss: § iter time (s): § samples/sec: §",
    "[Rank 0] step=§, skipped=§, lr=[0.1]",
    "global_step=§, RunningAvgSamplesPerSec=§",
    "saving checkpoint at iteration § to /ckpt",
    "successfully saved checkpoint from iteration § to /ckpt",
    "Saving model checkpoint to /out/checkpoint-§",
    "[Torch] Checkpoint global_step§ is about to be saved!",
    "Saving the checkpoint at step §.",
    "§\r§%|#| §/§ [00:01<00:00, §it/s]\r",
]
PROGRESS_TEXT = st.one_of(LINE_TEXT, templated(PROGRESS_TEMPLATES, NUMBER_TEXT))
PARSER = ProgressParser()


def _finite_nonneg_or_none(value: float | None) -> bool:
    return value is None or (math.isfinite(value) and value >= 0)


@props(400)
@given(text=PROGRESS_TEXT, rank=st.none() | RANK)
def test_progress_parser_never_raises(text: str, rank: int | None) -> None:
    sample = PARSER.parse(text, 1.0, rank, "gpu01")
    if sample is not None:
        assert sample.rank == rank and sample.node == "gpu01"
        assert sample.step is None or sample.step >= 0


@props(400)
@given(text=PROGRESS_TEXT)
def test_progress_step_times_and_rates_are_finite(text: str) -> None:
    # Step time and tokens/s feed the hang and straggler detectors' medians: inf would poison them.
    sample = PARSER.parse(text, 1.0)
    if sample is not None:
        assert _finite_nonneg_or_none(sample.step_time_s), sample
        assert _finite_nonneg_or_none(sample.tokens_per_s), sample


@props(200)
@given(text=PROGRESS_TEXT)
def test_progress_samples_are_publishable(text: str) -> None:
    sample = PARSER.parse(text, 1.0, 0, "gpu01")
    if sample is None:
        return
    batch = ProgressBatch(event_id="p", event_time=1.0, job_id="1", samples=[sample])
    # NaN loss is compared separately (test_non_finite_loss_survives_the_wire): compare bytes here.
    assert encode(decode(ProgressBatch, encode(batch))) == encode(batch)


@props(100)
@given(
    step=st.integers(min_value=0, max_value=10**9),
    total=st.integers(min_value=1, max_value=10**9),
    ms=st.floats(min_value=0, max_value=1e7, allow_nan=False),
)
def test_megatron_line_parses_back(step: int, total: int, ms: float) -> None:
    s = PARSER.parse(f" iteration {step}/ {total} | elapsed time per iteration (ms): {ms!r} | lm loss: 1.5 |", 1.0)
    assert s is not None and s.format == "megatron" and s.step == step and s.loss == 1.5
    assert s.step_time_s == pytest.approx(ms / 1000.0)


CUSTOM_GROUPS = ["step", "step_time_s", "step_time_ms", "loss", "grad_norm", "tokens_per_s", "other"]


@props(150)
@given(
    patterns=st.lists(
        st.text(alphabet="()?P<>[]{}*+.\\|^$0123456789abc,-", max_size=20)
        | st.sampled_from(CUSTOM_GROUPS).map(lambda g: rf"{g}=(?P<{g}>\S+)"),
        max_size=3,
    ),
    text=PROGRESS_TEXT,
)
def test_custom_progress_patterns_are_accepted_or_refused_with_value_error(patterns: list[str], text: str) -> None:
    try:
        parser = ProgressParser(patterns)
    except ValueError:
        return
    sample = parser.parse(text, 1.0)
    if sample is not None:
        assert _finite_nonneg_or_none(sample.step_time_s)


# --- producers/tracebacks.py ---------------------------------------------------------------------

TRACEBACK_TEXT = st.one_of(
    st.sampled_from(
        [
            HEADER,
            '  File "train.py", line 42, in <module>',
            "    loss = model(batch)",
            "",
            "During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:",
            "ValueError: bad batch shape",
            "\tat frame",
        ]
    ),
    LINE_TEXT,
)
FEED = st.lists(
    st.tuples(st.sampled_from([None, 0, 1, 2]), TRACEBACK_TEXT, st.floats(min_value=0, max_value=3), st.booleans()),
    max_size=60,
)


def _expand(line: LogLine) -> list[str]:
    return line.context.split("\n") if line.context is not None else [line.text]


@props(300)
@given(feed=FEED, stale_after_s=st.floats(min_value=0, max_value=5))
def test_traceback_grouper_loses_and_duplicates_no_line(
    feed: list[tuple[int | None, str, float, bool]], stale_after_s: float
) -> None:
    # The API's promise: every line comes back, as itself or inside exactly one folded
    # line's context, and each rank's lines keep their order (ranks interleave freely).
    grouper = TracebackGrouper(stale_after_s=stale_after_s)
    now = 0.0
    out: list[LogLine] = []
    for lineno, (rank, text, dt, flush) in enumerate(feed, 1):
        now += dt
        out += grouper.feed(LogLine(text=text, ts=now, rank=rank, lineno=lineno), now)
        if flush:
            out += grouper.flush(now)
    out += grouper.flush(now, force=True)
    for rank in (None, 0, 1, 2):
        sent = [text for r, text, _, _ in feed if r == rank]
        got = [t for line in out if line.rank == rank for t in _expand(line)]
        assert got == sent
    for line in out:
        assert line.context is None or line.context.split("\n")[-1] == line.text


def test_traceback_grouper_gives_up_on_an_endless_block_without_losing_lines() -> None:
    grouper = TracebackGrouper()
    feed = [HEADER, *(f"  frame {i}" for i in range(450)), "RuntimeError: x"]
    out = [o for i, t in enumerate(feed) for o in grouper.feed(LogLine(text=t, ts=0, rank=0, lineno=i), 0.0)]
    out += grouper.flush(0.0, force=True)
    assert [t for line in out for t in _expand(line)] == feed


# --- producers/gpu_dcgm.py -----------------------------------------------------------------------

LABEL_VALUE = st.one_of(
    st.integers(min_value=0, max_value=16).map(str), st.sampled_from(["", "\u00b2", "gpu02", "x"]), st.text(max_size=8)
)
LABELS = st.dictionaries(
    st.sampled_from(["gpu", "Hostname", "UUID", "pci_bus_id", "device", "GPU_I_ID"]), LABEL_VALUE, max_size=4
)
EXPO_VALUE = st.one_of(
    NUMBER_TEXT,
    st.sampled_from(["NaN", "+Inf", "-Inf", "140737488355328", "1 1700000000000"]),
)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def exposition_line(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["series", "series", "raw", "comment"]))
    if kind == "raw":
        return draw(LINE_TEXT)
    if kind == "comment":
        return "# HELP " + draw(LINE_TEXT)
    name = draw(st.sampled_from(sorted(DCGM_FIELDS)) | st.text(alphabet=string.ascii_uppercase + "_", max_size=12))
    labels = draw(LABELS)
    label_text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
    body = draw(st.sampled_from([f"{{{label_text}}}", "{", "{}", '{gpu="0"', "{gpu=0}", ""]))
    return f"{name}{body} {draw(EXPO_VALUE)}"


EXPOSITION = st.lists(exposition_line(), max_size=12).map("\n".join) | st.text(max_size=200)


@props(300)
@given(text=EXPOSITION)
def test_parse_exposition_parses_or_raises_scrape_error(text: str) -> None:
    try:
        by_node = parse_exposition(text, "default")
    except ScrapeError:
        return
    for gpus in by_node.values():
        assert [g.index for g in gpus] == sorted({g.index for g in gpus})


@props(100)
@given(
    gpus=st.dictionaries(
        st.integers(min_value=0, max_value=15),
        st.tuples(st.floats(min_value=0, max_value=120, allow_nan=False), st.integers(min_value=0, max_value=10**6)),
        min_size=1,
        max_size=8,
    ),
    host=st.none() | NODE,
)
def test_exposition_values_parse_back(gpus: dict[int, tuple[float, int]], host: str | None) -> None:
    hostname = f',Hostname="{host}"' if host else ""
    text = "\n".join(
        line
        for index, (temp, used) in gpus.items()
        for line in (
            f'DCGM_FI_DEV_GPU_TEMP{{gpu="{index}",UUID="GPU-{index}"{hostname}}} {temp!r}',
            f'DCGM_FI_DEV_FB_USED{{gpu="{index}",UUID="GPU-{index}"{hostname}}} {used}',
        )
    )
    by_node = parse_exposition(text, "default")
    metrics = {g.index: g for g in by_node[host or "default"]}
    assert set(metrics) == set(gpus)
    for index, (temp, used) in gpus.items():
        assert metrics[index].temperature_c == temp
        assert metrics[index].memory_used_bytes == used * 1024 * 1024
        assert metrics[index].uuid == f"GPU-{index}"


# --- producers/slurm.py --------------------------------------------------------------------------


@props(300)
@given(text=st.text(alphabet="abn0123456789[]-, ()", max_size=18) | st.none() | st.text(max_size=20))
def test_expand_hostlist_returns_names_or_raises_hostlist_error(text: str | None) -> None:
    try:
        names = expand_hostlist(text)
    except HostlistError:
        return
    assert all(isinstance(n, str) and n for n in names)


@props(150)
@given(
    prefix=st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True),
    suffix=st.from_regex(r"(-[a-z]{1,4})?", fullmatch=True),
    width=st.integers(min_value=1, max_value=4),
    ranges=st.lists(
        st.tuples(st.integers(min_value=0, max_value=9999), st.integers(min_value=0, max_value=40)),
        min_size=1,
        max_size=3,
    ),
)
def test_expand_hostlist_ranges(prefix: str, suffix: str, width: int, ranges: list[tuple[int, int]]) -> None:
    specs, expected = [], []
    for low, span in ranges:
        low_text = str(low).zfill(width)
        specs.append(low_text if span == 0 else f"{low_text}-{low + span}")
        # Slurm pads to the width of the range's lower bound as written.
        expected += [f"{prefix}{str(n).zfill(len(low_text))}{suffix}" for n in range(low, low + span + 1)]
    assert expand_hostlist(f"{prefix}[{','.join(specs)}]{suffix}") == expected


@props(100)
@given(names=st.lists(st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True), min_size=1, max_size=5))
def test_expand_hostlist_plain_names(names: list[str]) -> None:
    # A lone "none" is one of Slurm's placeholders for "no nodes".
    assume(names != ["none"])
    assert expand_hostlist(",".join(names)) == names


SQUEUE_ENTRY = st.fixed_dictionaries(
    {},
    optional={
        k: PY_JSON
        for k in (
            "job_id",
            "job_state",
            "restart_cnt",
            "submit_time",
            "start_time",
            "end_time",
            "suspend_time",
            "nodes",
            "partition",
            "state_reason",
            "exit_code",
        )
    },
)
SINFO_ENTRY = st.fixed_dictionaries(
    {}, optional={k: PY_JSON for k in ("name", "state", "state_flags", "reason", "reason_changed_at", "partitions")}
)


@props(200)
@given(doc=st.fixed_dictionaries({}, optional={"jobs": st.lists(SQUEUE_ENTRY | PY_JSON, max_size=4) | PY_JSON}))
def test_parse_squeue_parses_or_raises_slurm_command_error(doc: dict[str, Any]) -> None:
    try:
        jobs = parse_squeue(doc)
    except SlurmCommandError:
        return
    assert all(isinstance(j.state, str) and isinstance(j.restart_cnt, int) for j in jobs.values())


@props(200)
@given(doc=st.fixed_dictionaries({}, optional={"nodes": st.lists(SINFO_ENTRY | PY_JSON, max_size=4) | PY_JSON}))
def test_parse_sinfo_parses_or_raises_slurm_command_error(doc: dict[str, Any]) -> None:
    try:
        nodes = parse_sinfo(doc)
    except SlurmCommandError:
        return
    assert all(isinstance(n.state, str) for n in nodes.values())


@props(150)
@given(text=st.text(max_size=100) | PY_JSON.map(repr) | JSON.map(lambda v: orjson.dumps(v).decode()))
def test_load_document_parses_or_raises_slurm_command_error(text: str) -> None:
    # squeue/sinfo --json output goes through _load_document first; fetch() documents SlurmCommandError.
    with contextlib.suppress(SlurmCommandError):
        assert isinstance(_load_document(text, "squeue --json"), dict)


# --- producers/jobdiscovery.py and sinks/backends/slurm_cli.py: `scontrol show -o` lines --------

SCONTROL_KEY = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,10}", fullmatch=True)
SCONTROL_VALUE = st.text(alphabet=string.ascii_letters + string.digits + "()/:.,_-[]", max_size=12)


@pytest.mark.parametrize("parse", [parse_scontrol_job, parse_scontrol_line], ids=["jobdiscovery", "slurm_cli"])
@props(100)
@given(line=st.text(max_size=150))
def test_scontrol_parsers_never_raise(parse: Callable[[str], dict[str, str]], line: str) -> None:
    assert all(isinstance(v, str) for v in parse(line).values())


@pytest.mark.parametrize("parse", [parse_scontrol_job, parse_scontrol_line], ids=["jobdiscovery", "slurm_cli"])
@props(100)
@given(fields=st.dictionaries(SCONTROL_KEY, SCONTROL_VALUE, min_size=1, max_size=8))
def test_scontrol_fields_parse_back(parse: Callable[[str], dict[str, str]], fields: dict[str, str]) -> None:
    assert parse(" ".join(f"{k}={v}" for k, v in fields.items())) == fields


# --- producers/ingest.py -------------------------------------------------------------------------

_DAY_MINUS = timedelta(hours=23, minutes=59)
TIMESTAMP = st.one_of(
    PY_JSON,
    st.floats(),
    st.datetimes(timezones=st.none() | st.builds(timezone, st.timedeltas(-_DAY_MINUS, _DAY_MINUS))).map(
        lambda d: d.isoformat()
    ),
    st.fixed_dictionaries({"seconds": PY_JSON}, optional={"nanos": PY_JSON}),
)
NVSENTINEL_EVENT = st.fixed_dictionaries(
    {},
    optional={
        "checkName": st.text(max_size=10) | JSON,
        "nodeName": st.text(max_size=10) | JSON,
        "agent": JSON,
        "componentClass": JSON,
        "isFatal": JSON,
        "isHealthy": JSON,
        "message": JSON,
        "recommendedAction": st.integers(min_value=0, max_value=100) | JSON,
        "processingStrategy": st.sampled_from(["STORE_ONLY", "EXECUTE_REMEDIATION"]) | JSON,
        "errorCode": st.lists(st.text(max_size=5), max_size=3) | JSON,
        "entitiesImpacted": st.lists(
            st.fixed_dictionaries({"entityType": st.text(max_size=5), "entityValue": st.text(max_size=5)}), max_size=2
        )
        | JSON,
        "metadata": JSON,
        "generatedTimestamp": TIMESTAMP,
        "quarantineOverrides": st.fixed_dictionaries({}, optional={"force": JSON, "skip": JSON}) | JSON,
        "version": JSON,
    },
)
NVSENTINEL_BODY = st.one_of(
    NVSENTINEL_EVENT,
    st.fixed_dictionaries({"events": st.lists(NVSENTINEL_EVENT, max_size=3) | JSON}, optional={"version": JSON}),
    st.fixed_dictionaries(
        {"specversion": st.just("1.0") | JSON, "data": st.fixed_dictionaries({"healthEvent": NVSENTINEL_EVENT}) | JSON}
    ),
    JSON,
)
NVRX_REPORT = st.fixed_dictionaries(
    {},
    optional={
        "kind": st.sampled_from(["straggler", "fault"]) | JSON,
        "node": st.text(max_size=10) | JSON,
        "timestamp": TIMESTAMP,
        "job_id": st.from_regex(r"[0-9]{1,20}", fullmatch=True) | JSON,
        "rank": st.integers(min_value=-1, max_value=10**8) | JSON,
        "message": JSON,
        "scores": st.fixed_dictionaries(
            {},
            optional={
                "gpu_relative": st.floats(min_value=-1, max_value=2) | JSON,
                "gpu_individual": st.floats(min_value=0, max_value=1),
                "section_relative": st.dictionaries(
                    st.text(max_size=5), st.floats(min_value=0, max_value=1), max_size=2
                ),
                "section_individual": JSON,
            },
        )
        | JSON,
        "threshold": st.floats(min_value=-1, max_value=2) | JSON,
        "fault_type": st.from_regex(r"[a-z_]{1,10}", fullmatch=True) | JSON,
        "fatal": JSON,
    },
)
NVRX_BODY = st.one_of(NVRX_REPORT, st.fixed_dictionaries({"reports": st.lists(NVRX_REPORT, max_size=3) | JSON}), JSON)


def _body(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer beyond 64 bits: orjson cannot write it, so no client can send it
        return b"{}"


@pytest.mark.parametrize("parse", [parse_nvsentinel, parse_nvrx], ids=["nvsentinel", "nvrx"])
@props(100)
@given(body=st.binary(max_size=200))
def test_ingest_arbitrary_bytes_are_a_bad_request(parse: Callable[[bytes, float], list[Any]], body: bytes) -> None:
    try:
        events = parse(body, 1.0)
    except _BadRequest:
        return
    for event in events:
        _publishable(event)


@pytest.mark.parametrize(
    ("parse", "bodies"), [(parse_nvsentinel, NVSENTINEL_BODY), (parse_nvrx, NVRX_BODY)], ids=["nvsentinel", "nvrx"]
)
@props(250)
@given(data=st.data())
def test_ingest_json_bodies_give_events_or_a_bad_request(
    parse: Callable[[bytes, float], list[Any]], bodies: st.SearchStrategy[Any], data: st.DataObject
) -> None:
    try:
        events = parse(_body(data.draw(bodies)), 1.0)
    except _BadRequest as bad:
        assert bad.reason in ("invalid_json", "invalid_field") and bad.field
        return
    assert events
    for event in events:
        _publishable(event)


@props(300)
@given(value=TIMESTAMP)
def test_parse_timestamp_returns_seconds_or_raises_value_error(value: object) -> None:
    try:
        seconds = parse_timestamp(value)
    except ValueError:
        return
    assert isinstance(seconds, float) and math.isfinite(seconds)


@props(100)
@given(
    seconds=st.integers(min_value=0, max_value=int(MAX_EVENT_TIME) - 1),
    nanos=st.integers(min_value=0, max_value=999_999_999),
)
def test_parse_timestamp_forms_agree(seconds: int, nanos: int) -> None:
    # Times after 2200 are refused (schemas.events.MAX_EVENT_TIME), in every form.
    assert parse_timestamp(seconds) == float(seconds)
    assert parse_timestamp({"seconds": str(seconds), "nanos": nanos}) == seconds + nanos / 1e9


# --- sinks/audit_queries.py, producers/gpu_nvml.py -----------------------------------------------


@props(150)
@given(text=st.text(max_size=20) | templated(["§§", " §§ "], st.sampled_from(list("smhdwSMHDWx")) | NUMBER_TEXT))
def test_parse_since_returns_a_duration_or_raises_value_error(text: str) -> None:
    with contextlib.suppress(ValueError):
        assert parse_since(text) > timedelta(0)


@props(100)
@given(n=st.integers(min_value=1, max_value=10**6), unit=st.sampled_from(["s", "m", "h", "d", "w"]))
def test_parse_since_units(n: int, unit: str) -> None:
    factor = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[unit]
    assert parse_since(f"{n}{unit.upper()}") == timedelta(seconds=n * factor)


@props(200)
@given(mask=st.integers(min_value=-(2**70), max_value=2**70))
def test_decode_throttle_reasons_names_every_set_bit(mask: int) -> None:
    names = decode_throttle_reasons(mask)
    assert len(names) == (bin(mask).count("1") if mask >= 0 else 0)
    assert len(set(names)) == len(names)


# --- streams/detectors -------------------------------------------------------------------------

SIGNATURES = SignatureDetector()
XIDS = XidDetector()
LOG_TEXT = st.one_of(
    LINE_TEXT,
    templated(
        [
            "srun: error: Node failure on §",
            "§:§:§ [§] NCCL WARN NET/IB : Got async event : port error §",
            "RuntimeError: CUDA error: §",
            "torch.OutOfMemoryError: CUDA out of memory. §",
            "[rank§]:[E§] Watchdog caught collective operation timeout: §",
            "§ NCCL WARN § §",
        ],
        LINE_TEXT | NUMBER_TEXT | NODE,
    ),
)


@props(300)
@given(text=LOG_TEXT)
def test_signature_matcher_never_raises(text: str) -> None:
    hit = SIGNATURES.match_line(text)
    if hit is not None:
        sig, match = hit
        assert sig.pattern and match.re.pattern == sig.pattern


@props(100)
@given(
    lines=st.lists(
        st.builds(LogLine, text=LOG_TEXT, ts=EVENT_TIME, rank=st.none() | RANK, node=st.none() | NODE, lineno=RANK),
        max_size=5,
    )
)
def test_signature_detector_anomalies_are_publishable(lines: list[LogLine]) -> None:
    batch = LogBatch(event_id="l", event_time=1.0, job_id="1", source="/x/out", job_nodes=["gpu01"], lines=lines)
    for anomaly in SIGNATURES.detect(batch):
        _publishable(anomaly)


@props(300)
@given(
    event=st.builds(
        KernelEvent,
        event_id=st.just("k"),
        event_time=EVENT_TIME,
        node=NODE,
        kind=st.sampled_from(["xid", "sxid", "fallen_off_bus", "other"]),
        xid=st.none() | I64 | st.integers(min_value=0, max_value=200),
        gpu_index=st.none() | st.integers(min_value=0, max_value=16),
        text=LINE_TEXT,
    )
)
def test_xid_classifier_never_raises(event: KernelEvent) -> None:
    anomalies = XIDS.detect(event)
    assert len(anomalies) <= 1
    for anomaly in anomalies:
        assert anomaly.signature.startswith("xid_")
        _publishable(anomaly)


SIGNATURE_FIELDS = {
    "id": "x",
    "category": "oom",
    "severity": "error",
    "role": "root",
    "meaning": "m",
    "source": "s",
}


@props(150)
@given(pattern=st.text(alphabet="()?P<>[]{}*+.\\|^$0123456789abc,-", max_size=24))
def test_catalog_signature_pattern_validates_or_raises_validation_error(pattern: str) -> None:
    with contextlib.suppress(ValidationError):
        Signature.model_validate({**SIGNATURE_FIELDS, "pattern": pattern})


# --- streams/policy.py and sinks/guardrails.py -------------------------------------------------

YAMLISH = st.text(alphabet=" :-[]{}\n#&*!|>'\"abcmode0129._,?%@`\t", max_size=60)
POLICY_VALUE = st.one_of(
    JSON_SCALARS, st.sampled_from([*CATEGORIES, *ACTIONS, *MODES]), st.lists(st.sampled_from(CATEGORIES), max_size=2)
)
POLICY_DOC = st.fixed_dictionaries(
    {"actions": st.dictionaries(st.sampled_from(CATEGORIES) | st.text(max_size=5), st.sampled_from(ACTIONS) | JSON)},
    optional={
        "mode": st.sampled_from(MODES) | POLICY_VALUE,
        "version": POLICY_VALUE,
        "categories": st.dictionaries(st.sampled_from(CATEGORIES), POLICY_VALUE, max_size=2) | POLICY_VALUE,
        "partitions": st.dictionaries(st.text(max_size=5), st.fixed_dictionaries({}, optional={"mode": POLICY_VALUE}))
        | POLICY_VALUE,
        "rules": st.lists(
            st.fixed_dictionaries(
                {"name": st.text(max_size=8), "action": POLICY_VALUE},
                optional={
                    "match": st.dictionaries(st.sampled_from(["category", "min_severity", "partition"]), POLICY_VALUE)
                },
            ),
            max_size=2,
        ),
        "restart_budget": st.dictionaries(st.sampled_from(["max_restarts", "window_h", "stop"]), POLICY_VALUE)
        | POLICY_VALUE,
        "min_confidence": POLICY_VALUE,
        "guardrails": JSON,
        "readiness": st.dictionaries(st.sampled_from(["min_samples", "min_precision"]), POLICY_VALUE) | POLICY_VALUE,
    },
)
POLICY_TEXT = st.one_of(YAMLISH, st.text(max_size=60), POLICY_DOC.map(lambda d: yaml.safe_dump(d, allow_unicode=True)))


@props(300)
@given(text=POLICY_TEXT)
def test_parse_policy_gives_a_policy_or_a_policy_error(text: str) -> None:
    try:
        policy = parse_policy(text, "p.yaml")
    except PolicyError as exc:
        assert str(exc).startswith("p.yaml: ")
        return
    assert set(policy.actions) == set(CATEGORIES)


@props(100)
@given(
    # `unknown` may only map to none (streams.policy refuses anything else).
    actions=st.fixed_dictionaries({c: st.sampled_from(ACTIONS if c != "unknown" else ("none",)) for c in CATEGORIES}),
    mode=st.sampled_from(MODES),
)
def test_valid_policy_parses_back(actions: dict[str, str], mode: str) -> None:
    policy = parse_policy(yaml.safe_dump({"mode": mode, "actions": actions}))
    assert policy.mode == mode and dict(policy.actions) == actions


GUARDRAIL_KEYS = sorted(GuardrailSettings.model_fields)


@props(200)
@given(
    text=YAMLISH
    | st.fixed_dictionaries(
        {"guardrails": st.dictionaries(st.sampled_from(GUARDRAIL_KEYS) | st.text(max_size=4), POLICY_VALUE) | JSON}
    ).map(yaml.safe_dump)
)
def test_parse_guardrails_gives_settings_or_a_guardrail_config_error(text: str) -> None:
    # GuardrailFile reloads the policy file while the executor runs and only catches this error.
    with contextlib.suppress(GuardrailConfigError):
        assert isinstance(parse_guardrails(text, "p.yaml"), GuardrailSettings)


# --- inputs that break a contract today ------------------------------------------------------
#
# Each case names the function, the smallest input found, and the only exceptions the
# function documents. These fail until the function is fixed; the report that came with
# this file lists them for the lead.


@dataclass(frozen=True)
class ContractCase:
    id: str
    call: Callable[[], object]
    allowed: tuple[type[BaseException], ...] = ()


def _never() -> NoReturn:
    raise AssertionError("the line was expected to parse")


def _publish_kernel(line: str) -> object:
    parsed = parse_kernel_line(line, "n")
    assert parsed is not None
    return encode(to_event(parsed, 1.0))


def _publish_journald(message: str, host: str) -> object:
    sent: list[bytes] = []

    class _Publisher:
        def publish(self, topic: object, event: KernelEvent) -> None:
            sent.append(encode(event))

    KernelStreamProducer(_Publisher(), node="n").handle(message, host)  # type: ignore[arg-type]
    assert [orjson.loads(s)["node"] for s in sent] == ["n"]
    return sent


def _publish_progress(line: str) -> object:
    sample = PARSER.parse(line, 1.0)
    assert sample is not None
    return encode(ProgressBatch(event_id="p", event_time=1.0, job_id="1", samples=[sample]))


_DIGITS = "9" * (sys.get_int_max_str_digits() + 1)  # past CPython's int(str) limit: int() raises ValueError
_XID = "NVRM: Xid (PCI:0000:01:00): "

KNOWN_CONTRACT_BREAKS = [
    # producers/kernel.py parse_kernel_line: `pid_raw.isdigit()` is true for '²', int('²') is not.
    ContractCase("kernel-pid-superscript-digit", lambda: parse_kernel_line(_XID + "13, pid=\u00b2, name=x, ", "n")),
    ContractCase("kernel-xid-over-int-digit-limit", lambda: parse_kernel_line(_XID + _DIGITS + ", ", "n")),
    # ... and a 20-digit Xid parses but cannot be encoded: KernelLogProducer.poll_once dies in publish.
    ContractCase("kernel-xid-beyond-64-bit-unpublishable", lambda: _publish_kernel(_XID + "9" * 20 + ", ")),
    # ... and so did a syslog host name over KernelEvent's bound (found by bench/fuzz.py): the _SYSLOG
    # host group is unbounded; a host that is no Slurm node name (schemas.ids) is the default node now.
    ContractCase(
        "kernel-syslog-host-over-128-chars-unpublishable",
        lambda: _publish_kernel("Mar  3 12:00:00 " + "a" * 129 + " kernel: " + _XID + "79, "),
    ),
    # The same through journald: its _HOSTNAME becomes the node (also found by bench/fuzz.py),
    # unless it is no Slurm node name (schemas.ids): then the producer's own node.
    ContractCase("kernel-journald-host-not-a-node-name", lambda: _publish_journald(_XID + "79, ", "h" * 129)),
    # producers/kernel.py journal_message: documented "None when it is not an entry".
    ContractCase("journal-message-byte-over-255", lambda: journal_message('{"MESSAGE": [256]}')),
    ContractCase("journal-message-list-of-text", lambda: journal_message('{"MESSAGE": ["a"]}')),
    # producers/progress.py ProgressParser.parse: float * int overflows on a long seqlen.
    ContractCase(
        "progress-megatron-seqlen-overflow",
        lambda: PARSER.parse(
            " iteration 1/ 1 | elapsed time per iteration (ms): 1 | samples per second: 1.0 | actual seqlen: 1"
            + "0" * 400,
            1.0,
        ),
    ),
    ContractCase(
        "progress-megatron-iteration-over-int-digit-limit",
        lambda: PARSER.parse(f" iteration {_DIGITS}/ 1 | elapsed time per iteration (ms): 1 |", 1.0),
    ),
    ContractCase(
        "progress-step-beyond-64-bit-unpublishable",
        lambda: _publish_progress(" iteration " + "9" * 20 + "/ 1 | elapsed time per iteration (ms): 1 |"),
    ),
    # ProgressParser(custom_patterns) documents ValueError for a bad pattern.
    ContractCase(
        "progress-custom-pattern-repeat-overflow",
        lambda: ProgressParser(["(?P<step>a{4294967296})"]),
        (ValueError,),
    ),
    # producers/gpu_dcgm.py parse_exposition: int(-inf) and int('²') (str.isdigit accepts it).
    ContractCase(
        "dcgm-negative-infinity-in-int-field",
        lambda: parse_exposition('DCGM_FI_DEV_FB_USED{gpu="0"} -Inf\n', "n"),
        (ScrapeError,),
    ),
    ContractCase(
        "dcgm-superscript-gpu-label",
        lambda: parse_exposition('DCGM_FI_DEV_GPU_UTIL{gpu="\u00b2"} 1\n', "n"),
        (ScrapeError,),
    ),
    # producers/slurm.py: expand_hostlist documents HostlistError (its callers catch only that).
    ContractCase("hostlist-over-int-digit-limit", lambda: expand_hostlist(f"n[{_DIGITS}]"), (HostlistError,)),
    # parse_sinfo iterates state_flags / partitions without checking they are lists.
    ContractCase(
        "sinfo-state-flags-not-a-list",
        lambda: parse_sinfo({"nodes": [{"name": "a", "state_flags": 1}]}),
        (SlurmCommandError,),
    ),
    ContractCase(
        "sinfo-partitions-not-a-list",
        lambda: parse_sinfo({"nodes": [{"name": "a", "partitions": 1}]}),
        (SlurmCommandError,),
    ),
    # _load_document catches json.JSONDecodeError only.
    ContractCase(
        "slurm-json-int-over-digit-limit", lambda: _load_document(_DIGITS, "squeue --json"), (SlurmCommandError,)
    ),
    ContractCase(
        "slurm-json-deep-nesting", lambda: _load_document("[" * 100_000, "squeue --json"), (SlurmCommandError,)
    ),
    # producers/ingest.py parse_timestamp documents ValueError (float() of a huge int overflows).
    ContractCase("timestamp-huge-int", lambda: parse_timestamp(10**400), (ValueError,)),
    ContractCase("timestamp-huge-nanos", lambda: parse_timestamp({"seconds": 0, "nanos": 10**400}), (ValueError,)),
    # streams/policy.py parse_policy: PyYAML's SafeConstructor raises plain Python errors.
    ContractCase("policy-impossible-date", lambda: parse_policy("a: 2020-02-30"), (PolicyError,)),
    ContractCase("policy-bad-bool-tag", lambda: parse_policy("a: !!bool x"), (PolicyError,)),
    ContractCase("policy-bad-timestamp-tag", lambda: parse_policy("a: !!timestamp x"), (PolicyError,)),
    ContractCase("policy-bad-int-tag", lambda: parse_policy("a: !!int x"), (PolicyError,)),
    ContractCase("policy-deep-nesting", lambda: parse_policy("[" * 2000), (PolicyError,)),
    # sinks/guardrails.py parse_guardrails: same; GuardrailFile's reload then kills the executor.
    ContractCase("guardrails-impossible-date", lambda: parse_guardrails("a: 2020-02-30", "p"), (GuardrailConfigError,)),
    # sinks/audit_queries.py parse_since documents ValueError; timedelta overflows.
    ContractCase("since-overflow", lambda: parse_since("99999999999999w"), (ValueError,)),
    # streams/catalog Signature: the pattern validator lets re's OverflowError through pydantic.
    ContractCase(
        "catalog-pattern-repeat-overflow",
        lambda: Signature.model_validate({**SIGNATURE_FIELDS, "pattern": "a{4294967296}"}),
        (ValidationError,),
    ),
]


@pytest.mark.parametrize("case", KNOWN_CONTRACT_BREAKS, ids=lambda c: c.id)
def test_known_inputs_raise_only_documented_errors(case: ContractCase) -> None:
    with contextlib.suppress(*case.allowed):
        case.call()


def test_tqdm_rate_below_float_range_gives_a_finite_step_time() -> None:
    # 1.0 / 5e-324 is inf: the it/s branch skips the _nonneg check the other branches make.
    sample = PARSER.parse(" 5%|#| 1/20 [00:01<00:19, 5e-324it/s]", 1.0)
    assert sample is not None and _finite_nonneg_or_none(sample.step_time_s), sample


@pytest.mark.parametrize(
    "value",
    ["1960-01-01T00:00:00Z", "2300-01-01T00:00:00Z", {"seconds": int(MAX_EVENT_TIME), "nanos": 500_000_000}, -1, 9e9],
)
def test_parse_timestamp_refuses_times_outside_what_events_carry(value: object) -> None:
    # An NVSentinel event dated before 1970 or after 2200 must be a 400, not a HealthEvent
    # that fails validation after the request was accepted.
    with pytest.raises(ValueError):
        parse_timestamp(value)
