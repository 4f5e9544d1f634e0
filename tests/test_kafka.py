"""Kafka as the broker (outbox.broker_url = kafka://…): a real
Kafka-protocol broker on loopback (tansu), read back with kafka-python,
and counted as the other brokers are: every committed event reaches its
topic at least once (exactly once without a fault), a rolled-back one
never does, and the broker's faults never spend a retry.

Hostile cases first: a template that names no topic, a peer that is not
Kafka, a topic that does not exist, an event that makes a bad name, then
the broker killed, frozen and restarted mid-drain, then the happy path."""

import json
import os
import shutil
import signal
import struct
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import psycopg
import pytest
from kafka.partitioner.default import murmur2

from harness import Kafka, Listener, TlsTerminator, drain_held, free_port, make_tls_files, wait_until
from standalone import HOST, installed_cluster, new_cluster

# Kafka's protocol and its faults are the broker's side (the claim and the
# mark are the ones every sink uses, tested on each PostgreSQL version):
# .ci/run runs these under its first PostgreSQL version only.
pytestmark = pytest.mark.broker_only


@pytest.fixture(scope="module")
def kafka():
    broker = Kafka()
    yield broker
    broker.close()


@pytest.fixture(scope="module")
def kafka_cluster(kafka, redis_server):
    with installed_cluster(redis_server.url, broker_url=kafka.url, kafka_topic="{queue}",
                           reconnect_delay_min="200ms", reconnect_delay_max="1s", broker_timeout="3s",
                           heartbeat_interval="1s") as pg:
        yield pg


@pytest.fixture
def ob(kafka_cluster, kafka):
    kafka_cluster.reset(enabled="on", broker_url=kafka.url, kafka_topic="{queue}")
    kafka_cluster.empty()
    yield kafka_cluster


def topic(kafka, name, partitions=3):
    """A fresh topic (each test its own: the broker keeps them)."""
    name = f"{name}-{os.urandom(3).hex()}"
    kafka.create_topic(name, partitions)
    return name


def enqueue(pg, n, queue, event_type="test.event", keys=None, rollback=False):
    """Enqueues n events in one transaction (keyed by `keys[i % len]`); their ids."""
    with pg.connect(autocommit=False) as conn:
        ids = []
        for i in range(n):
            key = keys[i % len(keys)] if keys else None
            ids.append(str(conn.execute(
                "SELECT outbox_enqueue(%s, jsonb_build_object('n', %s::int), queue => %s, ordering_key => %s, "
                "headers => %s)", (event_type, i, queue, key, json.dumps({"traceparent": f"00-{i:032x}-01"}))
            ).fetchone()[0]))
        conn.rollback() if rollback else conn.commit()
    return ids


def last_error(pg):
    return pg.value("SELECT string_agg(last_error, ' | ') FROM outbox.workers") or ""


def statuses(pg, ids):
    return Counter(r[0] for r in pg.sql("SELECT status::text FROM outbox.events WHERE id = ANY(%s::uuid[])", (ids,)))


def test_a_template_that_names_no_topic_is_refused_and_nothing_moves(ob, kafka):
    ob.configure(kafka_topic="orders/{event_type}")
    ids = enqueue(ob, 3, "celery")
    wait_until(lambda: "outbox.kafka_topic" in last_error(ob), message="the template refused")
    assert "'/'" in last_error(ob)
    time.sleep(1)
    assert statuses(ob, ids) == {"pending": 3}
    ob.configure(kafka_topic="{queue}")
    name = topic(kafka, "after")
    ob.sql("UPDATE outbox.log SET queue = %s", (name,))
    wait_until(lambda: statuses(ob, ids) == {"dispatched": 3}, message="the events once the template is fixed")
    assert sorted(kafka.ids(name)) == sorted(ids)


class GarbagePeer:
    """Answers every connection with `reply` (bytes), then streams `tail`
    forever (`pause` seconds apart), counting what it sent."""

    def __init__(self, reply, tail=b"", pause=0.0):
        self.reply, self.tail, self.pause, self.sent = reply, tail, pause, 0
        self.listener = Listener(self._talk)
        self.port = self.listener.port

    def _talk(self, conn):
        try:
            conn.recv(65536)
            conn.sendall(self.reply)
            self.sent += len(self.reply)
            while self.tail and not self.listener.closed.is_set():
                conn.sendall(self.tail)
                self.sent += len(self.tail)
                time.sleep(self.pause)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.listener.close()


