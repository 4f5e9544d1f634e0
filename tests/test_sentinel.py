"""High availability: Redis under Sentinel (kombu's sentinel:// URLs), a
failover while 20,000 events drain (SENTINEL FAILOVER, then the master
killed), and kombu's key options (global_keyprefix, priority_steps, sep)
with a stock Celery worker configured the same way."""

import json
import shutil
import signal
import tempfile
from pathlib import Path

import psycopg
import pytest

from harness import CeleryWorker, Cluster, SentinelGroup, decode, drain_held, wait_until
from outbox_dispatch import enqueue

# Failovers are the broker's side alone: .ci/run runs them under its first
# PostgreSQL version only.
pytestmark = pytest.mark.broker_only

EVENTS = 20_000
QUEUE = "q_ha"


@pytest.fixture
def group():
    sentinels = SentinelGroup()
    yield sentinels
    sentinels.close()


def ha_cluster(group, **settings):
    """A cluster on the sentinels with outbox.redis_wait_replicas as it
    comes: its default waits for a replica with a sentinel:// URL."""
    return Cluster(group.url, redis_sentinel_master=group.name,
                   reconnect_delay_min="100ms", reconnect_delay_max="1s", batch_size=500, enabled="off",
                   **settings)


def ids_in(client, key):
    return [decode(m)[0]["headers"]["id"] for m in client.lrange(key, 0, -1)]


def drain_through(pg, group, failure, aftermath=lambda: None):
    """Enqueues EVENTS, lets them drain, runs `failure` once a tenth are
    in Redis, the drain held there (harness.drain_held), then `aftermath`
    as it goes on; returns the event ids."""
    pg.sql("CREATE EXTENSION outbox_dispatch")
    events = {str(r[0]) for r in pg.sql(
        f"SELECT outbox_enqueue('ha', '{{}}', queue => '{QUEUE}') FROM generate_series(1, {EVENTS})")}
    # Read in Redis, not counted through outbox.events, whose status is
    # derived row by row: the count would come after the drain.
    with drain_held(pg, until=lambda: group.master_client().llen(QUEUE) >= EVENTS // 10,
                    begin=lambda: pg.configure(enabled="on")):
        failure()
    aftermath()
    wait_until(lambda: pg.count("dispatched") == EVENTS, timeout=180,
               message=f"every event dispatched ({pg.sql('SELECT status, count(*) FROM outbox.events GROUP BY 1')}, "
                       f"{pg.sql('SELECT state, last_error FROM outbox.workers')})")
    return events


def check_nothing_lost(pg, group, events):
    assert pg.count("failed") == 0 and pg.metric("outbox_dead_letters_total") == 0
    queued = ids_in(group.master_client(), QUEUE)
    missing, unknown = len(events - set(queued)), len(set(queued) - events)
    assert (missing, unknown) == (0, 0), \
        f"{missing} events missing from the new master, {unknown} not ours; the sentinels:\n{group.events()}"
    # Duplicates only from the batch in flight when the master changed (a
    # master short of replicas is not pushed to at all).
    assert len(queued) - len(events) <= 500, len(queued) - len(events)
    assert pg.metric("outbox_broker_master_changes_total") >= 1
    assert pg.metric("outbox_broker_unavailable_seconds_total") > 0
    assert "the Redis master moved from" in pg.log_text()


def test_a_sentinel_failover_loses_nothing_and_fails_nothing(group):
    pg = ha_cluster(group)
    try:
        old = group.master_port()
        events = drain_through(pg, group, lambda: group.sentinel_client().execute_command(
            "SENTINEL", "FAILOVER", group.name))
        assert group.master_port() != old
        check_nothing_lost(pg, group, events)
        # The old master turned replica: READONLY (reason failover), or the
        # replicas' confirmation missing (refused, condition noreplicas).
        reasons = dict(pg.sql("SELECT labels->>'reason', value FROM outbox.metrics "
                              "WHERE name = 'outbox_reconnects_total' AND value > 0"))
        assert set(reasons) <= {"failover", "refused", "connection_lost"}, reasons
        assert sum(reasons.values()) >= 1, reasons
    finally:
        pg.close()


