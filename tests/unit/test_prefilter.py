"""The literal prefilter in front of the signature catalog skips a line only when the pattern
cannot match it (streams/detectors/prefilter.py): checked on text generated from each pattern,
on the fixture logs and the corpus's dev split, and on hand-made cases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streams.catalog import default_signatures
from streams.detectors.prefilter import may_match, required
from streams.detectors.signatures import SignatureDetector

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SIGNATURES = default_signatures()


def _accepts(pattern: str, text: str) -> bool:
    test = may_match(pattern)
    return test is None or test(text)


@pytest.mark.parametrize("sig", SIGNATURES, ids=lambda s: s.id)
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_no_text_a_catalog_pattern_matches_is_skipped(sig: object, data: st.DataObject) -> None:
    pattern = sig.pattern  # type: ignore[attr-defined]
    text = data.draw(st.from_regex(pattern, fullmatch=False))
    if re.search(pattern, text):
        assert _accepts(pattern, text), (pattern, text)


def test_every_fixture_and_dev_corpus_line_finds_the_same_signature_with_and_without_it() -> None:
    det = SignatureDetector()
    plain = [(c.sig, c.regex) for c in det._compiled]
    files = [p for p in (FIXTURES / "logs").rglob("*") if p.is_file()]
    files += [p for p in (FIXTURES / "corpus" / "dev").rglob("*") if p.is_file()]
    lines = [line for p in files for line in p.read_text(errors="replace").splitlines()]
    assert len(lines) > 1000
    matched = 0
    for line in lines:
        expected = next((sig.id for sig, rx in plain if rx.search(line)), None)
        hit = det.match_line(line)
        assert (hit[0].id if hit else None) == expected, line
        matched += expected is not None
    assert matched > 50  # the check saw real hits, not only misses


@pytest.mark.parametrize(
    ("pattern", "text", "accepted"),
    [
        (r"(?:(?P<node>\w+): )?NCCL WARN NET/IB", "gpu01: NCCL WARN NET/IB", True),
        (r"(?:(?P<node>\w+): )?NCCL WARN NET/IB", "step 10 loss 2.1", False),
        (r"(?:abc)?xyz|\bfoo", "foo", True),  # either branch
        (r"(?:abc)?xyz|\bfoo", "xy fo", False),
        (r"\s*(?:abc)*def", "def", True),  # a repeat that may match zero times needs nothing
        (r"\bx(?=lookahead)", "xlookahead", True),
        (r"\bx(?=lookahead)", "x look", False),
        (r"\b(?!never)value", "value", True),  # a negative look-ahead adds no need
        (r"(?i)\bloss is nan", "LOSS IS NAN", True),
        (r"(?i)\bloss is nan", "loss is fine", False),
        (r"(?i)\bſtop", "STOP", True),  # the long s folds to s: a non-ASCII literal needs nothing
        (r"(?i)\bKELVIN", "\u212aelvin", True),  # the Kelvin sign folds to k: a non-ASCII line is searched
    ],
)
def test_hand_made_cases(pattern: str, text: str, accepted: bool) -> None:
    assert _accepts(pattern, text) is accepted
    if re.search(pattern, text):
        assert accepted


def test_what_a_pattern_needs() -> None:
    assert required(r"(?:(?P<node>\w+): )?NCCL WARN NET/IB") == "NCCL WARN NET/IB"
    assert required(r"\d+") is None
    assert required(r"(?i)\bHello") == "hello"
    assert may_match(r"Segmentation fault") is None  # a literal start: re scans for it itself
