"""enqueue() and publish(): a Celery task, or an event for every subscribed
task, into ``outbox.events``, in the caller's transaction.

The vocabulary is Celery's ``apply_async``; the row is what
``outbox_enqueue()`` (the extension's SQL function) makes of it, so every
argument is checked there, with errors that name it. Nothing is sent until
the caller's transaction commits, and nothing at all if it rolls back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import uuid
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple, Union

from outbox_dispatch.call import AutocommitError, Call, in_autocommit, refuse_asynchronous, with_connection

#: Seconds, a timedelta, or (for ``expires``) an absolute datetime, as Celery takes them.
Seconds = Union[int, float, dt.timedelta]

# Named arguments: the call does not depend on the function's order of them.
# outbox_enqueue resolves through the connection's search_path: the
# extension's schema (public by default) must be on it.
# CAST rather than "::": SQLAlchemy would read ":name::type" as no parameter.
ENQUEUE = Call(
    "SELECT outbox_enqueue(event_type => {0}, payload => CAST({1} AS jsonb), queue => {2}, task => {3}, "
    "headers => CAST({4} AS jsonb), delay => CAST({5} AS interval), priority => CAST({6} AS integer), "
    "expires => CAST({7} AS interval), args => CAST({8} AS jsonb), ordering_key => {9})",
    ("event_type", "payload", "queue", "task", "headers", "delay", "priority", "expires", "args", "ordering_key"),
)


def enqueued(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    *,
    queue: Optional[str] = None,
    countdown: Optional[Seconds] = None,
    eta: Optional[dt.datetime] = None,
    expires: Optional[Union[Seconds, dt.datetime]] = None,
    priority: Optional[int] = None,
    headers: Optional[Mapping[str, Any]] = None,
    event_type: Optional[str] = None,
    ordering_key: Optional[str] = None,
    allow_autocommit: bool = False,
) -> Event:
    """The :class:`Event` of :func:`enqueue`: its arguments but ``conn``."""
    task_name = task_name_of(task)
    return Event("enqueue", event_type or task_name, task_name, args, kwargs, queue, countdown, eta, expires,
                 priority, headers, ordering_key, allow_autocommit)


@with_connection(enqueued)
def enqueue(conn: Any, *args: Any, **kwargs: Any) -> uuid.UUID:
    """Enqueue ``task`` in the transaction of ``conn``; returns the event id,
    which is also the Celery task id.

    ``conn`` is a DB-API connection or cursor (psycopg 3, psycopg2, Django's
    ``connection``) or a SQLAlchemy ``Connection`` or ``Session``. ``task`` is
    a Celery task or its name. ``args`` and ``kwargs`` both reach the task.
    ``countdown`` (seconds) or ``eta`` (a datetime; naive means UTC) delays
    it; ``expires`` (seconds from now, or a datetime) drops it if it is not
    delivered by then. ``priority`` is 0 (highest) to 9, as kombu's Redis
    transport orders them. ``event_type`` defaults to the task's name.

    With ``ordering_key`` (1 to 255 bytes: ``"order:42"``), the task runs
    only once every earlier event of that key has finished, in the order
    the transactions that enqueued them committed (docs/guides/per-key-order.md). The transaction then holds the key's lock until it ends:
    another transaction enqueuing for the same key waits for it. Enqueue
    for several keys in one transaction in a consistent (sorted) order.

    With OpenTelemetry active, the current trace context travels in the
    message headers (``traceparent``, ``tracestate``); called inside a
    running Celery task, the new task's ``parent_id`` and ``root_id`` chain
    to it.

    A connection in autocommit mode (psycopg's and psycopg2's
    ``autocommit``, an SQLAlchemy ``AUTOCOMMIT`` connection, Django outside
    ``transaction.atomic()``) would commit the event at once, whatever
    becomes of the work it belongs to: :class:`AutocommitError`, unless
    ``allow_autocommit=True`` says that is meant.
    """
    return _send(conn, enqueued(*args, **kwargs))


def published(
    event_type: str,
    payload: Optional[Mapping[str, Any]] = None,
    *,
    queue: Optional[str] = None,
    countdown: Optional[Seconds] = None,
    eta: Optional[dt.datetime] = None,
    expires: Optional[Union[Seconds, dt.datetime]] = None,
    priority: Optional[int] = None,
    headers: Optional[Mapping[str, Any]] = None,
    ordering_key: Optional[str] = None,
    allow_autocommit: bool = False,
) -> Event:
    """The :class:`Event` of :func:`publish`: its arguments but ``conn``."""
    if not isinstance(event_type, str) or not event_type:
        raise TypeError(f"publish: event_type must be a non-empty string, not {event_type!r}")
    return Event("publish", event_type, None, (), payload, queue, countdown, eta, expires, priority, headers,
                 ordering_key, allow_autocommit)


@with_connection(published)
def publish(conn: Any, *args: Any, **kwargs: Any) -> uuid.UUID:
    """Publish ``event_type`` in the transaction of ``conn``, for every task
    subscribed to it (``outbox_subscribe()``); returns the event id.

    Each subscription gets a delivery of its own, a Celery task with
    ``payload`` as its keyword arguments and an id of its own (the event's
    deliveries are in ``outbox.deliveries``); an accumulated subscription
    gets the event in its next batch. With no subscription for it, the event
    goes to the task named like ``event_type``. The other arguments are
    :func:`enqueue`'s (a subscription's queue and priority, when it has
    them, win); with ``ordering_key``, each subscribed task gets the events
    of that key one at a time, in order.
    """
    return _send(conn, published(*args, **kwargs))


@dataclasses.dataclass(frozen=True)
class Event:
    """What :func:`enqueue` or :func:`publish` (``caller``) was asked to put
    into ``outbox.events``, and its checks, whatever the connection."""

    caller: str
    event_type: str
    task: Optional[str]
    args: Sequence[Any]
    kwargs: Optional[Mapping[str, Any]]
    queue: Optional[str]
    countdown: Optional[Seconds]
    eta: Optional[dt.datetime]
    expires: Optional[Union[Seconds, dt.datetime]]
    priority: Optional[int]
    headers: Optional[Mapping[str, Any]]
    ordering_key: Optional[str]
    allow_autocommit: bool

    def check(self) -> None:
        """What is refused before the connection is used."""
        if self.countdown is not None and self.eta is not None:
            raise ValueError(f"{self.caller}: give countdown or eta, not both")
        if self.ordering_key is not None and not isinstance(self.ordering_key, str):
            raise TypeError(
                f"{self.caller}: ordering_key must be a string or None, not {type(self.ordering_key).__name__}"
            )

    def refuse_autocommit(self, autocommit: bool) -> None:
        """Raises :class:`AutocommitError` for a connection in autocommit
        mode, unless the caller said it is meant."""
        if autocommit and not self.allow_autocommit:
            raise AutocommitError(
                f"{self.caller}: the connection is in autocommit mode: the event would be committed at once, "
                "whatever becomes of the work it belongs to. Call it inside a transaction (conn.transaction(), "
                "transaction.atomic(), session.begin(), autocommit off), or pass allow_autocommit=True if that "
                "is meant."
            )

    def parameters(self) -> Tuple[Any, ...]:
        """outbox_enqueue()'s arguments (ENQUEUE's names), the trace context
        in the headers: inside :func:`producer_span`."""
        now = dt.datetime.now(dt.timezone.utc)
        return (
            self.event_type,
            _dumps(dict(self.kwargs or {}), "kwargs" if self.task else "payload", self.caller),
            self.queue,
            self.task,
            _dumps(_headers(self.headers), "headers", self.caller),
            _interval(_delay(self.countdown, self.eta, now)),
            0 if self.priority is None else self.priority,
            _interval(_until(self.expires, now)),
            _dumps(list(self.args), "args", self.caller) if self.args else None,
            self.ordering_key,
        )


def _send(conn: Any, event: Event) -> uuid.UUID:
    refuse_asynchronous(conn, event.caller)
    event.check()
    event.refuse_autocommit(in_autocommit(conn))
    with producer_span(event.queue) as span:
        return sent(span, ENQUEUE.scalar(conn, event.parameters(), event.caller))


def sent(span: Any, value: Any) -> uuid.UUID:
    """The event id outbox_enqueue() returned, on the producer's span."""
    event_id = value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
    if span is not None:
        span.set_attribute("messaging.message.id", str(event_id))
    return event_id


