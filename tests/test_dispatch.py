"""The core path: committed events become Celery tasks in Redis, executed by
a stock Celery worker; rolled-back ones never leave the database."""

import json
import os
import re
import signal
import time
from pathlib import Path

import psycopg
import pytest

from harness import DISPATCHER_PLANNER, Cluster, decode, drain_held, queued_ids, wait_until
from standalone import library_only, new_cluster

ROOT = Path(__file__).resolve().parent.parent


def statuses(pg):
    """Exact counts per status (outbox.status estimates the finished ones)."""
    return {status: pg.count(status) for status in ("pending", "processing", "dispatched", "processed", "failed")}


def test_celery_worker_executes_committed_events(outbox, redis_server, celery_worker):
    with outbox.connect(autocommit=False) as conn:
        ids = [
            str(conn.execute("SELECT outbox_enqueue('tests.record', %s::jsonb, headers => %s::jsonb)",
                             (json.dumps({"job_id": n}), json.dumps({"traceparent": f"00-{n}"}))).fetchone()[0])
            for n in range(3)
        ]
        conn.commit()

    client = redis_server.client()
    wait_until(lambda: client.hlen("executed") == 3, timeout=60, message="Celery to run 3 tasks")
    for n, event_id in enumerate(ids):
        received = json.loads(client.hget("executed", event_id))  # task id == event id
        assert received["kwargs"] == {"job_id": n}
        assert received["args"] == []
        assert received["event_type"] == "tests.record"
        assert received["traceparent"] == f"00-{n}"
    wait_until(lambda: statuses(outbox)["dispatched"] == 3, message="rows marked dispatched")


def test_rolled_back_events_never_reach_redis(outbox, redis_server):
    client = redis_server.client()
    with outbox.connect(autocommit=False) as conn:
        doomed = conn.execute("SELECT outbox_enqueue('doomed', '{}', queue => 'q_rollback')").fetchone()[0]
        conn.rollback()
    with outbox.connect(autocommit=False) as conn:
        conn.execute("SAVEPOINT s")
        in_savepoint = conn.execute("SELECT outbox_enqueue('doomed', '{}', queue => 'q_rollback')").fetchone()[0]
        conn.execute("ROLLBACK TO SAVEPOINT s")
        kept = conn.execute("SELECT outbox_enqueue('kept', '{}', queue => 'q_rollback')").fetchone()[0]
        conn.commit()

    wait_until(lambda: queued_ids(client, "q_rollback"), message="the committed event")
    # The committed event arrived after the rolled-back ones would have.
    assert queued_ids(client, "q_rollback") == [str(kept)]
    assert str(doomed) not in queued_ids(client, "q_rollback")
    assert str(in_savepoint) not in queued_ids(client, "q_rollback")
    assert outbox.value("SELECT count(*) FROM outbox.events") == 1


def test_orm_insert_is_dispatched(outbox, redis_server):
    event_id = outbox.value(
        "INSERT INTO outbox.events (event_type, payload, queue) "
        "VALUES ('orders.created', '[1, 2]', 'q_orm') RETURNING id")
    client = redis_server.client()
    wait_until(lambda: client.llen("q_orm") == 1, message="the ORM-inserted event")
    envelope, body = decode(client.lindex("q_orm", 0))
    assert envelope["headers"]["id"] == str(event_id)
    assert envelope["headers"]["task"] == "orders.created"  # task defaults to event_type
    assert body[0] == [1, 2] and body[1] == {}
    # UUIDv7: the version nibble says 7.
    assert str(event_id)[14] == "7"


COMMIT_WAKE = "the wake at commit is the library's; the sidecar polls, or LISTENs with outbox.notify = on " \
    "(tests/test_sidecar.py)"


@library_only(COMMIT_WAKE)
def test_commit_wakes_an_idle_dispatcher(outbox, redis_server):
    """With a 60 s safety poll, only the commit-time wake can deliver within
    the deadline."""
    outbox.configure(poll_interval="60s")
    wait_until(lambda: outbox.value("SELECT bool_and(state = 'idle') FROM outbox.workers"),
               message="idle dispatchers")
    client = redis_server.client()
    with outbox.connect(autocommit=False) as conn:
        event_id = conn.execute("SELECT outbox_enqueue('woken', '{}', queue => 'q_wake')").fetchone()[0]
        conn.commit()
    wait_until(lambda: queued_ids(client, "q_wake") == [str(event_id)], timeout=10,
               message="the event within 10 s of COMMIT")


def claims(pg):
    """Claims made so far: each writes its position (outbox.positions)."""
    return pg.value("SELECT n_tup_ins FROM pg_stat_all_tables WHERE relid = 'outbox.positions'::regclass")


