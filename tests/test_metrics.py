"""Observability: shared-memory counters and histograms, outbox.metrics,
outbox_metrics_prometheus(), outbox.workers and outbox.status, and what
each host serves Prometheus (the exporter over the library's, the
sidecar's /metrics), read by the alert rules. (Reconnects,
dead letters and stuck events are counted in test_reliability.py, where
those faults are made.)"""

import re
import subprocess
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from alert_recording import INTERVAL, Recording, firing, promtool_on
from harness import Cluster, wait_until
from standalone import library_only

METRICS_PAGE = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "metrics.md").read_text()


def histogram(pg, name):
    """(buckets as [(le, cumulative)], sum, count) as the host serves them."""
    [family] = [f for f in text_string_to_metric_families(pg.exposition()) if f.name == name]
    buckets = [(s.labels["le"], s.value) for s in family.samples if s.name == f"{name}_bucket"]
    totals = {s.name: s.value for s in family.samples}
    return buckets, totals[f"{name}_sum"], totals[f"{name}_count"]


def test_dispatching_n_events_moves_the_counters_by_n(outbox):
    outbox.wait_idle()
    dispatched = outbox.metric("outbox_dispatched_total")
    _, _, latency_count = histogram(outbox, "outbox_dispatch_latency_seconds")
    batches = outbox.metric("outbox_batches_total")
    outbox.sql("SELECT outbox_enqueue('m', '{}', queue => 'q_metrics') FROM generate_series(1, 250)")
    wait_until(lambda: outbox.count("dispatched") == 250, message="250 dispatched")

    assert outbox.metric("outbox_dispatched_total") - dispatched == 250
    buckets, latency_sum, count = histogram(outbox, "outbox_dispatch_latency_seconds")
    assert count - latency_count == 250
    values = [v for _, v in buckets]
    assert values == sorted(values), "buckets are cumulative"
    assert buckets[-1] == ("+Inf", count)
    assert latency_sum >= 0
    _, size_sum, size_count = histogram(outbox, "outbox_batch_size")
    assert size_count == outbox.metric("outbox_batches_total")
    assert outbox.metric("outbox_batches_total") > batches
    assert abs(size_sum - outbox.metric("outbox_dispatched_total")) < 0.5


def test_counters_survive_a_dispatcher_restart(outbox):
    outbox.sql("SELECT outbox_enqueue('m', '{}', queue => 'q_survive') FROM generate_series(1, 10)")
    wait_until(lambda: outbox.count("dispatched") == 10, message="10 dispatched")
    before = outbox.metric("outbox_dispatched_total")
    [pid] = outbox.dispatcher_pids()
    outbox.sql("SELECT pg_terminate_backend(%s)", (pid,))
    wait_until(lambda: outbox.dispatcher_pids() not in ([], [pid]), timeout=60, message="the restart")
    assert outbox.metric("outbox_dispatched_total") >= before >= 10


@library_only("counters in the server's shared memory")
def test_counters_reset_when_the_server_restarts(redis_server):
    pg = Cluster(redis_server.url)
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.sql("SELECT outbox_enqueue('m', '{}', queue => 'q_reset') FROM generate_series(1, 5)")
        wait_until(lambda: pg.metric("outbox_dispatched_total") == 5, message="5 dispatched")
        pg.restart()
        assert pg.metric("outbox_dispatched_total") == 0
        assert pg.metric("outbox_dispatch_latency_seconds_count") == 0
    finally:
        pg.close()


