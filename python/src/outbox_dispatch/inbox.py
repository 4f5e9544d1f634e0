"""Effects once: a task's writes to the database happen once per message,
however many times the message is delivered (docs/guides/effects-once.md).

:func:`claim` calls ``outbox_inbox_claim()`` in the caller's transaction.
:func:`once` wraps a bound Celery task so that its body runs in a
transaction that first claims the task id, and not at all when a run of
the same message committed already.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, TypeVar, Union

from outbox_dispatch.call import AutocommitError, Call, in_autocommit, refuse_asynchronous

# Types qualified: a worker's search_path may hold a domain of the same name.
CLAIM = Call(
    "SELECT outbox_inbox_claim(id => CAST({0} AS pg_catalog.uuid), consumer => CAST({1} AS pg_catalog.text))",
    ("id", "consumer"),
)

#: The request attribute a skipped duplicate sets, which the companion's
#: report carries (``"duplicate": true``).
DUPLICATE_ATTRIBUTE = "outbox_duplicate"

R = TypeVar("R")


def claim(conn: Any, message_id: Union[str, uuid.UUID], consumer: str = "") -> bool:
    """Claims ``message_id`` for ``consumer`` in the transaction of ``conn``
    (a DB-API connection or cursor, Django's ``connection``, or a
    SQLAlchemy ``Connection`` or ``Session``): True when this transaction
    is the first to claim it, False when it was claimed already (by a
    transaction that committed, or by this one). Waits for a claim another
    transaction holds and has not ended. A connection in autocommit mode
    would commit the claim apart from the effects it guards:
    :class:`~outbox_dispatch.AutocommitError`."""
    refuse_asynchronous(conn, "claim")
    check_consumer(consumer)
    refuse_autocommit(in_autocommit(conn))
    return bool(CLAIM.scalar(conn, (str(message_id), consumer), "claim"))


def check_consumer(consumer: Any) -> None:
    if not isinstance(consumer, str):
        raise TypeError(f"claim: consumer must be a string, not {type(consumer).__name__}")


def refuse_autocommit(autocommit: bool) -> None:
    if autocommit:
        raise AutocommitError(
            "claim: the connection is in autocommit mode: the claim would commit on its own, apart from the "
            "effects it guards. Claim inside the transaction that makes them."
        )


def once(
    using: Any = "default", *, consumer: Optional[str] = None, outcome_wait: float = 10.0
) -> Callable[[Callable[..., R]], Callable[..., Optional[R]]]:
    """Decorates the function of a bound Celery task (``@app.task(bind=True)``
    above it) so that its body runs in a transaction that first claims the
    task id (:func:`claim`, consumer the task's name unless given), and is
    skipped when that claim is False: the task then returns None, and its
    report says it was a duplicate.

    What Celery does after a skipped duplicate depends on whether the first
    run is known to have finished its own after-steps (Celery sends a
    task's callbacks and next chain step, then stores its result and counts
    its chord part: a worker that dies after the body committed does none
    of them). The first run is known to have finished when the task's
    result backend holds its ``SUCCESS``; a duplicate waits up to
    ``outcome_wait`` seconds for it to appear (a first run still finishing).
    Then Celery stores no result for the duplicate (the first run's stays)
    and sends none of its callbacks, chain or chord again. Otherwise (no
    result backend, ``ignore_result``, or nothing stored in time) the first
    run may have died before them: Celery stores the duplicate's None and
    sends its callbacks, next chain step and chord part, at least once,
    each with None as the parent's value (the first run's is unknown).

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
    run (a Celery retry, a redelivery) claims again. Celery's ``Ignore``
    (raised by ``self.replace()``) commits them first: the task handed its
    work on. ``self.retry(throw=False)`` followed by a return commits the
    claim, and the retry is then skipped as a duplicate: let ``retry()``
    raise.
    """

    def decorate(body: Callable[..., R]) -> Callable[..., Optional[R]]:
        @functools.wraps(body)
        def run(task: Any, *args: Any, **kwargs: Any) -> Optional[R]:
            name, message = start(task, using, consumer, kwargs)
            for attempt in range(CLAIM_ATTEMPTS):
                claimed = False
                try:
                    with _transaction(using) as (conn, keyword):
                        if claim(conn, message, name):
                            claimed = True
                            if keyword is not None:
                                kwargs[keyword] = conn
                            try:
                                result = body(task, *args, **kwargs)
                            except Exception as e:
                                if not ends_the_task(e):
                                    raise
                                ended = e
                            else:
                                check_healthy(conn)
                                return result
                    if not claimed:
                        # A duplicate, its transaction over: what the first
                        # run left undone is found out of it.
                        skip(task, message, outcome_wait)
                        return None
                    # Committed: the task ended on purpose (self.replace()).
                    raise ended
                except Exception as e:
                    if not claims_again(e, claimed, attempt):
                        raise
            raise AssertionError("unreachable: the last attempt returns or raises")

        return run

    return decorate


#: Transactions a claim is tried in when it meets a serialization failure.
CLAIM_ATTEMPTS = 3


def start(task: Any, using: Any, consumer: Optional[str], kwargs: Dict[str, Any]) -> Tuple[str, str]:
    """The consumer and the message of a run of ``task`` (its request
    marked as no duplicate, by this run alone: a message's headers become
    request attributes too), once the task's own arguments are checked."""
    name = consumer if consumer is not None else task.name
    message = message_id_of(task)
    setattr(task.request, DUPLICATE_ATTRIBUTE, False)
    if keyword_of(using) in kwargs:
        raise TypeError(f"once: the task was given {keyword_of(using)!r} itself, which once() passes")
    return name, message


def claims_again(error: BaseException, claimed: bool, attempt: int) -> bool:
    """Whether attempt number ``attempt``, which raised ``error``, is tried
    again in a new transaction: at repeatable read or serializable, a claim
    another transaction committed after this one's snapshot is a
    serialization failure, which a new transaction sees past."""
    return not claimed and attempt + 1 < CLAIM_ATTEMPTS and _serialization_failure(error)


def skip(task: Any, message: str, wait: float) -> None:
    """Marks the request of a skipped duplicate: its report says so. When
    the first run is known to have finished (:func:`_first_run_finished`),
    Celery leaves its outcome as it is: the duplicate stores no result (with
    ``ignore_result=False``, Celery's default, its None would replace the
    first run's value in the result backend) and sends no callback, no next
    step of a chain and no chord part (the first run did). Otherwise the
    request is left as it came: the first run may have died after its
    commit and before any of them, and a chain that stops or a chord that
    never completes is worse than a callback sent twice."""
    request = task.request
    setattr(request, DUPLICATE_ATTRIBUTE, True)
    if _first_run_finished(task, message, wait):
        request.ignore_result = True
        request.callbacks = request.chain = request.chord = None


def _first_run_finished(task: Any, message: str, wait: float) -> bool:
    """Whether the result backend holds the ``SUCCESS`` of ``message``,
    waiting up to ``wait`` seconds for it. Celery stores it after sending
    the task's callbacks and next chain step, and counts a chord part right
    after: once it is there, they were sent. False when it cannot be known:
    no result backend, results ignored (the first run stored none), or the
    backend unreachable."""
    backend = getattr(task, "backend", None)
    if backend is None or type(backend).__name__ == "DisabledBackend" or _ignores_result(task):
        return False
    deadline = time.monotonic() + wait
    pause = 0.02
    while True:
        try:
            meta = backend.get_task_meta(message, cache=False)
        except Exception:  # noqa: BLE001 - unreachable, or a backend that stores nothing: unknown
            return False
        if meta.get("status") == "SUCCESS":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))  # gevent and eventlet patch it
        pause = min(pause * 2, 0.5)


