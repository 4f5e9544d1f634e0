"""outbox_dispatch.aio against PostgreSQL with every asynchronous
connection it accepts (psycopg's AsyncConnection and AsyncCursor, asyncpg,
SQLAlchemy's AsyncConnection and AsyncSession on both of its asynchronous
drivers): the event joins the caller's transaction (rolled back: gone;
committed: a stock Celery worker runs it), a connection that commits by
itself is refused, and once() makes an async body's writes once per
message through a prefork Celery worker that runs every message twice."""

import asyncio
import contextlib
import functools
import json
import uuid

import asyncpg
import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.pool import NullPool

from harness import CeleryWorker, decode, wait_until
from outbox_dispatch import AutocommitError, aio, enqueue, publish
from outbox_dispatch.inbox import claim


def dsn(pg):
    return f"host={pg.dir} port={pg.port} user=postgres dbname=postgres"


def url(pg, driver):
    return f"postgresql+{driver}://postgres@/postgres?host={pg.dir}&port={pg.port}"


def asyncpg_connect(pg):
    return asyncpg.connect(host=str(pg.dir), port=pg.port, user="postgres", database="postgres")


# Each opens a connection and gives a function whose block is a transaction
# (committed at its end, rolled back when it raises) and yields what the
# calls take; with autocommit, a connection that commits each statement,
# and a block that opens no transaction (SQLAlchemy's begin() opens none
# with AUTOCOMMIT).

@contextlib.asynccontextmanager
async def psycopg_connection(pg, autocommit=False):
    async with await psycopg.AsyncConnection.connect(dsn(pg), autocommit=autocommit) as conn:
        yield lambda: _yielding(contextlib.nullcontext() if autocommit else conn.transaction(), conn)


@contextlib.asynccontextmanager
async def psycopg_cursor(pg, autocommit=False):
    async with await psycopg.AsyncConnection.connect(dsn(pg), autocommit=autocommit) as conn:
        yield lambda: _yielding(contextlib.nullcontext() if autocommit else conn.transaction(), conn.cursor())


@contextlib.asynccontextmanager
async def asyncpg_connection(pg, autocommit=False):
    conn = await asyncpg_connect(pg)
    try:
        # asyncpg commits each statement outside conn.transaction().
        yield lambda: _yielding(contextlib.nullcontext() if autocommit else conn.transaction(), conn)
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def asyncpg_pool_connection(pg, autocommit=False):
    async with asyncpg.create_pool(host=str(pg.dir), port=pg.port, user="postgres", database="postgres",
                                   min_size=1, max_size=1) as pool, pool.acquire() as conn:
        yield lambda: _yielding(contextlib.nullcontext() if autocommit else conn.transaction(), conn)


@contextlib.asynccontextmanager
async def sqlalchemy_connection(pg, autocommit=False):
    """SQLAlchemy's AsyncConnection, on asyncpg."""
    engine = create_async_engine(url(pg, "asyncpg"), isolation_level="AUTOCOMMIT" if autocommit else None)
    try:
        async with engine.connect() as conn:
            yield lambda: _yielding(conn.begin(), conn)
    finally:
        await engine.dispose()


@contextlib.asynccontextmanager
async def sqlalchemy_session(pg, autocommit=False):
    """SQLAlchemy's AsyncSession, on psycopg's asynchronous connection."""
    engine = create_async_engine(url(pg, "psycopg"), isolation_level="AUTOCOMMIT" if autocommit else None)
    try:
        async with AsyncSession(engine) as session:
            yield lambda: _yielding(session.begin(), session)
    finally:
        await engine.dispose()


@contextlib.asynccontextmanager
async def _yielding(transaction, conn):
    """`conn` inside `transaction` (an async context manager, or a plain one
    for none)."""
    if hasattr(transaction, "__aenter__"):
        async with transaction:
            yield conn
    else:
        with transaction:
            yield conn


DRIVERS = [psycopg_connection, psycopg_cursor, asyncpg_connection, asyncpg_pool_connection, sqlalchemy_connection,
           sqlalchemy_session]


