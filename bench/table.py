"""`make bench`, reading outbox.events: what a read of the view costs beside
a read of the table it shows, and the status filters people write, over
BENCH_TABLE_EVENTS [1000000] events delivered in batches of 100, half of
the batches reported processed (an outcome row each, as a round of reports
records it), with 100 dead letters and 100 events in line. Each query runs
twice through the view as 1.0.0 defined it (a row at a time through
outbox.event_status() and outbox.batch_of(), recreated here as
bench_events_1_0) and through outbox.events; the figures are the second
run's, in CPU time of the backend (from /proc) and wall time.

Writes bench/results/table.md and bench/results/table.json."""

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import Cluster, Redis, wait_until  # noqa: E402

EVENTS = int(os.environ.get("BENCH_TABLE_EVENTS", 1_000_000))
RESULTS = ROOT / "bench" / "results"
# 1.0.0's view, row by row (sql/schema.sql at 1.0.0).
VIEW_1_0 = """
CREATE VIEW public.bench_events_1_0 AS
SELECT l.id, l.event_type, l.payload, l.queue, l.task, l.headers, l.priority,
       outbox.event_status(l.status, l.pending_xid, l.id, l.key_state) AS status,
       l.retry_count, l.created_at, l.available_at, l.last_error, l.args, l.expires_at, l.event_id,
       l.subscription_id, l.routed_to,
       l.deliveries + (outbox.batch_of(l.pending_xid, l.id) IS NOT NULL)::integer AS deliveries,
       l.pending_xid, l.ordering_key, l.key_seq, l.key_state,
       outbox.batch_of(l.pending_xid, l.id) AS batch
  FROM outbox.log AS l"""
# Each: its name, its SQL, and whether it reads every row through 1.0.0's
# view (which derives the status of each before it can filter on it).
QUERIES = [
    ("read every row (status, deliveries, batch)",
     "SELECT count(e.status), count(e.deliveries), count(e.batch) FROM {view} AS e", True),
    ("status = 'failed'", "SELECT count(*) FROM {view} AS e WHERE e.status = 'failed'", True),
    ("status = 'pending'", "SELECT count(*) FROM {view} AS e WHERE e.status = 'pending'", True),
    ("status IN ('pending', 'processing')",
     "SELECT count(*) FROM {view} AS e WHERE e.status IN ('pending', 'processing')", True),
    ("a page of dead letters by created_at",
     "SELECT e.id FROM {view} AS e WHERE e.status = 'failed' ORDER BY e.created_at DESC LIMIT 100", True),
    ("a page of dispatched events by id",
     "SELECT e.id FROM {view} AS e WHERE e.status = 'dispatched' ORDER BY e.id DESC LIMIT 100", False),
    ("one event by id", "SELECT e.status FROM {view} AS e WHERE e.id = '{some_id}'", False),
]
# Too slow through 1.0.0's view to run whole (about 110 µs a row): timed
# over a sample of this many rows, and scaled.
SAMPLE = 20_000


def log(*args):
    print("bench/table:", *args, flush=True)


class Backend:
    """One connection, with the CPU time its backend spends."""

    def __init__(self, pg):
        self.conn = pg.connect()
        self.conn.execute("SET jit = off")
        self.pid = self.conn.info.backend_pid

    def cpu(self):
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def timed(self, query):
        """(CPU seconds, wall seconds, rows) of `query`'s second run."""
        self.conn.execute(query).fetchall()
        cpu, wall = self.cpu(), time.monotonic()
        rows = self.conn.execute(query).fetchall()
        return self.cpu() - cpu, time.monotonic() - wall, rows