@library_only("a commit wakes the dispatchers through their latches, with no NOTIFY")
def test_wakeups_are_counted_by_source(outbox):
    outbox.wait_idle()
    commit = outbox.metric("outbox_wakeups_total", source="commit")
    manual = outbox.metric("outbox_wakeups_total", source="manual")
    outbox.sql("SELECT outbox_enqueue('m', '{}', queue => 'q_wakeups')")
    wait_until(lambda: outbox.metric("outbox_wakeups_total", source="commit") > commit, message="a commit wake")
    outbox.wait_idle()
    outbox.sql("SELECT outbox_wake()")
    wait_until(lambda: outbox.metric("outbox_wakeups_total", source="manual") > manual, message="a manual wake")
    # A dispatcher's own statements (its claims insert the batches of
    # accumulated subscriptions) wake nobody: idle, it stays asleep.
    commit = outbox.metric("outbox_wakeups_total", source="commit")
    time.sleep(1)
    assert outbox.metric("outbox_wakeups_total", source="commit") == commit
    poll = outbox.metric("outbox_wakeups_total", source="poll")
    outbox.configure(poll_interval="100ms")
    wait_until(lambda: outbox.metric("outbox_wakeups_total", source="poll") > poll + 3, message="poll wakes")


def test_prometheus_text_parses_and_every_metric_is_documented(outbox):
    """What Prometheus scrapes of the host (the exporter over
    outbox_metrics_prometheus(), or the sidecar's /metrics): the same
    families, each sample labelled with its database, and outbox_up, on
    which the dashboard's database picker and the alert rules rely."""
    outbox.sql("SELECT outbox_enqueue('m', '{}', queue => 'q_prom')")
    wait_until(lambda: outbox.count("dispatched") == 1, message="one dispatched")
    text = outbox.exposition()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "outbox_dispatched": "counter", "outbox_retries": "counter", "outbox_dead_letters": "counter",
        "outbox_stuck_rescued": "counter", "outbox_unacked_resent": "counter", "outbox_unacked_failed": "counter",
        "outbox_acked": "counter", "outbox_task_failures": "counter", "outbox_expired": "counter",
        "outbox_refused": "counter", "outbox_strays_relined": "counter",
        "outbox_reports_ignored": "counter", "outbox_broker_master_changes": "counter",
        "outbox_broker_unavailable_seconds": "counter",
        "outbox_purged": "counter", "outbox_batches": "counter", "outbox_push_failures": "counter",
        "outbox_accumulated_batches": "counter", "outbox_accumulated_events": "counter",
        "outbox_reconnects": "counter", "outbox_broker_refusals": "counter", "outbox_wakeups": "counter",
        "outbox_dispatch_latency_seconds": "histogram", "outbox_batch_size": "histogram",
        "outbox_workers_running": "gauge", "outbox_workers_connected": "gauge",
        "outbox_events": "gauge", "outbox_events_estimated": "gauge", "outbox_lag_seconds": "gauge",
        "outbox_events_unreported": "gauge", "outbox_workers_blocked": "gauge", "outbox_purge_lag_seconds": "gauge",
        "outbox_oldest_transaction_seconds": "gauge", "outbox_events_dead_tuples": "gauge",
        "outbox_key_turns": "counter", "outbox_inbox_duplicates": "counter", "outbox_events_waiting": "gauge", "outbox_keys_waiting": "gauge",
        "outbox_keys_dead_lettered": "gauge", "outbox_key_head_seconds": "gauge",
        "outbox_up": "gauge", "outbox_scrape_duration_seconds": "gauge",
    }
    assert {name: f.type for name, f in families.items()} == expected
    assert all(f.documentation for f in families.values())
    unlabelled = [s for f in families.values() for s in f.samples if s.labels.get("database") != "postgres"]
    assert unlabelled == []
    assert [(s.name, s.value) for s in families["outbox_up"].samples] == [("outbox_up", 1)]
    # The two families each host's scrape target adds itself, in its own
    # code, say the same.
    assert families["outbox_up"].documentation == "Whether the database answered the last scrape (1) or not (0)."
    assert families["outbox_scrape_duration_seconds"].documentation == "How long the last scrape of the database took."
    # Either broker may be behind them: the texts name "the broker", except
    # where only Redis applies (its Sentinel's master).
    assert [name for name, f in families.items()
            if "Redis" in f.documentation and name != "outbox_broker_master_changes"] == []
    for name in expected:
        assert re.search(rf"`{name}(_total)?[`{{]", METRICS_PAGE), f"{name} is not in docs/reference/metrics.md"
    # The text and the view agree.
    [dispatched] = families["outbox_dispatched"].samples
    assert dispatched.value == outbox.metric("outbox_dispatched_total")
    events = {s.labels["status"]: s.value for s in families["outbox_events"].samples}
    assert events == {"pending": 0, "processing": 0, "dispatched": 1, "processed": 0, "failed": 0}
    estimated = {s.labels["status"]: s.value for s in families["outbox_events_estimated"].samples}
    assert estimated == {"pending": 0, "processing": 0, "dispatched": 0, "processed": 0, "failed": 0}


