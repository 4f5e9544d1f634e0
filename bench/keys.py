"""`make bench`, part four: per-key order. Runs its own PostgreSQL 15 (fsync
on) and Redis, with the release build installed by the Makefile; writes
bench/results/keys.md and the raw numbers in keys.json.

- The full loop (enqueue → dispatch → a stock prefork Celery worker with
  outbox_dispatch.celery → its report → processed), without keys and with
  every event keyed over BENCH_KEYS keys, one at a time per key.
- The drain of events without a key, with BENCH_BLOCKED keys blocked by a
  dead-lettered head (each with events waiting behind it) and with none.
- The enqueue rate of one session, with and without keys.

Sizes from the environment (defaults in brackets): BENCH_KEY_EVENTS
[100000] events of each full loop, BENCH_KEYS [1000], BENCH_BLOCKED
[10000] keys blocked, BENCH_KEY_WAITING [5] events waiting per blocked
key, BENCH_DRAIN_EVENTS [100000], BENCH_ROUNDS [3] runs of each drain (the
median is reported)."""

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import CeleryWorker, Cluster, Redis, wait_until  # noqa: E402

LOOP_EVENTS = int(os.environ.get("BENCH_KEY_EVENTS", 100_000))
KEYS = int(os.environ.get("BENCH_KEYS", 1000))
BLOCKED = int(os.environ.get("BENCH_BLOCKED", 10_000))
WAITING = int(os.environ.get("BENCH_KEY_WAITING", 5))
DRAIN_EVENTS = int(os.environ.get("BENCH_DRAIN_EVENTS", 100_000))
ENQUEUE_EVENTS = 50_000
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
BATCH = 1000
RESULTS = ROOT / "bench" / "results"
SERVER_CONF = {"fsync": "on", "shared_buffers": "'512MB'", "max_wal_size": "'4GB'", "checkpoint_timeout": "'15min'"}


def log(*args):
    print("bench:", *args, flush=True)


def full_loop(pg, redis, keyed):
    """Events per second from enabling the dispatchers to the last
    `processed`, through a prefork worker of 2 processes (as bench/run.py's
    full loop): LOOP_EVENTS events, keyed round-robin over KEYS keys or
    not at all."""
    pg.configure(enabled="off")
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    redis.client().flushall()
    worker = CeleryWorker(redis.url, queues=("bench_keys",), app="loop_app", pool="prefork", concurrency=2,
                          extra_args=("--prefetch-multiplier=100", "--loglevel=WARNING"))
    try:
        wait_until(lambda: redis.client().exists("_kombu.binding.bench_keys") or worker.proc.poll() is not None,
                   timeout=60, message="the Celery worker")
        key = f"'k' || (g %% {KEYS})" if keyed else "NULL"
        with pg.connect() as conn:
            conn.execute(f"SELECT outbox_enqueue('bench.loop', '{{}}', queue => 'bench_keys', task => 'loop.noop', "
                         f"ordering_key => {key}) FROM generate_series(1, %s) AS g", (LOOP_EVENTS,))
            conn.execute("VACUUM ANALYZE outbox.log")
        started = time.monotonic()
        pg.configure(enabled="on")
        while pg.count("processed") < LOOP_EVENTS:
            assert time.monotonic() - started < 1800, "the full loop stalled"
            time.sleep(0.2)
        elapsed = time.monotonic() - started
    finally:
        worker.close()
    return {"events": LOOP_EVENTS, "keys": KEYS if keyed else 0, "seconds": elapsed, "rate": LOOP_EVENTS / elapsed}


