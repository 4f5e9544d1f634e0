"""The closed loop with stock Celery 5 workers running outbox_dispatch.celery:
every outcome (processed, failed in the task, unknown task, expired, worker
process lost) reaches outbox.events, through Redis, in the prefork, threads,
solo, gevent and eventlet pools. Also enqueue()'s lineage and trace
context, and the reports' edge cases (one that overtakes the dispatcher's
own record, forged, replayed, stale, malformed)."""

import json
import os
import signal
import time
import uuid

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from harness import CeleryWorker, decode, queued_ids, wait_until
from outbox_dispatch import enqueue, report

POOLS = ("prefork", "threads", "solo", "gevent", "eventlet")


@pytest.fixture(scope="module")
def workers(redis_server):
    """A prefork worker with two processes, a threads one with two threads,
    a solo one, and gevent and eventlet ones with four greenlets, each on
    its own queue; the solo one traces with OpenTelemetry."""
    started = {
        "prefork": CeleryWorker(redis_server.url, queues=("loop_prefork",), app="loop_app",
                                pool="prefork", concurrency=2),
        "threads": CeleryWorker(redis_server.url, queues=("loop_threads",), app="loop_app",
                                pool="threads", concurrency=2),
        "solo": CeleryWorker(redis_server.url, queues=("loop_solo",), app="loop_app",
                             env={"OUTBOX_TEST_OTEL": "1"}),
        **{pool: CeleryWorker(redis_server.url, queues=(f"loop_{pool}",), app="loop_app", pool=pool,
                              concurrency=4) for pool in ("gevent", "eventlet")},
    }
    try:
        for worker in started.values():
            worker.wait_ready()
        yield started
    finally:
        for worker in started.values():
            worker.close()


@pytest.fixture
def loop(cluster, redis_server, workers):
    """The shared cluster with an empty outbox. Redis is not flushed: the
    workers' own keys (kombu's bindings) must stay."""
    cluster.reset(enabled="on")
    cluster.empty()
    yield cluster


def dsn(pg):
    return f"host={pg.dir} port={pg.port} user=postgres dbname=postgres"


def status_of(pg, event_id):
    return pg.sql("SELECT status::text, last_error FROM outbox.events WHERE id = %s", (event_id,))[0]


def wait_status(pg, event_id, status, timeout=60):
    wait_until(lambda: status_of(pg, event_id)[0] == status, timeout=timeout,
               message=f"event {event_id} {status} (is {status_of(pg, event_id)})")
    return status_of(pg, event_id)


def notes(redis_server, key):
    return [json.loads(n) for n in redis_server.client().lrange(key, 0, -1)]


@pytest.mark.parametrize("pool", POOLS)
def test_every_outcome_reaches_the_outbox(loop, redis_server, workers, pool):
    queue = f"loop_{pool}"
    acked = loop.metric("outbox_acked_total", source="celery")
    failures = loop.metric("outbox_task_failures_total")
    with psycopg.connect(dsn(loop)) as conn:
        ok = enqueue(conn, "loop.ok", args=(1, "two"), kwargs={"three": 3}, queue=queue)
        boom = enqueue(conn, "loop.boom", queue=queue)
        flaky = enqueue(conn, "loop.flaky", kwargs={"failures": 2}, queue=queue)
        unknown = enqueue(conn, "loop.nobody_knows_me", queue=queue)

    wait_status(loop, ok, "processed")
    [ran] = notes(redis_server, f"ran:{ok}")
    assert (ran["args"], ran["kwargs"]) == ([1, "two"], {"three": 3})

    status, error = wait_status(loop, boom, "failed")
    assert error.startswith("ValueError: the task refused: boom\n"), error
    assert "Traceback" in error and "raise ValueError" in error

    wait_status(loop, flaky, "processed")
    assert notes(redis_server, f"ran:{flaky}") == [0, 1, 2], "two retries, then success, reported once"

    status, error = wait_status(loop, unknown, "failed")
    assert "unregistered task 'loop.nobody_knows_me'" in error

    assert loop.metric("outbox_acked_total", source="celery") == acked + 2
    assert loop.metric("outbox_task_failures_total") == failures + 2
    assert loop.value("SELECT count(*) FROM outbox.dead_letters") == 2
    # The first numbers a user sees are right: exact, not estimated.
    assert loop.sql("SELECT status::text, count, estimated FROM outbox.status "
                    "WHERE status IN ('processed', 'failed')") == [("processed", 2, False), ("failed", 2, False)]
    assert loop.value("SELECT deliveries FROM outbox.events WHERE id = %s", (flaky,)) == 1


