"""Producer overhead benchmark (not a test): prints figures and writes
bench/results/producers.json and bench/results/producers.md, and the result in the common format,
bench/results/producers/<date>-<commit>.json (bench/results.py).

- GPU producers, each in its own process, one node with 8 GPUs, one sample per
  interval, publishing to a real embedded broker: CPU % of one core (utime+stime
  from /proc/<pid>/stat over the measured window, after a warm-up) and RSS
  (VmRSS / VmHWM from /proc/<pid>/status).
  * nvml: NvmlProducer over the fake pynvml (tests/fakes), or the real library with --nvml real.
  * dcgm: DcgmProducer scraping an 8-GPU dcgm-exporter exposition served on 127.0.0.1.
- Job-log tailer: JobLogProducer over a generated log file, lines/s until every
  batch is acknowledged by the broker (acks=all).

Run: .venv/bin/python -m bench.producers [--seconds 20] [--interval 1] [--tail-lines 500000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.server
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import figures, results
from bench.machine import machine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
FIXTURE = REPO / "tests" / "fixtures" / "dcgm" / "dcgm_exporter_metrics.prom"
TARGETS = {"gpu_cpu_pct": 1.0, "gpu_rss_mb": 60.0, "tailer_lines_per_s": 50_000.0}
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- child side: one producer per process ---------------------------------------------


def child(args: argparse.Namespace) -> None:
    from bus.publish import Publisher

    publisher = Publisher(args.bootstrap, f"bench-{args.child}")
    stop = threading.Event()
    producer: Any
    if args.child == "nvml":
        from producers.gpu_nvml import NvmlCollector, NvmlProducer

        if args.nvml == "real":
            collector = NvmlCollector()
        else:
            from tests.fakes.fake_pynvml import FakeNvml, h100_gpus

            collector = NvmlCollector(FakeNvml(h100_gpus(args.gpus)))
        producer = NvmlProducer(publisher, "bench-node", interval_s=args.interval, collector=collector)
        gpus = len(collector.gpus)
    else:
        from producers.gpu_dcgm import DcgmProducer

        producer = DcgmProducer(publisher, args.url, interval_s=args.interval)
        gpus = args.gpus

    def stop_on_eof() -> None:
        sys.stdin.read()  # the parent closes our stdin to stop us
        stop.set()

    threading.Thread(target=stop_on_eof, daemon=True).start()
    producer.poll_once()
    publisher.flush(10)
    print(json.dumps({"ready": True, "gpus": gpus}), flush=True)
    producer.run(stop)
    print(json.dumps({"samples": producer.samples, "errors": producer.errors}), flush=True)


# --- parent side --------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime of every thread


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def measure_producer(kind: str, bootstrap: str, seconds: float, interval: float, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.producers", "--child", kind, "--bootstrap", bootstrap]
    cmd += ["--interval", str(interval), *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    ready = json.loads(proc.stdout.readline() or "{}")
    if not ready.get("ready"):
        proc.kill()
        raise SystemExit(f"{kind} producer did not start (exit {proc.wait()})")
    time.sleep(min(3.0, seconds / 4))  # warm-up: imports and the first connections are not steady state
    cpu0, t0 = _cpu_seconds(proc.pid), time.monotonic()
    time.sleep(seconds)
    cpu1, t1 = _cpu_seconds(proc.pid), time.monotonic()
    rss_kb, hwm_kb = _status_kb(proc.pid, "VmRSS"), _status_kb(proc.pid, "VmHWM")
    proc.stdin.close()
    final = json.loads(proc.stdout.readline() or "{}")
    proc.wait(timeout=30)
    cpu_pct = 100.0 * (cpu1 - cpu0) / (t1 - t0)
    rss_mb = rss_kb / 1024
    return {
        "gpus": ready["gpus"],
        "interval_s": interval,
        "window_s": round(t1 - t0, 2),
        "cpu_pct_one_core": round(cpu_pct, 3),
        "rss_mb": round(rss_mb, 1),
        "peak_rss_mb": round(hwm_kb / 1024, 1),
        "samples": final.get("samples"),
        "errors": final.get("errors"),
        "meets_targets": cpu_pct <= TARGETS["gpu_cpu_pct"] and rss_mb <= TARGETS["gpu_rss_mb"],
    }


@contextmanager
def serve_exporter(body: bytes) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def one_node_exposition() -> bytes:
    """The fixture's node gpu01 only: one exporter per node, 8 GPUs."""
    lines = [ln for ln in FIXTURE.read_text().splitlines() if 'Hostname="gpu02"' not in ln]
    return ("\n".join(lines) + "\n").encode()


def write_log(path: Path, lines: int, ranks: int = 32) -> int:
    """A Megatron-style training log under `srun --label`, with the odd NCCL/warning line."""
    rnd = random.Random(7)
    size = 0
    with path.open("w") as fh:
        for i in range(lines):
            rank = i % ranks
            if i % 97 == 0:
                text = f"{rank}: [rank{rank}]:gpu{rank // 8:02d}:1234:1290 [{rank % 8}] NCCL INFO Channel 00/0 : {rank} -> {(rank + 1) % ranks} via P2P/IPC"
            else:
                step = i // ranks
                text = (
                    f"{rank}: [rank{rank}]: iteration {step:>8}/ 500000 | consumed samples: {step * 1024:>12} | "
                    f"elapsed time per iteration (ms): {rnd.uniform(800, 900):.1f} | learning rate: 2.999E-04 | "
                    f"lm loss: {rnd.uniform(2, 3):.6E} | grad norm: {rnd.uniform(0.5, 1.5):.3f}"
                )
            fh.write(text + "\n")
            size += len(text) + 1
    return size


