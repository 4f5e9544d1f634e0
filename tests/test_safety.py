"""Safety and operations: privileges, secrets, Redis AUTH and TLS, bad
settings that must not crash-loop the server, DROP/CREATE EXTENSION and the
upgrade from the previous version."""

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from harness import Cluster, Redis, make_tls_files, queued_ids, wait_until

ENQUEUE = "outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, interval, jsonb, text)"


def public_file(directory, name, text):
    """A file the postgres user can read (the dispatchers run as it)."""
    path = Path(directory) / name
    path.write_text(text)
    path.chmod(0o644)
    return path


@pytest.fixture
def secrets_dir():
    directory = tempfile.mkdtemp(prefix="outbox-secrets-")
    os.chmod(directory, 0o755)
    yield Path(directory)
    shutil.rmtree(directory, ignore_errors=True)


# -- privileges ---------------------------------------------------------------

@pytest.fixture(scope="module")
def roles(cluster):
    """The roles of the "Privileges" page (docs/operations/security.md)."""
    cluster.sql("""
        DO $$ BEGIN
            CREATE ROLE outbox_app LOGIN;
            CREATE ROLE outbox_consumer LOGIN;
            CREATE ROLE outbox_watcher LOGIN IN ROLE pg_monitor;
            CREATE ROLE outbox_nobody LOGIN;
        EXCEPTION WHEN duplicate_object THEN NULL;
        END $$""")
    for role, documented in (("outbox_app", "app"), ("outbox_consumer", "consumer"), ("outbox_watcher", "grafana")):
        cluster.connect_as(role, documented).close()
    return cluster


def as_role(pg, role):
    return pg.connect(user=role)


def denied(pg, role, query, params=None):
    with as_role(pg, role) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(query, params)


def test_an_application_role_can_enqueue_and_nothing_more(outbox, roles, redis_server):
    with as_role(outbox, "outbox_app") as conn:
        event_id = conn.execute("SELECT outbox_enqueue('granted', '{}', queue => 'q_priv')").fetchone()[0]
        conn.execute("INSERT INTO outbox.events (event_type, queue) VALUES ('orm', 'q_priv')")
    wait_until(lambda: len(queued_ids(redis_server.client(), "q_priv")) == 2, message="both events")
    assert str(event_id) in queued_ids(redis_server.client(), "q_priv")
    for query in ["SELECT * FROM outbox.events", "UPDATE outbox.events SET payload = '{}'",
                  "DELETE FROM outbox.events", "TABLE outbox.status", "TABLE outbox.dead_letters",
                  "SELECT outbox_retry_failed()", "SELECT outbox_wake()",
                  "SELECT outbox_ack(gen_random_uuid())", "SHOW outbox.redis_url",
                  "SHOW outbox.broker_password_file", "SHOW outbox.redis_password_file",
                  # What the outbox writes of an event: never a writer's to choose.
                  "INSERT INTO outbox.log (event_type, generation) VALUES ('e', 1)",
                  "INSERT INTO outbox.events (event_type, ordering_key, key_seq, key_state) VALUES ('e', 'k', 1, 'head')",
                  "INSERT INTO outbox.log (event_type, status) VALUES ('e', 'failed')",
                  "INSERT INTO outbox.events (event_type, pending_xid) VALUES ('e', '1')"]:
        denied(outbox, "outbox_app", query)


def test_a_consumer_role_can_acknowledge_and_nothing_more(outbox, roles):
    event_id = outbox.value("SELECT outbox_enqueue('ack', '{}', queue => 'q_consumer')")
    wait_until(lambda: outbox.count("dispatched") == 1, message="dispatched")
    with as_role(outbox, "outbox_consumer") as conn:
        assert conn.execute("SELECT outbox_ack(%s)", (event_id,)).fetchone()[0] is True
    assert outbox.count("processed") == 1
    for query in ["SELECT * FROM outbox.events", "SELECT outbox_enqueue('e', '{}')",
                  "UPDATE outbox.events SET payload = '{}'"]:
        denied(outbox, "outbox_consumer", query)


