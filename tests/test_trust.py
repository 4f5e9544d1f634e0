"""Trust inside the server: a hostile database owner gains nothing, every
wait answers a shutdown within seconds, the broker's own conditions never
dead-letter an event, pg_dump keeps the events, and the dispatchers report
what they do as PostgreSQL's own workers do."""

import re
import time

import psycopg
import pytest

from harness import PG_BIN, Cluster, Redis, SilentBroker, as_postgres, decode, queued_ids, wait_until


def enqueue(pg, n, queue, payload="{}", dbname="postgres"):
    with pg.connect(dbname=dbname) as conn:
        return [str(r[0]) for r in conn.execute(
            "SELECT outbox_enqueue('trust', %s::jsonb, queue => %s) FROM generate_series(1, %s)",
            (payload, queue, n)).fetchall()]


def timed_fast_stop(pg):
    started = time.monotonic()
    pg.stop("fast")
    return time.monotonic() - started


# -- a hostile database owner ---------------------------------------------------

ESCALATE = """
CREATE FUNCTION public.escalate() RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF pg_catalog.current_setting('is_superuser') = 'on' THEN
        EXECUTE 'ALTER ROLE mallory SUPERUSER';
    END IF;
    RETURN true;
END $$;
CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE plpgsql AS $$
BEGIN
    PERFORM public.escalate();
    RETURN pg_catalog.clock_timestamp();
END $$;
CREATE FUNCTION public.min(timestamptz, timestamptz) RETURNS timestamptz LANGUAGE plpgsql AS $$
BEGIN PERFORM public.escalate(); RETURN pg_catalog.least($1, $2); END $$;
CREATE AGGREGATE public.min(timestamptz) (sfunc = public.min, stype = timestamptz);
CREATE FUNCTION public.date_part(text, timestamptz) RETURNS float8 LANGUAGE plpgsql AS $$
BEGIN PERFORM public.escalate(); RETURN 0; END $$;
CREATE FUNCTION public.date_part(text, interval) RETURNS float8 LANGUAGE plpgsql AS $$
BEGIN PERFORM public.escalate(); RETURN 0; END $$;
"""

# Operators the extension's statements use, each calling escalate().
OPERATORS = [("=", "uuid", "pg_catalog.uuid_eq"), ("=", "integer", "pg_catalog.int4eq"),
             (">=", "integer", "pg_catalog.int4ge"), ("<=", "integer", "pg_catalog.int4le"),
             (">", "integer", "pg_catalog.int4gt"), ("<=", "timestamptz", "pg_catalog.timestamptz_le"),
             ("<", "timestamptz", "pg_catalog.timestamptz_lt"), ("=", "timestamptz", "pg_catalog.timestamptz_eq"),
             ("=", "text", "pg_catalog.texteq"), ("=", "bigint", "pg_catalog.int8eq")]


def plant(conn):
    since_17 = [("transaction_timeout", "'1ms'")] if conn.info.server_version >= 170000 else []
    conn.execute(ESCALATE)
    for i, (op, type_, real) in enumerate(OPERATORS):
        conn.execute(f"""
            CREATE FUNCTION public.evil_op{i}(a {type_}, b {type_}) RETURNS boolean LANGUAGE plpgsql AS $$
            BEGIN PERFORM public.escalate(); RETURN {real}(a, b); END $$;
            CREATE OPERATOR public.{op} (leftarg = {type_}, rightarg = {type_}, function = public.evil_op{i})""")
    conn.execute("ALTER DATABASE app SET search_path = public, pg_catalog")
    # Every setting a database owner may set for the dispatchers' sessions.
    for setting, value in [("outbox.default_queue", "''"), ("outbox.notify", "on"),
                           ("outbox.notify_channel", "'hostile'"), ("DateStyle", "'SQL, DMY'"),
                           ("TimeZone", "'Asia/Kathmandu'"), ("IntervalStyle", "'sql_standard'"),
                           ("synchronous_commit", "'local'"), ("role", "mallory"), ("exit_on_error", "on"),
                           ("enable_indexscan", "off"), ("jit_above_cost", "0"), *since_17]:
        conn.execute(f"ALTER DATABASE app SET {setting} = {value}")


