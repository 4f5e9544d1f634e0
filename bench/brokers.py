"""`make bench`, part five: Redis, RabbitMQ and Kafka side by side. Runs
its own PostgreSQL 15 (fsync on), redis-server, rabbitmq-server and tansu
(a Kafka-protocol broker), with the release build installed by the
Makefile; writes bench/results/brokers.md and the raw numbers in
brokers.json.

- The drain: BENCH_BROKER_EVENTS [100000] pending events, one dispatcher,
  batch 1000, to a Redis list, to a durable RabbitMQ queue (classic, and
  quorum), every message confirmed, and to a Kafka topic of 3 partitions
  (acks=all, idempotent) once per outbox.kafka_compression (none, lz4,
  zstd); the median of BENCH_ROUNDS [3] runs of each, in
  alternation.
- The full loop through a stock prefork Celery worker (2 processes) on each
  broker, with outbox_dispatch.celery reporting over the same broker:
  BENCH_BROKER_LOOP [20000] events from enabling to the last `processed`.
- A steady rate: BENCH_STEADY_RATE [10000] events a second for
  BENCH_STEADY_SECONDS [60], committed BENCH_STEADY_CHUNK [50] to a
  transaction by two producer processes, to Redis and to Kafka (3
  partitions, no compression) in turn; commit → consumer latency (p50,
  p99, max) from COMMIT's return to a consumer's receipt: BLMPOP on
  Redis, a kafka-python consumer (fetch.max.wait.ms 10) on Kafka, each in
  a process of its own."""

import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import amqp  # noqa: E402
import amqp.protocol  # noqa: E402

from harness import CeleryWorker, Cluster, Kafka, RabbitMQ, Redis, wait_until  # noqa: E402

EVENTS = int(os.environ.get("BENCH_BROKER_EVENTS", 100_000))
LOOP_EVENTS = int(os.environ.get("BENCH_BROKER_LOOP", 20_000))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
BATCH = 1000
# outbox.kafka_compression's values, each drained to its own topic.
CODECS = ("none", "lz4", "zstd")
STEADY_RATE = int(os.environ.get("BENCH_STEADY_RATE", 10_000))
STEADY_SECONDS = int(os.environ.get("BENCH_STEADY_SECONDS", 60))
STEADY_CHUNK = int(os.environ.get("BENCH_STEADY_CHUNK", 50))
STEADY_PRODUCERS = 2
RESULTS = ROOT / "bench" / "results"
SERVER_CONF = {"fsync": "on", "shared_buffers": "'512MB'", "max_wal_size": "'4GB'", "checkpoint_timeout": "'15min'"}


def log(*args):
    print("bench:", *args, flush=True)


def enqueue(pg, n, queue, task="bench.noop"):
    pg.configure(enabled="off")
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    with pg.connect() as conn:
        conn.execute("SELECT outbox_enqueue('bench', '{\"n\": 1}', queue => %s, task => %s) "
                     "FROM generate_series(1, %s)", (queue, task, n))
        conn.execute("VACUUM ANALYZE outbox.log")
    pg.sql("CHECKPOINT")


def drain(pg, url, queued, queue, **settings):
    """Events per second from enabling the dispatcher until `queued()`
    counts every event in the broker."""
    pg.configure(broker_url=url, report_key="", **settings)
    enqueue(pg, EVENTS, queue)
    started = time.monotonic()
    pg.configure(enabled="on")
    while queued() < EVENTS:
        assert time.monotonic() - started < 900, "the drain stalled"
        time.sleep(0.02)
    return EVENTS / (time.monotonic() - started)


class Depth:
    """Messages in a RabbitMQ queue, 0 before it exists: a passive
    declaration per look on one connection (as LLEN is on Redis), its
    channel opened again after a look at a queue not there yet."""

    def __init__(self, rabbit):
        self.rabbit = rabbit
        self.channel = rabbit.channel()

    def __call__(self, queue):
        return self._look(queue).message_count

    def consumers(self, queue):
        return self._look(queue).consumer_count

    def _look(self, queue):
        try:
            return self.channel.queue_declare(queue, passive=True)
        except amqp.exceptions.NotFound:
            self.channel = self.channel.connection.channel()
            return amqp.protocol.queue_declare_ok_t(queue, 0, 0)

    def close(self):
        self.channel.connection.close()