def test_pg_monitor_members_read_the_views_but_no_payloads(outbox, roles):
    outbox.sql("SELECT outbox_enqueue('e', '{}', queue => 'q_watched')")
    with as_role(outbox, "outbox_watcher") as conn:
        assert len(conn.execute("TABLE outbox.status").fetchall()) == 5
        assert conn.execute("SELECT count(*) FROM outbox.workers").fetchone()[0] == 1
        assert conn.execute("SELECT count(*) FROM outbox.metrics").fetchone()[0] > 0
        assert "outbox_dispatched_total" in conn.execute("SELECT outbox_metrics_prometheus()").fetchone()[0]
        # The function the views read batches with runs as its owner: a
        # window made up lists nothing (it would list every event in line).
        assert conn.execute(
            "SELECT count(*) FROM outbox.batch_members('2:2:', pg_current_snapshot(), NULL, NULL, "
            "pg_snapshot_xmax(pg_current_snapshot()), 'ffffffff-ffff-ffff-ffff-ffffffffffff')").fetchone()[0] == 0
    for query in ["SELECT payload FROM outbox.events", "TABLE outbox.dead_letters",
                  "SELECT outbox_enqueue('e', '{}')", "SELECT outbox_retry_failed()"]:
        denied(outbox, "outbox_watcher", query)


def test_the_view_is_the_writer_s_alone_and_acts_as_its_caller_when_read(outbox, roles):
    """A writer granted INSERT on outbox.events alone enqueues through it
    (its rules write outbox.log as the view's owner; the triggers still see
    the writer), and may not read it; a reader of the view needs what it is
    made of, as the docs grant it."""
    outbox.sql("CREATE ROLE outbox_view_only LOGIN; GRANT USAGE ON SCHEMA outbox TO outbox_view_only; "
               "GRANT INSERT (event_type, queue) ON outbox.events TO outbox_view_only")
    try:
        with as_role(outbox, "outbox_view_only") as conn:
            conn.execute("INSERT INTO outbox.events (event_type, queue) VALUES ('e', 'q_view_only')")
        denied(outbox, "outbox_view_only", "SELECT id FROM outbox.events")
        denied(outbox, "outbox_view_only", "INSERT INTO outbox.log (event_type) VALUES ('e')")
        outbox.sql("GRANT SELECT ON outbox.events, outbox.log TO outbox_view_only")
        denied(outbox, "outbox_view_only", "SELECT status FROM outbox.events")
        outbox.sql("GRANT SELECT ON outbox.unread, outbox.batches, outbox.outcomes, outbox.cursor TO outbox_view_only")
        with as_role(outbox, "outbox_view_only") as conn:
            assert conn.execute("SELECT count(*) FROM outbox.events WHERE queue = 'q_view_only'").fetchone()[0] == 1
    finally:
        outbox.sql("DROP OWNED BY outbox_view_only; DROP ROLE outbox_view_only")


def test_an_ungranted_role_can_do_nothing(outbox, roles):
    for query in ["SELECT outbox_enqueue('e', '{}')", "INSERT INTO outbox.events (event_type) VALUES ('e')",
                  "TABLE outbox.status", "TABLE outbox.workers", "SELECT outbox_wake()",
                  "SELECT outbox_metrics_prometheus()", "SHOW outbox.redis_url"]:
        denied(outbox, "outbox_nobody", query)


def test_row_level_security_does_not_hide_events_from_the_dispatchers(outbox, roles, redis_server):
    outbox.sql("""
        ALTER TABLE outbox.log ENABLE ROW LEVEL SECURITY;
        ALTER TABLE outbox.log FORCE ROW LEVEL SECURITY;
        CREATE POLICY tenant_insert ON outbox.log FOR INSERT TO outbox_app
            WITH CHECK (headers->>'tenant' = current_setting('app.tenant'))""")
    # As docs/operations/security.md says: a tenant held to a policy
    # inserts into the table, whose columns it is granted.
    outbox.sql("GRANT INSERT (event_type, queue, headers) ON outbox.log TO outbox_app")
    insert = "INSERT INTO outbox.log (event_type, queue, headers) VALUES ('tenant', 'q_rls', %s)"
    try:
        with as_role(outbox, "outbox_app") as conn:
            conn.execute("SET app.tenant = 't1'")
            conn.execute(insert, ('{"tenant": "t1"}',))
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
                conn.execute(insert, ('{"tenant": "t2"}',))
        wait_until(lambda: len(queued_ids(redis_server.client(), "q_rls")) == 1, message="the tenant's event")
        wait_until(lambda: outbox.count("dispatched") == 1, message="the tenant's event marked")
    finally:
        outbox.sql("""
            REVOKE INSERT (event_type, queue, headers) ON outbox.log FROM outbox_app;
            DROP POLICY tenant_insert ON outbox.log;
            ALTER TABLE outbox.log NO FORCE ROW LEVEL SECURITY;
            ALTER TABLE outbox.log DISABLE ROW LEVEL SECURITY""")


