"""`make bench`, without the library (docs/guides/managed.md), in one run beside
the same with the library:

- what an enqueue costs on a server where the schema is installed by
  `outbox-dispatch install`, against a plain INSERT of the same row. The
  per-insert work the library does in Rust (the id, the routing default,
  the wake) is SQL there; a NOTIFY per insert (`outbox.notify = on`) is
  what a sidecar woken by LISTEN costs the application;
- the drain of a backlog by `outbox-dispatch run` against the background
  worker's, one dispatcher each, batch 1000, and against the seed design's
  relay (a Python process: claim 100 with FOR UPDATE SKIP LOCKED, send each
  with Celery's send_task, mark them);
- commit → broker latency at BENCH_SIDECAR_RATE events/s with the
  sidecar's two wakes: its poll (every 20 ms, the default) and LISTEN with
  `outbox.notify = on`.

Runs two PostgreSQL servers (fsync on): one with the library preloaded and
the extension created, one without shared_preload_libraries and the schema
installed by a role that is not a superuser. Writes
bench/results/standalone.md. Sizes as bench/run.py: BENCH_PGBENCH_SECONDS,
BENCH_PGBENCH_CLIENTS, BENCH_ROUNDS (5 here), BENCH_PAYLOAD_BYTES,
BENCH_SECONDS; BENCH_SIDECAR_EVENTS (100,000), BENCH_RELAY_EVENTS (20,000),
BENCH_SIDECAR_RATE (1,000)."""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from harness import Cluster, Redis, wait_until  # noqa: E402
from run import (LOAD, PAYLOAD, PGBENCH_CLIENTS, PGBENCH_SECONDS, SECONDS, SERVER_CONF,  # noqa: E402
                 commit_to_broker, machine, pgbench)
from wal import create_plain  # noqa: E402

BIN = ROOT / "target" / "release" / "outbox-dispatch"
RESULTS = ROOT / "bench" / "results"

ROUNDS = int(os.environ.get("BENCH_ROUNDS", 5))
DRAIN_EVENTS = int(os.environ.get("BENCH_SIDECAR_EVENTS", 100_000))
RELAY_EVENTS = int(os.environ.get("BENCH_RELAY_EVENTS", 20_000))
RATE = int(os.environ.get("BENCH_SIDECAR_RATE", 1000))
PLAIN = "plain INSERT (no trigger)"
HOSTS = ("with the library", "without it")


def install(pg):
    pg.sql("CREATE ROLE owner LOGIN")
    pg.sql("GRANT pg_read_all_stats TO owner")
    pg.sql("ALTER SCHEMA public OWNER TO owner")
    pg.sql("ALTER DATABASE postgres OWNER TO owner")
    subprocess.run([str(BIN), "install", "--dsn", f"host={pg.dir} port={pg.port} user=owner dbname=postgres"],
                   check=True, capture_output=True, text=True)


def enqueue_cost(servers):
    """TPS of each workload on each server, the median of ROUNDS runs, the
    workloads and the servers taking turns."""
    payload = PAYLOAD.replace("'", "''")
    enqueue = f"SELECT outbox_enqueue('bench', '{payload}', queue => 'bench_enqueue');\n"
    workloads = {
        PLAIN: (f"INSERT INTO bench_plain (event_type, payload, queue) "
                f"VALUES ('bench', '{payload}', 'bench_enqueue');\n", ""),
        "outbox_enqueue(), notify off": (enqueue, ""),
        "INSERT INTO outbox.events, notify off": (
            f"INSERT INTO outbox.events (event_type, payload, queue) "
            f"VALUES ('bench', '{payload}', 'bench_enqueue');\n", ""),
        "outbox_enqueue(), notify on": (enqueue, "-c outbox.notify=on"),
    }
    for pg in servers.values():
        create_plain(pg, "bench_plain")
    runs = {(host, name): [] for host in servers for name in workloads}
    for _ in range(ROUNDS):
        for name, (script, options) in workloads.items():
            for host, pg in servers.items():
                pg.sql("TRUNCATE outbox.log, bench_plain")
                pg.sql("CHECKPOINT")
                runs[(host, name)].append(pgbench(pg, script, options))
    return {key: statistics.median(tps) for key, tps in runs.items()}, list(workloads)


