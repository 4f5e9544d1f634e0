"""The inbox: outbox_inbox_claim() claims a message once per consumer, in
the caller's transaction. The hostile cases first: a duplicate racing the
first claim (committed, rolled back), bad input, a role with no grant, a
planted search_path; then retention and pg_dump."""

import contextlib
import json
import threading
import types
import time
import uuid

import psycopg
import pytest
import redis as redis_lib

from harness import CeleryWorker, decode, drain_held, wait_until
from standalone import library_only, new_cluster
from outbox_dispatch.inbox import once


@pytest.fixture
def inbox(cluster):
    cluster.reset(enabled="on")
    cluster.sql("TRUNCATE outbox.inbox")
    yield cluster


def claim(conn, message, consumer=None):
    """One claim in a transaction block: its own, on an autocommit
    connection."""
    with conn.transaction() if conn.autocommit else contextlib.nullcontext():
        if consumer is None:
            return conn.execute("SELECT outbox_inbox_claim(%s)", (message,)).fetchone()[0]
        return conn.execute("SELECT outbox_inbox_claim(%s, %s)", (message, consumer)).fetchone()[0]


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
def test_a_duplicate_waits_for_the_first_claim(inbox, first_ends):
    """The second claim of a message waits for the first transaction: false
    once it commits, true (its own claim) once it rolled back."""
    message = uuid.uuid4()
    first = inbox.connect(autocommit=False)
    assert claim(first, message) is True
    answers = []

    def second_claim():
        with inbox.connect(autocommit=False) as second:
            answers.append(claim(second, message))
            second.commit()

    thread = threading.Thread(target=second_claim)
    thread.start()
    time.sleep(0.5)
    assert answers == [], "the duplicate must wait for the first claim's transaction"
    getattr(first, first_ends)()
    first.close()
    thread.join(timeout=30)
    assert answers == [first_ends == "rollback"]
    assert inbox.value("SELECT count(*) FROM outbox.inbox WHERE id = %s", (message,)) == 1


@library_only("SQL cannot tell a statement outside a transaction block (docs/guides/managed.md)")
def test_a_claim_outside_a_transaction_block_is_refused(inbox):
    """In autocommit the claim would commit on its own, before the effects
    it guards (and a duplicate would stop waiting for them)."""
    with inbox.connect() as conn:
        with pytest.raises(psycopg.errors.NoActiveSqlTransaction, match="inside a transaction block"):
            conn.execute("SELECT outbox_inbox_claim(%s)", (uuid.uuid4(),))
    assert inbox.value("SELECT count(*) FROM outbox.inbox") == 0


def test_a_claim_of_an_event_that_may_run_again_outlives_the_retention(inbox):
    """The purge keeps the claim of an event still here and not processed
    (a dead letter that outbox_retry() may send again): its effects were
    made, and must not be made twice."""
    inbox.configure(enabled="off")
    with inbox.connect() as conn:
        failed = conn.execute("SELECT outbox_enqueue('x', '{}')").fetchone()[0]
        conn.execute("UPDATE outbox.log SET status = 'failed' WHERE id = %s", (failed,))
        claim(conn, failed)
        claim(conn, uuid.uuid4())
    inbox.sql("UPDATE outbox.inbox SET claimed_at = now() - interval '2 hours'")
    inbox.configure(enabled="on", inbox_retention="1h", lifecycle_interval="1s")
    wait_until(lambda: inbox.value("SELECT count(*) FROM outbox.inbox") == 1, timeout=60,
               message="the other claim purged")
    assert inbox.value("SELECT id FROM outbox.inbox") == failed


def test_once_per_consumer_and_duplicates_counted(inbox):
    message = uuid.uuid4()
    before = inbox.metric("outbox_inbox_duplicates_total") or 0
    with inbox.connect() as conn, conn.transaction():
        assert claim(conn, message) is True
        assert claim(conn, message) is False, "claimed already, by this very transaction"
        assert claim(conn, message, "billing") is True
        assert claim(conn, message, "billing") is False
        assert claim(conn, message, "email") is True
    if inbox.counts_in_sql:
        assert inbox.metric("outbox_inbox_duplicates_total") == before + 2


def test_bad_input_is_refused_and_claims_nothing(inbox):
    with inbox.connect() as conn:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="id must not be null"):
            conn.execute("SELECT outbox_inbox_claim(NULL)")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="consumer must not be null"):
            conn.execute("SELECT outbox_inbox_claim(%s, NULL)", (uuid.uuid4(),))
        with pytest.raises(psycopg.errors.InvalidParameterValue,
                           match="consumer is 256 bytes, the limit is 255 bytes"):
            claim(conn, uuid.uuid4(), "c" * 256)
    assert inbox.value("SELECT count(*) FROM outbox.inbox") == 0