def test_the_alert_rules_read_what_the_host_serves(outbox, tmp_path):
    """promtool on a scrape of the host (the exporter over the library, or
    the sidecar's /metrics): `promtool check metrics` finds nothing to
    say; served ten minutes, a healthy outbox fires no alert (not
    OutboxExporterDown, which a sidecar without outbox_up set off); its
    scrape target down three minutes, OutboxExporterDown fires."""
    outbox.sql("SELECT outbox_enqueue('m', '{}', queue => 'q_rules')")
    wait_until(lambda: outbox.count("dispatched") == 1, message="one dispatched")
    text = outbox.exposition()
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stdout + checked.stderr == "", checked.stdout + checked.stderr
    scrapes = 10 * 60 // INTERVAL
    served = Recording(INTERVAL, [text] * scrapes + [None] * (3 * 60 // INTERVAL),
                       {"served": 0, "target down": scrapes})
    promtool_on(served, tmp_path, {
        ("served", 9.75): {},
        ("target down", 2.75): {"OutboxExporterDown": [firing("OutboxExporterDown", "1", severity="critical")]},
    })


def test_a_scrape_writes_nothing_and_runs_in_a_parallel_query(outbox):
    """A scrape is a read: it takes no transaction id (each would be a
    commit record, and a step towards wraparound, per scrape), so the
    functions declared PARALLEL SAFE run in a parallel worker too."""
    with outbox.connect(autocommit=False) as conn:
        for query in QUERIES:
            conn.execute(query).fetchall()
            assert conn.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0] is None, query
        conn.rollback()
    setting = "force_parallel_mode" if outbox.value("SHOW server_version_num") < "160000" else "debug_parallel_query"
    with outbox.connect() as conn:
        conn.execute(f"SET {setting} = on")
        for query in ("SELECT count(*) FROM outbox.metrics", "SELECT length(outbox_metrics_prometheus())",
                      "SELECT count(*) FROM outbox.workers"):
            plan = "\n".join(r[0] for r in conn.execute(f"EXPLAIN {query}"))
            assert "Gather" in plan, plan
            assert conn.execute(query).fetchone()[0] > 0, query


def test_a_scrape_is_not_compiled_whatever_the_session_allows(outbox):
    """outbox.status's estimated cost passes jit_above_cost once the cursor
    is bloated, and compiling it cost 200-300 ms of a 10 ms scrape: the
    scrape functions run with JIT off, whatever the caller set."""
    for function in ("outbox_metrics", "outbox_metrics_prometheus"):
        config = outbox.value("SELECT proconfig FROM pg_proc WHERE proname = %s", (function,))
        assert "jit=off" in config, (function, config)
    with outbox.connect() as conn:
        conn.execute("SET jit = on")
        conn.execute("SET jit_above_cost = 0")
        assert conn.execute("SELECT length(outbox_metrics_prometheus())").fetchone()[0] > 0
        assert conn.execute("SHOW jit").fetchone()[0] == "on", "the caller's setting is restored"


