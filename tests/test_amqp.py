"""RabbitMQ as the broker (outbox.broker_url = amqp://…): a real
rabbitmq-server on loopback, stock Celery workers on its AMQP, counted as
the Redis tests count: every committed event reaches a queue at least once,
a rolled-back one never does, and the broker's faults never spend a retry.

Hostile cases first: bad URLs and credentials, a queue declared otherwise,
a message nobody can route, the broker stopped mid-drain, a memory alarm."""

import json
import re
import shutil
import tempfile
import time

import pytest

from harness import CeleryWorker, RabbitMQ, drain_held, make_tls_files, wait_until
from standalone import installed_cluster, new_cluster


@pytest.fixture(scope="module")
def tls_files():
    directory = make_tls_files()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def rabbit(tls_files):
    node = RabbitMQ(tls=tls_files)
    yield node
    node.close()


@pytest.fixture(scope="module")
def amqp_cluster(rabbit, redis_server):
    # outbox.redis_url names the Redis; outbox.broker_url, set too, wins.
    with installed_cluster(redis_server.url, broker_url=rabbit.url, reconnect_delay_min="200ms",
                           reconnect_delay_max="1s", broker_timeout="3s") as pg:
        yield pg


@pytest.fixture
def ob(amqp_cluster, rabbit, redis_server):
    """The AMQP cluster with an empty outbox and a RabbitMQ without queues."""
    amqp_cluster.reset(enabled="on")
    amqp_cluster.empty()
    rabbit.reset()
    redis_server.client().flushdb()
    yield amqp_cluster


def enqueue(pg, n, queue="celery", task="tests.record", **extra):
    """Enqueues n events in one transaction; their ids."""
    with pg.connect(autocommit=False) as conn:
        ids = [str(r[0]) for r in conn.execute(
            "SELECT outbox_enqueue('test.event', jsonb_build_object('n', g), queue => %s, task => %s) "
            "FROM generate_series(1, %s) g", (queue, task, n)).fetchall()]
        conn.commit()
    return ids


def last_error(pg):
    return pg.value("SELECT string_agg(last_error, ' | ') FROM outbox.workers") or ""


def test_a_wrong_password_or_vhost_is_a_clear_error_and_spends_nothing(ob, rabbit):
    ob.configure(broker_url=f"amqp://guest:Zq-wrong-Wv@127.0.0.1:{rabbit.port}//")
    ids = enqueue(ob, 3)
    wait_until(lambda: "ACCESS_REFUSED" in last_error(ob), message="the refusal shown")
    # PostgreSQL itself logs a changed setting (outbox.broker_password_file
    # keeps a password out of it); no line of the dispatchers shows it.
    ours = [line for line in ob.log_text().splitlines() if "outbox.broker_url\" changed to" not in line]
    assert "Zq-wrong-Wv" not in last_error(ob) and not any("Zq-wrong-Wv" in line for line in ours)
    ob.configure(broker_url=f"amqp://guest:guest@127.0.0.1:{rabbit.port}/no-such-vhost")
    wait_until(lambda: "no-such-vhost" in last_error(ob) and "NOT_ALLOWED" in last_error(ob),
               message="the vhost refused")
    ob.configure(broker_url="amqp://guest:Zq%zzWv@127.0.0.1/")
    wait_until(lambda: "invalid outbox.broker_url" in last_error(ob), message="the URL refused")
    assert "Zq" not in last_error(ob)
    assert ob.value("SELECT count(*) FROM outbox.events WHERE status <> 'pending' OR retry_count > 0") == 0
    ob.configure(broker_url=rabbit.url)
    wait_until(lambda: ob.count("dispatched") == 3, message="the events sent once the URL is right")
    assert sorted(rabbit.drain("celery")) == sorted(ids)