def test_only_a_granted_role_claims_and_it_needs_nothing_else(inbox):
    inbox.sql("DROP ROLE IF EXISTS inbox_worker")
    inbox.sql("CREATE ROLE inbox_worker LOGIN")
    try:
        with inbox.connect(user="inbox_worker") as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                claim(conn, uuid.uuid4())
        inbox.sql("GRANT EXECUTE ON FUNCTION outbox_inbox_claim(uuid, text) TO inbox_worker")
        with inbox.connect(user="inbox_worker") as conn:
            # A table of the same name on its search_path changes nothing.
            conn.execute("CREATE TEMPORARY TABLE inbox (id uuid, consumer text)")
            conn.execute("SET search_path = pg_temp, public")
            assert claim(conn, uuid.uuid4()) is True
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT count(*) FROM outbox.inbox")
        assert inbox.value("SELECT count(*) FROM outbox.inbox") == 1
    finally:
        inbox.sql("REVOKE ALL ON FUNCTION outbox_inbox_claim(uuid, text) FROM inbox_worker")
        inbox.sql("DROP ROLE inbox_worker")


def test_claims_older_than_the_retention_are_forgotten(inbox):
    old, recent = uuid.uuid4(), uuid.uuid4()
    with inbox.connect() as conn:
        claim(conn, old)
        claim(conn, recent)
    inbox.sql("UPDATE outbox.inbox SET claimed_at = now() - interval '2 hours' WHERE id = %s", (old,))
    inbox.configure(inbox_retention="1h", lifecycle_interval="1s")
    wait_until(lambda: inbox.value("SELECT count(*) FROM outbox.inbox WHERE id = %s", (old,)) == 0,
               timeout=60, message="the old claim purged")
    assert inbox.value("SELECT count(*) FROM outbox.inbox WHERE id = %s", (recent,)) == 1
    with inbox.connect() as conn:
        assert claim(conn, old) is True, "a forgotten message is claimed anew"


@library_only("outbox.settings checks what SQL reads as it is written; the sidecar names the rest in "
              "outbox.workers.last_error (tests/test_sidecar.py)")
def test_the_retention_is_checked(inbox):
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="outbox.inbox_retention"):
        inbox.configure(inbox_retention="10min")


# --- Through a Celery worker ---------------------------------------------------

QUEUE = "effects"


def dsn(pg):
    return f"host={pg.dir} port={pg.port} user=postgres dbname=postgres"


def results_url(redis_server):
    """The workers' result backend: the tests' Redis, database 1."""
    return redis_server.url.rsplit("/", 1)[0] + "/1"


def start_worker(pg, redis_server, pool="prefork"):
    worker = CeleryWorker(redis_server.url, queues=(QUEUE,), app="loop_app", pool=pool, concurrency=4,
                          env={"OUTBOX_TEST_DSN": dsn(pg), "OUTBOX_TEST_RESULTS": results_url(redis_server)})
    worker.wait_ready()
    return worker


def stored_results(redis_server, ids):
    """What the result backend holds for each task id: (state, result)."""
    client = redis_lib.Redis.from_url(results_url(redis_server))
    stored = [client.get(f"celery-task-meta-{i}") for i in ids]
    return [(meta["status"], meta["result"]) for meta in (json.loads(m) if m else {"status": None, "result": None}
                                                          for m in stored)]


