"""What CREATE EXTENSION and ALTER EXTENSION … UPDATE bind for good: every
operator, function, type and cast of every install and upgrade script is
pg_catalog's or the extension's own, whatever a hostile database owner
planted in the schema the scripts run in (public, which the owner controls)
before the superuser ran them.

Checked two ways: a catalog check that no object of the extension (views,
indexes, defaults, constraints, generated columns, triggers, functions)
depends on anything outside pg_catalog and the extension, and the behaviour:
with the plants in place a superuser reads every view, subscribes,
enqueues, acknowledges, and the dispatchers run; no planted code ever runs."""

import difflib
import time

import pytest

from harness import PG_BIN, Cluster, as_postgres, queued_ids, wait_until

CURRENT = "1.1.0"
# The update chain: 0.8.0's install script (tests/fixtures), then each
# update. PostgreSQL installs a later one of them as 0.8.0 and the updates.
RELEASES = ["0.8.0", "0.9.0", "0.10.0", "1.0.0"]

# Every object of the extension and everything owned by one of them (an
# index, a view's rule, a default, a constraint, a trigger), then whatever
# they reference that is not one of them, the extension, its schemas or
# pg_catalog. PostgreSQL records no dependency on its pinned (initdb)
# objects, and plpgsql is a language, not code of the owner's.
FOREIGN_DEPENDENCIES = """
WITH RECURSIVE ours(classid, objid) AS (
    SELECT d.classid, d.objid
      FROM pg_catalog.pg_depend AS d
      JOIN pg_catalog.pg_extension AS x ON x.oid OPERATOR(pg_catalog.=) d.refobjid
     WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass
       AND x.extname OPERATOR(pg_catalog.=) 'outbox_dispatch'
       AND d.deptype OPERATOR(pg_catalog.=) 'e'
    UNION
    SELECT d.classid, d.objid
      FROM pg_catalog.pg_depend AS d
      JOIN ours AS o ON o.classid OPERATOR(pg_catalog.=) d.refclassid AND o.objid OPERATOR(pg_catalog.=) d.refobjid
     WHERE d.deptype OPERATOR(pg_catalog.=) ANY ('{a,i}'::pg_catalog."char"[])
)
SELECT pg_catalog.pg_describe_object(d.classid, d.objid, d.objsubid),
       pg_catalog.pg_describe_object(d.refclassid, d.refobjid, d.refobjsubid)
  FROM pg_catalog.pg_depend AS d
  JOIN ours AS o ON o.classid OPERATOR(pg_catalog.=) d.classid AND o.objid OPERATOR(pg_catalog.=) d.objid
 WHERE NOT EXISTS (SELECT FROM ours AS r
                    WHERE r.classid OPERATOR(pg_catalog.=) d.refclassid
                      AND r.objid OPERATOR(pg_catalog.=) d.refobjid)
   AND d.refclassid OPERATOR(pg_catalog.<>) 'pg_catalog.pg_extension'::pg_catalog.regclass
   AND d.refclassid OPERATOR(pg_catalog.<>) 'pg_catalog.pg_language'::pg_catalog.regclass
   AND NOT (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_namespace'::pg_catalog.regclass
            AND d.refobjid OPERATOR(pg_catalog.=) ANY (ARRAY[
                'outbox'::pg_catalog.regnamespace::pg_catalog.oid,
                (SELECT x.extnamespace FROM pg_catalog.pg_extension AS x
                  WHERE x.extname OPERATOR(pg_catalog.=) 'outbox_dispatch')]))
   AND (pg_catalog.pg_identify_object(d.refclassid, d.refobjid, 0)).schema IS DISTINCT FROM 'pg_catalog'
 ORDER BY 1, 2
"""

