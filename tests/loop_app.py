"""The Celery application of the closed-loop tests (tests/test_celery_loop.py)
and of the bench's full loop: stock Celery 5 with outbox_dispatch.celery
imported, nothing else changed. Tasks note what they saw in Redis keys
named after their task id, for the tests to check."""

import asyncio
import functools
import json
import os
import random
import time

import redis
from celery import Celery, signals

from outbox_dispatch.inbox import once

BROKER = os.environ["OUTBOX_TEST_BROKER"]

# A result backend only where a test names one (tests/test_inbox.py).
app = Celery("outbox_loop", broker=BROKER, backend=os.environ.get("OUTBOX_TEST_RESULTS"))
app.conf.update(
    imports=["outbox_dispatch.celery"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    # kombu's transport options, as JSON (the Sentinel test sets master_name
    # and the key options).
    broker_transport_options=json.loads(os.environ.get("OUTBOX_TEST_TRANSPORT_OPTIONS", "{}")),
)

# Where tasks leave their notes: the broker's Redis unless it is reached
# through sentinels.
notes = redis.Redis.from_url(os.environ.get("OUTBOX_TEST_NOTES", BROKER))


@app.task(name="loop.ok", bind=True)
def ok(self, *args, **kwargs):
    notes.rpush(f"ran:{self.request.id}", json.dumps({
        "args": list(args), "kwargs": kwargs,
        "parent_id": self.request.parent_id, "root_id": self.request.root_id,
    }))


def record(self, *args, **kwargs):
    """A subscriber (tests/test_subscriptions.py): notes its task name, its
    arguments and the event it delivers; fails its first run when the
    payload asks."""
    runs = notes.incr(f"runs:{self.request.id}")
    notes.rpush(f"ran:{self.request.id}", json.dumps({
        "task": self.name, "args": list(args), "kwargs": kwargs,
        "event": getattr(self.request, "outbox_event_id", None),
    }))
    if kwargs.get("fail_first") == self.name and runs == 1:
        raise RuntimeError(f"{self.name} failed its first run")


for subscriber in ("loop.billing", "loop.email", "loop.search", "loop.digest"):
    app.task(name=subscriber, bind=True)(record)


@app.task(name="loop.noop")
def noop(*args, **kwargs):
    """The bench's task: nothing but the round trip."""


@app.task(name="loop.boom")
def boom(*args, **kwargs):
    raise ValueError("the task refused: boom")


@app.task(name="loop.flaky", bind=True, max_retries=5)
def flaky(self, failures=2):
    notes.rpush(f"ran:{self.request.id}", self.request.retries)
    if self.request.retries < failures:
        raise self.retry(exc=RuntimeError("not yet"), countdown=0.1)
    return "done"


@app.task(name="loop.fragile", bind=True, acks_late=True, reject_on_worker_lost=True)
def fragile(self):
    """Its first run waits for the test to kill the process running it."""
    if notes.rpush(f"ran:{self.request.id}", os.getpid()) == 1:
        time.sleep(120)


@app.task(name="loop.doomed", bind=True)
def doomed(self):
    """Acknowledged early (Celery's default): waits for the test to kill the
    process running it; the message is not given back."""
    notes.rpush(f"ran:{self.request.id}", os.getpid())
    time.sleep(120)


@app.task(name="loop.spawn", bind=True)
def spawn(self, dsn):
    """Enqueues loop.ok from inside a task, as an application would."""
    import psycopg

    from outbox_dispatch import enqueue

    with psycopg.connect(dsn) as conn:
        child = enqueue(conn, ok, args=("from a task",), queue=self.request.delivery_info["routing_key"])
    notes.set(f"spawned:{self.request.id}", str(child))


@app.task(name="loop.traced", bind=True)
def traced(self):
    from opentelemetry import trace

    notes.set(f"trace:{self.request.id}", format(trace.get_current_span().get_span_context().trace_id, "032x"))


if os.environ.get("OUTBOX_TEST_OTEL"):
    @signals.worker_init.connect(weak=False)
    def instrument(**_):
        """OpenTelemetry with an in-memory exporter, and Celery's
        instrumentation (the solo pool: one process)."""
        from opentelemetry import trace
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        trace.set_tracer_provider(provider)
        CeleryInstrumentor().instrument()


def ordered(self, key, seq, fail=False, producer=None, slow=0):
    """Per-key order (tests/test_order.py): notes its key, sequence, start
    and end on the list order:<key>, after sleeping a few milliseconds;
    with fail, raises until the test sets heal:<task id>, and then sleeps
    `slow` seconds."""
    start = time.time()
    healed = fail and notes.exists(f"heal:{self.request.id}")
    time.sleep(slow if healed else random.uniform(0.001, 0.006))
    notes.rpush(f"order:{key}", json.dumps({"seq": seq, "producer": producer, "id": self.request.id,
                                             "start": start, "end": time.time()}))
    if fail and not healed:
        raise RuntimeError(f"{key} #{seq} refused")


for name in ("loop.ordered", "loop.ordered_too"):
    app.task(name=name, bind=True)(ordered)


def effects_connection():
    """A connection to the database the effects go to (tests/test_inbox.py
    names it in OUTBOX_TEST_DSN)."""
    import psycopg

    return psycopg.connect(os.environ["OUTBOX_TEST_DSN"])


@app.task(name="loop.effect", bind=True, max_retries=3, ignore_result=False)
@once(effects_connection)
def effect(self, n, fail_first=False, hold=0.3, conn=None):
    """Effects once (tests/test_inbox.py): writes its row, then holds its
    transaction `hold` seconds, so that a duplicate running at the same
    time waits for it; with fail_first, its first run raises after
    writing, and Celery retries it. Returns n, which Celery stores
    (Celery's default ignore_result=False) where a result backend is set."""
    conn.execute("INSERT INTO effects (event, n) VALUES (%s, %s)", (self.request.id, n))
    time.sleep(hold)
    if fail_first and self.request.retries == 0:
        raise self.retry(exc=RuntimeError("the first run fails after its write"), countdown=0.1)
    return n


@functools.lru_cache(maxsize=None)
def async_effect(using):
    """The body of loop.effect_async under outbox_dispatch.aio.once, on what
    `using` names: a callable opening a psycopg AsyncConnection or an
    asyncpg connection, a pool of either, or a SQLAlchemy
    async_sessionmaker. The pools and the engine are made in the loop
    that runs them (asyncio.run() per task): a pool is bound to its loop."""
    import asyncpg
    import psycopg
    import psycopg_pool
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
    from sqlalchemy.pool import NullPool

    from outbox_dispatch.aio import once as once_async

    dsn = os.environ["OUTBOX_TEST_DSN"]
    params = dict(part.split("=", 1) for part in dsn.split())
    asyncpg_params = {"host": params["host"], "port": int(params["port"]), "user": params["user"],
                      "database": params["dbname"]}
    engine = create_async_engine(f"postgresql+asyncpg://{params['user']}@/{params['dbname']}?host={params['host']}"
                                 f"&port={params['port']}", poolclass=NullPool)

    async def write(task, n, conn=None, session=None):
        if session is not None:
            await session.execute(text("INSERT INTO effects (event, n) VALUES (CAST(:event AS uuid), :n)"),
                                  {"event": task.request.id, "n": n})
        elif type(conn).__module__.startswith("asyncpg"):
            await conn.execute("INSERT INTO effects (event, n) VALUES ($1::uuid, $2)", task.request.id, n)
        else:
            await conn.execute("INSERT INTO effects (event, n) VALUES (%s, %s)", (task.request.id, n))
        await asyncio.sleep(0.3)  # a duplicate running at the same time waits for this one
        return n

    if using == "psycopg":
        return once_async(functools.partial(psycopg.AsyncConnection.connect, dsn))(write)
    if using == "asyncpg":
        return once_async(functools.partial(asyncpg.connect, **asyncpg_params))(write)
    if using == "sqlalchemy":
        return once_async(async_sessionmaker(engine))(write)

    async def pooled(task, n):
        if using == "psycopg_pool":
            pool = psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False)
            await pool.open()
        else:
            pool = await asyncpg.create_pool(min_size=1, max_size=1, **asyncpg_params)
        try:
            return await once_async(pool)(write)(task, n)
        finally:
            await pool.close()

    return pooled


@app.task(name="loop.effect_async", bind=True)
def effect_async(self, n, using):
    """Effects once with an async body (tests/test_async.py)."""
    return asyncio.run(async_effect(using)(self, n))