@pytest.fixture
def effects(inbox, redis_server):
    inbox.sql("DROP TABLE IF EXISTS effects")
    inbox.sql("CREATE TABLE effects (event uuid NOT NULL, n integer NOT NULL)")
    inbox.empty()
    redis_server.client().delete(QUEUE)
    yield inbox
    inbox.sql("DROP TABLE effects")


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_every_message_delivered_twice_at_once_makes_its_effect_once(effects, redis_server, pool):
    """20 events sent while no worker runs; each message is then put in
    the queue twice, side by side, for four processes (or threads, or
    greenlets) to run at once: the effects table holds each event's row
    once, and every event is processed. Under gevent, a duplicate waiting
    for the first run's transaction must let that first run go on. The
    result backend keeps what each first run returned: a skipped duplicate,
    at once or late, stores nothing over it."""
    client = redis_server.client()
    with effects.connect() as conn:
        ids = [str(conn.execute("SELECT outbox_enqueue('effect', %s::jsonb, queue => %s, task => 'loop.effect')",
                                (json.dumps({"n": n}), QUEUE)).fetchone()[0]) for n in range(20)]
    wait_until(lambda: client.llen(QUEUE) == 20, timeout=30, message="20 messages sent")
    messages = client.lrange(QUEUE, 0, -1)
    client.delete(QUEUE)
    client.rpush(QUEUE, *[m for message in messages for m in (message, message)])
    before = effects.metric("outbox_inbox_duplicates_total") or 0
    worker = start_worker(effects, redis_server, pool)
    try:
        wait_until(lambda: effects.count("processed") == 20 and client.llen(QUEUE) == 0, timeout=120,
                   message="every event processed")
        wait_until(lambda: sum(worker.log_text().count(f"Task loop.effect[{i}] succeeded") for i in ids) == 40,
                   timeout=60, message="each message's two runs over")
        if effects.counts_in_sql:
            wait_until(lambda: (effects.metric("outbox_inbox_duplicates_total") or 0) - before == 20, timeout=60,
                       message="20 duplicates skipped")
        rows = effects.sql("SELECT event::text, count(*) FROM effects GROUP BY 1")
        assert sorted(rows) == sorted((i, 1) for i in ids)
        # A duplicate that arrives after the first committed is skipped too.
        client.rpush(QUEUE, messages[0])
        late = decode(messages[0])[0]["headers"]["id"]
        wait_until(lambda: worker.log_text().count(f"Task loop.effect[{late}] succeeded") == 3, timeout=60,
                   message="the late duplicate's run over")
        if effects.counts_in_sql:
            assert (effects.metric("outbox_inbox_duplicates_total") or 0) - before == 21
        assert effects.value("SELECT count(*) FROM effects") == 20
        assert stored_results(redis_server, ids) == [("SUCCESS", n) for n in range(20)]
    finally:
        worker.close()


def ran(redis_server, task_id):
    """The args of each run of loop.ok under task id `task_id`."""
    return [json.loads(n)["args"] for n in redis_server.client().lrange(f"ran:{task_id}", 0, -1)]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_duplicate_of_a_first_run_that_died_before_its_callbacks_sends_them(effects, redis_server, pool):
    """Three first runs committed their effect and their claim, and their
    worker died before Celery sent their callbacks or stored their results
    (the state they left is made here: the effect rows and the claims,
    committed, nothing else). Each message's redelivery is a duplicate,
    and what the first run left undone is done: its link runs, the chain
    goes on, the chord completes, each given None (the first run's value
    died with it), and the result backend holds the duplicate's SUCCESS.
    A duplicate of a first run that finished sends nothing again and
    leaves its stored value."""
    from celery import Celery, chain, chord

    app = Celery("outbox_inbox_client", broker=redis_server.url, backend=results_url(redis_server))

    def effect(n, task_id):
        return app.signature("loop.effect", args=(n,), queue=QUEUE).set(task_id=task_id)

    def ok(task_id):
        return app.signature("loop.ok", queue=QUEUE).set(task_id=task_id)

    linked, chained, part, other, finished = (str(uuid.uuid4()) for _ in range(5))
    after_link, after_chain, after_chord, after_finished = (str(uuid.uuid4()) for _ in range(4))
    with effects.connect() as conn:
        for died in (linked, chained, part):
            with conn.transaction():
                conn.execute("INSERT INTO effects (event, n) VALUES (%s, 0)", (died,))
                claim(conn, died, "loop.effect")
    worker = start_worker(effects, redis_server, pool)
    try:
        # A first run that finishes, and its link.
        effect(5, finished).apply_async(link=ok(after_finished))
        wait_until(lambda: ran(redis_server, after_finished) == [[5]], timeout=60, message="the finished run's link")

        effect(1, linked).apply_async(link=ok(after_link))
        chain(effect(2, chained), ok(after_chain)).apply_async()
        chord([effect(3, part), effect(4, other)], ok(after_chord)).apply_async()
        wait_until(lambda: ran(redis_server, after_link) and ran(redis_server, after_chain)
                   and ran(redis_server, after_chord), timeout=90, message="the callbacks the dead runs never sent")
        assert ran(redis_server, after_link) == [[None]]
        assert ran(redis_server, after_chain) == [[None]]
        assert ran(redis_server, after_chord) == [[[None, 4]]]
        assert stored_results(redis_server, [linked, chained, part, other]) == [("SUCCESS", None)] * 3 + [
            ("SUCCESS", 4)]

        # The finished run's message again: a duplicate that sends nothing.
        effect(5, finished).apply_async(link=ok(after_finished))
        wait_until(lambda: worker.log_text().count(f"Task loop.effect[{finished}] succeeded") == 2, timeout=60,
                   message="the duplicate of the finished run over")
        time.sleep(1)
        assert ran(redis_server, after_finished) == [[5]]
        assert stored_results(redis_server, [finished]) == [("SUCCESS", 5)]
        assert sorted(effects.sql("SELECT event::text, n FROM effects")) == sorted(
            [(linked, 0), (chained, 0), (part, 0), (other, 4), (finished, 5)])
    finally:
        worker.close()