def test_a_killed_master_loses_nothing_and_fails_nothing(group):
    pg = ha_cluster(group)
    try:
        old = group.master

        def kill():
            old.proc.send_signal(signal.SIGKILL)
            old.proc.wait()
            old.proc = None

        def restart():
            wait_until(lambda: all(group.master_port(i) != old.port for i in range(3)), timeout=60,
                       message="the sentinels' failover")
            # The old server comes back (with its data: see SentinelGroup) and
            # the sentinels make it the new master's replica: WAIT is met again.
            old.start()

        events = drain_through(pg, group, kill, restart)
        check_nothing_lost(pg, group, events)
    finally:
        pg.close()


def test_a_celery_worker_with_the_same_options_executes_the_events(group):
    options = {"master_name": group.name, "global_keyprefix": "app1:", "priority_steps": list(range(10)),
               "sep": ":"}
    pg = ha_cluster(group, redis_key_prefix="app1:", priority_steps="0,1,2,3,4,5,6,7,8,9",
                    priority_separator=":")
    worker = CeleryWorker(group.url, queues=("q_ha_celery",), app="loop_app", env={
        "OUTBOX_TEST_TRANSPORT_OPTIONS": json.dumps(options),
        "OUTBOX_TEST_NOTES": f"redis://127.0.0.1:{group.master_port()}/0"})
    try:
        worker.wait_ready()
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.configure(enabled="on")
        with psycopg.connect(host=str(pg.dir), port=pg.port, user="postgres", dbname="postgres") as conn:
            events = [enqueue(conn, "loop.ok", args=(p,), queue="q_ha_celery", priority=p) for p in range(10)]
        for event in events:
            wait_until(lambda: pg.value("SELECT status::text FROM outbox.events WHERE id = %s", (event,))
                       == "processed", timeout=60, message=f"{event} processed through the prefixed lists")
        # They went through the lists the options name, reports included.
        assert pg.metric("outbox_acked_total", source="celery") == 10
        assert group.master_client().exists("app1:_kombu.binding.q_ha_celery")
    finally:
        worker.close()
        pg.close()


def test_passwords_for_the_master_and_for_the_sentinels():
    protected = SentinelGroup(password="m4ster", sentinel_password="s3ntinel")
    secrets = Path(tempfile.mkdtemp(prefix="outbox-secrets-"))
    secrets.chmod(0o755)  # the dispatchers run as postgres
    sentinel_password = secrets / "sentinel-password"
    sentinel_password.write_text("wrong\n")
    sentinel_password.chmod(0o644)
    # The URL's password is the master's, as in kombu.
    url = protected.url.replace("sentinel://", "sentinel://:m4ster@", 1)
    pg = Cluster(url, redis_sentinel_master=protected.name, redis_sentinel_password_file=str(sentinel_password),
                 reconnect_delay_min="100ms", reconnect_delay_max="500ms")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        wait_until(lambda: "no sentinel named the master" in (pg.value("SELECT last_error FROM outbox.workers") or ""),
                   message="the sentinels refusing the wrong password")
        assert "m4ster" not in pg.log_text() and "s3ntinel" not in pg.log_text()
        sentinel_password.write_text("s3ntinel\n")
        event = pg.value("SELECT outbox_enqueue('ha', '{}', queue => 'q_protected')")
        wait_until(lambda: ids_in(protected.master_client(), "q_protected") == [str(event)],
                   message="delivery through password-protected sentinels to a protected master")
        assert pg.value("SELECT last_error FROM outbox.workers") is None
    finally:
        pg.close()
        protected.close()
        shutil.rmtree(secrets, ignore_errors=True)
