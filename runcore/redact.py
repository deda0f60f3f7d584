"""What we print or record about a root: credentials redacted, control characters escaped.

A root URL may carry a password (``sftp://user:password@host/...``, ``webhdfs://...``,
fsspec reads it from there) or a signed query (``?X-Amz-Signature=...``, ``?token=...``);
log lines and events end up in shared job logs, dashboards and bug reports, so the secret
is replaced by ``***`` before anything is written (:func:`redact`, :func:`redact_fields`).
Text read from a root (names, reasons, manifest fields) is controlled by whoever can write
there: terminal escape sequences and carriage returns in it are escaped (:func:`safe_text`),
so a log line cannot repaint the terminal or pose as another line.

:func:`install_log_redaction` applies both to every log record of this project's loggers
(``ckpt``, ``elastic``, ``trainer``, ``runcore``, ``warmstart`` and their children), whatever
handler the user configured, through the log record factory; importing ``ckpt`` or
``elastic`` installs it. Standard library only (like all of ``runcore``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"

_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^/@\s:]*):[^/@\s]+@")
"""``scheme://user:secret@``: the secret (the user name stays, it helps and is not secret)."""
_QUERY_SECRET = re.compile(
    r"(?i)([?&][A-Za-z0-9_.\-]*(?:token|signature|secret|password|passwd|credential|sig|key)"
    r"[A-Za-z0-9_.\-]*=)[^&#\s\"']+"
)
"""A query parameter whose name says it holds a secret (``X-Amz-Signature``, ``token``)."""
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""Control characters but newline and tab, and the bidirectional overrides."""

PROJECT_LOGGERS = ("ckpt", "elastic", "trainer", "runcore", "warmstart")


def redact(text: str) -> str:
    """``text`` with every URL's password and secret-named query value replaced by ``***``."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(rf"\1:{MASK}@", text)
    return _QUERY_SECRET.sub(rf"\1{MASK}", text)


def escape_controls(text: str) -> str:
    """Control characters (but newline and tab) as ``\\xNN``/``\\uNNNN`` escapes."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def safe_text(text: object) -> str:
    """``str(text)`` redacted and with its control characters escaped."""
    return escape_controls(redact(str(text)))


def redact_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` (an event's) with every string value, nested ones too, :func:`safe_text`."""
    return {key: _redact_value(value) for key, value in fields.items()}


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, Mapping):
        return {k: _redact_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_redact_value(v) for v in value)
    return value


def _is_ours(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PROJECT_LOGGERS)


def _log_arg(arg: Any) -> Any:
    if isinstance(arg, str):
        return safe_text(arg)
    if isinstance(arg, BaseException | Mapping | list | tuple) or hasattr(arg, "__fspath__"):
        text = str(arg)
        cleaned = safe_text(text)
        return arg if cleaned == text else cleaned
    return arg


def _clean_record(record: logging.LogRecord) -> None:
    if isinstance(record.msg, str):
        record.msg = safe_text(record.msg)
    args = record.args
    if isinstance(args, tuple):
        record.args = tuple(_log_arg(a) for a in args)
    elif isinstance(args, Mapping):
        record.args = {k: _log_arg(v) for k, v in args.items()}


class RedactingStream:
    """A text stream whose writes are :func:`redact`-ed (a CLI's stdout and stderr: each
    ``print`` writes a whole line, so a URL is never split across writes)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_installed: list[Any] = []


def install_log_redaction() -> None:
    """Wrap the log record factory so that records of :data:`PROJECT_LOGGERS` are cleaned
    (idempotent; a factory installed later by someone else keeps calling ours)."""
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if _is_ours(record.name):
            try:
                _clean_record(record)
            except Exception:  # never lose a log line over its cleaning
                pass
        return record

    _installed.append(factory)
    logging.setLogRecordFactory(factory)
