"""outbox_dispatch without the library (docs/guides/managed.md): `outbox-dispatch
install` puts the schema and the SQL API into a database of a server with no
shared_preload_libraries, as the database's owner, who is not a superuser,
as on a managed service. The hostile cases first: a role without the
privileges, a password in the DSN, a second install, a database with the
extension or a planted schema, a writer that sets the settings a placeholder
leaves open to it."""

import difflib
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from harness import PG_BIN, as_postgres, wait_until
from standalone import BIN, dsn, fresh_database, install, library_only, plain_server, run

FIXTURES = Path(__file__).resolve().parent / "fixtures"

@pytest.fixture(scope="module")
def server():
    with plain_server() as pg:
        yield pg


@pytest.fixture(scope="module")
def app(server):
    install(server, "app")
    return server


def schemas(pg, dbname):
    return {r[0] for r in pg.sql("SELECT nspname FROM pg_namespace", dbname=dbname)}


def refused(pg, user, dbname, *args, installs_nothing=True):
    """An install into `dbname` as `user` that fails; what it says. With
    `installs_nothing`, the database has no schema outbox after it."""
    result = run("install", "--dsn", dsn(pg, user, dbname), *args)
    assert result.returncode == 1, result.stdout
    if installs_nothing:
        assert "outbox" not in schemas(pg, dbname)
    return result.stderr


def test_a_role_without_create_on_the_database_is_told_which_grant_it_needs(server):
    fresh_database(server, "nocreate", owner="postgres")
    stderr = refused(server, "writer", "nocreate")
    assert 'lacks CREATE on database "nocreate"' in stderr
    assert "GRANT CREATE ON DATABASE" in stderr


def test_a_role_without_create_on_the_functions_schema_is_told_which(server):
    fresh_database(server, "noschema", owner="postgres")
    server.sql("GRANT CREATE ON DATABASE noschema TO writer")
    stderr = refused(server, "writer", "noschema")
    assert 'lacks CREATE on schema "public"' in stderr
    stderr = refused(server, "writer", "noschema", "--schema", "absent")
    assert 'schema "absent" (--schema, for the functions) does not exist' in stderr


def test_a_password_in_the_dsn_is_never_printed(server):
    secret = "s3cret-" + uuid.uuid4().hex
    # Nothing listens on port 1: the connection fails, and says so without it.
    result = run("install", env={"OUTBOX_DSN": f"postgresql://owner:{secret}@127.0.0.1:1/app?connect_timeout=5"})
    assert result.returncode == 1
    assert "install:" in result.stderr
    assert secret not in result.stderr + result.stdout
    result = run("install", "--dsn", f"host={server.dir} port={server.port} user=nobody password={secret} dbname=app")
    assert result.returncode == 1
    assert 'role "nobody" does not exist' in result.stderr
    assert secret not in result.stderr + result.stdout


def test_a_second_install_does_nothing(app):
    before = app.value("SELECT xmin::text FROM outbox.installed", dbname="app")
    result = run("install", "--dsn", dsn(app, "owner", "app"))
    assert result.returncode == 0, result.stderr
    assert "installed already: nothing to do" in result.stdout
    assert app.value("SELECT xmin::text FROM outbox.installed", dbname="app") == before


def test_a_database_with_the_extension_is_refused(server):
    fresh_database(server, "withext", owner="postgres")
    server.sql("CREATE EXTENSION outbox_dispatch", dbname="withext")
    stderr = refused(server, "postgres", "withext", installs_nothing=False)
    assert 'has the extension outbox_dispatch' in stderr
    assert server.value("SELECT to_regclass('outbox.installed') IS NULL", dbname="withext")


def test_a_schema_outbox_of_something_else_is_refused_and_left_alone(server):
    fresh_database(server, "planted")
    with server.connect(dbname="planted", user="owner") as conn:
        conn.execute("CREATE SCHEMA outbox")
        conn.execute("CREATE TABLE outbox.log (mine int)")
    stderr = refused(server, "owner", "planted", installs_nothing=False)
    assert 'has a schema "outbox" that outbox-dispatch did not install' in stderr
    assert server.value("SELECT count(*) FROM pg_class WHERE relnamespace = 'outbox'::regnamespace",
                        dbname="planted") == 1


def test_a_failing_install_leaves_nothing(server):
    """A function of the API planted in the schema beforehand: the install
    fails on it and rolls back whole."""
    fresh_database(server, "halfway")
    with server.connect(dbname="halfway", user="owner") as conn:
        conn.execute("CREATE FUNCTION public.outbox_ack(uuid) RETURNS boolean LANGUAGE sql AS 'SELECT true'")
    stderr = refused(server, "owner", "halfway")
    assert "outbox_ack" in stderr


