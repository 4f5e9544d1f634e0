"""Reports: what a Celery worker tells the outbox became of a task.

A report is one JSON object appended to the Redis list the message named in
its ``outbox_report_to`` header; the dispatchers inside PostgreSQL read the
list and record each outcome. This module only builds them: no I/O.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

#: The message header naming the list to report to (set by the dispatchers).
REPORT_TO_HEADER = "outbox_report_to"

#: The most of a traceback a report carries: its end, where the error is.
MAX_TRACEBACK_CHARS = 3000


def report_key(headers: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The list to report to, or None for a message that did not come from
    the outbox (or whose dispatchers asked for no reports)."""
    if not headers:
        return None
    key = headers.get(REPORT_TO_HEADER)
    return key if isinstance(key, str) and key else None


def processed(task_id: str) -> bytes:
    return _encode({"id": task_id, "outcome": "processed"})


def failed(task_id: str, error: str) -> bytes:
    return _encode({"id": task_id, "outcome": "failed", "error": error})


def describe_exception(exception: BaseException, traceback: Optional[str] = None) -> str:
    """``Type: message``, then the end of the traceback, if any."""
    name = type(exception).__qualname__
    module = type(exception).__module__
    if module not in ("builtins", "__main__"):
        name = f"{module}.{name}"
    text = f"{name}: {exception}" if str(exception) else name
    if traceback:
        tail = traceback.rstrip()
        if len(tail) > MAX_TRACEBACK_CHARS:
            tail = "… (trimmed)\n" + tail[-MAX_TRACEBACK_CHARS:]
        text = f"{text}\n{tail}"
    return text


def _encode(report: Mapping[str, str]) -> bytes:
    return json.dumps(report, separators=(",", ":"), ensure_ascii=False).encode()