class Sidecar:
    """`outbox-dispatch run` (release build) on the server without the library."""

    def __init__(self, pg, redis, *args):
        self.proc = subprocess.Popen(
            [str(BIN), "run", "--dsn", f"host={pg.dir} port={pg.port} user=owner dbname=postgres sslmode=disable",
             "--broker-url", redis.url, *args], stderr=subprocess.DEVNULL)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def load(pg, n):
    with pg.connect() as conn:
        for start in range(0, n, 10_000):
            conn.execute(LOAD, (PAYLOAD, min(10_000, n - start)))
        conn.execute("VACUUM ANALYZE outbox.log")
        conn.execute("CHECKPOINT")


def delivered(redis, n, queue="bench"):
    """Seconds until `n` messages are in `queue`, from now."""
    started = time.monotonic()
    client = redis.client()
    while client.llen(queue) < n:
        time.sleep(0.02)
    return time.monotonic() - started


def drains(servers, redis):
    """Events per second of a backlog drained by each host, one dispatcher,
    batch 1000."""
    rates = {}
    library, plain = servers[HOSTS[0]], servers[HOSTS[1]]
    library.configure(enabled="off", batch_size=1000)
    library.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    redis.client().flushall()
    load(library, DRAIN_EVENTS)
    library.configure(enabled="on", batch_size=1000)
    rates[HOSTS[0]] = DRAIN_EVENTS / delivered(redis, DRAIN_EVENTS)
    library.configure(enabled="off")

    plain.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    plain.sql("INSERT INTO outbox.settings VALUES ('outbox.batch_size', '1000') "
              "ON CONFLICT (name) DO UPDATE SET value = excluded.value")
    redis.client().flushall()
    load(plain, DRAIN_EVENTS)
    sidecar = Sidecar(plain, redis)
    try:
        rates[HOSTS[1]] = DRAIN_EVENTS / delivered(redis, DRAIN_EVENTS)
    finally:
        sidecar.stop()
    return rates


RELAY = """
import sys, time
import psycopg
from celery import Celery
host, port, redis_url, total = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
app = Celery(broker=redis_url)
sent = 0
started = time.monotonic()
with psycopg.connect(host=host, port=port, user="postgres", dbname="postgres") as conn:
    while sent < total:
        with conn.transaction():
            rows = conn.execute("SELECT id, task, payload FROM seed_outbox WHERE status = 'pending' "
                                "ORDER BY created_at LIMIT 100 FOR UPDATE SKIP LOCKED").fetchall()
            for id_, task, payload in rows:
                app.send_task(task, kwargs=payload, queue="bench_relay", task_id=str(id_))
            conn.execute("UPDATE seed_outbox SET status = 'dispatched' WHERE id = ANY(%s)", ([r[0] for r in rows],))
        sent += len(rows)
print(total / (time.monotonic() - started))
"""


def relay(pg, redis):
    """Events per second of the seed design's relay, on the same server."""
    pg.sql("DROP TABLE IF EXISTS seed_outbox")
    pg.sql("CREATE TABLE seed_outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), task text NOT NULL, "
           "payload jsonb NOT NULL, status text NOT NULL DEFAULT 'pending', "
           "created_at timestamptz NOT NULL DEFAULT clock_timestamp())")
    pg.sql("CREATE INDEX ON seed_outbox (created_at) WHERE status = 'pending'")
    pg.sql("INSERT INTO seed_outbox (task, payload) SELECT 'bench', %s::jsonb FROM generate_series(1, %s)",
           (PAYLOAD, RELAY_EVENTS))
    pg.sql("VACUUM ANALYZE seed_outbox")
    out = subprocess.run([sys.executable, "-c", RELAY, str(pg.dir), str(pg.port), redis.url, str(RELAY_EVENTS)],
                         check=True, capture_output=True, text=True)
    return float(out.stdout.strip())