def test_two_installs_at_once_install_once(server):
    fresh_database(server, "race")
    procs = [subprocess.Popen([BIN, "install", "--dsn", dsn(server, "owner", "race")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted("nothing to do" in out for out, _ in outs) == [False, True]


def test_a_default_of_repeatable_read_does_not_break_two_installs_at_once(server):
    fresh_database(server, "race_rr")
    server.sql("ALTER ROLE owner IN DATABASE race_rr SET default_transaction_isolation = 'repeatable read'")
    try:
        procs = [subprocess.Popen([BIN, "install", "--dsn", dsn(server, "owner", "race_rr")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
    finally:
        server.sql("ALTER ROLE owner IN DATABASE race_rr RESET default_transaction_isolation")


def test_a_role_with_connect_only_holding_every_advisory_lock_holds_no_install_up(server):
    """1.0.0's installs took turns on an advisory lock, which any role may
    hold: one that held it made `install` wait for ever."""
    fresh_database(server, "squatted")
    squatter = psycopg.connect(host=str(server.dir), port=server.port, user="other", dbname="squatted",
                               autocommit=True)
    try:
        squatter.execute("SELECT pg_advisory_lock(%s, n) FROM generate_series(0, 3000) AS n", (0x6f757462,))
        squatter.execute("SELECT pg_advisory_lock(n) FROM generate_series(0, 1000) AS n")
        result = run("install", "--dsn", dsn(server, "owner", "squatted"))
        assert result.returncode == 0, result.stderr
    finally:
        squatter.close()


def test_an_install_that_waits_for_a_lock_gives_up_and_names_who_holds_it(server):
    """A session holding what the install needs (here another install's
    schema, not committed): the install waits its lock_timeout, not for
    ever, and names the session."""
    fresh_database(server, "held")
    holder = psycopg.connect(host=str(server.dir), port=server.port, user="owner", dbname="held",
                             application_name="a long migration")
    try:
        holder.execute("CREATE SCHEMA outbox")
        pid = holder.execute("SELECT pg_backend_pid()").fetchone()[0]
        started = time.monotonic()
        stderr = refused(server, "owner", "held", installs_nothing=False)
        took = time.monotonic() - started
        assert 9 < took < 30, took
        assert "waited 10s for a lock" in stderr and f"pid {pid} (role owner, application 'a long migration'" in stderr
    finally:
        holder.close()
    assert "outbox" not in schemas(server, "held")


def test_what_an_install_that_waited_says_runs_nothing_of_the_database_owners(server):
    """After a lock wait the install names the sessions holding locks, in a
    query of its own after its transaction, whose search_path pin is gone:
    the database's owner put its own || first in every session's path."""
    server.sql("DROP DATABASE IF EXISTS owned_by_other WITH (FORCE)")
    server.sql("CREATE DATABASE owned_by_other OWNER other")
    server.sql("GRANT CREATE ON DATABASE owned_by_other TO owner", dbname="owned_by_other")
    with server.connect(dbname="owned_by_other", user="other") as conn:
        conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        conn.execute("CREATE SCHEMA evil")
        conn.execute("GRANT USAGE ON SCHEMA evil TO PUBLIC")
        conn.execute("CREATE TABLE evil.calls (by name)")
        conn.execute("GRANT INSERT ON evil.calls TO PUBLIC")
        conn.execute("CREATE FUNCTION evil.cat(a text, b text) RETURNS text LANGUAGE plpgsql AS "
                     "$$ BEGIN INSERT INTO evil.calls VALUES (current_user); RETURN a OPERATOR(pg_catalog.||) b; END $$")
        conn.execute("CREATE OPERATOR evil.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.cat)")
        conn.execute("ALTER DATABASE owned_by_other SET search_path = evil, pg_catalog")
    server.sql("CREATE SCHEMA fns AUTHORIZATION owner", dbname="owned_by_other")
    holder = psycopg.connect(host=str(server.dir), port=server.port, user="owner", dbname="owned_by_other")
    try:
        holder.execute("SET search_path = pg_catalog")
        holder.execute("CREATE SCHEMA outbox")
        stderr = refused(server, "owner", "owned_by_other", "--schema", "fns", installs_nothing=False)
        assert "waited 10s for a lock" in stderr
    finally:
        holder.close()
    assert server.sql("SELECT by FROM evil.calls", dbname="owned_by_other") == []


def test_a_schema_made_to_look_installed_by_another_role_is_refused(server):
    fresh_database(server, "forged", owner="postgres")
    server.sql("GRANT CREATE ON DATABASE forged TO other, owner", dbname="forged")
    with server.connect(dbname="forged", user="other") as conn:
        conn.execute("CREATE SCHEMA outbox")
        conn.execute("CREATE TABLE outbox.installed AS SELECT %s::text AS version", (version(),))
    stderr = refused(server, "owner", "forged", installs_nothing=False)
    assert 'belongs to role other' in stderr


def test_a_schema_another_role_made_to_look_like_an_earlier_release_is_not_updated_by_a_superuser(server):
    """Another role with CREATE on the database plants a schema outbox whose
    outbox.installed says 0.10.0, with a trigger that would make it a
    superuser: an install by a superuser, who holds every role's
    privileges, neither updates it nor runs its code."""
    fresh_database(server, "planted", owner="postgres")
    server.sql("GRANT CREATE ON DATABASE planted TO other", dbname="planted")
    with server.connect(dbname="planted", user="other") as conn:
        conn.execute("CREATE SCHEMA outbox")
        conn.execute("CREATE TABLE outbox.installed (version text, installed_at timestamptz)")
        conn.execute("INSERT INTO outbox.installed VALUES ('0.10.0', now())")
        conn.execute("CREATE FUNCTION outbox.escalate() RETURNS trigger LANGUAGE plpgsql AS "
                     "$$ BEGIN EXECUTE 'ALTER ROLE other SUPERUSER'; RETURN NEW; END $$")
        conn.execute("CREATE TRIGGER escalate BEFORE UPDATE ON outbox.installed "
                     "FOR EACH ROW EXECUTE FUNCTION outbox.escalate()")
    stderr = refused(server, "postgres", "planted", installs_nothing=False)
    assert "belongs to role other" in stderr
    assert server.value("SELECT rolsuper FROM pg_roles WHERE rolname = 'other'") is False
    assert server.value("SELECT version FROM outbox.installed", dbname="planted") == "0.10.0"


def plant(pg, dbname, definition):
    """Role other, which may create in schema public of `dbname`, runs
    `definition` there; then it may no longer create there."""
    with pg.connect(dbname=dbname, user="postgres") as conn:
        conn.execute("SET ROLE other")
        conn.execute(definition)
        conn.execute("RESET ROLE")
        conn.execute("REVOKE CREATE ON SCHEMA public FROM other")


def test_a_functions_schema_others_may_create_in_is_refused_naming_them(server):
    fresh_database(server, "open_schema")
    with server.connect(dbname="open_schema", user="postgres") as conn:
        conn.execute("GRANT CREATE ON SCHEMA public TO other")
    stderr = refused(server, "owner", "open_schema")
    assert 'schema "public" is open to others: other may create in it' in stderr
    with server.connect(dbname="open_schema", user="postgres") as conn:
        conn.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
    assert "PUBLIC" in refused(server, "owner", "open_schema")
    server.sql("REVOKE CREATE ON SCHEMA public FROM PUBLIC", dbname="open_schema")
    plant(server, "open_schema", "CREATE FUNCTION public.outbox_ack(text) RETURNS boolean LANGUAGE sql AS 'SELECT true'")
    stderr = refused(server, "owner", "open_schema")
    assert "outbox_ack(text)" in stderr


def test_a_database_owners_search_path_runs_nothing_of_theirs_in_the_install(server):
    """The owner of the database, who is not the installer, sets its
    search_path to a schema of theirs with an = of their own: nothing the
    install runs, its checks first, resolves a name through it."""
    fresh_database(server, "trapped", owner="other")
    server.sql("GRANT CREATE ON DATABASE trapped TO owner")
    server.sql("CREATE SCHEMA fns AUTHORIZATION owner", dbname="trapped")
    with server.connect(dbname="trapped", user="other") as conn:
        conn.execute("""
            CREATE SCHEMA trap;
            GRANT USAGE ON SCHEMA trap TO PUBLIC;
            CREATE TABLE trap.calls (who text);
            GRANT INSERT ON trap.calls TO PUBLIC;
            CREATE FUNCTION trap.eq(name, name) RETURNS boolean LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO trap.calls VALUES (current_user);
                RETURN $1 OPERATOR(pg_catalog.=) $2;
            END $$;
            CREATE OPERATOR trap.= (LEFTARG = name, RIGHTARG = name, FUNCTION = trap.eq);
            ALTER DATABASE trapped SET search_path = trap, pg_catalog""")
    try:
        for _ in range(2):  # the install, then the one that finds it installed
            result = run("install", "--dsn", dsn(server, "owner", "trapped"), "--schema", "fns")
            assert result.returncode == 0, result.stderr
        assert server.value("SELECT count(*) FROM trap.calls", dbname="trapped") == 0
    finally:
        server.sql("DROP DATABASE trapped WITH (FORCE)")


def test_a_grant_committed_while_the_script_runs_is_seen_before_the_install_commits(server):
    """The check runs again as the install's last statement: CREATE granted
    to another role while the script ran (here, while an event trigger
    holds its first CREATE TABLE) refuses the install, and nothing of it
    stays."""
    fresh_database(server, "raced")
    server.sql("""
        CREATE FUNCTION public.hold_first_table() RETURNS event_trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF current_user = 'owner' AND current_setting('raced.held', true) IS NULL THEN
                PERFORM set_config('raced.held', 'on', true);
                PERFORM pg_sleep(3);
            END IF;
        END $$;
        CREATE EVENT TRIGGER hold_first_table ON ddl_command_start WHEN TAG IN ('CREATE TABLE')
            EXECUTE FUNCTION public.hold_first_table()""", dbname="raced")
    installing = subprocess.Popen([BIN, "install", "--dsn", dsn(server, "owner", "raced")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: server.value("SELECT count(*) FROM pg_stat_activity WHERE datname = 'raced' "
                                        "AND wait_event = 'PgSleep'") == 1, message="the script held")
        server.sql("GRANT CREATE ON SCHEMA public TO other", dbname="raced")
        _, stderr = installing.communicate(timeout=60)
    finally:
        installing.kill()
    assert installing.returncode == 1, stderr
    assert 'schema "public" is open to others: other may create in it' in stderr
    assert "outbox" not in schemas(server, "raced")


def server_version(pg):
    return int(pg.value("SHOW server_version_num"))


def test_a_role_that_may_set_role_to_one_that_inherits_the_schemas_grant_is_another(server):
    """From PostgreSQL 16 a member may inherit a role's privileges without
    SET ROLE to it, or SET ROLE to it without inheriting: other, which may
    SET ROLE to deployers, which inherits makers' CREATE, may create in the
    schema, though it neither inherits makers' privileges nor may SET ROLE
    to makers."""
    if server_version(server) < 160000:
        pytest.skip("membership options came with PostgreSQL 16")
    server.sql("CREATE ROLE chain_makers NOLOGIN; CREATE ROLE chain_deployers NOLOGIN; "
               "GRANT chain_makers TO owner; "
               "GRANT chain_makers TO chain_deployers WITH INHERIT TRUE, SET FALSE; "
               "GRANT chain_deployers TO other WITH INHERIT FALSE, SET TRUE")
    try:
        fresh_database(server, "chained")
        server.sql("GRANT CREATE ON SCHEMA public TO chain_makers", dbname="chained")
        stderr = refused(server, "owner", "chained")
        assert "chain_makers (which other belongs to) may create" in stderr
    finally:
        server.sql("DROP DATABASE IF EXISTS chained WITH (FORCE)")
        server.sql("DROP ROLE chain_deployers; DROP ROLE chain_makers")


def test_a_role_the_databases_settings_switch_the_install_to_is_refused(server):
    """The database's owner, who is not the installer, sets role for the
    database to a group both belong to: the install would run as that
    group and make the outbox the owner's too. It is refused, naming the
    setting; the installer may still choose a role for itself."""
    server.sql("CREATE ROLE switched NOLOGIN; GRANT switched TO owner, other")
    try:
        fresh_database(server, "switching", owner="other")
        server.sql("GRANT CREATE ON DATABASE switching TO owner, switched")
        server.sql("CREATE SCHEMA fns AUTHORIZATION switched", dbname="switching")
        server.sql("REVOKE CREATE ON SCHEMA public FROM PUBLIC", dbname="switching")
        with server.connect(dbname="switching", user="other") as conn:
            conn.execute("ALTER DATABASE switching SET role = switched")
        stderr = refused(server, "owner", "switching", "--schema", "fns")
        assert 'role "switched"' in stderr and "ALTER DATABASE" in stderr
    finally:
        server.sql("DROP DATABASE IF EXISTS switching WITH (FORCE)")
        server.sql("DROP ROLE switched")


def test_an_outbox_function_already_there_is_refused_unless_the_installers_or_a_superusers(server):
    """A function of the outbox's names already in the schema is what a
    caller's call would find: on an install it may only be the installer's
    (or a superuser's), whatever group owns it now."""
    server.sql("CREATE ROLE quiet_makers NOLOGIN; GRANT quiet_makers TO owner")
    try:
        fresh_database(server, "quiet")
        server.sql("CREATE FUNCTION public.outbox_ack(text) RETURNS boolean LANGUAGE sql AS 'SELECT true'; "
                   "ALTER FUNCTION public.outbox_ack(text) OWNER TO quiet_makers", dbname="quiet")
        assert "outbox_ack(text)" in refused(server, "owner", "quiet")
    finally:
        server.sql("DROP DATABASE IF EXISTS quiet WITH (FORCE)")
        server.sql("DROP ROLE quiet_makers")


def test_the_databases_settings_change_nothing_of_how_the_script_reads(server):
    """standard_conforming_strings off for the database would read the
    script's backslashes as escapes, and loosen its checks."""
    fresh_database(server, "escaping")
    server.sql("ALTER DATABASE escaping SET standard_conforming_strings = off")
    result = run("install", "--dsn", dsn(server, "owner", "escaping"))
    assert result.returncode == 0, result.stderr
    with server.connect(dbname="escaping") as conn:
        conn.execute("SET standard_conforming_strings = on")
        check = conn.execute("SELECT pg_get_constraintdef(oid) FROM pg_constraint "
                             "WHERE conrelid = 'outbox.settings'::regclass AND contype = 'c'").fetchone()[0]
    assert r"'^outbox\.[a-z_]+$'" in check, check


def test_a_roles_administrator_is_trusted_as_the_installers_are(server):
    """From PostgreSQL 16 a role's creator that is no superuser administers
    it (ADMIN, with neither INHERIT nor SET): it could become any role it
    administers, as it could become the installer, and is not counted as
    another that may create in the schema."""
    if server_version(server) < 160000:
        pytest.skip("before PostgreSQL 16 a role's creator is not made its member")
    server.sql("CREATE ROLE admin_mgr LOGIN CREATEROLE")
    try:
        with server.connect(user="admin_mgr") as conn:
            conn.execute("CREATE ROLE mgr_makers NOLOGIN")
            conn.execute("GRANT mgr_makers TO owner")
        fresh_database(server, "administered")
        server.sql("GRANT CREATE ON SCHEMA public TO mgr_makers", dbname="administered")
        result = run("install", "--dsn", dsn(server, "owner", "administered"))
        assert result.returncode == 0, result.stderr
    finally:
        server.sql("DROP DATABASE IF EXISTS administered WITH (FORCE)")
        server.sql("DROP ROLE IF EXISTS mgr_makers")
        server.sql("DROP ROLE admin_mgr")


def test_a_group_the_installer_shares_with_others_is_theirs_too(server):
    """CREATE granted to a group role is every member's: a group the
    installer belongs to is its own only while no other role that logs in
    (nor a member of such a role) belongs to it too; the same holds for
    the owner of an outbox_* function already there."""
    server.sql("CREATE ROLE makers NOLOGIN; CREATE ROLE inner_makers NOLOGIN IN ROLE makers; "
               "GRANT makers TO owner")
    try:
        fresh_database(server, "group_schema")
        server.sql("GRANT CREATE ON SCHEMA public TO makers", dbname="group_schema")
        result = run("install", "--dsn", dsn(server, "owner", "group_schema"))
        assert result.returncode == 0, result.stderr

        fresh_database(server, "shared_group")
        server.sql("GRANT CREATE ON SCHEMA public TO makers", dbname="shared_group")
        server.sql("GRANT inner_makers TO other")
        stderr = refused(server, "owner", "shared_group")
        assert 'schema "public" is open to others: makers (which other belongs to) may create in it' in stderr
        server.sql("REVOKE CREATE ON SCHEMA public FROM makers", dbname="shared_group")
        with server.connect(dbname="shared_group", user="postgres") as conn:
            conn.execute("GRANT CREATE ON SCHEMA public TO makers")
            conn.execute("SET ROLE makers")
            conn.execute("CREATE FUNCTION public.outbox_ack(text) RETURNS boolean LANGUAGE sql AS 'SELECT true'")
            conn.execute("RESET ROLE")
            conn.execute("REVOKE CREATE ON SCHEMA public FROM makers")
        stderr = refused(server, "owner", "shared_group")
        assert "outbox_ack(text)" in stderr
    finally:
        for dbname in ("group_schema", "shared_group"):
            server.sql(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")
        server.sql("DROP ROLE inner_makers; DROP ROLE makers")


def test_a_superuser_installing_is_refused_a_schema_others_may_create_in_and_their_functions(server):
    """A superuser is a member of every role: what another role may plant
    in the functions' schema is still another's, and would run as every
    writer that calls it. A function of the id default's name is not
    taken over, whether by `install` or by the printed script."""
    fresh_database(server, "super_open", owner="postgres")
    with server.connect(dbname="super_open", user="postgres") as conn:
        conn.execute("GRANT CREATE ON SCHEMA public TO other")
    assert 'schema "public" is open to others: other may create in it' in refused(server, "postgres", "super_open")
    # The database's owner, through pg_database_owner, when it is not the installer.
    fresh_database(server, "super_owned", owner="owner")
    assert 'schema "public" is open to others: owner may create in it' in refused(server, "postgres", "super_owned")
    plant(server, "super_open",
          "CREATE FUNCTION public.outbox_uuid_v7() RETURNS uuid LANGUAGE sql AS 'SELECT gen_random_uuid()'")
    stderr = refused(server, "postgres", "super_open")
    assert 'schema "public" is open to others' in stderr and "outbox_uuid_v7()" in stderr
    printed = run("sql")
    assert printed.returncode == 0, printed.stderr
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="belongs to role other"):
        with server.connect(dbname="super_open", user="postgres") as conn:
            conn.execute(printed.stdout)
    assert "outbox" not in schemas(server, "super_open")
    assert server.value("SELECT proowner::regrole::text FROM pg_proc WHERE proname = 'outbox_uuid_v7'",
                        dbname="super_open") == "other"
    # A schema another role owns, with no grant at all: its owner may
    # grant itself CREATE whenever it likes.
    with server.connect(dbname="super_open", user="postgres") as conn:
        conn.execute("CREATE SCHEMA owned_by_other AUTHORIZATION other")
    stderr = refused(server, "postgres", "super_open", "--schema", "owned_by_other")
    assert 'schema "owned_by_other" is open to others: other may create in it' in stderr
    # A name the script's literals could not hold is refused before anything runs.
    stderr = refused(server, "postgres", "super_open", "--schema", "x$name$")
    assert "cannot quote" in stderr


def test_an_argument_is_never_echoed(server):
    secret = "S3CRET-" + uuid.uuid4().hex
    for args in (["install", f"postgresql://owner:{secret}@127.0.0.1:1/app"],
                 ["install", f"--dns=postgresql://owner:{secret}@127.0.0.1:1/app"],
                 [f"postgresql://owner:{secret}@127.0.0.1:1/app"],
                 ["instal", "--dsn", f"postgresql://owner:{secret}@127.0.0.1:1/app"],
                 ["run", "--dsn", "x", f"--log-format={secret}"],
                 ["run", "--dsn", "x", "--dispatchers", secret],
                 ["run", "--dsn", "x", "--broker-url", f"redis://:{secret}@h/0", "--broker-url-file", "/f"],
                 ["sql", "--schema"],
                 [b"\xff" + secret.encode()]):
        result = run(*args)
        assert result.returncode == 2, args
        assert secret not in result.stderr + result.stdout, args
        assert "panicked" not in result.stderr


def test_help_and_version_answer_on_every_command():
    version = run("--version").stdout.split()[-1]
    for command in ([], ["install"], ["sql"], ["run"]):
        for flag in ("--help", "-h"):
            result = run(*command, flag)
            assert result.returncode == 0, (command, flag, result.stderr)
            assert "Usage: outbox-dispatch" in result.stdout and "Exit status:" in result.stdout
            assert "3  run: the outbox is not installed" in result.stdout
        for flag in ("--version", "-V"):
            result = run(*command, flag)
            assert result.returncode == 0 and result.stdout == f"outbox-dispatch {version}\n", (command, flag)
    assert "--dsn-file" in run("install", "--help").stdout and "--broker-url-file" in run("run", "-h").stdout
    assert run("help", "run").stdout == run("run", "--help").stdout
    # No command: the help, on standard error, exit status 2.
    result = run()
    assert result.returncode == 2 and "Usage:" in result.stderr


def test_a_misspelled_command_or_option_is_told_the_right_one():
    result = run("instal", "--dsn", "x")
    assert result.returncode == 2
    assert "did you mean 'install'" in result.stderr, result.stderr
    result = run("run", "--dsn", "x", "--dispachers", "2")
    assert result.returncode == 2
    assert "unknown option --dispachers; did you mean '--dispatchers'" in result.stderr, result.stderr


def test_the_systemd_unit_is_hardened_reads_a_private_environment_file_and_verifies(tmp_path):
    unit = (Path(__file__).resolve().parent.parent / "packaging" / "systemd" / "outbox-dispatch@.service").read_text()
    lines = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in unit.splitlines() if "=" in line
             and not line.startswith("#")}
    assert lines["EnvironmentFile"] == "/etc/outbox-dispatch/%i.env"
    assert lines["DynamicUser"] == "yes" and lines["NoNewPrivileges"] == "yes"
    assert lines["ProtectSystem"] == "strict" and lines["ProtectHome"] == "yes"
    assert lines["ExecStart"].endswith("outbox-dispatch run")
    # No restart for what a restart does not change: bad usage, a database not installed.
    assert lines["RestartPreventExitStatus"].split() == ["2", "3"]
    assert "2  bad usage" in run("--help").stdout
    if shutil.which("systemd-analyze"):
        copy = tmp_path / "outbox-dispatch@app.service"
        copy.write_text(unit.replace("/usr/local/bin/outbox-dispatch", BIN))
        result = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def private_file(tmp_path, name, text, mode=0o600):
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


def test_secrets_come_from_files_no_one_else_may_read_and_an_argument_holding_one_is_warned_of(app, tmp_path):
    app.sql("ALTER ROLE owner PASSWORD 'owner-pw'")
    with_password = f"host={app.dir} port={app.port} user=owner dbname=app password=owner-pw"
    # Given as an argument: it works, and says that every local user can read it in ps.
    result = run("install", "--dsn", f"host={app.dir} port={app.port} user=owner dbname=app password=owner-pw")
    assert result.returncode == 0, result.stderr
    assert "--dsn holds a password, which every local user can read in ps" in result.stderr
    assert "owner-pw" not in result.stderr
    # From the environment or a file of its own: no warning.
    result = run("install", env={"OUTBOX_DSN": f"host={app.dir} port={app.port} user=owner dbname=app "
                                               "password=owner-pw"})
    assert result.returncode == 0 and "holds a password" not in result.stderr
    dsn_file = private_file(tmp_path, "dsn", f"host={app.dir} port={app.port} user=owner dbname=app "
                                             "password=owner-pw\n")
    for args, env in ((["--dsn-file", str(dsn_file)], None), ([], {"OUTBOX_DSN_FILE": str(dsn_file)})):
        result = run("install", *args, env=env)
        assert result.returncode == 0 and "holds a password" not in result.stderr, result.stderr
    # A file others may read is refused, naming it and the mode it needs, before anything is done.
    for mode in (0o644, 0o640, 0o604):
        dsn_file.chmod(mode)
        result = run("install", "--dsn-file", str(dsn_file))
        assert result.returncode == 2, oct(mode)
        assert f"--dsn-file {dsn_file}" in result.stderr and "0600" in result.stderr
        assert "owner-pw" not in result.stderr
    # A --config file holding a password: refused when others may read it, as libpq refuses such a .pgpass.
    config = private_file(tmp_path, "outbox.toml", f"dsn = '{with_password}'\n", 0o644)
    result = run("install", "--config", str(config))
    assert result.returncode == 2
    assert f"--config {config}" in result.stderr and "holds a password" in result.stderr, result.stderr
    assert "owner-pw" not in result.stderr
    config.chmod(0o600)
    result = run("install", "--config", str(config))
    assert result.returncode == 0, result.stderr
    # Without a password in it, a file anyone may read is fine.
    plain = private_file(tmp_path, "plain.toml", f"dsn = 'host={app.dir} port={app.port} user=owner dbname=app'\n",
                         0o644)
    assert run("install", "--config", str(plain)).returncode == 0


def version():
    return run("--version").stdout.split()[-1]


def test_a_writer_cannot_raise_its_own_payload_limit(app):
    with app.connect(dbname="app", user="owner") as conn:
        conn.execute("INSERT INTO outbox.settings VALUES ('outbox.max_payload_bytes', '1kB')")
    try:
        with app.connect(dbname="app", user="writer") as conn:
            conn.execute("SET outbox.max_payload_bytes = '10MB'")
            with pytest.raises(psycopg.errors.ProgramLimitExceeded, match="1024"):
                conn.execute("SELECT outbox_enqueue('big', jsonb_build_object('x', repeat('x', 2000)))")
            conn.execute("SELECT outbox_enqueue('small', '{}')")
        with app.connect(dbname="app", user="writer") as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("UPDATE outbox.settings SET value = '10MB'")
    finally:
        app.sql("DELETE FROM outbox.settings", dbname="app")


def test_a_bad_setting_is_refused_naming_it(app):
    with app.connect(dbname="app", user="owner") as conn:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="outbox.max_payload_bytes is \"lots\""):
            conn.execute("INSERT INTO outbox.settings VALUES ('outbox.max_payload_bytes', 'lots')")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="outbox.report_timeout is \"-1\""):
            conn.execute("INSERT INTO outbox.settings VALUES ('outbox.report_timeout', '-1')")
        for name in ("work_mem", "outbox.max_payload_byte"):
            with pytest.raises(psycopg.errors.UndefinedObject, match=f"{name} is not a setting of outbox_dispatch"):
                conn.execute("INSERT INTO outbox.settings VALUES (%s, '1')", (name,))
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="sidecar's own configuration"):
            conn.execute("INSERT INTO outbox.settings VALUES ('outbox.broker_url', 'redis://:pw@h/0')")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="each session's own"):
            conn.execute("INSERT INTO outbox.settings VALUES ('outbox.default_queue', 'q')")
    assert app.value("SELECT count(*) FROM outbox.settings", dbname="app") == 0


@library_only("reads the settings the library registers, in a server that loads it")
def test_every_setting_of_the_library_has_its_place_without_it(app, cluster):
    """The names outbox.settings takes are the library's: each of its
    settings is the database's, the sidecar's, the launcher's, a session's
    or the rotation's."""
    names = [r[0] for r in cluster.sql("SELECT name FROM pg_settings WHERE name LIKE 'outbox.%' ORDER BY name")]
    assert len(names) > 30
    with app.connect(dbname="app", user="owner", autocommit=False) as conn:
        places = {name: conn.execute("SELECT outbox.setting_place(%s)", (name,)).fetchone()[0] for name in names}
        assert None not in places.values(), places
        values = dict(cluster.sql("SELECT name, setting FROM pg_settings WHERE name LIKE 'outbox.%'"))
        for name, place in places.items():
            if place == "database":
                conn.execute("INSERT INTO outbox.settings VALUES (%s, %s)", (name, values[name] or "x"))
        conn.rollback()


def test_a_writer_cannot_choose_its_place_in_line_with_outbox_moving(app):
    with app.connect(dbname="app", user="writer") as conn:
        conn.execute("SET outbox.moving = on")
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="outbox.moving"):
            conn.execute("INSERT INTO outbox.events (event_type, payload) VALUES ('forged', '{}')")
    assert app.value("SELECT count(*) FROM outbox.log WHERE event_type = 'forged'", dbname="app") == 0


def test_a_writer_cannot_run_its_operators_as_the_owner(app):
    """A delivery's insert runs the insert trigger as the owner (the
    routing is SECURITY DEFINER) with the writer's search_path: an operator
    the writer planted must not be what the trigger compares with."""
    app.sql("CREATE SCHEMA IF NOT EXISTS w AUTHORIZATION writer", dbname="app")
    with app.connect(dbname="app", user="owner") as conn:
        sid = conn.execute("SELECT outbox_subscribe('escalate.*', 'tasks.audit')").fetchone()[0]
    try:
        with app.connect(dbname="app", user="writer") as conn:
            conn.execute("""CREATE FUNCTION w.eq(a text, b text) RETURNS boolean LANGUAGE plpgsql AS $f$
                BEGIN
                    IF current_user::text OPERATOR(pg_catalog.<>) session_user::text THEN
                        EXECUTE 'INSERT INTO outbox.settings VALUES (''outbox.max_payload_bytes'', ''2GB'')';
                    END IF;
                    RETURN a OPERATOR(pg_catalog.=) b;
                END $f$""")
            conn.execute("CREATE OPERATOR w.= (LEFTARG = text, RIGHTARG = text, FUNCTION = w.eq)")
            conn.execute("CREATE OPERATOR w.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = w.eq)")
            conn.execute("GRANT USAGE ON SCHEMA w TO PUBLIC")
            conn.execute("SET outbox.notify = on")
            conn.execute("SET search_path = w, pg_catalog")
            conn.execute("INSERT INTO outbox.events (event_type, payload) VALUES ('escalate.now', '{}')")
        assert app.value("SELECT count(*) FROM outbox.settings", dbname="app") == 0
        assert app.value("SELECT count(*) FROM outbox.log WHERE event_type = 'escalate.now' "
                         "AND subscription_id IS NOT NULL", dbname="app") == 1
    finally:
        app.sql("DROP SCHEMA w CASCADE", dbname="app")
        app.sql("DELETE FROM outbox.settings", dbname="app")
        app.sql(f"SELECT outbox_unsubscribe({sid})", dbname="app")


def test_a_session_of_another_role_on_a_holders_pid_holds_no_lease(app):
    """A lease is its holder's while the holder's session lives. The pid of
    a holder gone may come back to any role's session, whose start an
    owner without pg_read_all_stats cannot see: such a session is not the
    holder, and the lease is free."""
    with app.connect(dbname="app", user="other") as other:
        pid = other.execute("SELECT pg_backend_pid()").fetchone()[0]
        with app.connect(dbname="app", user="owner") as conn:
            conn.execute("SET search_path = pg_catalog, pg_temp")
            assert conn.execute("SELECT backend_start FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() == (None,)
            conn.execute("INSERT INTO outbox.sidecar_leases (name, holder, backend_pid, backend_role, backend_start, "
                         "taken_at) VALUES ('dispatcher 7', 'gone', %s, 'owner'::regrole, now() - interval '1 day', "
                         "now() - interval '1 day')", (pid,))
            try:
                assert conn.execute("SELECT outbox.take_lease('dispatcher 7', 'next', NULL)").fetchone() == (None,)
            finally:
                conn.execute("DELETE FROM outbox.sidecar_leases")


def test_the_settings_the_sql_side_reads_are_bounded_as_the_library_bounds_them(app):
    with app.connect(dbname="app", user="owner") as conn:
        with pytest.raises(psycopg.errors.InvalidParameterValue,
                           match=r'outbox.retention is "100 years": it must be from 1 to 315360000 seconds'):
            conn.execute("INSERT INTO outbox.settings VALUES ('outbox.retention', '100 years')")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="outbox.report_timeout is \"10 years\""):
            conn.execute("INSERT INTO outbox.settings VALUES ('outbox.report_timeout', '10 years')")
    app.sql("ALTER DATABASE app SET outbox.max_payload_bytes = '3GB'")
    try:
        with app.connect(dbname="app", user="writer") as conn:
            with pytest.raises(psycopg.errors.InvalidParameterValue, match='outbox.max_payload_bytes is "3GB"'):
                conn.execute("SELECT outbox_enqueue('t', '{}')")
    finally:
        app.sql("ALTER DATABASE app RESET outbox.max_payload_bytes")


def test_the_settings_come_from_the_table_then_alter_database_never_the_session(app):
    app.sql("ALTER DATABASE app SET outbox.report_timeout = '90'")
    try:
        with app.connect(dbname="app", user="writer") as conn:
            conn.execute("SET outbox.report_timeout = '5'")
            assert conn.execute("SELECT outbox_report_timeout()").fetchone()[0].total_seconds() == 90
        app.sql("INSERT INTO outbox.settings VALUES ('outbox.report_timeout', '2 min')", dbname="app")
        assert app.value("SELECT outbox_report_timeout()", dbname="app").total_seconds() == 120
        app.sql("INSERT INTO outbox.settings VALUES ('outbox.report_key', '')", dbname="app")
        assert app.value("SELECT outbox_report_timeout()", dbname="app") is None
    finally:
        app.sql("ALTER DATABASE app RESET outbox.report_timeout")
        app.sql("DELETE FROM outbox.settings", dbname="app")


def test_a_keyed_event_at_repeatable_read_is_refused_naming_the_isolation(app):
    with app.connect(dbname="app", user="writer", autocommit=False) as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="repeatable read"):
            conn.execute("SELECT outbox_enqueue('k', '{}', ordering_key => 'rr')")


