"""Reports: what a Celery worker tells the outbox became of a task.

A report is one JSON object appended to the Redis list the message named in
its ``outbox_report_to`` header; the dispatchers inside PostgreSQL read the
list and record each outcome. It names the send it answers (the message's
``outbox_send`` header, new at every send): the dispatchers take it only for
that send. This module only builds them: no I/O.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

#: The message header naming the list to report to (set by the dispatchers).
REPORT_TO_HEADER = "outbox_report_to"

#: The message header naming this send of the event.
SEND_HEADER = "outbox_send"

#: The most of a traceback a report carries: its end, where the error is.
MAX_TRACEBACK_CHARS = 3000

#: The most bytes of a report (the dispatchers drop larger ones unread,
#: core/src/report.rs MAX_REPORT_BYTES is 16 KiB): its error is cut to fit.
MAX_REPORT_BYTES = 12 * 1024


def report_key(headers: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The list to report to, or None for a message that did not come from
    the outbox (or whose dispatchers asked for no reports)."""
    if not headers:
        return None
    key = headers.get(REPORT_TO_HEADER)
    return key if isinstance(key, str) and key else None


def send_id(headers: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The send a message is, as its ``outbox_send`` header names it."""
    send = headers.get(SEND_HEADER) if headers else None
    return send if isinstance(send, str) and send else None


def processed(task_id: str, send: str, duplicate: bool = False) -> bytes:
    """A success report; ``duplicate`` says the run found its message
    claimed already (:func:`outbox_dispatch.inbox.once`) and skipped its
    body. The dispatchers take it as processed either way."""
    body: dict[str, Any] = {"id": task_id, "send": send, "outcome": "processed"}
    if duplicate:
        body["duplicate"] = True
    return _encode(body)


def failed(task_id: str, send: str, error: str) -> bytes:
    """A failure report, its error cut (keeping its start, where the
    exception's type and message are) so that the report fits in
    MAX_REPORT_BYTES whatever the exception's text."""
    body = _encode({"id": task_id, "send": send, "outcome": "failed", "error": error})
    keep = len(error)
    while len(body) > MAX_REPORT_BYTES and keep > 0:
        keep = keep * MAX_REPORT_BYTES // len(body) - 64
        body = _encode({"id": task_id, "send": send, "outcome": "failed",
                        "error": error[:max(keep, 0)] + " … (cut)"})
    return body


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


def _encode(report: Mapping[str, Any]) -> bytes:
    # An exception's text may hold lone surrogates (bytes decoded with
    # surrogateescape): replaced, so that the report is still sent.
    return json.dumps(report, separators=(",", ":"), ensure_ascii=False).encode("utf-8", errors="replace")
