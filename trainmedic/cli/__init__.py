"""The `trainmedic` command: one module per noun (audit, mode, nodes, run, ...), `main` the entry point.

May import every other trainmedic package; nothing imports it back.
"""