class Acknowledged:
    """Events the broker acknowledged since this was made: the dispatchers'
    counter (`outbox_dispatched_total`, in shared memory), read on one
    connection, a look as cheap as LLEN is on Redis. (tansu's latest
    offset is its last batch's first, not the log's end, so the topic's
    offsets cannot count them.)"""

    def __init__(self, pg):
        self.conn = pg.connect()
        self.base = self._total()

    def _total(self):
        return self.conn.execute("SELECT coalesce(sum(value), 0) FROM outbox.metrics "
                                 "WHERE name = 'outbox_dispatched_total'").fetchone()[0]

    def __call__(self):
        return self._total() - self.base

    def close(self):
        self.conn.close()


def produce_steady(host, port, queue, rate, seconds, out):
    """A producer process: `rate` events a second, STEADY_CHUNK to a
    transaction; sends {event id: time COMMIT returned} back."""
    import psycopg
    committed = {}
    commits = rate * seconds // STEADY_CHUNK
    with psycopg.connect(host=host, port=port, user="postgres", dbname="postgres", autocommit=True) as conn:
        start = time.time()
        for i in range(commits):
            pause = start + i * STEADY_CHUNK / rate - time.time()
            if pause > 0:
                time.sleep(pause)
            ids = [r[0] for r in conn.execute("SELECT outbox_enqueue('bench', '{\"n\": 1}', queue => %s) "
                                              "FROM generate_series(1, %s)", (queue, STEADY_CHUNK))]
            now = time.time()
            committed.update((str(event), now) for event in ids)
    out.put(("committed", committed))


def receive_redis(port, queue, total, seconds, out):
    """The Redis consumer: pops what arrived (up to 1000 at a time) and
    stamps it; decodes at the end."""
    import redis as redis_lib
    client = redis_lib.Redis(host="127.0.0.1", port=port)
    stamped, count, end = [], 0, time.time() + seconds + 60
    while count < total and time.time() < end:
        popped = client.blmpop(5, 1, queue, direction="RIGHT", count=1000)
        if popped is not None:
            stamped.append((time.time(), popped[1]))
            count += len(popped[1])
    out.put(("arrived", {json.loads(m)["headers"]["id"]: at for at, messages in stamped for m in messages}))


def receive_kafka(address, topic, total, seconds, out):
    """The Kafka consumer: polls what arrived and stamps it; its `id`
    header is the event's id."""
    from kafka import KafkaConsumer
    consumer = KafkaConsumer(topic, bootstrap_servers=address, auto_offset_reset="earliest",
                             fetch_max_wait_ms=10, enable_auto_commit=False, group_id=None)
    arrived, end = {}, time.time() + seconds + 60
    while len(arrived) < total and time.time() < end:
        for records in consumer.poll(timeout_ms=100, max_records=5000).values():
            now = time.time()
            for record in records:
                arrived[dict(record.headers)["id"].decode()] = now
    consumer.close()
    out.put(("arrived", arrived))


def steady(pg, url, queue, receiver, receiver_args, **settings):
    """Commit → consumer latency at STEADY_RATE for STEADY_SECONDS."""
    pg.configure(broker_url=url, report_key="", enabled="on", **settings)
    pg.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    pg.sql("CHECKPOINT")
    pg.wait_idle()
    total = STEADY_RATE // STEADY_PRODUCERS * STEADY_PRODUCERS * STEADY_SECONDS // STEADY_CHUNK * STEADY_CHUNK
    results = multiprocessing.Queue()
    consumer = multiprocessing.Process(target=receiver, args=(*receiver_args, total, STEADY_SECONDS, results))
    consumer.start()
    time.sleep(1)
    producers = [multiprocessing.Process(target=produce_steady,
                                         args=(str(pg.dir), pg.port, queue, STEADY_RATE // STEADY_PRODUCERS,
                                               STEADY_SECONDS, results))
                 for _ in range(STEADY_PRODUCERS)]
    started = time.time()
    for p in producers:
        p.start()
    times = {"committed": {}, "arrived": {}}
    for _ in range(STEADY_PRODUCERS + 1):
        kind, part = results.get(timeout=STEADY_SECONDS + 300)
        times[kind].update(part)
    for p in producers + [consumer]:
        p.join()
    committed, arrived = times["committed"], times["arrived"]
    lat = sorted(max(0.0, arrived[e] - at) * 1000 for e, at in committed.items() if e in arrived)
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None  # noqa: E731
    last = max(committed.values(), default=started)
    return {"events": len(committed), "missing": len(committed) - len(lat),
            "rate": len(committed) / max(last - started, 1e-9),
            "p50": pick(0.5), "p99": pick(0.99), "max": lat[-1] if lat else None}


