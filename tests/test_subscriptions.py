"""Subscriptions, with a stock Celery worker running every delivery: one
event to every subscribed task (each delivery its own task, status, retry
and dead letter), the fallback without subscriptions, an explicit task,
prefixes, routing fixed at enqueue, accumulated batches by count and by
time and across a crash, privileges and bad arguments."""

import json
import time
from pathlib import Path

import psycopg
import pytest

from harness import CeleryWorker, queued_ids, wait_until
from standalone import library_only, new_cluster
from outbox_dispatch import publish as publish_from_python

QUEUE = "loop_subscribers"
PLAIN = "q_sub_plain"  # no worker reads it


@pytest.fixture(scope="module")
def subscriber(redis_server):
    worker = CeleryWorker(redis_server.url, queues=(QUEUE,), app="loop_app", pool="threads", concurrency=4)
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.close()


def clear(pg):
    """Empties the tables."""
    pg.empty("outbox.log, outbox.batches, outbox.outcomes, outbox.batch_members, outbox.all_subscriptions")


@pytest.fixture
def subs(cluster, subscriber):
    cluster.reset(enabled="on")
    clear(cluster)
    yield cluster
    clear(cluster)


def subscribe(pg, event_type, task, **options):
    names = ", ".join(f"{name} => %s" for name in options)
    return pg.value(f"SELECT outbox_subscribe(%s, %s, queue => %s{', ' + names if names else ''})",
                    (event_type, task, QUEUE, *options.values()))


def publish(pg, event_type, payload=None, **options):
    names = "".join(f", {name} => %s" for name in options)
    return pg.value(f"SELECT outbox_enqueue(%s, %s{names})",
                    (event_type, json.dumps(payload or {}), *options.values()))


def runs(redis_server, task_id):
    return [json.loads(n) for n in redis_server.client().lrange(f"ran:{task_id}", 0, -1)]


def deliveries(pg, event_id):
    return pg.sql("SELECT task, delivery_id, status, batched FROM outbox.deliveries WHERE event_id = %s "
                  "ORDER BY task", (event_id,))


def wait_deliveries(pg, status, count, timeout=60):
    def done():
        return pg.value("SELECT count(*) FROM outbox.deliveries WHERE status = %s", (status,))
    wait_until(lambda: done() == count, timeout=timeout,
               message=f"{count} deliveries {status} (are {pg.sql('SELECT status, count(*) FROM outbox.deliveries GROUP BY 1')})")


def test_an_event_goes_to_every_subscription_as_its_own_task(subs, redis_server):
    tasks = ("loop.billing", "loop.email", "loop.search")
    ids = {task: subscribe(subs, "shop.order.created", task) for task in tasks}
    events = [publish(subs, "shop.order.created", {"n": n}) for n in range(20)]
    # An ORM's INSERT routes the same way, and still gets its row back.
    for n in range(20, 25):
        row = subs.sql("INSERT INTO outbox.events (event_type, payload) VALUES ('shop.order.created', %s) "
                       "RETURNING id, status::text, routed_to", (json.dumps({"n": n}),))
        assert row[0][1:] == ("processed", 3)
        events.append(row[0][0])
    wait_deliveries(subs, "processed", 75)

    for n, event in enumerate(events):
        rows = subs.sql("SELECT task, subscription_id, delivery_id, status FROM outbox.deliveries "
                        "WHERE event_id = %s ORDER BY task", (event,))
        assert [(r[0], r[1], r[3]) for r in rows] == [(t, ids[t], "processed") for t in tasks]
        assert len({r[2] for r in rows} | {event}) == 4, "a task id of its own per delivery"
        for task, _, delivery, _ in rows:
            assert runs(redis_server, delivery) == [
                {"task": task, "args": [], "kwargs": {"n": n}, "event": str(event)}]
    assert subs.value("SELECT count(*) FROM outbox.events WHERE routed_to = 3 AND status = 'processed'") == 25


