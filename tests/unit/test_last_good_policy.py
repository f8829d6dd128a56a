"""The operator API's policy holder: a broken policy file leaves the last good policy in force,
remembers why it was refused (file and line), and is forgotten once the file is valid again."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

import trainmedic.web.last_good_policy as holder_module
from streams.policy import DEFAULT_POLICY, Policy
from trainmedic.web.last_good_policy import LastGoodPolicy

GOOD = DEFAULT_POLICY.read_text()
# The second `mode:` is line 2: PyYAML would keep it silently; the loader refuses it.
DUPLICATE_KEY = "mode: monitor\nmode: autonomous\n" + GOOD.split("\nmode: monitor\n", 1)[1]
BAD_CATEGORY = GOOD.replace("\nactions:\n", "\nactions:\n  gpu_hardwre: stop\n", 1)


def _rewrite(path: Path, text: str) -> None:
    """Write and move the mtime on, so a rewrite within one timestamp tick still reads as changed."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_a_valid_file_is_the_policy_in_force(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    _rewrite(path, GOOD)
    state = LastGoodPolicy(path, clock=lambda: 100.0).state
    assert isinstance(state.policy, Policy) and state.policy.mode == "monitor"
    assert state.error is None and state.problem() is None and state.loaded_at == 100.0


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (DUPLICATE_KEY, "line 2: duplicate key 'mode' (first at line 1)"),
        (BAD_CATEGORY, "field 'actions.gpu_hardwre': unknown category"),
    ],
)
def test_a_broken_file_keeps_the_last_good_policy_and_names_file_and_line(
    tmp_path: Path, text: str, needle: str
) -> None:
    path = tmp_path / "policy.yaml"
    _rewrite(path, GOOD.replace("min_samples: 10", "min_samples: 7"))
    holder = LastGoodPolicy(path, clock=lambda: 0.0)
    _rewrite(path, text.replace("min_samples: 10", "min_samples: 1"))
    state = holder.reload()
    assert state.policy is not None and state.policy.readiness.min_samples == 7  # the last good one
    assert state.error is not None and state.error.startswith(f"{path}: line ") and needle in state.error
    problem = state.problem()
    assert problem is not None and needle in problem
    assert "the policy last read successfully, at 1970-01-01T00:00:00+00:00, stays in force" in problem


def test_a_fixed_file_clears_the_error(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    _rewrite(path, GOOD)
    holder = LastGoodPolicy(path)
    _rewrite(path, BAD_CATEGORY)
    assert holder.reload().error is not None
    _rewrite(path, GOOD.replace("min_samples: 10", "min_samples: 5"))
    state = holder.reload()
    assert state.error is None and state.problem() is None
    assert state.policy is not None and state.policy.readiness.min_samples == 5


def test_no_valid_file_ever_leaves_no_policy_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    _rewrite(path, BAD_CATEGORY)
    state = LastGoodPolicy(path).state
    assert state.policy is None and state.loaded_at is None
    problem = state.problem()
    assert problem is not None and "unknown category" in problem and "only a switch to monitor" in problem
    missing = LastGoodPolicy(tmp_path / "absent.yaml").state
    assert missing.policy is None and missing.error is not None and "cannot read policy file" in missing.error


def test_refresh_reads_the_file_only_when_it_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "policy.yaml"
    _rewrite(path, GOOD)
    reads: list[Path] = []
    real = holder_module.load_policy

    def counting(p: Path) -> Policy:
        reads.append(p)
        return real(p)

    monkeypatch.setattr(holder_module, "load_policy", counting)
    holder = LastGoodPolicy(path)
    holder.refresh()
    holder.refresh()
    assert len(reads) == 1  # health polls do not parse an unchanged file
    _rewrite(path, BAD_CATEGORY)
    assert holder.refresh().error is not None and len(reads) == 2
    holder.reload()
    assert len(reads) == 3  # an operator's request always reads the file


def test_refresh_of_a_missing_file_reads_again(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    _rewrite(path, GOOD)
    holder = LastGoodPolicy(path)
    path.unlink()
    assert holder.refresh().error is not None
    _rewrite(path, GOOD)
    assert holder.refresh().error is None


def test_each_distinct_error_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "policy.yaml"
    _rewrite(path, GOOD)
    holder = LastGoodPolicy(path)
    _rewrite(path, BAD_CATEGORY)
    with caplog.at_level(logging.INFO, logger="trainmedic.web.api"):
        for _ in range(3):
            holder.reload()
        _rewrite(path, DUPLICATE_KEY)
        holder.reload()
        _rewrite(path, GOOD)
        holder.reload()
    refused = [r.getMessage() for r in caplog.records if "keeping the last good policy" in r.getMessage()]
    assert len(refused) == 2 and "unknown category" in refused[0] and "duplicate key" in refused[1]
    assert any("is valid again" in r.getMessage() for r in caplog.records)
