"""`make bench`: drain throughput against the raw ceilings (and with fan-out
3), commit-to-Redis latency at a steady rate, enqueue cost (with 0, 1 and 3
matching subscriptions), dispatcher memory, and the full loop
through a Celery worker and back. Runs its own
PostgreSQL 15 (fsync on, as in production) and Redis, with the release build
installed by the Makefile, and writes bench/results/latest.md,
bench/results/latest.png and the raw numbers in bench/results/latest.json.

Sizes come from the environment (defaults in brackets): BENCH_EVENTS
[200000], BENCH_BATCHES [100,1000,5000], BENCH_WORKERS [1,2], BENCH_RATE
[2000] events/s for BENCH_SECONDS [30], BENCH_PGBENCH_SECONDS [10] per
pgbench run of BENCH_PGBENCH_CLIENTS [2] clients, BENCH_ROUNDS [3] runs per enqueue workload (the median is
reported), BENCH_PAYLOAD_BYTES [100], BENCH_LOOP_EVENTS [20000] for the full
loop through a Celery worker and back, BENCH_LINGERS [0,2,5] ms of
`outbox.linger` for the latency run repeated with each. The drain with fan-out 3 routes
BENCH_EVENTS / 3 events to three subscriptions each."""

import json
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import PG_BIN, CeleryWorker, Cluster, Redis, wait_until  # noqa: E402
from wal import create_plain, pgq  # noqa: E402

EVENTS = int(os.environ.get("BENCH_EVENTS", 200_000))
BATCHES = [int(b) for b in os.environ.get("BENCH_BATCHES", "100,1000,5000").split(",")]
WORKERS = [int(w) for w in os.environ.get("BENCH_WORKERS", "1,2").split(",")]
RATE = int(os.environ.get("BENCH_RATE", 2000))
SECONDS = int(os.environ.get("BENCH_SECONDS", 30))
PGBENCH_SECONDS = int(os.environ.get("BENCH_PGBENCH_SECONDS", 10))
PGBENCH_CLIENTS = int(os.environ.get("BENCH_PGBENCH_CLIENTS", 2))
PAYLOAD_BYTES = int(os.environ.get("BENCH_PAYLOAD_BYTES", 100))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
LOOP_EVENTS = int(os.environ.get("BENCH_LOOP_EVENTS", 20_000))
LINGERS = [int(m) for m in os.environ.get("BENCH_LINGERS", "0,2,5").split(",")]
RESULTS = ROOT / "bench" / "results"
SERVER_CONF = {"fsync": "on", "shared_buffers": "'512MB'", "max_wal_size": "'4GB'", "checkpoint_timeout": "'15min'"}

PAYLOAD = json.dumps({"n": 1, "pad": "x" * max(0, PAYLOAD_BYTES - 20)})
LOAD = ("SELECT outbox_enqueue('bench', %s::jsonb, queue => 'bench') FROM generate_series(1, %s)")


def log(*args):
    print("bench:", *args, flush=True)


def load(pg, n):
    """Commits `n` pending events, then settles the table and flushes the
    dirty buffers, so that no checkpoint lands in the measurement."""
    with pg.connect() as conn:
        for start in range(0, n, 10_000):
            conn.execute(LOAD, (PAYLOAD, min(10_000, n - start)))
        conn.execute("VACUUM ANALYZE outbox.log")
        conn.execute("CHECKPOINT")


def memory_kb(pid):
    """(RSS, private anonymous RSS) of a process, in kB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    kb = lambda key: int(fields.get(key, "0 kB").split()[0])  # noqa: E731
    return kb("VmRSS"), kb("RssAnon")


def drain(pg, redis, workers, batch):
    """Events per second from enabling the dispatchers to the last push, and
    the dispatchers' memory along the way."""
    pg.configure(enabled="off", batch_size=batch)
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    redis.client().flushall()
    load(pg, EVENTS)
    pids = pg.dispatcher_pids()
    assert len(pids) == workers, pids
    before = pg.metric("outbox_dispatched_total")
    samples = []
    started = time.monotonic()
    pg.configure(enabled="on", batch_size=batch)
    while pg.metric("outbox_dispatched_total") - before < EVENTS:
        done = pg.metric("outbox_dispatched_total") - before
        samples.append((done, [memory_kb(p) for p in pids]))
        time.sleep(0.1)
    elapsed = time.monotonic() - started
    wait_until(lambda: pg.count("dispatched") == EVENTS, timeout=120, message="every row marked")
    assert redis.client().llen("bench") == EVENTS
    samples.append((EVENTS, [memory_kb(p) for p in pids]))
    return EVENTS / elapsed, samples