def test_enqueue_and_per_key_turns_as_the_library_takes_them(app):
    with app.connect(dbname="app", user="writer") as conn:
        ids = [conn.execute("SELECT outbox_enqueue('k', '{}', ordering_key => 'order-1')").fetchone()[0]
               for _ in range(3)]
        plain = conn.execute("SELECT outbox_enqueue('p', '{}')").fetchone()[0]
        # An ORM's INSERT takes the same path.
        conn.execute("INSERT INTO outbox.events (event_type, payload) VALUES ('orm', '{}')")
    rows = dict(app.sql("SELECT id, key_state FROM outbox.log WHERE ordering_key = 'order-1'", dbname="app"))
    assert [rows[i] for i in ids] == ["head", "waiting", "waiting"]
    for i in ids + [plain]:
        assert uuid.UUID(str(i)).version == 7
    assert ids == sorted(ids)
    # Never sent (no sidecar runs): an acknowledgement of it is refused, and
    # the key stays with its head.
    with app.connect(dbname="app", user="writer") as conn:
        assert conn.execute("SELECT outbox_ack(%s)", (ids[0],)).fetchone()[0] is False
        # Not its key's head yet: nothing to skip.
        assert conn.execute("SELECT outbox_skip(%s)", (ids[2],)).fetchone()[0] is False
    rows = dict(app.sql("SELECT id, key_state FROM outbox.log WHERE ordering_key = 'order-1'", dbname="app"))
    assert [rows[i] for i in ids] == ["head", "waiting", "waiting"]
    assert app.value("SELECT status FROM outbox.events WHERE id = %s", (ids[0],), dbname="app") == "pending"