def test_a_killed_worker_process_is_redelivered_and_processed_once(loop, redis_server, workers):
    """acks_late + reject_on_worker_lost: kombu gives the message back, the
    second run succeeds; the lost first run reports nothing."""
    with psycopg.connect(dsn(loop)) as conn:
        event = enqueue(conn, "loop.fragile", queue="loop_prefork")
    [pid] = wait_until(lambda: notes(redis_server, f"ran:{event}"), message="the first run")
    os.kill(pid, signal.SIGKILL)
    wait_status(loop, event, "processed")
    runs = notes(redis_server, f"ran:{event}")
    assert len(runs) == 2 and runs[1] != pid
    assert loop.value("SELECT last_error FROM outbox.events WHERE id = %s", (event,)) is None


def test_a_process_lost_without_acks_late_ends_failed_naming_it(loop, redis_server, workers):
    """Acknowledged before it ran, a task whose process dies is gone: the
    worker reports the loss (WorkerLostError), the event ends failed."""
    with psycopg.connect(dsn(loop)) as conn:
        event = enqueue(conn, "loop.doomed", queue="loop_prefork")
    [pid] = wait_until(lambda: notes(redis_server, f"ran:{event}"), message="the run")
    os.kill(pid, signal.SIGKILL)
    status, error = wait_status(loop, event, "failed")
    assert "WorkerLostError" in error, error
    assert len(notes(redis_server, f"ran:{event}")) == 1


def test_the_trace_continues_in_the_worker(loop, redis_server, workers):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("outbox tests")
    with tracer.start_as_current_span("checkout") as span:
        # The helper injects the current context: set it as the global one.
        trace.set_tracer_provider(provider)
        with psycopg.connect(dsn(loop)) as conn:
            event = enqueue(conn, "loop.traced", queue="loop_solo")
        produced = format(span.get_span_context().trace_id, "032x")
    wait_status(loop, event, "processed")
    assert redis_server.client().get(f"trace:{event}").decode() == produced
    # The enqueue is a PRODUCER span as the messaging conventions name it,
    # and the message carries its context.
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"checkout", "send loop_solo"}
    send = spans["send loop_solo"]
    assert send.kind == trace.SpanKind.PRODUCER
    assert send.parent.span_id == spans["checkout"].context.span_id
    assert dict(send.attributes) == {
        "messaging.system": "celery", "messaging.operation.type": "send", "messaging.operation.name": "send",
        "messaging.destination.name": "loop_solo", "messaging.message.id": str(event)}
    headers = loop.value("SELECT headers FROM outbox.events WHERE id = %s", (event,))
    assert headers["traceparent"].split("-")[1] == produced
    assert headers["traceparent"].split("-")[2] == format(send.context.span_id, "016x")


def test_a_task_enqueued_from_a_task_chains_to_it(loop, redis_server, workers):
    with psycopg.connect(dsn(loop)) as conn:
        parent = enqueue(conn, "loop.spawn", args=(dsn(loop),), queue="loop_solo")
    wait_status(loop, parent, "processed")
    child = redis_server.client().get(f"spawned:{parent}").decode()
    wait_status(loop, child, "processed")
    [ran] = notes(redis_server, f"ran:{child}")
    assert (ran["parent_id"], ran["root_id"]) == (str(parent), str(parent))


def test_an_event_that_expires_before_delivery_is_not_sent(loop, redis_server):
    expired = loop.metric("outbox_expired_total")
    loop.configure(enabled="off")
    wait_until(lambda: loop.value("SELECT state FROM outbox.workers") == "paused", message="paused")
    with psycopg.connect(dsn(loop)) as conn:
        event = enqueue(conn, "loop.ok", queue="q_expiring", expires=0.5)
        kept = enqueue(conn, "loop.ok", queue="q_expiring", expires=3600)
    wait_until(lambda: loop.value("SELECT expires_at < now() FROM outbox.events WHERE id = %s", (event,)),
               message="the expiry to pass")
    loop.configure(enabled="on")
    status, error = wait_status(loop, event, "failed")
    assert error.startswith("expired at ") and error.endswith(" before it was sent"), error
    wait_status(loop, kept, "dispatched")
    assert queued_ids(redis_server.client(), "q_expiring") == [str(kept)]
    assert loop.metric("outbox_expired_total") == expired + 1


