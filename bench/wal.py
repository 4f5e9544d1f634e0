"""`make bench`, the write path: WAL per event of each part of an event's
life, beside the physical floor (a plain INSERT of the same row into a
table with a uuid primary key) and PgQ (Debian's postgresql-15-pgq3: insert
and tick, then a bare consume), in the same run, on the same server.

Each path is measured over BENCH_WAL_EVENTS [100000] events of
BENCH_PAYLOAD_BYTES [100] bytes, with a checkpoint before each phase (so
every phase pays the full-page images of the pages it touches first), and
autovacuum off (vacuum's own WAL is not counted; the dead tuples each path
leaves are reported beside it). Paths: plain; keyed (100 events per key);
fan-out 3 (three subscriptions); failed then retried (one failed push per
event); and the whole loop with reports on (a stock Celery worker running
a no-op task, reporting through outbox_dispatch.celery). Phases: enqueue,
delivery (claim, push, mark), reports (recorded), retention (purged).

Writes bench/results/wal.md and bench/results/wal.json."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import PG_BIN, CeleryWorker, Cluster, Redis, wait_until  # noqa: E402

EVENTS = int(os.environ.get("BENCH_WAL_EVENTS", 100_000))
PAYLOAD_BYTES = int(os.environ.get("BENCH_PAYLOAD_BYTES", 100))
PER_KEY = 100
CHUNK = 10_000
RESULTS = ROOT / "bench" / "results"
SERVER_CONF = {"fsync": "on", "shared_buffers": "'512MB'", "max_wal_size": "'8GB'", "checkpoint_timeout": "'1h'",
               "autovacuum": "off"}
PAYLOAD = json.dumps({"n": 1, "pad": "x" * max(0, PAYLOAD_BYTES - 20)})


def log(*args):
    print("bench/wal:", *args, flush=True)


def wal_of(pg, work):
    """Bytes of WAL written while `work()` runs, after a checkpoint."""
    pg.sql("CHECKPOINT")
    start = pg.value("SELECT pg_current_wal_insert_lsn()::text")
    work()
    return int(pg.value("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)", (start,)))


def in_chunks(pg, statement, *params):
    """Runs `statement` (which inserts %s rows) for EVENTS rows, a
    transaction per CHUNK."""
    with pg.connect() as conn:
        for start in range(0, EVENTS, CHUNK):
            conn.execute(statement, (*params, min(CHUNK, EVENTS - start)))


def create_plain(pg, name):
    """The floor's table: an event's row (its type, payload and queue) with
    a uuid primary key and its creation time, and nothing else. `make
    bench` compares both the WAL (here) and the enqueue rate (bench/run.py)
    with a plain INSERT into it."""
    pg.sql(f"CREATE TABLE {name} (id uuid PRIMARY KEY DEFAULT outbox_uuid_v7(), event_type text NOT NULL, "
           "payload jsonb NOT NULL, queue text NOT NULL, created_at timestamptz NOT NULL DEFAULT clock_timestamp())")


def floor(pg):
    """WAL per row of a plain INSERT of the same row."""
    create_plain(pg, "plain_events")
    try:
        return wal_of(pg, lambda: in_chunks(
            pg, "INSERT INTO plain_events (event_type, payload, queue) "
                "SELECT 'bench', %s::jsonb, 'bench' FROM generate_series(1, %s)", PAYLOAD)) / EVENTS
    finally:
        pg.sql("DROP TABLE plain_events")


def pgq(pg, events=EVENTS, per_tick=CHUNK // 10):
    """PgQ 3 on the same server: WAL per event of insert_event for `events`
    events with a tick every `per_tick` (so batches of that size), and of
    the bare consume (next_batch, get_batch_events, finish_batch) by one
    consumer, with its rate. `make bench` (bench/run.py) compares the
    drain with the rate."""
    pg.sql("CREATE EXTENSION IF NOT EXISTS pgq")
    pg.sql("SELECT pgq.create_queue('bench')")
    pg.sql("SELECT pgq.register_consumer('bench', 'bench')")

    def insert():
        with pg.connect() as conn:
            for start in range(0, events, per_tick):
                conn.execute("SELECT pgq.insert_event('bench', 'bench', %s) FROM generate_series(1, %s)",
                             (PAYLOAD, min(per_tick, events - start)))
                conn.execute("SELECT pgq.force_tick('bench')")
                conn.execute("SELECT pgq.ticker('bench')")

    elapsed = []

    def consume():
        seen = 0
        with pg.connect() as conn:
            started = time.monotonic()
            while seen < events:
                batch = conn.execute("SELECT pgq.next_batch('bench', 'bench')").fetchone()[0]
                assert batch is not None, f"PgQ gave no batch after {seen} events"
                seen += conn.execute("SELECT count(*) FROM pgq.get_batch_events(%s)", (batch,)).fetchone()[0]
                conn.execute("SELECT pgq.finish_batch(%s)", (batch,))
            elapsed.append(time.monotonic() - started)

    try:
        inserted = wal_of(pg, insert) / events
        consumed = wal_of(pg, consume) / events
        return {"insert": inserted, "consume": consumed, "consume_rate": events / elapsed[0]}
    finally:
        pg.sql("SELECT pgq.unregister_consumer('bench', 'bench')")
        pg.sql("SELECT pgq.drop_queue('bench')")


def dead_tuples(pg):
    """Dead tuples in outbox.log's partitions, counted (pgstattuple)."""
    return pg.value("SELECT sum((pgstattuple(relid)).dead_tuple_count)::bigint "
                    "FROM pg_partition_tree('outbox.log') WHERE isleaf")