@contextlib.contextmanager
def producer_span(queue: Optional[str]) -> Iterator[Any]:
    """With OpenTelemetry, a PRODUCER span around the enqueue, as the
    messaging semantic conventions name it (``send {queue}``; the queue
    left to ``outbox.default_queue`` is not known here: ``send``). The trace
    context the message carries is this span's, so that the worker's span
    is its child."""
    try:
        from opentelemetry import trace
    except ImportError:
        yield None
        return
    attributes = {"messaging.system": "celery", "messaging.operation.type": "send",
                  "messaging.operation.name": "send"}
    if queue:
        attributes["messaging.destination.name"] = queue
    tracer = trace.get_tracer("outbox_dispatch")
    with tracer.start_as_current_span(f"send {queue}" if queue else "send", kind=trace.SpanKind.PRODUCER,
                                      attributes=attributes) as span:
        yield span


def task_name_of(task: Any) -> str:
    name = task if isinstance(task, str) else getattr(task, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"enqueue: task must be a Celery task or a task name, not {type(task).__name__}")
    return name


def _delay(countdown: Optional[Seconds], eta: Optional[dt.datetime], now: dt.datetime) -> Optional[float]:
    if countdown is not None:
        return _seconds(countdown)
    if eta is not None:
        return max(0.0, (_aware(eta) - now).total_seconds())
    return None


