"""What each role class the docs name may do, and nothing else, on both
hosts (the suite's mode, OUTBOX_HOST): PUBLIC or a role with CONNECT only
(other), a writer with the grants docs/operations/security.md gives, a
pg_monitor member (monitor); each acts as itself, never as a superuser.

No name a caller controls reaches code that runs as another role: every
SECURITY DEFINER function, and every PL/pgSQL function (a session compiles
one once, with the types of whoever called it first, and a definer caller
reuses that copy), pins its search_path or qualifies every name; the
catalog says which, and a hostile session of each role class plants what
it can and counts what of it ran as someone else."""

import psycopg
import pytest

from harness import decode, documented_grants, queued_ids, wait_until
from outbox_dispatch import report
from resolution import faults, tokens
from standalone import HOST, installed_cluster

PIN = "search_path=pg_catalog, pg_temp"
OWNER = "owner" if HOST == "sidecar" else "postgres"

# The functions that pin no search_path on purpose, each qualifying every
# name instead (tests/resolution.py checks the body the server keeps; a
# C function's SPI statements are checked where they are written): the
# write path, where a SET clause costs most (sql/api.sql).
QUALIFIED = {
    "outbox_enqueue": "the write path itself (runs as its caller)",
    "outbox_route": "the routing trigger, on every insert a subscription matches",
    "outbox_take_turn": "the key's turn, on every keyed insert",
    "outbox_pending_again": "an event put back in line",
    "outbox_uuid_v7": "every id (PostgreSQL before 18)",
    "outbox_routed_to_default": "the library's: a per-backend cache, written in Rust (src/subscriptions.rs)",
}

OURS = """
SELECT p.oid::pg_catalog.regprocedure::pg_catalog.text, p.proname::pg_catalog.text, p.prosecdef,
       l.lanname::pg_catalog.text, coalesce(p.proconfig, '{}'), p.prosrc, p.prosqlbody IS NOT NULL
  FROM pg_catalog.pg_proc AS p
  JOIN pg_catalog.pg_language AS l ON l.oid OPERATOR(pg_catalog.=) p.prolang
 WHERE p.pronamespace OPERATOR(pg_catalog.=) 'outbox'::pg_catalog.regnamespace
    OR (p.pronamespace OPERATOR(pg_catalog.=) 'public'::pg_catalog.regnamespace
        AND p.proname OPERATOR(pg_catalog.~~) 'outbox\\_%')
 ORDER BY 1
"""


@pytest.fixture(scope="module")
def pg(redis_server):
    with installed_cluster(redis_server.url) as pg:
        pg.sql("CREATE ROLE writer LOGIN")
        pg.sql("CREATE ROLE monitor LOGIN IN ROLE pg_monitor")
        pg.sql("CREATE ROLE other LOGIN")
        pg.sql("CREATE ROLE ops LOGIN")
        # An application's own schema, where it may create.
        for role in ("writer", "monitor"):
            pg.sql(f"CREATE SCHEMA {role}_own AUTHORIZATION {role}")
        # What the docs grant an application and a consumer, no more.
        with pg.connect(user=OWNER) as conn:
            for statement in documented_grants("app") + documented_grants("consumer"):
                conn.execute(statement.replace(" TO app;", " TO writer;").replace(" TO consumer;", " TO writer;"))
            for statement in documented_grants("ops"):
                conn.execute(statement)
        yield pg


def ours(pg):
    with pg.connect(user=OWNER) as conn:
        conn.execute("SET search_path = pg_catalog, pg_temp")
        return conn.execute(OURS).fetchall()


def test_every_function_that_runs_as_another_pins_its_search_path_or_qualifies_every_name(pg):
    """SECURITY DEFINER functions and PL/pgSQL functions, as installed:
    pinned, or a body bound as it was created (BEGIN ATOMIC, RETURN), or
    named in QUALIFIED with a body that leaves no name to the caller."""
    unsafe = []
    for signature, name, definer, language, config, body, bound in ours(pg):
        if not (definer or language == "plpgsql") or PIN in config or bound:
            continue
        if name not in QUALIFIED:
            unsafe.append(f"{signature}: neither pinned nor on the list of qualified functions")
        elif language not in ("c", "internal"):
            unsafe += [f"{signature}: {fault}" for fault in faults(body, language)]
    assert unsafe == []


