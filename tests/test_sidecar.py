"""`outbox-dispatch run` (docs/guides/managed.md): the dispatchers as a process
beside a server that cannot load the library, connected as the outbox's
owner, who is not a superuser. The hostile cases first: a password in the
environment, a database it must not serve, a broker that never answers, a
database that sets nonsense; then what must survive: a sidecar killed mid
drain, a connection cut, three sidecars at once; then the happy paths."""

import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import psycopg
import pytest

from harness import Redis, SilentBroker, as_postgres, drain_held, free_port, queued_ids, wait_until
from standalone import Sidecar, Standby, fresh_database, install, plain_server, samples, scrape


@pytest.fixture(scope="module")
def server():
    with plain_server() as pg:
        # As docs/guides/managed.md asks: the rotation sees every open transaction.
        pg.sql("GRANT pg_read_all_stats TO owner")
        yield pg


@pytest.fixture
def db(server, request):
    """A database of its own for each test, installed and granted."""
    name = "s_" + request.node.name.removeprefix("test_")[:50]
    install(server, name)
    yield name
    server.sql(f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture
def sidecars():
    started = []

    def start(*args, **kwargs):
        sidecar = Sidecar(*args, **kwargs)
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        sidecar.close()


def enqueue(pg, dbname, queue, n=1, notify=False):
    """`n` events to `queue`, committed by writer; their ids."""
    with pg.connect(dbname=dbname, user="writer") as conn:
        if notify:
            conn.execute("SET outbox.notify = on")
        return [str(r[0]) for r in conn.execute(
            "SELECT outbox_enqueue('t.run', jsonb_build_object('n', i), queue => %s) FROM generate_series(1, %s) AS i",
            (queue, n)).fetchall()]


def set_setting(pg, dbname, name, value, owner="owner"):
    with pg.connect(dbname=dbname, user=owner) as conn:
        conn.execute("INSERT INTO outbox.settings (name, value) VALUES (%s, %s) "
                     "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (name, value))


def workers(pg, dbname):
    return pg.sql("SELECT worker, state, last_error, events_dispatched FROM outbox.workers ORDER BY worker",
                  dbname=dbname)


def last_error(pg, dbname, worker=0):
    return pg.value("SELECT last_error FROM outbox.workers WHERE worker = %s", (worker,), dbname=dbname) or ""


def serving(pg, dbname, n=1):
    wait_until(lambda: [r[1] for r in workers(pg, dbname)] == ["idle"] * n, timeout=60,
               message=f"{n} idle dispatchers", seen=lambda: workers(pg, dbname))


def statuses(pg, dbname):
    return dict(pg.sql("SELECT status, count(*) FROM outbox.events GROUP BY 1", dbname=dbname))


# -- hostile ------------------------------------------------------------------------------------

def test_a_broker_password_in_the_environment_is_never_printed_and_a_silent_broker_stops_nothing(
        server, db, sidecars):
    secret = "S3CRET-in-the-env"
    silent = SilentBroker()
    try:
        set_setting(server, db, "outbox.broker_timeout", "1s")
        ids = enqueue(server, db, "q_silent", 3)
        sidecar = sidecars(server, db, env={"OUTBOX_BROKER_URL": f"redis://:{secret}@127.0.0.1:{silent.port}/0"})
        wait_until(lambda: "outbox.broker_timeout" in last_error(server, db), timeout=60,
                   message="the timeout shown", seen=lambda: workers(server, db))
        status, took = sidecar.stop()
        assert status == 0 and took < 10, (status, took)
        log = sidecar.log()
        assert secret not in log and "127.0.0.1" in log
        assert secret not in str(server.sql("SELECT * FROM outbox.workers", dbname=db))
        # The broker's fault: nothing sent, nothing spent.
        assert statuses(server, db) == {"pending": len(ids)}
        assert server.value("SELECT max(retry_count) FROM outbox.events", dbname=db) == 0
    finally:
        silent.close()


def test_the_database_cannot_choose_where_events_and_the_broker_password_go(server, db, sidecars):
    """The broker's URL is the sidecar's own: `outbox.redis_url`, the former
    name of `outbox.broker_url`, set on the database is not read, and
    without --broker-url the default stands."""
    lure = SilentBroker()
    try:
        server.sql(f"ALTER DATABASE {db} SET outbox.redis_url = 'redis://127.0.0.1:{lure.port}/0'")
        enqueue(server, db, "q_lure", 2)
        env = {name: "" for name in ("OUTBOX_BROKER_URL",)}
        sidecar = sidecars(server, db, env=env)
        wait_until(lambda: "6379" in last_error(server, db) or "6379" in sidecar.log(), timeout=60,
                   message="the default broker tried", seen=lambda: (workers(server, db), sidecar.log()))
        time.sleep(1)
        assert lure.held == [], "the database's URL was used"
    finally:
        lure.close()


def test_a_database_it_must_not_serve_is_refused_at_once(server, sidecars):
    fresh_database(server, "s_bare")
    bare = sidecars(server, "s_bare")
    assert bare.proc.wait(timeout=30) == 3
    assert "run outbox-dispatch install" in bare.log()

    fresh_database(server, "s_ext", owner="postgres")
    server.sql("CREATE EXTENSION outbox_dispatch", dbname="s_ext")
    server.sql("ALTER DATABASE s_ext OWNER TO owner")
    ext = sidecars(server, "s_ext")
    assert ext.proc.wait(timeout=30) == 3
    assert "extension outbox_dispatch is created in this database" in ext.log()
    assert server.value("SELECT count(*) FROM outbox.events", dbname="s_ext") == 0

    install(server, "s_old")
    with server.connect(dbname="s_old", user="owner") as conn:
        conn.execute("UPDATE outbox.installed SET version = '0.0.1'")
    old = sidecars(server, "s_old")
    assert old.proc.wait(timeout=30) == 3
    assert "run the outbox-dispatch of 0.0.1" in old.log()
    for name in ("s_bare", "s_ext", "s_old"):
        server.sql(f"DROP DATABASE {name} WITH (FORCE)")


# Every advisory lock 1.0.0's sidecars took: the install's, the
# dispatchers' numbers, the turns.
LOCK_CLASS = 0x6f757462


def hold_every_lock(pg, dbname, user="other"):
    """A session of `user` holding every lock it may: advisory locks in the
    ranges 1.0.0's sidecars used and beyond (a pair of int4 and a bigint),
    and, in a transaction it keeps open, every table it may lock."""
    squatter = psycopg.connect(host=str(pg.dir), port=pg.port, user=user, dbname=dbname, autocommit=True)
    squatter.execute("SELECT pg_advisory_lock(%s, n) FROM generate_series(0, 3000) AS n", (LOCK_CLASS,))
    squatter.execute("SELECT pg_advisory_lock(n) FROM generate_series(0, 1000) AS n")
    squatter.execute("BEGIN")
    for (table,) in squatter.execute(
            "SELECT c.oid::regclass::text FROM pg_class AS c WHERE c.relkind IN ('r', 'p', 'v', 'm') "
            "AND has_table_privilege(c.oid, 'SELECT')").fetchall():
        squatter.execute("SAVEPOINT s")
        try:
            squatter.execute(f"LOCK TABLE {table} IN ACCESS SHARE MODE NOWAIT")
        except psycopg.Error:
            squatter.execute("ROLLBACK TO SAVEPOINT s")
    return squatter


def test_a_role_with_connect_only_holding_every_lock_it_may_stops_nothing(server, db, redis_server, sidecars):
    """1.0.0's sidecars coordinated with advisory locks, which any role
    may take: one that held the numbers left outbox.workers empty and 0 of
    5 events sent in 30 s. The leases are rows only the owner writes: the
    same role, holding every lock it may, stops nothing."""
    squatter = hold_every_lock(server, db)
    try:
        sidecar = sidecars(server, db, broker=redis_server.url)
        ids = enqueue(server, db, "q_squat", 5)
        wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_squat")) == sorted(ids), timeout=30,
                   message="5 of 5 sent", seen=lambda: (workers(server, db), sidecar.log()[-2000:]))
        serving(server, db)
        wait_until(lambda: {"housekeeping", "reports"} <= set(leases(server, db)), message="the turns taken",
                   seen=lambda: leases(server, db))
        assert last_error(server, db) == ""
    finally:
        squatter.close()


def leases(pg, dbname):
    """{lease: backend pid} of the leases whose holder's session lives and
    that have not expired."""
    return dict(pg.sql("SELECT name, backend_pid FROM outbox.sidecar_leases "
                       "WHERE coalesce(expires_at > now(), true) AND outbox.session_lives(backend_pid, backend_role, backend_start)",
                       dbname=dbname))


def test_a_turn_that_cannot_be_had_is_named_with_who_holds_the_leases(server, db, redis_server, sidecars):
    """Only the owner's sessions may lock the leases: one that holds the
    table (a migration, a DBA's transaction) keeps the turns from being
    taken. The dispatcher says so, naming that session, in its row and its
    log; events flow all the same, and the note goes once it ends."""
    sidecar = sidecars(server, db, broker=redis_server.url)
    serving(server, db)
    locker = server.connect(dbname=db, user="owner", autocommit=False, application_name="a long migration")
    try:
        pid = locker.execute("SELECT pg_backend_pid()").fetchone()[0]
        locker.execute("LOCK TABLE outbox.sidecar_leases IN ACCESS EXCLUSIVE MODE")
        wait_until(lambda: f"role owner (pid {pid}, a long migration" in last_error(server, db), timeout=60,
                   message="the session named", seen=lambda: workers(server, db))
        assert "outbox.sidecar_leases" in sidecar.log() and f"pid {pid}" in sidecar.log()
        ids = enqueue(server, db, "q_leases_locked", 5)
        wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_leases_locked")) == sorted(ids),
                   message="5 of 5 sent")
    finally:
        locker.close()
    wait_until(lambda: last_error(server, db) == "", timeout=60, message="the note gone",
               seen=lambda: workers(server, db))


