"""Per-key order: events of one ordering_key run one at a time, in the order
their transactions committed, across a prefork Celery fleet running
outbox_dispatch.celery. The hostile cases first: producers that cross,
stall or run at repeatable read, a task that keeps failing, a push that
fails, a forged key state; then the issue's load test, subscriptions and
two dispatchers."""

import json
import random
import threading
import time
import uuid

import psycopg
import pytest

from harness import CeleryWorker, decode, queued_ids, wait_until
from standalone import library_only

QUEUE = "ordered"


@pytest.fixture(scope="module")
def fleet(redis_server):
    """A prefork worker with four processes on the ordered queue."""
    worker = CeleryWorker(redis_server.url, queues=(QUEUE,), app="loop_app", pool="prefork", concurrency=4)
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.close()


@pytest.fixture
def keyed(cluster, redis_server):
    """The shared cluster with an empty outbox, one dispatcher, and no
    notes left by an earlier test (the workers' own keys stay)."""
    cluster.reset(enabled="on")
    cluster.empty()
    client = redis_server.client()
    for pattern in ("order:*", "heal:*", QUEUE, "poisoned"):
        for key in client.keys(pattern):
            client.delete(key)
    yield cluster


def enqueue_ordered(conn, key, seq, **kwargs):
    payload = {"key": key, "seq": seq, **kwargs}
    return conn.execute(
        "SELECT outbox_enqueue('loop.ordered', %s::jsonb, queue => %s, ordering_key => %s)",
        (json.dumps(payload), kwargs.pop("queue", QUEUE), key)).fetchone()[0]


def runs(redis_server, key):
    return [json.loads(r) for r in redis_server.client().lrange(f"order:{key}", 0, -1)]


def key_states(pg, key):
    return pg.sql("SELECT id, status::text, key_state, key_seq FROM outbox.events "
                  "WHERE ordering_key = %s ORDER BY key_seq", (key,))


def assert_one_at_a_time(recorded, expected):
    """Runs of one key: in `expected` order, none overlapping the next."""
    assert [r["seq"] for r in recorded] == expected, recorded
    for before, after in zip(recorded, recorded[1:]):
        assert after["start"] >= before["end"], (before, after)


# --- Hostile producers -------------------------------------------------------


def test_crossing_producers_run_in_commit_order(keyed, redis_server, fleet):
    """The second transaction to enqueue for a key takes a smaller id than
    the first, and commits after it: its event runs second. It waits for
    the first's commit at its INSERT (the key's lock); another key's
    producer does not."""
    later, earlier = sorted((uuid.uuid4() for _ in range(2)), reverse=True)
    first = keyed.connect(autocommit=False)
    second = keyed.connect(autocommit=False)
    insert = ("INSERT INTO outbox.events (id, event_type, task, queue, payload, ordering_key) "
              "VALUES (%s, 'ordered', 'loop.ordered', %s, %s::jsonb, 'crossing')")
    first.execute(insert, (later, QUEUE, json.dumps({"key": "crossing", "seq": 1})))
    done = threading.Event()

    def enqueue_second():
        second.execute(insert, (earlier, QUEUE, json.dumps({"key": "crossing", "seq": 2})))
        second.commit()
        done.set()

    thread = threading.Thread(target=enqueue_second)
    thread.start()
    time.sleep(0.5)
    assert not done.is_set(), "the second producer of a key must wait for the first"
    with keyed.connect() as other:
        enqueue_ordered(other, "elsewhere", 1)
    wait_until(lambda: len(runs(redis_server, "elsewhere")) == 1, timeout=30,
               message="another key's event sent while a producer holds a key")
    first.commit()
    thread.join(timeout=30)
    assert done.is_set()
    wait_until(lambda: len(runs(redis_server, "crossing")) == 2, timeout=60, message="both events run")
    assert_one_at_a_time(runs(redis_server, "crossing"), [1, 2])
    assert [r["id"] for r in runs(redis_server, "crossing")] == [str(later), str(earlier)]
    first.close()
    second.close()


def test_a_producer_holding_a_key_holds_up_no_dispatcher(keyed, redis_server, fleet):
    """The head of a key finishes while a producer of the key has not
    committed: the dispatcher does not wait for that producer's lock, other
    keys are sent meanwhile, and the key goes on once the producer commits."""
    with keyed.connect() as conn:
        enqueue_ordered(conn, "held", 1)
    wait_until(lambda: len(runs(redis_server, "held")) == 1, timeout=30, message="the head run")
    producer = keyed.connect(autocommit=False)
    enqueue_ordered(producer, "held", 2)
    with keyed.connect() as conn:
        for seq in range(1, 6):
            enqueue_ordered(conn, f"free{seq}", seq)
    for seq in range(1, 6):
        wait_until(lambda: len(runs(redis_server, f"free{seq}")) == 1, timeout=30,
                   message="other keys sent while a producer holds one")
    assert keyed.value("SELECT count(*) FROM outbox.workers WHERE state = 'blocked'") == 0
    producer.commit()
    producer.close()
    wait_until(lambda: len(runs(redis_server, "held")) == 2, timeout=30, message="the held key went on")
    assert_one_at_a_time(runs(redis_server, "held"), [1, 2])


REFUSED_ABOVE_READ_COMMITTED = "without the library a keyed event is refused above READ COMMITTED " \
    "(docs/guides/managed.md; tests/test_standalone.py)"