def test_publish_from_python_routes_like_sql(subs, redis_server):
    subscribe(subs, "shop.order.placed", "loop.billing")
    subscribe(subs, "shop.order.placed", "loop.email", priority=9)
    with subs.connect(autocommit=False) as conn:
        event = publish_from_python(conn, "shop.order.placed", {"order": 7}, headers={"tenant": "acme"})
    wait_deliveries(subs, "processed", 2)
    rows = deliveries(subs, event)
    assert [r[0] for r in rows] == ["loop.billing", "loop.email"]
    for task, delivery, _, _ in rows:
        assert runs(redis_server, delivery) == [{"task": task, "args": [], "kwargs": {"order": 7}, "event": str(event)}]
    assert subs.sql("SELECT priority, headers->>'tenant' FROM outbox.events WHERE event_id = %s ORDER BY priority",
                    (event,)) == [(0, "acme"), (9, "acme")]


def test_while_no_subscription_is_active_the_routing_trigger_is_not_called(subs):
    """Events without a task cost what they did before subscriptions: the
    routing trigger runs only while some subscription is active, which each
    session learns at the commit of a change (the cache invalidation)."""
    with subs.connect() as producer, subs.connect() as admin:
        producer.execute("SET track_functions = 'pl'")

        def enqueue_and_count():
            producer.execute("SELECT outbox_enqueue('shop.counted', '{}', queue => 'q_sub_counted')")
            producer.execute("SELECT pg_stat_force_next_flush()")
            return producer.execute("SELECT coalesce((SELECT calls FROM pg_stat_user_functions "
                                    "WHERE funcname = 'outbox_route'), 0)").fetchone()[0]

        assert [enqueue_and_count() for _ in range(3)] == [0, 0, 0]
        sub = admin.execute("SELECT outbox_subscribe('shop.counted', 'loop.billing', queue => 'q_sub_counted')"
                            ).fetchone()[0]
        assert enqueue_and_count() == 1
        admin.execute("SELECT outbox_unsubscribe(%s)", (sub,))
        assert enqueue_and_count() == 1
    assert subs.sql("SELECT routed_to FROM outbox.events WHERE event_id IS NULL ORDER BY created_at") == [
        (0,), (0,), (0,), (1,), (0,)]


def test_without_subscriptions_or_with_a_task_an_event_goes_to_one_task(subs, redis_server):
    subscribe(subs, "shop.order.created", "loop.billing")
    # No subscription for its type: the task named like the event type.
    fallback = publish(subs, "loop.search", {"n": 1}, queue=QUEUE)
    # An explicit task: that task alone, subscriptions or not.
    explicit = publish(subs, "shop.order.created", {"n": 2}, queue=QUEUE, task="loop.email")
    wait_until(lambda: runs(redis_server, fallback) and runs(redis_server, explicit), message="both ran")
    assert runs(redis_server, fallback) == [{"task": "loop.search", "args": [], "kwargs": {"n": 1}, "event": None}]
    assert runs(redis_server, explicit) == [{"task": "loop.email", "args": [], "kwargs": {"n": 2}, "event": None}]
    assert subs.value("SELECT routed_to FROM outbox.events WHERE id = %s", (fallback,)) == 0
    assert subs.value("SELECT count(*) FROM outbox.deliveries") == 0
    assert subs.value("SELECT count(*) FROM outbox.events") == 2


def test_a_trailing_star_subscribes_to_a_prefix(subs, redis_server):
    subscribe(subs, "shop.*", "loop.search")
    subscribe(subs, "shop.order.created", "loop.billing")
    created = publish(subs, "shop.order.created")
    refund = publish(subs, "shop.refund")
    outside = [publish(subs, "shopping.cart", queue=PLAIN), publish(subs, "shop", queue=PLAIN)]
    wait_deliveries(subs, "processed", 3)
    assert [r[0] for r in deliveries(subs, created)] == ["loop.billing", "loop.search"]
    assert [r[0] for r in deliveries(subs, refund)] == ["loop.search"]
    wait_until(lambda: sorted(queued_ids(redis_server.client(), PLAIN)) == sorted(map(str, outside)),
               message="the unmatched events sent as they are")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=r"has a \* before its end"):
        subs.sql("SELECT outbox_subscribe('shop.*.created', 'loop.search')")


