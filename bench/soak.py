"""`make soak`: a sustained run that shows whether costs stay flat once
the rotation truncates as fast as producers insert.

Producers commit one-event transactions at a fixed rate while the
dispatcher delivers them and a consumer pops them from Redis; retention is
shortened so that many generations pass (each lasts half of it); autovacuum
is off on the events' tables (the partitions of outbox.log and
outbox.outcomes): delivery must leave them no dead tuples, and the rotation
gives their space back by TRUNCATE. Every few seconds the run records
their size and their indexes', live and dead tuples, the size of the
dispatchers' bookkeeping (outbox.batches and outbox.positions, a row or
two per claim, vacuumed by autovacuum), how long a metrics scrape takes,
and the dispatcher's memory; the COMMIT → Redis latency is taken per
window from the producers' and the consumer's clocks; the WAL of the whole
run per event is set beside a plain INSERT's in one-row transactions.
Writes bench/results/soak.md and soak.png (and soak.json, the raw series).

Sizes from the environment (defaults in brackets): SOAK_SECONDS [1800],
SOAK_RATE [1000] events/s, SOAK_RETENTION [60] seconds, SOAK_SAMPLE [5]
seconds between samples."""

import json
import multiprocessing
import os
import queue
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from harness import Cluster, Redis  # noqa: E402
from run import PAYLOAD, SERVER_CONF, consume, machine, memory_kb, pgbench, produce  # noqa: E402
from wal import create_plain  # noqa: E402

SECONDS = int(os.environ.get("SOAK_SECONDS", 1800))
RATE = int(os.environ.get("SOAK_RATE", 1000))
RETENTION = int(os.environ.get("SOAK_RETENTION", 60))
SAMPLE = float(os.environ.get("SOAK_SAMPLE", 5))
PRODUCERS = 4
WINDOW = 10  # seconds per latency percentile
RESULTS = ROOT / "bench" / "results"

# The events' tables: the partitions of outbox.log and outbox.outcomes.
EVENT_TABLES = """
SELECT p.relid FROM pg_partition_tree('outbox.log') AS p WHERE p.isleaf
UNION ALL
SELECT p.relid FROM pg_partition_tree('outbox.outcomes') AS p WHERE p.isleaf"""

SAMPLE_SQL = f"""
SELECT sum(pg_relation_size(s.relid))::bigint, sum(pg_indexes_size(s.relid))::bigint,
       sum(s.n_live_tup)::bigint, sum(s.n_dead_tup)::bigint, sum(s.autovacuum_count)::bigint
  FROM pg_stat_user_tables AS s
 WHERE s.relid IN ({EVENT_TABLES})"""


# The dispatchers' bookkeeping: a row per claim (its batch) and the cursor.
BOOK_SQL = """
SELECT sum(pg_total_relation_size(s.relid))::bigint, sum(s.n_dead_tup)::bigint
  FROM pg_stat_user_tables AS s
 WHERE s.relid IN ('outbox.batches'::regclass, 'outbox.positions'::regclass)"""


def log(*args):
    print("soak:", *args, flush=True)


def sample(pg, conn, started, pid):
    table, indexes, live, dead, vacuums = conn.execute(SAMPLE_SQL).fetchone()
    book, book_dead = conn.execute(BOOK_SQL).fetchone()
    t = time.monotonic()
    conn.execute("SELECT outbox_metrics_prometheus()").fetchone()
    scrape_ms = (time.monotonic() - t) * 1000
    rss, anon = memory_kb(pid)
    return {"t": time.monotonic() - started, "table_mb": table / 2**20, "indexes_mb": indexes / 2**20,
            "live": live, "dead": dead, "autovacuums": vacuums, "scrape_ms": scrape_ms,
            "book_mb": book / 2**20, "book_dead": book_dead,
            "dispatcher_rss_mb": rss / 1024, "dispatcher_private_mb": anon / 1024}