def test_workers_view_describes_each_dispatcher(outbox):
    outbox.wait_idle()
    row = outbox.sql("SELECT worker, pid, state, connected, started_at <= now(), "
                     "last_heartbeat IS NOT NULL, last_error, events_dispatched >= 0 FROM outbox.workers")
    assert row == [(0, outbox.dispatcher_pids()[0], "idle", True, True, True, None, True)]
    outbox.configure(enabled="off")
    wait_until(lambda: outbox.value("SELECT state FROM outbox.workers") == "paused", message="paused")
    assert "outbox_dispatcher_starting worker=0" in outbox.log_text()


def test_lag_grows_while_paused_and_falls_to_zero_after(outbox):
    outbox.configure(enabled="off")
    wait_until(lambda: outbox.value("SELECT state FROM outbox.workers") == "paused", message="paused")
    outbox.sql("SELECT outbox_enqueue('m', '{}', queue => 'q_lag')")
    lag = lambda: outbox.value(  # noqa: E731
        "SELECT extract(epoch FROM lag) FROM outbox.status WHERE status = 'pending'")
    first = lag()
    time.sleep(1.5)
    assert lag() >= float(first) + 1
    assert outbox.metric("outbox_lag_seconds") >= 1
    outbox.configure(enabled="on")
    wait_until(lambda: lag() == 0, message="the lag back to zero")
    assert outbox.metric("outbox_lag_seconds") == 0


def buffers(conn, query):
    """Shared buffers a query touched, functions it calls included, on a
    connection that has run it once (an exporter's connection lives on:
    reading the catalogs into a new backend's caches is paid once, not per
    scrape)."""
    conn.execute(query).fetchall()
    plan = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query}").fetchone()[0][0]["Plan"]
    return plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]


def costly_statements(conn, query):
    """The plans, with their buffers, of the statements `query` runs that
    touch more than 1000 buffers (auto_explain, loaded for `conn` alone):
    what a failure of the flat-cost check shows."""
    plans = []
    conn.add_notice_handler(lambda notice: plans.append(notice.message_primary))
    conn.execute("LOAD 'auto_explain'")
    conn.execute("SET auto_explain.log_min_duration = 0; SET auto_explain.log_nested_statements = on; "
                 "SET auto_explain.log_analyze = on; SET auto_explain.log_buffers = on; "
                 "SET auto_explain.log_level = notice")
    conn.execute(query).fetchall()
    return [p for p in plans if any(int(n) > 1000 for n in re.findall(r"shared hit=(\d+)", p))]


def sent(pg, event_type, count, processed=False):
    """Sends `count` events of `event_type` and waits until they are (all
    but the ten delayed ones sent); with
    `processed`, records them reported processed and their batches
    settled a day ago (as retention sees them)."""
    pg.sql("SELECT outbox_enqueue(%s, '{}', queue => 'q_flat_sent') FROM generate_series(1, %s)",
           (event_type, count))
    wait_until(lambda: pg.sql("SELECT status::text, count FROM outbox.status "
                              "WHERE status IN ('pending', 'processing')") == [("pending", 10), ("processing", 0)],
               timeout=120, message=f"{count} events sent")
    if processed:
        pg.sql("SELECT outbox.record_outcomes(array_agg(batch), array_agg(generation), array_agg(id), "
               "array_agg(now() - interval '1 day')) "
               "FROM outbox.events JOIN outbox.log USING (id) WHERE events.event_type = %s", (event_type,))
        pg.sql("UPDATE outbox.batches SET marked_at = now() - interval '1 day', settled_at = now() - interval '1 day' "
               "WHERE id IN (SELECT batch FROM outbox.events WHERE event_type = %s)", (event_type,))


def estimates(pg):
    return {r[0]: r[1] for r in pg.sql("SELECT status::text, count FROM outbox.status WHERE estimated")}