def test_one_failed_delivery_is_retried_alone(subs, redis_server):
    subscribe(subs, "shop.paid", "loop.billing")
    subscribe(subs, "shop.paid", "loop.email")
    event = publish(subs, "shop.paid", {"fail_first": "loop.email"})
    wait_deliveries(subs, "processed", 1)
    wait_deliveries(subs, "failed", 1)
    [(task, delivery, event_id, error)] = subs.sql(
        "SELECT task, id, event_id, last_error FROM outbox.dead_letters")
    assert (task, event_id) == ("loop.email", event)
    assert error.startswith("RuntimeError: loop.email failed its first run")
    billing = deliveries(subs, event)[0][1]

    assert subs.value("SELECT outbox_retry(%s)", (delivery,)) is True
    wait_deliveries(subs, "processed", 2)
    assert len(runs(redis_server, delivery)) == 2
    assert len(runs(redis_server, billing)) == 1, "the delivery that succeeded ran once"
    assert subs.value("SELECT outbox_retry_failed()") == 0


def test_routing_is_fixed_when_the_event_is_inserted(subs, redis_server):
    first = subscribe(subs, "shop.shipped", "loop.billing")
    with subs.connect(autocommit=False) as writer:
        early = writer.execute("SELECT outbox_enqueue('shop.shipped', '{}')").fetchone()[0]
        # Subscribed after the INSERT, before its commit: not this event's.
        subscribe(subs, "shop.shipped", "loop.email")
    late = publish(subs, "shop.shipped")
    wait_deliveries(subs, "processed", 3)
    assert [r[0] for r in deliveries(subs, early)] == ["loop.billing"]
    assert [r[0] for r in deliveries(subs, late)] == ["loop.billing", "loop.email"]

    # Unsubscribing keeps what was routed already.
    subs.configure(enabled="off")
    wait_until(lambda: subs.value("SELECT state FROM outbox.workers") == "paused", message="paused")
    routed = publish(subs, "shop.shipped")
    assert subs.value("SELECT outbox_unsubscribe(%s)", (first,)) is True
    assert subs.value("SELECT outbox_unsubscribe(%s)", (first,)) is False
    after = publish(subs, "shop.shipped")
    subs.configure(enabled="on")
    wait_deliveries(subs, "processed", 6)
    assert [r[0] for r in deliveries(subs, routed)] == ["loop.billing", "loop.email"]
    assert [r[0] for r in deliveries(subs, after)] == ["loop.email"]
    assert [r[0] for r in subs.sql("SELECT task FROM outbox.subscriptions")] == ["loop.email"]


def batch_notes(redis_server, pg):
    """The lists of events each batch delivery's task received."""
    batches = pg.sql("SELECT id FROM outbox.events WHERE subscription_id IS NOT NULL AND event_id IS NULL "
                     "ORDER BY created_at")
    received = []
    for (batch,) in batches:
        [run] = runs(redis_server, batch)
        assert run["kwargs"] == {} and len(run["args"]) == 1
        received.append(run["args"][0])
    return received


def test_an_accumulated_subscription_delivers_batch_max_events_at_a_time(subs, redis_server):
    sub = subscribe(subs, "shop.viewed", "loop.digest", batch_max=5)
    events = [publish(subs, "shop.viewed", {"n": n}) for n in range(12)]
    wait_deliveries(subs, "processed", 10)
    assert subs.value("SELECT waiting FROM outbox.subscriptions WHERE id = %s", (sub,)) == 2
    assert [r[2] for r in deliveries(subs, events[-1])] == ["waiting"]
    events += [publish(subs, "shop.viewed", {"n": n}) for n in range(12, 15)]
    wait_deliveries(subs, "processed", 15)

    received = batch_notes(redis_server, subs)
    assert [len(b) for b in received] == [5, 5, 5]
    flat = [item for batch in received for item in batch]
    assert [item["id"] for item in flat] == [str(e) for e in events], "each event once, oldest first"
    assert flat[0] == {"id": str(events[0]), "event_type": "shop.viewed", "payload": {"n": 0}}
    assert subs.metric("outbox_accumulated_batches_total") >= 3