def test_a_sidecar_whose_broker_is_down_gives_the_reports_turn_back(server, db, sidecars):
    """A dispatcher keeps the reports turn's lease from one look at the
    list to the next; one that stops looking (its broker is gone) gives it
    back within seconds, for another sidecar to take: the reports of the
    database are never left to a sidecar that cannot read them."""
    first, second = Redis(), Redis()
    try:
        a = sidecars(server, db, broker=first.url)
        wait_until(lambda: "reports" in leases(server, db), message="the reports turn taken",
                   seen=lambda: (workers(server, db), a.log()))
        first.stop()
        wait_until(lambda: "reports" not in leases(server, db), timeout=30, message="the turn given back",
                   seen=lambda: (workers(server, db), a.log()))
        sidecars(server, db, broker=second.url)
        wait_until(lambda: "reports" in leases(server, db), timeout=30, message="the turn taken by the second")
        reports = f"outbox_dispatch.reports:{server.value('SELECT oid FROM pg_database WHERE datname = %s', (db,))}"
        second.client().rpush(reports, b"garbage")
        wait_until(lambda: second.client().llen(reports) == 0, timeout=30, message="the second sidecar collecting")
    finally:
        first.close()
        second.close()


def test_a_push_the_broker_holds_up_shows_within_a_second_or_two(server, db, redis_server, sidecars):
    """A dispatcher's row is written between steps; within one, what it
    does shows as the broker holds it up. Redis pauses writes just after
    a delivery (the row written idle a moment before): the row shows the
    dispatcher draining within seconds, not once the push is done."""
    set_setting(server, db, "outbox.broker_timeout", "60s")
    sidecars(server, db, broker=redis_server.url)
    serving(server, db)
    client = redis_server.client()
    first = enqueue(server, db, "q_held")
    wait_until(lambda: queued_ids(client, "q_held") == first, message="a first event sent")
    serving(server, db)
    client.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
    try:
        enqueue(server, db, "q_held")
        # Held for 30 s (the push may wait 60): no error to show, only
        # what the dispatcher does.
        wait_until(lambda: [r[1] for r in workers(server, db)] == ["draining"], timeout=20,
                   message="the held push shown", seen=lambda: workers(server, db))
    finally:
        client.execute_command("CLIENT", "UNPAUSE")
    wait_until(lambda: len(queued_ids(client, "q_held")) == 2, message="the second event sent")


