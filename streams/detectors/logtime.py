"""Moved: log-line timestamps are read by `schemas.timestamps`, the one reader the kernel producer
shares. These names stay importable for `trainmedic/diagnose.py` until it imports them from there;
then this module goes."""

from schemas.timestamps import PLACEHOLDER_YEAR, FileClock, parse_stamp, reference_time, resolve_year
from schemas.timestamps import Stamp as RawStamp

__all__ = ["PLACEHOLDER_YEAR", "FileClock", "RawStamp", "parse_stamp", "reference_time", "resolve_year"]