def _ignores_result(task: Any) -> bool:
    """Whether Celery stores no result for this run of ``task`` (the
    request's ``ignore_result`` over the task's), as Celery decides it."""
    try:
        from celery.app.task import get_actual_ignore_result
    except ImportError:  # an older Celery
        return bool(getattr(task, "ignore_result", False) or getattr(task.request, "ignore_result", False))
    return bool(get_actual_ignore_result(task, task.request))


def keyword_of(using: Any) -> Optional[str]:
    """The keyword the body gets its connection as, for ``using``."""
    if isinstance(using, str):
        return None
    if hasattr(using, "begin") and hasattr(using, "kw"):
        return "session"
    return "conn"


def ends_the_task(error: BaseException) -> bool:
    """Celery's ``Ignore``, which ``self.replace()`` raises once the
    replacement is sent: the body's work is done, its writes commit."""
    try:
        from celery.exceptions import Ignore
    except ImportError:
        return False
    return isinstance(error, Ignore)


def _serialization_failure(error: BaseException) -> bool:
    """SQLSTATE 40001, as psycopg (3 or 2), SQLAlchemy or Django raise it."""
    seen: Optional[BaseException] = error
    for _ in range(4):
        if seen is None:
            return False
        if getattr(seen, "sqlstate", None) == "40001" or getattr(seen, "pgcode", None) == "40001":
            return True
        seen = getattr(seen, "orig", None) or seen.__cause__
    return False


