"""Effects once: a task's writes to the database happen once per message,
however many times the message is delivered (the README's "Effects
once").

:func:`claim` calls ``outbox_inbox_claim()`` in the caller's transaction.
:func:`once` wraps a bound Celery task so that its body runs in a
transaction that first claims the task id, and not at all when a run of
the same message committed already.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from typing import Any, Callable, Iterator, Optional, Tuple, TypeVar, Union

from outbox_dispatch.call import Call

_CLAIM = Call("SELECT outbox_inbox_claim(id => CAST({0} AS uuid), consumer => {1})", ("id", "consumer"))

#: The request attribute a skipped duplicate sets, which the companion's
#: report carries (``"duplicate": true``).
DUPLICATE_ATTRIBUTE = "outbox_duplicate"

R = TypeVar("R")


def claim(conn: Any, message_id: Union[str, uuid.UUID], consumer: str = "") -> bool:
    """Claims ``message_id`` for ``consumer`` in the transaction of ``conn``
    (a DB-API connection or cursor, Django's ``connection``, or a
    SQLAlchemy ``Connection`` or ``Session``): True when this transaction
    is the first to claim it, False when another claimed it and committed.
    Waits for a claim another transaction holds and has not ended."""
    if not isinstance(consumer, str):
        raise TypeError(f"claim: consumer must be a string, not {type(consumer).__name__}")
    return bool(_CLAIM.scalar(conn, (str(message_id), consumer), "claim"))


def once(using: Any = "default", *, consumer: Optional[str] = None) -> Callable[[Callable[..., R]], Callable[..., Optional[R]]]:
    """Decorates the function of a bound Celery task (``@app.task(bind=True)``
    above it) so that its body runs in a transaction that first claims the
    task id (:func:`claim`, consumer the task's name unless given), and is
    skipped when that claim is False: the task then returns None, and its
    report says it was a duplicate.

    ``using`` says where the transaction is:

    - a Django database alias (the default, ``"default"``): the body runs
      in ``transaction.atomic(using=alias)``, as it is called;
    - a SQLAlchemy ``sessionmaker``: the body gets the session as keyword
      ``session``, in ``sessionmaker.begin()``;
    - a psycopg ``ConnectionPool`` (or anything whose ``connection()`` is a
      context manager giving a psycopg connection), or a callable returning
      a new psycopg connection: the body gets the connection as keyword
      ``conn``, in ``conn.transaction()``.

    An exception in the body rolls its writes back with the claim: a later
    run (a Celery retry, a redelivery) claims again.
    """

    def decorate(body: Callable[..., R]) -> Callable[..., Optional[R]]:
        @functools.wraps(body)
        def run(task: Any, *args: Any, **kwargs: Any) -> Optional[R]:
            name = consumer if consumer is not None else task.name
            with _transaction(using) as (conn, keyword):
                if not claim(conn, task.request.id, name):
                    setattr(task.request, DUPLICATE_ATTRIBUTE, True)
                    return None
                if keyword is not None:
                    kwargs[keyword] = conn
                return body(task, *args, **kwargs)

        return run

    return decorate


@contextlib.contextmanager
def _transaction(using: Any) -> Iterator[Tuple[Any, Optional[str]]]:
    """A transaction on what ``using`` names, committed when the block ends
    and rolled back when it raises; yields the connection to claim on and
    the keyword the body gets it as (None: Django's, not passed)."""
    if isinstance(using, str):
        from django.db import connections, transaction  # type: ignore[import-untyped]

        with transaction.atomic(using=using):
            yield connections[using], None
    elif hasattr(using, "begin") and hasattr(using, "kw"):  # a sessionmaker
        with using.begin() as session:
            yield session, "session"
    elif hasattr(using, "connection"):  # a psycopg_pool.ConnectionPool
        with using.connection() as conn, conn.transaction():
            yield conn, "conn"
    elif callable(using):
        with using() as conn, conn.transaction():
            yield conn, "conn"
    else:
        raise TypeError(
            "once: using must be a Django database alias, a SQLAlchemy sessionmaker, a psycopg ConnectionPool "
            f"or a callable returning a psycopg connection, not {type(using).__name__}"
        )
