"""The per-test time guard (tests/budget.py), run on an inner pytest with a short limit: a test
over it fails naming the limit, one marked slow with a reason passes, a mark without a reason
and more than the allowed number of marks are usage errors."""

from __future__ import annotations

from pathlib import Path

import pytest

LIMIT = "0.3"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("TMTEST_SLOW_LIMIT_S", LIMIT)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return pytester


def _run(p: pytest.Pytester) -> pytest.RunResult:
    # A subprocess: tests.budget reads its limit at import, which must happen with the env above.
    return p.runpytest_subprocess("-p", "tests.budget", "-p", "no:cacheprovider")


def test_a_test_over_the_limit_fails_and_a_marked_one_passes(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_times="""
        import time, pytest

        @pytest.fixture(scope="session")
        def shared():
            time.sleep(0.5)  # a shared fixture's setup is not the test's own time

        @pytest.fixture
        def _slurm_cluster_lock():
            time.sleep(0.5)  # waiting for a cluster another test holds is not the test's own time

        def test_quick(shared):
            pass

        def test_waited_for_a_cluster(_slurm_cluster_lock):
            pass

        def test_slow():
            time.sleep(0.5)

        @pytest.mark.slow(reason="measures a half-second window")
        def test_slow_on_purpose():
            time.sleep(0.5)
        """
    )
    result = _run(inner)
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*test_slow took 0.* s of its own*over the suite's per-test limit of 0 s*"])
    for fine in ("test_quick", "test_slow_on_purpose", "test_waited_for_a_cluster"):
        assert f"{fine} took" not in result.stdout.str()


def test_a_slow_mark_needs_a_reason(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_mark="import pytest\n\n@pytest.mark.slow\ndef test_x():\n    pass\n")
    result = _run(inner)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*@pytest.mark.slow needs reason=*"])


def test_at_most_ten_tests_may_be_marked_slow(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_many="import pytest\n\n@pytest.mark.slow(reason='r')\n@pytest.mark.parametrize('i', range(11))\n"
        "def test_x(i):\n    pass\n"
    )
    result = _run(inner)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*11 tests are marked slow, at most 10 may be*"])
