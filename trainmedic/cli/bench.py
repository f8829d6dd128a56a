"""`trainmedic bench`: the end-to-end pipeline benchmark (bench/pipeline.py) from the CLI."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from schemas.errors import UsageError
from schemas.extras import require
from trainmedic.cli.base import new_app

bench_app = new_app(
    invoke_without_command=True,
    no_args_is_help=False,
    help=(
        "Benchmark the whole pipeline against a simulated N-node x 8-GPU cluster with injected faults: "
        "detection and action latency, accuracy, consumer lag, CPU/RSS, the status quo beside each figure, "
        "and the largest cluster this machine sustains. Writes JSON, Markdown and plots."
    ),
)

_REPO = Path(__file__).resolve().parents[2]


def _pipeline() -> Any:
    try:
        import bench.pipeline as pipeline
    except ImportError:
        # bench/ ships with the source tree, not the wheel: use the checkout this trainmedic runs from.
        if not (_REPO / "bench" / "pipeline.py").exists():
            raise UsageError("trainmedic bench needs a source checkout (bench/pipeline.py)") from None
        sys.path.insert(0, str(_REPO))
        import bench.pipeline as pipeline
    return pipeline


@bench_app.callback(invoke_without_command=True)
def bench(
    quick: Annotated[
        bool,
        typer.Option(help="Small cluster through real files and tailers, explicit faults and hangs, no scale search."),
    ] = False,
    nodes: Annotated[Optional[int], typer.Option(help="Nodes (x 8 GPUs) of the fault scenario.")] = None,
    reps: Annotated[Optional[int], typer.Option(help="Injections per fault kind.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the cluster, its jobs and the fault plan.")] = 7,
    kinds: Annotated[Optional[str], typer.Option(help="Comma-separated fault kinds (default: all).")] = None,
    transport: Annotated[
        Optional[str], typer.Option(help="direct (events built in memory) or files (real files, real tailers).")
    ] = None,
    scale: Annotated[
        Optional[str], typer.Option(help="Comma-separated node counts for the scale search; '' for none.")
    ] = None,
    scale_seconds: Annotated[float, typer.Option(help="Seconds per scale step.")] = 150.0,
    profile_seconds: Annotated[float, typer.Option(help="py-spy the streams worker this long (0: no).")] = 30.0,
    manual_response_s: Annotated[float, typer.Option(help="Status quo: a person's response time.")] = 1800.0,
    silent_notice_s: Annotated[
        float, typer.Option(help="Status quo: when a fault that fails nothing is noticed.")
    ] = 3600.0,
    out: Annotated[Path, typer.Option(help="Where the JSON, Markdown and plots go.")] = _REPO / "bench" / "results",
    prefix: Annotated[str, typer.Option(help="File names: PREFIX.json, PREFIX.md, PREFIX_*.png.")] = "pipeline",
    data_dir: Annotated[Path, typer.Option(help="Scratch space for the stacks (chDB, logs).")] = Path("var/bench"),
) -> None:
    # Checked first: the stack runs for minutes before the plots need matplotlib.
    require("embedded", "trainmedic bench (the embedded stack)")
    require("bench", "trainmedic bench (its plots)", only=("matplotlib",))
    pipeline = _pipeline()
    argv = [
        f"--seed={seed}",
        f"--scale-seconds={scale_seconds}",
        f"--profile-seconds={profile_seconds}",
        f"--manual-response-s={manual_response_s}",
        f"--silent-notice-s={silent_notice_s}",
        f"--out={out}",
        f"--prefix={prefix}",
        f"--data-dir={data_dir.resolve()}",
    ]
    if quick:
        argv.append("--quick")
    for flag, value in (
        ("--nodes", nodes),
        ("--reps", reps),
        ("--kinds", kinds),
        ("--transport", transport),
        ("--scale", scale),
    ):
        if value is not None:
            argv.append(f"{flag}={value}")
    try:
        options = pipeline.options_from_args(pipeline.parse_args(argv))
    except SystemExit as exc:
        raise UsageError(str(exc)) from None
    options.say = typer.echo
    pipeline.run_bench(options)