def test_settings_the_database_gets_wrong_are_named_and_the_rest_flows(server, db, redis_server, sidecars):
    server.sql(f"ALTER DATABASE {db} SET outbox.batch_size = 'lots'")
    sidecar = sidecars(server, db, broker=redis_server.url)
    ids = enqueue(server, db, "q_wrong", 5)
    wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_wrong")) == sorted(ids),
               message="events sent")
    assert 'parameter "outbox.batch_size": "lots"' in last_error(server, db)
    assert 'invalid value for parameter "outbox.batch_size"' in sidecar.log()


class Pgbouncer:
    """Debian's pgbouncer in front of `pg`, in `mode` (transaction or
    session), handing out free server sessions last used first, or oldest
    first (`round_robin`); run as the postgres user (it refuses root)."""

    def __init__(self, pg, mode, round_robin=False):
        self.dir = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        shutil.chown(self.dir, "postgres", "postgres")
        self.port = free_port()
        (self.dir / "users.txt").write_text('"owner" ""\n"writer" ""\n')
        (self.dir / "pgbouncer.ini").write_text(f"""[databases]
* = host={pg.dir} port={pg.port}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir}/users.txt
pool_mode = {mode}
server_round_robin = {int(round_robin)}
default_pool_size = 20
ignore_startup_parameters = extra_float_digits
logfile = {self.dir}/pgbouncer.log
pidfile = {self.dir}/pgbouncer.pid
""")
        as_postgres("pgbouncer", "-d", self.dir / "pgbouncer.ini")
        wait_until(lambda: (self.dir / "pgbouncer.pid").exists(), message="pgbouncer started")

    def dsn(self, user, dbname):
        return f"host=127.0.0.1 port={self.port} user={user} dbname={dbname} sslmode=disable"

    def close(self):
        pid = int((self.dir / "pgbouncer.pid").read_text())
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), message="pgbouncer stopped")
        shutil.rmtree(self.dir)


@pytest.mark.parametrize("round_robin", [False, True])
def test_a_pooler_in_transaction_mode_is_refused_naming_the_cause_and_the_fix(server, db, sidecars, round_robin):
    """Through pgbouncer in transaction mode a sidecar's transactions run on
    whichever server session is free: its settings, its LISTEN and the
    lease of its number would be other clients'. It refuses to run, at
    once, saying why and what to connect through instead, whichever free
    session the pooler hands out first (the last used, or the oldest)."""
    bouncer = Pgbouncer(server, "transaction", round_robin=round_robin)
    try:
        ids = enqueue(server, db, "q_pooled", 5)
        sidecar = sidecars(server, db, "--dispatchers", "2", to=bouncer.dsn("owner", db))
        assert sidecar.proc.wait(timeout=60) == 3, sidecar.log()
        log = sidecar.log()
        assert "pooler in transaction mode" in log and "pool_mode = session" in log, log
        assert statuses(server, db) == {"pending": len(ids)}
        assert workers(server, db) == []
    finally:
        bouncer.close()


