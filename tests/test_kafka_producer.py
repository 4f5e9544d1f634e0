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
from kafka_rules import NOT_ENOUGH_REPLICAS, OUT_OF_ORDER_SEQUENCE_NUMBER, REQUEST_TIMED_OUT, StrictKafka
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


def reconnects(pg):
    return pg.value("SELECT coalesce(sum(value), 0) FROM outbox.metrics WHERE name = 'outbox_reconnects_total'")


def spent(pg):
    """Events that spent a retry, or went to the dead letter."""
    return pg.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0 OR status = 'failed'")


def writers(log):
    """The (producer id, epoch) pairs that wrote `log`."""
    return {(r["producer_id"], r["epoch"]) for partition in log for r in partition}


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


def kept_once_in_one_session(ob, strict, topic, ids, before):
    """Every event of `ids` dispatched and once in `topic`, in key order, no
    retry spent, no reconnect since `before` of them, one producer id and
    epoch throughout."""
    wait_until(lambda: dispatched(ob, ids) == len(ids), message="every event dispatched")
    log = strict.log(topic)
    exactly_once_in_key_order(log, ids)
    assert spent(ob) == 0
    assert reconnects(ob) == before
    assert len(writers(log)) == 1, writers(log)


def test_a_leader_that_moves_is_followed_inside_the_connection(ob, strict):
    # Two of the topic's three partitions move to node 2 mid-push (a
    # rolling restart): node 1 answers NOT_LEADER_OR_FOLLOWER, writing
    # nothing. The dispatcher asks for metadata again and sends the same
    # batches, under the same producer id, epoch and sequences, to node 2;
    # the session, its other connections and the third partition go on.
    strict.create_topic("moving", 3)
    keys, pad = several_in_flight(ob)
    before = reconnects(ob)
    strict.moves = {strict.produced + 4: {("moving", 0): 2, ("moving", 1): 2}}
    kept_once_in_one_session(ob, strict, "moving", enqueue(ob, 300, "moving", keys, pad), before)
    assert not strict.moves, "the leaders moved mid-drain"


def test_a_batch_written_and_then_refused_is_sent_again_under_its_sequence(ob, strict):
    # The leader writes two batches and answers them
    # NOT_ENOUGH_REPLICAS_AFTER_APPEND (a follower lost after the write),
    # with more of their partition's in flight behind them. Kafka's
    # producer sends such a batch again under its own sequence, and the
    # broker, which has it, answers the copy as a duplicate. Under a new
    # sequence or epoch it would be written twice.
    strict.create_topic("appended", 3)
    keys, pad = several_in_flight(ob)
    strict.appended_then_refused = {"appended": 2}
    before = reconnects(ob)
    kept_once_in_one_session(ob, strict, "appended", enqueue(ob, 300, "appended", keys, pad), before)
    assert strict.appended_then_refused == {"appended": 0}


def test_a_topic_short_of_replicas_never_slows_another(ob, strict):
    # Topic "sick" has a replica down under min.insync.replicas: every
    # batch to it is refused NOT_ENOUGH_REPLICAS for 4 s. Meanwhile one
    # event a tenth of a second goes to topic "healthy". Its events reach
    # the broker as fast as when "sick" is well, however long the
    # reconnect delay: the session is not dropped, and the sick topic's
    # events wait out of line, no retry spent, until it heals.
    strict.create_topic("sick", 3)
    strict.create_topic("healthy", 1)
    ob.configure(reconnect_delay_min="5s", reconnect_delay_max="10s")
    before = reconnects(ob)
    strict.sick = {"sick": NOT_ENOUGH_REPLICAS}
    committed = {}
    try:
        sick = enqueue(ob, 100, "sick", [f"s{i}" for i in range(20)])
        for i in range(40):
            [event] = enqueue(ob, 1, "healthy", [f"h{i}"])
            committed[event] = time.monotonic()
            time.sleep(0.1)
        wait_until(lambda: dispatched(ob, list(committed)) == 40, timeout=30, message="the healthy topic drained")
        assert dispatched(ob, sick) == 0
    finally:
        strict.sick = {}
    waits = sorted(r["at"] - committed[r["id"]] for r in strict.log("healthy")[0])
    assert len(waits) == 40 and waits[-1] < 1.5, waits
    wait_until(lambda: dispatched(ob, sick) == 100, timeout=90, message="the sick topic drained once healed")
    exactly_once_in_key_order(strict.log("sick"), sick)
    assert spent(ob) == 0
    assert reconnects(ob) == before
    # Counted once a push, never more than the broker refused.
    assert 0 < ob.metric("outbox_broker_refusals_total", condition="not_enough_replicas") <= strict.refused