def measure_tailer(bootstrap: str, lines: int) -> dict[str, Any]:
    from bus.publish import Publisher
    from producers.joblogs import JobLayout, JobLogProducer

    with tempfile.TemporaryDirectory(prefix="trainmedic-bench-") as tmp:
        path = Path(tmp) / "slurm-4242.out"
        size = write_log(path, lines)
        publisher = Publisher(bootstrap, "bench-tailer")
        nodes = tuple(f"gpu{i:02d}" for i in range(4))
        tailer = JobLogProducer(publisher, "4242", [path], layout=JobLayout(nodes, 8), partition="train")
        t0 = time.monotonic()
        cpu0 = time.process_time()
        while tailer.lines_published < lines:
            if tailer.poll_once() == 0:
                raise SystemExit(f"tailer stalled at {tailer.lines_published} of {lines} lines")
        left = publisher.flush(120)
        elapsed = time.monotonic() - t0
        cpu = time.process_time() - cpu0
        tailer.close()
    rate = lines / elapsed
    return {
        "lines": lines,
        "bytes": size,
        "seconds": round(elapsed, 3),
        "lines_per_s": round(rate),
        "process_cpu_s": round(cpu, 3),
        "batches_sent": publisher.sent.get("job.logs", 0),
        "batches_delivered": publisher.delivered.get("job.logs", 0),
        "undelivered": left,
        "meets_target": rate >= TARGETS["tailer_lines_per_s"] and left == 0,
    }


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    out = [
        "# Producer benchmark",
        "",
        f"Measured {result['measured_at']} on {m['cores']} cores ({m['cpu']}), Python {m['python']}, "
        f"with `python -m bench.producers`. One run, not an average.",
        "",
        f"GPU producers: one node, {result['gpu_producers']['nvml']['gpus']} GPUs, one sample every "
        f"{result['interval_s']} s, publishing to the embedded broker; CPU over a {result['seconds']} s window "
        "after warm-up. Targets: <= 1 % of one core, <= 60 MB RSS.",
        "",
        "| producer | CPU % of one core | RSS MB | peak RSS MB | samples | errors | meets targets |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result["gpu_producers"].items():
        out.append(
            f"| {name} | {r['cpu_pct_one_core']:.2f} | {r['rss_mb']:.1f} | {r['peak_rss_mb']:.1f} | {r['samples']} "
            f"| {r['errors']} | {'yes' if r['meets_targets'] else 'NO'} |"
        )
    t = result["tailer"]
    out += [
        "",
        "Job-log tailer (JobLogProducer, srun-labelled Megatron-style lines, acks=all until every batch is delivered). "
        "Target: >= 50,000 lines/s.",
        "",
        "| lines | MB | seconds | lines/s | meets target |",
        "|---|---|---|---|---|",
        f"| {t['lines']} | {t['bytes'] / 1e6:.1f} | {t['seconds']:.2f} | {t['lines_per_s']:,} | "
        f"{'yes' if t['meets_target'] else 'NO'} |",
        "",
        f"NVML source: {result['nvml_source']}. With the fake module the figure is the producer's own cost "
        "(Python, pydantic, Kafka client), not the NVIDIA driver's time per call.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per GPU producer")
    parser.add_argument("--interval", type=float, default=1.0, help="GPU sample interval")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--tail-lines", type=int, default=500_000)
    parser.add_argument("--nvml", choices=("fake", "real"), default="fake", help="real: the installed NVML driver")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", choices=("nvml", "dcgm"), help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return

    from bus.admin import ensure_topics
    from trainmedic.stack.broker import EmbeddedBroker

    started = results.now()

    broker = EmbeddedBroker().start()
    try:
        ensure_topics(broker.bootstrap)
        gpu: dict[str, Any] = {}
        print(f"nvml producer ({args.nvml}), {args.seconds:.0f} s ...", flush=True)
        gpu["nvml"] = measure_producer(
            "nvml", broker.bootstrap, args.seconds, args.interval, ["--gpus", str(args.gpus), "--nvml", args.nvml]
        )
        print(f"  {gpu['nvml']}", flush=True)
        print(f"dcgm producer, {args.seconds:.0f} s ...", flush=True)
        with serve_exporter(one_node_exposition()) as url:
            gpu["dcgm"] = measure_producer("dcgm", broker.bootstrap, args.seconds, args.interval, ["--url", url])
        print(f"  {gpu['dcgm']}", flush=True)
        print(f"job-log tailer, {args.tail_lines} lines ...", flush=True)
        tailer = measure_tailer(broker.bootstrap, args.tail_lines)
        print(f"  {tailer}", flush=True)
    finally:
        broker.stop()

    result = {
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "seconds": args.seconds,
        "interval_s": args.interval,
        "nvml_source": "fake pynvml (tests/fakes/fake_pynvml.py)" if args.nvml == "fake" else "real NVML driver",
        "targets": TARGETS,
        "gpu_producers": gpu,
        "tailer": tailer,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "producers.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "producers.md").write_text(markdown(result))
    print(markdown(result))
    common = results.record(
        "producers",
        figures.producers(result),
        root=args.out,
        started=started,
        machine=result["machine"],
        details={**result, "gpus": args.gpus, "tail_lines": args.tail_lines},
        report=args.out / "producers.md",
    )
    print(f"wrote {args.out / 'producers.json'}, {args.out / 'producers.md'} and {common}")


if __name__ == "__main__":
    main()