class RolledBack(Exception):
    pass


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda f: f.__name__)
def test_enqueue_and_publish_join_the_callers_transaction(outbox, redis_server, celery_worker, driver):
    """Rolled back: no row. Committed: a stock Celery worker runs both
    tasks with what they were given."""

    async def scenario():
        async with driver(outbox) as transaction:
            with pytest.raises(RolledBack):
                async with transaction() as conn:
                    dropped = await aio.enqueue(conn, "tests.record", args=(1,))
                    raise RolledBack()
            async with transaction() as conn:
                kept = await aio.enqueue(conn, "tests.record", args=(7, "x"), kwargs={"lang": "fr"}, countdown=0,
                                         expires=600, priority=0, headers={"tenant": "a"}, ordering_key="order:7")
                published = await aio.publish(conn, "tests.record", {"n": 1})
        return dropped, kept, published

    dropped, kept, published = asyncio.run(scenario())
    assert outbox.value("SELECT count(*) FROM outbox.events WHERE id = %s", (dropped,)) == 0
    client = redis_server.client()
    wait_until(lambda: client.hexists("executed", str(kept)) and client.hexists("executed", str(published)),
               timeout=60, message="the worker to run both tasks")
    ran = json.loads(client.hget("executed", str(kept)))
    assert (ran["args"], ran["kwargs"], ran["event_type"]) == ([7, "x"], {"lang": "fr"}, "tests.record")
    assert json.loads(client.hget("executed", str(published)))["kwargs"] == {"n": 1}
    assert outbox.sql("SELECT ordering_key, headers->>'tenant', expires_at - created_at BETWEEN '599s' AND '601s' "
                      "FROM outbox.events WHERE id = %s", (kept,)) == [("order:7", "a", True)]
    assert not client.hexists("executed", str(dropped))


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda f: f.__name__)
def test_a_connection_that_commits_by_itself_is_refused_unless_meant(outbox, driver):
    """psycopg in autocommit, asyncpg outside conn.transaction(), SQLAlchemy
    with AUTOCOMMIT: the event (or a claim) would not be the caller's
    transaction's. Refused, nothing inserted; allowed when meant."""

    async def scenario():
        async with driver(outbox, autocommit=True) as transaction:
            async with transaction() as conn:
                with pytest.raises(AutocommitError, match="enqueue: the connection is in autocommit mode"):
                    await aio.enqueue(conn, "tests.record", queue="q_autocommit")
                with pytest.raises(AutocommitError, match="publish: the connection is in autocommit mode"):
                    await aio.publish(conn, "shop.ordered", queue="q_autocommit")
                with pytest.raises(AutocommitError, match="claim: the connection is in autocommit mode"):
                    await aio.claim(conn, uuid.uuid4())
                assert outbox.value("SELECT count(*) FROM outbox.events") == 0
                return await aio.enqueue(conn, "tests.record", queue="q_autocommit", allow_autocommit=True)

    meant = asyncio.run(scenario())
    assert outbox.value("SELECT count(*) FROM outbox.events WHERE id = %s", (meant,)) == 1


def test_each_call_names_the_other_for_a_connection_of_the_other_kind(outbox):
    """A synchronous call on an asynchronous connection (whose statement
    would never run: "'coroutine' object is not subscriptable" before) says
    what to await; an awaited call on a synchronous one, what to call."""

    async def on_asynchronous():
        async with psycopg_connection(outbox) as transaction, transaction() as conn:
            for call in (enqueue, functools.partial(publish, event_type="e"), claim):
                with pytest.raises(TypeError, match=r"conn is asynchronous \(AsyncConnection\): await "
                                                    r"outbox_dispatch\.aio\.(enqueue|publish|claim)\(conn"):
                    call(conn, "t") if call is enqueue else call(conn, uuid.uuid4()) if call is claim else call(conn)
        async with sqlalchemy_session(outbox) as transaction, transaction() as session:
            with pytest.raises(TypeError, match=r"conn is asynchronous \(AsyncSession\)"):
                enqueue(session, "t")

    asyncio.run(on_asynchronous())
    with psycopg.connect(dsn(outbox)) as conn:
        with pytest.raises(TypeError, match="enqueue: conn must be an asynchronous connection .* not Connection"):
            asyncio.run(aio.enqueue(conn, "t"))
    assert outbox.value("SELECT count(*) FROM outbox.events") == 0