def test_an_accumulated_subscription_delivers_after_batch_wait(subs, redis_server):
    subscribe(subs, "shop.searched", "loop.digest", batch_max=100, batch_wait="1 second")
    subscribe(subs, "shop.searched", "loop.search")
    events = [publish(subs, "shop.searched", {"n": n}) for n in range(3)]
    wait_deliveries(subs, "processed", 6)
    [batch] = batch_notes(redis_server, subs)
    assert [item["id"] for item in batch] == [str(e) for e in events]
    # Not sent before the oldest had waited batch_wait.
    assert subs.value("""
        SELECT sent.marked_at - min(m.available_at) >= interval '1 second'
          FROM outbox.batch_members m JOIN outbox.events b ON b.id = m.batch_id
          JOIN outbox.batches sent ON sent.id = b.batch GROUP BY sent.marked_at""")


def test_the_dispatchers_sleep_ends_at_the_next_batch_wait(subs):
    """What the dispatcher asks before it sleeps (sql/worker/next_due.sql)
    counts the oldest waiting member's batch_wait, and a delayed member's
    fall due."""
    subs.configure(enabled="off")
    wait_until(lambda: subs.value("SELECT state FROM outbox.workers") == "paused", message="paused")
    next_due = (Path(__file__).resolve().parent.parent / "sql" / "worker" / "next_due.sql").read_text()
    next_due = next_due.replace("$1::bigint[]", "'{}'::bigint[]").replace("$2", "'-Infinity'")
    assert subs.value(next_due) is None
    subscribe(subs, "shop.idle", "loop.digest", batch_max=100, batch_wait="30 seconds")
    publish(subs, "shop.idle")
    assert 25 < subs.value(next_due) <= 30
    subscribe(subs, "shop.later", "loop.digest", batch_max=2)
    publish(subs, "shop.later", delay="10 seconds")
    assert 5 < subs.value(next_due) <= 10


def test_a_purged_batch_takes_its_members_with_it(subs, redis_server):
    subscribe(subs, "shop.purged", "loop.digest", batch_max=2)
    publish(subs, "shop.purged")
    publish(subs, "shop.purged")
    wait_deliveries(subs, "processed", 2)
    assert subs.value("SELECT count(*) FROM outbox.batch_members") == 2
    subs.configure(retention="1s", lifecycle_interval="1s")
    wait_until(lambda: subs.value("SELECT count(*) FROM outbox.batch_members") == 0, timeout=30,
               message="the members purged with their batch")
    assert subs.value("SELECT count(*) FROM outbox.events WHERE subscription_id IS NOT NULL") == 0


def test_unsubscribing_delivers_the_waiting_members_at_once(subs, redis_server):
    sub = subscribe(subs, "shop.rated", "loop.digest", batch_max=100, batch_wait="1 hour")
    events = [publish(subs, "shop.rated", {"n": n}) for n in range(4)]
    wait_until(lambda: subs.value("SELECT waiting FROM outbox.subscriptions") == 4, message="4 waiting")
    assert subs.value("SELECT outbox_unsubscribe(%s)", (sub,)) is True
    wait_deliveries(subs, "processed", 4)
    assert [[item["id"] for item in b] for b in batch_notes(redis_server, subs)] == [[str(e) for e in events]]
    assert subs.value("SELECT count(*) FROM outbox.subscriptions") == 0


def test_a_crash_while_a_batch_accumulates_loses_and_repeats_nothing(redis_server, subscriber):
    pg = new_cluster(redis_server.url, report_key="outbox_dispatch.reports.crash")
    try:
        pg.install()
        subscribe(pg, "shop.clicked", "loop.digest", batch_max=10, batch_wait="3 seconds")
        waiting = [publish(pg, "shop.clicked", {"n": n}) for n in range(7)]
        pg.stop("immediate")
        pg.start()
        full = [publish(pg, "shop.clicked", {"n": n}) for n in range(7, 17)]
        # A full batch, then a crash at once: its delivery was made or not,
        # with its members, never half.
        pg.stop("immediate")
        pg.start()
        wait_deliveries(pg, "processed", 17, timeout=90)
        received = batch_notes(redis_server, pg)
        flat = sorted(item["id"] for batch in received for item in batch)
        assert flat == sorted(str(e) for e in waiting + full), "every event in exactly one batch"
        assert all(len(b) <= 10 for b in received)
        assert pg.value("SELECT count(*) FROM outbox.batch_members WHERE batch_id IS NULL") == 0
    finally:
        pg.close()