def test_a_pooler_in_session_mode_serves(server, db, redis_server, sidecars):
    bouncer = Pgbouncer(server, "session")
    try:
        sidecars(server, db, "--dispatchers", "2", broker=redis_server.url, to=bouncer.dsn("owner", db))
        ids = enqueue(server, db, "q_session", 5)
        wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_session")) == sorted(ids), timeout=60,
                   message="5 events sent through the pooler", seen=lambda: workers(server, db))
        serving(server, db, 2)
    finally:
        bouncer.close()


def own_connections(pg, dbname):
    """The backends of the sidecar's connections that are no dispatcher's:
    its listener, its status rows' writer, its /metrics gauges'."""
    return [r[0] for r in pg.sql(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = 'outbox-dispatch' "
        "AND pid NOT IN (SELECT pid FROM outbox.sidecar_workers WHERE pid IS NOT NULL)", (dbname,), dbname=dbname)]


def drain_time(pg, dbname, client, queue, n=200):
    """Seconds from the commit of `n` events to the last of them in Redis."""
    enqueue(pg, dbname, queue, n)
    started = time.monotonic()
    wait_until(lambda: len(queued_ids(client, queue)) == n, timeout=60, message=f"{n} events sent to {queue}")
    return time.monotonic() - started


def test_a_control_connection_that_hangs_and_a_scrape_that_never_reads_cost_delivery_nothing(
        server, db, redis_server, sidecars):
    """1.0.0's dispatchers wrote their rows, and /metrics read the gauges,
    on one shared connection under a lock: one that stopped answering held
    every dispatcher up. Every connection that is no dispatcher's own
    stopped (SIGSTOP), the status table locked by its owner, a scrape that
    never reads its answer and one that waits for the gauges: delivery goes
    on at its rate, and the scrapes are answered (the database down,
    outbox_up 0, while the gauges' connection is stopped; up, and the
    counters with it, once it answers again)."""
    port = free_port()
    sidecars(server, db, "--metrics-listen", f"127.0.0.1:{port}", broker=redis_server.url)
    serving(server, db)
    assert scrape(port)[0].endswith("200 OK")
    client = redis_server.client()
    before = drain_time(server, db, client, "q_before")
    stopped = own_connections(server, db)
    assert len(stopped) == 3, stopped
    locker = server.connect(dbname=db, user="owner", autocommit=False)
    silent = socket.create_connection(("127.0.0.1", port))
    try:
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        locker.execute("LOCK TABLE outbox.sidecar_workers IN ACCESS EXCLUSIVE MODE")
        silent.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        scraped = {}
        waiting = threading.Thread(target=lambda: scraped.update(answer=scrape(port)))
        waiting.start()
        during = drain_time(server, db, client, "q_during")
        assert during < 3 * before + 2, (before, during)
        waiting.join(timeout=30)
        status, body = scraped["answer"]
        served = samples(body)
        assert status.endswith("200 OK") and served[f'outbox_up{{database="{db}"}}'] == 0, served
        assert [s for s in served if not s.startswith(("outbox_up{", "outbox_scrape_duration_seconds{"))] == []
        # The lock released, the rows' writer still stopped: another writes them.
        locker.rollback()
        wait_until(lambda: server.value("SELECT events_dispatched FROM outbox.workers", dbname=db) == 400,
                   timeout=30, message="the rows written from a new connection")
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        locker.close()
        silent.close()
    wait_until(lambda: samples(scrape(port)[1]).get(f'outbox_dispatched_total{{database="{db}"}}') == 400,
               timeout=30, message="the counters served, the database answering again")


def peak_resident_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@pytest.mark.parametrize("payload", ["repeat('a', 1000000)", "(SELECT string_agg(md5(i::text || n::text), '') "
                                                            "FROM generate_series(1, 31250) AS i)"])
def test_a_dispatcher_holds_what_max_batch_bytes_allows_not_a_batch_of_events(
        server, db, redis_server, sidecars, payload):
    """What a dispatcher holds is bounded by outbox.max_batch_bytes, not by
    outbox.batch_size: 100 events of 1 MB each (compressible, whose stored
    size is a fraction of their text, and not) drain with max_batch_bytes
    64kB and the sidecar's peak resident memory grows by a few of them, not
    by the 100 (1.0.0 claimed them at once: 300 MB and more)."""
    set_setting(server, db, "outbox.max_batch_bytes", "64kB")
    set_setting(server, db, "outbox.max_payload_bytes", "2MB")
    sidecar = sidecars(server, db, broker=redis_server.url)
    serving(server, db)
    client = redis_server.client()
    assert drain_time(server, db, client, "q_warm", 5) < 30
    baseline = peak_resident_bytes(sidecar.proc.pid)
    with server.connect(dbname=db, user="writer") as conn, conn.transaction():
        conn.execute(f"SELECT outbox_enqueue('t.big', jsonb_build_object('blob', {payload}), queue => 'q_big') "
                     "FROM generate_series(1, 100) AS n")
    try:
        wait_until(lambda: client.llen("q_big") == 100, timeout=120, message="100 large events sent",
                   seen=lambda: (client.llen("q_big"), workers(server, db)))
        grown = peak_resident_bytes(sidecar.proc.pid) - baseline
        assert grown < 32 * 2**20, f"{grown / 2**20:.0f} MB"
    finally:
        client.delete("q_big")


