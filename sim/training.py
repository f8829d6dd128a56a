"""Simulated multi-node training jobs that write logs the way real ones do.

Each node of a job writes `<job dir>/<node>.out` (as `srun -o %N.out` would)
with torchrun's `[rankN]:` prefixes; the last rank prints Megatron-LM style
iteration lines. Each node has a kernel log `<nodes dir>/<node>/kern.log`.
Line formats follow the real texts in tests/fixtures/logs (see SOURCES.md).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from sinks.backends.base import SchedulerBackend

NCCL_TIMEOUT_MS = 600_000


@dataclass
class GroundTruth:
    """What was injected, when: the start of detection latency."""

    kind: str
    job_id: str
    node: str
    category: str
    expected_action: str
    written_at: float


def _stamp() -> str:
    return datetime.now().strftime("%b %d %H:%M:%S")


def _pci(gpu: int) -> str:
    return f"0000:{0x18 + gpu * 0x10:02x}:00"


@dataclass
class SimJob:
    sched: SchedulerBackend
    job_id: str
    jobs_dir: Path
    nodes_dir: Path
    ranks_per_node: int = 8
    step_s: float = 0.5
    seed: int = 0
    collective_timeout_s: float = 1.0  # stands in for NCCL's 600 s watchdog
    iteration: int = 0
    dead_nodes: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _failed: bool = False

    @property
    def dir(self) -> Path:
        return self.jobs_dir / self.job_id

    def log_path(self, node: str) -> Path:
        return self.dir / f"{node}.out"

    def kern_path(self, node: str) -> Path:
        return self.nodes_dir / node / "kern.log"

    def nodes(self) -> tuple[str, ...]:
        return self.sched.job_state(self.job_id).nodes

    def _write(self, path: Path, lines: list[str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write("".join(line + "\n" for line in lines))

    def _rank_lines(self, node: str, text: str) -> list[str]:
        nodes = self.nodes()
        i = nodes.index(node)
        return [
            f"[rank{r}]:{text.format(rank=r)}" for r in range(i * self.ranks_per_node, (i + 1) * self.ranks_per_node)
        ]

    def _peer_rank_lines(self, index: int, text: str) -> list[str]:
        # Ranks of the allocation at fault time, even if the scheduler has moved on since.
        return [
            f"[rank{r}]:{text.format(rank=r)}"
            for r in range(index * self.ranks_per_node, (index + 1) * self.ranks_per_node)
        ]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"simjob-{self.job_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def restart(self) -> None:
        """The scheduler requeued the job and it runs again (from its last checkpoint)."""
        with self._lock:
            self._failed = False
            self.dead_nodes.clear()
        self._banner()

    def _banner(self) -> None:
        nodes = self.nodes()
        for n in nodes:
            self._write(
                self.log_path(n),
                self._rank_lines(
                    n, f"{n}:1234:1234 [{{rank}}] NCCL INFO Bootstrap : Using ib0:10.0.0.{nodes.index(n) + 1}<0>"
                )
                + self._rank_lines(
                    n,
                    f"{n}:1234:1234 [{{rank}}] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:10.0.0.{nodes.index(n) + 1}<0>",
                ),
            )

    def _run(self) -> None:
        rng = random.Random(self.seed)
        self._banner()
        while not self._stop.wait(self.step_s):
            with self._lock:
                if self._failed:
                    continue
                nodes = self.nodes()
                if not nodes:
                    continue
                self.iteration += 1
                last = len(nodes) * self.ranks_per_node - 1
                ms = self.step_s * 1000 * rng.uniform(0.97, 1.03)
                loss = 9.0 / (1 + 0.01 * self.iteration) + rng.uniform(-0.02, 0.02)
                self._write(
                    self.log_path(nodes[-1]),
                    [
                        f"[rank{last}]: iteration {self.iteration:8d}/  500000 | consumed samples: {self.iteration * 512:12d} | "
                        f"elapsed time per iteration (ms): {ms:.1f} | learning rate: 3.000E-04 | global batch size:   512 | "
                        f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {rng.uniform(0.7, 0.9):.3f} | "
                        f"number of skipped iterations:   0 | number of nan iterations:   0 |"
                    ],
                )

    def inject_xid79(self, node: str, gpu: int = 3) -> GroundTruth:
        """GPU falls off the bus on `node`: its ranks go silent, the others time out."""
        with self._lock:
            self._failed = True
            self.dead_nodes.add(node)
            seq = 7000 + self.iteration
        written = time.time()
        # Format as in tests/fixtures/logs/xid79_kern.log (journalctl -k / syslog).
        self._write(
            self.kern_path(node),
            [
                f"{_stamp()} {node} kernel: NVRM: Xid (PCI:{_pci(gpu)}): 79, pid=0, GPU has fallen off the bus.",
                f"{_stamp()} {node} kernel: NVRM: GPU {_pci(gpu)}.0: GPU has fallen off the bus.",
            ],
        )
        peers = [(i, n) for i, n in enumerate(self.nodes()) if n != node]
        restarts = self.sched.job_state(self.job_id).restart_count
        threading.Thread(target=self._cascade, args=(peers, seq, restarts), daemon=True).start()
        return GroundTruth("xid79", self.job_id, node, "gpu_hardware", "drain_and_requeue", written)

    def _cascade(self, peers: list[tuple[int, str]], seq: int, restarts: int) -> None:
        # Format as in tests/fixtures/logs/nccl_watchdog_timeout.log (PyTorch ProcessGroupNCCL).
        if self._stop.wait(self.collective_timeout_s):
            return
        if self.sched.job_state(self.job_id).restart_count != restarts:
            return  # requeued before the watchdog fired: Slurm killed the waiting ranks
        now = datetime.now().strftime("%m%d %H:%M:%S.%f")
        for i, n in peers:
            self._write(
                self.log_path(n),
                self._peer_rank_lines(
                    i,
                    f"[E{now} ProcessGroupNCCL.cpp:607] [Rank {{rank}}] Watchdog caught collective operation timeout: "
                    f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=544997376, NumelOut=544997376, "
                    f"Timeout(ms)={NCCL_TIMEOUT_MS}) ran for {NCCL_TIMEOUT_MS + 61} milliseconds before timing out.",
                ),
            )