# -- a hostile session of each role class ----------------------------------------------------

PLANTED = """
CREATE FUNCTION pg_temp.planted() RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF pg_catalog.current_user() OPERATOR(pg_catalog.<>) pg_catalog.session_user() THEN
        PERFORM pg_catalog.set_config('hostile.ran', pg_catalog.current_user()::pg_catalog.text, false);
        RAISE WARNING 'planted code ran as %', pg_catalog.current_user();
    END IF;
    RETURN true;
END $$
"""

# Values of a function's arguments, by type; NULL for the rest.
SAMPLES = {
    "text": "'hostile'", "jsonb": "'{}'", "uuid": "pg_catalog.gen_random_uuid()", "integer": "1",
    "bigint": "1", "smallint": "1", "interval": "'1 second'", "boolean": "false", "name": "'hostile'",
    "double precision": "1", "text[]": "'{hostile}'", "bigint[]": "'{1}'", "uuid[]": "'{}'",
}

USED_TYPES = """
SELECT t.typname::pg_catalog.text
  FROM pg_catalog.pg_type AS t
 WHERE t.typnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace
   AND t.typtype OPERATOR(pg_catalog.=) ANY ('{b,r,m}') AND t.typname OPERATOR(pg_catalog.!~~) '\\_%%'
   AND t.typname OPERATOR(pg_catalog.=) ANY (%s)
"""
USED_RELATIONS = """
SELECT c.relname::pg_catalog.text
  FROM pg_catalog.pg_class AS c
 WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace
   AND c.relkind OPERATOR(pg_catalog.=) ANY ('{r,v}') AND c.relname OPERATOR(pg_catalog.=) ANY (%s)
"""
# The operators of pg_catalog a body may name, over the types it uses.
USED_OPERATORS = """
SELECT o.oprname::pg_catalog.text, o.oprleft::pg_catalog.regtype::pg_catalog.text,
       o.oprright::pg_catalog.regtype::pg_catalog.text, o.oprresult::pg_catalog.regtype::pg_catalog.text,
       o.oprcode::pg_catalog.regproc::pg_catalog.text
  FROM pg_catalog.pg_operator AS o
  JOIN pg_catalog.pg_type AS l ON l.oid OPERATOR(pg_catalog.=) o.oprleft
  JOIN pg_catalog.pg_type AS r ON r.oid OPERATOR(pg_catalog.=) o.oprright
 WHERE o.oprnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace
   AND o.oprname OPERATOR(pg_catalog.=) ANY (%s)
   AND l.typname OPERATOR(pg_catalog.=) ANY (%s) AND r.typname OPERATOR(pg_catalog.=) ANY (%s)
"""
# The plain functions of pg_catalog a body may call by these names.
USED_FUNCTIONS = """
SELECT p.proname::pg_catalog.text,
       ARRAY(SELECT a::pg_catalog.regtype::pg_catalog.text
                          FROM pg_catalog.unnest(p.proargtypes::pg_catalog.oid[]) AS a),
       p.prorettype::pg_catalog.regtype::pg_catalog.text
  FROM pg_catalog.pg_proc AS p
 WHERE p.pronamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace
   AND p.prokind OPERATOR(pg_catalog.=) 'f' AND NOT p.proretset AND p.provariadic OPERATOR(pg_catalog.=) 0
   AND p.proname OPERATOR(pg_catalog.=) ANY (%s)
   AND NOT EXISTS (SELECT FROM pg_catalog.unnest(p.proargtypes::pg_catalog.oid[] OPERATOR(pg_catalog.||)
                                                 p.prorettype) AS a
                     JOIN pg_catalog.pg_type AS t ON t.oid OPERATOR(pg_catalog.=) a
                    WHERE t.typtype OPERATOR(pg_catalog.=) 'p'
                      AND t.typname OPERATOR(pg_catalog.<>) 'void')
"""
OPERATOR_NAMES = ["=", "<>", "<", ">", "<=", ">=", "+", "-", "*", "/", "%", "||", "~~", "->>", "->", "@>", "?", "~"]