def test_an_idle_dispatcher_claims_nothing_between_wakes(outbox, redis_server):
    """Reports on, a dispatcher looks at the report list ten times a second;
    only a wake, the poll or housekeeping makes it claim, not those looks:
    an empty claim writes a position and takes a transaction id."""
    outbox.configure(poll_interval="60s")
    wait_until(lambda: outbox.value("SELECT bool_and(state = 'idle') FROM outbox.workers"),
               message="idle dispatchers")
    time.sleep(1)
    before, xid_before = claims(outbox), outbox.value("SELECT pg_current_xact_id()::text::bigint")
    time.sleep(3)
    assert claims(outbox) - before <= 1, "claims while idle"
    # This statement's own id, the housekeeping's (a key sweep every 10 s,
    # the sweepers if they fall due): a few, where a claim at each look
    # took thirty.
    assert outbox.value("SELECT pg_current_xact_id()::text::bigint") - xid_before <= 8
    ids = [str(r[0]) for r in outbox.sql(
        "SELECT outbox_enqueue('idle.woken', '{}', queue => 'q_idle') FROM generate_series(1, 2)")]
    wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_idle")) == sorted(ids), timeout=10,
               message="a commit still claimed at once")


def test_a_stream_of_commits_is_claimed_together_after_its_first(outbox, redis_server):
    """`outbox.linger`: the first commit after a quiet spell is claimed at
    once; the ones that follow it within the linger wait for its end and go
    in one claim, not one each."""
    outbox.configure(linger="1s", poll_interval="60s")
    client = redis_server.client()
    outbox.wait_idle()
    time.sleep(1.5)  # longer than the linger: any claim before is a quiet spell ago
    with outbox.connect() as conn:
        ids = [str(conn.execute("SELECT outbox_enqueue('streamed', '{}', queue => 'q_stream')").fetchone()[0])
               for _ in range(20)]
    wait_until(lambda: sorted(queued_ids(client, "q_stream")) == sorted(ids), timeout=30,
               message="the 20 events")
    batches = outbox.sql("SELECT events, claimed_at - (SELECT min(created_at) FROM outbox.events) "
                         "FROM outbox.batches ORDER BY id")
    assert len(batches) <= 3, f"a claim per commit or so: {batches}"
    assert batches[0][1].total_seconds() < 0.9, f"the first commit waited for the linger: {batches}"


def test_a_lingering_dispatcher_stops_at_sigterm_and_loses_nothing(outbox, redis_server):
    """A SIGTERM while a dispatcher lingers after a push ends it within
    seconds (the linger returns, the drain records its push, the loop
    exits); every event reaches Redis, from it or from the one started
    again."""
    outbox.configure(linger="1s")
    client = redis_server.client()
    outbox.wait_idle()
    pid = outbox.dispatcher_pids()[0]
    with outbox.connect() as conn:
        ids = [str(conn.execute("SELECT outbox_enqueue('lingered', '{}', queue => 'q_linger')").fetchone()[0])
               for _ in range(3)]
    wait_until(lambda: len(queued_ids(client, "q_linger")) >= 1, message="the first push")
    outbox.sql("SELECT pg_terminate_backend(%s)", (pid,))
    wait_until(lambda: pid not in outbox.dispatcher_pids(), timeout=5, message="the dispatcher gone")
    wait_until(lambda: set(queued_ids(client, "q_linger")) == set(ids), timeout=30,
               message="every event, by the dispatcher started again")


@library_only(COMMIT_WAKE)
def test_no_wake_is_lost_across_pauses_reloads_and_brief_locks(redis_server):
    """Pause, enqueue, resume while the table is briefly locked (the
    dispatchers' first claims wait on the lock, whose wait resets their
    latches), and again: each time, with a 60 s safety poll, the events
    go out within seconds."""
    pg = new_cluster(redis_server.url, workers=2, batch_size=1000, poll_interval="60s")
    client = redis_server.client()
    try:
        pg.install()
        wait_until(lambda: pg.value("SELECT count(*) FROM outbox.workers WHERE state = 'idle'") == 2,
                   timeout=60, message="two idle dispatchers")
        for cycle in range(10):
            queue = f"q_wake_cycle_{cycle}"
            pg.configure(enabled="off")
            wait_until(lambda: pg.value("SELECT bool_and(state = 'paused') FROM outbox.workers"),
                       message="paused dispatchers")
            pg.sql("SELECT outbox_enqueue('cycle', '{}', queue => %s) FROM generate_series(1, 3000)", (queue,))
            with pg.connect(autocommit=False) as locker:
                locker.execute("LOCK TABLE outbox.log IN ACCESS EXCLUSIVE MODE")
                pg.configure(enabled="on")
                time.sleep(0.1 + 0.1 * (cycle % 4))
                # A commit while they wait on the lock: its wake must count.
                with pg.connect() as producer:
                    producer.execute("SET lock_timeout = '50ms'")
                    with pytest.raises(psycopg.errors.LockNotAvailable):
                        producer.execute("SELECT outbox_enqueue('cycle', '{}', queue => %s)", (queue,))
                locker.commit()
            pg.sql("SELECT outbox_enqueue('cycle', '{}', queue => %s)", (queue,))
            wait_until(lambda: client.llen(queue) == 3001, timeout=20,
                       message=f"cycle {cycle}: every event well before the 60 s poll "
                               f"({client.llen(queue)} of 3001; {pg.sql('TABLE outbox.workers')})")
    finally:
        pg.close()