def test_a_slow_acks_all_is_waited_for_and_not_written_again(ob, strict):
    # Every answer waits 2.5 s for the in-sync replicas, longer than
    # outbox.broker_timeout (1 s) and well within
    # outbox.kafka_request_timeout (30 s): the dispatcher waits for it,
    # as Kafka's producer waits request.timeout.ms, and writes nothing twice.
    strict.create_topic("slow", 3)
    ob.configure(batch_size="50", broker_timeout="1s")
    before = reconnects(ob)
    strict.ack_delay = 2.5
    try:
        ids = enqueue(ob, 100, "slow", [f"k{i}" for i in range(50)])
        wait_until(lambda: dispatched(ob, ids) == 100, timeout=60, message="every event dispatched")
    finally:
        strict.ack_delay = 0.0
    exactly_once_in_key_order(strict.log("slow"), ids)
    assert spent(ob) == 0
    assert reconnects(ob) == before


def bursts(pg, queue, count, size, pause):
    """`count` bursts of `size` events of as many keys, each dispatched and
    followed by `pause` seconds of quiet: their ids, in order."""
    ids = []
    for _ in range(count):
        ids += enqueue(pg, size, queue, [f"k{i}" for i in range(size)])
        wait_until(lambda: dispatched(pg, ids) == len(ids), timeout=30, message="the burst dispatched")
        time.sleep(pause)
    return ids


def test_connections_the_broker_closes_when_idle_lose_nothing(ob, strict):
    # The broker closes a connection that sent nothing for half a second
    # (connections.max.idle.ms): between bursts, every one the dispatcher
    # holds is gone. Each burst still arrives once, and no retry is spent.
    strict.create_topic("idle", 3)
    ob.configure(heartbeat_interval="30s")
    strict.idle = 0.5
    try:
        ids = bursts(ob, "idle", 3, 20, 1.5)
    finally:
        strict.idle = None
    exactly_once_in_key_order(strict.log("idle"), ids)
    assert spent(ob) == 0


def test_a_sasl_session_is_renewed_before_the_broker_ends_it(ob, strict):
    # The broker grants each authenticated connection a 2 s session
    # (KIP-368) and closes one used after it ends. The dispatcher replaces
    # its connections most of the way through (a new one authenticates
    # anew), so that none is used past its session: nothing is sent on a
    # connection the broker is about to close, and no reconnect is needed.
    strict.create_topic("sessions", 3)
    strict.session_ms, strict.expired = 2000, 0
    try:
        ob.configure(broker_url=strict.url.replace("kafka://", "kafka://user:secret@"),
                     kafka_sasl_mechanism="plain", kafka_sasl_plain_cleartext="on", heartbeat_interval="1s")
        ob.wait_idle()
        before = reconnects(ob)
        ids = bursts(ob, "sessions", 6, 10, 0.9)
        assert strict.expired == 0
        assert reconnects(ob) == before
    finally:
        strict.session_ms = None
    exactly_once_in_key_order(strict.log("sessions"), ids)
    assert spent(ob) == 0


def test_leaders_are_sent_to_at_once(ob, strict):
    # The topic's two partitions have two leaders, each holding a produce
    # answer half a second (acks=all). The push sends to both before it
    # awaits either, as Kafka's producer drains every node's batches at
    # once: both nodes hold a request at the same time.
    strict.create_topic("spread", 2)
    strict.leaders.update({("spread", 0): 1, ("spread", 1): 2})
    ob.configure(batch_size="40")
    strict.ack_delay, strict.overlap = 0.5, 0
    try:
        ids = enqueue(ob, 40, "spread", [f"k{i}" for i in range(40)])
        wait_until(lambda: dispatched(ob, ids) == 40, timeout=60, message="every event dispatched")
    finally:
        strict.ack_delay = 0.0
    log = strict.log("spread")
    assert all(log), "both partitions written"
    assert strict.overlap == 2
    exactly_once_in_key_order(log, ids)


def pending_why(pg, ids):
    """The last errors of those of `ids` not dispatched."""
    return {r[0] for r in pg.sql("SELECT last_error FROM outbox.events WHERE id = ANY(%s::uuid[]) "
                                 "AND status <> 'dispatched'", (ids,))}