def plant(conn, pg, own):
    """As the role of `conn`: a domain in pg_temp for every type name our
    functions use, a view in pg_temp for every catalog relation they name,
    and, in the role's own schema `own` (first in its search_path), an
    operator and a function for each of pg_catalog's they could resolve
    to; each runs pg_temp.planted() first."""
    words = sorted({text for _, _, _, _, _, body, _ in ours(pg) for kind, text in tokens(body) if kind == "word"})
    conn.execute("SET search_path = pg_catalog, pg_temp")
    conn.execute(PLANTED)
    types = [r[0] for r in conn.execute(USED_TYPES, (words,))]
    relations = [r[0] for r in conn.execute(USED_RELATIONS, (words,))]
    planted = 0
    if own:
        operators = conn.execute(USED_OPERATORS, (OPERATOR_NAMES, types, types)).fetchall()
        for i, (name, left, right, result, code) in enumerate(operators):
            conn.execute(f"""
                CREATE FUNCTION {own}.op{i}(a {left}, b {right}) RETURNS {result} LANGUAGE plpgsql AS $$
                BEGIN PERFORM pg_temp.planted(); RETURN pg_catalog.{code}(a, b); END $$""")
            conn.execute(f"CREATE OPERATOR {own}.{name} (LEFTARG = {left}, RIGHTARG = {right}, "
                         f"FUNCTION = {own}.op{i})")
        for i, (name, args, result) in enumerate(conn.execute(USED_FUNCTIONS, (words,)).fetchall()):
            params = ", ".join(f"a{j} {t}" for j, t in enumerate(args))
            call = f"pg_catalog.{name}({', '.join(f'a{j}' for j in range(len(args)))})"
            body = f"PERFORM {call}; RETURN;" if result == "void" else f"RETURN {call};"
            conn.execute(f"""
                CREATE FUNCTION {own}.{name}({params}) RETURNS {result} LANGUAGE plpgsql AS $$
                BEGIN PERFORM pg_temp.planted(); {body} END $$""")
            planted += 1
        planted += len(operators)
    for name in relations:
        # Not over a column of a pseudo-type (pg_stats'): a view cannot hold one.
        columns = conn.execute(
            "SELECT pg_catalog.string_agg(pg_catalog.quote_ident(a.attname), ', ') FROM pg_catalog.pg_attribute AS a "
            "JOIN pg_catalog.pg_type AS t ON t.oid OPERATOR(pg_catalog.=) a.atttypid "
            "WHERE a.attrelid OPERATOR(pg_catalog.=) pg_catalog.to_regclass('pg_catalog.' || %s) "
            "AND a.attnum OPERATOR(pg_catalog.>) 0 AND t.typtype OPERATOR(pg_catalog.<>) 'p'", (name,)).fetchone()[0]
        conn.execute(f"CREATE VIEW pg_temp.{name} AS SELECT {columns} FROM pg_catalog.{name} WHERE pg_temp.planted()")
    for name in types:
        conn.execute(f"CREATE DOMAIN pg_temp.{name} AS pg_catalog.{name} CHECK (pg_temp.planted())")
    conn.execute(f"SET search_path = {own + ', ' if own else ''}pg_catalog")
    return planted + len(relations) + len(types)


# Every function of ours the session may execute, those that run as
# their caller first (to compile them with its types), with its
# arguments' types.
CALLABLE = """
SELECT p.oid::pg_catalog.regproc::pg_catalog.text, p.prosecdef,
       ARRAY(SELECT pg_catalog.format_type(a, NULL)
                          FROM pg_catalog.unnest(p.proargtypes::pg_catalog.oid[]) WITH ORDINALITY AS u(a, n)
                         ORDER BY u.n)
  FROM pg_catalog.pg_proc AS p
 WHERE (p.pronamespace OPERATOR(pg_catalog.=) 'outbox'::pg_catalog.regnamespace
        OR (p.pronamespace OPERATOR(pg_catalog.=) 'public'::pg_catalog.regnamespace
            AND p.proname OPERATOR(pg_catalog.~~) 'outbox\\_%'))
   AND p.prorettype OPERATOR(pg_catalog.<>) 'pg_catalog.trigger'::pg_catalog.regtype
   AND p.prokind OPERATOR(pg_catalog.=) 'f'
   AND pg_catalog.has_function_privilege(p.oid, 'EXECUTE')
   AND pg_catalog.has_schema_privilege(p.pronamespace, 'USAGE')
 ORDER BY p.prosecdef, 1
"""


