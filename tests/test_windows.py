"""The claims read the log window after window (sql/worker/claim.sql,
outbox.cursor): a claim's cost does not grow with the events read before
it, nor with a pinned xmin, and reading by windows loses nothing: not an
event whose transaction commits after later ones were claimed (nor a
prepared one), not one another session holds locked, not one a DBA sends
again by hand or a restore brings back with another history's
transaction id."""

import psycopg
import pytest

from harness import CLAIM_STATEMENT, Cluster, queued_ids, wait_until


def enqueue(conn, queue, event_type="e"):
    return str(conn.execute("SELECT outbox_enqueue(%s, '{}', queue => %s)", (event_type, queue)).fetchone()[0])


def test_a_claim_costs_the_same_after_200000_events_under_a_pin(redis_server):
    pg = Cluster(redis_server.url, batch_size=1000,
                 server_conf={"shared_preload_libraries": "'outbox_dispatch,pg_stat_statements'",
                              "pg_stat_statements.track": "all"})
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.sql("CREATE EXTENSION pg_stat_statements")
        client = redis_server.client()
        # A session idle in a transaction with an xid, for the whole test:
        # vacuum can remove no row version that died after it began.
        pin = pg.connect(autocommit=False)
        pin.execute("SELECT pg_current_xact_id()")

        def blocks_per_claim(events=20):
            """Shared buffers one claim touches, on average, while events
            are enqueued one transaction at a time and each is dispatched
            before the next."""
            pg.sql("SELECT pg_stat_statements_reset()")
            with pg.connect() as conn:
                for _ in range(events):
                    event = enqueue(conn, "q_cost")
                    wait_until(lambda: event in queued_ids(client, "q_cost"), message="the event in Redis")
            calls, blocks = pg.sql("SELECT sum(calls), sum(shared_blks_hit + shared_blks_read) "
                                   "FROM pg_stat_statements WHERE query LIKE %s", (CLAIM_STATEMENT,))[0]
            assert calls >= events
            return blocks / calls

        before = blocks_per_claim()
        # 200,000 events read and sent, under the pin.
        pg.sql("SELECT outbox_enqueue('gone', '{}', queue => 'q_gone') FROM generate_series(1, 200000)")
        wait_until(lambda: client.llen("q_gone") == 200000, timeout=300, message="200,000 events sent")
        # Sent without a write to them: nothing dead in the log.
        pg.sql("VACUUM outbox.log")
        assert pg.value("SELECT sum(n_dead_tup) FROM pg_stat_user_tables "
                        "WHERE relid IN (SELECT relid FROM pg_partition_tree('outbox.log'))") == 0
        # 3,000 claims more, which find nothing: each leaves a position
        # the pin keeps. Then fresh statistics, which the plans follow.
        with pg.connect(autocommit=False) as conn:
            pg.prepare_claim(conn)
            for _ in range(3000):
                pg.take_turn(conn)
                conn.execute("EXECUTE claim(1000, 99)")
                conn.commit()
        pg.sql("ANALYZE outbox.positions, outbox.batches")
        after = blocks_per_claim()
        assert after <= 2 * before + 10, (before, after)
        pin.rollback()
        pin.close()
    finally:
        pg.close()


