"""Text from the bus or the audit, made safe to print on a terminal: the one escaping helper.

A value an outside party chose (a node name of an NVSentinel event written before node names
were checked, a job's comment, a log line) can carry a newline that forges a row of a table, or
an ANSI escape that recolours, moves the cursor or clears the screen. Every CLI line or table
cell that shows such a value passes it through `printable`: control characters come out as
Python writes them in a repr (``\\n``, ``\\r``, ``\\t``, ``\\x1b``, ``\\x9b``, ``\\u202e``), so
they are seen, never acted on; printable text is returned unchanged (and unallocated).
"""

from __future__ import annotations

__all__ = ["printable"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(value: object) -> str:
    """`value` as text with every character Python does not call printable escaped: the C0 and C1
    controls (ESC, CSI), DEL, line and paragraph separators, bidi overrides and other format
    characters, and spaces other than ' '. A backslash stays as it is."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)
