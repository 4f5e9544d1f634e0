"""Every database of the server (outbox.database = '*' or a list): one
launcher serves each database that has the extension with its own
dispatchers; CREATE/DROP EXTENSION start and stop them; DROP DATABASE,
a rename and a copy never fail or wait because of them; a user who may
not drop a database cannot stop its dispatchers by trying; worker slots
that run out are a warning and a row, never a silent database."""

import shutil
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from harness import CeleryWorker, Cluster, decode, queued_ids, wait_until
from outbox_dispatch import report

APPS = ("app_a", "app_b", "app_c")


def dispatchers(pg, database):
    """(worker, pid, state) of the dispatchers serving `database`."""
    return pg.sql("SELECT worker, pid, state FROM outbox.workers WHERE database = %s ORDER BY worker", (database,))


def connected(pg, database):
    """Dispatchers connected to `database`, as pg_stat_activity sees them."""
    return pg.value("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND backend_type = 'outbox dispatcher'",
                    (database,))


def serving(pg, database, workers=1):
    wait_until(lambda: [r[2] for r in dispatchers(pg, database)] == ["idle"] * workers, timeout=30,
               message=f"{workers} idle dispatchers in {database}",
               seen=lambda: pg.sql("SELECT database, worker, state, last_error FROM outbox.workers"))


def enqueue(pg, database, queue, n=1):
    return [str(r[0]) for r in pg.sql(
        f"SELECT outbox_enqueue('loop.ok', jsonb_build_object('n', i), queue => '{queue}') "
        f"FROM generate_series(1, {n}) AS i", dbname=database)]


@pytest.fixture(scope="module")
def server(redis_server):
    """A cluster serving '*', two dispatchers per database, with postgres
    (where the tests read outbox.workers), app_a, app_b and app_c created
    with the extension, and plain without it."""
    pg = Cluster(redis_server.url, database="*", workers=2, report_timeout="1h")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        for name in APPS:
            pg.sql(f"CREATE DATABASE {name}")
            pg.sql("CREATE EXTENSION outbox_dispatch", dbname=name)
        pg.sql("CREATE DATABASE plain")
        for name in APPS:
            serving(pg, name, workers=2)
        yield pg
    finally:
        pg.close()


