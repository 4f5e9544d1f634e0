"""`make bench`, second part: dispatch while a long transaction elsewhere
holds the xmin horizon back, against the same without one, in one run.

For each of the two (a fresh cluster each, autovacuum on, 2 dispatchers,
batch 100, no Celery):

- WAL per event: enqueue of BENCH_PINNED_WAL_EVENTS [20000] events (one per
  transaction) and their dispatch, against a plain INSERT of the same rows
  into a table with a primary key only;
- a steady rate: BENCH_RATE [2000] one-event transactions per second from 4
  producers for BENCH_PINNED_SECONDS [600], commit → Redis latency per
  30-second window (p50, p99, max), the table's dead tuples at the end of
  each window, and the shared buffers one claim touches on average
  (pg_stat_statements);
- beside it, BENCH_PINNED_DELAYED [a tenth of the rate] events a second
  enqueued with a delay of a second (they wait out of line in
  events_due_idx, then come due): the shared buffers each call of the
  statements that read that index touches (came_due.sql, in_line.sql,
  next_due.sql), and every one of them sent;
- a long transaction's event: a session enqueues one as the steady rate
  starts and commits it as it ends, a claim after every batch of the run;
  the time and buffers a read of its status through outbox.events takes
  (outbox.batch_at(), outbox.held_by());
- a backlog: BENCH_PINNED_BACKLOG [100000] events committed while the
  dispatchers are paused, then drained.

"Pinned" opens a session first that takes a transaction id and stays idle
in its transaction to the end (`BEGIN; SELECT pg_current_xact_id()`).
Writes bench/results/pinned.md, pinned.png and pinned.json."""

import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import PAYLOAD, RATE, RESULTS, SERVER_CONF, consume, log, machine, produce  # noqa: E402

from harness import CLAIM_STATEMENT, Cluster, Redis, wait_until  # noqa: E402

