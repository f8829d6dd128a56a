"""Coverage-guided fuzz run (atheris / libFuzzer) of the parsers that read untrusted text.

Targets (each runs in its own process: libFuzzer ends the process when it is done):

- ``logs``: the job-log path of JobLogProducer and the log detector, one fuzz input read as
  a chunk of log file: lines split like the follower does, ``split_rank_prefix``,
  ``TracebackGrouper`` (feed, then a forced flush), ``ProgressParser.parse`` on every line that
  comes out, ``SignatureDetector`` on the batch, and the encode of the LogBatch/ProgressBatch.
- ``kernel``: the kernel-log path of KernelLogProducer / KernelStreamProducer: every line
  through ``parse_kernel_line`` as is, as a /dev/kmsg record (``kmsg_message``) and as a
  ``journalctl -o json`` line (``journal_message``), then ``to_event`` and its encode.

None of these functions documents an exception: a finding is any exception at all, a
single input slower than ``--timeout`` seconds, or one over libFuzzer's memory limit.
libFuzzer stops at the first finding, writes the input under var/fuzz/ and exits non-zero;
so does this script. The seed corpus is every log line under tests/fixtures (copied into a
fresh temporary corpus per run), and a dictionary of the tokens the parsers look for.

Run: .venv/bin/python -m bench.fuzz [--runs N] [--target logs|kernel|all] [--report PATH]
     .venv/bin/python -m bench.fuzz --target kernel --reproduce var/fuzz/kernel-crash-<sha1>

Needs atheris (``pip install atheris``). Writes bench/results/fuzz.md and fuzz.json, and the result in the
common format, bench/results/fuzz/<date>-<commit>.json (bench/results.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from bench import figures, results
from bench.machine import machine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
ARTIFACTS = REPO / "var" / "fuzz"
FIXTURES = REPO / "tests" / "fixtures"
TARGETS = ("logs", "kernel")
# Chosen so that `python -m bench.fuzz` (both targets) is a ~25 s smoke run on 2 cores.
DEFAULT_RUNS = {"logs": 20_000, "kernel": 150_000}
START_MARK = "BENCH-FUZZ-START"
INSTALL_HINT = "bench.fuzz needs atheris: pip install atheris (into the project's venv: .venv/bin/pip install atheris)"


@dataclass(frozen=True)
class Target:
    name: str
    functions: tuple[str, ...]
    tokens: tuple[str, ...]


TARGET_INFO = {
    "logs": Target(
        "logs",
        (
            "producers.joblogs.split_rank_prefix",
            "producers.tracebacks.TracebackGrouper.feed/flush",
            "producers.progress.ProgressParser.parse",
            "streams.detectors.signatures.SignatureDetector.detect (match_line)",
            "schemas.codec.encode (LogBatch, ProgressBatch)",
        ),
        (
            "Traceback (most recent call last):",
            "During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:",
            '  File "train.py", line 1, in <module>',
            "[rank",
            "[default",
            "]:",
            "0: ",
            " iteration ",
            "/ ",
            " | ",
            "elapsed time per iteration (ms): ",
            "lm loss: ",
            "lm_loss: ",
            "grad norm: ",
            "loss scale: ",
            "samples per second: ",
            "actual seqlen: ",
            "validation loss at iteration ",
            "lm loss value: ",
            "global_step: ",
            "reduced_train_loss: ",
            "train_step_timing in s: ",
            "%|",
            "| ",
            " [00:01<00:02, ",
            "it/s",
            "s/it",
            "Epoch 0: ",
            "Validation DataLoader 0: ",
            "{'loss': ",
            "'grad_norm': ",
            "'eval_loss': ",
            "'step': ",
            "step: ",
            "  loss: ",
            "tps: ",
            "steps: ",
            "iter time (s): ",
            "[Rank 0] step=",
            ", skipped=",
            "global_step=",
            ", RunningAvgSamplesPerSec=",
            "] 1/2, SamplesPerSec=",
            "saving checkpoint at iteration ",
            "successfully saved checkpoint from iteration ",
            "Saving model checkpoint to ",
            "checkpoint-",
            "[Torch] Checkpoint ",
            "Saving the checkpoint",
            "nan",
            "inf",
            "1e-320",
            "\r",
        ),
    ),
    "kernel": Target(
        "kernel",
        (
            "producers.kernel.parse_kernel_line",
            "producers.kernel.kmsg_message",
            "producers.kernel.journal_message",
            "producers.kernel.to_event + schemas.codec.encode",
        ),
        (
            "NVRM: Xid (PCI:",
            "0000:3b:00",
            "): ",
            ", pid=",
            "'<unknown>'",
            ", name=",
            "SXid (PCI:",
            "NVRM: GPU at PCI:",
            ": GPU has fallen off the bus.",
            "fallen off the bus",
            " kernel: ",
            "Mar  3 12:00:00 ",
            "2024-03-03T12:00:00.123+00:00 ",
            "4,1234,5678901,-;",
            '{"MESSAGE":',
            '"_HOSTNAME":',
            "[78,86,82,77]",
        ),
    ),
}


# --- child: one target under libFuzzer ------------------------------------------------------


def _import_atheris() -> Any:
    try:
        import atheris  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        raise SystemExit(2) from None
    return atheris


def _lines(data: bytes) -> Iterator[str]:
    # As producers.follow.FileFollower hands lines over: split on \n, \r stripped, bad UTF-8 replaced.
    for raw in data.split(b"\n"):
        yield raw.rstrip(b"\r").decode("utf-8", errors="replace")


def _logs_harness() -> Callable[[bytes], None]:
    from producers.joblogs import split_rank_prefix
    from producers.progress import ProgressParser
    from producers.tracebacks import TracebackGrouper
    from schemas.codec import encode
    from schemas.events import LogBatch, LogLine, ProgressBatch
    from streams.detectors.signatures import SignatureDetector

    parser = ProgressParser()
    detector = SignatureDetector()

    def one_input(data: bytes) -> None:
        grouper = TracebackGrouper()
        now = 0.0
        lines: list[LogLine] = []
        for lineno, text in enumerate(_lines(data), 1):
            r = split_rank_prefix(text)
            lines += grouper.feed(LogLine(text=r.text, ts=now, rank=r.rank, lineno=lineno), now)
            now += 0.5
        lines += grouper.flush(now, force=True)
        if not lines:
            return
        batch = LogBatch(event_id="fuzz", event_time=now, job_id="1", source="fuzz", job_nodes=["n1"], lines=lines)
        encode(batch)
        detector.detect(batch)
        samples = [s for ln in lines if (s := parser.parse(ln.text, ln.ts, ln.rank, ln.node)) is not None]
        if samples:
            encode(ProgressBatch(event_id="fuzz", event_time=now, job_id="1", samples=samples))

    return one_input


def _kernel_harness() -> Callable[[bytes], None]:
    from producers.kernel import journal_message, kmsg_message, parse_kernel_line, to_event
    from schemas.codec import encode
    from schemas.ids import is_node_name

    def publish(message: str, host: str | None) -> None:
        # As KernelStreamProducer.handle: journald's _HOSTNAME only when it is a Slurm node name.
        parsed = parse_kernel_line(message, host if host and is_node_name(host) else "fuzz-node")
        if parsed is not None:
            encode(to_event(parsed, 0.0, gpu_index=0))

    def one_input(data: bytes) -> None:
        for line in _lines(data):
            publish(line, None)
            publish(kmsg_message(line + "\n"), None)
            entry = journal_message(line)
            if entry is not None:
                publish(*entry)

    return one_input


def child(args: argparse.Namespace) -> NoReturn:
    atheris = _import_atheris()
    # Only our packages are instrumented: coverage of pydantic or yaml internals would only
    # dilute the guidance (and slow every execution).
    with atheris.instrument_imports(include=["producers", "schemas", "streams"]):
        one_input = _logs_harness() if args.child == "logs" else _kernel_harness()
    argv = [sys.argv[0], *args.libfuzzer]
    atheris.Setup(argv, one_input)
    print(f"{START_MARK} {time.monotonic():.6f}", file=sys.stderr, flush=True)
    atheris.Fuzz()
    # libFuzzer exits the process itself (no SystemExit, no atexit): this line is not reached.
    raise SystemExit(0)


# --- parent: seeds, one child per target, report ----------------------------------------------


def _seed_lines(target: str) -> list[str]:
    kernel_names = ("kern", "dmesg", "syslog", "messages")
    out: list[str] = []
    for path in sorted(FIXTURES.rglob("*")):
        if not path.is_file() or path.suffix in (".md", ".yaml", ".prom", ".json"):
            continue
        is_kernel = path.name.startswith(kernel_names) or "_kern" in path.name
        if is_kernel == (target == "kernel"):
            out += path.read_text(errors="replace").splitlines()
    return out


def write_seeds(target: str, corpus: Path, max_len: int) -> int:
    """Seed files of a few lines each (a fuzz input is a chunk of log), plus kmsg and
    journald renderings of kernel lines so those decoders start from real records."""
    lines = _seed_lines(target)
    chunks = ["\n".join(lines[i : i + 8]) for i in range(0, len(lines), 8)]
    if target == "kernel":
        nvidia = [ln for ln in lines if "NVRM" in ln or "SXid" in ln]
        chunks += [f"6,{i},{i * 1000},-;{ln.split('kernel: ', 1)[-1]}" for i, ln in enumerate(nvidia)]
        chunks += [json.dumps({"MESSAGE": ln.split("kernel: ", 1)[-1], "_HOSTNAME": "gpu07"}) for ln in nvidia]
    n = 0
    for chunk in chunks:
        data = chunk.encode()[:max_len]
        if data:
            n += 1
            (corpus / f"seed-{n:05d}").write_bytes(data)
    return n


def write_dictionary(target: str, path: Path) -> int:
    tokens = set(TARGET_INFO[target].tokens)
    if target == "logs":
        # Literal runs of the catalog's patterns: what the signature matcher looks for.
        from streams.catalog import default_signatures

        for sig in default_signatures():
            tokens.update(t for t in re.findall(r"[A-Za-z][A-Za-z0-9 _:.,'=-]{3,}", sig.pattern) if len(t) <= 64)
    entries = []
    for token in sorted(tokens):
        escaped = "".join(
            ch if 0x20 <= ord(ch) < 0x7F and ch not in '"\\' else "".join(f"\\x{b:02X}" for b in ch.encode())
            for ch in token
        )
        entries.append(f'"{escaped}"')
    path.write_text("\n".join(entries) + "\n")
    return len(entries)


_STAT = re.compile(r"^stat::(\w+):\s+(\d+)")
_STATUS = re.compile(r"^#(\d+)\s+(\w+)\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
_DONE = re.compile(r"^Done (\d+) runs in (\d+) second")
_ARTIFACT = re.compile(r"Test unit written to (\S+)")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def parse_output(lines: list[str]) -> dict[str, Any]:
    """What libFuzzer and atheris printed, as figures and (at most one) finding."""
    stats: dict[str, int] = {}
    status: dict[str, int] = {}
    done_runs: int | None = None
    artifact: str | None = None
    traceback: list[str] = []
    in_traceback = False
    kind: str | None = None
    for line in lines:
        if m := _STAT.match(line):
            stats[m.group(1)] = int(m.group(2))
        elif m := _STATUS.match(line):
            status = {"runs": int(m.group(1)), "cov": int(m.group(3)), "ft": int(m.group(4)), "corp": int(m.group(5))}
        elif m := _DONE.match(line):
            done_runs = int(m.group(1))
        if m := _ARTIFACT.search(line):
            artifact = m.group(1)
        if "=== Uncaught Python exception: ===" in line:
            kind, in_traceback = "crash", True
            continue
        if in_traceback:
            if not line.strip() or line.startswith("==") or line.startswith("MS:"):
                in_traceback = False
            else:
                traceback.append(line)
        if "libFuzzer: timeout" in line:
            kind = "timeout"
        elif "libFuzzer: out-of-memory" in line:
            kind = "oom"
        elif "libFuzzer: deadly signal" in line and kind is None:
            kind = "crash"
    runs = stats.get("number_of_executed_units") or done_runs or status.get("runs") or 0
    return {
        "runs": runs,
        "coverage_edges": status.get("cov"),
        "features": status.get("ft"),
        "corpus_units": status.get("corp"),
        "new_units": stats.get("new_units_added"),
        "peak_rss_mb": stats.get("peak_rss_mb"),
        "kind": kind,
        "artifact": artifact,
        "traceback": traceback,
    }


def _exception(traceback: list[str]) -> str | None:
    """The exception lines after the last frame (pydantic's message spans several lines)."""
    last_frame = max((i for i, ln in enumerate(traceback) if _FRAME.match(ln)), default=-1)
    tail = traceback[last_frame + 1 :]
    head = next((i for i, ln in enumerate(tail) if ln[:1].strip()), None)
    if head is None:
        return traceback[-1].strip() if traceback else None
    return " / ".join(ln.strip() for ln in tail[head : head + 3])


def _where(traceback: list[str]) -> str | None:
    """The innermost frame in this repository: where the fix goes."""
    frames = [m for ln in traceback if (m := _FRAME.match(ln))]
    ours = [m for m in frames if m.group(1).startswith(str(REPO)) and "/.venv/" not in m.group(1)]
    for m in reversed(ours or frames):
        return f"{os.path.relpath(m.group(1), REPO)}:{m.group(2)} in {m.group(3)}"
    return None


def run_target(target: str, args: argparse.Namespace) -> dict[str, Any]:
    runs = args.runs if args.runs is not None else DEFAULT_RUNS[target]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{target}-") as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        seeds = write_seeds(target, corpus, args.max_len)
        dict_path = Path(tmp) / "tokens.dict"
        tokens = write_dictionary(target, dict_path)
        libfuzzer = [
            f"-runs={runs}",
            f"-seed={args.seed}",
            f"-max_len={args.max_len}",
            f"-timeout={args.timeout}",
            f"-max_total_time={args.max_seconds}",
            f"-dict={dict_path}",
            f"-artifact_prefix={ARTIFACTS}/{target}-",
            "-print_final_stats=1",
            str(corpus),
        ]
        cmd = [sys.executable, "-m", "bench.fuzz", "--child", target, "--", *libfuzzer]
        print(f"fuzz {target}: {runs:,} runs, {seeds} seed inputs, {tokens} dictionary tokens ...", flush=True)
        started = time.monotonic()
        # A fixed hash seed takes set/dict order out of the run-to-run variation. libFuzzer's
        # scheduler still weighs inputs by their measured time, so two runs with one -seed can
        # still differ: a finding is reproduced from its saved input, not by rerunning.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, errors="replace", check=False)
        ended = time.monotonic()
    lines = (proc.stdout + proc.stderr).splitlines()
    fuzz_start = next((float(ln.split()[1]) for ln in lines if ln.startswith(START_MARK)), started)
    parsed = parse_output(lines)
    seconds = max(ended - fuzz_start, 1e-9)
    kind = parsed["kind"]
    if kind is None and proc.returncode != 0:
        kind = "error"
    result: dict[str, Any] = {
        "functions": list(TARGET_INFO[target].functions),
        "runs_requested": runs,
        "runs": parsed["runs"],
        "seconds": round(seconds, 2),
        "startup_s": round(fuzz_start - started, 2),
        "execs_per_s": round(parsed["runs"] / seconds),
        "coverage_edges": parsed["coverage_edges"],
        "features": parsed["features"],
        "corpus_units": parsed["corpus_units"],
        "seed_inputs": seeds,
        "new_units": parsed["new_units"],
        "peak_rss_mb": parsed["peak_rss_mb"],
        "exit_code": proc.returncode,
        "result": "ok" if kind is None else kind,
        "finding": None,
    }
    if kind is not None:
        finding: dict[str, Any] = {
            "kind": kind,
            "exception": _exception(parsed["traceback"]),
            "where": _where(parsed["traceback"]),
            "traceback": [ln.replace(f"{REPO}/", "") for ln in parsed["traceback"]],
            "artifact": None,
            "input_repr": None,
            "input_bytes": None,
            "output_tail": lines[-40:],
        }
        if parsed["artifact"]:
            artifact = Path(parsed["artifact"])
            finding["artifact"] = os.path.relpath(artifact, REPO)
            if artifact.exists():
                data = artifact.read_bytes()
                finding["input_bytes"] = len(data)
                finding["input_repr"] = repr(data[:300]) + (" ..." if len(data) > 300 else "")
            finding["reproduce"] = f".venv/bin/python -m bench.fuzz --target {target} --reproduce {finding['artifact']}"
        result["finding"] = finding
    print(f"  {summary_line(target, result)}", flush=True)
    return result


def reproduce(target: str, path: Path) -> int:
    """Run one saved input through a target once, with atheris's own report."""
    cmd = [sys.executable, "-m", "bench.fuzz", "--child", target, "--", str(path)]
    return subprocess.run(cmd, cwd=REPO, check=False).returncode


def summary_line(target: str, r: dict[str, Any]) -> str:
    return (
        f"{target:<7} runs {r['runs']:>9,}  {r['seconds']:>7.2f} s  {r['execs_per_s']:>8,} execs/s  "
        f"cov {r['coverage_edges'] or '-'}  result {r['result'].upper()}"
    )


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    s = doc["settings"]
    out = [
        "# Fuzz run",
        "",
        f"Measured {doc['measured_at']} on {m['cores']} cores ({m['cpu']}), Python {m['python']}, "
        f"atheris {doc['atheris']}, with `{doc['command']}`. One run, not an average.",
        "",
        f"libFuzzer settings: seed {s['seed']}, inputs up to {s['max_len']} bytes, {s['timeout_s']} s per input "
        f"before a timeout counts as a finding, at most {s['max_seconds']} s per target. Seeds: every log line "
        "under tests/fixtures (in chunks of 8 lines), plus kmsg and journald renderings of the kernel lines; "
        "a dictionary of the tokens the parsers and the signature catalog look for.",
        "",
        "A finding is any exception (none of these functions documents one), a timeout or an out-of-memory.",
        "",
        "| target | runs | seconds | execs/s | coverage (edges) | corpus | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in doc["targets"].items():
        out.append(
            f"| {name} | {r['runs']:,} | {r['seconds']:.2f} | {r['execs_per_s']:,} | {r['coverage_edges'] or '-'} "
            f"| {r['corpus_units'] or '-'} | {'ok' if r['result'] == 'ok' else '**' + r['result'].upper() + '**'} |"
        )
    out += ["", "Functions under test:", ""]
    for name, r in doc["targets"].items():
        out.append(f"- `{name}`: " + ", ".join(f"`{f}`" for f in r["functions"]))
    findings = [(name, r["finding"]) for name, r in doc["targets"].items() if r["finding"]]
    out += ["", "## Findings", ""]
    if not findings:
        out += ["None in this run.", ""]
    for name, f in findings:
        out += [
            f"### {name}: {f['kind']}",
            "",
            f"- exception: `{f['exception'] or '-'}`",
            f"- where: `{f['where'] or '-'}`",
            f"- input ({f['input_bytes'] if f['input_bytes'] is not None else '?'} bytes): `{f['input_repr'] or '-'}`",
            f"- saved as: `{f['artifact'] or '-'}`",
        ]
        if f.get("reproduce"):
            out.append(f"- reproduce: `{f['reproduce']}`")
        if f["traceback"]:
            out += ["", "```", *f["traceback"], "```"]
        out.append("")
    return "\n".join(out)


def _atheris_version() -> str:
    try:
        from importlib.metadata import version

        return version("atheris")
    except Exception:
        return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=(*TARGETS, "all"), default="all")
    parser.add_argument(
        "--runs",
        type=int,
        help=f"inputs per target (default: {', '.join(f'{k} {v:,}' for k, v in DEFAULT_RUNS.items())})",
    )
    parser.add_argument("--seed", type=int, default=1, help="libFuzzer seed; 0 picks a random one")
    parser.add_argument("--max-len", type=int, default=4096, help="largest input in bytes")
    parser.add_argument("--timeout", type=int, default=10, help="seconds one input may take before it is a finding")
    parser.add_argument(
        "--max-seconds", type=int, default=120, help="stop a target after this long even if runs remain"
    )
    parser.add_argument("--report", type=Path, default=RESULTS / "fuzz.md", help="Markdown report; JSON next to it")
    parser.add_argument("--reproduce", type=Path, help="run one saved input (needs --target logs|kernel)")
    parser.add_argument("--child", choices=TARGETS, help=argparse.SUPPRESS)
    parser.add_argument("libfuzzer", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
    if importlib.util.find_spec("atheris") is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    if args.reproduce is not None:
        if args.target == "all":
            parser.error("--reproduce needs --target logs or --target kernel")
        return reproduce(args.target, args.reproduce)

    targets = TARGETS if args.target == "all" else (args.target,)
    started = results.now()
    outcomes = {t: run_target(t, args) for t in targets}
    doc: dict[str, Any] = {
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "atheris": _atheris_version(),
        "command": ("python -m bench.fuzz " + shlex.join(argv if argv is not None else sys.argv[1:])).strip(),
        "settings": {
            "runs": args.runs,
            "default_runs": DEFAULT_RUNS,
            "seed": args.seed,
            "max_len": args.max_len,
            "timeout_s": args.timeout,
            "max_seconds": args.max_seconds,
        },
        "targets": outcomes,
        "findings": sum(1 for r in outcomes.values() if r["result"] != "ok"),
    }
    report = args.report if args.report.suffix == ".md" else args.report / "fuzz.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(markdown(doc))
    report.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    common = results.record(
        "fuzz",
        figures.fuzz(doc),
        root=report.parent,
        started=started,
        machine=doc["machine"],
        details=doc,
        variant=results.variant_name(report.stem, "fuzz"),
        report=report,
    )
    print()
    print("summary:")
    for name, r in outcomes.items():
        print(f"  {summary_line(name, r)}")
        if r["finding"]:
            f = r["finding"]
            shown = (f["input_repr"] or "?")[:160]
            print(f"    {f['exception'] or f['kind']}\n    at {f['where'] or '?'}\n    input {shown}")
    print(f"wrote {report}, {report.with_suffix('.json')} and {common}")
    return 1 if doc["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
