"""Bounds on what a client may ask for, shared by the API, the console and the audit CLI."""

from __future__ import annotations

from datetime import timedelta

from sinks.audit_queries import parse_since

# Ten years: further back than any audit, and far from the overflow of a timestamp.
MAX_LOOKBACK_DAYS = 3660
MAX_LOOKBACK = timedelta(days=MAX_LOOKBACK_DAYS)


def bounded_since(text: str) -> timedelta:
    """'30m', '24h', '7d' -> timedelta, at most MAX_LOOKBACK; ValueError says what is expected."""
    window = parse_since(text)
    if window > MAX_LOOKBACK:
        raise ValueError(f"{text!r} reaches back more than {MAX_LOOKBACK_DAYS} days")
    return window