LAUNCHER_COUNT = "the launcher and its count of reloads are the library's"


def reload_by_launcher_alone(pg, **settings):
    """`outbox.*` settings with ALTER SYSTEM, then a SIGHUP to the launcher
    alone: a reload every dispatcher missed, as one starting when it came
    misses it, which they follow through the launcher's count."""
    with pg.connect() as conn:
        for name, value in settings.items():
            conn.execute(f"ALTER SYSTEM SET outbox.{name} = '{value}'")
    os.kill(pg.value("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox launcher'"), signal.SIGHUP)


@library_only(LAUNCHER_COUNT)
def test_a_reload_a_dispatcher_missed_reaches_it_through_the_launchers_count(redis_server):
    """PostgreSQL drops a SIGHUP that comes while it starts a background
    worker, so a dispatcher forked just before a reload would keep the
    settings from before it. The launcher counts the reloads it does, and a
    dispatcher behind the count reads the files again. Shown here with a
    SIGHUP to the launcher alone, which no dispatcher gets: within seconds,
    with a 60 s safety poll, they follow it."""
    pg = new_cluster(redis_server.url, workers=2, poll_interval="60s")
    try:
        pg.install()
        wait_until(lambda: pg.value("SELECT count(*) FROM outbox.workers WHERE state = 'idle'") == 2,
                   timeout=60, message="two idle dispatchers")
        reload_by_launcher_alone(pg, enabled="off")
        wait_until(lambda: pg.value("SELECT bool_and(state = 'paused') FROM outbox.workers"), timeout=20,
                   message="the dispatchers paused by the reload only the launcher was sent",
                   seen=lambda: pg.sql("SELECT worker, state FROM outbox.workers"))
    finally:
        pg.close()


@library_only(LAUNCHER_COUNT)
def test_a_dispatcher_started_after_a_reload_reads_no_edit_that_was_not_reloaded(redis_server):
    """A dispatcher holds the configuration as of the launcher's count
    when it was registered: one started after the last reload follows no
    edit made since, as PostgreSQL's own processes do not."""
    pg = new_cluster(redis_server.url, workers=2, poll_interval="60s")
    try:
        pg.install()
        wait_until(lambda: pg.value("SELECT count(*) FROM outbox.workers WHERE state = 'idle'") == 2,
                   timeout=60, message="two idle dispatchers")
        # A reload the launcher has surely counted: it acts on it.
        pg.configure(workers=3)
        wait_until(lambda: pg.value("SELECT count(*) FROM outbox.workers WHERE state = 'idle'") == 3,
                   timeout=60, message="three idle dispatchers")
        with pg.connect() as conn:
            conn.execute("ALTER SYSTEM SET outbox.enabled = off")
        pid = pg.value("SELECT pid FROM outbox.workers WHERE worker = 1")
        pg.sql("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(lambda: pg.value("SELECT pid FROM outbox.workers WHERE worker = 1 AND state = 'idle'")
                   not in (None, pid), timeout=30, message="dispatcher 1 started again",
                   seen=lambda: pg.sql("SELECT worker, pid, state FROM outbox.workers"))
        time.sleep(1)
        assert pg.value("SELECT state FROM outbox.workers WHERE worker = 1") == "idle"
    finally:
        pg.close()


@pytest.mark.parametrize("reload", ["sent to all", pytest.param("counted by the launcher",
                                                                 marks=library_only(LAUNCHER_COUNT))])
def test_a_reload_during_a_push_takes_effect_before_the_backlog_is_drained(redis_server, reload):
    """A reload that comes while a push waits on Redis is performed there;
    the drain then stops to apply it, as it stops for one it sees. So too
    for a reload the dispatcher missed and the launcher counted."""
    pg = new_cluster(redis_server.url, batch_size=500, broker_timeout="10s")
    client = redis_server.client()
    try:
        pg.install()
        pg.wait_idle()
        pg.configure(enabled="off")
        wait_until(lambda: pg.value("SELECT state FROM outbox.workers") == "paused", message="paused")
        pg.sql("SELECT outbox_enqueue('backlog', '{}', queue => 'q_backlog') FROM generate_series(1, 60000)")
        # Redis paused while a pushed batch's mark waits: the next push waits on it.
        with drain_held(pg, until=lambda: client.llen("q_backlog") > 0, begin=lambda: pg.configure(enabled="on")):
            client.execute_command("CLIENT", "PAUSE", 2000, "WRITE")
        if reload == "sent to all":
            pg.configure(enabled="off")
        else:
            reload_by_launcher_alone(pg, enabled="off")
        wait_until(lambda: pg.value("SELECT state FROM outbox.workers") == "paused", timeout=10,
                   message="paused once the push held up by Redis ends")
        sent = client.llen("q_backlog")
        time.sleep(1)
        assert client.llen("q_backlog") == sent < 60000, "the drain went on after the reload"
    finally:
        pg.close()