# -- secrets, AUTH and TLS ----------------------------------------------------

def assert_secret_hidden(pg, secret):
    assert secret not in str(pg.sql("SELECT * FROM outbox.workers"))
    assert secret not in str(pg.sql("SELECT * FROM outbox.metrics"))
    assert secret not in pg.value("SELECT outbox_metrics_prometheus()")
    assert secret not in pg.log_text()


def test_a_wrong_password_is_reported_without_leaking_and_recovers(outbox, secrets_dir):
    server = Redis(password="right-horse-battery")
    try:
        password_file = public_file(secrets_dir, "redis-password", "wrong-staple-42\n")
        outbox.configure(redis_url=f"redis://127.0.0.1:{server.port}/0", broker_password_file=str(password_file),
                         reconnect_delay_min="200ms", reconnect_delay_max="500ms")
        wait_until(lambda: "auth" in (outbox.value("SELECT last_error FROM outbox.workers") or "").lower(),
                   message="the authentication failure")
        assert outbox.value("SELECT state FROM outbox.workers") == "reconnecting"
        assert_secret_hidden(outbox, "wrong-staple-42")

        password_file.write_text("right-horse-battery\n")  # rotated: read at the next attempt
        event_id = outbox.value("SELECT outbox_enqueue('auth', '{}', queue => 'q_auth')")
        wait_until(lambda: queued_ids(server.client(), "q_auth") == [str(event_id)], message="delivery with AUTH")
        assert outbox.value("SELECT last_error FROM outbox.workers") is None
        assert_secret_hidden(outbox, "right-horse-battery")
    finally:
        server.close()


def test_an_acl_user_from_the_url_with_its_password_from_a_file(outbox, secrets_dir):
    server = Redis(password="admin-secret")
    try:
        server.client().acl_setuser("outbox", enabled=True, passwords=["+acl-secret"], keys=["*"],
                                    commands=["+@all"])
        password_file = public_file(secrets_dir, "acl-password", "acl-secret\n")
        outbox.configure(redis_url=f"redis://outbox@127.0.0.1:{server.port}/0",
                         broker_password_file=str(password_file))
        event_id = outbox.value("SELECT outbox_enqueue('acl', '{}', queue => 'q_acl')")
        wait_until(lambda: queued_ids(server.client(), "q_acl") == [str(event_id)], message="delivery as ACL user")
        assert_secret_hidden(outbox, "acl-secret")
    finally:
        server.close()


def watcher_sees(pg, pieces):
    """Which of `pieces` a pg_monitor member reads in what the dispatchers
    show, or anyone in the server log, PostgreSQL's own line for a changed
    setting (`parameter "outbox.broker_url" changed to "…"`) included."""
    with as_role(pg, "outbox_watcher") as conn:
        seen = str(conn.execute("SELECT * FROM outbox.workers").fetchall())
        seen += str(conn.execute("SELECT * FROM outbox.metrics").fetchall())
    seen += pg.log_text()
    return [piece for piece in pieces if piece in seen]


def changed_lines(pg, setting):
    return [line for line in pg.log_text().splitlines() if f'parameter "{setting}" changed to' in line]


