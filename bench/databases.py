"""`make bench`, part three: the drain rate with one database served, and
with three served at once by one server (outbox.database = '*'), each with
its own dispatchers. Runs its own PostgreSQL 15 (fsync on) and Redis, with
the release build installed by the Makefile; writes
bench/results/databases.md and the raw numbers in databases.json.

Sizes from the environment (defaults in brackets): BENCH_DB_EVENTS
[100000] events per database, BENCH_DB_BATCH [1000], BENCH_DB_WORKERS [1]
dispatchers per database, BENCH_ROUNDS [3] runs of each (the median is
reported)."""

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import Cluster, Redis, wait_until  # noqa: E402

EVENTS = int(os.environ.get("BENCH_DB_EVENTS", 100_000))
BATCH = int(os.environ.get("BENCH_DB_BATCH", 1000))
WORKERS = int(os.environ.get("BENCH_DB_WORKERS", 1))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
RESULTS = ROOT / "bench" / "results"
SERVER_CONF = {"fsync": "on", "shared_buffers": "'512MB'", "max_wal_size": "'4GB'", "checkpoint_timeout": "'15min'",
               "autovacuum": "off"}
DATABASES = ("db1", "db2", "db3")
PAYLOAD = json.dumps({"n": 1, "pad": "x" * 80})


def log(*args):
    print("bench:", *args, flush=True)


def dispatched(pg, name):
    return pg.value("SELECT value FROM outbox.metrics WHERE name = 'outbox_dispatched_total'", dbname=name) or 0


def drain(pg, redis, names):
    """Events per second, over every database in `names`, from enabling the
    dispatchers to the last push; and each database's own rate."""
    pg.configure(enabled="off")
    redis.client().flushall()
    for name in names:
        with pg.connect(dbname=name) as conn:
            conn.execute("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
            conn.execute(f"SELECT outbox_enqueue('bench', %s::jsonb, queue => 'bench_{name}') "
                         f"FROM generate_series(1, %s)", (PAYLOAD, EVENTS))
            conn.execute("VACUUM ANALYZE outbox.log")
    pg.sql("CHECKPOINT")
    before = {name: dispatched(pg, name) for name in names}
    finished = {}
    started = time.monotonic()
    pg.configure(enabled="on")
    while len(finished) < len(names):
        for name in names:
            if name not in finished and dispatched(pg, name) - before[name] >= EVENTS:
                finished[name] = time.monotonic() - started
        assert time.monotonic() - started < 600, f"drain stalled: {finished}"
        time.sleep(0.05)
    elapsed = max(finished.values())
    for name in names:
        assert redis.client().llen(f"bench_{name}") == EVENTS
    return {"rate": EVENTS * len(names) / elapsed,
            "per_database": {name: EVENTS / seconds for name, seconds in finished.items()}}


def main():
    RESULTS.mkdir(exist_ok=True)
    redis = Redis()
    runs = {"one": [], "three": []}
    try:
        pg = Cluster(redis.url, server_conf=SERVER_CONF, database="*", workers=WORKERS, batch_size=BATCH,
                     enabled="off")
        try:
            for name in DATABASES:
                pg.sql(f"CREATE DATABASE {name}")
                pg.sql("CREATE EXTENSION outbox_dispatch", dbname=name)
            wait_until(lambda: pg.value("SELECT count(*) FROM pg_stat_activity "
                                        "WHERE backend_type = 'outbox dispatcher'") == WORKERS * len(DATABASES),
                       timeout=60, message="every database's dispatchers")
            for round_ in range(ROUNDS):
                log(f"round {round_ + 1}: one database")
                runs["one"].append(drain(pg, redis, DATABASES[:1]))
                log(f"  {runs['one'][-1]['rate']:,.0f} events/s")
                log(f"round {round_ + 1}: three databases at once")
                runs["three"].append(drain(pg, redis, DATABASES))
                log(f"  {runs['three'][-1]['rate']:,.0f} events/s in all")
        finally:
            pg.close()
    finally:
        redis.close()
    one = statistics.median(r["rate"] for r in runs["one"])
    three = statistics.median(r["rate"] for r in runs["three"])
    slowest = statistics.median(min(r["per_database"].values()) for r in runs["three"])
    lines = [
        "# Several databases served at once", "",
        f"{EVENTS:,} pending events per database, drained by {WORKERS} dispatcher(s) per database, batch {BATCH}, "
        f"one PostgreSQL 15 server (fsync on, autovacuum off) serving `outbox.database = '*'`; the median of "
        f"{ROUNDS} runs. {os.cpu_count()} cores.", "",
        "| databases draining at once | events/s, all databases | events/s, slowest database |",
        "|---|---|---|",
        f"| 1 | {one:,.0f} | {one:,.0f} |",
        f"| 3 | {three:,.0f} | {slowest:,.0f} |", "",
        f"Three databases drain at {three / one:.0%} of one database's rate in all: their dispatchers share "
        "the cores, the WAL and Redis.",
    ]
    (RESULTS / "databases.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "databases.json").write_text(json.dumps(runs, indent=1))
    print((RESULTS / "databases.md").read_text())


if __name__ == "__main__":
    main()
