"""A simulated fleet for the predictive-migration scenario (issue 44, deliverable 4).

Job slots that each run one training job for the whole horizon, checkpointing on a fixed schedule;
GPU faults that arrive as a Poisson process per GPU; warnings ahead of some faults (the recall) and
false warnings in proportion to the true ones (the precision). Virtual time only: no Slurm, no logs,
no broker. bench/predictive.py accounts what the reactive path and the migration lose on it.

Every draw comes from its own seeded stream, so a sweep over lead time and precision sees the same
jobs, the same faults, the same warned faults and the same false-warning sequence at every point
(common random numbers): a difference between two points is the parameter's, not the dice's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class FleetJob:
    """One job slot. Checkpoints complete at ckpt_offset_s + k * ckpt_interval_s for every integer k:
    the job was already running before the horizon starts."""

    job_id: int
    nodes: int
    ckpt_interval_s: float
    ckpt_offset_s: float
    restart_s: float

    @property
    def gpus(self) -> int:
        return self.nodes * GPUS_PER_NODE

    def last_checkpoint(self, t: float) -> float:
        """The last checkpoint completed at or before t."""
        k = math.floor((t - self.ckpt_offset_s) / self.ckpt_interval_s)
        return self.ckpt_offset_s + k * self.ckpt_interval_s

    def next_checkpoint(self, t: float) -> float:
        """The first checkpoint completing at or after t."""
        k = math.ceil((t - self.ckpt_offset_s) / self.ckpt_interval_s)
        return self.ckpt_offset_s + k * self.ckpt_interval_s


@dataclass(frozen=True)
class Fault:
    job_id: int
    node_index: int
    t_s: float
    warned: bool  # whether a pre-failure verdict comes before it (drawn with the recall)


@dataclass(frozen=True)
class FalseWarning:
    job_id: int
    node_index: int
    t_s: float


@dataclass(frozen=True)
class FleetSpec:
    jobs: int
    nodes_choices: tuple[int, ...]
    ckpt_interval_s: tuple[float, float]
    restart_s: float
    fault_rate_per_gpu_h: float
    horizon_s: float
    recall: float
    seed: int


@dataclass(frozen=True)
class Fleet:
    spec: FleetSpec
    jobs: tuple[FleetJob, ...]
    faults: tuple[Fault, ...]

    def job(self, job_id: int) -> FleetJob:
        return self.jobs[job_id]

    def false_warnings(self, n: int) -> list[FalseWarning]:
        """The first n false warnings of one fixed sequence: on a node chosen in proportion to node
        count (a false verdict is about a node, and lands on the job running there), at a uniform time."""
        rng = random.Random(f"{self.spec.seed}:false-warnings")
        weights = [j.nodes for j in self.jobs]
        out: list[FalseWarning] = []
        for _ in range(n):
            job = rng.choices(self.jobs, weights=weights)[0]
            out.append(FalseWarning(job.job_id, rng.randrange(job.nodes), rng.uniform(0.0, self.spec.horizon_s)))
        return out


def make_fleet(spec: FleetSpec) -> Fleet:
    job_rng = random.Random(f"{spec.seed}:jobs")
    jobs: list[FleetJob] = []
    for i in range(spec.jobs):
        interval = job_rng.uniform(*spec.ckpt_interval_s)
        jobs.append(
            FleetJob(
                job_id=i,
                nodes=job_rng.choice(spec.nodes_choices),
                ckpt_interval_s=interval,
                ckpt_offset_s=job_rng.uniform(0.0, interval),
                restart_s=spec.restart_s,
            )
        )
    return Fleet(spec, tuple(jobs), tuple(make_faults(spec, jobs)))


def make_faults(spec: FleetSpec, jobs: Sequence[FleetJob]) -> list[Fault]:
    """Poisson arrivals per job at fault_rate_per_gpu_h x its GPUs; a job slot is back in service after
    each fault (its restart is short next to the time between faults), so arrivals do not pause."""
    fault_rng = random.Random(f"{spec.seed}:faults")
    warn_rng = random.Random(f"{spec.seed}:recall")
    faults: list[Fault] = []
    for job in jobs:
        rate_per_s = spec.fault_rate_per_gpu_h * job.gpus / 3600.0
        t = fault_rng.expovariate(rate_per_s)
        while t < spec.horizon_s:
            faults.append(Fault(job.job_id, fault_rng.randrange(job.nodes), t, warn_rng.random() < spec.recall))
            t += fault_rng.expovariate(rate_per_s)
    return sorted(faults, key=lambda f: f.t_s)