def latency_windows(committed, arrived, started_wall):
    """p99 COMMIT → Redis per WINDOW seconds of commit time."""
    windows = {}
    for event_id, at in committed.items():
        if event_id in arrived:
            windows.setdefault(int((at - started_wall) // WINDOW), []).append(max(0.0, arrived[event_id] - at) * 1000)
    result = []
    for w in sorted(windows):
        values = sorted(windows[w])
        result.append({"t": (w + 0.5) * WINDOW, "p99_ms": values[min(len(values) - 1, int(0.99 * len(values)))]})
    return result


def flat(series, key, after):
    """Flat after the first retention period: the last third of the run
    stays within 25% (plus a small absolute slack) of the third before it."""
    values = [s[key] for s in series if s["t"] >= after]
    third = max(1, len(values) // 3)
    middle, last = values[-2 * third:-third] or values, values[-third:]
    slack = {"table_mb": 2, "indexes_mb": 2, "dead": 5000, "book_mb": 2, "scrape_ms": 5, "p99_ms": 5,
             "dispatcher_private_mb": 2}[key]
    return max(last) <= max(middle) * 1.25 + slack, max(middle), max(last)


def report(r):
    RESULTS.mkdir(exist_ok=True)
    after = RETENTION + 10
    lines = ["# outbox_dispatch soak", "", f"Machine: {r['machine']}.", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {SECONDS} s at {RATE} events/s "
             f"({PRODUCERS} producer processes, one-event transactions), `outbox.retention = {RETENTION}s` "
             f"(generations of {RETENTION // 2} s), `outbox.lifecycle_interval = 5s`, one dispatcher (batch 100), "
             f"a consumer popping from Redis, a sample every {SAMPLE:g} s; PostgreSQL with fsync on, autovacuum off "
             "on the events' tables (the partitions of `outbox.log` and `outbox.outcomes`). `make soak` writes this "
             "file; sizes are set by SOAK_* variables (bench/soak.py).", "",
             f"Committed {r['committed']:,} events, {r['arrived']:,} arrived in Redis, "
             f"{r['purged']:,} truncated by the rotation; {r['samples'][-1]['autovacuums']} autovacuums of the "
             "events' tables.", "",
             f"WAL per event over the whole run (enqueue, delivery, rotation, checkpoints, the bookkeeping's "
             f"autovacuum): {r['wal_per_event']:,.0f} B; a plain INSERT of the same row into a table with a uuid "
             f"primary key, one row per transaction (pgbench, 2 clients, after the run): {r['plain_wal']:,.0f} B "
             f"({r['wal_per_event'] / r['plain_wal']:.1f}×).", "",
             "## Goal: every line flat after the first retention period, no dead tuples", "",
             f"Compared: the last third of the run after {after} s against the third before it (within 25% plus "
             "a small absolute slack); dead tuples must stay at 0.", "",
             "| line | middle third, max | last third, max | flat |", "|---|---|---|---|"]
    series = {"table_mb": ("table size (MB)", r["samples"]), "indexes_mb": ("index size (MB)", r["samples"]),
              "dead": ("dead tuples", r["samples"]),
              "book_mb": ("batches and positions, with indexes (MB)", r["samples"]),
              "scrape_ms": ("metrics scrape (ms)", r["samples"]),
              "p99_ms": ("p99 COMMIT → Redis (ms)", r["latency"]),
              "dispatcher_private_mb": ("dispatcher private memory (MB)", r["samples"])}
    for key, (label, data) in series.items():
        ok, middle, last = flat(data, key, after)
        if key == "dead":
            ok = max(s["dead"] for s in data) == 0
        lines.append(f"| {label} | {middle:,.1f} | {last:,.1f} | {'yes' if ok else 'no'} |")
    lines += ["", "![soak](soak.png)", ""]
    (RESULTS / "soak.md").write_text("\n".join(lines))
    (RESULTS / "soak.json").write_text(json.dumps(r, indent=1))
    plot(r, series)


def plot(r, series):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(22, 8))
    for ax, (key, (label, data)) in zip(axes.flat, series.items()):
        ax.plot([s["t"] for s in data], [s[key] for s in data])
        for k in range(1, SECONDS // RETENTION + 1):
            ax.axvline(k * RETENTION, color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(label)
        ax.set_xlabel("seconds (dotted: retention periods)")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=100)


def plain_wal(pg):
    """WAL per row of a plain INSERT of the event's row, one per
    transaction, as the producers commit theirs."""
    create_plain(pg, "soak_plain")
    payload = PAYLOAD.replace("'", "''")
    before = pg.value("SELECT pg_current_wal_lsn()")
    pgbench(pg, f"INSERT INTO soak_plain (event_type, payload, queue) VALUES ('bench', '{payload}', 'bench');\n")
    wal = float(pg.value("SELECT pg_current_wal_lsn() - %s::pg_lsn", (before,)))
    return wal / pg.value("SELECT count(*) FROM soak_plain")


def fresh_cluster(redis):
    pg = Cluster(redis.url, server_conf=SERVER_CONF, retention=f"{RETENTION}s", lifecycle_interval="5s",
                 enabled="on")
    pg.sql("CREATE EXTENSION outbox_dispatch")
    for (relid,) in pg.sql(EVENT_TABLES):
        pg.sql(f"ALTER TABLE {relid} SET (autovacuum_enabled = off)")
    pg.wait_idle()
    return pg


def main():
    redis = Redis()
    try:
        r = sustained(redis)
    finally:
        redis.close()
    report(r)
    print((RESULTS / "soak.md").read_text())


def sustained(redis):
    """Producers at RATE for SECONDS on a fresh cluster, sampled."""
    pg = fresh_cluster(redis)
    try:
        [pid] = pg.dispatcher_pids()
        per_producer = RATE // PRODUCERS
        results = multiprocessing.Queue()
        consumer = multiprocessing.Process(target=consume, args=(redis.port, per_producer * PRODUCERS * SECONDS,
                                                                 results))
        consumer.start()
        started, started_wall = time.monotonic(), time.time()
        wal_start = pg.value("SELECT pg_current_wal_lsn()")
        producers = [multiprocessing.Process(target=produce, args=(str(pg.dir), pg.port, per_producer, SECONDS,
                                                                   results)) for _ in range(PRODUCERS)]
        for p in producers:
            p.start()
        samples = []
        times = {"committed": {}, "arrived": {}}
        reported = 0
        with pg.connect() as conn:
            # Until every producer and the consumer have sent their times
            # (a process cannot exit before its queue is read).
            while reported < PRODUCERS + 1:
                samples.append(sample(pg, conn, started, pid))
                last = samples[-1]
                log(f"{last['t']:6.0f}s tables {last['table_mb']:.1f} MB, indexes {last['indexes_mb']:.1f} MB, "
                    f"live {last['live']:,}, dead {last['dead']:,}, batches and positions {last['book_mb']:.1f} MB "
                    f"({last['book_dead']:,} dead), scrape {last['scrape_ms']:.1f} ms")
                deadline = time.monotonic() + SAMPLE
                while reported < PRODUCERS + 1 and (pause := deadline - time.monotonic()) > 0:
                    try:
                        kind, part = results.get(timeout=pause)
                    except queue.Empty:
                        break
                    times[kind].update(part)
                    reported += 1
                assert time.monotonic() - started < SECONDS + 300, "producers or consumer stalled"
            for p in producers + [consumer]:
                p.join()
            wal = float(pg.value("SELECT pg_current_wal_lsn() - %s::pg_lsn", (wal_start,)))
        return {"machine": machine(), "samples": samples,
                "wal_per_event": wal / max(1, len(times["committed"])), "plain_wal": plain_wal(pg),
                "latency": latency_windows(times["committed"], times["arrived"], started_wall),
                "committed": len(times["committed"]), "arrived": len(times["arrived"]),
                "purged": int(pg.metric("outbox_purged_total"))}
    finally:
        pg.close()


if __name__ == "__main__":
    main()