def test_a_hostile_database_owner_gains_nothing_and_events_still_flow(redis_server):
    pg = Cluster(redis_server.url, database="app", poll_interval="1s", sweep_interval="1s",
                 lifecycle_interval="1s", heartbeat_interval="1s")
    try:
        pg.sql("CREATE ROLE mallory LOGIN")
        pg.sql("CREATE DATABASE app OWNER mallory")
        with pg.connect(dbname="app") as conn:
            conn.execute("CREATE EXTENSION outbox_dispatch")
        with pg.connect(dbname="app", user="mallory") as conn:
            plant(conn)
        # The superuser's own sessions in app keep what the tests need.
        undo = "-c role=none -c exit_on_error=off -c enable_indexscan=on -c jit=off"
        undo += " -c transaction_timeout=0" if pg.value("SHOW server_version_num") >= "170000" else ""
        # Any restart of the dispatchers picks up the database's settings.
        with pg.connect(dbname="app", options=undo) as conn:
            pid = wait_until(lambda: conn.execute("SELECT pid FROM outbox.workers").fetchone()[0], timeout=60,
                             message="the dispatcher connected to app")
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            wait_until(lambda: conn.execute("SELECT pid FROM outbox.workers").fetchone()[0] not in (None, pid),
                       timeout=60, message="a restarted dispatcher")
            restarted = conn.execute("SELECT pid FROM outbox.workers").fetchone()[0]
        with pg.connect(dbname="app", options=undo) as conn:
            # A superuser working in that database, with the owner's search_path.
            assert conn.execute("SHOW search_path").fetchone()[0] == "public, pg_catalog"
            ids = [str(r[0]) for r in conn.execute(
                "SELECT outbox_enqueue('hostile', '{}', queue => 'q_hostile', delay => interval '1 second') "
                "FROM generate_series(1, 5)").fetchall()]
            # Routed by a SECURITY DEFINER trigger, to a delivery and a batch.
            conn.execute("SELECT outbox_subscribe('hostile.routed', 'task.now', queue => 'q_hostile_sub'), "
                         "outbox_subscribe('hostile.routed', 'task.batch', queue => 'q_hostile_sub', batch_max => 5), "
                         "outbox_subscribe('hostile.routed', 'task.own_queue', batch_max => 5)")
            conn.execute("SELECT outbox_enqueue('hostile.routed', '{}', queue => 'q_hostile_sub') "
                         "FROM generate_series(1, 5)")
            conn.execute("SELECT outbox_retry_failed()")
            conn.execute("SELECT outbox_metrics_prometheus()")
            conn.execute("TABLE outbox.metrics")
        wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_hostile")) == sorted(ids), timeout=60,
                   message="delivery in the hostile database")
        with pg.connect(dbname="app", options=undo) as conn:
            routed = [str(r[0]) for r in conn.execute(
                "SELECT id FROM outbox.events WHERE subscription_id IS NOT NULL").fetchall()]
        assert len(routed) == 7
        wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_hostile_sub")) == sorted(routed), timeout=60,
                   message="the deliveries and the batches in the hostile database")
        # Times in the headers are ISO 8601 in UTC, whatever the database's style.
        envelope, _ = decode(redis_server.client().lindex("q_hostile", 0))
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\+00", envelope["headers"]["outbox_created_at"])
        time.sleep(3)  # heartbeats, sweeps and purges run meanwhile
        assert pg.value("SELECT rolsuper FROM pg_roles WHERE rolname = 'mallory'") is False
        assert "ignoring the settings of database \"app\"" in pg.log_text()
        with pg.connect(dbname="app", options=undo) as conn:
            dispatchers = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type OPERATOR(pg_catalog.=) 'outbox dispatcher'").fetchone()[0]
            # Not one restart since (exit_on_error, transaction_timeout would cause them).
            assert conn.execute("SELECT pid FROM outbox.workers").fetchone()[0] == restarted
        assert dispatchers == 1
    finally:
        pg.close()


# -- every wait answers a shutdown ------------------------------------------------