def outbox_path(pg, redis, name, enqueue, before_delivery=None, during_delivery=None, reports=False):
    """One path's phases: WAL per event of each, and the dead tuples it
    left in outbox.log."""
    pg.configure(enabled="off", retention="1h", lifecycle_interval="1h", report_key="", batch_size=1000)
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    redis.client().flushall()
    pg.sql("SELECT pg_stat_reset()")
    result = {"enqueue": wal_of(pg, enqueue) / EVENTS}
    if before_delivery:
        before_delivery()
    final = "processed" if reports else "dispatched"
    rows = pg.value("SELECT count(*) FROM outbox.events WHERE status = 'pending' OR key_state = 'waiting'")

    def deliver():
        pg.configure(enabled="on", **({"report_key": "outbox_dispatch.reports"} if reports else {}))
        if during_delivery:
            during_delivery()
        wait_until(lambda: pg.value(f"SELECT count(*) FROM outbox.events WHERE status = '{final}'") >= rows,
                   timeout=900, interval=0.5, message=f"{name}: every event {final}")
        pg.wait_idle()

    result["delivery" if not reports else "delivery and reports"] = wal_of(pg, deliver) / EVENTS
    result["dead tuples after delivery"] = dead_tuples(pg)

    def purge():
        pg.configure(retention="1s", lifecycle_interval="1s")
        time.sleep(2)
        wait_until(lambda: pg.value("SELECT count(*) FROM outbox.events") == 0, timeout=600, interval=0.5,
                   message=f"{name}: every event purged")
        pg.configure(enabled="off")

    result["retention"] = wal_of(pg, purge) / EVENTS
    result["whole life"] = sum(v for k, v in result.items() if k != "dead tuples after delivery")
    return result


def enqueue_plain(pg, **extra):
    names = ", ".join(f"{k} => %s" for k in extra)
    call = f"outbox_enqueue('bench', %s::jsonb, queue => 'bench'{', ' + names if names else ''})"
    return lambda: in_chunks(pg, f"SELECT {call} FROM generate_series(1, %s)", PAYLOAD, *extra.values())


