"""outbox_dispatch.enqueue() against PostgreSQL with every kind of
connection it accepts: the event joins the caller's transaction (committed:
delivered; rolled back: gone), and outbox_enqueue()'s checks reach the
caller."""

import contextlib

import psycopg
import psycopg2
import pytest
import sqlalchemy
from sqlalchemy.orm import Session

from harness import decode, wait_until
from outbox_dispatch import AutocommitError, enqueue, publish


def psycopg_connection(pg):
    conn = psycopg.connect(host=str(pg.dir), port=pg.port, user="postgres", dbname="postgres")
    return conn, conn.commit, conn.rollback, conn.close


def psycopg_cursor(pg):
    conn = psycopg.connect(host=str(pg.dir), port=pg.port, user="postgres", dbname="postgres")
    return conn.cursor(), conn.commit, conn.rollback, conn.close


def psycopg2_connection(pg):
    conn = psycopg2.connect(host=str(pg.dir), port=pg.port, user="postgres", dbname="postgres")
    return conn, conn.commit, conn.rollback, conn.close


def sqlalchemy_connection(pg):
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://postgres@/postgres?host={pg.dir}&port={pg.port}")
    conn = engine.connect()
    return conn, conn.commit, conn.rollback, lambda: (conn.close(), engine.dispose())


def sqlalchemy_session(pg):
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://postgres@/postgres?host={pg.dir}&port={pg.port}")
    session = Session(engine)
    return session, session.commit, session.rollback, lambda: (session.close(), engine.dispose())


def django_connection(pg):
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(DATABASES={"default": {
            "ENGINE": "django.db.backends.postgresql", "NAME": "postgres", "USER": "postgres",
            "HOST": str(pg.dir), "PORT": pg.port}})
        django.setup()
    from django.db import connection, transaction

    transaction.set_autocommit(False)
    return (connection, transaction.commit, transaction.rollback,
            lambda: (transaction.set_autocommit(True), connection.close()))


CONNECTIONS = [psycopg_connection, psycopg_cursor, psycopg2_connection, sqlalchemy_connection,
               sqlalchemy_session, django_connection]


@pytest.mark.parametrize("open_connection", CONNECTIONS, ids=lambda f: f.__name__)
def test_enqueue_joins_the_callers_transaction(outbox, redis_server, open_connection):
    conn, commit, rollback, close = open_connection(outbox)
    try:
        dropped = enqueue(conn, "shop.send_receipt", args=(7,), queue="q_enqueue")
        rollback()
        kept = enqueue(conn, "shop.send_receipt", args=(7, "x"), kwargs={"lang": "fr"}, queue="q_enqueue",
                       countdown=0, expires=600, priority=6, headers={"tenant": "a"}, ordering_key="order:7")
        commit()
    finally:
        close()
    assert outbox.value("SELECT count(*) FROM outbox.events WHERE id = %s", (dropped,)) == 0
    key = "q_enqueue\x06\x166"
    raw = wait_until(lambda: redis_server.client().lrange(key, 0, -1), message="the message in Redis")
    [(envelope, body)] = [decode(m) for m in raw]
    headers = envelope["headers"]
    assert headers["id"] == str(kept) and headers["task"] == "shop.send_receipt"
    assert body[0] == [7, "x"] and body[1] == {"lang": "fr"}
    assert headers["tenant"] == "a" and headers["expires"].endswith("+00:00")
    assert outbox.value("SELECT expires_at - created_at BETWEEN '599s' AND '601s' FROM outbox.events WHERE id = %s",
                        (kept,))
    assert outbox.sql("SELECT ordering_key, key_state FROM outbox.events WHERE id = %s", (kept,)) == [
        ("order:7", "head")]


def psycopg_autocommit(pg):
    conn = psycopg.connect(host=str(pg.dir), port=pg.port, user="postgres", dbname="postgres", autocommit=True)
    return conn, conn.close


def psycopg_cursor_autocommit(pg):
    conn = psycopg.connect(host=str(pg.dir), port=pg.port, user="postgres", dbname="postgres", autocommit=True)
    return conn.cursor(), conn.close


def psycopg2_autocommit(pg):
    conn = psycopg2.connect(host=str(pg.dir), port=pg.port, user="postgres", dbname="postgres")
    conn.autocommit = True
    return conn, conn.close


def sqlalchemy_autocommit(pg):
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://postgres@/postgres?host={pg.dir}&port={pg.port}",
                                      isolation_level="AUTOCOMMIT")
    conn = engine.connect()
    return conn, lambda: (conn.close(), engine.dispose())


def sqlalchemy_session_autocommit(pg):
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://postgres@/postgres?host={pg.dir}&port={pg.port}",
                                      isolation_level="AUTOCOMMIT")
    session = Session(engine)
    return session, lambda: (session.close(), engine.dispose())