@pytest.mark.parametrize("c", ["/", "?", "#", "@", ":", "%"])
def test_a_password_with_any_character_is_never_shown(outbox, roles, redis_server, c):
    """The password holds a character that ends or splits a URL's authority.
    Written as it is, the URL is refused without a piece of it shown;
    percent-encoded (as kombu wants it too), it is the password, and Redis
    takes it. Sentinel and TLS URLs go through the same parser and
    redaction (core/src/broker_url.rs tests each scheme); an AMQP URL too,
    whose handshake this Redis refuses."""
    password = f"Zq{c}Xy{c}Wv"
    pieces = ["Zq", "Xy", "Wv"]
    server = Redis(password=password)
    try:
        for setting, scheme in (("redis_url", "redis"), ("redis_url", "rediss"), ("redis_url", "sentinel"),
                                ("broker_url", "amqp"), ("broker_url", "redis")):
            logged = len(changed_lines(outbox, f"outbox.{setting}"))
            outbox.configure(**{setting: f"{scheme}://:{password}@127.0.0.1:{server.port}/0"},
                             redis_sentinel_master="outbox", reconnect_delay_min="200ms",
                             reconnect_delay_max="500ms")
            # PostgreSQL's own line is there, the URL in it redacted.
            wait_until(lambda: len(changed_lines(outbox, f"outbox.{setting}")) > logged,
                       message=f"{setting}: the server's line for the change")
            # An error (most), or a connection (a URL that still parses as
            # meant: kombu's parser, too, takes the last @ and the first :).
            wait_until(lambda: outbox.value("SELECT last_error IS NOT NULL OR connected FROM outbox.workers"),
                       message=f"{scheme}: the dispatcher's error or connection")
            time.sleep(0.5)
            assert watcher_sees(outbox, pieces) == [], scheme
        encoded = "".join(f"%{b:02X}" for b in password.encode())
        outbox.configure(broker_url="", redis_url=f"redis://:{encoded}@127.0.0.1:{server.port}/0")
        wait_until(lambda: f"redis://***@127.0.0.1:{server.port}/0" in changed_lines(outbox, "outbox.redis_url")[-1],
                   message="the line for the encoded password, redacted")
        assert encoded not in outbox.log_text()
        event_id = outbox.value("SELECT outbox_enqueue('secret', '{}', queue => 'q_secret_chars')")
        wait_until(lambda: queued_ids(server.client(), "q_secret_chars") == [str(event_id)],
                   message="delivery with the percent-encoded password")
        assert watcher_sees(outbox, pieces) == []
    finally:
        server.close()


def test_redis_settings_are_hidden_from_ordinary_roles(outbox, roles):
    for setting in ("outbox.broker_url", "outbox.redis_url", "outbox.broker_password_file",
                    "outbox.redis_password_file"):
        denied(outbox, "outbox_nobody", f"SHOW {setting}")
        denied(outbox, "outbox_nobody", "SELECT current_setting(%s)", (setting,))
        with as_role(outbox, "outbox_nobody") as conn:
            hidden = conn.execute("SELECT count(*) FROM pg_settings WHERE name = %s", (setting,)).fetchone()[0]
        assert hidden == 0


@pytest.fixture(scope="module")
def tls_files():
    directory = make_tls_files()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def tls_redis(tls_files):
    server = Redis(tls=tls_files)
    yield server
    server.close()


def test_tls_with_a_trusted_ca_delivers_and_an_untrusted_one_is_refused(outbox, tls_files, tls_redis):
    url = tls_redis.url
    outbox.configure(redis_url=url, broker_tls_ca_file=str(tls_files / "other-ca.pem"),
                     reconnect_delay_min="200ms", reconnect_delay_max="500ms")
    wait_until(lambda: "certificate" in (outbox.value("SELECT last_error FROM outbox.workers") or "").lower(),
               message="the untrusted certificate refused")
    assert outbox.value("SELECT connected FROM outbox.workers") is False

    outbox.configure(redis_url=url, broker_tls_ca_file=str(tls_files / "ca.pem"))
    event_id = outbox.value("SELECT outbox_enqueue('tls', '{}', queue => 'q_tls')")
    wait_until(lambda: queued_ids(tls_redis.client(), "q_tls") == [str(event_id)], message="delivery over TLS")


def test_tls_presents_the_client_certificate_a_broker_asks_for(outbox, tls_files):
    server = Redis(tls=tls_files, client_certificates=True)
    try:
        outbox.configure(redis_url=server.url, broker_tls_ca_file=str(tls_files / "ca.pem"),
                         reconnect_delay_min="200ms", reconnect_delay_max="500ms")
        event_id = outbox.value("SELECT outbox_enqueue('mtls', '{}', queue => 'q_mtls')")
        wait_until(lambda: "cannot connect" in (outbox.value("SELECT last_error FROM outbox.workers") or ""),
                   message="no certificate, no connection")
        outbox.configure(broker_tls_cert_file=str(tls_files / "client.pem"),
                         broker_tls_key_file=str(tls_files / "client.key"))
        wait_until(lambda: queued_ids(server.client(), "q_mtls") == [str(event_id)],
                   message="delivery with the client certificate")
    finally:
        server.close()


# -- bad settings ---------------------------------------------------------------

def reconnect_lines(pg):
    return len(re.findall(r"outbox dispatcher 0: .*; reconnecting in", pg.log_text()))