def test_a_message_that_expires_in_the_queue_is_reported_by_the_worker(loop, redis_server):
    with psycopg.connect(dsn(loop)) as conn:
        event = enqueue(conn, "loop.ok", queue="loop_late", expires=1)
    wait_status(loop, event, "dispatched")
    wait_until(lambda: loop.value("SELECT expires_at < now() FROM outbox.events WHERE id = %s", (event,)),
               message="the expiry to pass")
    late = CeleryWorker(redis_server.url, queues=("loop_late",), app="loop_app")
    try:
        status, error = wait_status(loop, event, "failed")
    finally:
        late.close()
    assert "expired before a worker ran it" in error
    assert not notes(redis_server, f"ran:{event}")


def test_a_forged_report_finishes_no_event_and_a_replayed_one_no_later_send(loop, redis_server):
    """Any client of the broker can append to the report list. A report is
    taken only for the send it names: one for an event never sent (delayed
    here), one with a guessed send, and a late one of an earlier send change
    nothing; the current send's is taken."""
    client = redis_server.client()
    stale = loop.metric("outbox_reports_ignored_total", reason="stale")
    delayed = loop.value("SELECT outbox_enqueue('forged', '{}', queue => 'q_forged', delay => '1 hour')")
    client.rpush(loop.report_list(), report.processed(str(delayed), str(uuid.uuid4())))
    sent = loop.value("SELECT outbox_enqueue('replayed', '{}', queue => 'q_replayed')")
    wait_until(lambda: len(queued_ids(client, "q_replayed")) == 1, message="the first send")
    first = decode(client.lindex("q_replayed", 0))[0]["headers"]["outbox_send"]
    # Sent again (as the unacknowledged sweeper does), with a new send id.
    loop.sql("UPDATE outbox.log SET status = 'pending' WHERE id = %s", (sent,))
    loop.sql("SELECT outbox_wake()")
    wait_until(lambda: len(queued_ids(client, "q_replayed")) == 2, message="the second send")
    second = decode(client.lindex("q_replayed", 0))[0]["headers"]["outbox_send"]
    assert second != first
    wait_status(loop, sent, "dispatched")
    client.rpush(loop.report_list(), report.processed(str(sent), first), report.processed(str(sent), str(uuid.uuid4())))
    wait_until(lambda: loop.metric("outbox_reports_ignored_total", reason="stale") == stale + 3,
               message="the forged and replayed reports counted")
    time.sleep(0.5)
    assert status_of(loop, delayed) == ("pending", None)
    assert status_of(loop, sent) == ("dispatched", None)
    client.rpush(loop.report_list(), report.failed(str(sent), second, "ValueError: the real one"))
    assert wait_status(loop, sent, "failed") == ("failed", "ValueError: the real one")
    # Retried by hand: the report of the failed send, replayed, finishes
    # nothing either.
    stale = loop.metric("outbox_reports_ignored_total", reason="stale")
    assert loop.value("SELECT outbox_retry(%s)", (sent,)) is True
    client.rpush(loop.report_list(), report.processed(str(sent), second))
    wait_until(lambda: loop.metric("outbox_reports_ignored_total", reason="stale") == stale + 1,
               message="the replayed report counted")
    assert status_of(loop, sent)[0] in ("pending", "processing", "dispatched")


def test_a_report_may_overtake_the_dispatchers_record(loop, redis_server):
    """A worker can finish before the dispatcher has marked the event
    dispatched: the report wins, the late mark changes nothing."""
    loop.configure(enabled="off")
    wait_until(lambda: loop.value("SELECT bool_and(state = 'paused') FROM outbox.workers"), message="the pause")
    event = loop.value("SELECT outbox_enqueue('overtaken', '{}', queue => 'q_overtaken')")
    # Claimed by a dispatcher that has not marked it (index 7).
    _, sends = loop.claim_enqueued(7, [event])
    loop.configure(enabled="on")
    redis_server.client().rpush(loop.report_list(), report.processed(str(event), sends[str(event)]))
    wait_status(loop, event, "processed")
    assert loop.value("SELECT deliveries FROM outbox.events WHERE id = %s", (event,)) == 1