def test_ids_a_session_takes_in_turn_are_in_order_within_a_millisecond(app):
    """Before PostgreSQL 18 the id is PL/pgSQL's: the fraction of the
    millisecond follows the milliseconds, so ids taken one after another
    sort as they were taken, as the library's and PostgreSQL 18's do."""
    with app.connect(dbname="app", user="writer") as conn:
        ids = [uuid.UUID(str(conn.execute("SELECT outbox_uuid_v7()").fetchone()[0])) for _ in range(300)]
        now_ms = int(conn.execute("SELECT extract(epoch FROM clock_timestamp()) * 1000").fetchone()[0])
    millis = [i.int >> 80 for i in ids]
    assert len(set(millis)) < len(ids), "no two ids in one millisecond: the test shows nothing"
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    assert now_ms - 60_000 < millis[0] <= millis[-1] <= now_ms


def test_the_inbox_claims_once(app):
    message = uuid.uuid4()
    with app.connect(dbname="app", user="writer", autocommit=False) as conn:
        assert conn.execute("SELECT outbox_inbox_claim(%s, 'c')", (message,)).fetchone()[0] is True
        assert conn.execute("SELECT outbox_inbox_claim(%s, 'c')", (message,)).fetchone()[0] is False
        conn.commit()
    with app.connect(dbname="app", user="writer") as conn:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="consumer is 256 bytes, the limit is 255"):
            conn.execute("SELECT outbox_inbox_claim(%s, %s)", (message, "c" * 256))
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="id must not be null"):
            conn.execute("SELECT outbox_inbox_claim(NULL, 'c')")