def fill(pg, redis):
    log(f"enqueueing {EVENTS} events")
    with pg.connect() as conn:
        for start in range(0, EVENTS, 10_000):
            conn.execute("SELECT outbox_enqueue('bench', '{\"n\": 1}', queue => 'q_table') "
                         "FROM generate_series(1, %s)", (min(10_000, EVENTS - start),))
    pg.configure(enabled="on")
    wait_until(lambda: redis.client().llen("q_table") >= EVENTS, timeout=1800, interval=1,
               message="every event delivered")
    pg.configure(enabled="off")
    redis.client().delete("q_table")
    log("reporting half of the batches processed")
    pg.sql("""
        INSERT INTO outbox.outcomes (batch, events, generation)
        SELECT b.id, array_agg(m.id), min(l.generation)
          FROM outbox.batches AS b
         CROSS JOIN LATERAL outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
          JOIN outbox.log AS l ON l.id = m.id AND l.pending_xid = m.pending_xid
         WHERE b.id % 2 = 0
         GROUP BY b.id""")
    pg.sql("INSERT INTO outbox.log (event_type, queue, status, last_error) "
           "SELECT 'bench', 'q_table', 'failed', 'dead' FROM generate_series(1, 100)")
    pg.sql("SELECT outbox_enqueue('bench', '{}', queue => 'q_table') FROM generate_series(1, 100)")
    for table in ("outbox.log", "outbox.batches", "outbox.outcomes"):
        pg.sql(f"VACUUM ANALYZE {table}")
    pg.sql(VIEW_1_0)


def main():
    redis = Redis("--save", "", "--appendonly", "no")
    pg = Cluster(redis.url, batch_size=100, report_key="", enabled="off",
                 server_conf={"shared_buffers": "'1GB'", "max_wal_size": "'8GB'"})
    try:
        pg.install()
        fill(pg, redis)
        some_id = pg.value("SELECT id FROM outbox.log ORDER BY id OFFSET %s LIMIT 1", (EVENTS // 3,))
        backend = Backend(pg)
        log_cpu, log_wall, _ = backend.timed(
            "SELECT count(l.status), count(l.deliveries), count(l.pending_xid) FROM outbox.log AS l")
        rows = pg.value("SELECT count(*) FROM outbox.log")
        results = {"events": EVENTS, "rows": rows, "log": {"cpu": log_cpu, "wall": log_wall}, "queries": []}
        for name, query, whole in QUERIES:
            entry = {"query": name}
            for label, view in (("1.0.0", "public.bench_events_1_0"), ("now", "outbox.events")):
                scaled = whole and label == "1.0.0"
                source = f"(SELECT * FROM {view} LIMIT {SAMPLE})" if scaled else view
                cpu, wall, _ = backend.timed(query.format(view=source, some_id=some_id))
                factor = rows / SAMPLE if scaled else 1
                entry[label] = {"cpu": cpu * factor, "wall": wall * factor, "scaled": scaled}
                log(f"{name} [{label}]: {cpu * factor:.3f}s cpu, {wall * factor:.3f}s wall"
                    + (" (scaled from a sample)" if scaled else ""))
            results["queries"].append(entry)
        for name, query in (("outbox.status", "TABLE outbox.status"),
                            ("outbox.dead_letters", "SELECT count(*) FROM outbox.dead_letters"),
                            ("outbox_metrics_prometheus()", "SELECT outbox_metrics_prometheus()")):
            cpu, wall, _ = backend.timed(query)
            results["queries"].append({"query": name, "now": {"cpu": cpu, "wall": wall, "scaled": False}})
            log(f"{name}: {cpu:.3f}s cpu, {wall:.3f}s wall")
        write(results)
    finally:
        pg.close()
        redis.close()


def write(results):
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "table.json").write_text(json.dumps(results, indent=2) + "\n")
    rows = results["rows"]
    log_us = results["log"]["cpu"] / rows * 1e6
    lines = [
        "# Reading outbox.events",
        "",
        f"{results['events']:,} events delivered in batches of 100, half of the batches reported processed, "
        f"with 100 dead letters and 100 events in line ({rows:,} rows); `make bench` (bench/table.py). "
        "CPU time of the backend, the second of two runs; 1.0.0's view read row by row is timed over "
        f"{SAMPLE:,} rows and scaled (marked *).",
        "",
        f"Reading outbox.log: {results['log']['cpu']:.3f} s CPU, {log_us:.2f} µs a row.",
        "",
        "| query | 1.0.0's view | outbox.events | µs a row more than outbox.log |",
        "|---|---|---|---|",
    ]
    for entry in results["queries"]:
        before = entry.get("1.0.0")
        now = entry["now"]
        more = ""
        if entry["query"].startswith("read every row"):
            more = f"{(now['cpu'] / rows * 1e6) - log_us:.2f}"
        old = f"{before['cpu']:.3f} s{' *' if before['scaled'] else ''}" if before else ""
        lines.append(f"| {entry['query']} | {old} | {now['cpu']:.3f} s | {more} |")
    (RESULTS / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
