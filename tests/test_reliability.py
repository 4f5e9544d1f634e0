"""The chaos suite: every fault path, proven by counting events in Redis and
rows by status. Every committed event reaches Redis at least once; none is
dead-lettered for the broker's faults."""

import os
import signal
import threading
import time
from collections import Counter

import pytest

from harness import Redis, drain_held, queued_ids, wait_until
from standalone import HOST, new_cluster


def load(pg, n, queue, per_statement=1000):
    """Commits `n` events to `queue`, `per_statement` per transaction."""
    with pg.connect(autocommit=False) as conn:
        for start in range(0, n, per_statement):
            conn.execute("SELECT outbox_enqueue('load', jsonb_build_object('n', n), queue => %s) "
                         "FROM generate_series(%s::int, %s::int) n", (queue, start, min(n, start + per_statement) - 1))
            conn.commit()


def all_ids(pg):
    return {str(r[0]) for r in pg.sql("SELECT id FROM outbox.events")}


def test_safety_poll_delivers_events_committed_without_a_wake(outbox, redis_server):
    """PREPARE TRANSACTION / COMMIT PREPARED fires no commit callback."""
    outbox.configure(poll_interval="1s")
    outbox.wait_idle()
    with outbox.connect(autocommit=False) as conn:
        event_id = conn.execute("SELECT outbox_enqueue('prepared', '{}', queue => 'q_2pc')").fetchone()[0]
        conn.execute("PREPARE TRANSACTION 'outbox_2pc'")
    outbox.sql("COMMIT PREPARED 'outbox_2pc'")
    client = redis_server.client()
    wait_until(lambda: queued_ids(client, "q_2pc") == [str(event_id)], message="the prepared event")


def test_terminated_dispatcher_restarts_and_delivers_everything(outbox, redis_server):
    outbox.configure(enabled="off", batch_size=100)
    load(outbox, 20000, "q_term")
    # Terminated while a pushed batch's mark waits, 2,000 events or more marked.
    with drain_held(outbox, until=lambda: outbox.count("dispatched") >= 2000,
                    begin=lambda: outbox.configure(enabled="on")):
        [pid] = outbox.dispatcher_pids()
        outbox.sql("SELECT pg_terminate_backend(%s)", (pid,))
    wait_until(lambda: outbox.dispatcher_pids() not in ([], [pid]), timeout=60, message="a restarted dispatcher")
    wait_until(lambda: outbox.count("dispatched") == 20000, timeout=180, message="every event dispatched")
    seen = Counter(queued_ids(redis_server.client(), "q_term"))
    assert set(seen) == all_ids(outbox)
    assert sum(seen.values()) - len(seen) <= 100, "duplicates beyond one batch"