def test_subscriptions_are_the_owners_to_make(app):
    with app.connect(dbname="app", user="writer") as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="only the outbox's owner"):
            conn.execute("SELECT outbox_subscribe('order.*', 'tasks.audit')")
    with app.connect(dbname="app", user="owner") as conn:
        sid = conn.execute("SELECT outbox_subscribe('order.*', 'tasks.audit')").fetchone()[0]
        event = conn.execute("SELECT outbox_enqueue('order.paid', '{}')").fetchone()[0]
        deliveries = conn.execute("SELECT count(*) FROM outbox.log WHERE event_id = %s AND subscription_id = %s",
                                  (event, sid)).fetchone()[0]
        assert deliveries == 1
        assert conn.execute("SELECT outbox_unsubscribe(%s)", (sid,)).fetchone()[0] is True
        assert conn.execute("SELECT outbox_routed_to_default()").fetchone()[0] == 0


def test_the_views_answer_the_owner_and_a_monitor(app):
    for user in ("owner", "monitor"):
        with app.connect(dbname="app", user=user) as conn:
            status = dict(conn.execute("SELECT status::text, count FROM outbox.status").fetchall())
            assert set(status) == {"pending", "processing", "dispatched", "processed", "failed"}
            names = {r[0] for r in conn.execute("SELECT name FROM outbox.metrics").fetchall()}
            assert {"outbox_events", "outbox_lag_seconds", "outbox_events_unreported"} <= names
            text = conn.execute("SELECT outbox_metrics_prometheus()").fetchone()[0]
            assert "# TYPE outbox_events gauge\n" in text
            assert 'outbox_events{status="pending"} ' in text
            assert conn.execute("SELECT count(*) FROM outbox.workers").fetchone()[0] == 0