def attempt(conn, sql, params=None):
    """Runs `sql` in a savepoint; its error, if any, is the role's to get."""
    try:
        with conn.transaction():
            conn.execute(sql, params)
    except psycopg.Error:
        pass


def exercise(conn):
    """Everything the role may do: each function it may execute, twice
    (the second round with what the first compiled), then the write paths
    as a writer takes them, and every view it may read."""
    calls = conn.execute(CALLABLE).fetchall()
    for _ in range(2):
        for name, _, types in calls:
            args = [f"{SAMPLES.get(t, 'NULL')}::{t}" for t in types]
            attempt(conn, f"SELECT {name}({', '.join(args)})")
        for notify in ("on", "off"):
            attempt(conn, f"SET outbox.notify = {notify}")
            for args in ["'hostile.plain', '{}'", "'hostile.routed', '{}'", "'hostile.batched', '{}'",
                         "'hostile.keyed', '{}', ordering_key => 'k'", "'hostile.routed', '{}', ordering_key => 'k'",
                         "'hostile.later', '{}', delay => '1 hour'"]:
                attempt(conn, f"SELECT public.outbox_enqueue({args})")
            attempt(conn, "INSERT INTO outbox.events (event_type, payload, ordering_key) "
                          "VALUES ('hostile.routed', '{}', 'k'), ('hostile.orm', '{}', NULL)")
        for (view,) in conn.execute(
                "SELECT pg_catalog.format('%I.%I', n.nspname, c.relname) FROM pg_catalog.pg_class AS c "
                "JOIN pg_catalog.pg_namespace AS n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace "
                "WHERE n.nspname OPERATOR(pg_catalog.=) 'outbox' AND c.relkind OPERATOR(pg_catalog.=) 'v' "
                "AND pg_catalog.has_table_privilege(c.oid, 'SELECT')").fetchall():
            attempt(conn, f"SELECT * FROM {view}")


@pytest.mark.parametrize("role", ["other", "monitor", "writer"])
def test_no_role_runs_what_it_planted_as_another(pg, role):
    with pg.connect(user=OWNER) as conn:
        subscriptions = conn.execute(
            "SELECT outbox_subscribe('hostile.routed', 'tasks.routed'), "
            "outbox_subscribe('hostile.batched', 'tasks.batched', batch_max => 2)").fetchone()
    try:
        with pg.connect(user=role) as conn:
            warnings = []
            conn.add_notice_handler(lambda d: warnings.append(f"{d.message_primary} ({d.context})"))
            planted = plant(conn, pg, f"{role}_own" if role != "other" else None)
            assert planted >= 10, "little was planted: the test would prove nothing"
            exercise(conn)
            ran = conn.execute("SELECT pg_catalog.current_setting('hostile.ran', true)").fetchone()[0]
        assert [w for w in warnings if "planted code ran" in w] == [] and not ran, (ran, warnings[:5])
    finally:
        with pg.connect(user=OWNER) as conn:
            for sid in subscriptions:
                conn.execute("SELECT outbox_unsubscribe(%s)", (sid,))


def test_the_check_of_a_body_finds_each_name_left_to_the_caller():
    """What the catalog test relies on: each kind of name a caller's
    search_path could bind is found, and what the grammar binds is not."""
    body = """DECLARE
        a text;
        b pg_catalog.text;
        c integer := 0;
    BEGIN
        IF a = b OR a OPERATOR(pg_catalog.=) b OR a LIKE 'x%' OR c BETWEEN 1 AND 2 OR a IS DISTINCT FROM b THEN
            PERFORM now(), pg_catalog.now(), coalesce(a, b), a::jsonb, b::pg_catalog.uuid, c::integer, -1
              FROM pg_stat_activity, pg_catalog.pg_class;
            EXECUTE 'SELECT 1';
        END IF;
        RETURN NULL;
    END"""
    found = faults(body, "plpgsql")
    for expected in ["DECLARE a: type text unqualified", "operator = unqualified", "LIKE: ", "BETWEEN: ",
                     "IS DISTINCT FROM", "function now() unqualified", "cast: type jsonb unqualified",
                     "relation pg_stat_activity unqualified", "EXECUTE: "]:
        assert [f for f in found if f.startswith(expected)], (expected, found)
    assert len(found) == 9, found