def test_a_storm_of_commits_is_delivered_in_far_fewer_batches(outbox, redis_server):
    outbox.wait_idle()
    batches_before = outbox.metric("outbox_batches_total")
    producers, per_producer = 8, 1250

    def produce():
        with outbox.connect() as conn:
            for _ in range(per_producer):
                conn.execute("SELECT outbox_enqueue('storm', '{}', queue => 'q_storm')")

    threads = [threading.Thread(target=produce) for _ in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = producers * per_producer
    wait_until(lambda: outbox.count("dispatched") == total, timeout=180, message="the storm dispatched")
    batches = outbox.metric("outbox_batches_total") - batches_before
    assert len(set(queued_ids(redis_server.client(), "q_storm"))) == total
    assert batches <= total / 4, f"{total} events took {batches} batches"


def test_stuck_claims_return_to_pending_and_are_delivered(outbox, redis_server):
    outbox.configure(processing_timeout="2s", sweep_interval="1s", broker_timeout="200ms", max_payload_bytes="10kB",
                     enabled="off")
    wait_until(lambda: outbox.value("SELECT state FROM outbox.workers") == "paused", message="the pause")
    rescued_before = outbox.metric("outbox_stuck_rescued_total")
    ids = [str(r[0]) for r in outbox.sql(
        "SELECT outbox_enqueue('stuck', '{}', queue => 'q_stuck') FROM generate_series(1, 5)")]
    # The claim of a dispatcher that no longer exists (index 7), a minute old.
    batch, _ = outbox.claim_enqueued(7, ids)
    outbox.sql("UPDATE outbox.batches SET claimed_at = now() - interval '1 minute' WHERE id = %s", (batch,))
    assert outbox.count("processing") == 5
    outbox.configure(enabled="on")
    client = redis_server.client()
    wait_until(lambda: sorted(queued_ids(client, "q_stuck")) == sorted(ids), message="the stuck events")
    assert outbox.metric("outbox_stuck_rescued_total") - rescued_before == 5


def test_a_stream_that_never_empties_the_line_does_not_hold_off_the_sweepers(outbox, redis_server):
    """With a long linger, a commit every 0.4 s gives every claim events,
    so the drain never ends on an empty one: the sweepers still run
    between its pushes, and a stuck claim comes back while the stream
    lasts."""
    outbox.configure(linger="1s", processing_timeout="2s", sweep_interval="1s", broker_timeout="200ms",
                     max_payload_bytes="10kB", enabled="off")
    wait_until(lambda: outbox.value("SELECT state FROM outbox.workers") == "paused", message="the pause")
    ids = [str(r[0]) for r in outbox.sql(
        "SELECT outbox_enqueue('stuck', '{}', queue => 'q_stuck') FROM generate_series(1, 5)")]
    outbox.claim_enqueued(7, ids)  # a fresh claim of a dispatcher gone: stuck 2 s from now
    streaming = threading.Event()
    streaming.set()

    def stream():
        with outbox.connect() as conn:
            while streaming.is_set():
                conn.execute("SELECT outbox_enqueue('tick', '{}', queue => 'q_tick')")
                time.sleep(0.4)

    producer = threading.Thread(target=stream)
    producer.start()
    try:
        outbox.configure(enabled="on")
        client = redis_server.client()
        wait_until(lambda: sorted(queued_ids(client, "q_stuck")) == sorted(ids), timeout=15,
                   message="the stuck events, while the stream lasts")
    finally:
        streaming.clear()
        producer.join()


def test_an_abandoned_claim_sends_again_neither_what_was_acknowledged_nor_a_count(outbox, redis_server):
    """A dispatcher dies after its push, before its mark; meanwhile a
    consumer acknowledges one event of the claim. The stuck sweep gives
    back the rest, not the acknowledged one (sent again, it would go out
    after its key's next), and counts no send: whether the push reached the
    broker is unknown, and a crash loop must not spend
    outbox.max_redeliveries."""
    outbox.configure(processing_timeout="2s", sweep_interval="1s", broker_timeout="200ms", max_payload_bytes="10kB",
                     enabled="off")
    wait_until(lambda: outbox.value("SELECT state FROM outbox.workers") == "paused", message="the pause")
    ids = [str(r[0]) for r in outbox.sql(
        "SELECT outbox_enqueue('stuck', '{}', queue => 'q_abandoned') FROM generate_series(1, 3)")]
    batch, sends = outbox.claim_enqueued(7, ids)
    acked = ids[0]
    # Its id alone proves no receipt while the push is not recorded: refused.
    assert outbox.value("SELECT outbox_ack(%s)", (acked,)) is False
    assert outbox.value("SELECT outbox_ack(%s, %s)", (acked, sends[acked])) is True
    outbox.sql("UPDATE outbox.batches SET claimed_at = now() - interval '1 minute' WHERE id = %s", (batch,))
    outbox.configure(enabled="on")
    client = redis_server.client()
    wait_until(lambda: sorted(queued_ids(client, "q_abandoned")) == sorted(ids[1:]), message="the others sent")
    time.sleep(2)
    assert sorted(queued_ids(client, "q_abandoned")) == sorted(ids[1:])
    rows = dict(outbox.sql("SELECT id::text, status::text FROM outbox.events WHERE queue = 'q_abandoned'"))
    assert rows == {acked: "processed", ids[1]: "dispatched", ids[2]: "dispatched"}, rows
    assert outbox.value("SELECT max(deliveries) FROM outbox.events WHERE queue = 'q_abandoned'") == 1


def test_an_acknowledgement_by_id_alone_waits_for_the_push_to_be_recorded(outbox, redis_server):
    """outbox_ack(id) names no send: a consumer that guesses an id would
    acknowledge what no broker holds. While the batch that holds the event
    is claimed and not marked (the push may not have happened), it is
    refused with a warning, as it is again after that claim is given back
    and the event claimed anew (its key would pass on before the re-send);
    once the dispatcher records the send, it is taken."""
    outbox.configure(ack_timeout="1h", processing_timeout="2s", sweep_interval="1s", broker_timeout="200ms",
                     max_payload_bytes="10kB", enabled="off")
    wait_until(lambda: outbox.value("SELECT state FROM outbox.workers") == "paused", message="the pause")
    (event,) = [str(r[0]) for r in outbox.sql(
        "SELECT outbox_enqueue('guessed', '{}', queue => 'q_guessed', ordering_key => 'guessed')")]
    batch, _ = outbox.claim_enqueued(7, [event])
    warnings = []
    with outbox.connect() as conn:
        conn.add_notice_handler(lambda d: warnings.append(d.message_primary))
        assert conn.execute("SELECT outbox_ack(%s)", (event,)).fetchone()[0] is False
    assert any("its push is not recorded yet" in w for w in warnings), warnings
    assert outbox.value("SELECT status::text FROM outbox.events WHERE id = %s", (event,)) == "processing"
    outbox.sql("UPDATE outbox.batches SET claimed_at = now() - interval '1 minute' WHERE id = %s", (batch,))
    outbox.configure(enabled="on")
    client = redis_server.client()
    wait_until(lambda: event in queued_ids(client, "q_guessed"), message="the event sent")
    wait_until(lambda: outbox.value("SELECT status::text FROM outbox.events WHERE id = %s", (event,))
               == "dispatched", message="its send recorded")
    assert outbox.value("SELECT outbox_ack(%s)", (event,)) is True


def test_an_acknowledgement_the_stuck_sweeper_races_is_never_undone(outbox, redis_server):
    """Two claims of a dispatcher that died are swept; while the sweeper is
    held on the first, a consumer acknowledges the event of the second (its
    push got through). The sweeper decides what goes back in line after it
    holds the batches: it sees the acknowledgement, and the event is not
    sent again."""
    outbox.configure(processing_timeout="2s", sweep_interval="1s", broker_timeout="200ms", max_payload_bytes="10kB",
                     enabled="off")
    wait_until(lambda: outbox.value("SELECT state FROM outbox.workers") == "paused", message="the pause")
    # Nothing of earlier tests for the sweeper to take first.
    assert outbox.value("SELECT count(*) FROM outbox.batches WHERE marked_at IS NULL AND abandoned_at IS NULL") == 0
    (other,) = [str(r[0]) for r in outbox.sql("SELECT outbox_enqueue('stuck', '{}', queue => 'q_raced')")]
    first, _ = outbox.claim_enqueued(7, [other])
    (acked,) = [str(r[0]) for r in outbox.sql("SELECT outbox_enqueue('stuck', '{}', queue => 'q_raced')")]
    second, _ = outbox.claim_enqueued(7, [acked])
    outbox.sql("UPDATE outbox.batches SET claimed_at = now() - interval '2 minutes' WHERE id = %s", (first,))
    outbox.sql("UPDATE outbox.batches SET claimed_at = now() - interval '1 minute' WHERE id = %s", (second,))
    outbox.sql("CREATE FUNCTION public.hold_abandoning() RETURNS trigger LANGUAGE plpgsql "
               "AS $$ BEGIN PERFORM pg_sleep(3); RETURN NEW; END $$")
    outbox.sql(f"CREATE TRIGGER hold_abandoning BEFORE UPDATE ON outbox.batches FOR EACH ROW "
               f"WHEN (OLD.id = {int(first)} AND NEW.abandoned_at IS NOT NULL) "
               f"EXECUTE FUNCTION public.hold_abandoning()")
    try:
        outbox.configure(enabled="on")
        wait_until(lambda: outbox.value("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' "
                                        f"AND {outbox.dispatcher_sessions}") == 1,
                   message="the sweeper held on the first claim")
        # Taken, or refused when the sweeper's plan held both claims first.
        taken = outbox.value("SELECT outbox_ack(%s)", (acked,))
        client = redis_server.client()
        wait_until(lambda: other in queued_ids(client, "q_raced"), message="the other event sent")
        if taken:
            time.sleep(2)
            assert queued_ids(client, "q_raced") == [other]
            assert outbox.value("SELECT status::text FROM outbox.events WHERE id = %s", (acked,)) == "processed"
        else:
            wait_until(lambda: acked in queued_ids(client, "q_raced"), message="the refused one sent again")
    finally:
        outbox.sql("DROP TRIGGER hold_abandoning ON outbox.batches")
        outbox.sql("DROP FUNCTION public.hold_abandoning()")


def test_three_dispatchers_deliver_50000_events_exactly_once(redis_server):
    pg = new_cluster(redis_server.url, workers=3, batch_size=500, enabled="off")
    try:
        pg.install()
        load(pg, 50000, "q_50k", per_statement=5000)
        client = redis_server.client()
        client.delete("q_50k")
        pg.configure(enabled="on")
        wait_until(lambda: pg.count("dispatched") == 50000, timeout=300, message="50,000 dispatched")
        ids = queued_ids(client, "q_50k")
        assert len(ids) == 50000 and set(ids) == all_ids(pg)
        per_worker = [r[0] for r in pg.sql("SELECT events_dispatched FROM outbox.workers ORDER BY worker")]
        assert sum(per_worker) == 50000 and len(per_worker) == 3
    finally:
        pg.close()


@pytest.fixture
def persistent_redis():
    """A Redis that keeps its data across a stop and start (AOF)."""
    server = Redis("--appendonly", "yes", "--appendfsync", "always")
    yield server
    server.close()


def test_redis_outage_loses_nothing_and_spends_no_retries(persistent_redis):
    pg = new_cluster(persistent_redis.url, reconnect_delay_min="200ms", reconnect_delay_max="1s",
                 broker_timeout="1s", heartbeat_interval="1s")
    try:
        pg.install()
        stop = threading.Event()

        def produce():
            with pg.connect() as conn:
                while not stop.is_set():
                    conn.execute("SELECT outbox_enqueue('outage', '{}', queue => 'q_outage') "
                                 "FROM generate_series(1, 10)")
                    time.sleep(0.05)

        producer = threading.Thread(target=produce)
        producer.start()
        try:
            wait_until(lambda: pg.count("dispatched") >= 50, message="events flowing")
            persistent_redis.stop()
            wait_until(lambda: pg.value("SELECT bool_and(state = 'reconnecting' AND NOT connected) "
                                        "FROM outbox.workers"), message="the dispatcher to notice")
            lost = pg.metric("outbox_reconnects_total", reason="connection_lost")
            assert lost >= 1
            failures = lambda: pg.metric("outbox_reconnects_total", reason="connect_failed")  # noqa: E731
            wait_until(lambda: failures() >= 3, timeout=60, message="several reconnect cycles")
            assert pg.value("SELECT last_error FROM outbox.workers")
            persistent_redis.start()
            wait_until(lambda: pg.value("SELECT connected FROM outbox.workers"), timeout=60,
                       message="the reconnect")
        finally:
            stop.set()
            producer.join()
        total = pg.value("SELECT count(*) FROM outbox.events")
        wait_until(lambda: pg.count("dispatched") == total, timeout=120, message="the backlog delivered")
        assert pg.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0 OR status = 'failed'") == 0
        assert set(queued_ids(persistent_redis.client(), "q_outage")) == all_ids(pg)
        assert pg.value("SELECT state FROM outbox.workers") == "idle"
        assert pg.value("SELECT last_error FROM outbox.workers") is None
    finally:
        pg.close()


def test_server_crash_mid_drain_loses_nothing(redis_server):
    pg = new_cluster(redis_server.url, enabled="off", batch_size=200)
    try:
        pg.install()
        load(pg, 20000, "q_crash")
        client = redis_server.client()
        client.delete("q_crash")
        # Crashed while a pushed batch's mark waits, 2,000 events or more sent.
        with drain_held(pg, until=lambda: client.llen("q_crash") >= 2000, begin=lambda: pg.configure(enabled="on")):
            pg.stop("immediate")
        pg.start()
        assert pg.value("SELECT count(*) FROM outbox.events") == 20000
        wait_until(lambda: pg.count("dispatched") == 20000, timeout=180, message="every event after recovery")
        assert set(queued_ids(client, "q_crash")) == all_ids(pg)
    finally:
        pg.close()


def test_rejected_pushes_retry_then_dead_letter_while_others_flow(outbox, redis_server):
    outbox.configure(retry_backoff="100ms", max_retries=3)
    client = redis_server.client()
    client.set("q_wrong", "not a list")
    dead_before = outbox.metric("outbox_dead_letters_total")
    retries_before = outbox.metric("outbox_retries_total")
    rejected_before = outbox.metric("outbox_push_failures_total", reason="redis_error")
    wrong = {str(r[0]) for r in outbox.sql(
        "SELECT outbox_enqueue('wrong', '{}', queue => 'q_wrong') FROM generate_series(1, 3)")}
    ok = {str(r[0]) for r in outbox.sql(
        "SELECT outbox_enqueue('ok', '{}', queue => 'q_ok') FROM generate_series(1, 3)")}
    wait_until(lambda: set(queued_ids(client, "q_ok")) == ok, message="the other queue's events")
    wait_until(lambda: outbox.count("failed") == 3, timeout=60, message="three dead letters")
    rows = outbox.sql("SELECT id::text, retry_count, last_error FROM outbox.dead_letters")
    assert {r[0] for r in rows} == wrong
    assert all(r[1] == 3 and "WRONGTYPE" in r[2] for r in rows), rows
    # Counted once the outcome is committed: a moment after the rows show it.
    wait_until(lambda: outbox.metric("outbox_dead_letters_total") - dead_before == 3,
               message="the dead letters counted")
    assert outbox.metric("outbox_retries_total") - retries_before == 6
    assert outbox.metric("outbox_push_failures_total", reason="redis_error") - rejected_before == 9

    client.delete("q_wrong")
    assert outbox.value("SELECT outbox_retry_failed()") == 3
    wait_until(lambda: set(queued_ids(client, "q_wrong")) == wrong, message="the retried events")
    # (Marked after the push: wait for it.)
    wait_until(lambda: outbox.count("dispatched") == 6, message="the retried events marked")
    assert outbox.value("SELECT outbox_retry(%s)", (next(iter(wrong)),)) is False  # no longer failed


def test_retry_one_failed_event(outbox, redis_server):
    event_id = outbox.value(
        "INSERT INTO outbox.log (event_type, queue, status, retry_count, last_error) "
        "VALUES ('failed', 'q_retry_one', 'failed', 3, 'boom') RETURNING id")
    assert outbox.value("SELECT outbox_retry(%s)", (event_id,)) is True
    wait_until(lambda: queued_ids(redis_server.client(), "q_retry_one") == [str(event_id)],
               message="the retried event")
    assert outbox.value("SELECT retry_count FROM outbox.events") == 0


def test_two_acknowledgements_of_one_event_at_once_take_it_once(outbox, redis_server):
    """Two consumers acknowledge the same event at the same time: the
    second waits for the first, then finds the event processed (false),
    and the outcome is recorded once."""
    client = redis_server.client()
    outbox.configure(ack_timeout="1h")
    (event,) = [str(r[0]) for r in outbox.sql("SELECT outbox_enqueue('ack', '{}', queue => 'q_ack_twice')")]
    wait_until(lambda: outbox.value("SELECT status::text FROM outbox.events WHERE id = %s", (event,)) == "dispatched",
               message="the event dispatched")
    assert event in queued_ids(client, "q_ack_twice")
    second = {}
    with outbox.connect(autocommit=False) as first:
        assert first.execute("SELECT outbox_ack(%s)", (event,)).fetchone()[0] is True
        racing = threading.Thread(target=lambda: second.update(taken=outbox.value("SELECT outbox_ack(%s)", (event,))))
        racing.start()
        wait_until(lambda: outbox.value("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                        "AND query LIKE '%%outbox_ack%%'") == 1, message="the second waiting")
        first.commit()
        racing.join(timeout=30)
    assert second == {"taken": False}
    assert outbox.value("SELECT count(*) FROM outbox.outcomes WHERE %s = ANY (events)", (event,)) == 1
    assert outbox.value("SELECT status::text FROM outbox.events WHERE id = %s", (event,)) == "processed"


def test_an_acknowledgement_the_unacked_sweeper_races_is_never_undone(outbox, redis_server):
    """The sweeper settles two batches; while it is held on the first, a
    consumer acknowledges the event of the second. The sweeper's decision
    on that event is taken after it holds the batch: it sees the
    acknowledgement, and neither sends the event again nor fails it."""
    client = redis_server.client()
    outbox.configure(ack_timeout="1h", sweep_interval="1s")
    # The batches of earlier tests are done with: the sweeper's round is
    # these two.
    outbox.sql("UPDATE outbox.batches SET settled_at = now() WHERE settled_at IS NULL AND marked_at IS NOT NULL")
    (first,) = [str(r[0]) for r in outbox.sql("SELECT outbox_enqueue('ack', '{}', queue => 'q_race')")]
    wait_until(lambda: first in queued_ids(client, "q_race"), message="the first batch")
    (second,) = [str(r[0]) for r in outbox.sql("SELECT outbox_enqueue('ack', '{}', queue => 'q_race')")]
    wait_until(lambda: second in queued_ids(client, "q_race"), message="the second batch")
    wait_until(lambda: outbox.value("SELECT count(*) FROM outbox.events WHERE id IN (%s, %s) "
                                    "AND status = 'dispatched'", (first, second)) == 2, message="both marked")
    held, other = (outbox.value("SELECT batch FROM outbox.events WHERE id = %s", (event,)) for event in (first, second))
    outbox.sql("CREATE FUNCTION public.hold_settling() RETURNS trigger LANGUAGE plpgsql "
               "AS $$ BEGIN PERFORM pg_sleep(3); RETURN NEW; END $$")
    outbox.sql(f"CREATE TRIGGER hold_settling BEFORE UPDATE ON outbox.batches FOR EACH ROW "
               f"WHEN (OLD.id = {int(held)} AND NEW.settled_at IS NOT NULL) EXECUTE FUNCTION public.hold_settling()")
    try:
        time.sleep(1.5)  # both batches due at the sweeper's first round
        outbox.configure(ack_timeout="1s")
        wait_until(lambda: outbox.value("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' "
                                        f"AND {outbox.dispatcher_sessions}") == 1,
                   message="the sweeper held on the first batch")
        # Taken, or refused when the sweeper's plan held both batches first
        # (then the acknowledgement waits for it, and comes too late).
        taken = outbox.value("SELECT outbox_ack(%s)", (second,))
        wait_until(lambda: outbox.value("SELECT settled_at IS NOT NULL FROM outbox.batches WHERE id = %s", (other,)),
                   message="the sweep")
        outbox.configure(ack_timeout="1h")
        if taken:
            time.sleep(2)
            assert queued_ids(client, "q_race").count(second) == 1
            assert outbox.value("SELECT status::text FROM outbox.events WHERE id = %s", (second,)) == "processed"
        else:
            wait_until(lambda: queued_ids(client, "q_race").count(second) == 2, message="the refused one sent again")
    finally:
        outbox.sql("DROP TRIGGER hold_settling ON outbox.batches")
        outbox.sql("DROP FUNCTION public.hold_settling()")


def test_unacked_events_are_resent_and_retention_deletes_only_finished_ones(outbox, redis_server):
    client = redis_server.client()
    outbox.configure(ack_timeout="2s", sweep_interval="1s")
    acked, unacked = [str(r[0]) for r in outbox.sql(
        "SELECT outbox_enqueue('ack', '{}', queue => 'q_ack') FROM generate_series(1, 2)")]
    wait_until(lambda: outbox.count("dispatched") == 2, message="both dispatched")
    assert outbox.value("SELECT outbox_ack(%s)", (acked,)) is True
    wait_until(lambda: queued_ids(client, "q_ack").count(unacked) >= 2, timeout=30,
               message="the unacknowledged event re-sent")
    assert queued_ids(client, "q_ack").count(acked) == 1
    assert outbox.metric("outbox_unacked_resent_total") >= 1
    if outbox.counts_in_sql:
        assert outbox.metric("outbox_acked_total", source="sql") >= 1

    # Events that must survive any retention: a delayed pending one, a
    # dead letter, and (acknowledgements on) a dispatched one.
    keep = {str(r[0]) for r in outbox.sql(
        "INSERT INTO outbox.log (event_type, queue, status, available_at, created_at) VALUES "
        "('later', 'q_keep', 'pending', now() + interval '1 day', now() - interval '30 days'), "
        "('dead', 'q_keep', 'failed', now(), now() - interval '30 days') RETURNING id")}
    outbox.configure(ack_timeout="1h")
    wait_until(lambda: outbox.value("SELECT status = 'dispatched' FROM outbox.events WHERE id = %s", (unacked,)),
               message="the re-sent event dispatched again")
    outbox.configure(ack_timeout="1h", retention="1s", lifecycle_interval="1s")
    wait_until(lambda: outbox.value("SELECT count(*) FROM outbox.events WHERE id = %s", (acked,)) == 0,
               message="the processed event purged")
    time.sleep(2)  # a few more lifecycle rounds: nothing else may go
    assert all_ids(outbox) == keep | {unacked}

    outbox.configure(ack_timeout=0, retention="1s", lifecycle_interval="1s")
    wait_until(lambda: all_ids(outbox) == keep, message="the dispatched event purged with acks off")
    assert outbox.metric("outbox_purged_total") >= 2


def test_acknowledgements_are_off_by_default_and_redelivery_is_bounded(outbox, redis_server):
    assert outbox.setting("ack_timeout") in ("0", None)  # None: not set, the default
    client = redis_server.client()
    failed_before = outbox.metric("outbox_unacked_failed_total")
    outbox.configure(ack_timeout="1s", max_redeliveries=2, sweep_interval="1s")
    [event_id] = [str(r[0]) for r in outbox.sql("SELECT outbox_enqueue('never_acked', '{}', queue => 'q_bounded')")]
    wait_until(lambda: outbox.count("failed") == 1, timeout=60, message="the event failed after its re-sends")
    assert queued_ids(client, "q_bounded") == [event_id] * 3  # the first send and two re-sends
    deliveries, last_error = outbox.sql("SELECT deliveries, last_error FROM outbox.dead_letters")[0]
    assert deliveries == 3
    assert last_error == "not acknowledged after 3 sends (outbox.max_redeliveries = 2)"
    assert outbox.metric("outbox_unacked_failed_total") - failed_before == 1
    time.sleep(3)  # failed is final: no further sends
    assert len(queued_ids(client, "q_bounded")) == 3


def test_raising_ack_timeout_applies_to_what_is_sent_after_it(outbox, redis_server):
    """outbox.ack_timeout applies to what is sent while it is above 0: 20
    events sent with acknowledgements off, then a raise, leave 20 messages
    in the queue, not 40 (their batches, unsettled while reports are on,
    carry no deadline); one sent after the raise and never acknowledged is
    sent again."""
    client = redis_server.client()
    assert outbox.setting("ack_timeout") in ("0", None)
    sent = [str(r[0]) for r in outbox.sql(
        "SELECT outbox_enqueue('before', '{}', queue => 'q_raise') FROM generate_series(1, 20)")]
    wait_until(lambda: sorted(queued_ids(client, "q_raise")) == sorted(sent), message="the 20 sent")
    outbox.configure(ack_timeout="1s", sweep_interval="1s")
    after = str(outbox.value("SELECT outbox_enqueue('after', '{}', queue => 'q_raise')"))
    wait_until(lambda: queued_ids(client, "q_raise").count(after) >= 2, timeout=30,
               message="the event sent after the raise, sent again")
    time.sleep(3)  # more rounds of the sweeper: none of the 20
    queued = Counter(queued_ids(client, "q_raise"))
    assert {event: queued[event] for event in sent} == {event: 1 for event in sent}
    assert sum(queued.values()) - queued[after] == 20


def test_reload_changes_batch_size_and_redis_url(outbox, redis_server):
    second = Redis()
    try:
        outbox.configure(enabled="off")
        outbox.sql("SELECT outbox_enqueue('batch', '{}', queue => 'q_batch') FROM generate_series(1, 21)")
        batches_before = outbox.metric("outbox_batches_total")
        outbox.configure(enabled="on", batch_size=7)
        wait_until(lambda: outbox.count("dispatched") == 21, message="21 dispatched")
        # (The sidecar publishes its counters after each step.)
        wait_until(lambda: outbox.metric("outbox_batches_total") - batches_before >= 3, message="three batches")
        assert outbox.metric("outbox_batches_total") - batches_before == 3

        reloads = outbox.log_text().count("reloaded its settings")
        outbox.configure(batch_size=7, redis_url=second.url)
        # The library reloads; the sidecar, whose own the broker's URL is,
        # has started again with it (in configure()).
        if HOST == "library":
            wait_until(lambda: outbox.log_text().count("reloaded its settings") > reloads, message="the reload")
        outbox.wait_idle()
        event_id = outbox.value("SELECT outbox_enqueue('moved', '{}', queue => 'q_moved')")
        wait_until(lambda: queued_ids(second.client(), "q_moved") == [str(event_id)],
                   message="the event in the second Redis")
        assert redis_server.client().llen("q_moved") == 0
    finally:
        outbox.sql("ALTER SYSTEM RESET outbox.redis_url")
        outbox.sql("SELECT pg_reload_conf()")
        second.close()


def test_signals_during_redis_calls_do_not_break_the_connection(outbox, redis_server):
    """PostgreSQL signals its processes routinely (SIGUSR1 for invalidation
    catch-up, SIGHUP for reloads); a signal must not fail a Redis read or
    write (EINTR) and pass for a broken connection."""
    outbox.configure(enabled="off", batch_size=50)
    load(outbox, 20000, "q_signals")
    reconnects = outbox.value("SELECT sum(value) FROM outbox.metrics WHERE name = 'outbox_reconnects_total'")
    [pid] = outbox.dispatcher_pids()
    stop = threading.Event()

    def pester():
        while not stop.is_set():
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.0005)

    pesterer = threading.Thread(target=pester)
    pesterer.start()
    try:
        outbox.configure(enabled="on", batch_size=50)
        wait_until(lambda: outbox.count("dispatched") == 20000, timeout=180, message="every event")
    finally:
        stop.set()
        pesterer.join()
    assert outbox.value("SELECT sum(value) FROM outbox.metrics WHERE name = 'outbox_reconnects_total'") == reconnects
    assert set(queued_ids(redis_server.client(), "q_signals")) == all_ids(outbox)