# Every planted function counts its calls in public.planted_calls, and makes
# the owner a superuser when a superuser calls it.
PLANT_PRELUDE = """
CREATE SEQUENCE public.planted_calls;
GRANT USAGE ON SEQUENCE public.planted_calls TO PUBLIC;
CREATE FUNCTION public.planted() RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_catalog.nextval('public.planted_calls'::pg_catalog.regclass);
    IF pg_catalog.current_setting('is_superuser') OPERATOR(pg_catalog.=) 'on' THEN
        EXECUTE 'ALTER ROLE mallory SUPERUSER';
    END IF;
    RETURN true;
END $$;
GRANT EXECUTE ON FUNCTION public.planted() TO PUBLIC;
"""

# Operators a script could bind: (name, left, right, what it really does).
# Better matches than pg_catalog's (an enum against text, oid against
# regclass) win overload resolution; identical ones win where the owner's
# search_path puts public first.
OPERATORS = [
    ("=", "oid", "regclass", "$1 OPERATOR(pg_catalog.=) $2::pg_catalog.oid"),
    ("=", "anyenum", "text", "$1::pg_catalog.text OPERATOR(pg_catalog.=) $2"),
    ("<>", "anyenum", "text", "$1::pg_catalog.text OPERATOR(pg_catalog.<>) $2"),
    ("=", "uuid", "uuid", "$1 OPERATOR(pg_catalog.=) $2"),
    ("=", "integer", "integer", "$1 OPERATOR(pg_catalog.=) $2"),
    ("=", "bigint", "bigint", "$1 OPERATOR(pg_catalog.=) $2"),
    ("=", "text", "text", "$1 OPERATOR(pg_catalog.=) $2"),
    ("<=", "timestamptz", "timestamptz", "$1 OPERATOR(pg_catalog.<=) $2"),
    ("<", "timestamptz", "timestamptz", "$1 OPERATOR(pg_catalog.<) $2"),
    (">", "integer", "integer", "$1 OPERATOR(pg_catalog.>) $2"),
    ("<=", "integer", "integer", "$1 OPERATOR(pg_catalog.<=) $2"),
    (">=", "integer", "integer", "$1 OPERATOR(pg_catalog.>=) $2"),
]

# Once the extension's types exist (before an update), exact matches on them.
TYPE_OPERATORS = [
    ("=", "outbox.event_status", "outbox.event_status", "$1::pg_catalog.text OPERATOR(pg_catalog.=) $2::pg_catalog.text"),
    ("=", "outbox.event_status", "text", "$1::pg_catalog.text OPERATOR(pg_catalog.=) $2"),
    ("<>", "outbox.event_status", "outbox.event_status", "$1::pg_catalog.text OPERATOR(pg_catalog.<>) $2::pg_catalog.text"),
]

# Functions: (signature, return type, what it really does).
FUNCTIONS = [
    ("nextval(text)", "bigint", "pg_catalog.nextval($1::pg_catalog.regclass)"),
    ("now()", "timestamptz", "pg_catalog.now()"),
    ("to_regclass(text)", "regclass", "pg_catalog.to_regclass($1)"),
    ("octet_length(text)", "integer", "pg_catalog.octet_length($1)"),
    ("jsonb_typeof(jsonb)", "text", "pg_catalog.jsonb_typeof($1)"),
    ("current_setting(text, boolean)", "text", "pg_catalog.current_setting($1, $2)"),
    ("right(text, integer)", "text", "pg_catalog.\"right\"($1, $2)"),
    ("left(text, integer)", "text", "pg_catalog.\"left\"($1, $2)"),
    ("strpos(text, text)", "integer", "pg_catalog.strpos($1, $2)"),
    ("starts_with(text, text)", "boolean", "pg_catalog.starts_with($1, $2)"),
    ("date_part(text, timestamptz)", "double precision", "pg_catalog.date_part($1, $2)"),
    ("date_part(text, interval)", "double precision", "pg_catalog.date_part($1, $2)"),
    ("clock_timestamp()", "timestamptz", "pg_catalog.clock_timestamp()"),
    ("pg_column_size(jsonb)", "integer", "pg_catalog.pg_column_size($1)"),
    ("jsonb_build_object(text, uuid, text, bigint)", "jsonb",
     "pg_catalog.jsonb_build_object($1, $2, $3, $4)"),
    ("pg_extension_config_dump(text, text)", "void", "pg_catalog.pg_extension_config_dump($1::pg_catalog.regclass, $2)"),
]


