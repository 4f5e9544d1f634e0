"""Events sent again, or discarded, by filter: ``outbox_resend()`` and
``outbox_discard()`` (docs/reference/sql-api.md), through whatever
connection the application has, as the outbox's owner (the functions
refuse any other role). Each call acts on at most ``max_events`` events,
oldest first, and returns how many: call again while it returns
``max_events``. The functions check every filter and name the argument
they refuse.

- :func:`resend`: events already sent or dead-lettered (dispatched,
  processed, failed) back in line, their retries reset;
- :func:`discard`: events not sent yet, or dead-lettered (pending,
  failed), deleted: never sent.

Neither needs the caller's transaction: on a connection in autocommit
mode each call commits by itself, in a transaction it is part of it.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any, Iterable, Optional, Tuple, Union

from outbox_dispatch.call import Call, with_connection

#: The filters, named as the functions name them.
FILTERS = ("ids", "queue", "task", "event_type", "status", "created_after", "created_before", "max_events")

# Every argument as text, cast by the statement: the same for every driver.
_ARGUMENTS = (
    "ids => CAST({0} AS pg_catalog.uuid[]), queue => CAST({1} AS pg_catalog.text), "
    "task => CAST({2} AS pg_catalog.text), event_type => CAST({3} AS pg_catalog.text), "
    "status => CAST({4} AS outbox.event_status), created_after => CAST({5} AS pg_catalog.timestamptz), "
    "created_before => CAST({6} AS pg_catalog.timestamptz), max_events => CAST({7} AS pg_catalog.int4)"
)
RESEND = Call(f"SELECT outbox_resend({_ARGUMENTS})", FILTERS)
DISCARD = Call(f"SELECT outbox_discard({_ARGUMENTS})", FILTERS)

Moment = Union[dt.datetime, str]


def chosen(
    *,
    ids: Optional[Iterable[Union[str, uuid.UUID]]] = None,
    queue: Optional[str] = None,
    task: Optional[str] = None,
    event_type: Optional[str] = None,
    status: Optional[str] = None,
    created_after: Optional[Moment] = None,
    created_before: Optional[Moment] = None,
    max_events: int = 1000,
) -> Tuple[Optional[str], ...]:
    """The filters of :func:`resend` and :func:`discard`, as the
    functions' arguments: ``ids`` (UUIDs), ``queue``, ``task``,
    ``event_type``, ``status``, the events created at or after
    ``created_after`` and before ``created_before`` (datetimes, naive
    meaning UTC, or timestamps as PostgreSQL reads them), and at most
    ``max_events`` (1 to 100,000). Give at least one filter."""
    try:
        id_list = None if ids is None else "{" + ",".join(str(uuid.UUID(str(i))) for i in ids) + "}"
    except ValueError as e:
        raise ValueError(f"ids: each must be a UUID ({e})") from None
    if isinstance(max_events, bool) or not isinstance(max_events, int):
        raise TypeError(f"max_events must be an integer, not {type(max_events).__name__}")
    return (id_list, queue, task, event_type, status, _moment(created_after), _moment(created_before),
            str(max_events))


def _moment(value: Optional[Moment]) -> Optional[str]:
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo is not None else value.replace(tzinfo=dt.timezone.utc)).isoformat()
    return value


@with_connection(chosen)
def resend(conn: Any, *args: Any, **kwargs: Any) -> int:
    """Sends again up to ``max_events`` events already sent or
    dead-lettered that the filters name (:func:`chosen`), on ``conn`` (a
    DB-API connection or cursor, Django's, or a SQLAlchemy ``Connection``
    or ``Session``); returns how many."""
    return int(RESEND.scalar(conn, chosen(*args, **kwargs), "resend"))


@with_connection(chosen)
def discard(conn: Any, *args: Any, **kwargs: Any) -> int:
    """Deletes up to ``max_events`` events not sent yet, or dead-lettered,
    that the filters name (:func:`chosen`), on ``conn``; returns how many."""
    return int(DISCARD.scalar(conn, chosen(*args, **kwargs), "discard"))