def test_a_partition_whose_leader_is_being_elected_goes_on_once_it_has_one(ob, strict):
    # The partition's leader goes (the metadata names none, every node
    # answers NOT_LEADER_OR_FOLLOWER) and is back half a second later. The
    # dispatcher must not keep the leaderless metadata: once elected, the
    # leader gets the events within the rest, not after the metadata's
    # five minutes.
    strict.create_topic("elect", 1)
    warm = enqueue(ob, 1, "elect", ["w"])
    wait_until(lambda: dispatched(ob, warm) == 1, message="the metadata known")
    strict.leaders[("elect", 0)] = -1
    try:
        ids = enqueue(ob, 10, "elect", [f"k{i}" for i in range(10)])
        time.sleep(0.5)
    finally:
        strict.leaders[("elect", 0)] = 1
    wait_until(lambda: dispatched(ob, ids) == 10, timeout=15, message="every event dispatched")
    exactly_once_in_key_order(strict.log("elect"), warm + ids)
    assert spent(ob) == 0


def test_a_retry_that_cannot_be_answered_within_the_push_is_not_sent(ob, strict):
    # Every answer takes 2.5 s, and says REQUEST_TIMED_OUT: a retry could
    # not be answered within the push (1 s + 1 s + 2 s of
    # outbox.kafka_request_timeout). The dispatcher defers the events and
    # the partition rests, rather than sending it and timing out the whole
    # session.
    strict.create_topic("timedout", 1)
    ob.configure(broker_timeout="1s", kafka_request_timeout="2s", reconnect_delay_min="5s",
                 reconnect_delay_max="10s")
    before = reconnects(ob)
    strict.sick, strict.ack_delay = {"timedout": REQUEST_TIMED_OUT}, 2.5
    try:
        ids = enqueue(ob, 5, "timedout", [f"k{i}" for i in range(5)])
        wait_until(lambda: any("REQUEST_TIMED_OUT" in (why or "") for why in pending_why(ob, ids)),
                   timeout=20, message="the events deferred")
        assert reconnects(ob) == before
    finally:
        strict.sick, strict.ack_delay = {}, 0.0
    wait_until(lambda: dispatched(ob, ids) == 5, timeout=60, message="every event dispatched")
    exactly_once_in_key_order(strict.log("timedout"), ids)
    assert spent(ob) == 0


def test_a_partition_out_of_order_never_renumbers_another_partitions_written_batch(ob, strict):
    # In one push, topic "written" has its batch written and then refused
    # (NOT_ENOUGH_REPLICAS_AFTER_APPEND), and topic "unsequenced" answers
    # OUT_OF_ORDER_SEQUENCE_NUMBER, which needs the next epoch. Sent again
    # under the next epoch, the written batch would be written twice: it
    # goes again under its own, and the other waits for the next push.
    strict.create_topic("written", 1)
    strict.create_topic("unsequenced", 1)
    strict.appended_then_refused = {"written": 1}
    strict.sick = {"unsequenced": OUT_OF_ORDER_SEQUENCE_NUMBER}
    try:
        with ob.connect() as conn:
            ids = [str(r[0]) for r in conn.execute(
                "SELECT outbox_enqueue('t', jsonb_build_object('n', i), queue => q, ordering_key => q || i) "
                "FROM generate_series(0, 4) AS i, unnest(ARRAY['written', 'unsequenced']) AS q ORDER BY i, q")]
        written = [i for n, i in enumerate(ids) if n % 2 == 1]
        wait_until(lambda: dispatched(ob, written) == 5, timeout=30, message="the written topic dispatched")
    finally:
        strict.sick = {}
    wait_until(lambda: dispatched(ob, ids) == 10, timeout=60, message="every event dispatched")
    log = strict.log("written")
    exactly_once_in_key_order(log, written)
    assert len(writers(log)) == 1, writers(log)
    assert spent(ob) == 0


def test_a_leader_that_cannot_be_reached_never_slows_another(ob, strict):
    # The metadata names node 3 as the leader of topic "ghost", a node it
    # gives no address for. Its events wait out of line while its
    # partition rests; topic "bright" (node 1) goes at its own pace, and
    # the session is not dropped.
    strict.create_topic("ghost", 1)
    strict.create_topic("bright", 1)
    ob.configure(reconnect_delay_min="5s", reconnect_delay_max="10s")
    before = reconnects(ob)
    strict.leaders[("ghost", 0)] = 3
    committed = {}
    try:
        ghost = enqueue(ob, 20, "ghost", [f"g{i}" for i in range(20)])
        for i in range(20):
            [event] = enqueue(ob, 1, "bright", [f"b{i}"])
            committed[event] = time.monotonic()
            time.sleep(0.1)
        wait_until(lambda: dispatched(ob, list(committed)) == 20, timeout=30, message="the bright topic drained")
        assert dispatched(ob, ghost) == 0
        assert any("NETWORK_EXCEPTION" in (why or "") for why in pending_why(ob, ghost)), pending_why(ob, ghost)
    finally:
        strict.leaders[("ghost", 0)] = 1
    waits = sorted(r["at"] - committed[r["id"]] for r in strict.log("bright")[0])
    assert waits[-1] < 1.5, waits
    wait_until(lambda: dispatched(ob, ghost) == 20, timeout=90, message="the ghost topic drained once reachable")
    exactly_once_in_key_order(strict.log("ghost"), ghost)
    assert spent(ob) == 0
    assert reconnects(ob) == before