def dispatcher_pid(pg):
    """The process that dispatches: the background worker, or the sidecar."""
    if HOST == "sidecar":
        return pg.sidecar.proc.pid
    [pid] = pg.dispatcher_pids()
    return pid


def gone(pid):
    """Whether process `pid` exited (a zombie, its parent yet to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def dispatcher_rss_kb(pg):
    pid = dispatcher_pid(pg)
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_a_garbage_peer_costs_bounded_memory_and_a_prompt_shutdown(ob, kafka):
    # An ApiVersions answer (correlation 0, no error) whose list of APIs
    # claims two billion entries: the codec as published would size one
    # allocation by it and abort the server.
    impossible = struct.pack(">iihi", 10, 0, 0, 2**31 - 1)
    # A frame announced as 2 GB, then bytes forever.
    endless = struct.pack(">i", 2**31 - 1)
    ids = None
    for reply, tail, why in [(impossible, b"", "exceeds"), (endless, b"\x00" * 65536, "at most"),
                             (b"HTTP/1.1 400 Bad Request\r\n\r\n" * 100, b"", "Kafka protocol error")]:
        peer = GarbagePeer(reply, tail)
        try:
            ob.configure(broker_url=f"kafka://127.0.0.1:{peer.port}")
            ids = ids or enqueue(ob, 2, "celery")
            wait_until(lambda: why in last_error(ob), message=f"the garbage refused ({why})", seen=lambda: last_error(ob))
            assert dispatcher_rss_kb(ob) < 200_000
            assert statuses(ob, ids) == {"pending": 2}
        finally:
            peer.close()
    assert ob.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0") == 0
    # A dispatcher reading from the peer, its deadline a minute away, stops
    # at once when asked (SIGTERM).
    peer = GarbagePeer(struct.pack(">i", 1_000_000), b"\x00", pause=0.01)
    try:
        ob.configure(broker_url=f"kafka://127.0.0.1:{peer.port}", broker_timeout="60s")
        wait_until(lambda: peer.sent > 200, message="the drip under way")
        pid = dispatcher_pid(ob)
        started = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: gone(pid), timeout=30, message="the dispatcher gone")
        # The sidecar lets a broker operation in flight finish for 5 s
        # (sidecar/src/host.rs, STOP_DRAIN: a push whose answers come is
        # marked), then abandons it.
        assert time.monotonic() - started < (5 if HOST == "library" else 7)
    finally:
        peer.close()


def test_zstd_is_refused_by_name_where_the_broker_predates_it(ob, kafka):
    # A broker whose Produce stops at version 6 (Kafka 2.0) refuses zstd
    # batches (KIP-110). The setting is refused before a record goes, the
    # error naming it; no event moves or spends a retry.
    ranges = [(0, 3, 6), (3, 0, 7), (22, 0, 1)]
    body = struct.pack(">ihi", 0, 0, len(ranges)) + b"".join(struct.pack(">hhh", *r) for r in ranges)
    peer = GarbagePeer(struct.pack(">i", len(body)) + body)
    try:
        ob.configure(broker_url=f"kafka://127.0.0.1:{peer.port}", kafka_compression="zstd")
        ids = enqueue(ob, 3, "celery")
        wait_until(lambda: "outbox.kafka_compression = zstd" in last_error(ob), message="zstd refused",
                   seen=lambda: last_error(ob))
        assert "up to version 6" in last_error(ob)
        # lz4 is older than any Produce this client speaks: the same broker
        # is taken on (and then found mute).
        ob.configure(kafka_compression="lz4")
        wait_until(lambda: last_error(ob) and "kafka_compression" not in last_error(ob),
                   message="lz4 taken on", seen=lambda: last_error(ob))
        assert statuses(ob, ids) == {"pending": 3}
        assert ob.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0") == 0
    finally:
        peer.close()


@pytest.mark.parametrize("codec,code", [("lz4", 3), ("zstd", 4)])
def test_batches_go_compressed_as_outbox_kafka_compression_says(ob, kafka, codec, code):
    ob.configure(kafka_compression=codec, batch_size="100")
    name = topic(kafka, codec)
    keys = [f"k{i}" for i in range(7)]
    ids = enqueue(ob, 300, name, keys=keys)
    wait_until(lambda: statuses(ob, ids) == {"dispatched": 300}, message=f"the {codec} drain")
    records = kafka.records(name)
    assert sorted(r["headers"]["id"].decode() for r in records) == sorted(ids)
    by_key = defaultdict(list)
    for r in sorted(records, key=lambda r: (r["partition"], r["offset"])):
        by_key[r["key"]].append(json.loads(r["value"])["n"])
    assert all(ns == sorted(ns) for ns in by_key.values()) and len(by_key) == len(keys)
    codecs = kafka.codecs(name, 3)
    assert codecs and set(codecs) == {code}, codecs
    assert ob.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0") == 0


def test_an_unknown_topic_is_its_events_fault_and_others_flow(ob, kafka):
    ob.configure(max_retries="2", retry_backoff="100ms")
    good = topic(kafka, "good")
    lost = enqueue(ob, 4, "no-such-topic-here")
    kept = enqueue(ob, 20, good)
    wait_until(lambda: statuses(ob, kept) == {"dispatched": 20}, message="the other topic's events")
    wait_until(lambda: statuses(ob, lost) == {"failed": 4}, message="the unknown topic's events dead-lettered")
    errors = {r[0] for r in ob.sql("SELECT last_error FROM outbox.events WHERE id = ANY(%s::uuid[])", (lost,))}
    assert all("UNKNOWN_TOPIC_OR_PARTITION" in e and "no-such-topic-here" in e for e in errors), errors
    assert sorted(kafka.ids(good)) == sorted(kept)


def test_an_event_that_makes_a_bad_topic_name_fails_alone(ob, kafka):
    ob.configure(kafka_topic="{event_type}")
    good = topic(kafka, "typed")
    bad = enqueue(ob, 2, "celery", event_type="order:paid")
    fine = enqueue(ob, 5, "celery", event_type=good)
    wait_until(lambda: statuses(ob, fine) == {"dispatched": 5}, message="the good events")
    wait_until(lambda: statuses(ob, bad) == {"failed": 2}, message="the bad ones failed at once")
    error = ob.value("SELECT last_error FROM outbox.events WHERE id = %s", (bad[0],))
    assert "INVALID_TOPIC_EXCEPTION" in error and "order:paid" in error
    assert ob.value("SELECT max(retry_count) FROM outbox.events WHERE id = ANY(%s::uuid[])", (bad,)) <= 1


def test_a_frozen_broker_spends_no_retry_and_loses_nothing(ob, kafka):
    ob.configure(broker_timeout="1s", batch_size="50")
    name = topic(kafka, "frozen")
    stop = threading.Event()

    def produce():
        with ob.connect() as conn:
            while not stop.is_set():
                conn.execute("SELECT outbox_enqueue('f', '{}', queue => %s) FROM generate_series(1, 10)", (name,))
                time.sleep(0.02)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        wait_until(lambda: ob.count("dispatched") >= 100, message="events flowing")
        kafka.freeze()
        try:
            wait_until(lambda: ob.metric("outbox_reconnects_total", reason="timeout") >= 1, timeout=60,
                       message="the dispatcher to time out")
            time.sleep(2)
        finally:
            kafka.freeze(False)
        wait_until(lambda: ob.value("SELECT bool_and(connected) FROM outbox.workers"), timeout=60,
                   message="the reconnect")
    finally:
        stop.set()
        producer.join()
    total = ob.value("SELECT count(*) FROM outbox.events")
    wait_until(lambda: ob.count("dispatched") == total, timeout=120, message="the backlog delivered")
    assert ob.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0 OR status = 'failed'") == 0
    seen = Counter(kafka.ids(name))
    assert set(seen) == {str(r[0]) for r in ob.sql("SELECT id FROM outbox.events")}
    # A frozen broker's late answers are not lost: only what was in flight
    # when the connection was given up may come twice.
    assert sum(seen.values()) - len(seen) <= 100


def test_a_broker_killed_and_restarted_mid_drain_marks_only_what_it_acknowledged(ob, kafka):
    ob.configure(enabled="off", batch_size="2")
    name = f"restart-{os.urandom(3).hex()}"
    kafka.create_topic(name, 3)
    with ob.connect() as conn:
        conn.execute("SELECT outbox_enqueue('r', jsonb_build_object('n', g), queue => %s) "
                     "FROM generate_series(1, 10000) g", (name,))
    # Killed while a pushed batch's mark waits, 40 events or more marked.
    with drain_held(ob, until=lambda: ob.count("dispatched") >= 40, begin=lambda: ob.configure(enabled="on")):
        kafka.kill()
    try:
        # The dispatchers wait while the broker comes back without the
        # topic (memory storage), which would otherwise be their events'
        # own fault for a moment: a topic that does not exist.
        ob.configure(enabled="off")
        wait_until(lambda: ob.value("SELECT bool_and(state = 'paused') FROM outbox.workers"),
                   message="the dispatchers paused")
        # What the killed broker acknowledged: marked since, as the mark
        # held at the kill was; nothing after it.
        acknowledged_before = {str(r[0]) for r in ob.sql("SELECT id FROM outbox.events WHERE status = 'dispatched'")}
    finally:
        kafka.start()
    assert len(acknowledged_before) < 10000
    kafka.create_topic(name, 3)
    ob.configure(enabled="on")
    wait_until(lambda: ob.count("dispatched") == 10000, timeout=180, message="every event after the restart")
    assert ob.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0 OR status = 'failed'") == 0
    # The restarted broker holds every event not acknowledged before the
    # kill (its memory lost the others): none was marked without an answer.
    after = set(kafka.ids(name))
    everything = {str(r[0]) for r in ob.sql("SELECT id FROM outbox.events")}
    assert everything - acknowledged_before <= after


def test_dispatchers_killed_mid_drain_lose_nothing_and_keep_key_order(ob, kafka):
    ob.configure(enabled="off", batch_size="20")
    name = topic(kafka, "killed", partitions=2)
    keys = [f"k{k}" for k in range(40)]
    with ob.connect(autocommit=False) as conn:
        for start in range(0, 4000, 500):
            conn.execute("SELECT outbox_enqueue('k', jsonb_build_object('n', g), queue => %s, "
                         "ordering_key => 'k' || (g %% 40)) FROM generate_series(%s::int, %s::int) g",
                         (name, start, start + 499))
            conn.commit()
    # Killed while a pushed batch's mark waits, 400 events or more marked.
    with drain_held(ob, until=lambda: ob.count("dispatched") >= 400, begin=lambda: ob.configure(enabled="on")):
        if HOST == "sidecar":
            ob.sidecar.proc.kill()
            ob.sidecar.proc.wait()
        else:
            # The server takes a killed worker for a crash: it restarts
            # (and ends the session that held the drain).
            [pid] = ob.dispatcher_pids()
            os.kill(pid, signal.SIGKILL)
    if HOST == "sidecar":
        ob.configure(workers=2)

    def dispatched():
        try:
            return ob.count("dispatched")
        except psycopg.OperationalError:
            return None
    wait_until(lambda: dispatched() == 4000, timeout=180, message="every event after the kill")
    assert ob.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0 OR status = 'failed'") == 0
    seq = {str(r[0]): (r[1], r[2]) for r in ob.sql("SELECT id, ordering_key, key_seq FROM outbox.events")}
    first = {}
    for record in sorted(kafka.records(name), key=lambda r: (r["partition"], r["offset"])):
        first.setdefault(record["headers"]["id"].decode(), (record["partition"], record["offset"]))
    assert set(first) == set(seq)
    for key in keys:
        mine = sorted((first[i], s) for i, (k, s) in seq.items() if k == key)
        assert [s for _, s in mine] == sorted(s for _, s in mine), f"{key} out of order on first delivery"


# A key's bytes as a Debezium connector's key converter writes them:
# StringConverter's, and JsonConverter's without schemas.
KEY_FORMS = {"string": str.encode, "json": lambda key: json.dumps(key).encode()}


@pytest.mark.parametrize("key_format", sorted(KEY_FORMS))
def test_every_committed_event_once_with_debeziums_shape_in_key_order(ob, kafka, key_format):
    ob.configure(kafka_key_format=key_format)
    name = topic(kafka, "orders", partitions=4)
    keys = [f"order-{k}" for k in range(6)]
    keyed = enqueue(ob, 300, name, keys=keys)
    plain = enqueue(ob, 50, name)
    rolled_back = enqueue(ob, 10, name, rollback=True)
    wait_until(lambda: ob.count("dispatched") == 350, timeout=120, message="every committed event")
    records = kafka.records(name)
    by_id = {r["headers"]["id"].decode(): r for r in records}
    assert len(records) == len(by_id) == 350
    assert set(by_id) == set(keyed) | set(plain) and not set(rolled_back) & set(by_id)
    rows = {str(r[0]): r[1:] for r in ob.sql("SELECT id, ordering_key, event_type, payload::text, key_seq "
                                             "FROM outbox.events")}
    offsets = defaultdict(list)
    for id_, record in by_id.items():
        key, event_type, payload, seq = rows[id_]
        assert record["key"] == KEY_FORMS[key_format](key or id_)
        assert json.loads(record["value"]) == json.loads(payload)
        assert record["headers"]["eventType"] == event_type.encode()
        assert record["headers"]["traceparent"].startswith(b"00-")
        # Where Kafka's own default partitioner (kafka-python's, as Java's)
        # puts the key: the partition a Debezium producer of it chooses.
        assert record["partition"] == (murmur2(record["key"]) & 0x7FFFFFFF) % 4
        if key:
            offsets[key].append((record["offset"], seq))
    for key, placed in offsets.items():
        assert [seq for _, seq in sorted(placed)] == sorted(seq for _, seq in placed), f"{key} out of order"
    assert ob.metric("outbox_dispatched_total") >= 350


def test_with_acknowledgements_a_keys_next_event_waits_for_its_heads(ob, kafka):
    # Reports are off with Kafka; acknowledgements are not: a key's head
    # holds the key until a consumer acknowledges it (outbox_ack()).
    ob.configure(ack_timeout="1h")
    name = topic(kafka, "acked", partitions=1)
    ids = enqueue(ob, 3, name, keys=["order-7"])
    wait_until(lambda: kafka.ids(name) == ids[:1], message="the head sent")
    time.sleep(1)
    assert kafka.ids(name) == ids[:1], "the next event went before its head was acknowledged"
    for n in (1, 2):
        assert ob.value("SELECT outbox_ack(%s)", (ids[n - 1],))
        wait_until(lambda n=n: kafka.ids(name) == ids[:n + 1], message=f"event {n + 1} after the ack")
    assert ob.value("SELECT outbox_ack(%s)", (ids[2],))
    wait_until(lambda: statuses(ob, ids) == {"processed": 3}, message="every event acknowledged")


def test_a_tombstone_when_asked(ob, kafka):
    name = topic(kafka, "compacted", partitions=1)
    ob.configure(kafka_tombstones="on")
    with ob.connect() as conn:
        conn.execute("SELECT outbox_enqueue('gone', 'null'::jsonb, queue => %s, ordering_key => 'user-1')", (name,))
        conn.execute("SELECT outbox_enqueue('kept', 'null'::jsonb, queue => %s)", (name,))
    wait_until(lambda: ob.count("dispatched") == 2, message="both sent")
    values = {r["headers"]["eventType"]: r["value"] for r in kafka.records(name)}
    assert values == {b"gone": None, b"kept": b"null"}


def test_a_subscriptions_deliveries_carry_the_events_own_id(ob, kafka):
    # A plain subscription's deliveries are one event: each record says so
    # in `id` (what consumers dedupe on), whose delivery it is in
    # outbox_subscription_id, and its own id (outbox_ack's) beside them.
    fanned = topic(kafka, "fanned")
    subs = [ob.value("SELECT outbox_subscribe('kafka.fanned', %s, queue => %s)", (task, fanned))
            for task in ("billing", "search")]
    try:
        event = ob.value("SELECT outbox_enqueue('kafka.fanned', '{\"order\": 7}')")
        deliveries = dict(ob.sql("SELECT subscription_id, delivery_id FROM outbox.deliveries WHERE event_id = %s",
                                 (event,)))
        wait_until(lambda: len(kafka.records(fanned)) == 2, message="both deliveries")
        records = kafka.records(fanned)
        assert [r["headers"]["id"].decode() for r in records] == [str(event)] * 2
        assert sorted(int(r["headers"]["outbox_subscription_id"]) for r in records) == sorted(subs)
        for record in records:
            subscription = int(record["headers"]["outbox_subscription_id"])
            assert record["headers"]["outbox_delivery_id"].decode() == str(deliveries[subscription])
            assert json.loads(record["value"]) == {"order": 7}
    finally:
        for sub in subs:
            ob.sql("SELECT outbox_unsubscribe(%s)", (sub,))


def test_an_accumulated_subscriptions_batch_is_a_record_of_its_members(ob, kafka):
    batched = topic(kafka, "batched")
    digest = ob.value("SELECT outbox_subscribe('kafka.batched', 'digest', queue => %s, batch_max => 3)", (batched,))
    try:
        members = [ob.value("SELECT outbox_enqueue('kafka.batched', jsonb_build_object('n', %s::int))", (n,))
                   for n in range(3)]
        wait_until(lambda: len(kafka.records(batched)) == 1, message="the batch")
        [batch] = kafka.records(batched)
        value = json.loads(batch["value"])
        assert value != {}, "the batch went out without its members"
        assert [m["id"] for m in value] == [str(m) for m in members]
        assert [m["payload"] for m in value] == [{"n": n} for n in range(3)]
        assert {m["event_type"] for m in value} == {"kafka.batched"}
        assert int(batch["headers"]["outbox_subscription_id"]) == digest
        assert batch["headers"]["id"].decode() == str(ob.value(
            "SELECT DISTINCT delivery_id FROM outbox.deliveries WHERE subscription_id = %s", (digest,)))
    finally:
        ob.sql("SELECT outbox_unsubscribe(%s)", (digest,))


@pytest.mark.parametrize("mechanism", [None, "scram-sha-256", "plain"])
def test_sasl_is_spoken_and_a_refusal_is_clear(redis_server, mechanism):
    # tansu 0.6 with --authentication takes no user: its own `user create`
    # must authenticate first, and its memory storage forgets users made
    # before. So every login here is refused; that it is refused for the
    # credentials (not the protocol) is what this shows, with the SCRAM
    # exchange itself checked against RFC 7677's (core, sink::kafka::sasl).
    # No mechanism named: SCRAM-SHA-512. PLAIN over kafka:// would send the
    # password in clear text: refused unless a setting allows it.
    broker = Kafka(authentication=True)
    pg, directory = None, None
    try:
        directory = Path(tempfile.mkdtemp(prefix="outbox-kafka-"))
        directory.chmod(0o755)
        secret = directory / "password"
        secret.write_text("Wr0ng-pw\n")
        secret.chmod(0o644)
        chosen = {"kafka_sasl_mechanism": mechanism} if mechanism else {}
        pg = new_cluster(redis_server.url, broker_url=f"kafka://outbox@{broker.address}", kafka_topic="{queue}",
                         broker_password_file=str(secret), reconnect_delay_min="200ms", reconnect_delay_max="1s",
                         **chosen)
        pg.install()
        ids = enqueue(pg, 5, "secured")
        if mechanism == "plain":
            wait_until(lambda: "outbox.kafka_sasl_plain_cleartext" in last_error(pg),
                       message="PLAIN in clear text refused", seen=lambda: last_error(pg))
            assert "clear text" in last_error(pg)
            pg.configure(kafka_sasl_plain_cleartext="on")
        # tansu answers a SCRAM login of an unknown user at its last step
        # (e=unknown-user), and hangs up on PLAIN.
        refused = "cannot connect to the broker" if mechanism == "plain" else "refused the SCRAM authentication"
        wait_until(lambda: refused in last_error(pg), message="the refusal shown", seen=lambda: last_error(pg))
        assert "Wr0ng-pw" not in last_error(pg) and "Wr0ng-pw" not in pg.log_text()
        time.sleep(1)
        assert statuses(pg, ids) == {"pending": 5}
        assert pg.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0") == 0
    finally:
        if pg:
            pg.close()
        broker.close()
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def test_kafkas_presents_the_client_certificate_asked_for(redis_server):
    # tansu serves no TLS handshake, let alone asks for a client's
    # certificate: a TLS terminator that requires one (as Aiven, Strimzi's
    # `tls` authentication and MSK's mTLS do) stands in front of it, and
    # tansu advertises the terminator as its address.
    tls = make_tls_files()
    terminator = TlsTerminator(tls, target_port=free_port())
    broker = Kafka(advertised_port=terminator.port)
    terminator.target_port = broker.port
    pg = None
    try:
        name = f"mtls-{os.urandom(3).hex()}"
        broker.create_topic(name, 2)
        pg = new_cluster(redis_server.url, broker_url=f"kafkas://127.0.0.1:{terminator.port}",
                         broker_tls_ca_file=str(tls / "ca.pem"), kafka_topic="{queue}",
                         reconnect_delay_min="200ms", reconnect_delay_max="1s")
        pg.install()
        ids = enqueue(pg, 5, name)
        wait_until(lambda: terminator.refused >= 1 and "cannot connect" in last_error(pg),
                   message="no certificate, no connection", seen=lambda: last_error(pg))
        assert statuses(pg, ids) == {"pending": 5}
        pg.configure(broker_tls_cert_file=str(tls / "client.pem"))
        wait_until(lambda: "outbox.broker_tls_key_file" in last_error(pg), message="a certificate without its key",
                   seen=lambda: last_error(pg))
        pg.configure(broker_tls_key_file=str(tls / "client.key"))
        wait_until(lambda: statuses(pg, ids) == {"dispatched": 5}, message="delivered with the certificate",
                   seen=lambda: last_error(pg))
        assert pg.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0") == 0
    finally:
        if pg:
            pg.close()
        broker.close()
        terminator.close()
        shutil.rmtree(tls, ignore_errors=True)


def test_a_slow_acks_all_is_waited_for_as_kafka_request_timeout_says(ob, kafka):
    # Replicas slow to confirm (acks=all) hold the answer: the broker may
    # take outbox.kafka_request_timeout, whatever outbox.broker_timeout is.
    # The broker frozen for 4 s after a produce request went stands for
    # them: the answer then comes, and nothing is given up or sent twice.
    name = topic(kafka, "slow", partitions=1)
    ob.configure(broker_timeout="1s", kafka_request_timeout="20s", heartbeat_interval="1h")
    first = enqueue(ob, 1, name)
    wait_until(lambda: statuses(ob, first) == {"dispatched": 1}, message="the topic's metadata known")
    timeouts = ob.metric("outbox_reconnects_total", reason="timeout")
    kafka.freeze()
    try:
        ids = enqueue(ob, 20, name)
        wait_until(lambda: statuses(ob, ids) == {"processing": 20}, message="the push in flight")
        time.sleep(4)
    finally:
        kafka.freeze(False)
    wait_until(lambda: statuses(ob, ids) == {"dispatched": 20}, message="the answer waited for",
               seen=lambda: last_error(ob))
    assert ob.metric("outbox_reconnects_total", reason="timeout") == timeouts
    assert Counter(kafka.ids(name)) == Counter(first + ids), "an answer given up on: sent twice"


def test_sigterm_ends_a_wait_for_a_produce_answer_within_seconds(ob, kafka):
    # The answer may take outbox.kafka_request_timeout (ten minutes here);
    # a SIGTERM ends the wait at once (the sidecar lets a push in flight
    # finish for 5 s first), and the events go back in line unspent.
    name = topic(kafka, "stopped", partitions=1)
    ob.configure(kafka_request_timeout="10min", heartbeat_interval="1h")
    first = enqueue(ob, 1, name)
    wait_until(lambda: statuses(ob, first) == {"dispatched": 1}, message="the topic's metadata known")
    kafka.freeze()
    try:
        ids = enqueue(ob, 5, name)
        wait_until(lambda: statuses(ob, ids) == {"processing": 5}, message="the push in flight")
        time.sleep(1)
        pid = dispatcher_pid(ob)
        started = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: gone(pid), timeout=30, message="the dispatcher gone")
        assert time.monotonic() - started < 8
    finally:
        kafka.freeze(False)
        if HOST == "sidecar":
            # A sidecar again (the server restarts a background worker):
            # a change of its own settings starts one.
            ob.configure(workers=2)
    wait_until(lambda: statuses(ob, ids) == {"dispatched": 5}, timeout=60, message="the events sent after the stop")
    assert ob.value("SELECT count(*) FROM outbox.events WHERE retry_count > 0") == 0