@pytest.mark.parametrize("scheme", ["redis", "rediss"])
def test_a_silent_broker_times_out_a_reload_recovers_and_shutdown_is_prompt(redis_server, scheme):
    silent = SilentBroker()
    silent_url = f"{scheme}://:secret@127.0.0.1:{silent.port}/0"
    pg = Cluster(silent_url, broker_timeout="2s", reconnect_delay_min="100ms", reconnect_delay_max="200ms")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        wait_until(lambda: "within outbox.broker_timeout" in (pg.value("SELECT last_error FROM outbox.workers") or ""),
                   timeout=30, message="last_error to say timeout")
        assert pg.metric("outbox_reconnects_total", reason="timeout") >= 1
        # A long timeout now: the dispatcher sits in a connect for a minute
        # unless a reload or a shutdown reaches it.
        pg.configure(broker_timeout="60s")
        time.sleep(3)
        queue = f"q_silent_{scheme}"
        ids = enqueue(pg, 3, queue)
        started = time.monotonic()
        pg.configure(redis_url=redis_server.url)
        wait_until(lambda: sorted(queued_ids(redis_server.client(), queue)) == sorted(ids), timeout=30,
                   message="delivery after the reload")
        assert time.monotonic() - started < 20
        pg.configure(redis_url=silent_url)
        enqueue(pg, 1, queue)
        time.sleep(3)
        assert timed_fast_stop(pg) < 10
    finally:
        pg.close()
        silent.close()


def test_a_table_lock_shows_in_workers_and_does_not_hold_up_shutdown(outbox, redis_server):
    outbox.wait_idle()
    ids = enqueue(outbox, 3, "q_locked")
    wait_until(lambda: len(queued_ids(redis_server.client(), "q_locked")) == 3, message="the first events")
    with outbox.connect(autocommit=False) as locker:
        locker.execute("LOCK TABLE outbox.log IN ACCESS EXCLUSIVE MODE")
        outbox.sql("SELECT outbox_wake()")
        wait_until(lambda: outbox.value("SELECT state FROM outbox.workers") == "blocked", timeout=30,
                   message="the dispatcher to show the lock")
        assert "lock" in outbox.value("SELECT last_error FROM outbox.workers")
        locker.rollback()
    more = enqueue(outbox, 2, "q_locked")
    wait_until(lambda: set(queued_ids(redis_server.client(), "q_locked")) == set(ids + more), message="recovery")
    wait_until(lambda: outbox.value("SELECT last_error FROM outbox.workers") is None, message="the error cleared")


def test_a_lock_held_during_shutdown_does_not_delay_it(redis_server):
    pg = Cluster(redis_server.url)
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.wait_idle()
        locker = pg.connect(autocommit=False)
        locker.execute("LOCK TABLE outbox.log IN ACCESS EXCLUSIVE MODE")
        pg.sql("SELECT outbox_wake()")
        wait_until(lambda: pg.value("SELECT state FROM outbox.workers") == "blocked", timeout=30,
                   message="the dispatcher waiting on the lock")
        assert timed_fast_stop(pg) < 10
        locker.close()
    finally:
        pg.close()


def test_a_slow_statement_ends_at_outbox_statement_timeout_and_delivery_resumes(redis_server):
    """PostgreSQL arms statement_timeout only for top-level statements, never
    under SPI: the dispatchers arm their own deadline. A trigger makes every
    claim (its batch's row) sleep for a minute."""
    pg = Cluster(redis_server.url, statement_timeout="1s")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.wait_idle()
        [pid] = pg.dispatcher_pids()
        pg.sql("""CREATE FUNCTION public.slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
                  BEGIN PERFORM pg_catalog.pg_sleep(60); RETURN NEW; END $$;
                  CREATE TRIGGER slow_claim BEFORE INSERT ON outbox.batches FOR EACH ROW
                  EXECUTE FUNCTION public.slow_claim()""")
        ids = enqueue(pg, 3, "q_slow")
        wait_until(lambda: "statement timeout" in (pg.value("SELECT last_error FROM outbox.workers") or ""),
                   timeout=30, message="the deadline in last_error")
        assert pg.value("SELECT state FROM outbox.workers") == "blocked"
        assert pg.count("pending") == 3
        pg.sql("DROP TRIGGER slow_claim ON outbox.batches")
        wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_slow")) == sorted(ids), timeout=30,
                   message="delivery once the statement is quick again")
        wait_until(lambda: pg.value("SELECT last_error FROM outbox.workers") is None, message="the error cleared")
        assert pg.dispatcher_pids() == [pid], "the dispatcher was restarted"
        assert "canceling statement due to statement timeout" in pg.log_text()
        # A slow statement at shutdown: the fast stop does not wait for it.
        pg.sql("CREATE TRIGGER slow_claim BEFORE INSERT ON outbox.batches FOR EACH ROW "
               "EXECUTE FUNCTION public.slow_claim()")
        pg.configure(statement_timeout="1h")
        enqueue(pg, 1, "q_slow")
        wait_until(lambda: pg.value("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'") == 1,
                   timeout=30, message="the claim asleep")
        assert timed_fast_stop(pg) < 10
    finally:
        pg.close()