@library_only(REFUSED_ABOVE_READ_COMMITTED)
@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_a_producer_at_repeatable_read_makes_no_second_head(keyed, isolation):
    """A producer whose snapshot predates another producer's commit for
    the same key still sees that event: it waits behind it, rather than
    being a second head."""
    keyed.configure(enabled="off")
    late = keyed.connect(autocommit=False)
    late.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
    late.execute("SELECT count(*) FROM outbox.events").fetchone()
    with keyed.connect() as early:
        enqueue_ordered(early, "snapshot", 1)
    enqueue_ordered(late, "snapshot", 2)
    late.commit()
    late.close()
    states = [(r[2], r[3]) for r in key_states(keyed, "snapshot")]
    assert [s for s, _ in states] == ["head", "waiting"], states


def test_an_orm_insert_and_a_multi_row_insert_take_turns(keyed):
    """The column alone (an ORM's INSERT) orders the event; rows of one
    INSERT ... SELECT take turns in the order inserted; a forged key_seq or
    key_state in an INSERT of a pending event is replaced."""
    keyed.configure(enabled="off")
    with keyed.connect() as conn:
        conn.execute("INSERT INTO outbox.events (event_type, task, queue, ordering_key, payload) "
                     "SELECT 'ordered', 'loop.ordered', %s, 'orm', jsonb_build_object('seq', g) "
                     "FROM generate_series(1, 5) AS g", (QUEUE,))
        conn.execute("INSERT INTO outbox.events (event_type, task, queue, ordering_key, key_state, payload) "
                     "VALUES ('ordered', 'loop.ordered', %s, 'forged', 'waiting', '{}'), "
                     "       ('ordered', 'loop.ordered', %s, 'forged', 'head', '{}')", (QUEUE, QUEUE))
    rows = keyed.sql("SELECT payload->>'seq', key_state FROM outbox.events WHERE ordering_key = 'orm' "
                     "ORDER BY key_seq")
    assert rows == [("1", "head")] + [(str(s), "waiting") for s in range(2, 6)], rows
    assert [r[2] for r in key_states(keyed, "forged")] == ["head", "waiting"]


def test_a_routed_event_does_not_free_its_key(keyed):
    """An event routed to subscriptions keeps its ordering_key as a record,
    processed at once and holding nothing: the key's next event must still
    wait behind the key's head."""
    keyed.configure(enabled="off")
    with keyed.connect() as conn:
        conn.execute("SELECT outbox_subscribe('mixed.placed', 'loop.ordered', queue => %s)", (QUEUE,))
    try:
        with keyed.connect() as conn:
            enqueue_ordered(conn, "mixed", 1)
            conn.execute("SELECT outbox_enqueue('mixed.placed', '{}', ordering_key => 'mixed')")
            enqueue_ordered(conn, "mixed", 2)
        states = keyed.sql("SELECT subscription_id IS NOT NULL, key_state FROM outbox.events "
                           "WHERE ordering_key = 'mixed' AND status = 'pending' ORDER BY key_seq")
        assert states == [(False, "head"), (True, "head"), (False, "waiting")], states
    finally:
        keyed.sql("SELECT outbox_unsubscribe(id) FROM outbox.subscriptions")


def test_a_forged_key_seq_takes_a_turn_all_the_same(keyed):
    """A pending event inserted with a key_seq of its own and no key_state
    (an ORM copying a row, a guess) takes its turn: it waits behind the
    head, and the key's next event waits behind it."""
    keyed.configure(enabled="off")
    with keyed.connect() as conn:
        enqueue_ordered(conn, "forged_seq", 1)
        conn.execute("INSERT INTO outbox.events (event_type, task, queue, ordering_key, key_seq, payload) "
                     "VALUES ('ordered', 'loop.ordered', %s, 'forged_seq', 1000000000000, '{}')", (QUEUE,))
        enqueue_ordered(conn, "forged_seq", 3)
    states = [r[2] for r in key_states(keyed, "forged_seq")]
    assert states == ["head", "waiting", "waiting"], states


def test_a_copied_head_makes_no_second_head(keyed):
    """An INSERT ... SELECT that copies a head (an ORM's clone), key_seq and
    key_state with it, takes a turn of its own behind the head; an UPDATE
    that would make a second head of a key is refused by the schema."""
    keyed.configure(enabled="off")
    with keyed.connect() as conn:
        head = enqueue_ordered(conn, "cloned", 1)
        conn.execute("INSERT INTO outbox.events (event_type, task, queue, ordering_key, key_seq, key_state, payload) "
                     "SELECT event_type, task, queue, ordering_key, key_seq, key_state, payload "
                     "  FROM outbox.events WHERE id = %s", (head,))
        last = enqueue_ordered(conn, "cloned", 3)
    states = key_states(keyed, "cloned")
    assert [r[2] for r in states] == ["head", "waiting", "waiting"], states
    assert states[0][0] == head and len({r[3] for r in states}) == 3, states
    with pytest.raises(psycopg.errors.UniqueViolation, match=r"log_\d_key_head_idx"):
        keyed.sql("UPDATE outbox.log SET key_state = 'head' WHERE id = %s", (last,))


# --- Rows that bring their own turn (dispatch paused: the states stay as
# the SQL leaves them) ---------------------------------------------------------


@pytest.fixture
def paused(cluster):
    cluster.reset(enabled="off")
    cluster.empty()
    yield cluster
    cluster.reset(enabled="on")


def states(pg, key):
    return pg.sql("SELECT status::text, key_state, key_seq FROM outbox.events "
                  "WHERE ordering_key = %s ORDER BY key_seq", (key,))