# Types a function body may name: a domain's check runs code.
DOMAINS = ["timestamptz", "uuid", "jsonb", "interval", "int4", "int8"]


def plant(conn, operators, functions=(), domains=()):
    """As the owner: every operator, function and domain given, in public,
    each calling public.planted() and then doing what the real one does."""
    for name in domains:
        conn.execute(f"CREATE DOMAIN public.{name} AS pg_catalog.{name} CHECK (public.planted())")
    for i, (name, left, right, real) in enumerate(operators):
        fn = f"public.planted_op_{abs(hash((name, left, right))) % 10**8}"
        conn.execute(f"""
            CREATE OR REPLACE FUNCTION {fn}({left}, {right}) RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
            BEGIN PERFORM public.planted(); RETURN {real}; END $$;
            CREATE OPERATOR public.{name} (leftarg = {left}, rightarg = {right}, function = {fn})""")
    for signature, returns, real in functions:
        body = f"PERFORM {real}; RETURN;" if returns == "void" else f"RETURN {real};"
        conn.execute(f"""
            CREATE FUNCTION public.{signature} RETURNS {returns} LANGUAGE plpgsql AS $$
            BEGIN PERFORM public.planted(); {body} END $$""")


def inspect(pg, dbname):
    """A connection for the test's own queries, which must not call what
    the owner planted either."""
    conn = pg.connect(dbname=dbname)
    conn.execute("SET search_path = pg_catalog, pg_temp")
    return conn


def planted_calls(pg, dbname):
    with inspect(pg, dbname) as conn:
        last, called = conn.execute("SELECT last_value, is_called FROM public.planted_calls").fetchone()
    return last if called else 0


def foreign_dependencies(pg, dbname):
    with inspect(pg, dbname) as conn:
        return conn.execute(FOREIGN_DEPENDENCIES).fetchall()


def hostile_database(pg, name):
    """A database owned by mallory, who planted everything and put public
    first in its search_path."""
    pg.sql(f"CREATE DATABASE {name} OWNER mallory")
    with pg.connect(dbname=name, user="mallory") as conn:
        conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        conn.execute(PLANT_PRELUDE)
        plant(conn, OPERATORS, FUNCTIONS, DOMAINS)
        conn.execute(f"ALTER DATABASE {name} SET search_path = public, pg_catalog")


def install(pg, dbname, path):
    """CREATE EXTENSION at the first version of `path`, then each update,
    the owner planting operators on the extension's types before each."""
    with pg.connect(dbname=dbname) as conn:
        conn.execute(f"CREATE EXTENSION outbox_dispatch VERSION '{path[0]}'")
    with pg.connect(dbname=dbname) as conn:
        # The owner's application uses the outbox.
        conn.execute("GRANT USAGE ON SCHEMA outbox TO mallory")
    for version in path[1:]:
        with pg.connect(dbname=dbname, user="mallory") as conn:
            conn.execute("DROP OPERATOR IF EXISTS public.= (outbox.event_status, outbox.event_status), "
                         "public.= (outbox.event_status, text), public.<> (outbox.event_status, outbox.event_status)")
            plant(conn, TYPE_OPERATORS)
        with pg.connect(dbname=dbname) as conn:
            conn.execute(f"ALTER EXTENSION outbox_dispatch UPDATE TO '{version}'")


PATHS = {
    "fresh": [CURRENT],
    **{f"from {r}": RELEASES[RELEASES.index(r):] + [CURRENT] for r in RELEASES},
}


@pytest.fixture(scope="module")
def hostile(redis_server):
    pg = Cluster(redis_server.url, database="postgres", poll_interval="1s", sweep_interval="1s",
                 lifecycle_interval="1s", heartbeat_interval="1s", report_key="outbox_dispatch.reports.hostile")
    try:
        pg.sql("CREATE ROLE mallory LOGIN")
        yield pg
    finally:
        pg.close()