# -- the broker's conditions are not the events' fault ------------------------------

@pytest.mark.parametrize("condition", ["oom", "readonly"])
def test_a_refusing_broker_dead_letters_nothing(condition):
    server = Redis()
    pg = Cluster(server.url, reconnect_delay_min="200ms", reconnect_delay_max="500ms", max_retries=1)
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.wait_idle()
        client = server.client()
        if condition == "oom":
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 1)
        else:
            client.execute_command("REPLICAOF", "127.0.0.1", "1")
        ids = enqueue(pg, 10, "q_refused")
        wait_until(lambda: pg.metric("outbox_broker_refusals_total", condition=condition) >= 2, timeout=30,
                   message=f"the {condition} refusals counted")
        assert pg.count("failed") == 0
        assert condition.upper() in pg.value("SELECT last_error FROM outbox.workers")
        if condition == "oom":
            client.config_set("maxmemory", 0)
        else:
            client.execute_command("REPLICAOF", "NO", "ONE")
        wait_until(lambda: sorted(queued_ids(client, "q_refused")) == sorted(ids), timeout=60,
                   message="every event once the condition cleared")
        wait_until(lambda: pg.count("dispatched") == 10, message="every event marked (after its push)")
        assert pg.count("failed") == 0
        assert pg.metric("outbox_reconnects_total", reason="refused") >= 2
    finally:
        pg.close()
        server.close()


# -- pg_dump ---------------------------------------------------------------------

SUBSCRIPTIONS = "SELECT id, event_type, task, batch_max, waiting, unsubscribed_at FROM outbox.subscriptions"
DELIVERIES = "SELECT event_id, subscription_id, delivery_id, status FROM outbox.deliveries ORDER BY 1, 2"
KEYED = "SELECT id, key_state FROM outbox.events WHERE ordering_key = 'dumped' ORDER BY key_seq"


def test_pg_dump_and_restore_keep_undelivered_events_and_subscriptions(redis_server):
    pg = Cluster(redis_server.url, enabled="off")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        ids = enqueue(pg, 10, "q_dump")
        # Subscriptions, an event routed to them (one delivery, one member
        # waiting for its batch), and one routed to none.
        pg.sql("SELECT outbox_subscribe('trust.routed', 'dump.now'), "
               "outbox_subscribe('trust.routed', 'dump.later', batch_max => 10)")
        pg.sql("SELECT outbox_unsubscribe(outbox_subscribe('trust.gone', 'dump.gone'))")
        pg.sql("SELECT outbox_enqueue('trust.routed', '{}'), outbox_enqueue('trust.unrouted', '{}')")
        # A key's head and the events waiting behind it.
        pg.sql("SELECT outbox_enqueue('trust.keyed', '{}', queue => 'q_keyed', ordering_key => 'dumped') "
               "FROM generate_series(1, 3)")
        subscriptions, deliveries, keyed = pg.sql(SUBSCRIPTIONS), pg.sql(DELIVERIES), pg.sql(KEYED)
        assert [k[1] for k in keyed] == ["head", "waiting", "waiting"]
        assert len(subscriptions) == 2 and [d[3] for d in deliveries] == ["pending", "waiting"]
        dump = pg.dir / "app.dump"
        as_postgres(PG_BIN / "pg_dump", "-h", pg.dir, "-p", pg.port, "-U", "postgres", "-Fc", "-f", dump, "postgres")
        pg.sql("CREATE DATABASE restored")
        as_postgres(PG_BIN / "pg_restore", "-h", pg.dir, "-p", pg.port, "-U", "postgres", "-d", "restored", dump)
        with pg.connect(dbname="restored") as conn:
            restored = [str(r[0]) for r in conn.execute(
                "SELECT id FROM outbox.events WHERE status = 'pending' AND queue = 'q_dump'").fetchall()]
            assert conn.execute(SUBSCRIPTIONS).fetchall() == subscriptions
            # Restoring routes nothing again.
            assert conn.execute(DELIVERIES).fetchall() == deliveries
            assert conn.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 16
            # Each key keeps its order and its head; a new event waits behind them.
            assert conn.execute(KEYED).fetchall() == keyed
            conn.execute("SELECT outbox_enqueue('trust.keyed', '{}', queue => 'q_keyed', ordering_key => 'dumped')")
            assert conn.execute(KEYED).fetchall()[:3] == keyed
            assert conn.execute(KEYED).fetchall()[3][1] == "waiting"
            # The ids go on from where they were.
            assert conn.execute("SELECT outbox_subscribe('trust.new', 'dump.new')").fetchone()[0] == 4
        assert sorted(restored) == sorted(ids)
    finally:
        pg.close()