def test_the_printed_script_installs_the_same(server, app):
    fresh_database(server, "migrated")
    printed = run("sql", "--no-transaction")
    assert printed.returncode == 0, printed.stderr
    with server.connect(dbname="migrated", user="owner", autocommit=False) as conn:
        conn.execute("SET LOCAL search_path = app_schema, public")
        conn.execute(printed.stdout)
        # A migration goes on in the same transaction with its own path.
        assert conn.execute("SHOW search_path").fetchone()[0] == "app_schema, public"
        conn.commit()
    catalog = """SELECT n.nspname || '.' || c.relname || ':' || c.relkind::text FROM pg_class AS c
                   JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE n.nspname = 'outbox'
                 UNION ALL
                 SELECT p.oid::regprocedure::text FROM pg_proc AS p
                  WHERE p.pronamespace IN ('outbox'::regnamespace, 'public'::regnamespace)
                 ORDER BY 1"""
    assert server.sql(catalog, dbname="migrated") == server.sql(catalog, dbname="app")
    result = run("install", "--dsn", dsn(server, "owner", "migrated"))
    assert "nothing to do" in result.stdout


def schema_dump(pg, dbname):
    """`pg_dump --schema-only` of `dbname`, without pg_dump's comments."""
    dump = as_postgres(PG_BIN / "pg_dump", "--schema-only", "-h", pg.dir, "-p", pg.port, "-d", dbname).stdout
    return [line for line in dump.splitlines()
            if line.strip() and not line.startswith(("--", "\\restrict", "\\unrestrict"))]


