"""What this process is: version and Python, as `trainmedic --version` and `trainmedic_build_info` say."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import Info


def package_version() -> str:
    try:
        return version("trainmedic")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


VERSION = package_version()
BUILD_INFO = Info("trainmedic_build", "The running trainmedic's version and Python")
BUILD_INFO.info({"version": VERSION, "python": platform.python_version()})