def test_metrics_answer_garbage_with_nothing_and_show_the_library_s_names(
        server, db, redis_server, sidecars, cluster):
    port = free_port()
    sidecars(server, db, "--metrics-listen", f"127.0.0.1:{port}", broker=redis_server.url)
    serving(server, db)
    wait_until(lambda: scrape(port)[0].endswith("200 OK"), message="/metrics served")
    assert scrape(port, b"\x16\x03\x01garbage" * 2000)[0].endswith("400 Bad Request")
    assert scrape(port, b"GET /secrets HTTP/1.1\r\n\r\n")[0].endswith("404 Not Found")
    assert scrape(port, b"DELETE /metrics HTTP/1.1\r\n\r\n")[0].endswith("405 Method Not Allowed")
    with socket.create_connection(("127.0.0.1", port)):  # says nothing: given up after 5 s
        started = time.monotonic()
        assert scrape(port)[0].endswith("200 OK")
        assert time.monotonic() - started < 15

    ids = enqueue(server, db, "q_metrics", 5)
    wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_metrics")) == sorted(ids), message="sent")
    # Each sample labelled with its database, as the exporter labels the
    # library's.
    found = {re.sub(rf'database="{db}",?', "", series).replace("{}", ""): value
             for series, value in samples(scrape(port)[1]).items()}
    assert found["outbox_dispatched_total"] == 5 and found["outbox_up"] == 1
    assert found["outbox_workers_running"] == 1 and found["outbox_workers_connected"] == 1
    assert found['outbox_events{status="dispatched"}'] == 5
    # The library's names, but for what only its SQL functions count:
    # shown not at all rather than as a zero.
    assert 'outbox_acked_total{source="celery"}' in found and 'outbox_acked_total{source="sql"}' not in found
    library = {r[0] for r in cluster.sql("SELECT DISTINCT name FROM outbox.metrics")}
    names = {re.sub(r"\{.*", "", series) for series in found}
    exporter_own = {"outbox_up", "outbox_scrape_duration_seconds"}
    assert names == library - {"outbox_inbox_duplicates_total"} | exporter_own, (names ^ library)


def answer(port, path):
    """The status line of a GET of `path`; "" while nothing listens."""
    try:
        return scrape(port, f"GET {path} HTTP/1.1\r\n\r\n".encode())[0]
    except OSError:
        return ""


def test_healthz_says_alive_and_readyz_only_with_the_database_and_the_broker(server, db, redis_server, sidecars):
    port = free_port()
    down = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    sidecar = sidecars(server, db, "--metrics-listen", f"127.0.0.1:{port}", broker=down)
    wait_until(lambda: answer(port, "/healthz").endswith("200 OK"), message="/healthz")
    wait_until(lambda: workers(server, db), message="a dispatcher with its number")
    for _ in range(3):
        status, body = scrape(port, b"GET /readyz HTTP/1.1\r\n\r\n")
        assert status.endswith("503 Service Unavailable") and "not ready" in body, (status, body)
        time.sleep(0.5)
    sidecar.stop()
    port = free_port()
    sidecar = sidecars(server, db, "--metrics-listen", f"127.0.0.1:{port}", broker=redis_server.url)
    serving(server, db)
    wait_until(lambda: answer(port, "/readyz").endswith("200 OK"), message="/readyz")
    assert "ready: 1 of 1" in scrape(port, b"GET /readyz HTTP/1.1\r\n\r\n")[1]
    # The database gone from under the dispatcher: not ready until it connects again.
    server.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'outbox-dispatch' "
               "AND datname = %s", (db,))
    wait_until(lambda: answer(port, "/readyz").endswith("503 Service Unavailable"),
               message="not ready without the database")
    wait_until(lambda: answer(port, "/readyz").endswith("200 OK"), timeout=60,
               message="ready again")
    assert answer(port, "/healthz").endswith("200 OK")


def test_log_lines_as_json_parse_and_the_level_leaves_out_what_is_below_it(server, db, redis_server, sidecars):
    secret = "S3CRET-json"
    sidecar = sidecars(server, db, "--log-format", "json", broker=f"redis://:{secret}@127.0.0.1:{free_port()}/0")
    wait_until(lambda: "running 1 dispatcher" in sidecar.log(), timeout=60, message="started", seen=sidecar.log)
    sidecar.stop()
    lines = [json.loads(line) for line in sidecar.log().splitlines()]
    assert {"time", "level", "severity", "message", "pid"} <= set(lines[0])
    assert {line["level"] for line in lines} >= {"info", "warning"}
    assert any("running 1 dispatcher" in line["message"] for line in lines), sidecar.log()
    assert secret not in sidecar.log()
    quiet = sidecars(server, db, env={"OUTBOX_LOG_LEVEL": "warning"}, broker=redis_server.url)
    serving(server, db)
    quiet.stop()
    assert "running 1 dispatcher" not in quiet.log() and "LOG:" not in quiet.log()


