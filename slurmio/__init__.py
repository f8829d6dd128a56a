"""slurmio: trainmedic's one Slurm layer (a shared floor beside schemas/).

- `runners`: one runner protocol ``(argv, timeout) -> stdout`` raising
  `SlurmCommandError` (local here; the executor's SSH runner keeps it too)
- `hostlist`: hostlist expansion (python-hostlist)
- `versions`: which data parser wrote a JSON document (v0.0.38 / 22.05 to
  v0.0.42 / 24.11) and the encodings it promises (dataparsers.yaml)
- `squeue`, `sinfo`, `scontrol`: typed parsers (`JobInfo`, `NodeInfo`) for
  every supported version; an unknown shape raises `SlurmFormatError`
  naming the field and the version

Producers and executor backends read Slurm only through this package.
"""

from slurmio.hostlist import HostlistError, expand_hostlist
from slurmio.records import ExitStatus, JobInfo, NodeInfo
from slurmio.runners import LocalRunner, Runner, SlurmCommandError
from slurmio.scontrol import parse_scontrol_line, show_job, show_node
from slurmio.sinfo import NodesDocument, parse_nodes, parse_sinfo, read_nodes, read_sinfo
from slurmio.squeue import SQUEUE_ALL, JobsDocument, parse_jobs, read_jobs
from slurmio.versions import DataParser, SlurmFormatError, detect, known_versions, load_document

__all__ = [
    "SQUEUE_ALL",
    "DataParser",
    "ExitStatus",
    "HostlistError",
    "JobInfo",
    "JobsDocument",
    "LocalRunner",
    "NodeInfo",
    "NodesDocument",
    "Runner",
    "SlurmCommandError",
    "SlurmFormatError",
    "detect",
    "expand_hostlist",
    "known_versions",
    "load_document",
    "parse_jobs",
    "parse_nodes",
    "parse_scontrol_line",
    "parse_sinfo",
    "read_jobs",
    "read_nodes",
    "read_sinfo",
    "show_job",
    "show_node",
]