def test_a_head_copied_into_another_key_takes_a_turn_there(paused):
    """An ORM clones key A's head into key B (ordering_key changed, key_seq
    and key_state copied; no row of B has that key_seq). The turn does not
    fit B, whose newest event is finished: the clone takes a turn of its
    own, and B's next producer waits behind it (it would otherwise find B
    free, make a second head, and fail on events_key_head_idx)."""
    with paused.connect() as conn:
        a1 = enqueue_ordered(conn, "rt_a", 1)
        b1 = enqueue_ordered(conn, "rt_b", 1)
        # B1 done (finished by hand: paused, nothing was sent), key B free.
        conn.execute("UPDATE outbox.log SET status = 'processed', key_state = NULL WHERE id = %s", (b1,))
        conn.execute("INSERT INTO outbox.events (event_type, task, queue, ordering_key, key_seq, key_state, payload) "
                     "SELECT event_type, task, queue, 'rt_b', key_seq, key_state, payload "
                     "  FROM outbox.events WHERE id = %s", (a1,))
        enqueue_ordered(conn, "rt_b", 2)
    assert [r[:2] for r in states(paused, "rt_b")] == [("processed", None), ("pending", "head"), ("pending", "waiting")]
    assert [r[:2] for r in states(paused, "rt_a")] == [("pending", "head")]


def test_a_row_bringing_its_own_turn_waits_for_the_keys_lock(paused):
    """A row inserted with key_seq and key_state (a restore's, an import's)
    takes the key's lock like any producer: one that runs outbox_enqueue()
    for the key while that insert is uncommitted waits for it, then waits
    behind it (it would otherwise find the key free, make a second head,
    and fail on events_key_head_idx as the insert commits)."""
    forger = paused.connect(autocommit=False)
    forger.execute("INSERT INTO outbox.events (event_type, task, queue, ordering_key, key_seq, key_state, payload) "
                   "VALUES ('imported', 'loop.ordered', %s, 'rt_race', 9000000000000, 'head', '{}')", (QUEUE,))
    outcome = {}

    def produce():
        try:
            with paused.connect() as conn:
                outcome["id"] = enqueue_ordered(conn, "rt_race", 1)
        except Exception as e:  # noqa: BLE001
            outcome["error"] = e

    producer = threading.Thread(target=produce)
    producer.start()
    wait_until(lambda: paused.value("SELECT wait_event_type || ':' || wait_event FROM pg_stat_activity "
                                    "WHERE query LIKE 'SELECT outbox_enqueue%%' AND state = 'active'")
               == "Lock:advisory", message="the producer waiting for the key's lock")
    forger.commit()
    forger.close()
    producer.join(30)
    assert "error" not in outcome, f"the producer failed: {outcome.get('error')!r}"
    assert [r[:2] for r in states(paused, "rt_race")] == [("pending", "waiting"), ("pending", "head")]


