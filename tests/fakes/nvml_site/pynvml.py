"""`import pynvml` answered by tests.fakes.fake_pynvml.FakeNvml, in a trainmedic process a test starts.

Put this folder first on the child's PYTHONPATH (the repository after it) and name a JSON file in
TRAINMEDIC_FAKE_NVML: {"gpus": 8, "processes": {"2": [[4242, 1048576]]}} (GPU index -> compute
processes as (pid, bytes)). The real bindings are loaded first, from the rest of the path: the fake
reuses their constants, errors and structures.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path

_here = Path(__file__).resolve().parent
_spec = importlib.machinery.PathFinder.find_spec("pynvml", [p for p in sys.path if Path(p or ".").resolve() != _here])
assert _spec is not None and _spec.loader is not None, "nvidia-ml-py is not installed"
_real = importlib.util.module_from_spec(_spec)
sys.modules["pynvml"] = _real  # what tests.fakes.fake_pynvml imports as the real module
_spec.loader.exec_module(_real)

from tests.fakes.fake_pynvml import FakeNvml, h100_gpus  # noqa: E402 - needs the real module first

_state = json.loads(Path(os.environ["TRAINMEDIC_FAKE_NVML"]).read_text())
_gpus = h100_gpus(int(_state.get("gpus", 8)))
for _index, _procs in _state.get("processes", {}).items():
    _gpus[int(_index)].processes = {_real.NVML_PROCESS_MODE_COMPUTE: [(int(p), int(b)) for p, b in _procs]}

# The import system hands out whatever sys.modules holds once this module has run.
sys.modules["pynvml"] = FakeNvml(_gpus)