def test_an_owner_blind_to_other_roles_transactions_truncates_nothing_under_their_snapshots(
        server, redis_server, sidecars):
    """Without pg_read_all_stats, another role's open transaction reads as
    none. A rotation that trusted that would truncate, under a writer's
    REPEATABLE READ snapshot, the generation its event was moved out of:
    its outbox_ack() would then find the event nowhere."""
    server.sql("DROP ROLE IF EXISTS blind")
    server.sql("CREATE ROLE blind LOGIN")
    install(server, "s_blind", owner="blind")
    try:
        for name, value in [("outbox.retention", "2s"), ("outbox.lifecycle_interval", "1s"),
                            ("outbox.ack_timeout", "1h")]:
            set_setting(server, "s_blind", name, value, owner="blind")
        sidecar = sidecars(server, "s_blind", broker=redis_server.url, owner="blind")
        serving(server, "s_blind")
        current = "SELECT generation FROM outbox.generations WHERE ended_at IS NULL"
        generation = server.value(current, dbname="s_blind")
        [sent] = enqueue(server, "s_blind", "q_blind")
        wait_until(lambda: queued_ids(redis_server.client(), "q_blind") == [sent], message="sent")
        with server.connect(dbname="s_blind", user="writer", autocommit=False) as reader:
            reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            reader.execute("SELECT 1")  # the snapshot
            wait_until(lambda: server.value(current, dbname="s_blind") != generation, timeout=30,
                       message="the event's generation ended")
            time.sleep(6)  # ended three retentions ago: due for its truncation
            assert reader.execute("SELECT outbox_ack(%s)", (sent,)).fetchone()[0] is True
            reader.commit()
        assert "pg_read_all_stats" in last_error(server, "s_blind")
        assert "pg_read_all_stats" in sidecar.log()
        # Once its transaction ended, the reader holds nothing back (looked
        # at as blind, whose own sessions it sees: the suite's superuser's
        # would hold the rotation back too).

        def began(blind):
            return blind.execute("SELECT started_at FROM outbox.generations WHERE generation = %s",
                                 (generation,)).fetchone()[0]

        with server.connect(dbname="s_blind", user="blind") as blind:
            first = began(blind)
            wait_until(lambda: began(blind) != first, timeout=60, interval=0.5,
                       message="the event's generation truncated and begun again")
    finally:
        server.sql("DROP DATABASE s_blind WITH (FORCE)")
        server.sql("DROP ROLE blind")


# -- what must survive -----------------------------------------------------------------------------

def test_a_sidecar_killed_mid_drain_loses_nothing_and_sends_no_rolled_back_event(
        server, db, redis_server, sidecars):
    set_setting(server, db, "outbox.batch_size", "50")
    set_setting(server, db, "outbox.report_key", "")
    committed = enqueue(server, db, "q_kill", 20_000)
    with server.connect(dbname=db, user="writer", autocommit=False) as conn:
        rolled_back = [str(r[0]) for r in conn.execute(
            "SELECT outbox_enqueue('t.run', '{}', queue => 'q_kill') FROM generate_series(1, 100)").fetchall()]
        conn.rollback()
    # Killed while a pushed batch's mark waits, 1,000 events or more sent.
    with drain_held(server, until=lambda: redis_server.client().llen("q_kill") >= 1000, dbname=db,
                    begin=lambda: sidecars(server, db, broker=redis_server.url)) as held:
        held.begun.proc.kill()
        held.begun.proc.wait()
    sidecars(server, db, broker=redis_server.url)
    wait_until(lambda: set(queued_ids(redis_server.client(), "q_kill")) >= set(committed), timeout=120,
               message="every committed event sent")
    sent = set(queued_ids(redis_server.client(), "q_kill"))
    assert not sent & set(rolled_back)
    wait_until(lambda: statuses(server, db) == {"dispatched": len(committed)}, message="all marked",
               seen=lambda: statuses(server, db))


def test_a_cut_connection_is_made_again(server, db, redis_server, sidecars):
    sidecar = sidecars(server, db, broker=redis_server.url)
    serving(server, db)
    first = enqueue(server, db, "q_cut", 10)
    wait_until(lambda: len(queued_ids(redis_server.client(), "q_cut")) == 10, message="sent before the cut")
    cut = server.value("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                       "WHERE application_name = 'outbox-dispatch' AND datname = %s", (db,))
    assert cut >= 2  # the dispatcher's and the control connection
    second = enqueue(server, db, "q_cut", 10)
    wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_cut")) == sorted(first + second), timeout=60,
               message="sent after the cut")
    assert "connecting again" in sidecar.log()
    assert sidecar.proc.poll() is None