OWNER_SUBSCRIBES = "without the library only the outbox's owner manages subscriptions (docs/guides/managed.md)"


@library_only(OWNER_SUBSCRIBES)
def test_only_the_owner_or_a_grantee_subscribes_and_any_writer_routes(subs, redis_server):
    subs.sql("DROP ROLE IF EXISTS sub_writer")
    subs.sql("""CREATE ROLE sub_writer LOGIN;
                GRANT USAGE ON SCHEMA outbox TO sub_writer;
                GRANT INSERT ON outbox.events, outbox.log TO sub_writer;
                GRANT EXECUTE ON FUNCTION outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer,
                                                         interval, jsonb, text) TO sub_writer""")
    try:
        with subs.connect(user="sub_writer") as writer:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                writer.execute("SELECT outbox_subscribe('shop.granted', 'loop.billing')")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                writer.execute("SELECT outbox_unsubscribe(1)")
            subs.sql("GRANT EXECUTE ON FUNCTION outbox_subscribe(text, text, text, integer, integer, interval) "
                     "TO sub_writer")
            writer.execute("SELECT outbox_subscribe('shop.granted', 'loop.billing', queue => %s)", (QUEUE,))
            writer.execute("SELECT outbox_subscribe('shop.granted', 'loop.digest', queue => %s, batch_max => 1)",
                           (QUEUE,))
            event = writer.execute("SELECT outbox_enqueue('shop.granted', '{}')").fetchone()[0]
            writer.execute("INSERT INTO outbox.events (event_type) VALUES ('shop.granted')")
        wait_deliveries(subs, "processed", 4)
        assert [r[0] for r in deliveries(subs, event)] == ["loop.billing", "loop.digest"]
    finally:
        subs.sql("DROP OWNED BY sub_writer; DROP ROLE sub_writer")


@pytest.mark.parametrize("arguments, message", [
    ("NULL, 'loop.billing'", "event_type is 0 bytes, it must be 1 to 255 bytes"),
    ("repeat('e', 256), 'loop.billing'", "event_type is 256 bytes, it must be 1 to 255 bytes"),
    ("'shop.x', ''", "task is 0 bytes, it must be 1 to 255 bytes"),
    ("'shop.x', 'loop.billing', queue => ''", "queue is 0 bytes, it must be 1 to 255 bytes"),
    ("'shop.x', 'loop.billing', priority => 10", "priority is 10, it must be 0 (highest) to 9"),
    ("'shop.x', 'loop.billing', batch_max => 0", "batch_max is 0, it must be 1 to 1000"),
    ("'shop.x', 'loop.billing', batch_max => 1001", "batch_max is 1001, it must be 1 to 1000"),
    ("'shop.x', 'loop.billing', batch_wait => '0 s'", "batch_wait must be positive"),
    ("'shop.x', 'loop.billing', batch_wait => '-1 s'", "batch_wait must be positive"),
])
def test_a_bad_argument_is_named_and_nothing_is_subscribed(subs, arguments, message):
    with pytest.raises(psycopg.errors.InvalidParameterValue) as raised:
        subs.sql(f"SELECT outbox_subscribe({arguments})")
    assert message in str(raised.value)
    assert subs.value("SELECT count(*) FROM outbox.all_subscriptions") == 0


def test_a_second_identical_subscription_is_refused(subs):
    first = subscribe(subs, "shop.twice", "loop.billing")
    with pytest.raises(psycopg.errors.UniqueViolation, match=f"already \\(subscription {first}\\)"):
        subscribe(subs, "shop.twice", "loop.billing")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="id must not be null"):
        subs.sql("SELECT outbox_unsubscribe(NULL)")
    assert subs.value("SELECT count(*) FROM outbox.all_subscriptions") == 1