def test_a_body_that_raises_rolls_its_claim_back_and_the_retry_makes_the_effect_once(effects, redis_server):
    worker = start_worker(effects, redis_server)
    try:
        with effects.connect() as conn:
            event = conn.execute("SELECT outbox_enqueue('effect', '{\"n\": 1, \"fail_first\": true}', "
                                 "queue => %s, task => 'loop.effect')", (QUEUE,)).fetchone()[0]
        wait_until(lambda: effects.count("processed") == 1, timeout=60, message="the event processed")
        assert effects.sql("SELECT event, n FROM effects") == [(event, 1)]
        assert effects.value("SELECT count(*) FROM outbox.inbox WHERE id = %s", (event,)) == 1
    finally:
        worker.close()


def test_a_server_crash_mid_drain_sends_duplicates_and_the_effects_happen_once(redis_server):
    """The crash test of tests/test_reliability.py, with tasks that write:
    the marks lost in the crash send events again (counted in the queue),
    and each event's effect is made once. The crash comes while a pushed
    batch waits to be marked, for certain (harness.drain_held)."""
    # Its own report list: the shared cluster's dispatchers read theirs on
    # the same Redis (clusters sharing a Redis need distinct keys).
    pg = new_cluster(redis_server.url, enabled="off", batch_size=200, report_key="inbox_crash.reports")
    client = redis_server.client()
    worker = None
    try:
        pg.install()
        pg.sql("CREATE TABLE effects (event uuid NOT NULL, n integer NOT NULL)")
        client.delete(QUEUE)
        with pg.connect() as conn:
            conn.execute("SELECT outbox_enqueue('effect', jsonb_build_object('n', n, 'hold', 0), queue => %s, "
                         "task => 'loop.effect') FROM generate_series(1, 3000) AS n", (QUEUE,))
        with drain_held(pg, begin=lambda: pg.configure(enabled="on")):
            pg.stop("immediate")
        pg.start()
        wait_until(lambda: pg.count("dispatched") == 3000, timeout=180, message="every event after recovery")
        sent = client.llen(QUEUE)
        assert sent > 3000, "the crash lost no mark: nothing was sent twice"
        worker = start_worker(pg, redis_server)
        wait_until(lambda: pg.count("processed") == 3000 and client.llen(QUEUE) == 0, timeout=300,
                   message="every event processed")
        assert pg.value("SELECT count(*) FROM effects") == 3000
        assert pg.value("SELECT count(DISTINCT event) FROM effects") == 3000
        if pg.counts_in_sql:
            wait_until(lambda: pg.metric("outbox_inbox_duplicates_total") == sent - 3000, timeout=60,
                       message="each duplicate skipped")
    finally:
        if worker is not None:
            worker.close()
        pg.close()


def driver_using(pg, driver):
    """`once(using)` for `driver`, and a function that writes an effect row
    through what the body is given."""
    insert = "INSERT INTO effects (event, n) VALUES (%s, %s)"
    if driver == "psycopg":
        return (lambda: psycopg.connect(dsn(pg))), lambda task, n, conn: conn.execute(insert, (task.request.id, n))
    if driver == "sqlalchemy":
        import sqlalchemy
        from sqlalchemy.orm import sessionmaker

        engine = sqlalchemy.create_engine(f"postgresql+psycopg://postgres@/postgres?host={pg.dir}&port={pg.port}")
        named = sqlalchemy.text("INSERT INTO effects (event, n) VALUES (CAST(:event AS uuid), :n)")
        return sessionmaker(engine), lambda task, n, session: session.execute(named, {"event": task.request.id,
                                                                                       "n": n})
    from test_enqueue import django_connection

    django_connection(pg)
    from django.db import connection, transaction

    transaction.set_autocommit(True)

    def write(task, n, _):
        with connection.cursor() as cursor:
            cursor.execute(insert, (task.request.id, n))

    return "default", write


