"""A folder to put first on a child process's PYTHONPATH: its `pynvml` is the fake (see pynvml.py)."""