SECONDS = int(os.environ.get("BENCH_PINNED_SECONDS", 600))
BACKLOG = int(os.environ.get("BENCH_PINNED_BACKLOG", 100_000))
WAL_EVENTS = int(os.environ.get("BENCH_PINNED_WAL_EVENTS", 20_000))
DELAYED = int(os.environ.get("BENCH_PINNED_DELAYED", max(1, RATE // 10)))
# The statements that read events_due_idx, by a line each alone has.
DUE_STATEMENTS = {"came_due": "%FROM due%WHERE e.id = due.id%",
                  "in_line": "%SELECT EXISTS (SELECT FROM c WHERE c.target IS NOT NULL)%",
                  "next_due": "%s.id <> ALL ($1::bigint[])%"}
WINDOW = 30
PRODUCERS = 4
CONF = {**SERVER_CONF, "shared_preload_libraries": "'outbox_dispatch,pg_stat_statements'",
        "pg_stat_statements.track": "all"}
ENQUEUE_ONE = "SELECT outbox_enqueue('bench', %s::jsonb, queue => 'bench_wal')"


def lsn(pg):
    return float(pg.value("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn"))


def dead_tuples(pg):
    return pg.value("SELECT sum(n_dead_tup)::bigint FROM pg_stat_user_tables "
                    "WHERE relid IN (SELECT relid FROM pg_partition_tree('outbox.log') WHERE isleaf)")


def wal_per_event(pg, redis):
    """WAL bytes per event: enqueue, dispatch, and a plain INSERT of the same
    row (id, event type, payload, queue, times) for comparison."""
    pg.configure(enabled="off")
    pg.sql("CREATE TABLE plain (id uuid PRIMARY KEY, event_type text, payload jsonb, queue text, "
           "created_at timestamptz DEFAULT clock_timestamp(), available_at timestamptz DEFAULT clock_timestamp())")
    pg.sql("CHECKPOINT")
    with pg.connect() as conn:
        start = lsn(pg)
        for _ in range(WAL_EVENTS):
            conn.execute("INSERT INTO plain (id, event_type, payload, queue) "
                         "VALUES (outbox_uuid_v7(), 'bench', %s::jsonb, 'bench_wal')", (PAYLOAD,))
        plain = (lsn(pg) - start) / WAL_EVENTS
        pg.sql("CHECKPOINT")
        start = lsn(pg)
        for _ in range(WAL_EVENTS):
            conn.execute(ENQUEUE_ONE, (PAYLOAD,))
        enqueue = (lsn(pg) - start) / WAL_EVENTS
    pg.sql("CHECKPOINT")
    start = lsn(pg)
    pg.configure(enabled="on")
    wait_until(lambda: redis.client().llen("bench_wal") == WAL_EVENTS, timeout=300, message="the WAL events dispatched")
    wait_until(lambda: pg.count("dispatched") == WAL_EVENTS, timeout=120, message="every row marked")
    dispatch = (lsn(pg) - start) / WAL_EVENTS
    pg.sql("DROP TABLE plain")
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    redis.client().flushall()
    return {"plain_insert": plain, "enqueue": enqueue, "dispatch": dispatch}


def steady(pg, redis, pinned):
    """Per-window latency, dead tuples and buffers per claim at RATE/s;
    pinned, the status of a long transaction's event (which pins the
    horizon itself)."""
    pg.sql("SELECT pg_stat_statements_reset()")
    total = RATE // PRODUCERS * PRODUCERS * SECONDS
    results = multiprocessing.Queue()
    consumer = multiprocessing.Process(target=consume, args=(redis.port, total, results))
    consumer.start()
    started = time.time()
    procs = [multiprocessing.Process(target=produce, args=(str(pg.dir), pg.port, RATE // PRODUCERS, SECONDS, results))
             for _ in range(PRODUCERS)]
    for p in procs:
        p.start()
    dead, stop = [], threading.Event()

    def sample():
        while not stop.wait(WINDOW - (time.time() - started) % WINDOW):
            dead.append(dead_tuples(pg))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    delayed_ids = []

    def delay():
        with pg.connect() as conn:
            for i in range(DELAYED * SECONDS):
                pause = started + i / DELAYED - time.time()
                if pause > 0:
                    time.sleep(pause)
                delayed_ids.append(conn.execute("SELECT outbox_enqueue('bench', %s::jsonb, queue => 'bench_delayed', "
                                                "delay => '1 second')", (PAYLOAD,)).fetchone()[0])

    delaying = threading.Thread(target=delay)
    delaying.start()
    # A long transaction's event, committed as the run ends.
    if pinned:
        long_running = pg.connect(autocommit=False)
        long_event = str(long_running.execute("SELECT outbox_enqueue('bench', %s::jsonb, queue => 'bench_long')",
                                              (PAYLOAD,)).fetchone()[0])
    times = {"committed": {}, "arrived": {}}
    for _ in range(PRODUCERS + 1):
        kind, part = results.get(timeout=SECONDS + 300)
        times[kind].update(part)
    stop.set()
    for p in procs + [consumer]:
        p.join()
    delaying.join()
    wait_until(lambda: redis.client().llen("bench_delayed") == len(delayed_ids), timeout=120,
               message="every delayed event")
    lookup = None
    if pinned:
        long_running.commit()
        long_running.close()
        wait_until(lambda: redis.client().llen("bench_long") == 1, timeout=60, message="the long transaction's event")
        lookup = pg.sql("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT status FROM outbox.events WHERE id = %s",
                        (long_event,))[0][0][0]
    committed, arrived = times["committed"], times["arrived"]
    windows = {}
    for event, at in committed.items():
        windows.setdefault(int((at - started) // WINDOW), []).append(
            max(0.0, arrived[event] - at) * 1000 if event in arrived else None)
    rows = []
    for i in sorted(windows):
        lat = sorted(x for x in windows[i] if x is not None)
        pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None  # noqa: E731
        rows.append({"window": i, "events": len(windows[i]), "missing": windows[i].count(None),
                     "p50": pick(0.5), "p99": pick(0.99), "max": lat[-1] if lat else None,
                     "dead_tuples": dead[i] if i < len(dead) else None})
    # The steady state: every event from the second window on (the first
    # holds the cluster's first minute: its first checkpoint, caches).
    settled = sorted(x for i in sorted(windows) if i > 0 for x in windows[i] if x is not None)
    steady_p99 = settled[min(len(settled) - 1, int(0.99 * len(settled)))] if settled else None
    calls, blocks = pg.sql("SELECT sum(calls), sum(shared_blks_hit + shared_blks_read) FROM pg_stat_statements "
                           "WHERE query LIKE %s", (CLAIM_STATEMENT,))[0]
    due = {}
    for name, pattern in DUE_STATEMENTS.items():
        due_calls, due_blocks = pg.sql("SELECT sum(calls), sum(shared_blks_hit + shared_blks_read) "
                                       "FROM pg_stat_statements WHERE query LIKE %s", (pattern,))[0]
        due[name] = float(due_blocks) / float(due_calls) if due_calls else None
    return {"due_blocks_per_call": due, "delayed": len(delayed_ids),
            "long_event": lookup and {"ms": lookup["Execution Time"],
                                      "blocks": lookup["Plan"]["Shared Hit Blocks"] + lookup["Plan"]["Shared Read Blocks"]},
            "windows": rows, "steady_p99": steady_p99, "events": len(committed), "missing": len(committed) - len(arrived.keys() & committed.keys()),
            "achieved_rate": len(committed) / SECONDS, "blocks_per_claim": float(blocks) / float(calls),
            "dead_tuples_end": dead_tuples(pg)}


def backlog(pg, redis):
    """Events per second draining BACKLOG events committed while paused."""
    pg.configure(enabled="off")
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    redis.client().flushall()
    with pg.connect() as conn:
        for start in range(0, BACKLOG, 10_000):
            conn.execute("SELECT outbox_enqueue('bench', %s::jsonb, queue => 'bench_backlog') "
                         "FROM generate_series(1, %s)", (PAYLOAD, min(10_000, BACKLOG - start)))
    pg.sql("CHECKPOINT")
    started = time.monotonic()
    pg.configure(enabled="on")
    wait_until(lambda: redis.client().llen("bench_backlog") == BACKLOG, timeout=600, message="the backlog drained")
    return BACKLOG / (time.monotonic() - started)


def run(redis, pinned):
    pg = Cluster(redis.url, server_conf=CONF, workers=2, batch_size=100)
    pin = None
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.sql("CREATE EXTENSION pg_stat_statements")
        wait_until(lambda: len(pg.dispatcher_pids()) == 2, message="the dispatchers")
        if pinned:
            pin = pg.connect(autocommit=False)
            pin.execute("SELECT pg_current_xact_id()")
        r = {"wal": wal_per_event(pg, redis)}
        log(f"  WAL per event: {r['wal']}")
        r["steady"] = steady(pg, redis, pinned)
        worst = max(w["p99"] or 0 for w in r["steady"]["windows"])
        log(f"  steady: worst window p99 {worst:.1f} ms, {r['steady']['blocks_per_claim']:.1f} buffers per claim, "
            f"{r['steady']['dead_tuples_end']:,} dead tuples")
        r["backlog_rate"] = backlog(pg, redis)
        log(f"  backlog of {BACKLOG:,}: {r['backlog_rate']:,.0f} events/s")
        return r
    finally:
        if pin is not None:
            pin.close()
        pg.close()


def write_report(r):
    un, pi = r["unpinned"], r["pinned"]
    worst = lambda run, key: max(w[key] or 0 for w in run["steady"]["windows"])  # noqa: E731
    # The goal is read on every window; the first holds each cluster's
    # first minute (its first autovacuum, checkpoint, caches), which moves
    # from run to run, so the ratio after it is given too.
    ratios = [(p["p99"] or 0) / max(u["p99"] or 0, 1e-9)
              for u, p in zip(un["steady"]["windows"], pi["steady"]["windows"])]
    ratio, settled = max(ratios), max(ratios[1:] or ratios)
    lines = [
        "# Dispatch under a pinned xmin",
        "",
        f"Machine: {r['machine']}. Two dispatchers, batch 100, autovacuum on, fsync on; {RATE:,} one-event "
        f"transactions per second from {PRODUCERS} producers for {SECONDS} s; \"pinned\": a session idle in a "
        "transaction holding an xid from before the first event to the end, and another that enqueues an event as "
        "the steady rate starts and commits as it ends.",
        "",
        "| | unpinned | pinned |",
        "|---|---|---|",
        f"| events sent / missing | {un['steady']['events']:,} / {un['steady']['missing']} | "
        f"{pi['steady']['events']:,} / {pi['steady']['missing']} |",
        f"| steady p99 (commit → Redis, from the second window on) | {un['steady']['steady_p99']:.1f} ms | "
        f"{pi['steady']['steady_p99']:.1f} ms |",
        f"| worst window p99 (commit → Redis) | {worst(un, 'p99'):.1f} ms | {worst(pi, 'p99'):.1f} ms |",
        f"| worst window max | {worst(un, 'max'):.1f} ms | {worst(pi, 'max'):.1f} ms |",
        f"| shared buffers per claim | {un['steady']['blocks_per_claim']:.1f} | {pi['steady']['blocks_per_claim']:.1f} |",
        f"| dead tuples at the end | {un['steady']['dead_tuples_end']:,} | {pi['steady']['dead_tuples_end']:,} |",
        f"| backlog of {BACKLOG:,} drained | {un['backlog_rate']:,.0f} events/s | {pi['backlog_rate']:,.0f} events/s |",
        f"| WAL per event: enqueue + dispatch | {un['wal']['enqueue']:.0f} + {un['wal']['dispatch']:.0f} B | "
        f"{pi['wal']['enqueue']:.0f} + {pi['wal']['dispatch']:.0f} B |",
        f"| WAL per plain INSERT of the same row | {un['wal']['plain_insert']:.0f} B | {pi['wal']['plain_insert']:.0f} B |",
        f"| delayed events sent (1 s delay, {DELAYED:,}/s) | {un['steady']['delayed']:,} | {pi['steady']['delayed']:,} |",
        *[f"| shared buffers per {name}.sql call | {un['steady']['due_blocks_per_call'][name] or 0:.1f} | "
          f"{pi['steady']['due_blocks_per_call'][name] or 0:.1f} |" for name in DUE_STATEMENTS],
        f"| status of the pinning transaction's event through outbox.events, once sent | – | "
        f"{pi['steady']['long_event']['ms']:.2f} ms, {pi['steady']['long_event']['blocks']} buffers |",
        "",
        f"Steady p99 pinned / unpinned: {pi['steady']['steady_p99'] / un['steady']['steady_p99']:.2f}× (goal: "
        f"within 2×, no max above 1 s). Worst ratio of pinned to unpinned p99 in the same window: {ratio:.2f}×, "
        f"{settled:.2f}× from the second window on; backlog drain pinned/unpinned: "
        f"{pi['backlog_rate'] / un['backlog_rate']:.2f} (goal: within 20%).",
        "",
        "| window | p50 unpinned | p50 pinned | p99 unpinned | p99 pinned | max unpinned | max pinned | "
        "dead unpinned | dead pinned |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v: "–" if v is None else f"{v:,.1f}" if isinstance(v, float) else f"{v:,}"  # noqa: E731
    for u, p in zip(un["steady"]["windows"], pi["steady"]["windows"]):
        lines.append(f"| {u['window'] * WINDOW}–{(u['window'] + 1) * WINDOW} s | {fmt(u['p50'])} | {fmt(p['p50'])} | "
                     f"{fmt(u['p99'])} | {fmt(p['p99'])} | {fmt(u['max'])} | {fmt(p['max'])} | "
                     f"{fmt(u['dead_tuples'])} | {fmt(p['dead_tuples'])} |")
    lines += ["", "![latency and dead tuples per window](pinned.png)", ""]
    (RESULTS / "pinned.md").write_text("\n".join(lines))


def plot(r):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    for name, style in (("unpinned", "C0"), ("pinned", "C3")):
        windows = r[name]["steady"]["windows"]
        x = [(w["window"] + 0.5) * WINDOW for w in windows]
        ax1.plot(x, [w["p99"] for w in windows], color=style, label=f"p99, {name}")
        ax1.plot(x, [w["p50"] for w in windows], color=style, linestyle="--", label=f"p50, {name}")
        ax2.plot(x, [w["dead_tuples"] for w in windows], color=style, label=name)
    ax1.set_yscale("log")
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("commit → Redis (ms, log scale)")
    ax1.set_title(f"Latency per {WINDOW} s window at {RATE:,} events/s")
    ax1.legend()
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("dead tuples in outbox.events")
    ax2.set_title("Dead tuples")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "pinned.png", dpi=110)


def main():
    RESULTS.mkdir(exist_ok=True)
    r = {"machine": machine()}
    redis = Redis()
    try:
        for name in ("unpinned", "pinned"):
            log(f"{name}: WAL, {SECONDS} s at {RATE}/s, a backlog of {BACKLOG:,}")
            r[name] = run(redis, pinned=name == "pinned")
    finally:
        redis.close()
    (RESULTS / "pinned.json").write_text(json.dumps(r, indent=1))
    write_report(r)
    plot(r)
    print((RESULTS / "pinned.md").read_text())


if __name__ == "__main__":
    main()
