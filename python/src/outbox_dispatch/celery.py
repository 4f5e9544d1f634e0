"""Report the outcome of every task that came from the outbox.

Import this module in a Celery app (``app.conf.imports =
["outbox_dispatch.celery"]``, or a plain import in the app's module) and
every worker of it, in any pool (prefork, threads, solo), reports the final
outcome of each message the outbox_dispatch dispatchers sent, through the
worker's broker (Redis or RabbitMQ), to the list or queue the message names
in its ``outbox_report_to`` header. The dispatchers read it and record the
outcome in ``outbox.events``:

- the task returned: ``processed``;
- it raised, after its own retries (``self.retry()`` and ``autoretry_for``
  report only the final outcome): ``failed``, with the exception and the end
  of its traceback;
- the worker refused the message (unregistered task, expired, revoked,
  rejected, the process running it lost): ``failed``, saying why.

Messages without that header (sent by ``apply_async`` and the like) are
left alone. Workers need no database credentials: reports travel on the
broker connection the worker already has.

A report that cannot be sent (the broker is down through every attempt) is
logged; its event stays ``dispatched``, as it would be without this module.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Mapping, Optional

import amqp
from celery import Celery, signals

from outbox_dispatch import inbox, report

logger = logging.getLogger(__name__)

#: Attempts to append one report, and the pause between them.
ATTEMPTS = 3
PAUSE_SECONDS = 0.5

#: The longest one AMQP send of a report waits for the broker's confirm (or
#: for its socket).
TIMEOUT_SECONDS = 10.0


def _request_headers(request: Any) -> Mapping[str, Any]:
    """The message's own headers, as a task request holds them. Protocol 2
    spreads custom headers over the request; a retried message carries them
    in ``request.headers``."""
    key = getattr(request, report.REPORT_TO_HEADER, None)
    if key is not None:
        return {report.REPORT_TO_HEADER: key, report.SEND_HEADER: getattr(request, report.SEND_HEADER, None)}
    headers = getattr(request, "headers", None)
    return headers if isinstance(headers, Mapping) else {}


class _Link:
    """This process's broker connection for reports: opened at the first
    report, kept, opened afresh after a fork (prefork children) or an error.

    On Redis a report is an RPUSH through the broker's own client, which is
    safe to share between threads. On RabbitMQ (kombu's py-amqp transport)
    it is a persistent message published to the report queue through the
    default exchange, ``mandatory`` and with publisher confirms: the send
    returns once the broker has the report, and raises if it would drop it.
    An AMQP channel is not shared between threads: those sends hold the
    lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._connection: Any = None
        self._client: Any = None
        self._amqp = False

    def _open(self, app: Celery) -> None:
        if self._connection is not None and self._pid == os.getpid():
            return
        # On AMQP: publisher confirms, and no wait without a deadline (a
        # blocked connection, an alarm, never acks: the send times out and
        # is tried again, then logged). Redis's transport ignores these.
        connection = app.connection_for_write(transport_options={
            **(app.conf.broker_transport_options or {}), "confirm_publish": True,
            "read_timeout": TIMEOUT_SECONDS, "write_timeout": TIMEOUT_SECONDS})
        self._amqp = connection.transport.driver_type == "amqp"
        self._client = connection.default_channel if self._amqp else connection.default_channel.client
        self._connection, self._pid = connection, os.getpid()

    def append(self, app: Celery, key: str, body: bytes) -> None:
        """Appends ``body`` to the report list (Redis) or queue (AMQP) ``key``."""
        with self._lock:
            self._open(app)
            client, amqp_transport = self._client, self._amqp
            if amqp_transport:
                client.basic_publish(
                    amqp.Message(body, content_type="application/json", content_encoding="utf-8",
                                 delivery_mode=2),
                    exchange="", routing_key=key, mandatory=True, confirm_timeout=TIMEOUT_SECONDS)
                return
        client.rpush(key, body)

    def drop(self) -> None:
        with self._lock:
            connection, self._connection, self._client = self._connection, None, None
        if connection is not None and self._pid == os.getpid():
            try:
                connection.release()
            except Exception:  # already broken: nothing to release cleanly
                pass


_link = _Link()


def _send(app: Celery, key: str, task_id: str, body: bytes) -> None:
    """Appends one report to ``key`` on the broker, with a few attempts; a
    report that cannot be sent is logged, never raised: the task's own
    outcome must not change because of it."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            _link.append(app, key, body)
            return
        except Exception as exc:  # the broker's errors vary by transport and client
            _link.drop()
            if attempt == ATTEMPTS:
                logger.error("outbox_dispatch: could not report the outcome of task %s to %r: %r",
                             task_id, key, exc)
                return
            time.sleep(PAUSE_SECONDS)


def _report_request(app: Celery, request: Any, task_id: Optional[str], outcome: Optional[str] = None,
                    error: Optional[str] = None) -> None:
    """Reports on a task's request: ``processed`` when outcome says so, else
    ``failed`` with ``error``."""
    headers = _request_headers(request)
    key, send = report.report_key(headers), report.send_id(headers)
    task_id = task_id or getattr(request, "id", None)
    if key is None or send is None or not task_id:
        return
    if outcome == "processed":
        body = report.processed(task_id, send, duplicate=getattr(request, inbox.DUPLICATE_ATTRIBUTE, False) is True)
    else:
        body = report.failed(task_id, send, error or "failed")
    _send(app, key, task_id, body)


def _on_success(sender: Any = None, **_: Any) -> None:
    request = sender.request
    if request.id:
        _report_request(sender.app, request, request.id, outcome="processed")


def _on_failure(sender: Any = None, task_id: Optional[str] = None, exception: Optional[BaseException] = None,
                einfo: Any = None, **_: Any) -> None:
    traceback = getattr(einfo, "traceback", None)
    error = report.describe_exception(exception, traceback) if exception is not None else "failed"
    _report_request(sender.app, sender.request, task_id, error=error)


def _on_internal_error(sender: Any = None, task_id: Optional[str] = None, request: Any = None,
                       exception: Optional[BaseException] = None, einfo: Any = None, **_: Any) -> None:
    traceback = getattr(einfo, "traceback", None)
    described = report.describe_exception(exception, traceback) if exception is not None else "unknown"
    _report_request(sender.app, request, task_id, error=f"Celery internal error: {described}")


def _on_revoked(sender: Any = None, request: Any = None, terminated: bool = False, signum: Any = None,
                expired: bool = False, **_: Any) -> None:
    if expired:
        why = "expired before a worker ran it (Celery's expires)"
    elif terminated:
        why = f"revoked and terminated (signal {signum})"
    else:
        why = "revoked before it ran"
    _report_request(sender.app, request, getattr(request, "id", None), error=why)


def _report_message(consumer: Any, message: Any, why: str) -> None:
    headers = getattr(message, "headers", None) or {}
    key, send = report.report_key(headers), report.send_id(headers)
    task_id = headers.get("id")
    if key is not None and send is not None and task_id:
        _send(consumer.app, key, task_id, report.failed(task_id, send, why))


def _on_unknown(sender: Any = None, message: Any = None, name: Optional[str] = None, **_: Any) -> None:
    hostname = getattr(sender, "hostname", None) or "the worker"
    _report_message(sender, message, f"unregistered task {name!r}: {hostname} does not know it")


def _on_rejected(sender: Any = None, message: Any = None, exc: Optional[BaseException] = None,
                 **_: Any) -> None:
    why = f"message rejected by the worker: {report.describe_exception(exc)}" if exc else "message rejected"
    _report_message(sender, message, why)


#: Each Celery signal and what answers it. Connected strongly (the handlers
#: live as long as the module) and once, however often this is imported.
_HANDLERS = (
    (signals.task_success, _on_success),
    (signals.task_failure, _on_failure),
    (signals.task_internal_error, _on_internal_error),
    (signals.task_revoked, _on_revoked),
    (signals.task_unknown, _on_unknown),
    (signals.task_rejected, _on_rejected),
)

for _signal, _handler in _HANDLERS:
    _signal.connect(_handler, weak=False, dispatch_uid=f"outbox_dispatch.{_handler.__name__}")