# -- one subscription cannot take the machine -------------------------------------

def test_batches_are_cut_by_the_size_that_will_be_sent(subs, redis_server):
    """Members' payloads compress well (their stored size is small): the cut
    is by their JSON, so every batch message fits in outbox.max_batch_bytes
    (the first member of a batch always goes)."""
    subs.configure(max_batch_bytes="256kB")
    sub = subscribe(subs, "shop.bulky", "loop.digest", batch_max=50, batch_wait="1 second")
    blob = "x" * 60_000
    events = [publish(subs, "shop.bulky", {"n": n, "blob": blob}) for n in range(20)]
    assert subs.value("SELECT max(pg_column_size(payload)) FROM outbox.batch_members") < 5_000
    wait_until(lambda: subs.value("SELECT waiting FROM outbox.subscriptions WHERE id = %s", (sub,)) in (0, None)
               and subs.value("SELECT count(*) FROM outbox.events WHERE subscription_id = %s "
                              "AND status NOT IN ('dispatched', 'processed')", (sub,)) == 0,
               timeout=60, message="every member batched and sent")
    received = batch_notes(redis_server, subs)
    assert sorted(item["id"] for b in received for item in b) == sorted(str(e) for e in events)
    assert all(1 <= len(b) <= 3 for b in received), [len(b) for b in received]
    sizes = [len(json.dumps(b)) for b in received]
    assert max(sizes) * 4 // 3 < 256 * 1024, sizes
    assert subs.count("failed") == 0


def batch_trigger(pg, name, sub, action):
    """A trigger (an operator's, say) that does `action` when a batch of
    subscription `sub` is about to be inserted; returns the SQL dropping it.

    That SQL locks outbox.log before the DROP TRIGGER: the DROP takes the
    partitions' clones before the table, a dispatcher's INSERT the table
    before a partition, and the two deadlock (docs/operations/runbook.md)."""
    pg.sql(f"""
        CREATE OR REPLACE FUNCTION public.{name}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.subscription_id = {sub} AND NEW.event_id IS NULL AND NEW.status = 'pending' THEN
                {action};
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER {name} BEFORE INSERT ON outbox.log FOR EACH ROW EXECUTE FUNCTION public.{name}()""")
    return (f"LOCK TABLE outbox.log IN ACCESS EXCLUSIVE MODE; "
            f"DROP TRIGGER {name} ON outbox.log; DROP FUNCTION public.{name}()")


def test_a_batch_that_cannot_be_made_fails_its_members_and_nothing_else(subs, redis_server):
    broken = subscribe(subs, "shop.broken", "loop.digest", batch_max=3)
    healthy = subscribe(subs, "shop.healthy", "loop.digest", batch_max=2)
    drop = batch_trigger(subs, "refuse_batches", broken, f"RAISE EXCEPTION 'batches of subscription {broken} "
                         "are refused' USING ERRCODE = 'check_violation'")
    try:
        doomed = [publish(subs, "shop.broken", {"n": n}) for n in range(3)]
        fine = [publish(subs, "shop.healthy", {"n": n}) for n in range(2)]
        plain = publish(subs, "shop.plain", queue=PLAIN)
        wait_until(lambda: subs.value("SELECT count(*) FROM outbox.dead_letters WHERE subscription_id = %s",
                                      (broken,)) == 3, timeout=30, message="the broken batch's members failed")
        wait_deliveries(subs, "processed", 2)
        wait_until(lambda: str(plain) in queued_ids(redis_server.client(), PLAIN), message="the plain event")
        letters = subs.sql("SELECT id, last_error FROM outbox.dead_letters WHERE subscription_id = %s", (broken,))
        assert all(f"batches of subscription {broken} are refused" in error for _, error in letters)
        assert f"batches of subscription {broken} are refused" in subs.value(
            "SELECT last_error FROM outbox.subscriptions WHERE id = %s", (broken,))
        assert subs.value("SELECT last_error FROM outbox.subscriptions WHERE id = %s", (healthy,)) is None
        assert f"subscription {broken}: its batch could not be made" in subs.log_text()
        assert sorted(r[0] for r in subs.sql("SELECT event_id FROM outbox.deliveries WHERE status = 'failed'")) \
            == sorted(doomed)
    finally:
        subs.sql(drop)
    # Each failed member is a batch of one, sent alone when retried.
    for failed_id, _ in letters:
        assert subs.value("SELECT outbox_retry(%s)", (failed_id,)) is True
    wait_deliveries(subs, "processed", 5)
    received = batch_notes(redis_server, subs)
    assert sorted(item["id"] for b in received if len(b) == 1 for item in b) == sorted(str(e) for e in doomed)
    assert fine