def test_delayed_event_waits_for_available_at(outbox, redis_server):
    client = redis_server.client()
    event_id = outbox.value("SELECT outbox_enqueue('later', '{}', queue => 'q_delay', delay => '3 seconds')")
    assert client.llen("q_delay") == 0
    status, due = outbox.sql("SELECT status::text, available_at > now() FROM outbox.events")[0]
    assert status == "pending" and due
    wait_until(lambda: client.llen("q_delay") == 1, timeout=30, message="the delayed event")
    assert queued_ids(client, "q_delay") == [str(event_id)]
    # Pushed no earlier than it was due: the mark, which follows the push
    # (and may not have happened yet), is no earlier either.
    wait_until(lambda: outbox.count("dispatched") == 1, message="the mark")
    assert outbox.value("SELECT b.marked_at >= e.available_at FROM outbox.events AS e "
                        "JOIN outbox.batches AS b ON b.id = e.batch")


def test_priority_selects_the_kombu_list(outbox, redis_server):
    outbox.sql("SELECT outbox_enqueue('urgent', '{}', queue => 'q_prio', priority => 0)")
    outbox.sql("SELECT outbox_enqueue('relaxed', '{}', queue => 'q_prio', priority => 7)")
    client = redis_server.client()
    wait_until(lambda: client.llen("q_prio") == 1 and client.llen("q_prio\x06\x166") == 1,
               message="one message per priority list")
    envelope, _ = decode(client.lindex("q_prio\x06\x166", 0))
    assert envelope["properties"]["priority"] == 7


BAD_INPUTS = [
    ("SELECT outbox_enqueue(NULL, '{}')", "event_type must not be null or empty"),
    ("SELECT outbox_enqueue('', '{}')", "event_type must not be null or empty"),
    ("SELECT outbox_enqueue(repeat('e', 256), '{}')", "event_type is 256 bytes, the limit is 255 bytes"),
    ("SELECT outbox_enqueue('e', '{}', queue => repeat('q', 300))", "queue is 300 bytes, it must be 1 to 255 bytes"),
    ("SELECT outbox_enqueue('e', '{}', queue => '')", "queue is 0 bytes, it must be 1 to 255 bytes"),
    ("SELECT outbox_enqueue('e', '{}', task => repeat('t', 256))", "task is 256 bytes, it must be 1 to 255 bytes"),
    ("SELECT outbox_enqueue('e', NULL)", "payload must not be null"),
    ("SELECT outbox_enqueue('e', jsonb_build_object('x', repeat('p', 2000)))",
     "payload is 2017 bytes as jsonb, over outbox.max_payload_bytes (1024 bytes)"),
    ("SELECT outbox_enqueue('e', '{}', headers => '[1]')", "headers must be a JSON object, not array"),
    ("SELECT outbox_enqueue('e', '{}', delay => '-1 minute')",
     "delay must be finite and not negative (got -00:01:00)"),
    ("SELECT outbox_enqueue('e', '{}', priority => 10)", "priority is 10, it must be 0 (highest) to 9"),
]