@pytest.mark.parametrize("bad,error", [
    ({"redis_url": "redis://user:pw-in-bad-url@127.0.0.1:notaport/0"}, "invalid outbox.broker_url"),
    ({"redis_url": "redis://127.0.0.1:1/0"}, "cannot connect to the broker"),
    ({"redis_url": "sentinel://127.0.0.1:1/0"}, "set outbox.redis_sentinel_master"),
    ({"priority_steps": "3,1"}, 'outbox.priority_steps "3,1" must start at 0 and ascend'),
], ids=["malformed", "unreachable", "sentinel-without-master", "priority-steps"])
def test_a_bad_broker_setting_is_reported_at_a_bounded_rate_and_recovers(outbox, redis_server, bad, error):
    outbox.configure(reconnect_delay_min="1s", reconnect_delay_max="2s", **bad)
    wait_until(lambda: error in (outbox.value("SELECT last_error FROM outbox.workers") or ""),
               message="the error in outbox.workers")
    assert "pw-in-bad-url" not in outbox.value("SELECT last_error FROM outbox.workers")
    before, start = reconnect_lines(outbox), time.monotonic()
    time.sleep(4)
    attempts = reconnect_lines(outbox) - before
    assert 1 <= attempts <= (time.monotonic() - start) / 1.0 + 1, f"{attempts} attempts: a tight loop"
    for name in bad:
        outbox.sql(f"ALTER SYSTEM RESET outbox.{name}")
    outbox.configure(redis_url=redis_server.url)
    event_id = outbox.value("SELECT outbox_enqueue('fixed', '{}', queue => 'q_fixed')")
    wait_until(lambda: queued_ids(redis_server.client(), "q_fixed") == [str(event_id)], message="delivery after the fix")


def test_an_out_of_range_setting_is_refused_and_the_server_stays_up(outbox, redis_server):
    with pytest.raises(psycopg.errors.InvalidParameterValue,
                       match=r'0 is outside the valid range for parameter "outbox.batch_size" \(1 \.\. 100000\)'):
        outbox.sql("ALTER SYSTEM SET outbox.batch_size = 0")
    with open(outbox.data / "postgresql.conf", "a") as conf:
        conf.write("outbox.poll_interval = -5\n")
    try:
        outbox.sql("SELECT pg_reload_conf()")
        wait_until(lambda: 'parameter "outbox.poll_interval"' in outbox.log_text(), message="the refusal logged")
        event_id = outbox.value("SELECT outbox_enqueue('still', '{}', queue => 'q_range')")
        wait_until(lambda: queued_ids(redis_server.client(), "q_range") == [str(event_id)], message="delivery")
    finally:
        text = (outbox.data / "postgresql.conf").read_text().replace("outbox.poll_interval = -5\n", "")
        (outbox.data / "postgresql.conf").write_text(text)
        outbox.sql("SELECT pg_reload_conf()")


def test_a_missing_database_is_shown_warned_once_and_served_once_named_right(redis_server):
    pg = Cluster(redis_server.url, database="no_such_db")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        wait_until(lambda: pg.sql("SELECT database, worker, state, last_error FROM outbox.workers")
                   == [("no_such_db", None, "not served", "no such database")], message="the reason shown")
        time.sleep(6)
        warnings = pg.log_text().count('database "no_such_db" is not served: no such database')
        assert warnings == 1, f"{warnings} warnings in a few seconds"
        pg.configure(database="postgres")
        event_id = pg.value("SELECT outbox_enqueue('found', '{}', queue => 'q_db')")
        wait_until(lambda: queued_ids(redis_server.client(), "q_db") == [str(event_id)], timeout=60,
                   message="delivery once outbox.database names a database")
        assert pg.value("SELECT last_error FROM outbox.workers") is None
    finally:
        pg.close()


# -- extension lifecycle ----------------------------------------------------------

def test_drop_and_create_extension_while_dispatchers_run(redis_server):
    pg = Cluster(redis_server.url, poll_interval="500ms")
    waiting = "is not created in database"
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.wait_idle()
        for round_trip in range(2):
            pg.sql("DROP EXTENSION outbox_dispatch")
            wait_until(lambda: pg.log_text().count(waiting) > round_trip, message="the dispatcher noticing")
            pg.sql("CREATE EXTENSION outbox_dispatch")
            event_id = pg.value("SELECT outbox_enqueue('again', '{}', queue => 'q_recreated')")
            wait_until(lambda: str(event_id) in queued_ids(redis_server.client(), "q_recreated"),
                       message="delivery after CREATE EXTENSION")
        assert " ERROR: " not in pg.log_text(), "a dispatcher failed around DROP/CREATE"
        assert len(pg.dispatcher_pids()) == 1
    finally:
        pg.close()