def test_three_sidecars_share_the_work_and_claim_nothing_twice(server, db, redis_server, sidecars):
    set_setting(server, db, "outbox.batch_size", "20")
    for _ in range(3):
        sidecars(server, db, broker=redis_server.url)
    serving(server, db, 3)
    ids = []

    def produce():
        for _ in range(30):
            ids.extend(enqueue(server, db, "q_three", 100))

    producers = [threading.Thread(target=produce) for _ in range(2)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    wait_until(lambda: redis_server.client().llen("q_three") >= len(ids), timeout=120, message="all sent")
    time.sleep(1)
    sent = queued_ids(redis_server.client(), "q_three")
    assert len(sent) == len(ids) == 6000 and set(sent) == set(ids), "each sent once"
    rows = workers(server, db)
    assert [r[0] for r in rows] == [0, 1, 2]
    assert sum(r[3] for r in rows) == 6000


def test_a_multi_host_dsn_follows_the_promoted_primary(redis_server, sidecars):
    """target_session_attrs=read-write: the sidecar connects to the primary
    of the two, and after a failover to the standby it promoted; what was
    committed on the old primary and replicated is sent, once at least."""
    with plain_server() as primary:
        install(primary, "app_ha")
        standby = Standby(primary)
        try:
            both = (f"host={primary.dir},{standby.dir} port={primary.port},{standby.port} user=owner "
                    "dbname=app_ha target_session_attrs=read-write sslmode=disable")
            sidecar = sidecars(primary, "app_ha", broker=redis_server.url, to=both)
            serving(primary, "app_ha")
            before = enqueue(primary, "app_ha", "q_ha", 20)
            wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_ha")) == sorted(before),
                       message="sent by the first primary")
            lsn = primary.value("SELECT pg_current_wal_lsn()::text")
            wait_until(lambda: standby.value("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)),
                       message="the standby caught up")
            primary.stop("immediate")
            standby.pg_ctl("promote")
            wait_until(lambda: standby.value("SELECT NOT pg_is_in_recovery()"), message="promoted")
            after = enqueue(standby, "app_ha", "q_ha", 20)
            wait_until(lambda: set(queued_ids(redis_server.client(), "q_ha")) >= set(before + after),
                       timeout=120, message="sent by the promoted standby", seen=sidecar.log)
            assert sidecar.proc.poll() is None
            assert "connecting again" in sidecar.log()
        finally:
            standby.close()


def test_sigterm_mid_drain_is_prompt_and_what_was_claimed_goes_again(server, db, redis_server, sidecars):
    set_setting(server, db, "outbox.batch_size", "100")
    ids = enqueue(server, db, "q_term", 20_000)
    # Stopped while a pushed batch's mark waits, 500 events or more sent;
    # the mark goes on as the stop begins.
    with drain_held(server, until=lambda: redis_server.client().llen("q_term") >= 500, dbname=db,
                    begin=lambda: sidecars(server, db, broker=redis_server.url)) as held:
        sidecar = held.begun
        status, took = sidecar.stop(meanwhile=held.release)
    assert status == 0 and took < 10, (status, took)
    assert "stopped" in sidecar.log()
    assert server.value("SELECT state FROM outbox.workers", dbname=db) == "stopped"
    sidecars(server, db, broker=redis_server.url)
    wait_until(lambda: set(queued_ids(redis_server.client(), "q_term")) >= set(ids), timeout=120,
               message="the rest sent by the next")


def test_sigterm_mid_drain_marks_every_push_it_made_before_it_exits(server, db, redis_server, sidecars):
    """The push in flight at a SIGTERM is finished and marked, within the
    stop's bound: nothing that reached the broker is left processing, or
    pending to go again."""
    set_setting(server, db, "outbox.batch_size", "100")
    ids = enqueue(server, db, "q_marked", 20_000)
    for _ in range(3):
        seen = redis_server.client().llen("q_marked")
        # Stopped while a pushed batch's mark waits, 500 events or more
        # sent by this one; the mark goes on as the stop begins.
        with drain_held(server, until=lambda: redis_server.client().llen("q_marked") >= seen + 500, dbname=db,
                        begin=lambda: sidecars(server, db, broker=redis_server.url)) as held:
            status, took = held.begun.stop(meanwhile=held.release)
        assert status == 0 and took < 10, (status, took)
        sent = set(queued_ids(redis_server.client(), "q_marked"))
        rows = dict(server.sql("SELECT id::text, status FROM outbox.events WHERE queue = 'q_marked'", dbname=db))
        unmarked = [i for i in sent if rows.get(i) != "dispatched"]
        assert unmarked == [], f"{len(unmarked)} pushed and not marked, e.g. {unmarked[:3]}"
        assert "processing" not in statuses(server, db)
    sidecars(server, db, broker=redis_server.url)
    wait_until(lambda: len(queued_ids(redis_server.client(), "q_marked")) >= len(ids), timeout=120,
               message="the rest sent by the next")
    assert sorted(queued_ids(redis_server.client(), "q_marked")) == sorted(ids), "each sent once"


# -- the happy paths -------------------------------------------------------------------------------

def test_sighup_reads_the_settings_again(server, db, redis_server, sidecars):
    sidecar = sidecars(server, db, broker=redis_server.url)
    serving(server, db)
    set_setting(server, db, "outbox.enabled", "off")
    sidecar.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: workers(server, db)[0][1] == "paused", message="paused")
    ids = enqueue(server, db, "q_hup", 3)
    time.sleep(1)
    assert redis_server.client().llen("q_hup") == 0
    set_setting(server, db, "outbox.enabled", "on")
    sidecar.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_hup")) == sorted(ids), message="sent on resuming")
    assert "reading the settings again" in sidecar.log()


