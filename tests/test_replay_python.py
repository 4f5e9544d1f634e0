"""outbox_dispatch.resend() and discard() (and outbox_dispatch.aio's),
which call outbox_resend() and outbox_discard() (tests/test_replay.py
tests the functions): each filter reaches them as given through every
kind of connection, a call is bounded by max_events, their refusals reach
the caller naming the argument, and a role that does not own the outbox
is refused."""

import asyncio
import datetime as dt
import uuid

import asyncpg
import psycopg
import pytest
import sqlalchemy
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox_dispatch
from outbox_dispatch import aio

QUEUE = "q_py_replay"


def psycopg_connection(pg):
    """A call on a psycopg connection in autocommit mode: each commits by itself."""
    def call(name, **filters):
        with psycopg.connect(host=str(pg.dir), port=pg.port, user=pg.owner, dbname="postgres",
                             autocommit=True) as conn:
            return getattr(outbox_dispatch, name)(conn, **filters)
    return call


def sqlalchemy_session(pg):
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://{pg.owner}@/postgres?host={pg.dir}&port={pg.port}")

    def call(name, **filters):
        with Session(engine) as session, session.begin():
            return getattr(outbox_dispatch, name)(session, **filters)
    return call


def asyncpg_connection(pg):
    def call(name, **filters):
        async def run():
            conn = await asyncpg.connect(host=str(pg.dir), port=pg.port, user=pg.owner, database="postgres")
            try:
                return await getattr(aio, name)(conn, **filters)
            finally:
                await conn.close()
        return asyncio.run(run())
    return call


def sqlalchemy_async_session(pg):
    def call(name, **filters):
        async def run():
            engine = create_async_engine(f"postgresql+asyncpg://{pg.owner}@/postgres?host={pg.dir}&port={pg.port}")
            try:
                async with AsyncSession(engine) as session, session.begin():
                    return await getattr(aio, name)(session, **filters)
            finally:
                await engine.dispose()
        return asyncio.run(run())
    return call


CALLERS = [psycopg_connection, sqlalchemy_session, asyncpg_connection, sqlalchemy_async_session]


def refusal(error):
    """The server's words of a refusal, whichever driver raised it."""
    return str(getattr(error, "orig", None) or error)


@pytest.mark.parametrize("caller", CALLERS, ids=lambda f: f.__name__)
def test_each_filter_reaches_the_functions_through_every_connection(outbox, caller):
    outbox.configure(enabled="off")  # nothing is sent meanwhile: the events stay pending
    call = caller(outbox)
    events = [outbox.value("SELECT outbox_enqueue('py.replay', '{}', queue => %s)", (QUEUE,)) for _ in range(4)]
    kept = outbox.value("SELECT outbox_enqueue('py.replay', '{}', queue => 'q_py_kept')")
    now = dt.datetime.now(dt.timezone.utc)

    assert call("discard", ids=[events[0]]) == 1
    # Bounded: one per call, oldest first; a naive datetime is UTC.
    assert call("discard", queue=QUEUE, created_after=(now - dt.timedelta(hours=1)).replace(tzinfo=None),
                created_before=now + dt.timedelta(hours=1), max_events=1) == 1
    assert outbox.value("SELECT count(*) FROM outbox.events WHERE id = %s", (events[1],)) == 0
    # Every filter given must hold: another task's name takes none.
    assert call("discard", task="py.other", status="pending", ids=[str(events[2]), events[3]]) == 0
    outbox.sql("UPDATE outbox.log SET status = 'failed', last_error = 'boom' WHERE id = %s", (events[2],))
    assert call("resend", event_type="py.replay", status="failed") == 1
    assert outbox.sql("SELECT id, status::text FROM outbox.events WHERE queue = %s ORDER BY id", (QUEUE,)) == [
        (events[2], "pending"), (events[3], "pending")]
    assert call("discard", queue=QUEUE, created_before="2000-01-01 00:00:00+00") == 0
    assert outbox.value("SELECT count(*) FROM outbox.events WHERE id = %s", (kept,)) == 1

    for name, filters, words in [
        ("resend", {}, "outbox_resend: name the events"),
        ("resend", {"queue": QUEUE, "status": "pending"}, "status is pending, it must be one of dispatched"),
        ("discard", {"queue": QUEUE, "max_events": 0}, "max_events is 0, it must be 1 to 100000"),
        ("discard", {"status": "lost"}, 'invalid input value for enum outbox.event_status: "lost"'),
    ]:
        with pytest.raises((psycopg.Error, asyncpg.PostgresError, DBAPIError)) as refused:
            call(name, **filters)
        assert words in refusal(refused.value), refusal(refused.value)
    with pytest.raises(ValueError, match="ids: each must be a UUID"):
        call("discard", ids=["not-a-uuid"])
    with pytest.raises(TypeError, match="max_events must be an integer"):
        call("resend", queue=QUEUE, max_events="10")
    assert outbox.value("SELECT count(*) FROM outbox.events WHERE queue = %s", (QUEUE,)) == 2


def test_a_role_that_does_not_own_the_outbox_is_refused(outbox):
    outbox.configure(enabled="off")
    event = outbox.value("SELECT outbox_enqueue('py.replay', '{}', queue => %s)", (QUEUE,))
    with outbox.connect(user=outbox.owner) as conn:
        conn.execute("GRANT EXECUTE ON FUNCTION outbox_discard(uuid[], text, text, text, outbox.event_status, "
                     "timestamptz, timestamptz, integer) TO PUBLIC")
    try:
        with outbox.connect_as("py_replay_writer", "app") as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="only the outbox's owner"):
                outbox_dispatch.discard(conn, ids=[event])
    finally:
        with outbox.connect(user=outbox.owner) as conn:
            conn.execute("REVOKE EXECUTE ON FUNCTION outbox_discard(uuid[], text, text, text, outbox.event_status, "
                         "timestamptz, timestamptz, integer) FROM PUBLIC")
    assert outbox.value("SELECT count(*) FROM outbox.events WHERE id = %s", (event,)) == 1


def test_the_calls_name_the_connection_they_take(outbox):
    with psycopg.connect(host=str(outbox.dir), port=outbox.port, user="postgres", dbname="postgres") as conn:
        with pytest.raises(TypeError, match=r"resend: conn must be an asynchronous connection"):
            asyncio.run(aio.resend(conn, ids=[uuid.uuid4()]))

    async def synchronous_on_asynchronous():
        conn = await psycopg.AsyncConnection.connect(host=str(outbox.dir), port=outbox.port, user="postgres",
                                                     dbname="postgres")
        async with conn:
            with pytest.raises(TypeError, match=r"discard: conn is asynchronous .*outbox_dispatch\.aio\.discard"):
                outbox_dispatch.discard(conn, ids=[uuid.uuid4()])

    asyncio.run(synchronous_on_asynchronous())