def enqueue_rate(pg, keyed):
    """Events per second that one session enqueues, 1,000 per transaction,
    keyed over 1,000 keys or not (the dispatchers paused)."""
    pg.configure(enabled="off")
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    key = "'k' || g" if keyed else "NULL"
    started = time.monotonic()
    with pg.connect() as conn:
        for _ in range(ENQUEUE_EVENTS // 1000):
            conn.execute(f"SELECT outbox_enqueue('bench', '{{}}', queue => 'bench_enqueue', ordering_key => {key}) "
                         "FROM generate_series(1, 1000) AS g")
    return ENQUEUE_EVENTS / (time.monotonic() - started)


def block_keys(pg, n):
    """`n` keys whose head is dead-lettered (outbox.key_on_failure =
    block), each with WAITING events behind it."""
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    if n == 0:
        return
    with pg.connect() as conn:
        # A thousand keys per transaction: each holds its keys' locks to its
        # commit, one lock table entry per key (docs/guides/per-key-order.md).
        for first in range(1, n + 1, 1000):
            conn.execute("SELECT outbox_enqueue('bench.blocked', '{}', queue => 'bench_blocked', "
                         "ordering_key => 'blocked' || k) "
                         "FROM generate_series(%s::int, %s::int) AS k, generate_series(0, %s::int) AS s ORDER BY k, s",
                         (first, min(first + 999, n), WAITING))
        conn.execute("UPDATE outbox.events SET status = 'failed', last_error = 'bench' WHERE key_state = 'head'")
        conn.execute("VACUUM ANALYZE outbox.log")


def drain(pg, redis, blocked):
    """Events per second draining DRAIN_EVENTS events without a key, batch
    BATCH, with `blocked` keys blocked."""
    pg.configure(enabled="off")
    block_keys(pg, blocked)
    redis.client().flushall()
    with pg.connect() as conn:
        conn.execute("SELECT outbox_enqueue('bench', '{\"n\": 1}', queue => 'bench_drain') "
                     "FROM generate_series(1, %s)", (DRAIN_EVENTS,))
        conn.execute("VACUUM ANALYZE outbox.log")
    pg.sql("CHECKPOINT")
    started = time.monotonic()
    pg.configure(enabled="on")
    while redis.client().llen("bench_drain") < DRAIN_EVENTS:
        assert time.monotonic() - started < 600, "the drain stalled"
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    assert pg.value("SELECT count(*) FROM outbox.events WHERE key_state = 'waiting'") == blocked * WAITING
    return DRAIN_EVENTS / elapsed


def main():
    RESULTS.mkdir(exist_ok=True)
    redis = Redis()
    r = {"loop": {}, "drain": {"none": [], "blocked": []}, "enqueue": {"unkeyed": [], "keyed": []}}
    try:
        pg = Cluster(redis.url, server_conf=SERVER_CONF, batch_size=BATCH, enabled="off")
        try:
            pg.sql("CREATE EXTENSION outbox_dispatch")
            wait_until(lambda: len(pg.dispatcher_pids()) == 1, message="the dispatcher")
            for round_ in range(ROUNDS):
                for label in ("unkeyed", "keyed"):
                    r["enqueue"][label].append(enqueue_rate(pg, label == "keyed"))
                    log(f"round {round_ + 1}: enqueue, {label}: {r['enqueue'][label][-1]:,.0f} events/s")
            for keyed in (False, True):
                log(f"full loop, {LOOP_EVENTS} events, {'keyed over %d keys' % KEYS if keyed else 'no key'}")
                r["loop"]["keyed" if keyed else "unkeyed"] = full_loop(pg, redis, keyed)
                log(f"  {r['loop']['keyed' if keyed else 'unkeyed']['rate']:,.0f} events/s processed")
            pg.sql("ALTER SYSTEM SET autovacuum = off")
            pg.configure(report_key="")
            for round_ in range(ROUNDS):
                for label, blocked in (("none", 0), ("blocked", BLOCKED)):
                    log(f"round {round_ + 1}: drain with {blocked} keys blocked")
                    r["drain"][label].append(drain(pg, redis, blocked))
                    log(f"  {r['drain'][label][-1]:,.0f} events/s")
        finally:
            pg.close()
    finally:
        redis.close()
    unkeyed, keyed = r["loop"]["unkeyed"], r["loop"]["keyed"]
    none = statistics.median(r["drain"]["none"])
    blocked = statistics.median(r["drain"]["blocked"])
    enqueue = {label: statistics.median(rates) for label, rates in r["enqueue"].items()}
    lines = [
        "# Per-key order", "",
        f"One PostgreSQL 15 server (fsync on), one dispatcher, batch {BATCH}; {os.cpu_count()} cores.", "",
        "## Full loop, with and without keys", "",
        f"{LOOP_EVENTS:,} events for a no-op task, committed while the dispatcher was paused; then enabled. A "
        "stock Celery worker (prefork, 2 processes, prefetch 100) with `outbox_dispatch.celery` runs them and "
        "reports each outcome; keyed, an event is sent only once the one before it of its key is reported "
        f"processed. Keys are given round-robin: {LOOP_EVENTS // KEYS:,} events per key.", "",
        "| events | keys | all processed after | processed/s |",
        "|---|---|---|---|",
        f"| {unkeyed['events']:,} | none | {unkeyed['seconds']:.1f} s | {unkeyed['rate']:,.0f} |",
        f"| {keyed['events']:,} | {KEYS:,} | {keyed['seconds']:.1f} s | {keyed['rate']:,.0f} |", "",
        f"Keyed: {keyed['rate'] / unkeyed['rate']:.0%} of the rate without keys.", "",
        "## Drain without keys, with keys blocked", "",
        f"{DRAIN_EVENTS:,} pending events without a key, drained to Redis (reports off, autovacuum off), with "
        f"no key blocked and with {BLOCKED:,} keys blocked by a dead-lettered head, {WAITING} events waiting "
        f"behind each ({BLOCKED * WAITING:,} waiting events); the median of {ROUNDS} runs.", "",
        "| keys blocked | events/s |",
        "|---|---|",
        f"| 0 | {none:,.0f} |",
        f"| {BLOCKED:,} | {blocked:,.0f} |", "",
        f"With {BLOCKED:,} keys blocked: {blocked / none:.0%} of the rate with none.", "",
        "## Enqueue", "",
        f"{ENQUEUE_EVENTS:,} events enqueued by one session with `outbox_enqueue()`, 1,000 per transaction "
        f"(the dispatchers paused); keyed: 1,000 distinct keys per transaction. The median of {ROUNDS} runs.", "",
        "| events | events/s |",
        "|---|---|",
        f"| without a key | {enqueue['unkeyed']:,.0f} |",
        f"| keyed | {enqueue['keyed']:,.0f} |", "",
        f"Keyed: {enqueue['keyed'] / enqueue['unkeyed']:.0%} of the rate without a key (the key's lock, "
        "a sequence value and a look at the key's newest event, per event).",
    ]
    (RESULTS / "keys.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "keys.json").write_text(json.dumps(r, indent=1))
    print((RESULTS / "keys.md").read_text())


if __name__ == "__main__":
    main()
