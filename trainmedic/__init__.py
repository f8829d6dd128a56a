"""trainmedic: workload-level recovery for distributed AI training (CLI and wiring)."""

__version__ = "0.1.0"