@pytest.mark.broker_only
def test_amqps_with_a_trusted_ca_delivers_and_an_untrusted_one_is_refused(ob, rabbit, tls_files):
    ob.configure(broker_url=rabbit.tls_url, broker_tls_ca_file=str(tls_files / "other-ca.pem"))
    ids = enqueue(ob, 3)
    wait_until(lambda: "TLS" in last_error(ob) and "certificate" in last_error(ob), message="the certificate refused")
    assert ob.count("pending") == 3
    ob.configure(broker_tls_ca_file=str(tls_files / "ca.pem"))
    wait_until(lambda: ob.count("dispatched") == 3, message="the events sent over TLS")
    assert sorted(rabbit.drain("celery")) == sorted(ids)


@pytest.mark.broker_only
def test_queues_declared_their_own_way_are_used_as_they_are(ob, rabbit):
    """Queues an application declared its own way (Celery's
    `Queue('orders', queue_arguments={'x-message-ttl': …,
    'x-dead-letter-exchange': …})`, a quorum queue where the dispatchers
    would declare classic ones): used as they are, every event of every
    queue in the same claim delivered once, no retry spent."""
    channel = rabbit.channel()
    channel.exchange_declare("orders", "direct", durable=True, auto_delete=False)
    channel.queue_declare("orders", durable=True, auto_delete=False,
                          arguments={"x-message-ttl": 3_600_000, "x-dead-letter-exchange": "orders.dead"})
    channel.queue_bind("orders", "orders", "orders")
    channel.queue_declare("ledger", durable=True, auto_delete=False, arguments={"x-queue-type": "quorum"})
    channel.connection.close()
    with ob.connect(autocommit=False) as conn:
        ids = {queue: [] for queue in ("orders", "celery", "ledger")}
        for n in range(150):
            queue = ("orders", "celery", "ledger")[n % 3]
            ids[queue].append(str(conn.execute("SELECT outbox_enqueue('t', '{}', queue => %s, task => 'tests.record')",
                                               (queue,)).fetchone()[0]))
        conn.commit()
    wait_until(lambda: ob.count("dispatched") == 150,
               message=f"every event sent ({ob.count('dispatched')}; {last_error(ob)})")
    assert ob.value("SELECT max(retry_count) FROM outbox.events") == 0
    for queue, sent in ids.items():
        assert sorted(rabbit.drain(queue)) == sorted(sent), queue
    assert last_error(ob) == ""


@pytest.mark.broker_only
def test_a_queue_the_user_may_not_declare_fails_alone(ob, rabbit):
    """A user without the configure permission on one queue that does not
    exist: that queue's events retry and fail with RabbitMQ's reason; the
    events for the other queue, in the same claims, go out at once."""
    rabbit.ctl("add_user", "limited", "limited-pw")
    try:
        rabbit.ctl("set_permissions", "-p", "/", "limited", "^(?!forbidden).*", ".*", ".*")
        ob.configure(broker_url=f"amqp://limited:limited-pw@127.0.0.1:{rabbit.port}//", max_retries=2,
                     retry_backoff="100ms")
        with ob.connect(autocommit=False) as conn:
            allowed, forbidden = [], []
            for n in range(40):
                queue = "forbidden" if n % 2 else "celery"
                (allowed, forbidden)[n % 2].append(str(conn.execute(
                    "SELECT outbox_enqueue('t', '{}', queue => %s, task => 'tests.record')", (queue,)).fetchone()[0]))
            conn.commit()
        wait_until(lambda: ob.count("dispatched") == 20, message=f"the allowed events sent ({last_error(ob)})")
        wait_until(lambda: ob.count("failed") == 20, message="the forbidden events failed")
        errors = ob.sql("SELECT DISTINCT retry_count, last_error FROM outbox.events WHERE status = 'failed'")
        assert len(errors) == 1 and errors[0][0] == 2, errors
        assert 'declaring queue "forbidden"' in errors[0][1] and "403 ACCESS_REFUSED" in errors[0][1], errors
        assert sorted(rabbit.drain("celery")) == sorted(allowed)
        assert ob.value("SELECT max(retry_count) FROM outbox.events WHERE queue = 'celery'") == 0
    finally:
        ob.configure(broker_url=rabbit.url)
        rabbit.ctl("delete_user", "limited")