# (A grant taken back leaves an ACL written out where there was none: the
# same privileges.)
CATALOG_STATE = """
SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')',
       p.prosecdef, p.proconfig, p.proacl::text, md5(p.prosrc)
  FROM pg_proc p JOIN pg_depend d ON d.objid = p.oid AND d.deptype = 'e'
  JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'outbox_dispatch'
UNION ALL
SELECT c.relname, NULL, c.reloptions, coalesce(c.relacl, acldefault('r', c.relowner))::text,
       md5(coalesce(pg_get_viewdef(c.oid), ''))
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'outbox'
ORDER BY 1
"""


def test_upgrade_from_the_previous_version_keeps_events_flowing(redis_server):
    pg = Cluster(redis_server.url)
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch VERSION '0.8.0'")
        # The library is newer than the SQL: the dispatchers wait, visibly.
        first = pg.value("SELECT outbox_enqueue('old', '{}', queue => 'q_upgrade')")
        wait_until(lambda: "run ALTER EXTENSION outbox_dispatch UPDATE" in
                   (pg.value("SELECT last_error FROM outbox.workers") or ""), message="the version mismatch shown")
        assert pg.value("SELECT state FROM outbox.workers") == "blocked"
        assert pg.count("pending") == 1
        pg.configure(enabled="off")
        second = pg.value("SELECT outbox_enqueue('pending', '{}', queue => 'q_upgrade')")
        pg.sql(f"CREATE ROLE upgrade_app LOGIN; GRANT EXECUTE ON FUNCTION {ENQUEUE} TO upgrade_app; "
               "GRANT USAGE ON SCHEMA outbox TO upgrade_app; GRANT INSERT ON outbox.events TO upgrade_app")
        pg.sql("ALTER EXTENSION outbox_dispatch UPDATE")

        # What a DBA granted on the API holds across the update.
        assert pg.value(f"SELECT has_function_privilege('upgrade_app', '{ENQUEUE}', 'EXECUTE')")
        pg.sql(f"REVOKE EXECUTE ON FUNCTION {ENQUEUE} FROM upgrade_app")
        # outbox.status after the update: exact while counting is cheap.
        assert pg.sql("SELECT status::text, count, estimated FROM outbox.status") == [
            ("pending", 2, False), ("processing", 0, False), ("dispatched", 0, False), ("processed", 0, False),
            ("failed", 0, False)]
        assert pg.value("SELECT extversion FROM pg_extension WHERE extname = 'outbox_dispatch'") == "1.1.0"
        # The table became outbox.log, under the view outbox.events: the
        # role may insert through the view as it did into the table.
        assert pg.sql("SELECT relname::text, relkind::text FROM pg_class WHERE relnamespace = 'outbox'::regnamespace "
                      "AND relname IN ('events', 'log') ORDER BY 1") == [("events", "v"), ("log", "p")]
        with pg.connect(user="upgrade_app") as conn:
            conn.execute("INSERT INTO outbox.events (event_type, queue) VALUES ('orm', 'q_upgrade_orm')")
        pg.sql("REVOKE INSERT ON outbox.events, outbox.log FROM upgrade_app; "
               "REVOKE USAGE ON SCHEMA outbox FROM upgrade_app")
        pg.configure(enabled="on")
        third = pg.value("SELECT outbox_enqueue('new', '{}', queue => 'q_upgrade')")
        wait_until(lambda: set(queued_ids(redis_server.client(), "q_upgrade")) == {str(first), str(second), str(third)},
                   message="events from before and after the update")
        wait_until(lambda: len(queued_ids(redis_server.client(), "q_upgrade_orm")) == 1,
                   message="the event inserted through the view")

        # An updated installation is the same as a fresh one.
        pg.sql("CREATE DATABASE fresh")
        with pg.connect(dbname="fresh") as conn:
            conn.execute("CREATE EXTENSION outbox_dispatch")
            fresh = conn.execute(CATALOG_STATE).fetchall()
        assert pg.sql(CATALOG_STATE) == fresh
    finally:
        pg.close()
