"""Which literal text a regular expression cannot match without: a cheap `in` test before a search.

Nearly every line of a training log is healthy progress, and the signature catalog searches each
one with every pattern. A pattern whose first element is not a literal (an optional node prefix, a
word boundary, a case-insensitive branch) makes `re` try a match at every position of the line; a
substring test does not. So each pattern is parsed once (by `re`'s own parser) into what any match
must contain - literal runs that all must appear, or one of several branches - and a line lacking
that is skipped without searching.

Sound by construction: only mandatory parts of the pattern contribute (a repeat that may match zero
times, a negative assertion, a back-reference or anything unknown contribute nothing), so the test
can let through a line the pattern then rejects, never skip a line it would match. Under a
case-insensitive pattern the literals are compared lower-cased, and only where both the literals
and the line are ASCII (Unicode case folding has matches `str.lower` does not see: 'ſ' matches
's'); other lines are searched as before.
Written by hand: no maintained library derives required substrings from a Python pattern.
"""

from __future__ import annotations

import re
import re._constants as sre  # re's own parser; private, but stable across 3.11-3.13
import re._parser as sre_parse
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

MIN_LITERAL = 3  # shorter runs ("a", ": ") are in nearly every line and cost more than they save


@dataclass(frozen=True)
class _All:
    parts: tuple[_Need, ...]


@dataclass(frozen=True)
class _Any:
    options: tuple[_Need, ...]


_Need = str | _All | _Any


def _repeat_ops() -> frozenset[object]:
    ops = {sre.MAX_REPEAT, sre.MIN_REPEAT}
    if hasattr(sre, "POSSESSIVE_REPEAT"):
        ops.add(sre.POSSESSIVE_REPEAT)
    return frozenset(ops)


_REPEATS = _repeat_ops()


def _sequence(items: sre_parse.SubPattern | list[tuple[object, object]]) -> _Need | None:
    parts: list[_Need] = []
    run: list[str] = []

    def flush() -> None:
        if len(run) >= MIN_LITERAL:
            parts.append("".join(run))
        run.clear()

    for op, av in items:
        if op is sre.LITERAL:
            run.append(chr(av))  # type: ignore[arg-type]
            continue
        flush()
        need = _item(op, av)
        if need is not None:
            parts.append(need)
    flush()
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else _All(tuple(parts))


def _item(op: object, av: object) -> _Need | None:
    if op is sre.SUBPATTERN:
        add_flags: int = av[1]  # type: ignore[index]
        del_flags: int = av[2]  # type: ignore[index]
        if (add_flags | del_flags) & re.IGNORECASE:
            return None  # a local case change: the literals inside would compare wrongly
        return _sequence(av[3])  # type: ignore[index]
    if op is sre.BRANCH:
        options = []
        for branch in av[1]:  # type: ignore[index]
            need = _sequence(branch)
            if need is None:
                return None  # one branch needs nothing, so the whole needs nothing
            options.append(need)
        return options[0] if len(options) == 1 else _Any(tuple(options))
    if op in _REPEATS:
        low: int = av[0]  # type: ignore[index]
        return _sequence(av[2]) if low >= 1 else None  # type: ignore[index]
    if op is sre.ASSERT:
        return _sequence(av[1])  # type: ignore[index]  # a positive look-around's text is in the line too
    return None


def _literals(need: _Need) -> list[str]:
    if isinstance(need, str):
        return [need]
    return [lit for part in (need.parts if isinstance(need, _All) else need.options) for lit in _literals(part)]


def _lower(need: _Need) -> _Need:
    if isinstance(need, str):
        return need.lower()
    if isinstance(need, _All):
        return _All(tuple(_lower(p) for p in need.parts))
    return _Any(tuple(_lower(o) for o in need.options))


def _test(need: _Need) -> Callable[[str], bool]:
    """`need` as a function of the line, built once (walking the tree per line cost as much as
    the searches it saved)."""
    if isinstance(need, str):
        return lambda text: need in text
    if isinstance(need, _All):
        if all(isinstance(p, str) for p in need.parts):
            lits = tuple(str(p) for p in need.parts)
            return lambda text: all(lit in text for lit in lits)
        parts = tuple(_test(p) for p in need.parts)
        return lambda text: all(t(text) for t in parts)
    if all(isinstance(o, str) for o in need.options):
        alts = tuple(str(o) for o in need.options)
        return lambda text: any(alt in text for alt in alts)
    options = tuple(_test(o) for o in need.options)
    return lambda text: any(t(text) for t in options)


def _starts_literal(items: sre_parse.SubPattern | list[tuple[object, object]]) -> bool:
    """Whether `re` can find a match's start by a literal scan (its prefix or first-character
    optimisation): then it needs no help."""
    if not items:
        return False
    op, av = items[0]
    if op is sre.LITERAL:
        return True
    if op is sre.BRANCH:
        return all(_starts_literal(b) for b in av[1])  # type: ignore[index]
    if op is sre.SUBPATTERN:
        return _starts_literal(av[3])  # type: ignore[index]
    return False


def required(pattern: str) -> _Need | None:
    """What every match of `pattern` contains (None: nothing known)."""
    parsed = sre_parse.parse(pattern)
    need = _sequence(parsed)
    if need is not None and parsed.state.flags & re.IGNORECASE:
        if not all(lit.isascii() for lit in _literals(need)):
            return None  # 'ſ' matches 's' case-insensitively, and lower() does not say so
        need = _lower(need)
    return need


# Parsing a pattern costs ~1 ms and every SignatureDetector asks for each of its ~300: offline
# diagnosis builds two per run and the accuracy benchmark one per case, so each pattern's test is kept.
@lru_cache(maxsize=4096)
def may_match(pattern: str) -> Callable[[str], bool] | None:
    """A test that is False only for lines `pattern` cannot match (see the module docstring);
    None where the pattern starts with a literal, which `re` already scans for quickly."""
    parsed = sre_parse.parse(pattern)
    need = required(pattern)
    if need is None or (_starts_literal(parsed) and not parsed.state.flags & re.IGNORECASE):
        return None
    test = _test(need)
    if parsed.state.flags & re.IGNORECASE:
        return lambda text: not text.isascii() or test(text.lower())
    return test