@pytest.mark.parametrize("driver", ["psycopg", "sqlalchemy", "django"])
def test_once_with_each_driver_makes_the_effect_once(effects, driver):
    """The decorated body, called from two threads at once for the same
    message and once more after: one run writes, the others are skipped."""
    using, write = driver_using(effects, driver)
    keyword = {"psycopg": "conn", "sqlalchemy": "session", "django": None}[driver]

    @once(using)
    def body(task, n, **given):
        write(task, n, given.get(keyword) if keyword else None)
        time.sleep(0.3)
        return n

    message = str(uuid.uuid4())
    results = []

    def run():
        task = types.SimpleNamespace(name="effects.test", request=types.SimpleNamespace(id=message))
        try:
            results.append(body(task, 1))
        finally:
            if driver == "django":
                from django.db import connections

                connections.close_all()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    run()
    assert sorted(results, key=lambda r: r is None) == [1, None, None], results
    assert effects.value("SELECT count(*) FROM effects WHERE event = %s", (message,)) == 1


def test_once_refuses_what_would_break_its_promise(effects):
    """An autocommit connection, a body that caught its transaction's
    failure, a Django transaction already open, a keyword the task was given
    itself, a task id that is not a message's: each an error, nothing
    claimed."""
    import sqlalchemy
    from sqlalchemy.orm import sessionmaker

    from outbox_dispatch import AutocommitError

    def task():
        return types.SimpleNamespace(name="effects.test", request=types.SimpleNamespace(id=str(uuid.uuid4())))

    url = f"postgresql+psycopg://postgres@/postgres?host={effects.dir}&port={effects.port}"
    autocommit = sessionmaker(sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT"))

    @once(autocommit)
    def on_autocommit(task, session):
        session.execute(sqlalchemy.text("INSERT INTO effects VALUES (gen_random_uuid(), 1)"))

    with pytest.raises(AutocommitError, match="claim: the connection is in autocommit mode"):
        on_autocommit(task())

    @once(lambda: psycopg.connect(dsn(effects)))
    def swallowing(task, conn):
        conn.execute("INSERT INTO effects VALUES (gen_random_uuid(), 2)")
        try:
            conn.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            pass

    with pytest.raises(RuntimeError, match="the task's transaction failed"):
        swallowing(task())

    with pytest.raises(TypeError, match="the task was given 'conn' itself"):
        swallowing(task(), conn="mine")

    called_directly = types.SimpleNamespace(name="effects.test", request=types.SimpleNamespace(id=None))
    with pytest.raises(ValueError, match="the task id must be a UUID"):
        swallowing(called_directly)

    driver_using(effects, "django")
    from django.db import connections, transaction

    @once("default")
    def nested(task):
        pass

    with pytest.raises(RuntimeError, match="not in autocommit mode"):
        with transaction.atomic():
            nested(task())
    connections.close_all()
    assert effects.value("SELECT count(*) FROM effects") == 0
    assert effects.value("SELECT count(*) FROM outbox.inbox") == 0


def test_a_duplicate_at_repeatable_read_is_skipped_not_failed(effects):
    """At repeatable read, the duplicate's claim meets the first run's
    commit as a serialization failure: once() claims again in a new
    transaction, which sees it, and skips the body."""

    def repeatable_read():
        conn = psycopg.connect(dsn(effects))
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        return conn

    @once(repeatable_read)
    def body(task, n, conn):
        conn.execute("INSERT INTO effects (event, n) VALUES (%s, %s)", (task.request.id, n))
        time.sleep(0.5)
        return n

    message = str(uuid.uuid4())
    results, errors = [], []

    def run():
        task = types.SimpleNamespace(name="effects.rr", request=types.SimpleNamespace(id=message))
        try:
            results.append(body(task, 1))
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=30)
    assert errors == [] and sorted(results, key=lambda r: r is None) == [1, None], (results, errors)
    assert effects.value("SELECT count(*) FROM effects WHERE event = %s", (message,)) == 1


def test_a_task_that_replaces_itself_commits_its_writes(effects):
    """self.replace() sends the replacement and raises Ignore: the body's
    writes and its claim commit, and Ignore goes on to Celery."""
    from celery.exceptions import Ignore

    @once(lambda: psycopg.connect(dsn(effects)))
    def body(task, conn):
        conn.execute("INSERT INTO effects (event, n) VALUES (%s, 1)", (task.request.id,))
        raise Ignore()

    message = str(uuid.uuid4())
    with pytest.raises(Ignore):
        body(types.SimpleNamespace(name="effects.replaced", request=types.SimpleNamespace(id=message)))
    assert effects.value("SELECT count(*) FROM effects WHERE event = %s", (message,)) == 1
    assert effects.value("SELECT count(*) FROM outbox.inbox WHERE id = %s", (message,)) == 1