@pytest.mark.parametrize("query,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_refused_with_a_clear_error(outbox, query, message):
    with outbox.connect(autocommit=False) as conn:
        outbox.set_in(conn, max_payload_bytes="1kB")
        conn.execute("SELECT outbox_enqueue('fine', '{}', queue => 'q_bad')")
        with pytest.raises(psycopg.Error) as err:
            conn.execute(query)
        conn.rollback()
    assert f"outbox_enqueue: {message}" in str(err.value)
    assert outbox.value("SELECT count(*) FROM outbox.events") == 0


def test_orm_insert_is_checked_by_constraints(outbox):
    with pytest.raises(psycopg.errors.CheckViolation, match="events_event_type_length"):
        outbox.sql("INSERT INTO outbox.events (event_type) VALUES ('')")
    with pytest.raises(psycopg.errors.CheckViolation, match="events_headers_object"):
        outbox.sql("INSERT INTO outbox.events (event_type, headers) VALUES ('e', '\"x\"')")
    assert outbox.value("SELECT count(*) FROM outbox.events") == 0


def test_status_view_lists_every_status(outbox):
    outbox.configure(enabled="off")
    wait_until(lambda: outbox.value("SELECT bool_and(state = 'paused') FROM outbox.workers"),
               message="paused dispatchers")
    outbox.sql("SELECT outbox_enqueue('e', '{}', queue => 'q_status') FROM generate_series(1, 4)")
    rows = {r[0]: r[1:] for r in outbox.sql("SELECT status::text, count, oldest_created_at IS NOT NULL, lag FROM outbox.status")}
    assert set(rows) == {"pending", "processing", "dispatched", "processed", "failed"}
    assert rows["pending"][:2] == (4, True)
    assert rows["processing"][:2] == (0, False) and rows["dispatched"][2] is None


LAST = "ffffffff-ffff-ffff-ffff-ffffffffffff"
# outbox.log's partitions, one per generation: every read of the log reads
# each.
PARTITIONS = ("log_0", "log_1", "log_2")


def test_worker_queries_are_served_by_indexes(outbox):
    outbox.configure(enabled="off")
    outbox.sql("SELECT outbox_enqueue('e', '{}', queue => 'q_plan') FROM generate_series(1, 2000)")
    outbox.sql("ANALYZE outbox.log")
    worker = ROOT / "sql" / "worker"
    # The partition the events went to (an earlier test may have rotated).
    current = outbox.value("SELECT pg_sequence_last_value('outbox.generation')")
    pkey = f"log_{current}_pkey"
    # Per statement: its parameter types, sample arguments, and the indexes
    # its plan must use (each tuple: one of these).
    queries = {
        worker / "flush_batches.sql": ("(bigint, bigint[], bigint)", "(1048576, '{}', NULL)",
                                       [("batch_members_waiting_idx",)]),
        worker / "accumulating.sql": ("", "", []),
        worker / "home.sql": ("(oid, bool)", "(1, true)", []),
        worker / "fail_batch.sql": ("(bigint, text, bigint)", "(1, 'x', 1048576)", [("batch_members_waiting_idx",)]),
        worker / "lock_cursor.sql": ("", "", []),
        worker / "restore_turn.sql": ("", "", []),
        worker / "claim.sql": ("(int, int, bigint)", "(100, 0, 8388608)", [("_pending_xid_idx",)]),
        worker / "came_due.sql": ("(int, float8)", "(100, '-Infinity')", [("_due_idx",)]),
        worker / "next_due.sql": ("(bigint[], float8)", "('{}', '-Infinity')",
                                  [("_due_idx",), ("batch_members_waiting_idx",)]),
        worker / "due_bound.sql": ("", "", []),
        worker / "due_floor.sql": ("(float8, float8)", "('-Infinity', 1e10)", [("_due_idx",)]),
        worker / "in_line.sql": ("(float8)", "('-Infinity')", [("_due_idx",)]),
        worker / "mark_dispatched.sql": ("(bigint, int, bool)", "(1, 0, false)",
                                         [("batches_pkey",)]),
        worker / "mark_failed.sql": ("(uuid[], text[], text[], text[], float8[], bool[])",
                                     "(ARRAY[gen_random_uuid()], '{1}', '{failed}', '{x}', '{0}', '{true}')",
                                     [(pkey,)]),
        worker / "release.sql": ("(uuid[], text[])", "(ARRAY[gen_random_uuid()], '{1}')", [(pkey,)]),
        worker / "abandon.sql": ("(int, float8, int)", "(NULL, 1000, 10)", [("batches_unmarked_idx",)]),
        worker / "reline_abandoned.sql": ("(bigint[])", "('{1}')", [("batches_pkey",), (pkey,)]),
        worker / "sweep_strays.sql": ("(int)", "(100)", [("_pending_xid_idx",)]),
        worker / "settle_unacked.sql": ("(float8, int)", "(1000, 10)", [("batches_unacked_idx",)]),
        worker / "sweep_unacked.sql": ("(bigint[], int)", "('{1}', 5)", [("batches_pkey",)]),
        worker / "settle_reported.sql": ("(bigint[])", "('{1}')", [("batches_pkey", "batches_unsettled_idx")]),
        worker / "rotate.sql": ("(float8, int, bool)", "(1000, 10, true)", []),
        worker / "forget_batches.sql": ("(int)", "(10)", []),
        worker / "apply_reports.sql": ("(uuid[], uuid[], text[], text[])",
                                       "(ARRAY[gen_random_uuid()], ARRAY[gen_random_uuid()], '{processed}', '{NULL}')",
                                       [(pkey,)]),
        ROOT / "sql" / "ack.sql": ("(uuid, uuid)", "(gen_random_uuid(), NULL)", [(pkey,)]),
    }
    # The dispatcher's plans are cached: the generic plan too.
    for mode in ("auto", "force_generic_plan"):
        with outbox.connect() as conn:
            conn.execute("SET enable_seqscan = off")
            conn.execute(DISPATCHER_PLANNER)
            conn.execute(f"SET plan_cache_mode = {mode}")
            for path, (types, args, indexes) in queries.items():
                conn.execute(f"PREPARE q{types} AS {path.read_text()}")
                plan = "\n".join(r[0] for r in conn.execute(f"EXPLAIN EXECUTE q{args}"))
                conn.execute("DEALLOCATE q")
                for choices in indexes:
                    assert any(index in plan for index in choices), f"{path.name}, {mode}:\n{plan}"
                # outbox.all_subscriptions and outbox.claim_turn hold a handful
                # of rows: read whole.
                assert not re.search(r"Seq Scan on (log|batches|outcomes|batch_members|positions)", plan), \
                    f"{path.name}, {mode}:\n{plan}"
    # The claim reads the window's two ranges in each partition, each from
    # where it starts, merged in order: never a whole range sorted. (An
    # empty partition may be read by its primary key, in id order: as
    # cheap.)
    with outbox.connect() as conn:
        conn.execute(DISPATCHER_PLANNER)
        conn.execute("SET enable_seqscan = off")
        types, args, _ = queries[worker / "claim.sql"]
        conn.execute(f"PREPARE q{types} AS {(worker / 'claim.sql').read_text()}")
        for mode in ("auto", "force_generic_plan"):
            conn.execute(f"SET plan_cache_mode = {mode}")
            plan = "\n".join(r[0] for r in conn.execute(f"EXPLAIN EXECUTE q{args}"))
            assert all(len(re.findall(rf"Index (?:Only )?Scan using \w+ on {p} ", plan)) == 2 for p in PARTITIONS), plan
            assert plan.count(f"log_{current}_pending_xid_idx ") == 2, plan
            assert not re.search(r"(?<!Merge )Append", plan), plan
    # An event's batch: by the batches' last positions. A batch's events
    # (abandoned, swept, purged, reported): the window's two ranges, each
    # from where it starts.
    with outbox.connect() as conn:
        conn.execute("SET enable_seqscan = off")
        body = outbox.value("SELECT prosrc FROM pg_proc WHERE oid = 'outbox.batch_of'::regproc")
        plan = "\n".join(r[0] for r in conn.execute(
            f"EXPLAIN {body.replace('$1', chr(39) + '100' + chr(39) + '::xid8').replace('$2', chr(39) + LAST + chr(39) + '::uuid').replace('$3', 'false')}"))
        assert "batches_to_idx" in plan, plan
        body = outbox.value("SELECT prosrc FROM pg_proc WHERE oid = 'outbox.batch_members'::regproc")
        body = body.replace("batch_members.", "")
        for name, value in {"prev": "pg_current_snapshot()", "target": "pg_current_snapshot()",
                            "from_xid": "NULL::xid8", "from_id": "NULL::uuid", "to_xid": "'100'::xid8",
                            "to_id": f"'{LAST}'::uuid"}.items():
            body = re.sub(rf"(?<![.\w]){name}\b", value, body)
        plan = "\n".join(r[0] for r in conn.execute(f"EXPLAIN {body}"))
        assert all(plan.count(f"{p}_pending_xid_idx ") == 2 for p in PARTITIONS), plan
        # The rotation's look for what a generation still needs, and for the
        # batches left without events: index ranges, one partition.
        for function, args, indexes in (
                ("outbox.unfinished", {"$1": "1::smallint", "$2": "true"},
                 ("log_1_failed_idx", "log_1_key_state_idx", "log_1_due_idx", "log_1_pending_xid_idx",
                  "batches_unmarked_idx", "batches_unacked_idx")),
                ("outbox.forget_batches", {"$1": "10"}, ("batches_pkey",))):
            body = outbox.value("SELECT prosrc FROM pg_proc WHERE oid = %s::regproc", (function,))
            for name, value in args.items():
                body = body.replace(name, value)
            plan = "\n".join(r[0] for r in conn.execute(f"EXPLAIN {body}"))
            assert all(index in plan for index in indexes), plan
            assert not re.search(r"Seq Scan on (log|batches|outcomes)", plan), plan
            assert not re.search(r"on log_[02]", plan), plan


def due_entries_read(pg):
    """Entries the scans of events_due_idx (its partitions') have read."""
    return pg.value("SELECT sum(idx_tup_read)::bigint FROM pg_stat_user_indexes "
                    "WHERE schemaname = 'outbox' AND indexrelname LIKE '%due_idx'")


def test_claims_under_a_pinned_xmin_do_not_reread_the_events_that_came_due(outbox, redis_server):
    """A session idle in its transaction after an enqueue (as a request
    that enqueued, then waits on a call) holds its xmin while 3000 delayed
    events come due and go: their entries in events_due_idx stay, dead but
    not removable. The claims that follow start their scan of the index
    above them (sql/worker/due_bound.sql), not at its start: a claim per
    commit does not read 3000 entries each."""
    client = redis_server.client()
    with outbox.connect() as pin:
        pin.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        pin.execute("SELECT outbox_enqueue('pin', '{}', queue => 'q_pin')")
        outbox.sql("SELECT outbox_enqueue('later', '{}', queue => 'q_pinned', delay => '1 second') "
                   "FROM generate_series(1, 3000)")
        wait_until(lambda: outbox.count("dispatched") == 3000, timeout=60, message="the delayed events")
        # The dispatcher's floor is raised once a second.
        time.sleep(2)
        before = due_entries_read(outbox)
        for _ in range(20):
            outbox.sql("SELECT outbox_enqueue('now', '{}', queue => 'q_pinned')")
            time.sleep(0.1)
        wait_until(lambda: client.llen("q_pinned") == 3020, message="the events of the trickle")
        # Statistics are flushed at most once a second.
        time.sleep(2)
        read = due_entries_read(outbox) - before
        pin.execute("COMMIT")
    assert read < 3000, f"{read} entries read by the claims of 20 commits"


def test_a_delayed_event_written_by_a_transaction_older_than_the_floor_is_sent(outbox, redis_server):
    """A transaction that began before the dispatcher raised its floor and
    writes only later (and one that holds its lock across the raise)
    writes events out of line that fall due above the floor: each is
    sent when due."""
    client = redis_server.client()
    with outbox.connect() as late, outbox.connect() as held:
        late.execute("BEGIN")
        late.execute("SELECT now()")
        held.execute("BEGIN")
        held.execute("SELECT outbox_enqueue('held', '{}', queue => 'q_floor', delay => '100 milliseconds')")
        # Commits that wake the dispatcher, which raises its floor.
        for _ in range(3):
            outbox.sql("SELECT outbox_enqueue('now', '{}', queue => 'q_floor')")
            time.sleep(1.1)
        late.execute("INSERT INTO outbox.events (event_type, payload, queue, available_at) "
                     "VALUES ('late', '{}', 'q_floor', clock_timestamp() + interval '100 milliseconds')")
        late.execute("COMMIT")
        held.execute("COMMIT")
    wait_until(lambda: client.llen("q_floor") == 5, timeout=20, message="the late and the held events")


def test_a_claim_takes_what_its_bytes_allow_and_the_next_goes_on_in_order(outbox):
    """A claim stops after the event that brings its texts (payload, args,
    headers) past outbox.max_batch_bytes; the next claim goes on from
    there, in the same window: a page cut for its bytes does not end its
    window, whose later events would be taken as read. An event larger
    than the bound comes alone."""
    outbox.configure(enabled="off")
    wait_until(lambda: outbox.value("SELECT bool_and(state = 'paused') FROM outbox.workers"),
               message="the dispatchers paused")
    with outbox.connect(autocommit=False) as conn:
        # Each text is 998 bytes: {"p": "x…x"}.
        ids = [str(r[0]) for r in conn.execute(
            "SELECT outbox_enqueue('e', jsonb_build_object('p', repeat('x', 990)), queue => 'q_bytes') "
            "FROM generate_series(1, 5)")]
        conn.commit()
    # Enqueued in order, in one transaction: the page's order is the ids'.
    ids.sort()
    taken = []
    for bytes, expected in [(2500, 3), (2500, 2), (2500, 0)]:
        _, sends = outbox.claim_as(0, 100, bytes=bytes)
        assert len(sends) == expected, (bytes, sorted(sends))
        taken += sorted(sends)
    assert taken == ids
    with outbox.connect() as conn:
        big = str(conn.execute("SELECT outbox_enqueue('e', jsonb_build_object('p', repeat('x', 990)), "
                               "queue => 'q_bytes') FROM generate_series(1, 2)").fetchall()[0][0])
    batch, sends = outbox.claim_as(0, 100, bytes=10)
    assert list(sends) == [big]


def test_the_batch_of_a_long_transaction_s_event_is_found_without_walking_those_claimed_meanwhile(outbox,
                                                                                                    redis_server):
    """A transaction that stays open while 2,000 batches are claimed (one
    event each) has its events read by the window after it ends, on a page
    that goes on to later ones: finding their batch (the view, a report, an
    acknowledgement) reads that page, not every page claimed meanwhile,
    which the walk from its place in batches_to_idx passes first."""
    def pause():
        outbox.configure(enabled="off")
        wait_until(lambda: outbox.value("SELECT bool_and(state = 'paused') FROM outbox.workers"),
                   message="the dispatchers paused")

    pause()
    outbox.configure(enabled="on", batch_size=1)
    with outbox.connect() as long:
        long.execute("BEGIN")
        long.execute("SELECT outbox_enqueue('long', '{}', queue => 'q_long') FROM generate_series(1, 3)")
        outbox.sql("SELECT outbox_enqueue('short', '{}', queue => 'q_long') FROM generate_series(1, 2000)")
        wait_until(lambda: outbox.count("dispatched") == 2000, timeout=60, message="the short events")
        pause()
        long.execute("COMMIT")
    outbox.sql("SELECT outbox_enqueue('after', '{}', queue => 'q_long') FROM generate_series(1, 3)")
    outbox.configure(enabled="on", batch_size=100)
    wait_until(lambda: outbox.count("dispatched") == 2006, message="the long transaction's events")
    assert outbox.value("SELECT count(*) FROM outbox.batches") == 2001
    # As a dispatcher plans it (a round of reports), and as a session does
    # (the view, an acknowledgement).
    for planner in (DISPATCHER_PLANNER, "SELECT"):
        with outbox.connect() as conn:
            conn.execute(planner)
            plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                                "SELECT h.id FROM (SELECT * FROM outbox.log WHERE event_type = 'long' OFFSET 0) AS e, "
                                "outbox.held_by(e.pending_xid, e.id) AS h").fetchone()[0][0]["Plan"]
        lookups = plan["Plans"][1]
        assert lookups["Actual Rows"] == 1 and lookups["Actual Loops"] == 3, plan
        # A walk reads each of the 2,000 pages claimed meanwhile (about 700
        # buffers; about 90 here).
        assert lookups["Shared Hit Blocks"] + lookups["Shared Read Blocks"] < 3 * 60, (planner, plan)
    assert outbox.value("SELECT count(DISTINCT batch) FROM outbox.events WHERE event_type = 'long'") == 1


