"""streams/catalog/error_lines.yaml: loaded and checked, and checked against the other catalogs.

- every entry names its emitter's source and carries a line its emitter prints that matches it
  (the loader refuses one that does not, naming it);
- no not-fault entry explains away a line a fault signature recognises, on any dev case;
- a healthy dev case has no error-level line left unexplained.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from streams.catalog import CatalogError, default_signatures
from streams.catalog.error_lines import default_error_lines, load_error_lines
from streams.detectors.error_lines import ErrorLineReader
from streams.detectors.signatures import SignatureDetector
from tests.conftest import FIXTURES

DEV = FIXTURES / "corpus" / "dev"


def _dev_lines(prefix: str = "") -> list[tuple[str, str]]:
    out = []
    for case in sorted(DEV.iterdir()):
        if not case.is_dir() or not case.name.startswith(prefix):
            continue
        for path in sorted(case.iterdir()):
            if path.name != "label.yaml":
                out += [(case.name, line) for line in path.read_text(errors="replace").splitlines()]
    return out


def test_every_entry_cites_its_source_and_the_emitters_are_pinned() -> None:
    emitters = default_error_lines()
    assert {e.emitter for e in emitters} >= {"nccl", "slurm", "pytorch", "python", "linux_kernel", "nvidia_driver"}
    for em in emitters:
        assert em.version.strip(), em.emitter
        for entry in (*em.error_level, *em.not_faults):
            assert entry.source.startswith(("http://", "https://")), (em.emitter, entry.id)


def test_an_example_its_pattern_does_not_match_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "error_lines.yaml"
    bad.write_text(
        "emitters:\n  - emitter: nccl\n    version: v1\n    error_level:\n"
        "      - id: nccl_warn\n        pattern: 'NCCL WARN'\n        source: https://example.org/debug.cc\n"
        "        example: 'NCCL INFO only'\n"
    )
    with pytest.raises(CatalogError, match="does not match the pattern"):
        load_error_lines(bad)


def test_no_not_fault_entry_explains_away_a_recognised_fault_line() -> None:
    reader, signatures = ErrorLineReader(), SignatureDetector(default_signatures())
    masked = []
    for case, line in _dev_lines():
        if case.startswith("healthy_"):
            continue
        hit = reader.read(line)
        noise = hit is not None and hit.not_fault is not None and hit.not_fault.kind == "noise"
        if noise and (sig := signatures.match_line(line)) is not None and sig[0].category != "unknown":
            masked.append((case, hit.entry if hit else "", sig[0].id, line[:120]))
    assert masked == []


def test_healthy_dev_cases_have_no_unexplained_error_level_line() -> None:
    reader, signatures = ErrorLineReader(), SignatureDetector(default_signatures())
    left = [
        (case, hit.entry, line[:120])
        for case, line in _dev_lines("healthy_")
        if (hit := reader.read(line)) is not None and hit.not_fault is None and signatures.match_line(line) is None
    ]
    assert left == []
