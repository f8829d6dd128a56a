"""bench.scale_points: a bad point or number is refused with a usage error naming it, before any run."""

from __future__ import annotations

import pytest

from bench.scale_points import Point, parse_args


def test_points_and_seconds_are_read() -> None:
    a = parse_args(["--seconds", "150", "--profile-seconds", "30", "256x1@5", "2048x2", "1024x1@2.5"])
    assert a.seconds == 150.0
    assert a.profile_seconds == 30.0
    assert a.points == [Point(256, 1, 5.0), Point(2048, 2, None), Point(1024, 1, 2.5)]
    assert [p.name for p in a.points] == ["scale-256-w1-every5", "scale-2048-w2", "scale-1024-w1-every2.5"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--help-me", "256x1"], "unrecognized arguments: --help-me"),
        (["4096"], "'4096'"),
        (["4096x1@"], "'4096x1@'"),
        (["4096x0"], "'4096x0'"),
        (["1x1"], "'1x1'"),
        (["4096x1@0"], "'4096x1@0'"),
        (["--seconds", "soon", "256x1"], "'soon'"),
        (["--seconds", "0", "256x1"], "--seconds must be > 0"),
        (["--profile-seconds", "-1", "256x1"], "--profile-seconds must be >= 0"),
        ([], "required"),
    ],
)
def test_bad_input_is_a_usage_error_naming_it(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