@pytest.mark.xfail(strict=True, reason="per-key order locks a key with pg_advisory_xact_lock(hashtextextended(key, "
                   "subscription)), which any role may take: a key's lock held by a role with CONNECT only holds "
                   "up its enqueues, its acknowledgements and its turns (sql/keys.sql, sql/keys/lock.sql); a lock "
                   "only the owner may take awaits the keys' own table")
def test_a_role_with_connect_only_cannot_hold_a_key_up(pg):
    """A role with CONNECT only takes the advisory lock of a key it can
    name (hashtextextended(key, 0), PostgreSQL's own function) and keeps
    it: a writer's enqueue of that key must not wait for it."""
    with pg.connect(user="other") as squatter:
        squatter.execute("SELECT pg_advisory_lock(hashtextextended('order-42', 0))")
        with pg.connect(user="writer") as conn:
            conn.execute("SET lock_timeout = '2s'")
            conn.execute("SELECT outbox_enqueue('hostile.keyed', '{}', ordering_key => 'order-42')")


def test_a_role_with_connect_only_holds_up_no_delayed_event(pg, redis_server):
    """A transaction that puts an event out of line says so to the
    dispatchers' due floor by an advisory lock (1869968482, n:
    sql/worker/due_bound.sql), which any role may take. A role with
    CONNECT only takes 1.1.0's first number and those the next
    transactions' ids would give, and keeps them: a writer's delayed
    enqueue neither waits for them nor loses its delay (the number is drawn
    at random), and every event is delivered."""
    client = redis_server.client()
    with pg.connect(user="other", autocommit=False) as squatter:
        squatter.execute("SELECT pg_advisory_lock(1869968482, 1600419173)")
        squatter.execute("SELECT pg_advisory_lock(1869968482, hashtext((pg_current_xact_id()::text::bigint + n)::text)) "
                         "FROM generate_series(1, 200) AS n")
        squatter.commit()
        warnings = []
        with pg.connect(user="writer") as conn:
            conn.add_notice_handler(lambda d: warnings.append(d.message_primary))
            conn.execute("SET lock_timeout = '2s'")
            ids = [str(conn.execute("SELECT outbox_enqueue('hostile.squatted', '{}', queue => 'q_squatted', "
                                    "delay => '5 seconds')").fetchone()[0]) for _ in range(60)]
        assert warnings == []
        assert pg.value("SELECT count(*) FROM outbox.log WHERE id = ANY (%s::uuid[]) AND pending_xid IS NULL",
                        (ids,)) == 60, "every delay kept"
        wait_until(lambda: sorted(set(queued_ids(client, "q_squatted"))) == sorted(ids), timeout=30,
                   message="every delayed event, the locks held")


def test_an_acknowledgement_left_open_holds_up_no_report_nor_send(pg, redis_server):
    """A consumer acknowledges in its own transaction (as the inbox does) and
    keeps it open: the dispatchers still take the workers' reports of that
    batch and settle it, and go on sending."""
    client = redis_server.client()
    pg.configure(ack_timeout="1h")
    try:
        with pg.connect(user="writer") as conn:
            with conn.transaction():
                first, second = [str(conn.execute("SELECT outbox_enqueue('hostile.open', '{}', queue => 'q_open')")
                                     .fetchone()[0]) for _ in range(2)]
        wait_until(lambda: sorted(queued_ids(client, "q_open")) == sorted([first, second]), message="both sent")
        wait_until(lambda: pg.value("SELECT count(*) FROM outbox.events WHERE status = 'dispatched' "
                                    "AND queue = 'q_open'") == 2, message="both dispatched")
        sends = {m["headers"]["id"]: m["headers"]["outbox_send"]
                 for m in (decode(raw)[0] for raw in client.lrange("q_open", 0, -1))}
        with pg.connect(user="writer", autocommit=False) as consumer:
            assert consumer.execute("SELECT outbox_ack(%s, %s)", (first, sends[first])).fetchone()[0] is True
            # The workers' reports of both: the batch is then settled, an
            # update of the row the acknowledgement holds.
            client.rpush(pg.report_list(), report.processed(first, sends[first]),
                         report.processed(second, sends[second]))
            with pg.connect(user="writer") as conn:
                third = str(conn.execute("SELECT outbox_enqueue('hostile.open', '{}', queue => 'q_open')")
                            .fetchone()[0])
            wait_until(lambda: third in queued_ids(client, "q_open"), message="a send while the acknowledgement is open")
            wait_until(lambda: pg.value("SELECT status::text FROM outbox.events WHERE id = %s", (second,))
                       == "processed", message="the report taken while the acknowledgement is open")
            consumer.commit()
        assert pg.value("SELECT status::text FROM outbox.events WHERE id = %s", (first,)) == "processed"
    finally:
        pg.configure(ack_timeout="0")