@pytest.mark.broker_only
def test_an_unroutable_message_is_that_events_failure(ob, rabbit):
    """The queue deleted behind the dispatcher's back: RabbitMQ returns the
    message (mandatory); that event fails with the reason, spends one retry,
    and its retry declares the queue again."""
    first = enqueue(ob, 1, queue="gone")
    wait_until(lambda: ob.count("dispatched") == 1, message="the first event sent")
    channel = rabbit.channel()
    channel.queue_delete("gone")
    channel.connection.close()
    (second,) = enqueue(ob, 1, queue="gone")
    wait_until(lambda: ob.value("SELECT retry_count FROM outbox.events WHERE id = %s", (second,)) == 1,
               message="the unroutable event failed once")
    error = ob.value("SELECT last_error FROM outbox.events WHERE id = %s", (second,))
    assert "unroutable" in error and "NO_ROUTE" in error and '"gone"' in error, error
    wait_until(lambda: ob.count("dispatched") == 2, message="the retry sent")
    assert rabbit.drain("gone") == [second]
    assert first


@pytest.mark.broker_only
def test_a_message_rabbitmq_cannot_take_fails_alone(ob, rabbit):
    """Poison next to good events in one round trip: headers too large for
    one AMQP frame, and a queue name RabbitMQ reserves. Each fails with its
    reason (spending its retries); the others are delivered exactly once."""
    with ob.connect(autocommit=False) as conn:
        good = [str(conn.execute("SELECT outbox_enqueue('t', '{}', task => 'tests.record')").fetchone()[0])
                for _ in range(5)]
        (big,) = conn.execute("SELECT outbox_enqueue('t', '{}', task => 'tests.record', "
                              "headers => jsonb_build_object('big', repeat('x', 200000)))").fetchone()
        (reserved,) = conn.execute("SELECT outbox_enqueue('t', '{}', task => 'tests.record', "
                                   "queue => 'amq.poison')").fetchone()
        good += [str(conn.execute("SELECT outbox_enqueue('t', '{}', task => 'tests.record')").fetchone()[0])
                 for _ in range(5)]
        conn.commit()
    wait_until(lambda: ob.count("dispatched") == 10, message="the good events sent")
    for poison, reason in ((big, "above the frame size negotiated with RabbitMQ"),
                           (reserved, 'RabbitMQ reserves the queue name "amq.poison"')):
        wait_until(lambda: ob.value("SELECT retry_count FROM outbox.events WHERE id = %s", (poison,)) >= 1,
                   message="the poison failed")
        assert reason in ob.value("SELECT last_error FROM outbox.events WHERE id = %s", (poison,))
    queued = rabbit.drain("celery")
    assert sorted(queued) == sorted(good), "each good event exactly once"
    assert last_error(ob) == ""


@pytest.mark.broker_only
def test_a_message_above_the_brokers_max_message_size_fails_alone(ob, rabbit):
    """RabbitMQ set to take at most 4 kB a message: one event above it (an
    ORM insert bypasses outbox.max_payload_bytes) spends its retries and is
    dead-lettered with RabbitMQ's reason; the events around it in the same
    round trip are delivered."""
    rabbit.ctl("eval", "application:set_env(rabbit, max_message_size, 4096).")
    try:
        rabbit.ctl("close_all_connections", "max_message_size changed")  # new channels take the limit
        ob.configure(max_retries=2, retry_backoff="100ms")
        with ob.connect(autocommit=False) as conn:
            good = enqueue_in(conn, 5)
            (big,) = conn.execute("INSERT INTO outbox.events (event_type, payload, queue, task) "
                                  "VALUES ('t', jsonb_build_object('blob', repeat('x', 10000)), 'celery', "
                                  "'tests.record') RETURNING id").fetchone()
            good += enqueue_in(conn, 5)
            conn.commit()
        wait_until(lambda: ob.count("dispatched") == 10, message=f"the good events sent ({last_error(ob)})")
        wait_until(lambda: ob.count("failed") == 1, message=f"the large event failed ({last_error(ob)})")
        status, retries, error = ob.sql("SELECT status, retry_count, last_error FROM outbox.events WHERE id = %s",
                                        (big,))[0]
        assert (status, retries) == ("failed", 2)
        assert "max_message_size (4096 bytes" in error and "is larger than configured max size 4096" in error, error
        queued = rabbit.drain("celery")
        assert set(queued) == set(good) and str(big) not in queued
        assert len(queued) - len(set(queued)) <= 10, "duplicates beyond the round trip"
    finally:
        rabbit.ctl("eval", "application:set_env(rabbit, max_message_size, 134217728).")


