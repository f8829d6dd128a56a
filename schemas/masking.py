"""The one way secrets are kept out of what a process prints, logs or serves.

`mask(text)` is the function every message, log record, banner, API error, probe answer and
bundle goes through. It replaces

- the password of every URL in the text (``scheme://user:PASSWORD@host``),
- the value of every secret-looking URL query parameter (``?password=``, ``&access_token=``,
  ``api_key``, ``secret``, ``sig``, ``signature``, ``X-Amz-Credential`` ...),
- every secret value this process knows, anywhere in the text: raw, URL-quoted or JSON-escaped,

with `MASK`. A process learns its secrets with `remember` (the settings model remembers every
secret setting it loads, flags included; token files remember what they read), and `install`
(done by `trainmedic.settings.apply`, which every process calls first) masks every log record of
every logger and handler, its traceback included, and the traceback of an uncaught exception.

Values shorter than `MIN_SECRET_LEN` are not replaced in free text (each would garble every word
that contains it); inside URLs they are masked all the same.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, quote, quote_plus, unquote, urlsplit

MASK = "********"
MIN_SECRET_LEN = 6

# scheme://user:password@ : the password runs to the last '@' before the host (a raw '@' in it too).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s/?#@:'\"<>]*:)([^\s/?#'\"<>]*)@")
# Query parameters whose value is a credential, by their name or its last part (access_token, X-Amz-Signature).
_PARAM_NAMES = r"password|passwd|pwd|pass|token|secret|key|apikey|sig|signature|auth|credentials?|jwt"
_PARAM_NAME = rf"(?:[a-z0-9._-]*[_.-])?(?:{_PARAM_NAMES})"
_PARAM = re.compile(rf"(?i)([?&;]{_PARAM_NAME}=)([^&#\s'\"<>]+)")
_SECRET_PARAM = re.compile(rf"(?i)^{_PARAM_NAME}$")

_lock = threading.Lock()
_known: set[str] = set()
_ordered: tuple[str, ...] = ()  # longest first: a secret that contains another is masked whole
_installed = False


def mask(text: str, extra: Iterable[str | None] = ()) -> str:
    """`text` with every URL password, secret query value and known secret (and `extra`) as MASK."""
    if not text:
        return text
    values = _ordered
    if extra:
        values = tuple(sorted({*values, *_forms(extra)}, key=len, reverse=True))
    for value in values:
        if value in text:
            text = text.replace(value, MASK)
    if "://" in text:
        text = _USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@" if m.group(2) else m.group(0), text)
    if "=" in text:
        text = _PARAM.sub(lambda m: m.group(1) + MASK, text)
    return text


def remember(*values: str | None) -> None:
    """Secrets of this process: `mask` replaces them from now on, wherever they show.

    A URL's secrets are its password and secret query values (its host stays readable)."""
    found = _forms(values)
    if not found - _known:
        return
    global _ordered
    with _lock:
        _known.update(found)
        _ordered = tuple(sorted(_known, key=len, reverse=True))


def _forms(values: Iterable[str | None]) -> set[str]:
    out: set[str] = set()
    for value in values:
        if not value:
            continue
        for secret in _url_secrets(value) if "://" in value else [value]:
            # As given, URL-quoted both ways, and inside a JSON string (a health report, a bundle's files).
            quoted = (unquote(secret), quote(secret, safe=""), quote_plus(secret, safe=""))
            for form in (secret, *quoted, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]):
                if len(form) >= MIN_SECRET_LEN:
                    out.add(form)
    return out


def _url_secrets(url: str) -> list[str]:
    try:
        parts = urlsplit(url.strip())
        password = parts.password
    except ValueError:
        return [url]  # not a URL after all: the whole value is the secret
    found = [v for k, v in parse_qsl(parts.query) if _SECRET_PARAM.match(k)]
    # The raw (still quoted) password too: a URL printed as given holds that form.
    raw = parts.netloc.rpartition("@")[0].partition(":")[2] if "@" in parts.netloc else ""
    return [s for s in (password, raw, *found) if s]


def install() -> None:
    """Mask every log record this process makes (message, arguments, traceback, stack), whatever
    logger, handler or formatter writes it, and the traceback of an exception nobody caught."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        _mask_record(record)
        return record

    logging.setLogRecordFactory(factory)
    sys.excepthook = _masked_hook(sys.excepthook)
    threading.excepthook = _masked_thread_hook(threading.excepthook)


def _mask_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a bad format: logging reports it when the record is written
        return
    masked = mask(message)
    if masked != message:
        record.msg, record.args = masked, None
    if record.exc_info and record.exc_info[0] is not None:
        text = logging.Formatter().formatException(record.exc_info)
        masked = mask(text)
        if masked != text:
            record.exc_text = masked  # the formatter writes this instead of formatting the traceback
    if record.stack_info:
        record.stack_info = mask(record.stack_info)


def masked_traceback(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> str:
    import traceback

    return mask("".join(traceback.format_exception(exc_type, exc, tb)))


def _masked_hook(
    previous: Callable[[type[BaseException], BaseException, TracebackType | None], Any],
) -> Callable[[type[BaseException], BaseException, TracebackType | None], Any]:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            previous(exc_type, exc, tb)
            return
        sys.stderr.write(masked_traceback(exc_type, exc, tb))

    return hook


def _masked_thread_hook(previous: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def hook(args: Any) -> None:
        if args.exc_type is SystemExit or args.exc_value is None:
            previous(args)
            return
        name = args.thread.name if args.thread is not None else "?"
        sys.stderr.write(f"Exception in thread {name}:\n")
        sys.stderr.write(masked_traceback(args.exc_type, args.exc_value, args.exc_traceback))

    return hook
