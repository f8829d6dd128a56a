"""What the benchmarks ran on, for every report. No project imports: bench/fuzz.py loads this
before atheris instruments the modules under test."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    model = platform.processor()
    with contextlib.suppress(OSError):
        model = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            model,
        )
    mem = None
    with contextlib.suppress(OSError, StopIteration, ValueError):
        mem = round(
            int(next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1])
            / 1e6,
            1,
        )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "mem_gb": mem,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