def test_status_is_exact_while_counting_is_cheap_and_costs_the_same_beyond(outbox):
    """Finished events are counted through their partial indexes up to 1000,
    then estimated from statistics: a scrape over 250,000 finished events
    touches no more than 3 times the buffers of one over 1,000 (and a
    fifth of the table). The other counts stay exact; the estimates
    follow purges (after the vacuum that records them) and restarts."""
    # Ten events pending (delayed), 1000 reported processed a day ago, 999
    # dispatched now: sent for real, their outcomes and times written here.
    outbox.sql("SELECT outbox_enqueue('e', '{}', queue => 'q_flat', delay => '1 day') FROM generate_series(1, 10)")
    sent(outbox, "p", 1000, processed=True)
    sent(outbox, "d", 999)
    outbox.sql("VACUUM ANALYZE outbox.log, outbox.batches, outbox.outcomes")
    assert outbox.sql("SELECT status::text, count, estimated FROM outbox.status") == [
        ("pending", 10, False), ("processing", 0, False), ("dispatched", 999, False), ("processed", 1000, False),
        ("failed", 0, False)]
    with outbox.connect() as conn:
        small = {q: buffers(conn, q) for q in QUERIES}
    sent(outbox, "p_many", 200000, processed=True)
    sent(outbox, "d_many", 50000)
    outbox.sql("VACUUM ANALYZE outbox.log, outbox.batches, outbox.outcomes")
    table_pages = outbox.value("SELECT sum(pg_relation_size(relid)) / current_setting('block_size')::int "
                               "FROM pg_partition_tree('outbox.log')")
    with outbox.connect() as conn:
        for query in QUERIES:
            touched = buffers(conn, query)
            assert touched <= 3 * small[query] and touched < table_pages / 5, \
                (query, small[query], touched, costly_statements(conn, query))

    exact = {r[0]: r[1] for r in outbox.sql("SELECT status::text, count FROM outbox.status WHERE NOT estimated")}
    assert exact == {"pending": 10, "processing": 0, "failed": 0}
    rough = estimates(outbox)
    assert abs(rough["processed"] - 201000) < 10000 and abs(rough["dispatched"] - 51000) < 2500, rough
    scraped = {f.name: {s.labels["status"]: s.value for s in f.samples} for f in text_string_to_metric_families(
        outbox.value("SELECT outbox_metrics_prometheus()")) if f.name in ("outbox_events", "outbox_events_estimated")}
    assert scraped["outbox_events_estimated"] == {"pending": 0, "processing": 0, "dispatched": 1, "processed": 1,
                                                  "failed": 0}
    assert {k: scraped["outbox_events"][k] for k in rough} == {k: float(v) for k, v in rough.items()}

    # A truncation (the generations' times moved back: due at once), then
    # the vacuum that records it: counted again.
    outbox.configure(retention="1h", lifecycle_interval="1s")
    # Only the ten delayed ones left. (Counted in the table, not by status:
    # reading the status of 250,000 events takes seconds.)
    wait_until(lambda: outbox.age_generations() or outbox.sql(
        "SELECT (SELECT count(*) FROM outbox.log), (SELECT count(*) FROM outbox.batches)") == [(10, 0)],
        timeout=120, message="the events truncated, their batches gone")
    outbox.restore_generation_times()
    outbox.sql("VACUUM ANALYZE outbox.log")
    assert outbox.sql("SELECT count, estimated FROM outbox.status WHERE status = 'processed'") == [(0, False)]
    # A restart keeps both kinds.
    before = outbox.sql("SELECT status, count, estimated FROM outbox.status")
    outbox.restart()
    assert outbox.sql("SELECT status, count, estimated FROM outbox.status") == before


QUERIES = ("TABLE outbox.status", "TABLE outbox.metrics", "SELECT outbox_metrics_prometheus()")