def test_a_locked_member_holds_up_only_its_subscription(subs, redis_server):
    locked = subscribe(subs, "shop.locked", "loop.digest", batch_max=2)
    subscribe(subs, "shop.free", "loop.digest", batch_max=2)
    first = publish(subs, "shop.locked", {"n": 0})
    with subs.connect(autocommit=False) as locker:
        locker.execute("SELECT FROM outbox.batch_members WHERE event_id = %s FOR UPDATE", (first,))
        publish(subs, "shop.locked", {"n": 1})
        free = [publish(subs, "shop.free", {"n": n}) for n in range(2)]
        plain = publish(subs, "shop.plain", queue=PLAIN)
        wait_until(lambda: str(plain) in queued_ids(redis_server.client(), PLAIN), timeout=30,
                   message="a plain event while a member is locked")
        wait_deliveries(subs, "processed", 2)
        assert subs.value("SELECT waiting FROM outbox.subscriptions WHERE id = %s", (locked,)) == 2
        assert [item["id"] for b in batch_notes(redis_server, subs) for item in b] == [str(e) for e in free]
        locker.rollback()
    wait_deliveries(subs, "processed", 4, timeout=90)
    assert subs.count("failed") == 0


# -- who may end a subscription ----------------------------------------------------

@library_only(OWNER_SUBSCRIBES)
def test_only_the_subscriber_or_the_extension_owner_ends_a_subscription(subs):
    subs.sql('DROP ROLE IF EXISTS sub_alice, sub_bob, "Sub-Team"')
    subs.sql("""CREATE ROLE "Sub-Team"; CREATE ROLE sub_alice LOGIN IN ROLE "Sub-Team"; CREATE ROLE sub_bob LOGIN;
                GRANT EXECUTE ON FUNCTION outbox_subscribe(text, text, text, integer, integer, interval),
                                          outbox_unsubscribe(bigint) TO sub_alice, sub_bob, "Sub-Team" """)
    try:
        with subs.connect(user="sub_alice") as alice:
            mine = alice.execute("SELECT outbox_subscribe('shop.owned', 'loop.billing')").fetchone()[0]
            alice.execute('SET ROLE "Sub-Team"')
            teams = alice.execute("SELECT outbox_subscribe('shop.owned', 'loop.email')").fetchone()[0]
        assert subs.sql("SELECT id, created_by FROM outbox.subscriptions ORDER BY id") == [
            (mine, "sub_alice"), (teams, "Sub-Team")]
        with subs.connect(user="sub_bob") as bob:
            for sub in (mine, teams):
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match=f"subscription {sub} belongs to role"):
                    bob.execute("SELECT outbox_unsubscribe(%s)", (sub,))
            # The functions that do the work are the extension owner's alone.
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                bob.execute("SELECT outbox_subscription_end('sub_alice'::regrole, %s)", (mine,))
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                bob.execute("SELECT outbox_subscription_add('sub_alice', 'x', 'y', NULL, NULL, NULL, NULL)")
        assert subs.value("SELECT count(*) FROM outbox.subscriptions") == 2
        with subs.connect(user="sub_alice") as alice:
            # A member of "Sub-Team" ends the team's.
            assert alice.execute("SELECT outbox_unsubscribe(%s)", (teams,)).fetchone()[0] is True
        # The extension's owner (here a superuser) ends anyone's.
        assert subs.value("SELECT outbox_unsubscribe(%s)", (mine,)) is True
        assert subs.value("SELECT count(*) FROM outbox.subscriptions") == 0
    finally:
        subs.sql('DROP OWNED BY sub_alice, sub_bob, "Sub-Team"; DROP ROLE sub_alice, sub_bob, "Sub-Team"')