def installed(pg, path):
    """The hostile database where `path` (a key of PATHS) was installed,
    made the first time it is asked for."""
    dbname = "hostile_" + path.replace("from ", "").replace(".", "_")
    if not pg.value("SELECT count(*) FROM pg_database WHERE datname = %s", (dbname,)):
        hostile_database(pg, dbname)
        install(pg, dbname, PATHS[path])
    return dbname


# Functions of the extension outside its schema (pgrx declares its own
# without naming one: they must not land in pg_catalog).
# Functions are in the extension's schema, or in schema outbox, which the
# extension creates itself (CREATE SCHEMA fails on one planted before).
MISPLACED = """
SELECT p.oid::regprocedure::text
  FROM pg_proc AS p
  JOIN pg_depend AS d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e'
  JOIN pg_extension AS x ON x.oid = d.refobjid AND x.extname = 'outbox_dispatch'
 WHERE p.pronamespace NOT IN (x.extnamespace, 'outbox'::regnamespace)
"""


@pytest.mark.parametrize("path", PATHS)
def test_no_script_binds_an_object_the_owner_planted(hostile, path):
    dbname = installed(hostile, path)
    assert foreign_dependencies(hostile, dbname) == []
    assert planted_calls(hostile, dbname) == 0, "a script ran planted code"
    with inspect(hostile, dbname) as conn:
        assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'outbox_dispatch'").fetchone()[0] \
            == CURRENT
        assert conn.execute(MISPLACED).fetchall() == []


def exercise(pg, dbname, redis_server):
    """As a superuser in the owner's database, with the owner's search_path:
    every view, every function, and the dispatchers deliver."""
    queue = f"q_{dbname}"
    with pg.connect(dbname=dbname) as conn:
        assert conn.execute("SHOW search_path").fetchone()[0] == "public, pg_catalog"
        for view in ["status", "workers", "metrics", "dead_letters", "subscriptions", "deliveries"]:
            conn.execute(f"TABLE outbox.{view}").fetchall()
        conn.execute("SELECT outbox_metrics_prometheus()")
        subs = conn.execute(
            "SELECT outbox_subscribe('hostile.routed', 'task.now', queue => %s), "
            "outbox_subscribe('hostile.routed', 'task.batch', queue => %s, batch_max => 2)",
            (queue, queue)).fetchone()
        ids = [str(r[0]) for r in conn.execute(
            "SELECT outbox_enqueue('hostile', '{}', queue => %s) FROM generate_series(1, 3)", (queue,))]
        conn.execute("SELECT outbox_enqueue('hostile.routed', '{}') FROM generate_series(1, 2)")
        conn.execute("INSERT INTO outbox.events (event_type, queue) VALUES ('hostile.orm', %s)", (queue,))
        conn.execute("SELECT outbox_retry_failed(), outbox_wake()")
    wait_until(lambda: len(queued_ids(redis_server.client(), queue)) >= 3 + 2 + 1 + 1, timeout=60,
               message=f"delivery in {dbname}")
    with pg.connect(dbname=dbname) as conn:
        # Once sent: an acknowledgement of a pending event would finish it
        # unsent (a re-send's case), and the count above would never come.
        conn.execute("SELECT outbox_ack(%s)", (ids[0],))
        conn.execute("SELECT outbox_retry(%s)", (ids[1],))
        for sub in subs:
            assert conn.execute("SELECT outbox_unsubscribe(%s)", (sub,)).fetchone()[0] is True
        for view in ["status", "workers", "metrics", "dead_letters", "subscriptions", "deliveries", "unreported",
                     "events"]:
            conn.execute(f"TABLE outbox.{view}").fetchall()