def test_a_partition_answered_twice_is_taken_as_neither(ob, strict):
    # A broken broker refuses a batch (NOT_ENOUGH_REPLICAS, nothing
    # written) and then answers the same partition again with success.
    # Taking the last word would mark events dispatched that the broker
    # never wrote.
    strict.create_topic("twice", 1)
    strict.sick = {"twice": NOT_ENOUGH_REPLICAS}
    strict.repeat = set(range(strict.produced + 1, strict.produced + 100))
    try:
        ids = enqueue(ob, 5, "twice", [f"k{i}" for i in range(5)])
        wait_until(lambda: strict.produced > min(strict.repeat) + 2 or dispatched(ob, ids), timeout=30,
                   message="answered twice")
        assert dispatched(ob, ids) == 0
    finally:
        strict.sick, strict.repeat = {}, set()
    wait_until(lambda: dispatched(ob, ids) == 5, timeout=60, message="every event dispatched")
    exactly_once_in_key_order(strict.log("twice"), ids)
    assert spent(ob) == 0


def test_a_bootstrap_connection_closed_while_idle_is_opened_again_for_a_retry(ob, strict):
    # The broker closes every connection idle for half a second, and the
    # topic's leader moves meanwhile. The push finds its leader's
    # connection closed (sent again on a new one), is refused
    # NOT_LEADER_OR_FOLLOWER, and asks for metadata on a bootstrap
    # connection the broker closed too: it is opened again, and the
    # session goes on, no reconnect.
    strict.create_topic("reopened", 1)
    warm = enqueue(ob, 1, "reopened", ["w"])
    wait_until(lambda: dispatched(ob, warm) == 1, message="the metadata known")
    ob.configure(heartbeat_interval="30s")
    strict.idle = 0.5
    try:
        time.sleep(1.5)
        strict.leaders[("reopened", 0)] = 2
        before = reconnects(ob)
        ids = enqueue(ob, 10, "reopened", [f"k{i}" for i in range(10)])
        wait_until(lambda: dispatched(ob, ids) == 10, timeout=30, message="every event dispatched")
        assert reconnects(ob) == before
    finally:
        strict.idle = None
    exactly_once_in_key_order(strict.log("reopened"), warm + ids)
    assert spent(ob) == 0


def test_a_throttled_leader_never_holds_back_another(ob, strict):
    # Node 1 asks for a minute of quiet after every answer (a quota);
    # node 2 asks for none. A push with records for both sends node 2's at
    # once and waits for nothing on node 1's account: node 1's partitions
    # rest, no session is dropped, and node 2's records are written once.
    strict.create_topic("quota1", 1)
    strict.create_topic("free2", 1)
    strict.leaders[("free2", 0)] = 2
    ob.configure(broker_timeout="1s", kafka_request_timeout="1s")
    strict.throttle_nodes = {1: 60_000}
    try:
        warm = enqueue(ob, 1, "quota1", ["w"])
        wait_until(lambda: dispatched(ob, warm) == 1, message="node 1 answered, asking for quiet")
        before = reconnects(ob)
        with ob.connect() as conn:
            free = [str(r[0]) for r in conn.execute(
                "SELECT outbox_enqueue('t', jsonb_build_object('n', i), queue => 'free2', ordering_key => 'f' || i) "
                "FROM generate_series(0, 9) AS i ORDER BY i")]
            conn.execute("SELECT outbox_enqueue('t', '{}'::jsonb, queue => 'quota1', ordering_key => 'q')")
        wait_until(lambda: dispatched(ob, free) == 10, timeout=60, message="node 2's records dispatched")
        assert reconnects(ob) == before
    finally:
        strict.throttle_nodes = {}
    exactly_once_in_key_order(strict.log("free2"), free)
    assert spent(ob) == 0