def full_loop(pg, url, notes, consuming):
    """Events per second processed through a stock prefork worker that
    reports over the broker it consumes (`consuming()`: the worker is
    consuming the queue)."""
    pg.configure(broker_url=url, report_key="bench_reports", amqp_queue_type="classic")
    worker = CeleryWorker(url, queues=("bench_loop",), app="loop_app", pool="prefork", concurrency=2,
                          env={"OUTBOX_TEST_NOTES": notes},
                          extra_args=("--prefetch-multiplier=100", "--loglevel=WARNING"))
    try:
        wait_until(lambda: consuming() or worker.proc.poll() is not None, timeout=60, message="the Celery worker")
        enqueue(pg, LOOP_EVENTS, "bench_loop", task="loop.noop")
        started = time.monotonic()
        pg.configure(enabled="on")
        while pg.count("processed") < LOOP_EVENTS:
            assert time.monotonic() - started < 1800, "the full loop stalled"
            time.sleep(0.2)
        return LOOP_EVENTS / (time.monotonic() - started)
    finally:
        worker.close()


def main():
    RESULTS.mkdir(exist_ok=True)
    redis, rabbit, kafka = Redis("--loglevel", "warning"), RabbitMQ(), Kafka()
    for codec in CODECS:
        kafka.create_topic(f"bench_kafka_{codec}", 3)
    kafka.create_topic("bench_steady", 3)
    r = {"drain": {"redis": [], "classic": [], "quorum": [], **{f"kafka_{c}": [] for c in CODECS}}, "loop": {},
         "steady": {}}
    try:
        pg = Cluster(redis.url, server_conf=SERVER_CONF, batch_size=BATCH, enabled="off")
        # One connection watches the queue's depth (a passive declaration
        # per look), as LLEN does on Redis.
        watch = None
        try:
            pg.sql("CREATE EXTENSION outbox_dispatch")
            pg.sql("ALTER SYSTEM SET autovacuum = off")
            for round_ in range(ROUNDS):
                redis.client().flushall()
                r["drain"]["redis"].append(drain(pg, redis.url, lambda: redis.client().llen("bench_drain"),
                                                 "bench_drain"))
                log(f"round {round_ + 1}: Redis {r['drain']['redis'][-1]:,.0f} events/s")
                for kind in ("classic", "quorum"):
                    rabbit.reset()
                    watch = watch or Depth(rabbit)
                    queue = f"bench_{kind}"
                    rate = drain(pg, rabbit.url, lambda q=queue: watch(q), queue, amqp_queue_type=kind)
                    r["drain"][kind].append(rate)
                    log(f"round {round_ + 1}: RabbitMQ, {kind} queue, {rate:,.0f} events/s")
                for codec in CODECS:
                    acknowledged = Acknowledged(pg)
                    try:
                        rate = drain(pg, kafka.url, acknowledged, f"bench_kafka_{codec}", kafka_topic="{queue}",
                                     kafka_compression=codec)
                    finally:
                        acknowledged.close()
                    r["drain"][f"kafka_{codec}"].append(rate)
                    log(f"round {round_ + 1}: Kafka, {codec}, {rate:,.0f} events/s")
            pg.sql("ALTER SYSTEM SET autovacuum = on")
            redis.client().flushall()
            r["steady"]["redis"] = steady(pg, redis.url, "bench_steady", receive_redis, (redis.port, "bench_steady"))
            log(f"steady on Redis: {r['steady']['redis']}")
            r["steady"]["kafka"] = steady(pg, kafka.url, "bench_steady", receive_kafka,
                                          (kafka.address, "bench_steady"), kafka_topic="{queue}",
                                          kafka_compression="none")
            log(f"steady on Kafka: {r['steady']['kafka']}")
            pg.configure(enabled="off")
            redis.client().flushall()
            r["loop"]["redis"] = full_loop(pg, redis.url, redis.url,
                                           lambda: redis.client().exists("_kombu.binding.bench_loop"))
            log(f"full loop on Redis: {r['loop']['redis']:,.0f} events/s")
            rabbit.reset()
            watch = watch or Depth(rabbit)
            r["loop"]["rabbitmq"] = full_loop(pg, rabbit.url, redis.url, lambda: watch.consumers("bench_loop"))
            log(f"full loop on RabbitMQ: {r['loop']['rabbitmq']:,.0f} events/s")
        finally:
            if watch is not None:
                watch.close()
            pg.close()
    finally:
        redis.close()
        rabbit.close()
        kafka.close()
    median = {kind: statistics.median(rates) for kind, rates in r["drain"].items()}
    lines = [
        "# Redis, RabbitMQ and Kafka", "",
        f"One PostgreSQL 15 server (fsync on), one dispatcher, batch {BATCH}; redis-server (no persistence), "
        "rabbitmq-server (Debian's, one node) and tansu 0.6.0 (a Kafka-protocol broker, memory storage) on "
        f"loopback; {os.cpu_count()} cores.", "",
        "## Drain", "",
        f"{EVENTS:,} pending events, committed while the dispatcher was paused; then enabled, until the broker "
        "holds every message. On RabbitMQ every message is persistent, published `mandatory` to a durable queue "
        "and confirmed before its event counts as dispatched; on Kafka every record is acknowledged by its "
        "partition's leader (`acks=all`, the idempotent producer) before its event counts as dispatched, and "
        "the dispatchers' count of those (`outbox_dispatched_total`) is watched, once per "
        "`outbox.kafka_compression`. The median of "
        f"{ROUNDS} runs, brokers in alternation.", "",
        "| broker | events/s | of Redis's |",
        "|---|---|---|",
        f"| Redis list | {median['redis']:,.0f} | 100% |",
        f"| RabbitMQ, classic queue | {median['classic']:,.0f} | {median['classic'] / median['redis']:.0%} |",
        f"| RabbitMQ, quorum queue | {median['quorum']:,.0f} | {median['quorum'] / median['redis']:.0%} |",
        *(f"| Kafka topic, 3 partitions, compression {codec} | {median[f'kafka_{codec}']:,.0f} | "
          f"{median[f'kafka_{codec}'] / median['redis']:.0%} |" for codec in CODECS), "",
        "## Full loop", "",
        f"{LOOP_EVENTS:,} events for a no-op task, through a stock Celery worker (prefork, 2 processes, prefetch "
        "100) on the same broker, with `outbox_dispatch.celery` reporting each outcome over it.", "",
        "| broker | processed/s |",
        "|---|---|",
        f"| Redis | {r['loop']['redis']:,.0f} |",
        f"| RabbitMQ | {r['loop']['rabbitmq']:,.0f} |", "",
        "## A steady rate", "",
        f"{STEADY_RATE:,} events a second asked for {STEADY_SECONDS} s, {STEADY_CHUNK} to a transaction from "
        f"{STEADY_PRODUCERS} producer processes, one dispatcher (batch {BATCH}); latency from COMMIT's return "
        "to a consumer's receipt (Redis: BLMPOP; Kafka: a kafka-python consumer, fetch.max.wait.ms 10, "
        "3 partitions, `acks=all`, no compression), every event counted.", "",
        "| broker | events/s reached | p50 | p99 | max | not received |",
        "|---|---|---|---|---|---|",
        *(f"| {name} | {s['rate']:,.0f} | {s['p50']:.1f} ms | {s['p99']:.1f} ms | {s['max']:.1f} ms | "
          f"{s['missing']} |" for name, s in (("Redis", r["steady"]["redis"]), ("Kafka", r["steady"]["kafka"]))),
        "",
        "Sequin's published figure, for scale: one PostgreSQL replication slot streamed to Kafka at 50,000 "
        "ops/s, 55 ms average and 253 ms p99, on larger machines.",
    ]
    (RESULTS / "brokers.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "brokers.json").write_text(json.dumps(r, indent=1))
    print((RESULTS / "brokers.md").read_text())


if __name__ == "__main__":
    main()