def test_a_dump_keeps_what_awaits_an_acknowledgement_only_where_acknowledgements_are_on(redis_server):
    """Delivered, not acknowledged, by a batch that awaits acknowledgements
    (sent while outbox.ack_timeout > 0): the event may be lost in the
    broker, and a restore must still send it, whatever the setting is when
    the dump runs. What was sent with acknowledgements off is done, and not
    dumped (a restore would send it again)."""
    pg = Cluster(redis_server.url, ack_timeout="1h", report_key="")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        acked, unacked = enqueue(pg, 2, "q_dump_acks")
        wait_until(lambda: pg.count("dispatched") == 2, message="both dispatched")
        assert pg.value("SELECT outbox_ack(%s)", (acked,)) is True
        pg.configure(ack_timeout="0")
        (done,) = enqueue(pg, 1, "q_dump_acks")
        wait_until(lambda: pg.count("dispatched") == 2, message="the one sent without acknowledgements dispatched")
        for ack_timeout, kept in (("0", [unacked]), ("1h", [unacked])):
            pg.configure(ack_timeout=ack_timeout)
            dump = pg.dir / "acks.dump"
            as_postgres(PG_BIN / "pg_dump", "-h", pg.dir, "-p", pg.port, "-U", "postgres", "-Fc", "-f", dump,
                        "postgres")
            pg.sql("DROP DATABASE IF EXISTS restored")
            pg.sql("CREATE DATABASE restored")
            as_postgres(PG_BIN / "pg_restore", "-h", pg.dir, "-p", pg.port, "-U", "postgres", "-d", "restored", dump)
            with pg.connect(dbname="restored") as conn:
                assert [str(r[0]) for r in conn.execute(
                    "SELECT id FROM outbox.events WHERE queue = 'q_dump_acks'").fetchall()] == kept, ack_timeout
    finally:
        pg.close()


# -- statistics and activity ---------------------------------------------------------