def test_a_batch_s_outcomes_are_read_once_not_once_per_event(outbox):
    """A batch of 2000 events, each acknowledged alone (an outcome row
    each): settling it, sending the unacknowledged ones again, putting an
    abandoned batch's events back, the rotation's look and the views read
    the batch's outcome rows once, not once per event (a lookup per event
    would compare each with all 2000 rows)."""
    outbox.configure(enabled="off")
    # The reload reaches the dispatchers a moment later: until they show it,
    # one could claim the events first.
    wait_until(lambda: outbox.value("SELECT bool_and(state = 'paused') FROM outbox.workers"),
               message="the dispatchers paused")
    ids = [r[0] for r in outbox.sql("SELECT outbox_enqueue('e', '{}', queue => 'q_many') FROM generate_series(1, 2000)")]
    batch, _ = outbox.claim_enqueued(0, ids)
    outbox.sql("UPDATE outbox.batches SET marked_at = now() - interval '1 day' WHERE id = %s", (batch,))
    outbox.sql("INSERT INTO outbox.outcomes (batch, generation, events) "
               "SELECT %s, l.generation, ARRAY[l.id] FROM outbox.log AS l", (batch,))
    outbox.sql("ANALYZE outbox.outcomes")
    worker = ROOT / "sql" / "worker"
    statements = {
        "settle_reported": f"EXECUTE q(ARRAY[{batch}]::bigint[])",
        "sweep_unacked": f"EXECUTE q(ARRAY[{batch}]::bigint[], 5)",
        "reline_abandoned": f"EXECUTE q(ARRAY[{batch}]::bigint[])",
    }
    types = {"settle_reported": "(bigint[])", "sweep_unacked": "(bigint[], int)", "reline_abandoned": "(bigint[])"}

    def compared(plan):
        """Rows the plan compared and threw away, in all its nodes: about
        the batch's size when each set is read once, its square when each
        event is looked up among all the rows."""
        def walk(node):
            return (node.get("Rows Removed by Join Filter", 0) + node.get("Rows Removed by Filter", 0)
                    + sum(walk(child) for child in node.get("Plans", [])))
        return walk(plan[0]["Plan"])

    with outbox.connect(autocommit=False) as conn:
        conn.execute(DISPATCHER_PLANNER)
        for name, execute in statements.items():
            conn.execute(f"PREPARE q{types[name]} AS {(worker / (name + '.sql')).read_text()}")
            plan = conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {execute}").fetchone()[0]
            conn.rollback()
            conn.execute("DEALLOCATE q")
            assert compared(plan) < 20000, (name, compared(plan))
        for query in ("SELECT * FROM outbox.status", "SELECT * FROM outbox.unfinished(%s::smallint, true)"
                      % outbox.value("SELECT pg_sequence_last_value('outbox.generation')")):
            plan = conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {query}").fetchone()[0]
            assert compared(plan) < 20000, (query, compared(plan))
        conn.rollback()