def django_autocommit(pg):
    django_connection(pg)
    from django.db import connection, transaction

    transaction.set_autocommit(True)  # Django's default, outside atomic()
    return connection, connection.close


AUTOCOMMIT = [psycopg_autocommit, psycopg_cursor_autocommit, psycopg2_autocommit, sqlalchemy_autocommit,
              sqlalchemy_session_autocommit, django_autocommit]


@pytest.mark.parametrize("open_connection", AUTOCOMMIT, ids=lambda f: f.__name__)
def test_a_connection_in_autocommit_is_refused_unless_meant(outbox, open_connection):
    """enqueue() means the caller's transaction: on a connection that
    commits each statement at once, it refuses, and inserts nothing."""
    conn, close = open_connection(outbox)
    try:
        with pytest.raises(AutocommitError, match="enqueue: the connection is in autocommit mode"):
            enqueue(conn, "shop.send_receipt", queue="q_autocommit")
        with pytest.raises(AutocommitError, match="publish: the connection is in autocommit mode"):
            publish(conn, "shop.ordered", queue="q_autocommit")
        assert outbox.value("SELECT count(*) FROM outbox.events") == 0
        meant = enqueue(conn, "shop.send_receipt", queue="q_autocommit", allow_autocommit=True)
    finally:
        close()
    assert outbox.value("SELECT count(*) FROM outbox.events WHERE id = %s", (meant,)) == 1


def test_a_transaction_opened_on_an_autocommit_connection_is_the_callers(outbox):
    """psycopg's conn.transaction() opens one on a connection in autocommit
    mode: that is the caller's transaction. (psycopg2's `with conn` sends its
    BEGIN only with the first statement, which enqueue() cannot see coming:
    there, allow_autocommit=True, or a statement first.)"""

    class RolledBack(Exception):
        pass

    conn = psycopg.connect(host=str(outbox.dir), port=outbox.port, user="postgres", dbname="postgres",
                           autocommit=True)
    with conn:
        with pytest.raises(RolledBack):
            with conn.transaction():
                dropped = enqueue(conn, "shop.send_receipt", queue="q_autocommit")
                raise RolledBack()
        with conn.transaction():
            kept = enqueue(conn, "shop.send_receipt", queue="q_autocommit")
    ids = {r[0] for r in outbox.sql("SELECT id FROM outbox.events")}
    assert dropped not in ids and kept in ids


def test_outbox_enqueue_errors_reach_the_caller(outbox):
    with contextlib.closing(psycopg.connect(host=str(outbox.dir), port=outbox.port, user="postgres",
                                            dbname="postgres")) as conn:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="expires must be positive"):
            enqueue(conn, "t", expires=-5)
        conn.rollback()
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="priority is 12"):
            enqueue(conn, "t", priority=12)
        conn.rollback()
    assert outbox.value("SELECT count(*) FROM outbox.events") == 0


def test_sql_callers_get_args_and_expiry_checked(outbox):
    cases = [
        ("payload => '{}', args => '{}'", "args must be a JSON array, not object"),
        ("payload => '[2]', args => '[1]'", "with args, payload must be a JSON object"),
        ("payload => '{}', expires => '0s'", "expires must be positive"),
    ]
    for arguments, message in cases:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
            outbox.sql(f"SELECT outbox_enqueue(event_type => 'e', {arguments})")
    with pytest.raises(psycopg.errors.CheckViolation, match="events_args_with_kwargs"):
        outbox.sql("INSERT INTO outbox.events (event_type, payload, args) VALUES ('e', '[1]', '[2]')")
    assert outbox.value("SELECT count(*) FROM outbox.events") == 0


def test_notify_reaches_listeners_at_commit_and_a_bad_channel_is_named(outbox):
    outbox.configure(enabled="off")
    with outbox.connect() as listener:
        listener.execute("LISTEN outbox_new")
        with outbox.connect(autocommit=False) as conn:
            conn.execute("SET outbox.notify = on")
            conn.execute("SELECT outbox_enqueue('notified', '{}', queue => 'q_notify')")
            conn.commit()
        notices = listener.notifies(timeout=10, stop_after=1)
        assert [n.channel for n in notices] == ["outbox_new"]
    with outbox.connect() as conn:
        conn.execute("SET outbox.notify = on")
        conn.execute("SET outbox.notify_channel = ''")
        with pytest.raises(psycopg.errors.InvalidParameterValue,
                           match=r"outbox.notify_channel is 0 bytes, it must be 1 to 63 bytes \(or outbox.notify off\)\n"):
            conn.execute("SELECT outbox_enqueue('notified', '{}', queue => 'q_notify')")
    assert outbox.value("SELECT count(*) FROM outbox.events") == 1