def test_claims_keep_within_a_short_deadline_after_a_restart_and_a_pause_under_a_pin(redis_server):
    """No claim walks an unbounded stretch of entries: not the first one
    after a restart (which reads everything from the start), not the first
    after a pause (which reads what fell due meanwhile), however many dead
    entries a pinned xmin keeps, spread over many transactions. A claim
    over outbox.statement_timeout narrows its windows and goes on."""
    pg = Cluster(redis_server.url, statement_timeout="150ms", batch_size=1000)
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        client = redis_server.client()
        pin = pg.connect(autocommit=False)
        pin.execute("SELECT pg_current_xact_id()")
        pg.sql("DO $$ BEGIN FOR i IN 1..20000 LOOP "
               "PERFORM outbox_enqueue('gone', '{}', queue => 'q_gone') FROM generate_series(1, 10); COMMIT; "
               "END LOOP; END $$")
        wait_until(lambda: pg.count("dispatched") == 200_000, timeout=180, message="200,000 events dispatched")
        pg.configure(enabled="off")
        wait_until(lambda: pg.value("SELECT state FROM outbox.workers") == "paused", message="the pause")
        pg.sql("SELECT outbox_enqueue('backlog', '{}', queue => 'q_backlog') FROM generate_series(1, 100000)")
        [pid] = pg.dispatcher_pids()
        pg.sql("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(lambda: pg.dispatcher_pids() not in ([], [pid]), message="the dispatcher restarted")
        pg.configure(enabled="on")
        wait_until(lambda: client.llen("q_backlog") == 100_000, timeout=300, message="the backlog drained")
        with pg.connect() as conn:
            last = enqueue(conn, "q_after")
        wait_until(lambda: last in queued_ids(client, "q_after"), message="an event after it")
        pin.rollback()
        pin.close()
    finally:
        pg.close()


def claim_buffers(pg, limit=100):
    """Shared buffers one claim touches (EXPLAIN ANALYZE, rolled back)."""
    with pg.connect(autocommit=False) as conn:
        pg.take_turn(conn)
        pg.prepare_claim(conn)
        plan = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim({limit}, 0)").fetchone()[0]
        conn.rollback()
    top = plan[0]["Plan"]
    return top["Shared Hit Blocks"] + top["Shared Read Blocks"]


def test_a_transaction_left_open_is_not_walked_by_every_claim(redis_server):
    """A transaction that has enqueued 20,000 events and stays open is read
    once it ends, not walked by every claim meanwhile (a claim that reads
    nothing moves the window past it), and holds up nothing committed
    after it."""
    pg = Cluster(redis_server.url, enabled="off")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.claim_as(0, 100)
        with pg.connect(autocommit=False) as open_:
            open_.execute("SELECT outbox_enqueue('open', '{}', queue => 'q_open') FROM generate_series(1, 20000)")
            # A snapshot taken before any later transaction ended does not
            # list the open one as running (its xid is at or past the
            # snapshot's xmax), so the claim after such a snapshot still
            # walks its entries once; the one after that must not.
            for _ in range(2):
                assert pg.claim_as(0, 100) == (None, {})
            # Walking the open transaction's entries: about 400 buffers.
            assert claim_buffers(pg) < 50
            with pg.connect() as conn:
                later = enqueue(conn, "q_open")
            _, sent = pg.claim_as(0, 100)
            assert list(sent) == [later]
            open_.commit()
        claimed = {}
        while True:
            _, sent = pg.claim_as(0, 5000)
            if not sent:
                break
            claimed.update(sent)
        assert len(claimed) == 20000 and later not in claimed
    finally:
        pg.close()


def test_claims_put_back_their_turn_deleted_by_hand_and_still_take_turns(redis_server):
    """The row the claims lock in turn, deleted by hand: the next claim puts
    it back, and a claim beside it waits for it, as it would for the row
    (it does not claim the same page); the dispatchers go on."""
    pg = Cluster(redis_server.url, enabled="off")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.sql("DELETE FROM outbox.claim_turn")
        with pg.connect(autocommit=False) as first, pg.connect(autocommit=False) as beside:
            assert pg.take_turn(first)
            beside.execute("SET lock_timeout = '500ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                pg.take_turn(beside)
            first.commit()
            beside.rollback()
            assert not pg.take_turn(beside)
        assert pg.value("SELECT count(*) FROM outbox.claim_turn") == 1
        pg.sql("DELETE FROM outbox.claim_turn")
        with pg.connect() as conn:
            events = {enqueue(conn, "q_turn") for _ in range(20)}
        pg.configure(enabled="on")
        client = redis_server.client()
        wait_until(lambda: len(queued_ids(client, "q_turn")) >= 20, message="the events sent")
        assert sorted(queued_ids(client, "q_turn")) == sorted(events)
        assert pg.value("SELECT count(*) FROM outbox.claim_turn") == 1
    finally:
        pg.close()


def test_events_committed_after_later_ones_were_claimed_are_dispatched(outbox, redis_server):
    client = redis_server.client()
    late, rolled_back, prepared = (outbox.connect(autocommit=False) for _ in range(3))
    try:
        late_id = enqueue(late, "q_late", "late")
        rolled_back_id = enqueue(rolled_back, "q_late", "rolled_back")
        prepared_id = enqueue(prepared, "q_late", "prepared")
        prepared.execute("PREPARE TRANSACTION 'outbox_late'")
        # Later transactions commit first; their events are claimed while
        # the three above are still in progress.
        with outbox.connect() as conn:
            early = [enqueue(conn, "q_late") for _ in range(50)]
        wait_until(lambda: set(early) <= set(queued_ids(client, "q_late")), message="the early events")
        late.commit()
        rolled_back.rollback()
        outbox.sql("COMMIT PREPARED 'outbox_late'")
        # COMMIT PREPARED wakes nobody; the poll would, later.
        outbox.sql("SELECT outbox_wake()")
        wait_until(lambda: {late_id, prepared_id} <= set(queued_ids(client, "q_late")),
                   message="the late and the prepared event")
        with outbox.connect() as conn:
            last = enqueue(conn, "q_late")
        wait_until(lambda: last in queued_ids(client, "q_late"), message="an event after them")
        ids = queued_ids(client, "q_late")
        assert rolled_back_id not in ids
        assert sorted(ids) == sorted(early + [late_id, prepared_id, last])
    finally:
        for conn in (late, rolled_back, prepared):
            conn.close()
        if outbox.value("SELECT count(*) FROM pg_prepared_xacts WHERE gid = 'outbox_late'"):
            outbox.sql("ROLLBACK PREPARED 'outbox_late'")


def test_an_event_another_session_holds_locked_is_sent_all_the_same(outbox, redis_server):
    """The claim takes no lock of the events: a session holding one, even
    FOR UPDATE, holds up nothing."""
    client = redis_server.client()
    outbox.configure(enabled="off")
    wait_until(lambda: outbox.value("SELECT state FROM outbox.workers") == "paused", message="the pause")
    locked_id, share_id = (
        outbox.value("INSERT INTO outbox.events (event_type, queue) VALUES (%s, 'q_locked') RETURNING id::text", (t,))
        for t in ("locked", "share"))
    with outbox.connect(autocommit=False) as holder, outbox.connect(autocommit=False) as sharer:
        holder.execute("SELECT 1 FROM outbox.log WHERE id = %s FOR UPDATE", (locked_id,))
        sharer.execute("SELECT 1 FROM outbox.log WHERE id = %s FOR SHARE", (share_id,))
        outbox.configure(enabled="on")
        wait_until(lambda: {locked_id, share_id} <= set(queued_ids(client, "q_locked")),
                   message="the locked events sent while locked")
        holder.rollback()
        sharer.rollback()


def test_events_set_pending_by_hand_or_restored_are_put_in_line(outbox, redis_server):
    client = redis_server.client()
    with outbox.connect() as conn:
        passed = enqueue(conn, "q_hand")
        wait_until(lambda: passed in queued_ids(client, "q_hand"), message="the first send")
        # A DBA sends a dispatched event again by hand (an UPDATE that
        # leaves its status, place and due time as they were does not).
        # (One transaction: the dispatchers would send it again after each.)
        with conn.transaction():
            conn.execute("UPDATE outbox.log SET status = 'pending' WHERE id = %s", (passed,))
            conn.execute("UPDATE outbox.events SET payload = '{\"again\": true}' WHERE id = %s", (passed,))
            conn.execute("UPDATE outbox.log SET pending_xid = NULL WHERE id = %s", (passed,))
        wait_until(lambda: queued_ids(client, "q_hand").count(passed) == 2, message="the send by hand")
        # A DBA hurries an event delayed by an hour.
        delayed = str(conn.execute("SELECT outbox_enqueue('e', '{}', queue => 'q_hand', delay => '1 hour')")
                      .fetchone()[0])
        conn.execute("UPDATE outbox.events SET available_at = now() WHERE id = %s", (delayed,))
        wait_until(lambda: delayed in queued_ids(client, "q_hand"), message="the hurried event")
        # A row copied in with the transaction id of another history (a
        # restored dump), far behind where the claim has got to.
        restored = conn.execute("INSERT INTO outbox.events (event_type, queue, pending_xid) "
                                "VALUES ('restored', 'q_hand', '3') RETURNING id::text").fetchone()[0]
        wait_until(lambda: restored in queued_ids(client, "q_hand"), message="the restored event")
        # Nor can an UPDATE of the table set it behind the claim (the view
        # refuses the column).
        moved = str(conn.execute("SELECT outbox_enqueue('e', '{}', queue => 'q_hand', delay => '1 hour')")
                    .fetchone()[0])
        conn.execute("UPDATE outbox.log SET pending_xid = '3' WHERE id = %s", (moved,))
    assert outbox.value("SELECT count(*) FROM outbox.events WHERE pending_xid = '3'") == 0


def test_events_restored_from_a_busier_cluster_are_put_in_line(outbox, redis_server):
    """A data-only restore with its triggers disabled (pg_restore
    --disable-triggers) brings pending rows whose pending_xid lies in this
    cluster's future, where no claim looks until its transaction ids catch
    up: the sweep puts them in line. (ENABLE TRIGGER ALL after it turns
    events_pending_again back to origin-only: the restore step in
    docs/reference/table.md sets it ALWAYS again, as here.)"""
    client = redis_server.client()
    outbox.configure(sweep_interval="1s")
    with outbox.connect() as conn:
        conn.execute("ALTER TABLE outbox.log DISABLE TRIGGER ALL")
        try:
            future = conn.execute(
                "INSERT INTO outbox.events (event_type, queue, pending_xid) "
                "SELECT 'restored', 'q_future', (pg_snapshot_xmax(pg_current_snapshot())::text::bigint "
                "                                + 1000000000)::text::xid8 "
                "RETURNING id::text").fetchone()[0]
        finally:
            conn.execute("ALTER TABLE outbox.log ENABLE TRIGGER ALL")
            conn.execute("ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_pending_again")
        after = enqueue(conn, "q_future")
    wait_until(lambda: after in queued_ids(client, "q_future"), message="an event after it")
    wait_until(lambda: future in queued_ids(client, "q_future"), timeout=60, message="the restored event")
    outbox.configure(sweep_interval="30s")


def test_events_restored_with_a_transaction_id_before_every_window_are_put_in_line(outbox, redis_server):
    """The same restore from a cluster whose transaction ids are lower than
    this one's: the rows' pending_xid is one every window has passed, so no
    claim would ever read them; the sweep puts them in line."""
    client = redis_server.client()
    outbox.configure(sweep_interval="1s")
    with outbox.connect() as conn:
        conn.execute("ALTER TABLE outbox.log DISABLE TRIGGER ALL")
        try:
            past = conn.execute("INSERT INTO outbox.events (event_type, queue, pending_xid) "
                                "VALUES ('restored', 'q_past', '3') RETURNING id::text").fetchone()[0]
        finally:
            conn.execute("ALTER TABLE outbox.log ENABLE TRIGGER ALL")
            conn.execute("ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_pending_again")
    wait_until(lambda: past in queued_ids(client, "q_past"), timeout=60, message="the restored event")
    outbox.configure(sweep_interval="30s")


def test_events_restored_inside_windows_already_read_are_found_and_sent(outbox, redis_server):
    """A data-only restore with its triggers disabled into a database whose
    claims have read past the rows' transaction ids (a dump of another
    database of the same cluster). One row's place in line lies in a batch
    sent before it came: it looked sent. Another's lies in a window read
    before it came, in a batch or not. The dispatchers find both (written
    after the claims that passed their place), put them in line, and make
    the triggers fire always again. The restore is done as
    docs/reference/table.md says: nothing after ENABLE TRIGGER ALL."""
    client = redis_server.client()
    outbox.configure(sweep_interval="1h")
    with outbox.connect() as conn:
        # A transaction of the dumped database that enqueued nothing...
        idle = conn.execute("SELECT pg_current_xact_id()::text").fetchone()[0]
        # ... and one whose place is the first sent event's.
        with conn.transaction():
            sent = [enqueue(conn, "q_inside")]
            shared = conn.execute("SELECT pg_current_xact_id()::text").fetchone()[0]
        sent += [enqueue(conn, "q_inside") for _ in range(2)]
        wait_until(lambda: set(sent) <= set(queued_ids(client, "q_inside")), message="the events after it sent")
        conn.execute("ALTER TABLE outbox.log DISABLE TRIGGER ALL")
        try:
            restored = [r[0] for r in conn.execute(
                "INSERT INTO outbox.log (id, event_type, queue, pending_xid) "
                "VALUES ('00000000-0000-7000-8000-000000000001', 'restored', 'q_inside', %s), "
                "       (gen_random_uuid(), 'restored', 'q_inside', %s) RETURNING id::text", (shared, idle))]
        finally:
            conn.execute("ALTER TABLE outbox.log ENABLE TRIGGER ALL")
    # What the first looked like: sent, in the batch that sent the first event.
    assert outbox.value("SELECT status::text FROM outbox.events WHERE id = %s", (restored[0],)) == "dispatched"
    assert outbox.value("SELECT count(*) FROM outbox.triggers_off()") >= 1
    relined = outbox.metric("outbox_strays_relined_total") or 0
    outbox.configure(sweep_interval="1s")
    wait_until(lambda: set(restored) <= set(queued_ids(client, "q_inside")), timeout=60,
               message="the restored events")
    wait_until(lambda: outbox.value("SELECT count(*) FROM outbox.triggers_off()") == 0,
               message="the triggers firing always again")
    assert outbox.value("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'outbox.log'::regclass AND tgenabled = 'A'") \
        >= 2
    assert outbox.metric("outbox_strays_relined_total") - relined == 2
    assert sorted(queued_ids(client, "q_inside")) == sorted(sent + restored)
    outbox.configure(sweep_interval="30s")


def busy(pg, work):
    """Runs `work(conn)` in a transaction that has its transaction id while
    a later one stays in progress and a still later one ends (a busy
    cluster); commits it."""
    with pg.connect(autocommit=False) as conn, pg.connect(autocommit=False) as open_, pg.connect() as ended:
        conn.execute("SELECT pg_current_xact_id()")
        open_.execute("SELECT pg_current_xact_id()")
        ended.execute("SELECT pg_current_xact_id()")
        result = work(conn)
        conn.commit()
        open_.rollback()
    return result


def test_events_enqueued_in_the_transaction_that_creates_the_extension_are_sent(redis_server):
    """A migration that creates the extension and enqueues in one
    transaction, or a restore in one (pg_restore --single-transaction),
    while other transactions end: its events are read once it commits."""
    pg = Cluster(redis_server.url, report_key="")
    try:
        event = busy(pg, lambda conn: (conn.execute("CREATE EXTENSION outbox_dispatch"),
                                       enqueue(conn, "q_created"))[1])
        wait_until(lambda: event in queued_ids(redis_server.client(), "q_created"), timeout=60,
                   message="the event enqueued with the extension")
    finally:
        pg.close()


def test_an_update_on_a_busy_cluster_keeps_what_its_transaction_enqueues(redis_server):
    """ALTER EXTENSION ... UPDATE from 0.9.0 while a later transaction is in
    progress and a still later one has ended (it used to fail: its first
    snapshot was malformed), in a migration that enqueues in the same
    transaction: the events pending before and the one enqueued after the
    update are all sent; one sent before is not sent again."""
    pg = Cluster(redis_server.url, report_key="", enabled="off")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch VERSION '0.9.0'")
        sent, before = (pg.value("INSERT INTO outbox.events (event_type, queue) VALUES ('e', 'q_updated') "
                                 "RETURNING id::text") for _ in range(2))
        pg.sql("UPDATE outbox.events SET status = 'dispatched', dispatched_at = now() WHERE id = %s", (sent,))
        after = busy(pg, lambda conn: (conn.execute("ALTER EXTENSION outbox_dispatch UPDATE"),
                                       enqueue(conn, "q_updated"))[1])
        pg.configure(enabled="on")
        client = redis_server.client()
        wait_until(lambda: sorted(queued_ids(client, "q_updated")) == sorted([before, after]), timeout=60,
                   message="the events pending and enqueued with the update")
        assert pg.value("SELECT status::text FROM outbox.events WHERE id = %s", (sent,)) == "dispatched"
    finally:
        pg.close()


def test_the_events_0_9_0_sent_become_batches_retention_takes_a_few_at_a_time(redis_server):
    """The update puts what 0.9.0 had sent in batches of 10,000, which read
    as dispatched, hold no claim, and which retention deletes in
    statements of a few batches (one batch of everything would take
    longer than outbox.statement_timeout, and stop retention for good)."""
    pg = Cluster(redis_server.url, report_key="", enabled="off")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch VERSION '0.9.0'")
        pg.sql("INSERT INTO outbox.events (event_type, queue, status, dispatched_at) "
               "SELECT 'e', 'q_sent', 'dispatched', now() - interval '1 day' FROM generate_series(1, 25000)")
        pg.sql("ALTER EXTENSION outbox_dispatch UPDATE")
        assert pg.sql("SELECT dispatcher, events, marked_at IS NOT NULL FROM outbox.batches ORDER BY id") == \
            [(-1, 10000, True), (-1, 10000, True), (-1, 5000, True)]
        assert dict(pg.sql("SELECT status::text, count FROM outbox.status WHERE count > 0")) == {"dispatched": 25000}
        pg.configure(retention="1s", lifecycle_interval="1s", statement_timeout="5s", enabled="on")
        # The truncation, then the batches left without events, a round later.
        wait_until(lambda: pg.value("SELECT count(*) FROM outbox.log") == 0
                   and pg.value("SELECT count(*) FROM outbox.batches") == 0, timeout=120, message="retention")
        assert redis_server.client().llen("q_sent") == 0
    finally:
        pg.close()


def test_the_events_0_9_0_processed_keep_their_outcome_and_its_time(redis_server):
    """The update records what 0.9.0 had processed as outcomes of the
    batches it makes, each with the time it was processed."""
    pg = Cluster(redis_server.url, report_key="", enabled="off")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch VERSION '0.9.0'")
        pg.sql("INSERT INTO outbox.events (event_type, queue, status, dispatched_at, processed_at) "
               "SELECT 'e', 'q_done', 'processed', now() - interval '1 day', now() - g * interval '1 minute' "
               "FROM generate_series(1, 300) AS g")
        before = dict(pg.sql("SELECT id, processed_at FROM outbox.events"))
        pg.sql("ALTER EXTENSION outbox_dispatch UPDATE")
        assert dict(pg.sql("SELECT status::text, count FROM outbox.status WHERE count > 0")) == {"processed": 300}
        after = dict(pg.sql("SELECT r.id, o.at FROM outbox.outcomes AS o, unnest(o.events) AS r(id)"))
        assert after == before
    finally:
        pg.close()


def test_events_due_at_infinity_stop_nothing(outbox, redis_server):
    client = redis_server.client()
    never, always = (outbox.value("INSERT INTO outbox.events (event_type, queue, available_at) "
                                  "VALUES ('e', 'q_infinity', %s) RETURNING id::text", (at,))
                     for at in ("infinity", "-infinity"))
    with outbox.connect() as conn:
        after = enqueue(conn, "q_infinity")
    wait_until(lambda: {always, after} <= set(queued_ids(client, "q_infinity")), message="the events that are due")
    # The dispatcher sleeps with one event never due, and wakes for the next.
    outbox.wait_idle()
    with outbox.connect() as conn:
        later = enqueue(conn, "q_infinity")
    wait_until(lambda: later in queued_ids(client, "q_infinity"), message="an event after it")
    assert never not in queued_ids(client, "q_infinity")
    assert outbox.value("SELECT last_error FROM outbox.workers") is None
    if outbox.value("SHOW server_version_num") >= "170000":
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="delay must be finite"):
            outbox.sql("SELECT outbox_enqueue('e', '{}', delay => 'infinity')")