def test_code_a_superuser_runs_on_a_roles_behalf_cannot_end_anothers_subscription(subs):
    """An index expression runs as its table's owner when a superuser (or
    autovacuum) runs ANALYZE: it is that owner asking, not the superuser."""
    victim = subscribe(subs, "shop.victim", "loop.billing")
    subs.sql("DROP ROLE IF EXISTS sub_mallory")
    subs.sql("""CREATE ROLE sub_mallory LOGIN; GRANT CREATE ON SCHEMA public TO sub_mallory;
                GRANT EXECUTE ON FUNCTION outbox_subscribe(text, text, text, integer, integer, interval),
                                          outbox_unsubscribe(bigint) TO sub_mallory""")
    try:
        with subs.connect(user="sub_mallory") as mallory:
            mallory.execute(f"""
                CREATE FUNCTION public.sneak(x int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS $$
                BEGIN
                    BEGIN
                        PERFORM public.outbox_unsubscribe({victim});
                    EXCEPTION WHEN insufficient_privilege THEN NULL;
                    END;
                    RETURN x;
                END $$;
                CREATE TABLE public.sneaky (x int);
                INSERT INTO public.sneaky SELECT generate_series(1, 100);
                CREATE INDEX sneaky_idx ON public.sneaky (public.sneak(x))""")
        subs.sql("ANALYZE public.sneaky")
        assert subs.value("SELECT unsubscribed_at FROM outbox.all_subscriptions WHERE id = %s", (victim,)) is None
    finally:
        subs.sql("DROP TABLE IF EXISTS public.sneaky; DROP FUNCTION IF EXISTS public.sneak(int); "
                 "DROP OWNED BY sub_mallory; DROP ROLE sub_mallory")



def test_a_batch_slower_than_the_deadline_holds_up_only_its_subscription(subs, redis_server):
    """Making the batch takes longer than the whole statement deadline: it
    is cut at its share of it, backed off, and the claim goes on."""
    subs.configure(statement_timeout="2s")
    slow = subscribe(subs, "shop.slow", "loop.digest", batch_max=2)
    drop = batch_trigger(subs, "slow_batches", slow, "PERFORM pg_catalog.pg_sleep(30)")
    try:
        [publish(subs, "shop.slow", {"n": n}) for n in range(2)]
        plain = [publish(subs, "shop.plain", {"n": n}, queue=PLAIN) for n in range(3)]
        wait_until(lambda: {str(p) for p in plain} <= set(queued_ids(redis_server.client(), PLAIN)), timeout=30,
                   message="plain events while a batch is too slow to make")
        assert subs.value("SELECT waiting FROM outbox.subscriptions WHERE id = %s", (slow,)) == 2
        assert subs.count("failed") == 0
    finally:
        subs.sql(drop)
    wait_deliveries(subs, "processed", 2, timeout=120)


def test_a_backed_off_subscription_does_not_keep_the_dispatcher_busy(subs):
    """While a subscription is left alone after a failed flush (a member
    locked), the dispatcher sleeps until it is due, not in a loop."""
    sub = subscribe(subs, "shop.held", "loop.digest", batch_max=10, batch_wait="1 second")
    held = publish(subs, "shop.held")
    with subs.connect(autocommit=False) as locker:
        locker.execute("SELECT FROM outbox.batch_members WHERE event_id = %s FOR UPDATE", (held,))
        time.sleep(3)  # past batch_wait: due, and failing

        def commits():
            subs.sql("SELECT pg_stat_clear_snapshot()")
            return subs.value("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                              "WHERE datname = current_database()")

        before = commits()
        time.sleep(5)
        assert commits() - before < 100 + 5 * subs.looks_per_second, "the dispatcher spins"
        assert subs.value("SELECT waiting FROM outbox.subscriptions WHERE id = %s", (sub,)) == 1
        locker.rollback()
    wait_deliveries(subs, "processed", 1, timeout=120)