@library_only(REFUSED_ABOVE_READ_COMMITTED)
def test_concurrent_copies_of_a_turn_at_repeatable_read_take_turns_of_their_own(paused):
    """Two producers at REPEATABLE READ bring the same turn of a key in
    concurrent transactions. The second, once it has the key's lock, reads
    the key as of now and sees the first's row: it takes a turn of its own
    (two rows of one key_seq would have pass.sql skip one)."""
    brought = ("INSERT INTO outbox.events (event_type, task, queue, ordering_key, key_seq, key_state, payload) "
               "VALUES ('imported', 'loop.ordered', %s, 'rt_dup', 7, 'waiting', '{}')")
    first, second = (paused.connect(autocommit=False) for _ in range(2))
    try:
        for conn in (first, second):
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            conn.execute("SELECT 1")  # the snapshot: neither sees the other's row
        first.execute(brought, (QUEUE,))
        waiting = threading.Thread(target=lambda: (second.execute(brought, (QUEUE,)), second.commit()))
        waiting.start()
        wait_until(lambda: paused.value("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                        "AND query LIKE 'INSERT INTO outbox.events%%'") == 1,
                   message="the second waiting for the key's lock")
        first.commit()
        waiting.join(30)
    finally:
        first.close()
        second.close()
    seqs = [r[2] for r in states(paused, "rt_dup")]
    assert len(set(seqs)) == len(seqs), f"two rows of key rt_dup share a key_seq: {states(paused, 'rt_dup')}"


def test_the_upgrade_repair_leaves_no_second_claimable_event_of_a_key(cluster):
    """0.8.0 let an insert copy a head. The 0.9.0 update keeps one head per
    key, the one in flight; when its claim is given back (as sweep_stuck.sql
    does) and later the other's, no two events of the key are claimable at
    once: a pending event of the key without a turn takes one
    (events_take_turn_again fires on status too)."""
    cluster.sql("DROP DATABASE IF EXISTS redteam_upgrade")
    cluster.sql("CREATE DATABASE redteam_upgrade")
    try:
        db = "redteam_upgrade"
        cluster.sql("CREATE EXTENSION outbox_dispatch VERSION '0.8.0'", dbname=db)
        with cluster.connect(dbname=db) as conn:
            head = enqueue_ordered(conn, "rt_up", 1)
            conn.execute("INSERT INTO outbox.events (event_type, task, queue, ordering_key, key_seq, key_state, payload) "
                         "SELECT event_type, task, queue, ordering_key, key_seq, key_state, payload "
                         "  FROM outbox.events WHERE id = %s", (head,))
            # The clone is the one a dispatcher has claimed when the update runs.
            conn.execute("UPDATE outbox.events SET status = 'processing', processing_started_at = now() "
                         "WHERE ordering_key = 'rt_up' AND id <> %s", (head,))
            conn.execute("ALTER EXTENSION outbox_dispatch UPDATE TO '0.9.0'")
            # sweep_stuck.sql's update, as the stuck sweeper would run it:
            conn.execute("UPDATE outbox.events SET status = 'pending', processing_started_at = NULL, claimed_by = NULL "
                         "WHERE status = 'processing'")
            rows = conn.execute("SELECT id = %s, status::text, key_state FROM outbox.events "
                                "WHERE ordering_key = 'rt_up' ORDER BY key_seq, id", (head,)).fetchall()
        claimable = [r for r in rows if r[1] == "pending" and r[2] != "waiting"]
        assert len(claimable) == 1, f"two events of key rt_up are claimable at once: {rows}"
    finally:
        cluster.sql("DROP DATABASE IF EXISTS redteam_upgrade")


def test_a_turn_a_writer_brings_never_puts_its_event_before_one_committed_earlier(keyed, redis_server):
    """A key's head and an event waiting behind it, with a gap between
    their turns (another key took one). A writer granted as the docs say
    may not write a turn at all; one granted 1.0.0's INSERT on the whole
    table inserts an event into the gap, as a waiting one right behind the
    head: it takes its turn afresh, after the event committed before it,
    and is sent after it."""
    keyed.configure(enabled="off", report_key="", ack_timeout=0)
    with keyed.connect() as conn:
        head = str(enqueue_ordered(conn, "brought", 1, queue="q_brought"))
        enqueue_ordered(conn, "another", 1, queue="q_brought")
        earlier = str(enqueue_ordered(conn, "brought", 2, queue="q_brought"))
    (head_seq,) = keyed.sql("SELECT key_seq FROM outbox.events WHERE id = %s", (head,))[0]
    gap = head_seq + 1
    assert keyed.value("SELECT count(*) FROM outbox.events WHERE key_seq = %s AND ordering_key = 'brought'",
                       (gap,)) == 0
    forged = ("INSERT INTO outbox.events (event_type, queue, ordering_key, key_seq, key_state) "
              "VALUES ('loop.ordered', 'q_brought', 'brought', %s, 'waiting') RETURNING id")
    with keyed.connect_as("outbox_writer", "app") as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(forged.replace(" RETURNING id", ""), (gap,))
    with keyed.connect(user=keyed.owner) as conn:
        conn.execute("GRANT INSERT, SELECT ON outbox.events, outbox.log TO outbox_writer")
    try:
        with keyed.connect(user="outbox_writer") as conn:
            brought = str(conn.execute(forged, (gap,)).fetchone()[0])
    finally:
        with keyed.connect(user=keyed.owner) as conn:
            conn.execute("REVOKE INSERT, SELECT ON outbox.events, outbox.log FROM outbox_writer")
    seqs = dict(keyed.sql("SELECT id::text, key_seq FROM outbox.events WHERE ordering_key = 'brought'"))
    assert seqs[brought] > seqs[earlier] > seqs[head], seqs
    keyed.configure(enabled="on")
    client = redis_server.client()
    wait_until(lambda: brought in queued_ids(client, "q_brought"), message="the key's three sent")
    sent = [event for event in queued_ids(client, "q_brought") if event in (head, earlier, brought)]
    assert sent == [head, earlier, brought], (sent, head, earlier, brought, key_states(keyed, "brought"))


def test_an_acknowledgement_of_a_waiting_event_changes_nothing(keyed):
    keyed.configure(enabled="off")
    with keyed.connect() as conn:
        enqueue_ordered(conn, "acked", 1)
        waiting = enqueue_ordered(conn, "acked", 2)
        assert conn.execute("SELECT outbox_ack(%s)", (waiting,)).fetchone()[0] is False
    assert [r[1:3] for r in key_states(keyed, "acked")] == [("pending", "head"), ("pending", "waiting")]


def test_an_acknowledgement_of_an_event_never_sent_changes_nothing(keyed):
    """No send carried a delayed event: an acknowledgement of it, with or
    without a send, is refused, and it stays pending, to be sent when due."""
    keyed.configure(enabled="off")
    with keyed.connect() as conn:
        delayed = conn.execute("SELECT outbox_enqueue('x', '{}', queue => 'q_never', "
                               "delay => interval '1 hour')").fetchone()[0]
        assert conn.execute("SELECT outbox_ack(%s)", (delayed,)).fetchone()[0] is False
        assert conn.execute("SELECT outbox_ack(%s, gen_random_uuid())", (delayed,)).fetchone()[0] is False
        assert conn.execute("SELECT status::text FROM outbox.events WHERE id = %s", (delayed,)).fetchone()[0] \
            == "pending"


def test_an_acknowledgement_names_its_send_and_an_earlier_one_passes_no_key(keyed, redis_server):
    """A head not acknowledged in time is sent again. An acknowledgement of
    its first send is refused, and so is one that names no send (which
    copy was processed cannot be told): the key waits for the copy in the
    broker. The second send's passes it on."""
    keyed.configure(ack_timeout="1s", sweep_interval="1s", max_redeliveries=10)
    client = redis_server.client()
    with keyed.connect() as conn:
        head = str(enqueue_ordered(conn, "named", 1, queue="q_named"))
        after = str(enqueue_ordered(conn, "named", 2, queue="q_named"))
    wait_until(lambda: queued_ids(client, "q_named").count(head) >= 2, timeout=30, message="the head sent again")
    keyed.configure(ack_timeout="1h", max_redeliveries=10)
    wait_until(lambda: keyed.value("SELECT status::text FROM outbox.events WHERE id = %s", (head,)) == "dispatched",
               message="the head's second send marked")
    # Newest first (LPUSH): the send the head awaits an outcome of, and its first.
    sends = [decode(m)[0]["headers"]["outbox_send"] for m in client.lrange("q_named", 0, -1)
             if decode(m)[0]["headers"]["id"] == head]
    warnings = []
    with keyed.connect() as conn:
        conn.add_notice_handler(lambda notice: warnings.append(notice.message_primary))
        assert conn.execute("SELECT outbox_ack(%s, %s)", (head, sends[-1])).fetchone()[0] is False
        assert conn.execute("SELECT outbox_ack(%s)", (head,)).fetchone()[0] is False
        assert any("sent more than once" in w and "outbox_ack(id, send)" in w for w in warnings), warnings
        time.sleep(1)
        assert after not in queued_ids(client, "q_named")
        assert conn.execute("SELECT outbox_ack(%s, %s)", (head, sends[0])).fetchone()[0] is True
    wait_until(lambda: after in queued_ids(client, "q_named"), message="the key passed on")
    assert keyed.value("SELECT status::text FROM outbox.events WHERE id = %s", (head,)) == "processed"


def test_keys_are_checked(keyed):
    with keyed.connect() as conn:
        for bad in ("", "k" * 256):
            with pytest.raises(psycopg.errors.InvalidParameterValue, match="ordering_key is .* bytes, it must be 1 to 255"):
                conn.execute("SELECT outbox_enqueue('x', '{}', ordering_key => %s)", (bad,))
        with pytest.raises(psycopg.errors.CheckViolation, match="events_ordering_key_length"):
            conn.execute("INSERT INTO outbox.events (event_type, ordering_key) VALUES ('x', '')")
        with pytest.raises(psycopg.errors.CheckViolation, match="events_key_state"):
            conn.execute("INSERT INTO outbox.log (event_type, status, ordering_key, key_state) "
                         "VALUES ('x', 'processed', 'k', 'mine')")
        with pytest.raises(psycopg.errors.CheckViolation, match="events_key_state"):
            conn.execute("INSERT INTO outbox.events (event_type, key_state) VALUES ('x', 'waiting')")
    assert keyed.value("SELECT count(*) FROM outbox.events") == 0


# --- A key that fails --------------------------------------------------------


def test_a_failing_task_blocks_only_its_key_until_retried(keyed, redis_server, fleet):
    with keyed.connect() as conn:
        poison = enqueue_ordered(conn, "poison", 1, fail=True)
        for seq in (2, 3):
            enqueue_ordered(conn, "poison", seq)
        for seq in (1, 2, 3):
            enqueue_ordered(conn, "healthy", seq)
    wait_until(lambda: len(runs(redis_server, "healthy")) == 3, timeout=60, message="the healthy key ran")
    wait_until(lambda: keyed.value("SELECT status::text FROM outbox.events WHERE id = %s", (poison,)) == "failed",
               timeout=60, message="the poison head failed")
    time.sleep(1)
    assert [r["seq"] for r in runs(redis_server, "poison")] == [1]
    blocked = keyed.sql("SELECT ordering_key, head, status::text, waiting, last_error FROM outbox.blocked_keys")
    assert blocked == [("poison", poison, "failed", 2, blocked[0][4])], blocked
    assert "refused" in blocked[0][4]
    assert keyed.metric("outbox_keys_dead_lettered") == 1
    assert keyed.metric("outbox_events_waiting") == 2
    assert keyed.metric("outbox_keys_waiting") == 1
    assert keyed.value("SELECT holds_key FROM outbox.dead_letters WHERE id = %s", (poison,)) is True
    redis_server.client().set(f"heal:{poison}", 1)
    assert keyed.value("SELECT outbox_retry(%s)", (poison,)) is True
    wait_until(lambda: len(runs(redis_server, "poison")) == 4, timeout=60, message="the key resumed")
    assert_one_at_a_time(runs(redis_server, "poison"), [1, 1, 2, 3])
    wait_until(lambda: keyed.value("SELECT count(*) FROM outbox.blocked_keys") == 0, timeout=30,
               message="no key blocked")


def test_outbox_skip_lets_a_dead_lettered_key_go_on(keyed, redis_server, fleet):
    with keyed.connect() as conn:
        poison = enqueue_ordered(conn, "skipped", 1, fail=True)
        enqueue_ordered(conn, "skipped", 2)
        other = enqueue_ordered(conn, "other", 1)
    wait_until(lambda: keyed.value("SELECT status::text FROM outbox.events WHERE id = %s", (poison,)) == "failed",
               timeout=60, message="the head failed")
    # A head sent and not yet reported would be let go (that is skipping
    # past an unreported head): wait for the report of the other key's.
    wait_until(lambda: keyed.value("SELECT status::text FROM outbox.events WHERE id = %s", (other,)) == "processed",
               timeout=60, message="the other key's head was reported")
    assert keyed.value("SELECT outbox_skip(%s)", (other,)) is False, "only a failed head is skipped"
    assert keyed.value("SELECT outbox_skip(%s)", (uuid.uuid4(),)) is False
    assert keyed.value("SELECT outbox_skip(%s)", (poison,)) is True
    assert keyed.value("SELECT outbox_skip(%s)", (poison,)) is False, "skipped once"
    wait_until(lambda: len(runs(redis_server, "skipped")) == 2, timeout=60, message="the key went on")
    assert_one_at_a_time(runs(redis_server, "skipped"), [1, 2])
    assert keyed.value("SELECT holds_key FROM outbox.dead_letters WHERE id = %s", (poison,)) is False
    # Retried after its key went on, it takes a new turn, behind the key.
    redis_server.client().set(f"heal:{poison}", 1)
    with keyed.connect() as conn:
        enqueue_ordered(conn, "skipped", 3)
        assert conn.execute("SELECT outbox_retry(%s)", (poison,)).fetchone()[0] is True
    wait_until(lambda: len(runs(redis_server, "skipped")) == 4, timeout=60, message="the retried event ran")
    assert_one_at_a_time(runs(redis_server, "skipped"), [1, 2, 3, 1])


def test_a_head_retried_while_its_key_waits_to_be_passed_holds_it(keyed, redis_server, fleet):
    """Under continue, a head fails while a producer of its key has not
    committed: the dispatcher cannot pass the key yet. The head is retried
    and sent again meanwhile: once the producer commits, the key is not
    passed on while the head runs again."""
    keyed.configure(key_on_failure="continue")
    with keyed.connect() as conn:
        head = enqueue_ordered(conn, "deferred", 1, fail=True, slow=2)
    producer = keyed.connect(autocommit=False)
    enqueue_ordered(producer, "deferred", 2)
    wait_until(lambda: keyed.value("SELECT status::text FROM outbox.events WHERE id = %s", (head,)) == "failed",
               timeout=60, message="the head failed")
    time.sleep(0.5)
    redis_server.client().set(f"heal:{head}", 1)
    assert keyed.value("SELECT outbox_retry(%s)", (head,)) is True
    wait_until(lambda: keyed.value("SELECT deliveries FROM outbox.events WHERE id = %s", (head,)) == 2,
               timeout=60, message="the head sent again")
    producer.commit()
    producer.close()
    wait_until(lambda: len(runs(redis_server, "deferred")) == 3, timeout=60, message="every run")
    assert_one_at_a_time(runs(redis_server, "deferred"), [1, 1, 2])


def test_an_acknowledgement_waits_for_a_producer_of_its_key_and_holds_up_nothing(keyed, redis_server):
    """With acknowledgements, the head finishes at outbox_ack(). A producer
    of its key has not committed: the acknowledgement waits for it, without
    a lock the dispatchers need, and the key goes on once it commits."""
    keyed.configure(report_key="", ack_timeout="1h")
    client = redis_server.client()
    idle = QUEUE + "_idle"
    with keyed.connect() as conn:
        head = enqueue_ordered(conn, "acking", 1, queue=idle)
    wait_until(lambda: queued_ids(client, idle) == [str(head)], timeout=30, message="the head sent")
    producer = keyed.connect(autocommit=False)
    second = enqueue_ordered(producer, "acking", 2, queue=idle)
    acked = []
    acker = threading.Thread(target=lambda: acked.append(keyed.value("SELECT outbox_ack(%s)", (head,))))
    acker.start()
    time.sleep(0.5)
    assert acked == [], "the acknowledgement waits for the producer of its key"
    with keyed.connect() as conn:
        others = [enqueue_ordered(conn, f"meanwhile{n}", 1, queue=idle) for n in range(3)]
    wait_until(lambda: set(map(str, others)) <= set(queued_ids(client, idle)), timeout=30,
               message="other keys sent meanwhile")
    assert keyed.value("SELECT count(*) FROM outbox.workers WHERE state = 'blocked'") == 0
    producer.commit()
    producer.close()
    acker.join(timeout=30)
    assert acked == [True]
    wait_until(lambda: str(second) in queued_ids(client, idle), timeout=30, message="the key went on")
    client.delete(idle)


def test_outbox_skip_lets_a_key_go_on_past_a_head_never_reported(keyed, redis_server):
    """A head sent to a queue nobody consumes is never reported: the key
    waits, and outbox_skip() lets it go on (outbox_retry() would not: the
    head is not failed)."""
    client = redis_server.client()
    idle = QUEUE + "_idle"
    with keyed.connect() as conn:
        head = enqueue_ordered(conn, "unheard", 1, queue=idle)
        second = enqueue_ordered(conn, "unheard", 2, queue=idle)
    try:
        wait_until(lambda: queued_ids(client, idle) == [str(head)], timeout=30, message="the head sent")
        # Marked dispatched once the dispatcher records the push (with its
        # next claim), which may come a moment after the message.
        wait_until(lambda: keyed.sql("SELECT head, status::text, waiting FROM outbox.blocked_keys")
                   == [(head, "dispatched", 1)], timeout=30, message="the head dispatched, its key blocked")
        assert keyed.value("SELECT outbox_retry(%s)", (head,)) is False
        assert keyed.value("SELECT outbox_skip(%s)", (second,)) is False, "a waiting event holds nothing"
        assert keyed.value("SELECT outbox_skip(%s)", (head,)) is True
        wait_until(lambda: queued_ids(client, idle) == [str(head), str(second)], timeout=30,
                   message="the key went on")
    finally:
        client.delete(idle)


def test_a_skipped_head_is_never_sent_again_after_its_successor(keyed, redis_server):
    """With acknowledgements on, a head sent and skipped is not sent again
    by the unacknowledged sweeper once its successor went out: it is failed,
    saying why. Heads passed on as sent while acknowledgements were off
    await none when outbox.ack_timeout is raised later: neither failed nor
    sent again."""
    client = redis_server.client()
    idle = QUEUE + "_skipped"
    keyed.configure(ack_timeout="2s", sweep_interval="1s", report_key="")
    with keyed.connect() as conn:
        head = enqueue_ordered(conn, "skipped", 1, queue=idle)
        second = enqueue_ordered(conn, "skipped", 2, queue=idle)
    wait_until(lambda: queued_ids(client, idle) == [str(head)], timeout=30, message="the head sent")
    # Skipped once marked dispatched (the dispatcher records the push a
    # moment after the message).
    wait_until(lambda: keyed.value("SELECT status::text FROM outbox.events WHERE id = %s", (head,)) == "dispatched",
               timeout=30, message="the head dispatched")
    assert keyed.value("SELECT outbox_skip(%s)", (head,)) is True
    wait_until(lambda: queued_ids(client, idle)[:2] == [str(head), str(second)], timeout=30, message="the key went on")
    wait_until(lambda: keyed.value("SELECT status::text FROM outbox.events WHERE id = %s", (head,)) == "failed",
               timeout=30, message="the skipped head failed by the sweeper")
    assert "went on without it" in keyed.value("SELECT last_error FROM outbox.events WHERE id = %s", (head,))
    sent = queued_ids(client, idle)
    assert str(head) not in sent[1:], sent

    # Passed on as sent while nothing acknowledged them; then acknowledgements on.
    client.delete(idle)
    keyed.configure(ack_timeout="0")
    with keyed.connect() as conn:
        first = enqueue_ordered(conn, "raised", 1, queue=idle)
        then = enqueue_ordered(conn, "raised", 2, queue=idle)
    wait_until(lambda: {str(first), str(then)} <= set(queued_ids(client, idle)), timeout=30, message="both sent")
    keyed.configure(ack_timeout="2s")
    time.sleep(5)  # two sweeps past the new timeout: nothing sent before it awaits one
    raised = [event for event in queued_ids(client, idle) if event in (str(first), str(then))]
    assert raised == [str(first), str(then)]
    assert keyed.sql("SELECT status::text FROM outbox.events WHERE id IN (%s, %s)", (first, then)) \
        == [("dispatched",), ("dispatched",)]
    client.delete(idle)


def test_retrying_every_failed_event_keeps_each_keys_order(keyed, redis_server, fleet):
    """Under continue, three events of a key fail and the key goes on past
    each; outbox_retry_failed() gives them new turns in their first order."""
    keyed.configure(key_on_failure="continue")
    with keyed.connect() as conn:
        failing = [enqueue_ordered(conn, "again", seq, fail=True) for seq in (1, 2, 3)]
    wait_until(lambda: keyed.count("failed") == 3, timeout=60, message="three failed")
    for event in failing:
        redis_server.client().set(f"heal:{event}", 1)
    assert keyed.value("SELECT outbox_retry_failed()") == 3
    wait_until(lambda: len(runs(redis_server, "again")) == 6, timeout=60, message="each ran again")
    assert_one_at_a_time(runs(redis_server, "again"), [1, 2, 3, 1, 2, 3])


def test_key_on_failure_continue(keyed, redis_server, fleet):
    keyed.configure(key_on_failure="continue")
    with keyed.connect() as conn:
        enqueue_ordered(conn, "onward", 1, fail=True)
        enqueue_ordered(conn, "onward", 2)
    wait_until(lambda: len(runs(redis_server, "onward")) == 2, timeout=60, message="the key went on")
    assert_one_at_a_time(runs(redis_server, "onward"), [1, 2])
    wait_until(lambda: keyed.value("SELECT count(*) FROM outbox.blocked_keys") == 0, timeout=30,
               message="no key blocked")


def test_a_failed_push_backing_off_is_not_overtaken(keyed, redis_server):
    """The head's push fails (its list holds a string: WRONGTYPE) and waits
    for its backoff: the next event of its key, to a list that works, waits
    too. Reports off: each is finished once in Redis."""
    keyed.configure(report_key="", retry_backoff="500ms", max_retries=50)
    client = redis_server.client()
    client.set("poisoned", "not a list")
    with keyed.connect() as conn:
        head = enqueue_ordered(conn, "backoff", 1, queue="poisoned")
        second = enqueue_ordered(conn, "backoff", 2, queue="unpoisoned")
    wait_until(lambda: keyed.value("SELECT retry_count FROM outbox.events WHERE id = %s", (head,)) >= 2,
               timeout=30, message="the head's push failed twice")
    assert queued_ids(client, "unpoisoned") == []
    assert keyed.value("SELECT key_state FROM outbox.events WHERE id = %s", (second,)) == "waiting"
    client.delete("poisoned")
    wait_until(lambda: queued_ids(client, "unpoisoned") == [str(second)], timeout=30,
               message="the second sent after the head")
    assert queued_ids(client, "poisoned") == [str(head)]
    client.delete("unpoisoned", "poisoned")


def test_expired_and_delayed_heads(keyed, redis_server):
    """A delayed head holds its key until it is due and sent; an expired
    head is a dead letter like any other (it holds its key under block)."""
    keyed.configure(report_key="")
    client = redis_server.client()
    with keyed.connect() as conn:
        delayed = conn.execute("SELECT outbox_enqueue('loop.ordered', '{}', queue => %s, ordering_key => 'late', "
                               "delay => '2 seconds')", (QUEUE + "_idle",)).fetchone()[0]
        after = conn.execute("SELECT outbox_enqueue('loop.ordered', '{}', queue => %s, ordering_key => 'late')",
                             (QUEUE + "_idle",)).fetchone()[0]
    time.sleep(1)
    assert queued_ids(client, QUEUE + "_idle") == []
    wait_until(lambda: queued_ids(client, QUEUE + "_idle") == [str(delayed), str(after)], timeout=30,
               message="the delayed head, then the next")
    with keyed.connect() as conn:
        expired = conn.execute("SELECT outbox_enqueue('loop.ordered', '{}', queue => %s, ordering_key => 'old', "
                               "delay => '1 second', expires => '10 milliseconds')", (QUEUE + "_idle",)).fetchone()[0]
        conn.execute("SELECT outbox_enqueue('loop.ordered', '{}', queue => %s, ordering_key => 'old')",
                     (QUEUE + "_idle",))
    wait_until(lambda: keyed.value("SELECT status::text FROM outbox.events WHERE id = %s", (expired,)) == "failed",
               timeout=30, message="the expired head dead-lettered")
    assert keyed.sql("SELECT status::text FROM outbox.blocked_keys WHERE ordering_key = 'old'") == [("failed",)]
    client.delete(QUEUE + "_idle")


# --- Repair ------------------------------------------------------------------


def test_keys_left_without_a_head_are_passed_on(keyed, redis_server):
    """Hand edits that leave a key without a head, or a finished head still
    holding its key, are found by the dispatchers' key sweep."""
    keyed.configure(report_key="", enabled="off")
    client = redis_server.client()
    with keyed.connect() as conn:
        first = enqueue_ordered(conn, "orphan", 1, queue=QUEUE + "_idle")
        second = enqueue_ordered(conn, "orphan", 2, queue=QUEUE + "_idle")
        third = enqueue_ordered(conn, "finished", 1, queue=QUEUE + "_idle")
        fourth = enqueue_ordered(conn, "finished", 2, queue=QUEUE + "_idle")
        conn.execute("DELETE FROM outbox.events WHERE id = %s", (first,))
        conn.execute("UPDATE outbox.log SET status = 'processed' WHERE id = %s", (third,))
    keyed.configure(enabled="on")
    wait_until(lambda: set(queued_ids(client, QUEUE + "_idle")) == {str(second), str(fourth)}, timeout=60,
               message="the key sweep passed both keys on")
    client.delete(QUEUE + "_idle")


# --- The load test -----------------------------------------------------------


def test_many_keys_in_order_across_a_prefork_fleet(keyed, redis_server, fleet):
    """200 keys × 25 events, interleaved and enqueued in random order of
    keys: per key, the runs are in sequence and never overlap."""
    keys = [f"k{n}" for n in range(200)]
    with keyed.connect(autocommit=False) as conn:
        for seq in range(1, 26):
            for key in random.sample(keys, len(keys)):
                enqueue_ordered(conn, key, seq)
        conn.commit()
    wait_until(lambda: keyed.count("processed") == 5000, timeout=300,
               message=f"5000 events processed ({keyed.sql('SELECT status, count(*) FROM outbox.events GROUP BY 1')})")
    for key in keys:
        assert_one_at_a_time(runs(redis_server, key), list(range(1, 26)))
    assert keyed.metric("outbox_key_turns_total") >= 4800


def test_concurrent_producers_on_the_same_keys(keyed, redis_server, fleet):
    """Four producers enqueue for the same 20 keys in transactions of their
    own, committing in whatever order they race to: each key runs its events
    one at a time in key_seq order, which is each producer's own order. A
    transaction enqueues for its keys in sorted order, as docs/guides/per-key-order.md
    says to: two that lock keys in opposite orders deadlock, as with row locks."""
    keys = [f"race{n}" for n in range(20)]

    def produce(producer):
        with keyed.connect(autocommit=False) as conn:
            for seq in range(1, 11):
                for key in sorted(random.sample(keys, 5)):
                    enqueue_ordered(conn, key, seq, producer=producer)
                conn.commit()

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = keyed.value("SELECT count(*) FROM outbox.events")
    assert total == 200
    wait_until(lambda: keyed.count("processed") == total, timeout=120, message="every event processed")
    for key in keys:
        recorded = runs(redis_server, key)
        order = [str(r[0]) for r in keyed.sql(
            "SELECT id FROM outbox.events WHERE ordering_key = %s ORDER BY key_seq", (key,))]
        assert [r["id"] for r in recorded] == order
        for before, after in zip(recorded, recorded[1:]):
            assert after["start"] >= before["end"]
        for producer in range(4):
            mine = [r["seq"] for r in recorded if r["producer"] == producer]
            assert mine == sorted(mine), (key, producer, mine)


def test_two_dispatchers_never_have_two_of_a_key_in_flight(keyed, redis_server, fleet):
    keyed.configure(workers=2, batch_size=10)
    wait_until(lambda: keyed.value("SELECT count(*) FROM outbox.workers WHERE pid IS NOT NULL") == 2,
               timeout=30, message="two dispatchers")
    keys = [f"two{n}" for n in range(30)]
    with keyed.connect(autocommit=False) as conn:
        for seq in range(1, 11):
            for key in keys:
                enqueue_ordered(conn, key, seq)
        conn.commit()
    wait_until(lambda: keyed.count("processed") == 300, timeout=120, message="every event processed")
    for key in keys:
        assert_one_at_a_time(runs(redis_server, key), list(range(1, 11)))


def test_subscribers_each_get_a_key_in_order(keyed, redis_server, fleet):
    """A keyed event fanned out: each subscribed task has its own order of
    the key, and a failing subscriber blocks only its own."""
    with keyed.connect() as conn:
        conn.execute("SELECT outbox_subscribe('order.placed', 'loop.ordered', queue => %s)", (QUEUE,))
        conn.execute("SELECT outbox_subscribe('order.*', 'loop.ordered_too', queue => %s)", (QUEUE,))
    try:
        with keyed.connect() as conn:
            for seq in range(1, 6):
                conn.execute("SELECT outbox_enqueue('order.placed', %s::jsonb, ordering_key => 'fan')",
                             (json.dumps({"key": "fan", "seq": seq}),))
        wait_until(lambda: keyed.count("processed") == 15, timeout=60,
                   message="5 events and their 10 deliveries processed")
        recorded = runs(redis_server, "fan")
        assert len(recorded) == 10
        assert keyed.value("SELECT count(DISTINCT subscription_id) FROM outbox.events "
                           "WHERE ordering_key = 'fan' AND subscription_id IS NOT NULL") == 2
        for subscription in keyed.sql("SELECT DISTINCT subscription_id FROM outbox.events "
                                      "WHERE subscription_id IS NOT NULL"):
            mine = {str(r[0]) for r in keyed.sql("SELECT id FROM outbox.events WHERE subscription_id = %s",
                                                 subscription)}
            assert_one_at_a_time([r for r in recorded if r["id"] in mine], [1, 2, 3, 4, 5])
    finally:
        keyed.sql("SELECT outbox_unsubscribe(id) FROM outbox.subscriptions")