def test_an_update_is_checked_as_an_install_is(server):
    """Updating an outbox 0.10.0 installed (which checked nobody) refuses a
    functions' schema others may create in, as an install does, and a
    --schema other than the one its functions are in."""
    fresh_database(server, "earlier_open")
    server.sql("CREATE SCHEMA fns AUTHORIZATION owner", dbname="earlier_open")
    with server.connect(dbname="earlier_open", user="owner") as conn:
        conn.execute((FIXTURES / "outbox-dispatch-0.10.0.sql").read_text())
    server.sql("GRANT CREATE ON SCHEMA public TO other", dbname="earlier_open")
    stderr = refused(server, "owner", "earlier_open", installs_nothing=False)
    assert 'schema "public" is open to others: other may create in it' in stderr
    stderr = refused(server, "owner", "earlier_open", "--schema", "fns", installs_nothing=False)
    assert 'put its functions in schema public, not "fns"' in stderr
    assert server.value("SELECT version FROM outbox.installed", dbname="earlier_open") == "0.10.0"
    assert server.value("SELECT count(*) FROM pg_proc WHERE pronamespace = 'fns'::regnamespace",
                        dbname="earlier_open") == 0


def test_an_outbox_that_0_10_0_installed_is_updated_and_then_equals_a_fresh_install(server):
    """0.10.0's script, as its `outbox-dispatch sql` printed it
    (tests/fixtures), run by the owner, with an event in line and a setting
    under a name that 1.0.0 deprecates: this release's install updates it,
    in one transaction, keeping both; a second does nothing; the schema is
    then a fresh install's, as pg_dump writes it. `sql --update-from`
    prints the same update."""
    fresh_database(server, "earlier")
    with server.connect(dbname="earlier", user="owner") as conn:
        conn.execute((FIXTURES / "outbox-dispatch-0.10.0.sql").read_text())
        event = conn.execute("SELECT outbox_enqueue('earlier', '{}', queue => 'q_earlier')").fetchone()[0]
        conn.execute("INSERT INTO outbox.settings VALUES ('outbox.redis_timeout', '7s')")
        with pytest.raises(psycopg.errors.UndefinedObject):
            conn.execute("INSERT INTO outbox.settings VALUES ('outbox.broker_timeout', '3s')")
    printed = run("sql", "--update-from", "0.10.0")
    assert printed.returncode == 0 and "CREATE OR REPLACE FUNCTION outbox.setting_place" in printed.stdout
    assert "updates only 0.10.0, 1.0.0, not 0.9.0" in run("sql", "--update-from", "0.9.0").stderr

    updated = run("install", "--dsn", dsn(server, "owner", "earlier"))
    assert updated.returncode == 0, updated.stderr
    assert f"updated outbox_dispatch 0.10.0 to {version()}" in updated.stdout
    assert server.value("SELECT version FROM outbox.installed", dbname="earlier") == version()
    assert server.value("SELECT count(*) FROM outbox.events WHERE id = %s", (event,), dbname="earlier") == 1
    assert server.value("SELECT value FROM outbox.settings WHERE name = 'outbox.redis_timeout'",
                        dbname="earlier") == "7s"
    with server.connect(dbname="earlier", user="owner") as conn:
        conn.execute("INSERT INTO outbox.settings VALUES ('outbox.broker_timeout', '3s')")
    assert "nothing to do" in run("install", "--dsn", dsn(server, "owner", "earlier")).stdout

    # The printed update, as a migration runs it: the same schema; and it
    # refuses a database at any other release.
    fresh_database(server, "migrated_earlier")
    with server.connect(dbname="migrated_earlier", user="owner") as conn:
        conn.execute((FIXTURES / "outbox-dispatch-0.10.0.sql").read_text())
    with server.connect(dbname="migrated_earlier", user="owner", autocommit=False) as conn:
        conn.execute(printed.stdout.replace("BEGIN;\n", "", 1).rsplit("COMMIT;", 1)[0])
        conn.commit()
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match=f"{version()} is installed"):
        with server.connect(dbname="earlier", user="owner") as conn:
            conn.execute(printed.stdout)

    fresh_database(server, "fresh")
    assert run("install", "--dsn", dsn(server, "owner", "fresh")).returncode == 0
    fresh = schema_dump(server, "fresh")
    # A release no update starts from is refused, naming those that do.
    fresh_database(server, "unknown")
    assert run("install", "--dsn", dsn(server, "owner", "unknown")).returncode == 0
    with server.connect(dbname="unknown", user="owner") as conn:
        conn.execute("UPDATE outbox.installed SET version = '0.0.1'")
    stderr = refused(server, "owner", "unknown", installs_nothing=False)
    assert f"{version()} updates only 0.10.0, 1.0.0, not 0.0.1: run the outbox-dispatch of 0.0.1" in stderr
    assert len(fresh) > 500
    for updated in ("earlier", "migrated_earlier"):
        dump = schema_dump(server, updated)
        assert dump == fresh, "\n".join(difflib.unified_diff(fresh, dump, "fresh", updated, lineterm=""))