def test_two_dispatchers_deliver_10000_events_exactly_once(redis_server):
    pg = new_cluster(redis_server.url, workers=2, batch_size=100)
    try:
        pg.install()
        wait_until(lambda: pg.value("SELECT count(*) FROM outbox.workers WHERE pid IS NOT NULL") == 2,
                   message="two dispatchers")
        client = redis_server.client()
        client.delete("q_10k")
        with pg.connect(autocommit=False) as conn:
            for _ in range(100):
                conn.execute("SELECT outbox_enqueue('bulk', jsonb_build_object('n', n), queue => 'q_10k') "
                             "FROM generate_series(1, 100) n")
                conn.commit()
        wait_until(lambda: pg.value("SELECT count(*) FROM outbox.events WHERE status = 'dispatched'") == 10000,
                   timeout=180, message="10,000 dispatched rows")
        ids = queued_ids(client, "q_10k")
        assert len(ids) == 10000
        assert len(set(ids)) == 10000
        assert set(ids) == {str(r[0]) for r in pg.sql("SELECT id FROM outbox.events")}
        dispatched_by = pg.value("SELECT sum(events_dispatched) FROM outbox.workers")
        assert dispatched_by == 10000
    finally:
        pg.close()


def test_without_preloading_the_library_warns_and_does_not_crash(redis_server):
    pg = Cluster(redis_server.url, preload=False)
    try:
        with pg.connect() as conn:
            notices = []
            conn.add_notice_handler(lambda d: notices.append(d.message_primary))
            conn.execute("CREATE EXTENSION outbox_dispatch")
            assert any("loaded without shared_preload_libraries" in n for n in notices), notices
            conn.execute("SELECT outbox_enqueue('e', '{}')")
            assert conn.execute("SELECT count(*) FROM outbox.workers").fetchone()[0] == 0
        assert pg.value("SELECT count(*) FROM outbox.events WHERE status = 'pending'") == 1
    finally:
        pg.close()