def latency(pg, redis, notify):
    """Commit → broker at RATE events/s for SECONDS with the sidecar's poll
    (20 ms) or, with `notify`, LISTEN and `outbox.notify = on` in the
    producers' sessions: p50, p99, max in ms."""
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    pg.sql(f"ALTER ROLE postgres SET outbox.notify = {'on' if notify else 'off'}")
    redis.client().flushall()
    sidecar = Sidecar(pg, redis, *(["--poll-interval", "1h"] if notify else []))
    try:
        time.sleep(2)
        return commit_to_broker(pg, redis, RATE, SECONDS)
    finally:
        sidecar.stop()
        pg.sql("ALTER ROLE postgres RESET outbox.notify")


def write_report(tps, workloads, rates, relay_rate, latencies):
    lines = [
        "# Without the library",
        "",
        "## Enqueue",
        "",
        f"{machine()}; pgbench, {PGBENCH_CLIENTS} clients, {PGBENCH_SECONDS} s per run, the median of {ROUNDS} "
        "runs, the workloads and the servers taking turns; one statement per transaction. With the library: "
        "preloaded, the extension created, dispatch paused. Without it: a server without "
        "shared_preload_libraries, the schema installed by `outbox-dispatch install` as a role that is not a "
        "superuser, no dispatcher running.",
        "",
        "| workload | " + " | ".join(f"{host}: TPS, of a plain INSERT" for host in HOSTS) + " |",
        "|---|" + "---|" * len(HOSTS),
    ]
    for name in workloads:
        cells = [f"{tps[(host, name)]:,.0f}, {tps[(host, name)] / tps[(host, PLAIN)]:.0%}" for host in HOSTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    library, sidecar = rates[HOSTS[0]], rates[HOSTS[1]]
    lines += [
        "",
        "## Drain",
        "",
        f"A backlog of {DRAIN_EVENTS:,} events committed, then drained to Redis by one dispatcher at batch 1000 "
        f"(the relay: {RELAY_EVENTS:,} events, its own batch of 100).",
        "",
        "| drained by | events/s | |",
        "|---|---|---|",
        f"| the background worker (library) | {library:,.0f} | |",
        f"| `outbox-dispatch run` (sidecar) | {sidecar:,.0f} | {sidecar / library:.0%} of the library's "
        f"(target ≥ 50%: {'met' if sidecar >= 0.5 * library else 'not met'}) |",
        f"| the seed design's relay (Python, SKIP LOCKED, send_task) | {relay_rate:,.0f} | the sidecar is "
        f"{sidecar / relay_rate:.0f}× it (target ≥ 10×: {'met' if sidecar >= 10 * relay_rate else 'not met'}) |",
        "",
        "## Commit to broker",
        "",
        f"{RATE:,} one-event transactions a second for {SECONDS} s (4 producers), each COMMIT stamped, each "
        "message stamped as it arrives in Redis.",
        "",
        "| sidecar's wake | p50 ms | p99 ms | max ms | missing |",
        "|---|---|---|---|---|",
    ]
    for name, lat in latencies.items():
        lines.append(f"| {name} | {lat['p50']:.1f} | {lat['p99']:.1f} | {lat['max']:.1f} | {lat['missing']} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "standalone.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    servers = {}
    redis = Redis()
    try:
        servers[HOSTS[0]] = Cluster(redis.url, server_conf=SERVER_CONF, enabled="off", report_key="")
        servers[HOSTS[0]].sql("CREATE EXTENSION outbox_dispatch")
        servers[HOSTS[1]] = Cluster(redis.url, preload=False, server_conf=SERVER_CONF)
        install(servers[HOSTS[1]])
        servers[HOSTS[1]].sql("INSERT INTO outbox.settings VALUES ('outbox.report_key', '')")
        tps, workloads = enqueue_cost(servers)
        rates = drains(servers, redis)
        relay_rate = relay(servers[HOSTS[1]], redis)
        latencies = {"poll every 20 ms (the default)": latency(servers[HOSTS[1]], redis, notify=False),
                     "LISTEN, outbox.notify = on": latency(servers[HOSTS[1]], redis, notify=True)}
        write_report(tps, workloads, rates, relay_rate, latencies)
    finally:
        for pg in servers.values():
            pg.close()
        redis.close()


if __name__ == "__main__":
    main()