def test_an_outbox_that_1_0_0_installed_is_updated_keeping_its_events_and_then_equals_a_fresh_install(server):
    """1.0.0's script (tests/fixtures), run by the owner, with a plain and a
    keyed event in line and a setting: this release's install runs the
    extension's own update and the library's functions' in one
    transaction, keeping the events, their keys' turns and the setting;
    the schema is then a fresh install's."""
    fresh_database(server, "at_1_0_0")
    with server.connect(dbname="at_1_0_0", user="owner") as conn:
        conn.execute((FIXTURES / "outbox-dispatch-1.0.0.sql").read_text())
        events = [conn.execute("SELECT outbox_enqueue('earlier', '{}', queue => 'q_earlier')").fetchone()[0],
                  *[r[0] for r in conn.execute(
                      "SELECT outbox_enqueue('earlier', '{}', queue => 'q_earlier', ordering_key => 'k') "
                      "FROM generate_series(1, 2)").fetchall()]]
        conn.execute("INSERT INTO outbox.settings VALUES ('outbox.retention', '2d')")
        # 1.0.0's documented grants: writers INSERT, operators UPDATE on the table.
        conn.execute("GRANT USAGE ON SCHEMA outbox TO writer, monitor")
        conn.execute("GRANT INSERT ON outbox.events, outbox.log TO writer")
        conn.execute("GRANT SELECT, UPDATE ON outbox.events, outbox.log TO monitor")
        before = conn.execute("SELECT id, status::text, key_state FROM outbox.events ORDER BY id").fetchall()
    updated = run("install", "--dsn", dsn(server, "owner", "at_1_0_0"))
    assert updated.returncode == 0, updated.stderr
    assert f"updated outbox_dispatch 1.0.0 to {version()}" in updated.stdout
    with server.connect(dbname="at_1_0_0", user="owner") as conn:
        assert conn.execute("SELECT id, status::text, key_state FROM outbox.events ORDER BY id").fetchall() == before
        assert sorted(r[0] for r in before) == sorted(events)
        assert conn.execute("SELECT value FROM outbox.settings WHERE name = 'outbox.retention'").fetchone()[0] == "2d"
        # An UPDATE of the table writes an event's place and its key's turn:
        # the owner's alone now; the view's stays.
        assert conn.execute("SELECT has_table_privilege('monitor', 'outbox.log', 'UPDATE'), "
                            "has_table_privilege('monitor', 'outbox.events', 'UPDATE'), "
                            "has_table_privilege('writer', 'outbox.log', 'INSERT')").fetchone() == (False, True, True)
        conn.execute("REVOKE ALL ON outbox.events, outbox.log, outbox.unread, outbox.batches, outbox.outcomes, "
                     "outbox.cursor FROM writer, monitor")
        conn.execute("REVOKE ALL ON SCHEMA outbox FROM writer, monitor")
    fresh_database(server, "fresh_1_1")
    assert run("install", "--dsn", dsn(server, "owner", "fresh_1_1")).returncode == 0
    fresh, dump = schema_dump(server, "fresh_1_1"), schema_dump(server, "at_1_0_0")
    assert len(fresh) > 500
    assert dump == fresh, "\n".join(difflib.unified_diff(fresh, dump, "fresh", "at_1_0_0", lineterm=""))
