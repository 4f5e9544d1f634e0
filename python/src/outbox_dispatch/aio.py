"""The package's calls for asynchronous connections, awaited: psycopg's
``AsyncConnection`` (or ``AsyncCursor``), an asyncpg connection (or a
pool's), SQLAlchemy's ``AsyncConnection`` or ``AsyncSession``.

:func:`enqueue`, :func:`publish`, :func:`claim`, :func:`resend` and
:func:`discard` are those of :mod:`outbox_dispatch` and
:mod:`outbox_dispatch.inbox`, with the same
arguments and checks, in the caller's transaction: a connection that would
commit the event (or the claim) by itself is refused
(:class:`~outbox_dispatch.AutocommitError`): psycopg's in ``autocommit``
outside ``conn.transaction()``, an asyncpg connection outside
``conn.transaction()`` (asyncpg commits every statement otherwise), and
SQLAlchemy's with the ``AUTOCOMMIT`` isolation level. :func:`once` makes
an ``async def`` body's writes happen once per message, as
:func:`outbox_dispatch.inbox.once` does a synchronous one's.

::

    from outbox_dispatch.aio import enqueue

    async with session.begin():             # a SQLAlchemy AsyncSession
        session.add(order)
        await enqueue(session, charge_order, args=(order.id,))
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Tuple, TypeVar, Union

from outbox_dispatch import inbox
from outbox_dispatch.call import in_autocommit_async, refuse_synchronous, with_connection
from outbox_dispatch.producer import ENQUEUE, Event, enqueued, producer_span, published, sent
from outbox_dispatch.replay import DISCARD, RESEND, chosen

R = TypeVar("R")

__all__ = ["claim", "discard", "enqueue", "once", "publish", "resend"]


@with_connection(enqueued)
async def enqueue(conn: Any, *args: Any, **kwargs: Any) -> uuid.UUID:
    """:func:`outbox_dispatch.enqueue` on an asynchronous connection."""
    return await _send(conn, enqueued(*args, **kwargs))


@with_connection(published)
async def publish(conn: Any, *args: Any, **kwargs: Any) -> uuid.UUID:
    """:func:`outbox_dispatch.publish` on an asynchronous connection."""
    return await _send(conn, published(*args, **kwargs))


async def _send(conn: Any, event: Event) -> uuid.UUID:
    event.check()
    event.refuse_autocommit(await in_autocommit_async(conn, event.caller))
    with producer_span(event.queue) as span:
        return sent(span, await ENQUEUE.scalar_async(conn, event.parameters(), event.caller))


async def claim(conn: Any, message_id: Union[str, uuid.UUID], consumer: str = "") -> bool:
    """:func:`outbox_dispatch.inbox.claim` on an asynchronous connection."""
    inbox.check_consumer(consumer)
    inbox.refuse_autocommit(await in_autocommit_async(conn, "claim"))
    return bool(await inbox.CLAIM.scalar_async(conn, (str(message_id), consumer), "claim"))


@with_connection(chosen)
async def resend(conn: Any, *args: Any, **kwargs: Any) -> int:
    """:func:`outbox_dispatch.resend` on an asynchronous connection."""
    refuse_synchronous(conn, "resend")
    return int(await RESEND.scalar_async(conn, chosen(*args, **kwargs), "resend"))


@with_connection(chosen)
async def discard(conn: Any, *args: Any, **kwargs: Any) -> int:
    """:func:`outbox_dispatch.discard` on an asynchronous connection."""
    refuse_synchronous(conn, "discard")
    return int(await DISCARD.scalar_async(conn, chosen(*args, **kwargs), "discard"))


def once(
    using: Any, *, consumer: Optional[str] = None, outcome_wait: float = 10.0
) -> Callable[[Callable[..., Awaitable[R]]], Callable[..., Awaitable[Optional[R]]]]:
    """:func:`outbox_dispatch.inbox.once` for an ``async def`` body: the
    decorated function is a coroutine function of the task and its
    arguments, which the task runs in its event loop (a synchronous Celery
    task: ``return asyncio.run(body(self, order_id))``). ``using`` says
    where the transaction is:

    - a SQLAlchemy ``async_sessionmaker``: the body gets the session as
      keyword ``session``, in ``async_sessionmaker.begin()``;
    - a psycopg ``AsyncConnectionPool`` or an asyncpg ``Pool``, or a
      callable returning an awaitable of a new psycopg ``AsyncConnection``
      or asyncpg connection (``functools.partial(asyncpg.connect, dsn)``),
      closed after: the body gets the connection as keyword ``conn``, in
      ``conn.transaction()``.

    A pool or an engine is bound to the event loop it was made in: with
    ``asyncio.run()`` per task, give a callable, or an engine with
    ``poolclass=NullPool``.
    """
    if isinstance(using, str):
        raise TypeError("once: Django's connections have no asynchronous transactions: use outbox_dispatch.inbox.once")

    def decorate(body: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[Optional[R]]]:
        @functools.wraps(body)
        async def run(task: Any, *args: Any, **kwargs: Any) -> Optional[R]:
            name, message = inbox.start(task, using, consumer, kwargs)
            for attempt in range(inbox.CLAIM_ATTEMPTS):
                claimed = False
                try:
                    async with _transaction(using) as (conn, keyword):
                        if await claim(conn, message, name):
                            claimed = True
                            kwargs[keyword] = conn
                            try:
                                result = await body(task, *args, **kwargs)
                            except Exception as e:
                                if not inbox.ends_the_task(e):
                                    raise
                                ended = e
                            else:
                                await _check_healthy(conn)
                                return result
                    if not claimed:
                        # The result backend is waited on in a thread: the
                        # loop goes on meanwhile.
                        await asyncio.get_running_loop().run_in_executor(None, inbox.skip, task, message,
                                                                         outcome_wait)
                        return None
                    raise ended
                except Exception as e:
                    if not inbox.claims_again(e, claimed, attempt):
                        raise
            raise AssertionError("unreachable: the last attempt returns or raises")

        return run

    return decorate


async def _check_healthy(conn: Any) -> None:
    """:func:`outbox_dispatch.inbox.check_healthy` of an asynchronous
    connection. asyncpg keeps no transaction status it shows: a statement
    tells (25P02 in a failed transaction)."""
    if type(conn).__module__.startswith("sqlalchemy"):
        conn = (await (await conn.connection()).get_raw_connection()).driver_connection
    if type(conn).__module__.startswith("asyncpg"):
        try:
            await conn.execute("SELECT")
        except Exception as e:
            if getattr(e, "sqlstate", None) == "25P02":
                raise RuntimeError(inbox.TRANSACTION_FAILED) from None
            raise
        return
    inbox.check_driver_healthy(conn)


@contextlib.asynccontextmanager
async def _transaction(using: Any) -> AsyncIterator[Tuple[Any, str]]:
    """A transaction on what ``using`` names, committed when the block ends
    and rolled back when it raises; yields the connection to claim on and
    the keyword the body gets it as."""
    keyword = inbox.keyword_of(using)
    assert keyword is not None  # once() refuses a Django alias
    if keyword == "session":  # an async_sessionmaker
        async with using.begin() as session:
            yield session, keyword
    elif hasattr(using, "acquire"):  # an asyncpg Pool
        async with using.acquire() as conn, conn.transaction():
            yield conn, keyword
    elif hasattr(using, "connection"):  # a psycopg_pool.AsyncConnectionPool
        async with using.connection() as conn, conn.transaction():
            yield conn, keyword
    elif callable(using):
        conn = await using()
        try:
            async with conn.transaction():
                yield conn, keyword
        finally:
            await conn.close()
    else:
        raise TypeError(
            "once: using must be a SQLAlchemy async_sessionmaker, a psycopg AsyncConnectionPool, an asyncpg Pool, "
            f"or a callable returning an awaitable of a new connection, not {type(using).__name__}"
        )