@pytest.mark.parametrize("path", ["fresh", f"from {RELEASES[0]}"])
def test_with_everything_planted_a_superuser_and_the_dispatchers_run_no_planted_code(hostile, redis_server, path):
    dbname = installed(hostile, path)
    hostile.configure(database=dbname)
    wait_until(lambda: hostile.value("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                                     "AND backend_type = 'outbox dispatcher'", (dbname,)) == 1,
               timeout=60, message=f"the dispatcher connected to {dbname}")
    exercise(hostile, dbname, redis_server)
    time.sleep(3)  # heartbeats, sweeps, purges and report collection run meanwhile
    assert planted_calls(hostile, dbname) == 0
    assert hostile.value("SELECT rolsuper FROM pg_roles WHERE rolname = 'mallory'") is False


MEMBERS = """
SELECT pg_describe_object(classid, objid, objsubid)
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'outbox_dispatch')
 ORDER BY 1
"""
CONFIG_DUMPED = """
SELECT c::regclass::text, coalesce(cond, '')
  FROM pg_extension, unnest(extconfig, extcondition) AS u(c, cond)
 WHERE extname = 'outbox_dispatch'
 ORDER BY 1
"""


def dumped_schema(pg, dbname):
    """`pg_dump --schema-only` of what the extension made in `dbname`, as
    if the database had made it (pg_dump leaves an extension's members out):
    dumped from a copy whose members are let go, with their privileges in
    full. pg_dump's own comments and \\restrict lines dropped."""
    copy = dbname + "_members"
    pg.sql(f"CREATE DATABASE {copy} TEMPLATE {dbname}")
    try:
        with pg.connect(dbname=copy) as conn:
            conn.execute("DELETE FROM pg_catalog.pg_init_privs WHERE privtype = 'e'")
            conn.execute("DELETE FROM pg_catalog.pg_depend "
                         " WHERE refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass "
                         "   AND refobjid = (SELECT oid FROM pg_catalog.pg_extension "
                         "                    WHERE extname = 'outbox_dispatch')")
            conn.execute("DELETE FROM pg_catalog.pg_extension WHERE extname = 'outbox_dispatch'")
        dump = as_postgres(PG_BIN / "pg_dump", "--schema-only", "-h", pg.dir, "-p", pg.port, "-d", copy).stdout
    finally:
        pg.sql(f"DROP DATABASE {copy}")
    return [line for line in dump.splitlines()
            if line.strip() and not line.startswith(("--", "\\restrict", "\\unrestrict"))]


def test_a_database_updated_step_by_step_equals_a_fresh_install(redis_server):
    """Installed at 0.8.0 and updated one release at a time, a database has
    the same schema as one where the current version was installed: the
    same columns in the same order, constraints, indexes, triggers, views,
    functions, comments and privileges, as pg_dump writes them."""
    pg = Cluster(redis_server.url)
    try:
        pg.sql("CREATE DATABASE updated")
        pg.sql("CREATE DATABASE fresh")
        pg.sql(f"CREATE EXTENSION outbox_dispatch VERSION '{RELEASES[0]}'", dbname="updated")
        for version in RELEASES[1:] + [CURRENT]:
            pg.sql(f"ALTER EXTENSION outbox_dispatch UPDATE TO '{version}'", dbname="updated")
        pg.sql("CREATE EXTENSION outbox_dispatch", dbname="fresh")
        # What pg_dump leaves out of an extension's members: which objects
        # are members, and which tables' rows a dump keeps.
        for query in (MEMBERS, CONFIG_DUMPED):
            assert pg.sql(query, dbname="updated") == pg.sql(query, dbname="fresh"), query
        fresh, updated = dumped_schema(pg, "fresh"), dumped_schema(pg, "updated")
        assert len(fresh) > 500, fresh
        assert updated == fresh, "\n".join(difflib.unified_diff(fresh, updated, "fresh", "updated", lineterm=""))
    finally:
        pg.close()


def test_the_update_from_1_0_0_takes_back_updates_of_the_table_from_every_role_but_the_owner(redis_server):
    """1.0.0's docs granted operators UPDATE on outbox.log, which writes an
    event's place in line and its key's turn: the update revokes it, on the
    table and on any of its columns, from every role but the owner, naming
    each; the view's UPDATE and the writers' INSERT stay."""
    pg = Cluster(redis_server.url)
    try:
        pg.configure(enabled="off")
        pg.sql("CREATE DATABASE granted")
        pg.sql("CREATE EXTENSION outbox_dispatch VERSION '1.0.0'", dbname="granted")
        pg.sql("""
            CREATE ROLE granted_app; CREATE ROLE granted_ops; CREATE ROLE granted_column;
            CREATE ROLE "Granted Lead"; CREATE ROLE granted_by_lead;
            GRANT USAGE ON SCHEMA outbox TO granted_app, granted_ops, granted_column, "Granted Lead";
            GRANT INSERT ON outbox.events, outbox.log TO granted_app;
            GRANT SELECT, UPDATE ON outbox.events, outbox.log TO granted_ops;
            GRANT UPDATE (key_seq) ON outbox.log TO granted_column;
            GRANT UPDATE ON outbox.log TO "Granted Lead" WITH GRANT OPTION;
            SET ROLE "Granted Lead";
            GRANT UPDATE ON outbox.log TO granted_by_lead;
            RESET ROLE;
            """, dbname="granted")
        warnings = []
        with pg.connect(dbname="granted") as conn:
            conn.add_notice_handler(lambda notice: warnings.append(notice.message_primary))
            conn.execute(f"ALTER EXTENSION outbox_dispatch UPDATE TO '{CURRENT}'")
        assert pg.sql("""
            SELECT has_table_privilege('Granted Lead', 'outbox.log', 'UPDATE')
                OR has_table_privilege('granted_by_lead', 'outbox.log', 'UPDATE'),
                   has_table_privilege('granted_ops', 'outbox.log', 'UPDATE'),
                   has_column_privilege('granted_column', 'outbox.log', 'key_seq', 'UPDATE'),
                   has_table_privilege('granted_ops', 'outbox.events', 'UPDATE'),
                   has_table_privilege('granted_ops', 'outbox.log', 'SELECT'),
                   has_table_privilege('granted_app', 'outbox.log', 'INSERT')""", dbname="granted") == [
            (False, False, False, True, True, True)]
        revoked = sorted(w for w in warnings if "revoked" in w)
        assert revoked == ["outbox_dispatch 1.1.0: UPDATE on outbox.log revoked from Granted Lead",
                           "outbox_dispatch 1.1.0: UPDATE on outbox.log revoked from granted_by_lead",
                           "outbox_dispatch 1.1.0: UPDATE on outbox.log revoked from granted_column",
                           "outbox_dispatch 1.1.0: UPDATE on outbox.log revoked from granted_ops"], warnings
    finally:
        pg.close()


def test_the_update_carries_grants_row_security_and_publications_to_the_partitioned_log(redis_server):
    """0.10.0 makes outbox.log anew, partitioned by generation: what a DBA
    granted on 0.9.0's table (columns too), its row-level security and
    policies, and the publications that named it hold on the new one; an
    index or a trigger the DBA added is named in a warning, not lost
    silently; and every row is still there."""
    pg = Cluster(redis_server.url)
    try:
        pg.configure(enabled="off")
        pg.sql("CREATE DATABASE carried")
        pg.sql("CREATE EXTENSION outbox_dispatch VERSION '0.9.0'", dbname="carried")
        pg.sql("""
            CREATE ROLE carried_reader;
            GRANT USAGE ON SCHEMA outbox TO carried_reader;
            GRANT SELECT (id, event_type, queue) ON outbox.events TO carried_reader;
            GRANT INSERT ON outbox.events TO carried_reader WITH GRANT OPTION;
            ALTER TABLE outbox.events ENABLE ROW LEVEL SECURITY;
            ALTER TABLE outbox.events FORCE ROW LEVEL SECURITY;
            CREATE POLICY carried_mine ON outbox.events FOR SELECT TO carried_reader USING (queue = 'q_mine');
            CREATE POLICY carried_insert ON outbox.events AS RESTRICTIVE FOR INSERT TO carried_reader
                WITH CHECK (queue LIKE 'q_%');
            CREATE PUBLICATION carried_pub FOR TABLE outbox.events (id, event_type, queue) WHERE (queue <> 'q_secret')
                WITH (publish = 'insert');
            CREATE PUBLICATION carried_root FOR TABLE outbox.events WITH (publish_via_partition_root = true);
            CREATE INDEX carried_queue_idx ON outbox.events (queue);
            CREATE FUNCTION public.carried_audit() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END';
            CREATE TRIGGER carried_audit BEFORE INSERT ON outbox.events FOR EACH ROW
                EXECUTE FUNCTION public.carried_audit();
            SELECT outbox_enqueue('e', '{}', queue => q) FROM unnest('{q_mine,q_mine,q_other,q_secret}'::text[]) AS q;
            UPDATE outbox.events SET status = 'failed', last_error = 'x' WHERE queue = 'q_other';
            """, dbname="carried")
        warnings = []
        with pg.connect(dbname="carried") as conn:
            conn.add_notice_handler(lambda notice: warnings.append(notice.message_primary))
            conn.execute(f"ALTER EXTENSION outbox_dispatch UPDATE TO '{CURRENT}'")

        assert pg.value("SELECT relkind::text FROM pg_class WHERE oid = 'outbox.log'::regclass",
                        dbname="carried") == "p"
        assert pg.sql("SELECT queue, status::text FROM outbox.events ORDER BY queue", dbname="carried") == [
            ("q_mine", "pending"), ("q_mine", "pending"), ("q_other", "failed"), ("q_secret", "pending")]
        privileges = pg.sql("""
            SELECT has_column_privilege('carried_reader', 'outbox.log', 'queue', 'SELECT'),
                   has_column_privilege('carried_reader', 'outbox.log', 'payload', 'SELECT'),
                   has_table_privilege('carried_reader', 'outbox.log', 'INSERT WITH GRANT OPTION'),
                   has_table_privilege('carried_reader', 'outbox.log', 'UPDATE'),
                   relrowsecurity, relforcerowsecurity
              FROM pg_class WHERE oid = 'outbox.log'::regclass""", dbname="carried")
        assert privileges == [(True, False, True, False, True, True)]
        assert pg.sql("SELECT policyname::text, permissive, roles::text, cmd, qual, with_check FROM pg_policies "
                      "WHERE tablename = 'log' ORDER BY 1", dbname="carried") == [
            ("carried_insert", "RESTRICTIVE", "{carried_reader}", "INSERT", None, "(queue ~~ 'q_%'::text)"),
            ("carried_mine", "PERMISSIVE", "{carried_reader}", "SELECT", "(queue = 'q_mine'::text)", None)]
        with pg.connect(dbname="carried") as conn:
            conn.execute("SET ROLE carried_reader")
            assert conn.execute("SELECT queue FROM outbox.log ORDER BY 1").fetchall() == [("q_mine",), ("q_mine",)]
        # Without publish_via_partition_root, the partitions: they alone may
        # carry the row filter and the column list.
        assert pg.sql("SELECT tablename::text, attnames::text, rowfilter FROM pg_publication_tables "
                      "WHERE pubname = 'carried_pub' ORDER BY 1", dbname="carried") == [
            (f"log_{g}", "{id,event_type,queue}", "(queue <> 'q_secret'::text)") for g in range(3)]
        assert pg.sql("SELECT tablename::text FROM pg_publication_tables WHERE pubname = 'carried_root'",
                      dbname="carried") == [("log",)]
        carried = [w for w in warnings if "is not carried to outbox.log" in w]
        assert len(carried) == 2 and any("index outbox.carried_queue_idx" in w for w in carried) \
            and any("trigger carried_audit" in w for w in carried), warnings
    finally:
        pg.close()