def full_loop(pg, redis):
    """Enqueue → dispatch → a stock Celery worker (prefork, 2 processes, with
    outbox_dispatch.celery) runs a no-op task → its report → `processed`.
    Events per second from enabling the dispatchers to the last `processed`;
    the report list's length, sampled, shows whether recording the reports
    keeps up with the worker."""
    pg.configure(enabled="off", batch_size=1000)
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    redis.client().flushall()
    worker = CeleryWorker(redis.url, queues=("bench_loop",), app="loop_app", pool="prefork", concurrency=2,
                          extra_args=("--prefetch-multiplier=100", "--loglevel=WARNING"))
    try:
        wait_until(lambda: redis.client().exists("_kombu.binding.bench_loop") or worker.proc.poll() is not None,
                   timeout=60, message="the Celery worker")
        with pg.connect() as conn:
            conn.execute("SELECT outbox_enqueue('bench.loop', '{}', queue => 'bench_loop', task => 'loop.noop') "
                         "FROM generate_series(1, %s)", (LOOP_EVENTS,))
            conn.execute("VACUUM ANALYZE outbox.log")
        backlog = []
        started = time.monotonic()
        dispatched_at = None
        pg.configure(enabled="on")
        while True:
            processed, dispatched = pg.sql(
                "SELECT count(*) FILTER (WHERE status = 'processed'), "
                "count(*) FILTER (WHERE status IN ('dispatched', 'processed')) FROM outbox.events")[0]
            backlog.append(redis.client().llen(pg.report_list()))
            if dispatched_at is None and dispatched == LOOP_EVENTS:
                dispatched_at = time.monotonic() - started
            if processed == LOOP_EVENTS:
                break
            assert time.monotonic() - started < 600, f"full loop stalled at {processed} processed"
            time.sleep(0.1)
        elapsed = time.monotonic() - started
    finally:
        worker.close()
    return {"events": LOOP_EVENTS, "rate": LOOP_EVENTS / elapsed, "seconds": elapsed,
            "dispatched_seconds": dispatched_at or elapsed, "backlog_max": max(backlog),
            "backlog_median": sorted(backlog)[len(backlog) // 2]}


def sql_ceiling(pg, batch):
    """Claim and mark the same rows in the same batches, with no Redis: the
    dispatcher's own statements (its turn, the claim, the mark) in a
    server-side loop, a commit per batch."""
    pg.configure(enabled="off")
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    load(pg, EVENTS)
    turn = (ROOT / "sql/worker/lock_cursor.sql").read_text()
    claim = ((ROOT / "sql/worker/claim.sql").read_text()
             .replace("$1", str(batch)).replace("$2", "0").replace("$3", str(8 << 20)))
    mark = (ROOT / "sql/worker/mark_dispatched.sql").read_text().replace("$1", "claimed.batch").replace("$2", "0")
    body = f"""
        DO $$
        DECLARE claimed record; events bigint; marked bigint; total bigint := 0; empty int := 0;
        BEGIN
            WHILE total < {EVENTS} AND empty < 3 LOOP
                SET LOCAL synchronous_commit = off;
                PERFORM 1 FROM ({turn}) AS t;
                EXECUTE $claim${claim}$claim$ INTO claimed;
                events := coalesce((SELECT b.events FROM outbox.batches AS b WHERE b.id = claimed.batch), 0);
                IF events > 0 THEN
                    WITH m AS ({mark}) SELECT count(*) INTO marked FROM m;
                    empty := 0;
                ELSE
                    empty := empty + 1;
                END IF;
                total := total + events;
                COMMIT;
            END LOOP;
        END $$"""
    started = time.monotonic()
    pg.sql(body)
    elapsed = time.monotonic() - started
    assert pg.count("dispatched") == EVENTS
    return EVENTS / elapsed


def redis_ceiling(redis, batch):
    redis.client().flushall()
    out = subprocess.run([str(ROOT / "target/release/examples/push_ceiling"), redis.url, str(EVENTS), str(batch),
                          str(len(PAYLOAD))], check=True, capture_output=True, text=True)
    return float(out.stdout.strip())


def produce(host, port, rate, seconds, out):
    """One producer process: `rate` one-event transactions per second; sends
    {event id: time COMMIT returned} back."""
    import psycopg
    committed = {}
    with psycopg.connect(host=host, port=port, user="postgres", dbname="postgres", autocommit=True) as conn:
        start = time.time()
        for i in range(rate * seconds):
            due = start + i / rate
            pause = due - time.time()
            if pause > 0:
                time.sleep(pause)
            event_id = conn.execute("SELECT outbox_enqueue('bench', %s::jsonb, queue => 'bench_latency')",
                                    (PAYLOAD,)).fetchone()[0]
            committed[str(event_id)] = time.time()
    out.put(("committed", committed))


def consume(redis_port, total, out):
    """The consumer process: pops whatever has arrived (BLMPOP, up to 1000
    at a time) and stamps it; decodes only at the end, so that decoding
    never delays the next stamp. Sends {task id: arrival time} back."""
    import redis as redis_lib
    client = redis_lib.Redis(host="127.0.0.1", port=redis_port)
    stamped, count = [], 0
    while count < total:
        popped = client.blmpop(30, 1, "bench_latency", direction="RIGHT", count=1000)
        if popped is None:
            break
        now = time.time()
        stamped.append((now, popped[1]))
        count += len(popped[1])
    arrived = {json.loads(m)["headers"]["id"]: now for now, messages in stamped for m in messages}
    out.put(("arrived", arrived))


def latency(pg, redis):
    pg.configure(enabled="on", batch_size=100)
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    pg.sql("CHECKPOINT")
    redis.client().flushall()
    pg.wait_idle()
    wal_start, book_start = pg.value("SELECT pg_current_wal_lsn()"), pg.value(BOOK_WRITES)
    result = commit_to_broker(pg, redis, RATE, SECONDS)
    pg.wait_idle()
    wal = float(pg.value("SELECT pg_current_wal_lsn() - %s::pg_lsn", (wal_start,)))
    book = pg.value(BOOK_WRITES) - book_start
    return {**result, "wal_per_event": wal / result["events"], "book_writes_per_event": book / result["events"]}


def commit_to_broker(pg, redis, rate, seconds):
    """`rate` one-event transactions a second for `seconds` (4 producers),
    each COMMIT stamped, each message stamped as it arrives in Redis: the
    latency's percentiles in ms."""
    producers = 4
    total = rate // producers * producers * seconds
    results = multiprocessing.Queue()
    consumer = multiprocessing.Process(target=consume, args=(redis.port, total, results))
    consumer.start()
    procs = [multiprocessing.Process(target=produce, args=(str(pg.dir), pg.port, rate // producers, seconds, results))
             for _ in range(producers)]
    for p in procs:
        p.start()
    times = {"committed": {}, "arrived": {}}
    for _ in range(producers + 1):
        kind, part = results.get(timeout=seconds + 120)
        times[kind].update(part)
    for p in procs + [consumer]:
        p.join()
    committed, arrived = times["committed"], times["arrived"]
    lat = sorted(max(0.0, arrived[i] - committed[i]) * 1000 for i in committed if i in arrived)
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
    return {"events": len(committed), "missing": len(committed) - len(lat), "p50": pick(0.50),
            "p95": pick(0.95), "p99": pick(0.99), "max": lat[-1], "all": lat,
            "achieved_rate": len(committed) / seconds}


# Rows written to the dispatchers' bookkeeping: a batch per claim (inserted,
# marked, forgotten) and the cursor's position (replaced at each claim).
BOOK_WRITES = """SELECT sum(s.n_tup_ins + s.n_tup_upd + s.n_tup_del)::bigint FROM pg_stat_user_tables AS s
                  WHERE s.relid IN ('outbox.batches'::regclass, 'outbox.positions'::regclass)"""


def linger_sweep(pg, redis):
    """The latency run again with each of LINGERS: what lingering costs in
    latency and saves in bookkeeping and WAL."""
    sweep = {}
    for ms in LINGERS:
        pg.configure(linger=f"{ms}ms")
        sweep[ms] = {k: v for k, v in latency(pg, redis).items() if k != "all"}
    pg.sql("ALTER SYSTEM RESET outbox.linger")
    pg.sql("SELECT pg_reload_conf()")
    return sweep


def pgbench(pg, script, options=""):
    """TPS of `script` with PGBENCH_CLIENTS clients; `options` are server
    settings for their sessions (PGOPTIONS)."""
    path = pg.dir / "workload.sql"
    path.write_text(script)
    path.chmod(0o644)
    out = subprocess.run(["runuser", "-u", "postgres", "--", "env", f"PGOPTIONS={options}", str(PG_BIN / "pgbench"),
                          "-n", "-c", str(PGBENCH_CLIENTS), "-j", "2", "-T", str(PGBENCH_SECONDS), "-f", str(path), "-h",
                          str(pg.dir), "-p", str(pg.port), "postgres"], check=True, capture_output=True, text=True)
    return float(re.search(r"tps = ([\d.]+) \(without initial connection time\)", out.stdout).group(1))


def subscribe_fanout(pg):
    """Subscriptions for the fan-out workloads: one task for 'bench.fan1',
    three for 'bench.fan3' (so 'bench' itself matches none of the four)."""
    pg.sql("TRUNCATE outbox.all_subscriptions")
    pg.sql("SELECT outbox_subscribe('bench.fan1', 'bench.one', queue => 'bench'), "
           "outbox_subscribe('bench.fan3', 'bench.a', queue => 'bench'), "
           "outbox_subscribe('bench.fan3', 'bench.b', queue => 'bench'), "
           "outbox_subscribe('bench.fan3', 'bench.c', queue => 'bench')")


ENQUEUE_NOTIFY_OFF = "outbox_enqueue(), no subscription, notify off"
ENQUEUE_DELIVERED = "outbox_enqueue(), no subscription, delivered as they commit"


def enqueue_cost(pg):
    """TPS of each workload: the median of ROUNDS runs, the workloads taking
    turns so that the machine's drift hits them alike. Each workload runs
    with no subscription, or with the four of subscribe_fanout(); all but
    one with the dispatchers paused, that one while they deliver each event
    to Redis as it commits, on the same cores."""
    pg.configure(enabled="off")
    pg.sql("DROP TABLE IF EXISTS bench_plain")
    create_plain(pg, "bench_plain")
    payload = PAYLOAD.replace("'", "''")

    def enqueue(event_type, task=""):
        return f"SELECT outbox_enqueue('{event_type}', '{payload}', queue => 'bench_enqueue'{task});\n"

    insert = f"INSERT INTO outbox.events (event_type, payload, queue) VALUES ('bench', '{payload}', 'bench_enqueue');\n"
    # name: (script, with the subscriptions)
    workloads = {
        "plain INSERT (no trigger)": (
            f"INSERT INTO bench_plain (event_type, payload, queue) VALUES ('bench', '{payload}', 'bench_enqueue');\n",
            False),
        ENQUEUE_NOTIFY_OFF: (enqueue("bench"), False),
        ENQUEUE_DELIVERED: (enqueue("bench"), False),
        "INSERT INTO outbox.events, no subscription": (insert, False),
        "outbox_enqueue(), no subscription, notify on": (enqueue("bench"), False),
        "outbox_enqueue() with a task, subscriptions active": (enqueue("bench", ", task => 'bench.task'"), True),
        "outbox_enqueue(), 0 matching of 4 active subscriptions": (enqueue("bench"), True),
        "outbox_enqueue(), 1 matching subscription": (enqueue("bench.fan1"), True),
        "outbox_enqueue(), 3 matching subscriptions": (enqueue("bench.fan3"), True),
    }
    options = {"outbox_enqueue(), no subscription, notify on": "-c outbox.notify=on"}
    runs = {name: [] for name in workloads}
    for _ in range(ROUNDS):
        for name, (script, subscribed) in workloads.items():
            if subscribed:
                subscribe_fanout(pg)
            else:
                pg.sql("TRUNCATE outbox.all_subscriptions")
            pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes, bench_plain")
            pg.sql("CHECKPOINT")
            pg.configure(enabled="on" if name == ENQUEUE_DELIVERED else "off")
            runs[name].append(pgbench(pg, script, options.get(name, "")))
            pg.configure(enabled="off")
    pg.sql("DROP TABLE bench_plain")
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes, outbox.all_subscriptions")
    return {name: sorted(tps)[len(tps) // 2] for name, tps in runs.items()}


def fanout_drain(pg, redis):
    """A drain of events each routed to 3 subscriptions: deliveries (and
    events) per second from enabling the dispatcher to the last push, one
    dispatcher, batch 1000; the same measure as drain()."""
    events = EVENTS // 3
    pg.configure(enabled="off", batch_size=1000)
    subscribe_fanout(pg)
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    redis.client().flushall()
    with pg.connect() as conn:
        for start in range(0, events, 10_000):
            conn.execute("SELECT outbox_enqueue('bench.fan3', %s::jsonb) FROM generate_series(1, %s)",
                         (PAYLOAD, min(10_000, events - start)))
        conn.execute("VACUUM ANALYZE outbox.log")
        conn.execute("CHECKPOINT")
    before = pg.metric("outbox_dispatched_total")
    started = time.monotonic()
    pg.configure(enabled="on", batch_size=1000)
    wait_until(lambda: pg.metric("outbox_dispatched_total") - before >= 3 * events, timeout=600, interval=0.1,
               message="every delivery pushed")
    elapsed = time.monotonic() - started
    assert redis.client().llen("bench") == 3 * events
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes, outbox.all_subscriptions")
    return {"events": events, "deliveries": 3 * events, "deliveries_rate": 3 * events / elapsed,
            "events_rate": events / elapsed}


def machine():
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))) // 1024 // 1024
    run = lambda *cmd: subprocess.run(cmd, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return (f"{os.cpu_count()} × {cpu}, {mem} GiB RAM, Linux {platform.release()}; "
            f"{run(str(PG_BIN / 'postgres'), '--version')}; {run('redis-server', '--version').split(' sha')[0]}; "
            f"{run('rustc', '--version')}")


def memory_summary(samples):
    """RSS at the start, peak and end of a drain (summed over dispatchers),
    and the peak of private memory in the first and in the second half of
    the events: a leak grows from one half to the next, the allocator's
    ups and downs do not."""
    rss = [sum(r for r, _ in mems) for _, mems in samples]
    anon = [(done, sum(a for _, a in mems)) for done, mems in samples]
    first = max(a for done, a in anon if done <= EVENTS / 2)
    second = max(a for done, a in anon if done > EVENTS / 2)
    return {"rss_start": rss[0], "rss_peak": max(rss), "rss_end": rss[-1],
            "anon_first_half": first, "anon_second_half": second}


def write_report(r):
    smaller = {b: min(r["ceiling_sql"][b], r["ceiling_redis"][b]) for b in BATCHES}
    # The best drain against the best the machine allows at any batch size.
    (best_workers, best_batch), best_rate = max(r["drain"].items(), key=lambda kv: kv[1])
    ceiling_batch = max(BATCHES, key=lambda b: smaller[b])
    ceiling = smaller[ceiling_batch]
    lat, enq, loop, fan = r["latency"], r["enqueue"], r["loop"], r["fanout"]
    plain = enq["plain INSERT (no trigger)"]
    vs_pgq = (
        [f"| drain at batch 1000 ≥ 50% of PgQ's bare consume (one consumer, batch 1000, no broker) | "
         + ", ".join(f"{w} dispatcher(s) {r['drain'][(w, 1000)]:,.0f} events/s = "
                     f"{r['drain'][(w, 1000)] / r['pgq']['consume_rate']:.0%}" for w in WORKERS)
         + f" of {r['pgq']['consume_rate']:,.0f} events/s | "
         + f"{'yes' if max(r['drain'][(w, 1000)] for w in WORKERS) >= 0.5 * r['pgq']['consume_rate'] else 'no'} |"]
        if "pgq" in r and all((w, 1000) in r["drain"] for w in WORKERS) else [])
    flat = all(m["anon_second_half"] <= m["anon_first_half"] * 1.10 + 1024 for m in r["memory"].values())
    lines = [
        "# outbox_dispatch benchmark", "",
        f"Machine: {r['machine']}.", "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {EVENTS} events of "
        f"{len(PAYLOAD)}-byte payloads per drain; PostgreSQL with fsync on, shared_buffers 512MB; "
        "release build. `make bench` writes this file; sizes are set by BENCH_* variables (bench/run.py).", "",
        "## Targets", "",
        "| target | result | met |", "|---|---|---|",
        f"| drain ≥ 50% of the raw ceiling at the best batch size | best drain {best_rate:,.0f} events/s "
        f"({best_workers} dispatcher(s), batch {best_batch}) = {best_rate / ceiling:.0%} of the best ceiling, "
        f"{ceiling:,.0f} events/s (batch {ceiling_batch}) | {'yes' if best_rate >= 0.5 * ceiling else 'no'} |",
        f"| p99 commit → Redis ≤ 10 ms at {RATE} events/s | p99 {lat['p99']:.1f} ms "
        f"(achieved {lat['achieved_rate']:,.0f} events/s) | {'yes' if lat['p99'] <= 10 else 'no'} |",
        f"| enqueue TPS ≥ 90% of a plain INSERT's (no subscription, notify off, dispatchers paused) | "
        f"{enq[ENQUEUE_NOTIFY_OFF] / plain:.0%} | "
        f"{'yes' if enq[ENQUEUE_NOTIFY_OFF] >= 0.90 * plain else 'no'} |",
        f"| enqueue TPS ≥ 80% of a plain INSERT's while the dispatchers deliver on the same cores | "
        f"{enq[ENQUEUE_DELIVERED] / plain:.0%} | "
        f"{'yes' if enq[ENQUEUE_DELIVERED] >= 0.80 * plain else 'no'} |",
        *vs_pgq,
        f"| dispatcher RSS flat (no growth with events) | peak private memory, first → second half of "
        f"each drain: " + ", ".join(f"{m['anon_first_half']:,} → {m['anon_second_half']:,} kB"
                                     for m in r["memory"].values())
        + f" | {'yes' if flat else 'no'} |", "",
        "## Drain throughput", "",
        "Pending events loaded while `outbox.enabled = off` (then vacuumed and checkpointed), then "
        "enabled; events per second from the reload to the last push. The ceilings run the same sizes "
        "on the same machine, the better of two runs: SQL = the dispatcher's claim and mark statements "
        "in a server-side loop, a commit per batch, no Redis; Redis = pre-encoded messages pushed by "
        "multi-value LPUSH, one round trip per batch, with the dispatcher's client. Autovacuum is off "
        "during these runs so that no worker competes for the cores.", "",
        "| dispatchers | batch | events/s | SQL ceiling | Redis ceiling | of the smaller ceiling |",
        "|---|---|---|---|---|---|",
    ]
    for (workers, batch), rate in sorted(r["drain"].items()):
        lines.append(f"| {workers} | {batch} | {rate:,.0f} | {r['ceiling_sql'][batch]:,.0f} | "
                     f"{r['ceiling_redis'][batch]:,.0f} | {rate / smaller[batch]:.0%} |")
    lines += [
        "", "## Drain with fan-out 3", "",
        f"{fan['events']:,} events, each routed to 3 subscriptions ({fan['deliveries']:,} deliveries), "
        "committed while the dispatcher was paused, then drained as above: one dispatcher, batch 1000.", "",
        "| events | deliveries | deliveries/s | events/s | vs the plain drain (1 dispatcher, batch 1000) |",
        "|---|---|---|---|---|",
        f"| {fan['events']:,} | {fan['deliveries']:,} | {fan['deliveries_rate']:,.0f} | {fan['events_rate']:,.0f} | "
        f"{fan['deliveries_rate'] / r['drain'][(WORKERS[0], 1000)]:.0%} |"
        if (WORKERS[0], 1000) in r["drain"] else "",
        "", "## Latency: COMMIT → message in Redis", "",
        f"{RATE} one-event transactions per second from 4 client processes for {SECONDS} s; a consumer "
        "process pops messages as they arrive (BLMPOP) and stamps them. Latency = arrival time − the "
        "time the producer's COMMIT returned, same clock (an event can arrive before its producer "
        "sees the COMMIT return: those count as 0). One dispatcher, batch 100; autovacuum on.", "",
        "| offered | achieved | events | p50 | p95 | p99 | max | not arrived |", "|---|---|---|---|---|---|---|---|",
        f"| {RATE}/s | {lat['achieved_rate']:,.0f}/s | {lat['events']:,} | {lat['p50']:.2f} ms | {lat['p95']:.2f} ms | "
        f"{lat['p99']:.2f} ms | {lat['max']:.2f} ms | {lat['missing']} |", "",
        f"The same run with each `outbox.linger` (the default is 2 ms): what a claim's wait for the commits "
        f"that follow costs in latency and saves in rows of bookkeeping (`outbox.batches`, "
        f"`outbox.positions`) and in WAL per event, everything the run wrote included (a checkpoint before "
        f"it; a plain INSERT of the same row: bench/results/wal.md and soak.md).", "",
        "| linger | p50 | p99 | max | bookkeeping rows written per event | WAL per event |",
        "|---|---|---|---|---|---|",
        *[f"| {ms} ms | {x['p50']:.2f} ms | {x['p99']:.2f} ms | {x['max']:.2f} ms | "
          f"{x['book_writes_per_event']:.2f} | {x['wal_per_event']:,.0f} B |" for ms, x in r["linger"].items()],
        "", "## Full loop: enqueue → Celery → processed", "",
        f"{loop['events']:,} events for a no-op task, committed while the dispatchers were paused; then "
        "enabled. A stock Celery worker (prefork, 2 processes, prefetch 100) with `outbox_dispatch.celery` "
        "imported runs them and reports each outcome through Redis; the dispatcher records the reports. "
        "Events per second from the reload to the last `processed`. The report list's length, sampled "
        "every 0.1 s, is what the dispatcher had not yet recorded: small means recording keeps up with "
        "the worker, and the worker, not the loop back, sets the pace.", "",
        "| events | all dispatched after | all processed after | processed/s | report backlog, median | max |",
        "|---|---|---|---|---|---|",
        f"| {loop['events']:,} | {loop['dispatched_seconds']:.1f} s | {loop['seconds']:.1f} s | "
        f"{loop['rate']:,.0f} | {loop['backlog_median']:,} | {loop['backlog_max']:,} |",
        "", "## Enqueue cost", "",
        f"pgbench, {PGBENCH_CLIENTS} clients, one statement per transaction, dispatchers paused but for "
        f"the workload delivered as it commits; the median of {ROUNDS} "
        f"runs of {PGBENCH_SECONDS} s, the workloads taking turns. "
        "The plain table is the WAL floor's (bench/wal.py): the same event type, payload and queue, a uuid "
        "primary key and a creation time, no trigger. \"Subscriptions active\": four exist, one for `bench.fan1`, "
        "three for `bench.fan3`, none for `bench`; an event routed to k subscriptions writes 1 + k rows "
        "(the event's record and a delivery each). With none active, the routing trigger is not called.", "",
        "| workload | TPS | vs plain INSERT |", "|---|---|---|",
    ]
    for name, tps in enq.items():
        lines.append(f"| {name} | {tps:,.0f} | {tps / plain:.0%} |")
    lines += ["", "## Dispatcher memory during the drain", "",
              "Summed over the dispatchers, sampled every 0.1 s. RSS includes the shared buffers a "
              "dispatcher touched (it grows as the drain reads the table, up to shared_buffers); private "
              "(RssAnon) is the dispatcher's own heap, which rises and falls with the batch size as the "
              "allocator keeps or returns memory.", "",
              "| dispatchers | batch | RSS start | RSS peak | RSS end | private peak, 1st half | private peak, 2nd half |",
              "|---|---|---|---|---|---|---|"]
    for (workers, batch), m in sorted(r["memory"].items()):
        lines.append(f"| {workers} | {batch} | {m['rss_start']:,} kB | {m['rss_peak']:,} kB | {m['rss_end']:,} kB | "
                     f"{m['anon_first_half']:,} kB | {m['anon_second_half']:,} kB |")
    lines += ["", "![throughput, latency and enqueue cost](latest.png)", ""]
    (RESULTS / "latest.md").write_text("\n".join(lines))


def plot(r):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5))
    width = 0.8 / (len(WORKERS) + 2)
    for i, batch in enumerate(BATCHES):
        bars = [(f"{w} dispatcher(s)", r["drain"][(w, batch)]) for w in WORKERS]
        bars += [("SQL ceiling", r["ceiling_sql"][batch]), ("Redis ceiling", r["ceiling_redis"][batch])]
        for j, (label, value) in enumerate(bars):
            ax1.bar(i + j * width, value, width, label=label if i == 0 else None, color=f"C{j}")
    ax1.set_xticks([i + width * (len(WORKERS) + 1) / 2 for i in range(len(BATCHES))], [str(b) for b in BATCHES])
    ax1.set_xlabel("batch size")
    ax1.set_yscale("log")
    ax1.set_ylabel("events / s (log scale)")
    ax1.set_title(f"Drain of {EVENTS:,} events")
    ax1.legend(loc="lower right")

    lat = r["latency"]["all"]
    ax2.plot(lat, [i / len(lat) for i in range(len(lat))])
    ax2.axvline(10, color="grey", linestyle="--", label="10 ms target")
    ax2.set_xscale("log")
    ax2.set_xlabel("COMMIT → Redis (ms)")
    ax2.set_ylabel("fraction of events")
    ax2.set_title(f"Latency at {RATE} events/s")
    ax2.legend()

    names = list(r["enqueue"])
    ax3.barh(names, [r["enqueue"][n] for n in names], color="C2")
    ax3.set_xlabel(f"TPS (pgbench, {PGBENCH_CLIENTS} clients)")
    ax3.set_title("Enqueue cost")
    fig.tight_layout()
    fig.savefig(RESULTS / "latest.png", dpi=110)


def main():
    RESULTS.mkdir(exist_ok=True)
    r = {"machine": machine(), "drain": {}, "memory": {}, "ceiling_sql": {}, "ceiling_redis": {}}
    redis = Redis()
    try:
        for workers in WORKERS:
            pg = Cluster(redis.url, server_conf=SERVER_CONF, workers=workers, enabled="off")
            try:
                pg.sql("CREATE EXTENSION outbox_dispatch")
                wait_until(lambda: len(pg.dispatcher_pids()) == workers, message="the dispatchers")
                if workers == WORKERS[0]:
                    # The quiet measurements first, on a fresh cluster.
                    log(f"latency at {RATE}/s for {SECONDS}s")
                    r["latency"] = latency(pg, redis)
                    log(f"  p50 {r['latency']['p50']:.2f} ms, p99 {r['latency']['p99']:.2f} ms")
                    log(f"the same with outbox.linger = {LINGERS} ms")
                    r["linger"] = linger_sweep(pg, redis)
                    log(f"  {r['linger']}")
                    log("enqueue cost (pgbench)")
                    r["enqueue"] = enqueue_cost(pg)
                    log(f"  {r['enqueue']}")
                    log(f"full loop through Celery: {LOOP_EVENTS} events")
                    r["loop"] = full_loop(pg, redis)
                    log(f"  {r['loop']['rate']:,.0f} events/s processed")
                # Throughput runs compare like with like: no autovacuum
                # worker competes for the two cores (load() vacuums instead).
                pg.sql("ALTER SYSTEM SET autovacuum = off")
                pg.sql("SELECT pg_reload_conf()")
                if workers == WORKERS[0]:
                    for batch in BATCHES:
                        # A ceiling is the best the machine does: the better of two runs.
                        r["ceiling_sql"][batch] = max(sql_ceiling(pg, batch) for _ in range(2))
                        r["ceiling_redis"][batch] = max(redis_ceiling(redis, batch) for _ in range(2))
                        log(f"ceilings, batch {batch}: SQL {r['ceiling_sql'][batch]:,.0f}/s, "
                            f"Redis {r['ceiling_redis'][batch]:,.0f}/s")
                if workers == WORKERS[0] and pg.value(
                        "SELECT count(*) FROM pg_available_extensions WHERE name = 'pgq'"):
                    # PgQ (Debian's postgresql-15-pgq3): the bare consume the
                    # drain is held to, batch 1000, same events, same server.
                    log(f"PgQ: {EVENTS} events, bare consume at batch 1000")
                    r["pgq"] = pgq(pg, EVENTS, 1000)
                    log(f"  {r['pgq']['consume_rate']:,.0f} events/s")
                if workers == WORKERS[0]:
                    log(f"drain with fan-out 3: {EVENTS // 3} events")
                    r["fanout"] = fanout_drain(pg, redis)
                    log(f"  {r['fanout']['deliveries_rate']:,.0f} deliveries/s")
                for batch in BATCHES:
                    log(f"drain: {workers} dispatcher(s), batch {batch}")
                    rate, samples = drain(pg, redis, workers, batch)
                    r["drain"][(workers, batch)] = rate
                    r["memory"][(workers, batch)] = memory_summary(samples)
                    log(f"  {rate:,.0f} events/s")
            finally:
                pg.close()
    finally:
        redis.close()
    write_report(r)
    plot(r)
    raw = {key: {str(k): v for k, v in value.items() if k != "all"} if isinstance(value, dict) else value
           for key, value in r.items()}
    (RESULTS / "latest.json").write_text(json.dumps(raw, indent=1))
    print((RESULTS / "latest.md").read_text())


if __name__ == "__main__":
    main()