@pytest.mark.parametrize("column, value", [("key_seq", "1"), ("key_state", "'head'"), ("ordering_key", "'other'"),
                                           ("pending_xid", "'3'"), ("subscription_id", "777"),
                                           ("created_at", "'2000-01-01'"), ("id", "gen_random_uuid()")])
def test_an_operator_edits_what_an_event_carries_never_its_place(pg, column, value):
    """Operators are granted UPDATE on outbox.events (the docs' ops): they
    may edit what an event carries, not its place in line nor its key's
    turn, which would send it before an event of its key committed
    earlier."""
    pg.configure(enabled="off")
    try:
        with pg.connect(user="writer") as conn:
            head, last = [str(conn.execute("SELECT outbox_enqueue('hostile.turn', '{}', ordering_key => 'turned')")
                              .fetchone()[0]) for _ in range(2)]
        before = pg.sql("SELECT id::text, key_seq, key_state, pending_xid::text, ordering_key FROM outbox.log "
                        "WHERE ordering_key = 'turned' ORDER BY key_seq")
        with pg.connect(user="ops") as conn:
            with pytest.raises(psycopg.errors.FeatureNotSupported, match=f'cannot write column "{column}"'):
                conn.execute(f"UPDATE outbox.events SET {column} = {value} WHERE id = %s", (last,))
            conn.execute("UPDATE outbox.events SET payload = '{\"edited\": true}' WHERE id = %s", (last,))
        assert pg.sql("SELECT id::text, key_seq, key_state, pending_xid::text, ordering_key FROM outbox.log "
                      "WHERE ordering_key = 'turned' ORDER BY key_seq") == before
        assert [r[0] for r in before] == [head, last] and [r[2] for r in before] == ["head", "waiting"]
    finally:
        pg.sql("DELETE FROM outbox.log WHERE ordering_key = 'turned'")
        pg.configure(enabled="on")


def test_an_operator_retries_a_dead_letter_and_sends_nothing_again_by_its_due_time(pg, redis_server):
    """Operators retry dead letters (outbox_retry(), granted them) without
    a privilege on outbox.log; an event already sent keeps its due time:
    moving it would put it back in line, ahead of its key."""
    client = redis_server.client()
    with pg.connect(user="writer") as conn:
        sent = str(conn.execute("SELECT outbox_enqueue('hostile.sent', '{}', queue => 'q_ops')").fetchone()[0])
    wait_until(lambda: sent in queued_ids(client, "q_ops"), message="the event sent")
    wait_until(lambda: pg.value("SELECT status::text FROM outbox.events WHERE id = %s", (sent,)) == "dispatched",
               message="its send recorded")
    dead = pg.value("INSERT INTO outbox.log (event_type, queue, status, last_error) "
                    "VALUES ('hostile.dead', 'q_ops', 'failed', 'dead') RETURNING id::text")
    with pg.connect(user="ops") as conn:
        with pytest.raises(psycopg.errors.FeatureNotSupported, match='cannot write column "available_at"'):
            conn.execute("UPDATE outbox.events SET available_at = clock_timestamp() WHERE id = %s", (sent,))
        assert conn.execute("SELECT outbox_retry(%s)", (dead,)).fetchone()[0] is True
    wait_until(lambda: dead in queued_ids(client, "q_ops"), message="the dead letter sent again")
    assert queued_ids(client, "q_ops").count(sent) == 1