def test_the_processed_estimate_counts_events_whatever_rows_hold_them(outbox):
    """Beyond 1000, processed is estimated from the statistics. A round of
    reports records up to 100 events a row, an acknowledgement one: the
    estimate counts events, whatever the mix of rows."""
    outbox.sql("INSERT INTO outbox.outcomes (batch, events) "
               "SELECT g, ARRAY(SELECT gen_random_uuid() FROM generate_series(1, 100) WHERE g > 0) "
               "FROM generate_series(1, 202) AS g")
    outbox.sql("INSERT INTO outbox.outcomes (batch, events) "
               "SELECT 1000 + g, ARRAY[gen_random_uuid()] FROM generate_series(1, 50000) AS g")
    outbox.sql("VACUUM ANALYZE outbox.outcomes")
    [(count, estimated)] = outbox.sql("SELECT count, estimated FROM outbox.status WHERE status = 'processed'")
    assert estimated and 0.8 < count / 70200 < 1.25, count


def test_a_long_transaction_and_the_dead_rows_it_keeps_show_in_the_metrics(outbox):
    assert outbox.metric("outbox_oldest_transaction_seconds") < 5
    with outbox.connect(autocommit=False) as pin:
        # Idle in a transaction with an xid: no snapshot held, still pinning.
        pin.execute("SELECT pg_current_xact_id()")
        time.sleep(2)
        assert outbox.metric("outbox_oldest_transaction_seconds") >= 2
        outbox.sql("SELECT outbox_enqueue('m', '{}', queue => 'q_dead') FROM generate_series(1, 100)")
        wait_until(lambda: outbox.count("dispatched") == 100, message="the events dispatched")
        outbox.sql("VACUUM outbox.log")
        # Sent without a write to the events: nothing dead.
        assert outbox.metric("outbox_events_dead_tuples") == 0
        # Deleted: dead versions, which vacuum keeps.
        outbox.sql("DELETE FROM outbox.log WHERE queue = 'q_dead'")
        outbox.sql("VACUUM outbox.log")
        wait_until(lambda: outbox.metric("outbox_events_dead_tuples") >= 100, message="the dead rows counted")
    with outbox.connect() as conn:
        conn.execute("BEGIN")
        conn.execute("SELECT outbox_enqueue('m', '{}', queue => 'q_dead')")
        conn.execute("PREPARE TRANSACTION 'outbox_metrics_old'")
    try:
        time.sleep(2)
        assert outbox.metric("outbox_oldest_transaction_seconds") >= 2
    finally:
        outbox.sql("ROLLBACK PREPARED 'outbox_metrics_old'")
    assert outbox.metric("outbox_oldest_transaction_seconds") < 2


def test_status_does_not_walk_what_a_window_still_open_has_read(outbox):
    """A window stays open after a claim that read a full page: its
    position is at the last event read, and the status counts what lies
    beyond it, not what lies before (CI once measured 508,648 buffers for
    a scrape over 200,000 events of one transaction so read)."""
    outbox.configure(enabled="off")
    wait_until(lambda: outbox.value("SELECT bool_and(state = 'paused') FROM outbox.workers"), message="paused")
    outbox.sql("SELECT outbox_enqueue('read', '{}', queue => 'q_open') FROM generate_series(1, 5000)")
    outbox.sql("ANALYZE outbox.log")
    with outbox.connect(autocommit=False) as conn:
        outbox.prepare_claim(conn)
        for _ in range(5):
            outbox.take_turn(conn)
            assert len(conn.execute("EXECUTE claim(1000, 99)").fetchall()) == 1000
            conn.commit()
    assert outbox.value("SELECT target IS NOT NULL FROM outbox.cursor"), "the window is still open"
    assert outbox.sql("SELECT count FROM outbox.status WHERE status = 'pending'") == [(0,)]
    outbox.sql("SELECT outbox_enqueue('later', '{}', queue => 'q_open')")
    assert outbox.sql("SELECT count FROM outbox.status WHERE status = 'pending'") == [(1,)]
    with outbox.connect() as conn:
        # A walk of the 5,000 read would cost thousands; what earlier tests
        # left in the shared cluster (batches, outcomes) some hundreds.
        assert buffers(conn, "TABLE outbox.status") < 400