def main():
    RESULTS.mkdir(exist_ok=True)
    version = subprocess.run([PG_BIN / "pg_config", "--version"], capture_output=True, text=True, check=True).stdout
    major = int(version.split()[1].split(".")[0])
    redis = Redis()
    pg = Cluster(redis.url, server_conf=SERVER_CONF, enabled="off")
    r = {"events": EVENTS, "payload_bytes": PAYLOAD_BYTES}
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.sql("CREATE EXTENSION pgstattuple")
        log(f"floor: a plain INSERT, {EVENTS} rows")
        r["floor"] = floor(pg)
        log(f"  {r['floor']:.0f} B/row")
        if major == 15:
            log("PgQ")
            r["pgq"] = pgq(pg)
            log(f"  {r['pgq']}")
        paths = {}
        log("path: plain")
        paths["plain"] = outbox_path(pg, redis, "plain", enqueue_plain(pg))
        log(f"  {paths['plain']}")
        log("path: keyed")
        paths["keyed"] = outbox_path(pg, redis, "keyed", lambda: in_chunks(
            pg, "SELECT outbox_enqueue('bench', %s::jsonb, queue => 'bench', "
                "ordering_key => 'k' || (g %% " + str(EVENTS // PER_KEY) + ")) FROM generate_series(1, %s) AS g",
            PAYLOAD))
        log(f"  {paths['keyed']}")
        log("path: fan-out 3")
        for task in ("a", "b", "c"):
            pg.sql(f"SELECT outbox_subscribe('bench.fanout', 'bench.{task}', queue => 'bench')")
        paths["fan-out 3"] = outbox_path(pg, redis, "fan-out 3", lambda: in_chunks(
            pg, "SELECT outbox_enqueue('bench.fanout', %s::jsonb) FROM generate_series(1, %s)", PAYLOAD))
        pg.sql("SELECT outbox_unsubscribe(id) FROM outbox.subscriptions")
        log(f"  {paths['fan-out 3']}")
        log("path: failed then retried")

        def refuse():
            # A string where the list should be: every push fails (WRONGTYPE),
            # and is tried again after a backoff long enough for every
            # event to fail once first.
            redis.client().set("bench", "not a list")
            pg.configure(retry_backoff="20s")

        def accept():
            wait_until(lambda: pg.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0") >= EVENTS,
                       timeout=600, interval=0.5, message="every event failed once")
            redis.client().delete("bench")

        paths["failed then retried"] = outbox_path(pg, redis, "failed then retried", enqueue_plain(pg),
                                                   before_delivery=refuse, during_delivery=accept)
        pg.sql("ALTER SYSTEM RESET outbox.retry_backoff")
        log(f"  {paths['failed then retried']}")
        log("path: reports on, through a stock Celery worker")
        worker = CeleryWorker(redis.url, queues=("bench",), app="loop_app", pool="prefork", concurrency=2,
                              extra_args=("--prefetch-multiplier=100", "--loglevel=WARNING"))
        try:
            wait_until(lambda: redis.client().exists("_kombu.binding.bench") or worker.proc.poll() is not None,
                       timeout=60, message="the Celery worker")
            paths["reports on"] = outbox_path(
                pg, redis, "reports on", lambda: in_chunks(
                    pg, "SELECT outbox_enqueue('bench', %s::jsonb, queue => 'bench', task => 'loop.noop') "
                        "FROM generate_series(1, %s)", PAYLOAD),
                reports=True)
        finally:
            worker.close()
        log(f"  {paths['reports on']}")
        r["paths"] = paths
    finally:
        pg.close()
        redis.close()
    (RESULTS / "wal.json").write_text(json.dumps(r, indent=1))
    (RESULTS / "wal.md").write_text(report(r))
    print(report(r))


def report(r):
    lines = [f"# WAL per event ({r['events']:,} events, {r['payload_bytes']} B payloads, a checkpoint before each "
             "phase, autovacuum off)", "",
             f"Floor, a plain INSERT of the same row into a table with a uuid primary key: **{r['floor']:.0f} B**.", ""]
    if "pgq" in r:
        p = r["pgq"]
        lines += [f"PgQ 3 (postgresql-15-pgq3) on the same server: insert and tick {p['insert']:.0f} B, "
                  f"bare consume {p['consume']:.1f} B ({p['consume_rate']:,.0f} events/s, one consumer).", ""]
    lines += ["| path | phase | WAL per event | × floor |", "|---|---|---|---|"]
    for path, phases in r["paths"].items():
        for phase, value in phases.items():
            if phase == "dead tuples after delivery":
                continue
            lines.append(f"| {path} | {phase} | {value:,.0f} B | {value / r['floor']:.1f} |")
        lines.append(f"| {path} | dead tuples after delivery | {phases['dead tuples after delivery']:,} | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