def message_id_of(task: Any) -> str:
    """The task id, which must be a UUID (the outbox's ids are)."""
    task_id = getattr(task.request, "id", None)
    try:
        return str(uuid.UUID(str(task_id)))
    except ValueError:
        raise ValueError(
            f"once: the task id must be a UUID (as the outbox's are), not {task_id!r}: a task called directly "
            "has none"
        ) from None


def check_healthy(conn: Any) -> None:
    """Raises if the transaction failed inside the body (an error the body
    caught): its commit would roll back the effects and the claim, and the
    task would be reported processed all the same."""
    if type(conn).__module__.startswith("django"):
        from django.db import transaction

        if transaction.get_rollback(using=conn.alias):
            raise RuntimeError("once: the task's transaction is marked for rollback: its effects are not made")
        conn = conn.connection
    elif type(conn).__module__.startswith("sqlalchemy"):
        conn = conn.connection().connection.dbapi_connection
    check_driver_healthy(conn)


def check_driver_healthy(conn: Any) -> None:
    """:func:`check_healthy` of a psycopg (3 or 2) connection, which keeps
    its transaction's status."""
    info = getattr(conn, "info", None)
    status = getattr(info, "transaction_status", None)
    if status is None and hasattr(conn, "get_transaction_status"):  # psycopg2
        status = conn.get_transaction_status()
    if status is not None and int(status) >= _IN_ERROR:
        raise RuntimeError(TRANSACTION_FAILED)


TRANSACTION_FAILED = (
    "once: the task's transaction failed (a database error caught inside the task): its effects and its claim "
    "would be rolled back at the commit"
)


#: libpq's transaction status of a failed transaction (then unknown: 4).
_IN_ERROR = 3


@contextlib.contextmanager
def _transaction(using: Any) -> Iterator[Tuple[Any, Optional[str]]]:
    """A transaction on what ``using`` names, committed when the block ends
    and rolled back when it raises; yields the connection to claim on and
    the keyword the body gets it as (None: Django's, not passed)."""
    keyword = keyword_of(using)
    if isinstance(using, str):
        from django.db import connections, transaction

        if not connections[using].get_autocommit():
            raise RuntimeError(
                f"once: Django's connection {using!r} is not in autocommit mode (AUTOCOMMIT off, or "
                "set_autocommit(False)): its transaction would not end with the task"
            )
        # durable: refused inside another atomic block, whose transaction
        # would commit (or not) after the task.
        with transaction.atomic(using=using, durable=True):
            yield connections[using], None
    elif keyword == "session":  # a sessionmaker
        with using.begin() as session:
            yield session, keyword
    elif hasattr(using, "connection"):  # a psycopg_pool.ConnectionPool
        with using.connection() as conn, conn.transaction():
            yield conn, keyword
    elif callable(using):
        with using() as conn, conn.transaction():
            yield conn, keyword
    else:
        raise TypeError(
            "once: using must be a Django database alias, a SQLAlchemy sessionmaker, a psycopg ConnectionPool "
            f"or a callable returning a psycopg connection, not {type(using).__name__}"
        )