def test_a_notify_wakes_the_sidecar_long_before_its_poll(server, db, redis_server, sidecars):
    set_setting(server, db, "outbox.poll_interval", "1h")
    set_setting(server, db, "outbox.report_key", "")  # no collection of reports to wake it
    sidecars(server, db, "--poll-interval", "1h", broker=redis_server.url)
    serving(server, db)
    time.sleep(1)  # the listener is listening
    quiet = enqueue(server, db, "q_notify", 2)
    time.sleep(2)
    assert redis_server.client().llen("q_notify") == 0, "nothing but a NOTIFY or the poll wakes it"
    loud = enqueue(server, db, "q_notify", 2, notify=True)
    wait_until(lambda: set(queued_ids(redis_server.client(), "q_notify")) == set(quiet + loud), timeout=10,
               message="a NOTIFY's events sent")
    with psycopg.connect(host=str(server.dir), port=server.port, user="owner", dbname=db, autocommit=True) as conn:
        later = [str(conn.execute("SELECT outbox_enqueue('t.run', '{}', queue => 'q_notify')").fetchone()[0])]
        conn.execute("SELECT outbox_wake()")
    wait_until(lambda: set(queued_ids(redis_server.client(), "q_notify")) == set(quiet + loud + later), timeout=10,
               message="outbox_wake()'s events sent")


def test_an_idle_sidecar_polls_without_writing(server, db, redis_server, sidecars):
    """Fifty polls a second (the default): each reads the claim's index,
    none claims (an empty claim writes its position and takes a transaction
    id)."""
    sidecars(server, db, broker=redis_server.url)
    serving(server, db)
    time.sleep(1)
    claims = "SELECT n_tup_ins FROM pg_stat_all_tables WHERE relid = 'outbox.positions'::regclass"
    before, xid = server.value(claims, dbname=db), server.value("SELECT pg_current_xact_id()::text::bigint")
    time.sleep(3)
    assert server.value(claims, dbname=db) - before <= 1
    # 150 polls: a write each would take 150 transaction ids. A few are the
    # leases' (a turn unused 2 s is given back, housekeeping takes its
    # turn), more on a loaded machine, whose slower steps hold turns longer.
    assert server.value("SELECT pg_current_xact_id()::text::bigint") - xid <= 15
    # Anyone may NOTIFY the channels it listens on: a forged wake costs a
    # read-only look, not a claim.
    with server.connect(dbname=db, user="writer") as conn:
        for _ in range(200):
            conn.execute("NOTIFY outbox_dispatch_wake")
            conn.execute("NOTIFY outbox_new")
    time.sleep(2)
    assert server.value(claims, dbname=db) - before <= 1
    ids = enqueue(server, db, "q_idle", 3)
    wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_idle")) == sorted(ids), timeout=10,
               message="a poll finds them")


def test_a_poll_finds_delayed_events_and_due_batches(server, db, redis_server, sidecars):
    """What no claim range holds, a poll must find too: an event whose delay
    ends, a subscription's batch that is due."""
    set_setting(server, db, "outbox.poll_interval", "1h")
    sidecars(server, db, broker=redis_server.url)
    serving(server, db)
    time.sleep(1)
    with server.connect(dbname=db, user="writer") as conn:
        delayed = str(conn.execute("SELECT outbox_enqueue('t.run', '{}', queue => 'q_delay', "
                                   "delay => interval '1 second')").fetchone()[0])
    wait_until(lambda: queued_ids(redis_server.client(), "q_delay") == [delayed], timeout=15,
               message="the delayed event, once its delay ended")
    with server.connect(dbname=db, user="owner") as conn:
        conn.execute("SELECT outbox_subscribe('t.batched', 't.batch', queue => 'q_batch', batch_max => 2, "
                     "batch_wait => interval '1 hour')")
    with server.connect(dbname=db, user="writer") as conn:
        conn.execute("SELECT outbox_enqueue('t.batched', '{}') FROM generate_series(1, 2)")
    wait_until(lambda: redis_server.client().llen("q_batch") == 1, timeout=15, message="the batch of two")


def test_events_flow_and_the_views_show_the_sidecar(server, db, redis_server, sidecars):
    sidecars(server, db, "--dispatchers", "2", broker=redis_server.url)
    serving(server, db, 2)
    ids = enqueue(server, db, "q_flow", 200)
    wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_flow")) == sorted(ids), message="sent")
    rows = server.sql("SELECT worker, pid, connected, started_at IS NOT NULL, database FROM outbox.workers "
                      "ORDER BY worker", dbname=db)
    assert [(r[0], r[2], r[3], r[4]) for r in rows] == [(0, True, True, db), (1, True, True, db)]
    backends = server.sql("SELECT pid FROM pg_stat_activity WHERE application_name = 'outbox-dispatch'")
    assert {r[1] for r in rows} <= {r[0] for r in backends}, "pid is the dispatcher's backend"
    wait_until(lambda: statuses(server, db) == {"dispatched": 200}, message="marked")