def test_outbox_enqueues_errors_reach_an_asyncpg_caller(outbox):
    """Every argument travels as text and is cast by the statement: the
    checks of outbox_enqueue() are the same, and name the argument."""

    async def scenario():
        conn = await asyncpg_connect(outbox)
        try:
            for kwargs, message in (({"expires": -5}, "expires must be positive"), ({"priority": 12}, "priority is 12")):
                with pytest.raises(asyncpg.InvalidParameterValueError, match=message):
                    async with conn.transaction():
                        await aio.enqueue(conn, "t", **kwargs)
        finally:
            await conn.close()

    asyncio.run(scenario())
    assert outbox.value("SELECT count(*) FROM outbox.events") == 0


QUEUE = "q_async_effects"


@pytest.fixture
def effects(outbox, redis_server):
    outbox.sql("DROP TABLE IF EXISTS effects")
    outbox.sql("CREATE TABLE effects (event uuid NOT NULL, n integer NOT NULL)")
    outbox.sql("TRUNCATE outbox.inbox")
    yield outbox
    outbox.sql("DROP TABLE effects")


@pytest.mark.parametrize("using", ["psycopg", "psycopg_pool", "asyncpg", "asyncpg_pool", "sqlalchemy"])
def test_once_makes_an_async_bodys_effect_once_through_a_celery_worker(effects, redis_server, using):
    """Ten events, enqueued with aio.enqueue; each message is then put in
    the queue twice, side by side, for a prefork worker of four processes
    whose task runs its async body under aio.once(using): each effect is
    written once, and every event is processed."""
    client = redis_server.client()

    async def enqueued():
        async with asyncpg_connection(effects) as transaction, transaction() as conn:
            return [str(await aio.enqueue(conn, "loop.effect_async", kwargs={"n": n, "using": using}, queue=QUEUE))
                    for n in range(10)]

    ids = asyncio.run(enqueued())
    wait_until(lambda: client.llen(QUEUE) == 10, timeout=30, message="10 messages sent")
    messages = client.lrange(QUEUE, 0, -1)
    client.delete(QUEUE)
    client.rpush(QUEUE, *[m for message in messages for m in (message, message)])
    worker = CeleryWorker(redis_server.url, queues=(QUEUE,), app="loop_app", pool="prefork", concurrency=4,
                          env={"OUTBOX_TEST_DSN": dsn(effects)})
    try:
        worker.wait_ready()
        wait_until(lambda: effects.count("processed") == 10 and client.llen(QUEUE) == 0, timeout=120,
                   message="every event processed")
        wait_until(lambda: sum(worker.log_text().count(f"Task loop.effect_async[{i}] succeeded") for i in ids) == 20,
                   timeout=60, message="each message's two runs over")
    finally:
        worker.close()
    assert sorted(effects.sql("SELECT event::text, count(*) FROM effects GROUP BY 1")) == sorted((i, 1) for i in ids)
    assert sorted(decode(m)[0]["headers"]["id"] for m in messages) == sorted(ids)


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg", "sqlalchemy"])
def test_once_refuses_a_body_that_caught_its_transactions_failure(effects, driver):
    """The body caught a database error: the commit would roll back its
    effect and its claim, and the task be reported done. An error; nothing
    claimed. A task given the keyword once() passes is refused too."""
    engine = create_async_engine(url(effects, "asyncpg"), poolclass=NullPool)
    using = {"psycopg": functools.partial(psycopg.AsyncConnection.connect, dsn(effects)),
             "asyncpg": functools.partial(asyncpg_connect, effects),
             "sqlalchemy": async_sessionmaker(engine)}[driver]
    keyword = "session" if driver == "sqlalchemy" else "conn"

    @aio.once(using)
    async def swallowing(task, **given):
        conn = given[keyword]
        run = conn.execute(text("SELECT 1 / 0")) if driver == "sqlalchemy" else conn.execute("SELECT 1 / 0")
        with contextlib.suppress(Exception):
            await run

    def task():
        return type("Task", (), {"name": "effects.async", "request": type("Request", (), {"id": str(uuid.uuid4())})()})()

    with pytest.raises(RuntimeError, match="the task's transaction failed"):
        asyncio.run(swallowing(task()))
    with pytest.raises(TypeError, match=f"the task was given '{keyword}' itself"):
        asyncio.run(swallowing(task(), **{keyword: "mine"}))
    with pytest.raises(TypeError, match="Django's connections have no asynchronous transactions"):
        aio.once("default")
    asyncio.run(engine.dispose())
    assert effects.value("SELECT count(*) FROM outbox.inbox") == 0