def test_dispatchers_report_statistics_and_activity(outbox, redis_server):
    outbox.wait_idle()
    [pid] = outbox.dispatcher_pids()

    def claims():
        outbox.sql("SELECT pg_stat_clear_snapshot()")
        return outbox.sql("SELECT n_tup_ins, n_tup_upd FROM pg_stat_user_tables "
                          "WHERE relid = 'outbox.batches'::regclass")[0]

    inserted, updated = claims()
    batches = outbox.value("SELECT count(*) FROM outbox.batches")
    enqueue(outbox, 1000, "q_stats")
    wait_until(lambda: outbox.count("dispatched") == 1000, message="the events dispatched")
    made = outbox.value("SELECT count(*) FROM outbox.batches") - batches
    # Flushed while the dispatcher keeps running: it is the same process.
    # A claim inserts its batch's row, its mark updates it.
    wait_until(lambda: claims() >= (inserted + made, updated + made), timeout=30,
               message="claims and marks in pg_stat_user_tables")
    assert outbox.dispatcher_pids() == [pid]
    query = outbox.value("SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,))
    assert "outbox" in query, query


def test_a_broker_without_persistence_is_reported_once(outbox):
    outbox.wait_idle()
    assert outbox.value("SELECT broker_persistence FROM outbox.workers") == "none"
    assert outbox.log_text().count("persists nothing (no RDB snapshots, no AOF)") >= 1


# -- claims and sizes ----------------------------------------------------------------

def test_a_stale_holder_cannot_record_an_outcome_for_a_claim_it_lost(outbox, redis_server):
    outbox.configure(broker_timeout="30s")
    outbox.wait_idle()
    client = redis_server.client()
    client.execute_command("CLIENT", "PAUSE", 4000, "WRITE")
    ids = enqueue(outbox, 5, "q_stale")
    wait_until(lambda: outbox.count("processing") == 5, message="the claim, its push held up")
    # A sweeper took the claim meanwhile: its events went back in line,
    # where another claim (dispatcher 9's, never marked) took them.
    outbox.sql("UPDATE outbox.batches SET abandoned_at = now() WHERE marked_at IS NULL")
    outbox.sql("UPDATE outbox.log SET pending_xid = pg_current_xact_id() WHERE queue = 'q_stale'")
    batch, _ = outbox.claim_as(9, 100)
    wait_until(lambda: sorted(queued_ids(client, "q_stale")) == sorted(ids), timeout=30,
               message="the held-up push to finish")
    outbox.sql("SELECT outbox_wake()")
    outbox.wait_idle()
    assert outbox.sql("SELECT DISTINCT status::text, batch FROM outbox.events") == [("processing", batch)]
    assert outbox.value("SELECT count(*) FROM outbox.batches WHERE marked_at IS NOT NULL AND abandoned_at IS NOT NULL") == 0


def test_big_payloads_travel_in_several_round_trips_without_a_reconnect(outbox, redis_server):
    outbox.configure(batch_size=1000, max_batch_bytes="1MB")
    outbox.wait_idle()
    reconnects = sum(v for (v,) in outbox.sql(
        "SELECT value FROM outbox.metrics WHERE name = 'outbox_reconnects_total'"))
    payload = '{"blob": "%s"}' % ("x" * (1024 * 1024 - 20))
    ids = enqueue(outbox, 12, "q_big", payload=payload)
    wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_big")) == sorted(ids), timeout=60,
               message="every big event")
    assert outbox.count("failed") == 0
    assert sum(v for (v,) in outbox.sql(
        "SELECT value FROM outbox.metrics WHERE name = 'outbox_reconnects_total'")) == reconnects


def test_an_accepted_payload_is_never_dead_lettered_for_its_size(outbox, redis_server):
    outbox.configure(enabled="off")
    ids = enqueue(outbox, 2, "q_size", payload='{"blob": "%s"}' % ("y" * 5000))
    outbox.configure(enabled="on", max_payload_bytes="1kB")
    wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_size")) == sorted(ids), message="both events")
    assert outbox.count("failed") == 0
    with outbox.connect() as conn:
        with pytest.raises(psycopg.errors.ProgramLimitExceeded, match="bytes as jsonb, over outbox.max_payload_bytes"):
            conn.execute("SELECT outbox_enqueue('big', %s::jsonb)", ('{"blob": "%s"}' % ("z" * 2000),))


# -- settings and encodings -------------------------------------------------------------

def test_a_misspelled_setting_is_reported(redis_server):
    pg = Cluster(redis_server.url, server_conf={"outbox.bach_size": 10})
    try:
        assert 'invalid configuration parameter name "outbox.bach_size"' in pg.log_text()
    finally:
        pg.close()


def test_a_database_that_is_not_utf8_is_refused_clearly(cluster):
    cluster.sql("DROP DATABASE IF EXISTS latin")
    cluster.sql("CREATE DATABASE latin ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    with cluster.connect(dbname="latin") as conn:
        with pytest.raises(psycopg.errors.FeatureNotSupported, match='needs a UTF8 database; database "latin" is LATIN1'):
            conn.execute("CREATE EXTENSION outbox_dispatch")
        assert conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'outbox'").fetchone()[0] == 0


def test_a_processing_timeout_shorter_than_a_push_is_raised_and_said(outbox):
    outbox.configure(processing_timeout="1s", broker_timeout="5s")
    wait_until(lambda: "outbox.processing_timeout (1s) is shorter than the longest push" in outbox.log_text(),
               message="the warning")
