"""Durable before acting outside the database. The dispatchers commit their
own status changes asynchronously (a lost mark only sends an event again,
with the same task id), but a commit that something outside PostgreSQL
relies on must outlive a crash: a batch of an accumulated subscription
before it is pushed (or a crash would flush its members again into a batch
with a new task id), reports before they are trimmed from Redis (or they
would be lost).

The WAL writer runs every 10 s here, so an asynchronous commit is still in
shared memory when the immediate shutdown comes; the test's own sessions
only read in between (a commit of theirs would flush the WAL)."""


from harness import Cluster, Redis, decode, queued_ids, wait_until
from outbox_dispatch import report

SLOW_WAL_WRITER = {"wal_writer_delay": "'10s'", "wal_writer_flush_after": 0}


def test_a_crash_after_a_batch_is_made_does_not_change_its_task_id():
    server = Redis()
    pg = Cluster(server.url, server_conf=SLOW_WAL_WRITER, broker_timeout="30s")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.wait_idle()
        pg.sql("SELECT outbox_subscribe('durable.batched', 'durable.digest', queue => 'q_durable', batch_max => 3)")
        client = server.client()
        # Pushes wait: the batch is made and claimed, its push held up.
        client.execute_command("CLIENT", "PAUSE", 60000, "WRITE")
        members = [pg.value("SELECT outbox_enqueue('durable.batched', '{}')") for _ in range(3)]
        batch = wait_until(lambda: pg.value("SELECT id FROM outbox.events WHERE status = 'processing' "
                                            "AND subscription_id IS NOT NULL AND event_id IS NULL"),
                           message="the batch made and claimed")
        pg.stop("immediate")
        client.execute_command("CLIENT", "UNPAUSE")
        pg.start()
        wait_until(lambda: queued_ids(client, "q_durable"), timeout=60, message="the batch pushed")
        assert set(queued_ids(client, "q_durable")) == {str(batch)}
        [message] = {m for m in client.lrange("q_durable", 0, -1)}
        _, body = decode(message)
        assert sorted(item["id"] for item in body[0][0]) == sorted(str(m) for m in members)
    finally:
        pg.close()
        server.close()


def test_a_crash_after_reports_are_trimmed_loses_none(redis_server):
    pg = Cluster(redis_server.url, server_conf=SLOW_WAL_WRITER, report_key="outbox_dispatch.reports.durable")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.wait_idle()
        client = redis_server.client()
        ids = [str(r[0]) for r in pg.sql(
            "SELECT outbox_enqueue('durable.reported', '{}', queue => 'q_durable_reports') "
            "FROM generate_series(1, 50)")]
        wait_until(lambda: pg.count("dispatched") == 50, message="every event dispatched")
        messages = [decode(m)[0] for m in client.lrange("q_durable_reports", 0, -1)]
        key = pg.report_list()
        assert {m["headers"]["outbox_report_to"] for m in messages} == {key}
        # The marks' asynchronous commits reach the disk.
        pg.sql("CHECKPOINT")
        client.rpush(key, *[report.processed(m["headers"]["id"], m["headers"]["outbox_send"]) for m in messages])
        wait_until(lambda: client.llen(key) == 0, timeout=30, message="the reports read and trimmed")
        pg.stop("immediate")
        pg.start()
        assert pg.count("processed") == 50, "reports applied, trimmed, then lost in the crash"
        assert sorted(str(r[0]) for r in pg.sql("SELECT id FROM outbox.events WHERE status = 'processed'")) \
            == sorted(ids)
    finally:
        pg.close()


def test_a_crash_after_a_key_is_passed_on_sends_no_head_after_its_successor():
    """With nothing to report or acknowledge them, a head is finished once
    pushed, and the commit that records it passes its key on: the next event
    of the key is pushed right after. That commit must be durable first, or a
    crash sends the head again after its successor (a, b, a, b)."""
    server = Redis()
    pg = Cluster(server.url, server_conf=SLOW_WAL_WRITER, report_key="")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.wait_idle()
        client = server.client()
        # In one transaction: the second waits behind the first.
        ids = [str(r[0]) for r in pg.sql(
            "SELECT outbox_enqueue('durable.keyed', jsonb_build_object('seq', n), queue => 'q_durable_keyed', "
            "ordering_key => 'k') FROM generate_series(1, 2) AS n")]
        wait_until(lambda: len(queued_ids(client, "q_durable_keyed")) >= 2, interval=0.002,
                   message="both events of the key sent")
        pg.stop("immediate")
        pg.start()
        wait_until(lambda: pg.count("dispatched") == 2, timeout=60, message="both dispatched after the crash")
        sent = queued_ids(client, "q_durable_keyed")
        last_head = max(i for i, id in enumerate(sent) if id == ids[0])
        assert last_head < sent.index(ids[1]), sent
    finally:
        pg.close()
        server.close()