def _until(expires: Optional[Union[Seconds, dt.datetime]], now: dt.datetime) -> Optional[float]:
    if expires is None:
        return None
    if isinstance(expires, dt.datetime):
        return (_aware(expires) - now).total_seconds()
    return _seconds(expires)


def _seconds(value: Seconds) -> float:
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return float(value)


def _aware(moment: dt.datetime) -> dt.datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.timezone.utc)


def _interval(seconds: Optional[float]) -> Optional[str]:
    # Out-of-range values (a negative delay, an expiry in the past) are
    # refused by outbox_enqueue(), which names the argument.
    return None if seconds is None else f"{seconds:.6f} seconds"


def _headers(given: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """The caller's headers over the trace context and the running task."""
    headers: Dict[str, Any] = {}
    headers.update(_trace_context())
    headers.update(_lineage())
    headers.update(given or {})
    return headers or None


def _trace_context() -> Dict[str, str]:
    try:
        from opentelemetry import propagate
    except ImportError:
        return {}
    carrier: Dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def _lineage() -> Dict[str, str]:
    """``parent_id``/``root_id`` of a task enqueued from a running task."""
    try:
        from celery import current_task
    except ImportError:
        return {}
    request = getattr(current_task, "request", None) if current_task else None
    parent = getattr(request, "id", None)
    if not parent or getattr(request, "called_directly", True):
        return {}
    return {"parent_id": parent, "root_id": getattr(request, "root_id", None) or parent}


def _dumps(value: Any, what: str, caller: str) -> Optional[str]:
    """JSON as the worker will read it: kombu's encoder when Celery is
    installed (datetimes, UUIDs and decimals come back as such), else the
    standard library's."""
    if value is None:
        return None
    try:
        from kombu.utils.json import dumps as kombu_dumps

        encode: Callable[[Any], str] = kombu_dumps
    except ImportError:
        encode = json.dumps
    try:
        return encode(value)
    except TypeError as e:
        raise TypeError(f"{caller}: {what} cannot be sent as JSON: {e}") from None

