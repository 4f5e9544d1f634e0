"""The idempotent producer against a broker that keeps Kafka's rules
(tests/kafka_rules.py: duplicates within a producer id's last five
batches dropped, gaps refused as out of order, old epochs fenced), where
tansu keeps none of them. Counted as Kafka users count: every event
exactly once in its partition, each key's events in order, no retry spent
on the broker's faults."""

import json
import time

import pytest

from harness import wait_until
from kafka_rules import StrictKafka
from standalone import installed_cluster

# The producer's rules are the sink's, the same in both hosts and on every
# PostgreSQL version: .ci/run runs these under its first version only.
pytestmark = pytest.mark.broker_only


@pytest.fixture(scope="module")
def strict():
    broker = StrictKafka()
    yield broker
    broker.close()


@pytest.fixture(scope="module")
def strict_cluster(strict, redis_server):
    with installed_cluster(redis_server.url, broker_url=strict.url, kafka_topic="{queue}",
                           reconnect_delay_min="200ms", reconnect_delay_max="1s", broker_timeout="2s") as pg:
        yield pg


@pytest.fixture
def ob(strict_cluster, strict):
    strict_cluster.reset(enabled="on", broker_url=strict.url, kafka_topic="{queue}")
    strict_cluster.empty()
    yield strict_cluster


def enqueue(pg, n, queue, keys, pad=0):
    """n events in one transaction, event i keyed keys[i % len] (`pad`
    bytes more in each payload): their ids, in order."""
    with pg.connect() as conn:
        return [str(r[0]) for r in conn.execute(
            "SELECT outbox_enqueue('t', jsonb_build_object('n', i, 'pad', repeat('x', %s)), queue => %s, "
            "ordering_key => (%s::text[])[i %% %s + 1]) FROM generate_series(0, %s - 1) AS i ORDER BY i",
            (pad, queue, keys, len(keys), n))]


def several_in_flight(pg):
    """Pushes of many keys' heads, 20 kB each, at most 64 kB a request: a
    push is some 20 requests, five in flight at a time."""
    pg.configure(batch_size="100", max_batch_bytes="64kB")
    return [f"k{i}" for i in range(60)], 20_000


def dispatched(pg, ids):
    return pg.value("SELECT count(*) FROM outbox.events WHERE id = ANY(%s::uuid[]) AND status = 'dispatched'",
                    (ids,))


def exactly_once_in_key_order(log, ids):
    """Every id of `ids` once in the broker's log, each key's in order."""
    held = [r["id"] for partition in log for r in partition]
    assert sorted(held) == sorted(ids), f"{len(held) - len(set(held))} duplicates, {len(set(ids) - set(held))} lost"
    order = {id_: i for i, id_ in enumerate(ids)}
    for partition in log:
        for key in {r["key"] for r in partition}:
            mine = [order[r["id"]] for r in partition if r["key"] == key]
            assert mine == sorted(mine), f"key {key!r} out of order"


def test_a_write_left_on_its_way_by_a_failed_push_is_fenced(ob, strict):
    # The first epoch's writes to the topic are held by the broker for 6 s:
    # longer than the push waits (its answers and one new connection's).
    # The push gives up, its events go back to pending, and the next
    # session goes under the next epoch of the same producer id; when the
    # held writes arrive, the broker refuses their epoch. A fresh producer id would have had them written:
    # every event twice, and a key's older event after its newer one.
    strict.create_topic("held", 3)
    ob.configure(batch_size="50", broker_timeout="1s", kafka_request_timeout="100ms")
    strict.hold = ("held", 6)
    try:
        keys = [f"k{i}" for i in range(9)]
        ids = enqueue(ob, 60, "held", keys)
        wait_until(lambda: dispatched(ob, ids) == 60, timeout=60, message="every event dispatched")
        wait_until(lambda: strict.fenced >= 1, timeout=30, message="the held writes refused")
        time.sleep(1)
    finally:
        strict.hold = None
    log = strict.log("held")
    exactly_once_in_key_order(log, ids)
    first_id, first_epoch = strict.held["held"]
    assert {(r["producer_id"], r["epoch"]) for partition in log for r in partition} == {(first_id, first_epoch + 1)}
    assert ob.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0") == 0


def test_a_lost_answer_is_sent_again_under_the_same_sequence_and_kept_once(ob, strict):
    # The broker writes two produce requests and loses their answers (the
    # connection closes instead), the first with four more in flight behind
    # it. The dispatcher sends what went unanswered again, byte for byte,
    # under the same producer id, epoch and sequences: the broker drops the
    # copies of what it has, and writes what it had not read, in order.
    strict.create_topic("lost", 3)
    keys, pad = several_in_flight(ob)
    strict.lose, strict.answers_lost = {strict.produced + 3, strict.produced + 12}, 0
    ids = enqueue(ob, 300, "lost", keys, pad)
    wait_until(lambda: dispatched(ob, ids) == 300, message="every event dispatched")
    assert strict.answers_lost == 2
    log = strict.log("lost")
    exactly_once_in_key_order(log, ids)
    assert ob.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0") == 0
    # One producer id throughout: a fresh one would make every copy new.
    assert len({r["producer_id"] for partition in log for r in partition}) == 1
    assert json.loads(ob.value("SELECT payload::text FROM outbox.events WHERE id = %s", (ids[-1],)))["n"] == 299


def test_an_answer_that_leaves_out_a_partition_never_leaves_a_stale_value(ob, strict):
    # A broken broker writes a request and answers it without one of its
    # partitions. Whether that batch was written is not known: its events,
    # and the partition's behind it in the push, go back to pending and
    # come again under the next epoch, none marked before its answer. So a
    # key's records may come twice, but the last of each key (what a
    # compacted topic keeps) is its last event, in order.
    strict.create_topic("omitted", 3)
    keys, pad = several_in_flight(ob)
    strict.omit = {strict.produced + 2}
    try:
        ids = enqueue(ob, 300, "omitted", keys, pad)
        wait_until(lambda: dispatched(ob, ids) == 300, message="every event dispatched")
    finally:
        strict.omit = set()
    log = strict.log("omitted")
    assert {r["id"] for partition in log for r in partition} == set(ids)
    order = {id_: i for i, id_ in enumerate(ids)}
    for partition in log:
        last = {}
        for r in partition:
            last[r["key"]] = order[r["id"]]
        for key, n in last.items():
            assert n == max(order[i] for i in ids if keys[order[i] % len(keys)] == key.decode()), key
    assert ob.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0") == 0
    assert ob.metric("outbox_reconnects_total", reason="connection_lost") >= 1


def test_a_throttled_connection_sends_nothing_until_the_throttle_is_over(ob, strict):
    # A quota: every produce answer asks for 300 ms of quiet on its
    # connection (throttle_time_ms). Nothing is sent on it before then,
    # and nothing is lost or spends a retry meanwhile.
    strict.create_topic("quota", 1)
    ob.configure(batch_size="10")
    strict.throttle_ms, strict.early = 300, 0
    try:
        ids = enqueue(ob, 20, "quota", ["k"])
        wait_until(lambda: dispatched(ob, ids) == 20, timeout=60, message="every event dispatched")
    finally:
        strict.throttle_ms = 0
    assert strict.early == 0
    exactly_once_in_key_order(strict.log("quota"), ids)
    assert ob.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0") == 0
