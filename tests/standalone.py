"""What the tests of outbox_dispatch without the library share: a server
with no shared_preload_libraries and roles that are not superusers, as on a
managed service, and the `outbox-dispatch` command."""

import os
import subprocess
from contextlib import contextmanager

from harness import ROOT, Cluster

BIN = os.environ.get("OUTBOX_DISPATCH_BIN", str(ROOT / "target" / "debug" / "outbox-dispatch"))


def run(*args, env=None):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@contextmanager
def plain_server(**settings):
    """A server without the library; roles owner, writer, monitor (of
    pg_monitor) and other, all LOGIN and none superuser."""
    pg = Cluster("redis://127.0.0.1:1/0", preload=False, **settings)
    try:
        pg.sql("CREATE ROLE owner LOGIN")
        pg.sql("CREATE ROLE writer LOGIN")
        pg.sql("CREATE ROLE monitor LOGIN IN ROLE pg_monitor")
        pg.sql("CREATE ROLE other LOGIN")
        yield pg
    finally:
        pg.close()


def dsn(pg, user, dbname):
    return f"host={pg.dir} port={pg.port} user={user} dbname={dbname}"


def fresh_database(pg, name, owner="owner"):
    pg.sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    pg.sql(f"CREATE DATABASE {name} OWNER {owner}")


def install(pg, dbname, owner="owner"):
    """A fresh database `dbname`, installed by its owner, with writer
    granted as docs/managed.md says."""
    fresh_database(pg, dbname, owner=owner)
    result = run("install", "--dsn", dsn(pg, owner, dbname))
    assert result.returncode == 0, result.stderr
    with pg.connect(dbname=dbname, user=owner) as conn:
        conn.execute("GRANT USAGE ON SCHEMA outbox TO writer")
        conn.execute("GRANT INSERT ON outbox.events, outbox.log TO writer")
        conn.execute("GRANT EXECUTE ON FUNCTION outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, "
                     "interval, jsonb, text), outbox_ack(uuid), outbox_skip(uuid), outbox_inbox_claim(uuid, text), "
                     "outbox_subscribe(text, text, text, integer, integer, interval) TO writer")