@pytest.mark.broker_only
def test_a_message_a_full_queue_rejects_fails_once_refused_twice(ob, rabbit):
    """A queue that rejects publishes when full (x-overflow reject-publish):
    RabbitMQ nacks its messages. Refused twice, a message is its own fault:
    it spends a retry, and is dead-lettered after outbox.max_retries. The
    events for another queue in the same claims are delivered, and the
    connection stays (a nack is no broker failure: it used to reconnect)."""
    channel = rabbit.channel()
    channel.exchange_declare("bounded", "direct", durable=True, auto_delete=False)
    channel.queue_declare("bounded", durable=True, auto_delete=False,
                          arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    channel.queue_bind("bounded", "bounded", "bounded")
    channel.connection.close()
    ob.configure(max_retries=2, retry_backoff="100ms")
    (kept,) = enqueue(ob, 1, queue="bounded")
    wait_until(lambda: ob.count("dispatched") == 1, message="the queue filled")
    # A first event for the other queue: it is declared afresh on this
    # connection (the fixture deleted it under the connection: refused once).
    warm = enqueue(ob, 1)
    wait_until(lambda: ob.count("dispatched") == 2, message="the other queue declared")
    before = reconnects(ob)
    with ob.connect(autocommit=False) as conn:
        others = enqueue_in(conn, 3)
        refused = enqueue_in(conn, 3, queue="bounded")
        others += enqueue_in(conn, 3)
        conn.commit()
    wait_until(lambda: ob.count("failed") == 3, timeout=60,
               message=f"the refused events dead-lettered ({ob.sql('SELECT status, retry_count FROM outbox.events')})")
    rows = ob.sql("SELECT id::text, retry_count, last_error FROM outbox.events WHERE status = 'failed'")
    assert sorted(i for i, _, _ in rows) == sorted(refused)
    assert all(r == 2 and "refused the message twice (basic.nack)" in e for _, r, e in rows), rows
    wait_until(lambda: ob.count("dispatched") == 8, message="the other events sent")
    assert sorted(set(rabbit.drain("celery"))) == sorted(others + warm)
    assert rabbit.drain("bounded") == [kept]
    assert reconnects(ob) == before, ob.log_text()[-3000:]
    assert ob.value("SELECT bool_and(connected) FROM outbox.workers")


@pytest.mark.broker_only
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_an_urgent_event_overtakes_a_backlog(ob, rabbit, redis_server, broker):
    """Priority 0 is the most urgent on both brokers: an event of priority 0
    enqueued after a backlog of priority 9 is the first a consumer gets,
    from kombu's priority lists on Redis, from a queue with x-max-priority
    on RabbitMQ."""
    ob.configure(report_key="", amqp_max_priority=10,
                 **({"broker_url": redis_server.url} if broker == "redis" else {}))
    backlog = enqueue_at(ob, 30, priority=9)
    wait_until(lambda: ob.count("dispatched") == 30, message="the backlog sent")
    (urgent,) = enqueue_at(ob, 1, priority=0)
    wait_until(lambda: ob.count("dispatched") == 31, message="the urgent event sent")
    if broker == "redis":
        import kombu
        with kombu.Connection(redis_server.url) as connection:
            queue = connection.SimpleQueue("celery", no_ack=True)
            order = [queue.get(timeout=5).headers["id"] for _ in range(31)]
    else:
        order = rabbit.drain("celery")
    assert order[0] == urgent, (order.index(urgent), broker)
    assert sorted(order[1:]) == sorted(backlog)


def enqueue_in(conn, n, queue="celery"):
    """Enqueues n events in the transaction of `conn`; their ids."""
    return [str(r[0]) for r in conn.execute(
        "SELECT outbox_enqueue('t', '{}', queue => %s, task => 'tests.record') FROM generate_series(1, %s)",
        (queue, n)).fetchall()]


def enqueue_at(pg, n, priority):
    return [str(r[0]) for r in pg.sql(
        "SELECT outbox_enqueue('t', '{}', task => 'tests.record', priority => %s) FROM generate_series(1, %s)",
        (priority, n))]


@pytest.mark.broker_only
@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_reports_whose_recording_failed_are_read_again(ob, rabbit, redis_server, queue_type):
    """Reports read while the database refuses to record them (a lock
    held past outbox.statement_timeout) are read again: once the lock is
    gone every event is processed. On a quorum report queue whose delivery
    limit (a policy) is 1, too: they are never handed back to the queue
    meanwhile, where each return would count and the second drop them."""
    ob.configure(report_key="outbox_reports", statement_timeout="500ms", amqp_queue_type=queue_type)
    if queue_type == "quorum":
        rabbit.ctl("set_policy", "report-limit", "^outbox_reports", '{"delivery-limit": 1}', "--apply-to", "queues")
        # The task queue as the (classic) worker declares it; the report
        # queue, missing, is declared of outbox.amqp_queue_type.
        channel = rabbit.channel()
        channel.queue_declare("celery", durable=True, auto_delete=False)
        channel.connection.close()
    try:
        ids = enqueue(ob, 20, task="loop.ok")
        wait_until(lambda: ob.count("dispatched") == 20, message="the events sent")
        if queue_type == "quorum":
            assert "quorum" in rabbit.ctl("list_queues", "name", "type", "--quiet", "--no-table-headers")
        with ob.connect(autocommit=False) as lock:
            lock.execute("LOCK TABLE outbox.log IN ACCESS EXCLUSIVE MODE")
            read_again(ob, rabbit, redis_server, ids, lock)
    finally:
        if queue_type == "quorum":
            rabbit.ctl("clear_policy", "report-limit")


def read_again(ob, rabbit, redis_server, ids, lock):
    """Runs the tasks while `lock` keeps their reports from being recorded
    for several tries, then releases it: every event ends processed."""
    worker = CeleryWorker(rabbit.url, app="loop_app", env={"OUTBOX_TEST_NOTES": redis_server.url})
    try:
        worker.wait_ready()
        notes = redis_server.client()
        try:
            # Generous: a worker's report may wait out the companion's
            # confirm timeout (10 s) while the database refuses them.
            wait_until(lambda: all(notes.exists(f"ran:{i}") for i in ids), timeout=300, message="the tasks run")
        except AssertionError as e:
            raise AssertionError(f"{e}: {rabbit.depth('celery')} {worker.log_text()[-3000:]}") from None
        time.sleep(6)  # the dispatcher reads the reports, and fails to record them, several times
        lock.rollback()
        try:
            wait_until(lambda: ob.count("processed") == 20, timeout=60, message="every report recorded")
        except AssertionError as e:
            raise AssertionError(f"{e}: {ob.sql('SELECT status, count(*) FROM outbox.events GROUP BY 1')} "
                                 f"{rabbit.depth(ob.report_list())} {ob.log_text()[-4000:]}") from None
    finally:
        worker.close()


def test_a_stock_worker_runs_every_event(ob, rabbit, redis_server):
    """Messages as kombu's py-amqp transport publishes them: a stock Celery
    worker on amqp:// runs each, with its arguments, headers and priority."""
    # No reports (this worker's app does not import the companion): a key's
    # next event goes once the one before it is confirmed.
    ob.configure(report_key="")
    worker = CeleryWorker(rabbit.url, queues=("celery", "renders"), env={"OUTBOX_TEST_NOTES": redis_server.url})
    try:
        worker.wait_ready()
        with ob.connect() as conn:
            ids = [
                conn.execute("SELECT outbox_enqueue('t', '{\"a\": 1, \"b\": [true, null]}', task => 'tests.record')")
                .fetchone()[0],
                conn.execute("SELECT outbox_enqueue('t', '[1, \"two\", 3.5]', queue => 'renders', "
                             "task => 'tests.record', priority => 7)").fetchone()[0],
                conn.execute("SELECT outbox_enqueue('order.paid', '\"just one\"', task => 'tests.record', "
                             "headers => '{\"traceparent\": \"00-abc-def-01\", \"n\": {\"deep\": [1]}}')")
                .fetchone()[0],
            ]
            ids += [
                conn.execute("SELECT outbox_enqueue('t', '{\"k\": \"v\"}', task => 'tests.record', "
                             "args => '[1, 2]', expires => '1 hour')").fetchone()[0],
                conn.execute("SELECT outbox_enqueue('t', '{\"late\": true}', task => 'tests.record', "
                             "delay => '1 second', ordering_key => 'order:1')").fetchone()[0],
                conn.execute("SELECT outbox_enqueue('t', '{\"after\": true}', task => 'tests.record', "
                             "ordering_key => 'order:1')").fetchone()[0],
            ]
            # A subscription: the event is routed, its delivery is a message.
            conn.execute("SELECT outbox_subscribe('shop.paid', 'tests.record')")
            conn.execute("SELECT outbox_enqueue('shop.paid', '{\"sub\": 1}')")
        ids = [str(i) for i in ids]
        executed = redis_server.client()
        try:
            wait_until(lambda: executed.hlen("executed") == 7, timeout=60, message="the worker to run every event")
        except AssertionError as e:
            raise AssertionError(f"{e}: {executed.hlen('executed')} "
                                 f"{ob.sql('SELECT event_type, status, key_state, last_error FROM outbox.events')} "
                                 f"{worker.log_text()[-2000:]}") from None
        ran = {i: json.loads(executed.hget("executed", i)) for i in ids}
        assert ran[ids[0]]["kwargs"] == {"a": 1, "b": [True, None]} and ran[ids[0]]["args"] == []
        assert ran[ids[1]]["args"] == [1, "two", 3.5]
        assert ran[ids[2]]["args"] == ["just one"] and ran[ids[2]]["event_type"] == "order.paid"
        assert ran[ids[2]]["traceparent"] == "00-abc-def-01"
        assert ran[ids[3]]["args"] == [1, 2] and ran[ids[3]]["kwargs"] == {"k": "v"}
        assert ran[ids[4]]["kwargs"] == {"late": True} and ran[ids[5]]["kwargs"] == {"after": True}
        assert {"sub": 1} in [json.loads(v)["kwargs"] for v in executed.hvals("executed")]
        wait_until(lambda: ob.count("dispatched") == 7, message="every message recorded as dispatched")
    finally:
        worker.close()


def test_rolled_back_events_never_reach_the_broker(ob, rabbit):
    with ob.connect(autocommit=False) as conn:
        conn.execute("SELECT outbox_enqueue('t', '{}', task => 'tests.record') FROM generate_series(1, 50)")
        conn.rollback()
    committed = enqueue(ob, 20)
    wait_until(lambda: ob.count("dispatched") == 20, message="the committed events sent")
    assert sorted(rabbit.drain("celery")) == sorted(committed)


@pytest.mark.broker_only
def test_the_broker_stopped_mid_drain_loses_nothing(ob, rabbit):
    """RabbitMQ stopped while 3,000 events drain (held there: a pushed
    batch's mark waits), then started again (the queue and its persistent
    messages kept): every event is in the queue, none failed, no retry
    spent."""
    ob.configure(batch_size=50, enabled="off")
    ids = []
    for _ in range(6):
        ids += enqueue(ob, 500)
    with drain_held(ob, until=lambda: ob.count("dispatched") >= 100, begin=lambda: ob.configure(enabled="on")):
        rabbit.stop()
    wait_until(lambda: ob.value("SELECT bool_and(NOT connected) FROM outbox.workers"),
               message="the dispatcher to notice")
    time.sleep(2)
    rabbit.start()
    wait_until(lambda: ob.count("dispatched") == 3000, timeout=120, message="every event dispatched")
    queued = rabbit.drain("celery")
    assert set(queued) == set(ids)
    assert len(queued) - len(set(queued)) <= 50, "duplicates beyond one round trip"
    assert ob.value("SELECT max(retry_count) FROM outbox.events") == 0
    assert ob.value("SELECT count(*) FROM outbox.events WHERE status = 'failed'") == 0


def reconnects(pg):
    return pg.value("SELECT coalesce(sum(value), 0) FROM outbox.metrics WHERE name = 'outbox_reconnects_total'")


@pytest.mark.broker_only
def test_a_memory_alarm_pauses_publishing_on_the_same_connection(ob, rabbit):
    """A memory alarm: RabbitMQ blocks publishers. The dispatcher keeps
    the connection and shows the alarm (not a broker that did not answer,
    though the pause outlasts outbox.broker_timeout), spends no retry, and
    its round trip is confirmed once the alarm clears: each event in the
    queue once."""
    first = enqueue(ob, 1)
    wait_until(lambda: ob.count("dispatched") == 1, message="a first event sent")
    before = reconnects(ob)
    rabbit.ctl("set_vm_memory_high_watermark", "0.000001")
    try:
        ids = enqueue(ob, 20)
        wait_until(lambda: "RabbitMQ blocked the connection" in last_error(ob), message="the alarm shown",
                   seen=lambda: (ob.sql("TABLE outbox.workers"),
                                 ob.sql("SELECT status, count(*) FROM outbox.events GROUP BY 1")))
        time.sleep(4)  # longer than outbox.broker_timeout (3s)
        assert ob.sql("SELECT status, retry_count, last_error FROM outbox.events WHERE retry_count > 0") == []
        assert "RabbitMQ blocked the connection" in last_error(ob), last_error(ob)
        assert ob.value("SELECT bool_and(connected) FROM outbox.workers")
        assert reconnects(ob) == before
        assert ob.value("SELECT max(retry_count) FROM outbox.events") == 0
        assert ob.count("failed") == 0
        # SIGHUP is answered meanwhile (the reload is logged); a reload of
        # settings the pause derives from (processing_timeout, batch_size)
        # changes no connection: the paused push goes on, on the same one.
        ports = rabbit.ctl("list_connections", "peer_port", "--quiet", "--no-table-headers").split()
        noted = ob.log_text().count("during a broker operation")
        ob.configure(poll_interval="59s", processing_timeout="301s", batch_size=99)
        wait_until(lambda: ob.log_text().count("during a broker operation") > noted,
                   message="the reload during the alarm")
        time.sleep(1)
        assert rabbit.ctl("list_connections", "peer_port", "--quiet", "--no-table-headers").split() == ports
        assert ob.value("SELECT bool_and(connected) FROM outbox.workers")
    finally:
        rabbit.ctl("set_vm_memory_high_watermark", "0.4")
    wait_until(lambda: ob.count("dispatched") == 21, timeout=60, message="the events sent after the alarm")
    queued = rabbit.drain("celery")
    assert sorted(queued) == sorted(first + ids), "each event once"
    assert reconnects(ob) == before
    assert ob.value("SELECT max(retry_count) FROM outbox.events") == 0
    wait_until(lambda: last_error(ob) == "", message="the alarm no longer shown")
    assert ob.metric("outbox_broker_refusals_total", condition="blocked") >= 1


def test_reports_travel_over_amqp(ob, rabbit, redis_server):
    """The companion reports through the worker's own AMQP connection to a
    queue the dispatchers read: every event processed, the queue emptied
    (each report acknowledged once recorded)."""
    ob.configure(report_key="outbox_reports")
    worker = CeleryWorker(rabbit.url, app="loop_app", pool="prefork", concurrency=2,
                          env={"OUTBOX_TEST_NOTES": redis_server.url})
    try:
        worker.wait_ready()
        enqueue(ob, 200, task="loop.ok")
        (failing,) = enqueue(ob, 1, task="loop.boom")
        try:
            wait_until(lambda: ob.count("processed") == 200, timeout=120, message="every event processed")
        except AssertionError as e:
            raise AssertionError(f"{e}; {ob.sql('SELECT status, count(*) FROM outbox.events GROUP BY 1')} {last_error(ob)}; worker: {[l for l in worker.log_text().splitlines() if 'report' in l][:5]} server: {[l for l in ob.log_text().splitlines() if 'report' in l][-5:]}") from None
        wait_until(lambda: ob.value("SELECT status FROM outbox.events WHERE id = %s", (failing,)) == "failed",
                   timeout=60, message="the failing task reported")
        report_queue = ob.report_list()
        wait_until(lambda: rabbit.depth(report_queue) == 0, message="every report acknowledged")
    finally:
        worker.close()


@pytest.mark.broker_only
def test_a_cluster_node_killed_mid_drain_loses_nothing(redis_server):
    """Three RabbitMQ nodes clustered on loopback, a quorum queue, the URL
    naming all three: the node the dispatcher is connected to (the first)
    is killed while 20,000 events drain, 2,000 of them or more sent (held
    there: a pushed batch's mark waits). Every event is in the queue on the
    nodes left, none failed, no retry spent, and the duplicates stay within
    one round trip."""
    home = tempfile.mkdtemp(prefix="outbox-rabbit-cluster-")
    nodes = []
    try:
        first = RabbitMQ(home=home)
        nodes.append(first)
        others = [RabbitMQ(home=home, wait=False) for _ in range(2)]
        nodes += others
        for node in others:
            node.await_startup()
            node.join(first)
        assert first.ctl("cluster_status").count("outbox") >= 3
        url = ";".join(f"amqp://guest:guest@127.0.0.1:{n.port}//" for n in nodes)
        pg = new_cluster(redis_server.url, broker_url=url, amqp_queue_type="quorum", batch_size=500,
                     max_batch_bytes="64kB", reconnect_delay_min="100ms", reconnect_delay_max="1s",
                     broker_timeout="5s", report_key="", enabled="off")
        try:
            pg.install()
            ids = []
            for _ in range(20):
                ids += enqueue(pg, 1000, queue="ha")
            with drain_held(pg, until=lambda: pg.count("dispatched") >= 2000,
                            begin=lambda: pg.configure(enabled="on")):
                first.kill()
            wait_until(lambda: pg.count("dispatched") == 20_000, timeout=480, message="every event dispatched")
            moved = re.findall(r"reconnected to RabbitMQ at \S+ \(node 127\.0\.0\.1:(\d+)\)", pg.log_text())
            assert moved and moved[-1] != str(first.port), moved
            queued = others[0].drain("ha")
            assert set(queued) == set(ids)
            assert len(queued) - len(set(queued)) <= 500, "duplicates beyond one round trip"
            assert pg.value("SELECT max(retry_count) FROM outbox.events") == 0
            assert pg.count("failed") == 0
        finally:
            pg.close()
    finally:
        for node in nodes:
            node.close()
        shutil.rmtree(home, ignore_errors=True)