def test_a_user_who_may_not_drop_a_database_cannot_stop_its_dispatchers(server):
    before = dispatchers(server, "app_a")
    server.sql("CREATE ROLE intruder LOGIN CREATEDB")
    try:
        with server.connect(user="intruder", dbname="app_b") as conn:
            for command in ("DROP DATABASE app_a", "ALTER DATABASE app_a RENAME TO mine",
                            "ALTER DATABASE app_a SET TABLESPACE pg_default",
                            "CREATE DATABASE stolen TEMPLATE app_a"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(command)
        assert dispatchers(server, "app_a") == before, "the dispatchers were stopped by a refused command"
    finally:
        server.sql("DROP ROLE intruder")


def test_an_owner_the_server_refuses_for_another_reason_cannot_stop_its_dispatchers(server):
    """The owner of a served database runs a command PostgreSQL refuses
    for a reason other than ownership (no CREATEDB for a rename or a copy,
    no CREATE on the target tablespace, a name taken) or runs as a no-op
    (a move to the tablespace it is in): the dispatchers are not stopped
    first."""
    location = Path(tempfile.mkdtemp(prefix="outbox-tablespace-"))
    shutil.chown(location, "postgres", "postgres")
    server.sql("CREATE ROLE owner_only LOGIN")
    server.sql(f"CREATE TABLESPACE elsewhere LOCATION '{location}'")
    server.sql("ALTER DATABASE app_a OWNER TO owner_only")
    before = dispatchers(server, "app_a")
    try:
        with server.connect(user="owner_only", dbname="app_b") as conn:
            for command, refusal in (
                    ("ALTER DATABASE app_a RENAME TO app_a_moved", psycopg.errors.InsufficientPrivilege),
                    ("CREATE DATABASE app_a_copy TEMPLATE app_a", psycopg.errors.InsufficientPrivilege),
                    ("ALTER DATABASE app_a SET TABLESPACE elsewhere", psycopg.errors.InsufficientPrivilege),
                    ("ALTER DATABASE app_a SET TABLESPACE pg_default", psycopg.errors.InsufficientPrivilege)):
                with pytest.raises(refusal):
                    conn.execute(command)
        server.sql("GRANT CREATE ON TABLESPACE pg_default TO owner_only")
        with server.connect(user="owner_only", dbname="app_b") as conn:
            conn.execute("ALTER DATABASE app_a SET TABLESPACE pg_default")  # where it is: a no-op
        server.sql("REVOKE CREATE ON TABLESPACE pg_default FROM owner_only")
        server.sql("ALTER ROLE owner_only CREATEDB")
        with server.connect(user="owner_only", dbname="app_b") as conn:
            for command in ("ALTER DATABASE app_a RENAME TO app_b", "CREATE DATABASE app_b TEMPLATE app_a"):
                with pytest.raises(psycopg.errors.DuplicateDatabase):
                    conn.execute(command)
        assert dispatchers(server, "app_a") == before, "the dispatchers were stopped before a refusal"
    finally:
        server.sql("ALTER DATABASE app_a OWNER TO postgres")
        server.sql("DROP TABLESPACE elsewhere")
        server.sql("DROP ROLE owner_only")
        shutil.rmtree(location, ignore_errors=True)


def dispatcher_pids(pg, database):
    return sorted(r[0] for r in pg.sql(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND backend_type = 'outbox dispatcher'", (database,)))


def test_commands_postgres_refuses_past_ownership_do_not_stop_the_dispatchers(server):
    """The owner of a served database, with CREATEDB and CREATE on a
    tablespace, runs commands PostgreSQL refuses for another reason before
    it looks for other sessions (options that do not go together, not at
    the top level, an owner it may not become, a bad strategy, an encoding
    the template has not, a subscription in the database): the dispatchers
    are not stopped first."""
    location = Path(tempfile.mkdtemp(prefix="outbox-tablespace-"))
    shutil.chown(location, "postgres", "postgres")
    server.sql("CREATE ROLE rt_owner LOGIN CREATEDB")
    server.sql(f"CREATE TABLESPACE rt_elsewhere LOCATION '{location}'")
    server.sql("GRANT CREATE ON TABLESPACE rt_elsewhere TO rt_owner")
    server.sql("ALTER DATABASE app_a OWNER TO rt_owner")
    commands = [
        "ALTER DATABASE app_a WITH TABLESPACE rt_elsewhere CONNECTION LIMIT 5",
        "DO $$ BEGIN EXECUTE 'ALTER DATABASE app_a SET TABLESPACE rt_elsewhere'; END $$",
        "DO $$ BEGIN EXECUTE 'DROP DATABASE app_a'; END $$",
        "CREATE DATABASE rt_copy TEMPLATE app_a OWNER postgres",
        "CREATE DATABASE rt_copy TEMPLATE app_a STRATEGY bogus",
        "CREATE DATABASE rt_copy TEMPLATE app_a ENCODING 'LATIN1'",
        "CREATE DATABASE rt_copy TEMPLATE app_a CONNECTION LIMIT -5",
        "DROP DATABASE app_a",  # with a subscription in it
    ]
    stopped = []
    try:
        for command in commands:
            if command == "DROP DATABASE app_a":
                server.sql("CREATE SUBSCRIPTION rt_sub CONNECTION 'dbname=nowhere' PUBLICATION p "
                           "WITH (connect = false, enabled = false, create_slot = false, slot_name = NONE)",
                           dbname="app_a")
            serving(server, "app_a", workers=2)
            before = dispatcher_pids(server, "app_a")
            with server.connect(user="rt_owner", dbname="app_b") as conn:
                with pytest.raises(psycopg.Error):
                    conn.execute(command)
            time.sleep(0.3)
            if dispatcher_pids(server, "app_a") != before:
                stopped.append(command)
        assert stopped == []
    finally:
        with server.connect(dbname="app_a") as conn:
            if conn.execute("SELECT count(*) FROM pg_subscription WHERE subname = 'rt_sub'").fetchone()[0]:
                conn.execute("DROP SUBSCRIPTION rt_sub")
        server.sql("ALTER DATABASE app_a OWNER TO postgres")
        server.sql("DROP TABLESPACE rt_elsewhere")
        server.sql("DROP ROLE rt_owner")
        shutil.rmtree(location, ignore_errors=True)


def test_renames_in_open_transaction_blocks_hold_nothing_after_their_statements(server):
    """A hold ends with its command. A rename in a transaction block left
    open keeps the database to itself with its own lock (a dispatcher
    connecting waits for the block), not with one of the 16 holds: one
    login renaming databases in blocks it keeps open takes none from other
    roles' commands."""
    server.sql("CREATE ROLE hoarder LOGIN CREATEDB")
    names = [f"hoard_{i}" for i in range(5)]
    for name in names:
        server.sql(f"CREATE DATABASE {name} OWNER hoarder")
        server.sql("CREATE EXTENSION outbox_dispatch", dbname=name)
    server.configure(database=", ".join(("postgres",) + APPS + tuple(names)))
    blocks = [server.connect(user="hoarder", dbname="plain", autocommit=False) for _ in names]
    notices = []
    for conn in blocks:
        conn.add_notice_handler(lambda n: notices.append(n.message_primary))
    try:
        for name in names:
            serving(server, name, workers=2)
        for conn, name in zip(blocks, names):
            conn.execute(f"ALTER DATABASE {name} RENAME TO {name}_renamed")
        assert notices == []
        time.sleep(1)
        held = "SELECT count(*) FROM outbox.workers WHERE last_error LIKE 'a command holds it%%'"
        assert server.value(held) == 0, server.sql("SELECT database, state, last_error FROM outbox.workers")
        # Another role's command gets a hold, and runs.
        server.sql("ALTER DATABASE app_c RENAME TO app_c_renamed")
        server.sql("ALTER DATABASE app_c_renamed RENAME TO app_c")
        for conn in blocks:
            conn.commit()
        server.configure(database=", ".join(("postgres",) + APPS + tuple(f"{n}_renamed" for n in names)))
        for name in names:
            serving(server, f"{name}_renamed", workers=2)
    finally:
        for conn in blocks:
            conn.close()
        server.configure(database="*")
        for name in names:
            server.sql(f"DROP DATABASE IF EXISTS {name}")
            server.sql(f"DROP DATABASE IF EXISTS {name}_renamed")
        server.sql("DROP ROLE hoarder")
    serving(server, "app_c", workers=2)


def test_drop_extension_if_exists_from_anyone_wakes_and_spawns_nothing(server):
    server.sql("CREATE ROLE loiterer LOGIN")
    try:
        probe = 'extension outbox_dispatch is not created in database "plain"'
        wait_until(lambda: probe in server.log_text(), message="plain's first probe")
        before = server.log_text().count(probe)
        with server.connect(user="loiterer", dbname="plain") as conn:
            for _ in range(50):
                conn.execute("DROP EXTENSION IF EXISTS no_such_extension")
                conn.execute("DROP EXTENSION IF EXISTS outbox_dispatch")
        time.sleep(1)
        assert connected(server, "plain") == 0
        assert server.log_text().count(probe) == before
    finally:
        server.sql("DROP ROLE loiterer")


def test_a_rename_rolled_back_to_a_savepoint_holds_nothing_afterwards(server):
    with server.connect(dbname="app_b", autocommit=False) as conn:
        for _ in range(20):  # more than the 16 holds there are
            conn.execute("SAVEPOINT s")
            conn.execute("ALTER DATABASE app_a RENAME TO app_a_renamed")
            conn.execute("ROLLBACK TO SAVEPOINT s")
        # The transaction is still open: app_a is served again meanwhile.
        serving(server, "app_a", workers=2)
        conn.rollback()
    # And another session's rename still gets a hold of its own.
    server.sql("ALTER DATABASE app_c RENAME TO app_c_renamed")
    server.sql("ALTER DATABASE app_c_renamed RENAME TO app_c")
    serving(server, "app_c", workers=2)


def test_a_bad_list_is_refused_naming_the_setting(server):
    for value, detail in (("app_a,,app_b", "an empty database name in the list"),
                          ('"app_a', "closing double quote is missing")):
        with pytest.raises(psycopg.errors.InvalidParameterValue, match='"outbox.database"') as refused:
            server.sql(f"ALTER SYSTEM SET outbox.database = '{value}'")
        assert detail in str(refused.value.diag.message_detail)


def test_a_database_without_the_extension_costs_only_a_launcher_scan(server):
    # Looked at once: dispatcher 0 found no extension and left.
    wait_until(lambda: 'not serving it until CREATE EXTENSION' in server.log_text(), message="the probe")
    time.sleep(12)  # two launcher scans
    assert connected(server, "plain") == 0
    assert server.log_text().count('extension outbox_dispatch is not created in database "plain"') == 1
    assert dispatchers(server, "plain") == []


def test_create_extension_where_the_probe_found_none_is_served_and_other_wakes_cost_nothing(server, redis_server):
    probes = server.log_text().count('extension outbox_dispatch is not created in database "plain"')
    # outbox_wake() commits where dispatchers serve: no database is looked at again.
    for _ in range(50):
        server.sql("SELECT outbox_wake()", dbname="app_b")
    time.sleep(1)
    assert server.log_text().count('extension outbox_dispatch is not created in database "plain"') == probes
    server.sql("CREATE EXTENSION outbox_dispatch", dbname="plain")
    try:
        [event] = enqueue(server, "plain", "q_plain")
        wait_until(lambda: queued_ids(redis_server.client(), "q_plain") == [event], timeout=10,
                   message="served within 10 s of CREATE EXTENSION")
    finally:
        server.sql("DROP EXTENSION outbox_dispatch", dbname="plain")
    wait_until(lambda: connected(server, "plain") == 0, timeout=10, message="its dispatchers gone")


def test_events_in_every_database_run_in_a_stock_celery_worker_and_reports_reach_their_database(server,
                                                                                                 redis_server):
    worker = CeleryWorker(redis_server.url, queues=("q_multi",), app="loop_app")
    try:
        worker.wait_ready()
        ids = {name: enqueue(server, name, "q_multi", 20) for name in APPS}
        for name in APPS:
            wait_until(lambda: server.value("SELECT count(*) FROM outbox.events WHERE status = 'processed'",
                                            dbname=name) == 20, timeout=60,
                       message=f"every event of {name} run and reported")
            ran = {i for i in ids[name] if redis_server.client().exists(f"ran:{i}")}
            assert ran == set(ids[name])
        # Each database's metrics count its own events only.
        for name in APPS:
            assert server.value("SELECT value FROM outbox.metrics WHERE name = 'outbox_dispatched_total'",
                                dbname=name) == 20
            assert server.value("SELECT value FROM outbox.metrics WHERE name = 'outbox_workers_running'",
                                dbname=name) == 2
        assert {r[0] for r in server.sql("SELECT DISTINCT database FROM outbox.workers")} >= set(APPS)
    finally:
        worker.close()


def test_a_report_on_another_databases_list_changes_nothing(server, redis_server):
    [event] = enqueue(server, "app_a", "q_forge_other")
    wait_until(lambda: queued_ids(redis_server.client(), "q_forge_other") == [event], message="the push")
    [message] = [decode(m)[0] for m in redis_server.client().lrange("q_forge_other", 0, -1)]
    assert message["headers"]["outbox_report_to"] == server.report_list("app_a")
    # A true report of app_a's event, on app_b's list: app_b's dispatchers
    # find no such event there.
    redis_server.client().rpush(server.report_list("app_b"), report.processed(event, message["headers"]["outbox_send"]))
    wait_until(lambda: redis_server.client().llen(server.report_list("app_b")) == 0, message="the report read")
    assert server.value("SELECT status::text FROM outbox.events WHERE id = %s", (event,), dbname="app_a") \
        == "dispatched"
    assert server.value("SELECT value FROM outbox.metrics WHERE name = 'outbox_reports_ignored_total' "
                        "AND labels ->> 'reason' = 'stale'", dbname="app_b") == 1


def test_create_extension_is_served_within_seconds_and_drop_extension_stops_it(server, redis_server):
    server.sql("CREATE DATABASE app_new")
    try:
        started = time.monotonic()
        server.sql("CREATE EXTENSION outbox_dispatch", dbname="app_new")
        [event] = enqueue(server, "app_new", "q_new")
        wait_until(lambda: queued_ids(redis_server.client(), "q_new") == [event], timeout=10,
                   message="the new database served within 10 s")
        assert time.monotonic() - started < 10
        serving(server, "app_new", workers=2)
        server.sql("DROP EXTENSION outbox_dispatch", dbname="app_new")
        wait_until(lambda: connected(server, "app_new") == 0, timeout=10, message="its dispatchers gone")
        wait_until(lambda: dispatchers(server, "app_new") == [], timeout=10, message="its group let go")
        # And created again: served again.
        server.sql("CREATE EXTENSION outbox_dispatch", dbname="app_new")
        serving(server, "app_new", workers=2)
    finally:
        server.sql("DROP DATABASE app_new")


def test_plain_drop_database_of_a_served_database_right_after_an_enqueue(server, redis_server):
    """The Django/pytest test run: create test_app, enqueue, drop it."""
    others = {name: dispatchers(server, name) for name in APPS}
    for run in range(3):
        server.sql("CREATE DATABASE test_app")
        server.sql("CREATE EXTENSION outbox_dispatch", dbname="test_app")
        enqueue(server, "test_app", "q_test_app", 5)
        if run == 0:
            serving(server, "test_app", workers=2)
        started = time.monotonic()
        server.sql("DROP DATABASE test_app")
        assert time.monotonic() - started < 5, "DROP DATABASE waited for the dispatchers"
    wait_until(lambda: dispatchers(server, "test_app") == [], message="its rows gone")
    # The other databases' dispatchers never stopped.
    assert {name: dispatchers(server, name) for name in APPS} == others


def test_rename_and_copy_of_a_served_database(server, redis_server):
    server.sql("CREATE DATABASE app_r")
    try:
        server.sql("CREATE EXTENSION outbox_dispatch", dbname="app_r")
        serving(server, "app_r", workers=2)
        server.sql("ALTER DATABASE app_r RENAME TO app_renamed")
        serving(server, "app_renamed", workers=2)
        server.sql("CREATE DATABASE app_copy TEMPLATE app_renamed")
        # The copy has the extension: the launcher's scan serves it too.
        serving(server, "app_copy", workers=2)
        serving(server, "app_renamed", workers=2)
        [event] = enqueue(server, "app_copy", "q_copy")
        wait_until(lambda: queued_ids(redis_server.client(), "q_copy") == [event], message="the copy served")
        server.sql("ALTER DATABASE app_copy SET TABLESPACE pg_default")
    finally:
        server.sql("DROP DATABASE IF EXISTS app_copy")
        server.sql("DROP DATABASE IF EXISTS app_renamed")
        server.sql("DROP DATABASE IF EXISTS app_r")


def test_a_copy_of_a_database_with_events_sends_none_of_them_until_adopted(server, redis_server):
    """pytest-django's clones, a staging copy: the copy holds events the
    original sends; sending them from the copy too would run each twice."""
    server.configure(enabled="off")
    try:
        ids = enqueue(server, "app_a", "q_clone", 5)
        server.sql("CREATE DATABASE app_clone TEMPLATE app_a")
        server.configure(enabled="on")
        wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_clone")) == sorted(ids),
                   message="the original's events sent")
        wait_until(lambda: {r[2] for r in dispatchers(server, "app_clone")} == {"copy"}, timeout=30,
                   message="the copy's dispatchers waiting for outbox_adopt()")
        assert "SELECT public.outbox_adopt() in it" in server.value(
            "SELECT last_error FROM outbox.workers WHERE database = 'app_clone' AND worker = 0")
        time.sleep(2)
        assert sorted(queued_ids(redis_server.client(), "q_clone")) == sorted(ids), "a copy sent its events"
        assert server.value("SELECT outbox_adopt()", dbname="app_clone") is True
        wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_clone")) == sorted(ids * 2),
                   message="the adopted copy's events sent from it too")
        serving(server, "app_clone", workers=2)
        assert server.value("SELECT outbox_adopt()", dbname="app_clone") is False
    finally:
        server.configure(enabled="on")
        server.sql("DROP DATABASE IF EXISTS app_clone")


def test_utility_errors_keep_their_position_context_and_fields(server):
    """The hook sees every utility statement: an error inside one reaches the
    client as PostgreSQL raised it."""
    with server.connect(dbname="plain") as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS uniq (id int PRIMARY KEY)")
        conn.execute("INSERT INTO uniq VALUES (1) ON CONFLICT DO NOTHING")
        with pytest.raises(psycopg.errors.UniqueViolation) as raised:
            conn.execute("DO $$BEGIN INSERT INTO uniq VALUES (1); END$$")
        assert raised.value.diag.constraint_name == "uniq_pkey"
        assert "PL/pgSQL" in (raised.value.diag.context or "")
        with pytest.raises(psycopg.errors.UndefinedObject) as raised:
            conn.execute("CREATE TABLE broken (a no_such_type)")
        assert raised.value.diag.statement_position is not None
    server.sql("CREATE DATABASE from_default TEMPLATE DEFAULT")
    server.sql("DROP DATABASE from_default")


def test_one_blocked_database_does_not_stall_another(server, redis_server):
    with server.connect(dbname="app_a", autocommit=False) as blocker:
        blocker.execute("LOCK outbox.log IN ACCESS EXCLUSIVE MODE")
        wait_until(lambda: "blocked" in [r[2] for r in dispatchers(server, "app_a")], timeout=30,
                   message="app_a's dispatchers blocked")
        [event] = enqueue(server, "app_b", "q_unblocked")
        wait_until(lambda: queued_ids(redis_server.client(), "q_unblocked") == [event], timeout=10,
                   message="app_b served meanwhile")
        blocker.rollback()
    serving(server, "app_a", workers=2)


def test_paused_dispatchers_leave_a_dropped_extension(server):
    server.sql("CREATE DATABASE app_paused")
    try:
        server.sql("CREATE EXTENSION outbox_dispatch", dbname="app_paused")
        serving(server, "app_paused", workers=2)
        server.configure(enabled="off")
        wait_until(lambda: {r[2] for r in dispatchers(server, "app_paused")} == {"paused"}, message="paused")
        server.sql("DROP EXTENSION outbox_dispatch", dbname="app_paused")
        wait_until(lambda: connected(server, "app_paused") == 0, timeout=10, message="its dispatchers gone")
    finally:
        server.configure(enabled="on")
        server.sql("DROP DATABASE app_paused")


def test_a_launcher_that_dies_is_restarted_and_serves_every_database_again(server, redis_server):
    launcher = server.value("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox launcher'")
    before = {name: {r[1] for r in dispatchers(server, name)} for name in APPS}
    server.sql("SELECT pg_terminate_backend(%s)", (launcher,))
    wait_until(lambda: server.value("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox launcher'")
               not in (None, launcher), timeout=30, message="a new launcher")
    for name in APPS:
        wait_until(lambda: {r[1] for r in dispatchers(server, name)}.isdisjoint(before[name])
                   and [r[2] for r in dispatchers(server, name)] == ["idle"] * 2, timeout=30,
                   message=f"{name} served by new dispatchers")
        # One process per slot: the old ones are gone.
        assert connected(server, name) == 2
    [event] = enqueue(server, "app_c", "q_after_launcher")
    wait_until(lambda: queued_ids(redis_server.client(), "q_after_launcher") == [event], message="delivery")


def test_a_reload_changes_the_databases_and_the_dispatchers_per_database(server):
    try:
        server.configure(database="app_a, missing_db, plain, postgres", workers=1)
        wait_until(lambda: server.sql("SELECT database, worker, state, last_error FROM outbox.workers "
                                      "ORDER BY database, worker") ==
                   [("app_a", 0, "idle", None), ("missing_db", None, "not served", "no such database"),
                    ("plain", None, "not served", "extension outbox_dispatch is not created there"),
                    ("postgres", 0, "idle", None)],
                   timeout=30, message="one database served, two named not served")
        assert connected(server, "app_b") == 0
    finally:
        server.configure(database="*", workers=2)
    for name in APPS:
        serving(server, name, workers=2)


def test_too_few_worker_slots_is_a_warning_and_a_row(redis_server):
    # 1 launcher + 2 dispatchers for each of 3 databases (postgres, app_a,
    # app_b) = 7; only 4 slots.
    pg = Cluster(redis_server.url, database="*", workers=2, server_conf={"max_worker_processes": 4})
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        for name in APPS[:2]:
            pg.sql(f"CREATE DATABASE {name}")
            pg.sql("CREATE EXTENSION outbox_dispatch", dbname=name)
        wait_until(lambda: "no background worker slot is free; max_worker_processes is 4 and outbox_dispatch "
                           "alone needs 7" in pg.log_text(), timeout=30, message="the warning")
        wait_until(lambda: pg.value("SELECT count(*) FROM outbox.workers WHERE state = 'no worker slot' "
                                    "AND last_error LIKE '%raise max_worker_processes (now 4) to at least 7%'"),
                   timeout=30, message="a row per dispatcher not started")
        # The slots left (the logical replication launcher takes one) run
        # dispatchers; nothing crashed.
        assert pg.value("SELECT count(*) FROM outbox.workers WHERE pid IS NOT NULL") >= 2
        assert "terminated by signal" not in pg.log_text()
    finally:
        pg.close()