def test_a_message_names_a_send_good_for_its_own_event_alone(loop, redis_server):
    """Two events claimed in one batch: a worker that saw the message of one
    cannot report the other with what that message names (it would
    dead-letter it, or, processed, stop its re-send)."""
    loop.configure(enabled="off")
    wait_until(lambda: loop.value("SELECT bool_and(state = 'paused') FROM outbox.workers"), message="the pause")
    seen, other = (str(loop.value("SELECT outbox_enqueue('forged', '{}', queue => 'q_forged')")) for _ in range(2))
    stale = loop.metric("outbox_reports_ignored_total", reason="stale")
    _, sends = loop.claim_enqueued(7, [seen, other])
    assert set(sends) == {seen, other} and sends[seen] != sends[other]
    loop.configure(enabled="on")
    redis_server.client().rpush(loop.report_list(), report.failed(other, sends[seen], "forged"))
    wait_until(lambda: loop.metric("outbox_reports_ignored_total", reason="stale") == stale + 1,
               message="the forged report ignored")
    assert loop.value("SELECT status::text FROM outbox.events WHERE id = %s", (other,)) == "processing"
    redis_server.client().rpush(loop.report_list(), report.processed(other, sends[other]))
    wait_status(loop, other, "processed")


def test_stale_and_malformed_reports_are_counted_and_dropped(loop, redis_server):
    stale = loop.metric("outbox_reports_ignored_total", reason="stale")
    malformed = loop.metric("outbox_reports_ignored_total", reason="malformed")
    client = redis_server.client()
    client.rpush(loop.report_list(), report.processed("0190b5a8-3c4e-7d2a-9b1f-2e6a5c4d3b2a", str(uuid.uuid4())),
                 b"{not json", b'{"id": 1}', b"x" * (20 * 1024),
                 b'{"id": "0190b5a8-3c4e-7d2a-9b1f-2e6a5c4d3b2a", "outcome": "processed"}')
    wait_until(lambda: loop.metric("outbox_reports_ignored_total", reason="malformed") == malformed + 4,
               message="the malformed reports counted")
    assert loop.metric("outbox_reports_ignored_total", reason="stale") == stale + 1
    wait_until(lambda: client.llen(loop.report_list()) == 0, message="the list emptied")
    assert "ignoring a report in Redis list" in loop.log_text()


def test_reports_off_leaves_events_dispatched(loop, redis_server, workers):
    reports = loop.report_list()
    loop.configure(report_key="")
    with psycopg.connect(dsn(loop)) as conn:
        event = enqueue(conn, "loop.ok", queue="loop_solo")
    wait_until(lambda: notes(redis_server, f"ran:{event}"), message="the task to run")
    time.sleep(1)  # ten times the collector's poll: a report would have been recorded
    assert status_of(loop, event) == ("dispatched", None)
    assert redis_server.client().llen(reports) == 0


def test_events_no_worker_reports_are_listed_and_counted(loop, redis_server):
    """Reports on: an event sent long enough ago and never reported (here:
    no worker consumes its queue) is in outbox.unreported and counted;
    with reports off, or the timeout 0, nothing is."""
    loop.configure(report_timeout="1s")
    with psycopg.connect(dsn(loop)) as conn:
        lost = [enqueue(conn, "loop.ok", queue="loop_nobody") for _ in range(3)]
        ran = enqueue(conn, "loop.ok", queue="loop_solo")
    wait_status(loop, ran, "processed")
    wait_until(lambda: loop.value("SELECT count(*) FROM outbox.unreported") == 3, timeout=30,
               message="three unreported events")
    assert sorted(r[0] for r in loop.sql("SELECT id FROM outbox.unreported")) == sorted(lost)
    assert loop.metric("outbox_events_unreported") == 3
    loop.configure(report_timeout="0")
    wait_until(lambda: loop.value("SELECT count(*) FROM outbox.unreported") == 0, message="none with the timeout 0")
    loop.configure(report_timeout="1s", report_key="")
    wait_until(lambda: loop.value("SELECT count(*) FROM outbox.unreported") == 0, message="none with reports off")
    assert loop.metric("outbox_events_unreported") == 0
