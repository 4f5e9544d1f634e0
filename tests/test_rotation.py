"""The rotation (sql/rotation.sql): space comes back by TRUNCATE of the
oldest generation, and nothing still needed goes with it. Most steps are
driven here by calling outbox.rotate() (the dispatchers' lifecycle runs
once a day in these tests), with the generations' times moved back a day
where a test needs them due; the last test lets the dispatchers rotate
under load."""

import time

import psycopg
import pytest

from harness import queued_ids, wait_until
from standalone import library_only

RETENTION = "2 seconds"


def enqueue(conn, queue):
    return str(conn.execute("SELECT outbox_enqueue('e', '{}', queue => %s)", (queue,)).fetchone()[0])


@pytest.fixture
def rotating(outbox):
    outbox.configure(lifecycle_interval="1d")
    yield outbox
    outbox.restore_generation_times()


def rotate(pg, retention=RETENTION, acks=False):
    return pg.sql("SELECT step, events FROM outbox.rotate(%s, 1000, %s)", (retention, acks))[0]


def rotate_until(pg, wanted, retention=RETENTION, aged=False, acks=False):
    """Steps of the rotation (each after Cluster.age_generations(), if
    `aged`) until one of `wanted`; the steps taken."""
    steps = []

    def done():
        if aged:
            pg.age_generations()
        steps.append(rotate(pg, retention, acks)[0])
        return steps[-1] in wanted

    try:
        wait_until(done, message=f"a step in {wanted}")
    except AssertionError as e:
        raise AssertionError(f"{e}; steps: {steps}; {pg.sql('TABLE outbox.generations')}") from None
    return steps


def current(pg):
    return pg.value("SELECT pg_sequence_last_value('outbox.generation')")


def rotate_to_oldest(pg):
    """Two advances (and what falls due before them): the generation
    current now becomes the oldest."""
    for _ in range(2):
        rotate_until(pg, ("advanced",), aged=True)
    pg.age_generations()


def clean_oldest(pg):
    """Steps (the generations aged) until the oldest generation has just
    been truncated: it is empty, and was never current since."""
    rotate_until(pg, ("truncated",), aged=True)


def kept(pg, ids):
    return {str(r[0]): r[1:] for r in pg.sql(
        "SELECT id, status::text, key_state, key_seq, pending_xid IS NULL, last_error FROM outbox.events "
        "WHERE id = ANY(%s::uuid[])", (list(ids),))}


def awaiting_ack_in_the_oldest(rotating, client, queue):
    """Acknowledgements on: an event sent and marked, awaiting its
    acknowledgement, in the generation that has become the oldest (the
    dispatchers paused)."""
    rotating.configure(ack_timeout="1h")
    clean_oldest(rotating)
    with rotating.connect() as conn:
        event = enqueue(conn, queue)
    wait_until(lambda: event in queued_ids(client, queue), message="the event sent")
    wait_until(lambda: rotating.value("SELECT status::text FROM outbox.events WHERE id = %s", (event,)) == "dispatched",
               message="the event dispatched")
    rotating.configure(enabled="off")
    rotate_to_oldest(rotating)
    return event


def acknowledged_unseeing_the_move(rotating, event):
    """Moves `event` on, and acknowledges it in a transaction whose snapshot
    predates the move; then truncates its old generation."""
    acker = rotating.connect(autocommit=False)
    try:
        acker.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        acker.execute("SELECT 1")
        assert rotate(rotating, acks=True) == ("moved", 1)
        assert acker.execute("SELECT outbox_ack(%s)", (event,)).fetchone()[0] is True
        acker.commit()
    finally:
        acker.close()
    rotate_until(rotating, ("truncated",), aged=True, acks=True)


@library_only("the library registers outbox.moving as a superuser's setting; without it, "
              "test_standalone.py::test_a_writer_cannot_choose_its_place_in_line_with_outbox_moving")
def test_a_non_superuser_cannot_make_the_insert_triggers_pass_its_rows(rotating):
    """outbox.moving, which the rotation sets while it moves events, is for
    superusers only: a writer that set it would insert rows that take no
    key turn and are not put in line."""
    rotating.sql("DROP ROLE IF EXISTS rot_writer; CREATE ROLE rot_writer LOGIN")
    try:
        with rotating.connect(user="rot_writer") as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="outbox.moving"):
                conn.execute("SET outbox.moving = on")
    finally:
        rotating.sql("DROP ROLE rot_writer")


def test_the_oldest_generation_is_truncated_and_what_is_still_needed_moves_on(rotating, redis_server):
    client = redis_server.client()
    first = current(rotating)
    with rotating.connect() as conn:
        sent = [enqueue(conn, "q_rot_sent") for _ in range(200)]
    wait_until(lambda: len(queued_ids(client, "q_rot_sent")) == 200, message="200 events sent")
    # Still needed: a dead letter, an event delayed a day, and a key whose
    # head is delayed a day with two events waiting behind it.
    [dead] = [str(r[0]) for r in rotating.sql(
        "INSERT INTO outbox.log (event_type, queue, status, last_error) "
        "VALUES ('dead', 'q_rot_keep', 'failed', 'gave up') RETURNING id")]
    delayed = str(rotating.value("SELECT outbox_enqueue('later', '{}', queue => 'q_rot_keep', delay => '1 day')"))
    head = str(rotating.value("SELECT outbox_enqueue('k', '{}', queue => 'q_rot_key', delay => '1 day', "
                              "ordering_key => 'rot')"))
    behind = [str(rotating.value("SELECT outbox_enqueue('k', '{}', queue => 'q_rot_key', ordering_key => 'rot')"))
              for _ in range(2)]
    needed = [dead, delayed, head, *behind]
    before = kept(rotating, needed)
    assert [before[i][1] for i in [head, *behind]] == ["head", "waiting", "waiting"]

    rotate_to_oldest(rotating)
    assert rotate(rotating) == ("moved", 5)
    rotate_until(rotating, ("truncated",), aged=True)
    assert rotating.value(f"SELECT count(*) FROM outbox.log_{first}") == 0
    assert rotating.value("SELECT started_at IS NULL FROM outbox.generations WHERE generation = %s", (first,))
    # What was needed is where it was in every respect but its generation.
    assert kept(rotating, needed) == before
    assert rotating.value("SELECT count(DISTINCT generation) FROM outbox.log WHERE id = ANY(%s::uuid[])",
                          (needed,)) == 1
    assert rotating.value("SELECT count(*) FROM outbox.events WHERE id = ANY(%s::uuid[])", (sent,)) == 0
    # Their batches are forgotten, now that none of their events is left.
    assert rotating.value("SELECT outbox.forget_batches(1000)") > 0
    assert rotating.value("SELECT count(*) FROM outbox.batches") == 0
    # Each sent once; the key's events go when the head falls due, in order.
    assert sorted(queued_ids(client, "q_rot_sent")) == sorted(sent)
    # (Each holds its key until it is acknowledged.)
    rotating.sql("UPDATE outbox.events SET available_at = now() WHERE id = %s", (head,))
    for n, event in enumerate([head, *behind], 1):
        wait_until(lambda: len(queued_ids(client, "q_rot_key")) == n, message=f"the key's event {n} sent")
        assert rotating.value("SELECT outbox_ack(%s)", (event,)) is True
    assert queued_ids(client, "q_rot_key") == [head, *behind]


def test_a_transaction_open_since_before_its_generation_ended_holds_the_truncation(rotating, redis_server):
    """A transaction that read the generation before it ended may still
    insert into it, and its rows are not visible to the rotation until it
    commits: the truncation waits for it, and its event is sent."""
    client = redis_server.client()
    # Every generation empty and truncated since, but the current one.
    rotate_until(rotating, ("advanced",), aged=True)
    clean_oldest(rotating)
    late = rotating.connect(autocommit=False)
    try:
        late_id = str(late.execute("SELECT outbox_enqueue('late', '{}', queue => 'q_rot_late')").fetchone()[0])
        for _ in range(2):
            rotate_until(rotating, ("advanced",), retention="1 second")
        steps = rotate_until(rotating, ("waiting", "moved", "truncated"), retention="1 second")
        assert steps[-1] == "waiting", steps
        late.commit()
    finally:
        late.close()
    wait_until(lambda: late_id in queued_ids(client, "q_rot_late"), message="the late event sent")
    assert "truncated" in rotate_until(rotating, ("truncated",), retention="1 second")
    assert late_id not in {str(r[0]) for r in rotating.sql("SELECT id FROM outbox.events")}


def test_an_event_needed_again_after_the_drain_is_moved_not_truncated(rotating, redis_server):
    client = redis_server.client()
    with rotating.connect() as conn:
        event = enqueue(conn, "q_rot_again")
    wait_until(lambda: event in queued_ids(client, "q_rot_again"), message="the event sent")
    rotate_to_oldest(rotating)
    assert rotate(rotating) == ("moved", 0)
    # A DBA sends it again tomorrow, after the drain and before the truncation
    # (in the table: the view refuses to move an event sent).
    rotating.sql("UPDATE outbox.log SET available_at = now() + interval '1 day' WHERE id = %s", (event,))
    assert rotate(rotating) == ("moved", 1)
    rotate_until(rotating, ("truncated",), aged=True)
    assert kept(rotating, [event])[event][0] == "pending"


def test_an_event_put_in_another_generation_under_a_taken_id_moves_on_with_a_new_id(rotating, redis_server):
    """An insert that names a generation can reuse an id that generation's
    primary key does not see: when the rotation moves it where that id is
    taken, it gets a new one (its last_error says so), and the rotation
    goes on."""
    client = redis_server.client()
    clean_oldest(rotating)
    with rotating.connect() as conn:
        taken = enqueue(conn, "q_rot_taken")
    wait_until(lambda: taken in queued_ids(client, "q_rot_taken"), message="the event sent")
    rotating.sql("UPDATE outbox.log SET status = 'failed', last_error = 'real' WHERE id = %s", (taken,))
    now = current(rotating)
    rotating.sql("INSERT INTO outbox.log (id, generation, event_type, queue, status, last_error) "
                 "VALUES (%s, %s, 'forged', 'q_rot_taken', 'failed', 'forged')", (taken, (now + 1) % 3))
    # Never current: it counts as ended now, and is kept as long.
    assert rotate(rotating)[0] == "ended"
    assert rotate(rotating) == (None, 0)
    rotating.age_generations()
    assert rotate(rotating) == ("moved", 1)
    assert rotate_until(rotating, ("advanced",), aged=True)[-2:] == ["truncated", "advanced"]
    letters = {r[0]: (str(r[1]), r[2]) for r in rotating.sql(
        "SELECT event_type, id, last_error FROM outbox.dead_letters WHERE queue = 'q_rot_taken'")}
    assert letters["e"] == (taken, "real")
    assert letters["forged"][0] != taken
    assert letters["forged"][1] == f"moved to generation {now} with a new id: {taken} was taken there"


def test_a_writer_that_copies_an_older_events_id_has_its_event_refused_unsent(rotating, redis_server):
    """A writer that learned the id of an event still waiting in an older
    generation (delayed an hour) writes one of its own under that id: the
    current generation's primary key does not see the other. Its event is
    dead-lettered unsent (a consumer's inbox, keyed by the task id, would
    have dropped the other's task as run); the other stays, and goes when
    due."""
    client = redis_server.client()
    victim = rotating.value("SELECT outbox_enqueue('victim', '{}', queue => 'q_copied', delay => '1 hour')")
    rotate_until(rotating, ("advanced",), aged=True)
    assert rotating.value("SELECT generation FROM outbox.log WHERE id = %s", (victim,)) != current(rotating)
    with rotating.connect_as("copier", "app") as writer:
        writer.execute("INSERT INTO outbox.events (id, event_type, payload, queue) "
                       "VALUES (%s, 'copy', '{}', 'q_copied')", (victim,))
    wait_until(lambda: rotating.value("SELECT count(*) FROM outbox.dead_letters WHERE event_type = 'copy'") == 1,
               message="the copy refused")
    assert rotating.value("SELECT last_error FROM outbox.dead_letters WHERE event_type = 'copy'").startswith(
        f"its id {victim} names an event written before it in another generation")
    assert client.llen("q_copied") == 0
    assert rotating.sql("SELECT event_type, status::text FROM outbox.events WHERE id = %s ORDER BY 1", (victim,)) \
        == [("copy", "failed"), ("victim", "pending")]
    # An id of its own, made by outbox_uuid_v7() once its generation began,
    # is not looked up; one a writer makes (version 4) is, and goes.
    with rotating.connect_as("copier", "app") as writer:
        writer.execute("INSERT INTO outbox.events (id, event_type, payload, queue) "
                       "VALUES (gen_random_uuid(), 'own', '{}', 'q_copied')")
    wait_until(lambda: client.llen("q_copied") == 1, message="a writer's own id sent")


def test_an_acknowledged_event_moved_under_a_new_id_stays_processed(rotating, redis_server):
    """Acknowledgements on: an event awaiting its acknowledgement is moved
    where a forged row took its id, so it gets a new one (and leaves its
    batch, whose positions no longer hold it); an outbox_ack() that did not
    see the move is kept: under its new id the event is processed, neither
    needed by the rotation nor sent again."""
    client = redis_server.client()
    event = awaiting_ack_in_the_oldest(rotating, client, "q_rot_ack_new")
    target = current(rotating)
    rotating.sql("INSERT INTO outbox.log (id, generation, event_type, queue, status, last_error) "
                 "VALUES (%s, %s, 'forged', 'q_rot_forged', 'failed', 'forged')", (event, target))
    acknowledged_unseeing_the_move(rotating, event)
    [moved] = [str(r[0]) for r in rotating.sql("SELECT id FROM outbox.events WHERE queue = 'q_rot_ack_new'")]
    assert moved != event
    assert kept(rotating, [moved])[moved][0] == "processed"
    assert not rotating.sql("SELECT FROM outbox.unfinished(%s::smallint, true) AS u WHERE u.id = %s",
                            (target, moved))
    rotating.configure(enabled="on", lifecycle_interval="1s")
    time.sleep(3)
    assert queued_ids(client, "q_rot_ack_new") == [event]
    assert kept(rotating, [moved])[moved][0] == "processed"


def test_under_load_and_a_crash_the_dispatchers_rotate_and_every_event_is_sent(outbox, redis_server):
    """The dispatchers' own lifecycle, with generations of half a second:
    claims and pushes go on beside the moves and truncations, the server
    crashes half way (an immediate stop, at whatever step the rotation
    was), and every committed event reaches Redis."""
    client = redis_server.client()
    outbox.configure(retention="1s", lifecycle_interval="1s")
    ids = []
    for half in range(2):
        with outbox.connect() as conn:
            for _ in range(20):
                ids += [str(r[0]) for r in conn.execute(
                    "SELECT outbox_enqueue('load', '{}', queue => 'q_rot_load') FROM generate_series(1, 50)")]
                conn.execute("SELECT pg_sleep(0.1)")
        if half == 0:
            outbox.stop("immediate")
            outbox.start()
    truncated = outbox.metric("outbox_purged_total")
    wait_until(lambda: len(set(queued_ids(client, "q_rot_load"))) == len(ids), timeout=60,
               message="every event sent")
    assert set(queued_ids(client, "q_rot_load")) == set(ids)
    wait_until(lambda: outbox.value("SELECT count(*) FROM outbox.events WHERE queue = 'q_rot_load'") == 0,
               timeout=60, message="every generation that held them truncated")
    assert outbox.metric("outbox_purged_total") > truncated


def test_an_event_put_in_another_generation_with_a_taken_turn_moves_on_without_it(rotating):
    """The keys' unique indexes hold per generation: a dead letter copied
    into another generation with its key's turn (key_seq) clashes with the
    original when the rotation moves it. It moves on without the turn (its
    last_error says so), and the rotation goes on."""
    rotating.configure(enabled="off")
    clean_oldest(rotating)
    now = current(rotating)
    original = str(rotating.value(
        "INSERT INTO outbox.log (event_type, queue, status, last_error, ordering_key, key_seq) "
        "VALUES ('e', 'q_rot_turn', 'failed', 'real', 'rot_turn', 7) RETURNING id"))
    copy = str(rotating.value(
        "INSERT INTO outbox.log (event_type, queue, status, last_error, ordering_key, key_seq, generation) "
        "VALUES ('e', 'q_rot_turn', 'failed', 'copied', 'rot_turn', 7, %s) RETURNING id", ((now + 1) % 3,)))
    assert rotate(rotating)[0] == "ended"
    rotating.age_generations()
    assert rotate(rotating) == ("moved", 1)
    rotate_until(rotating, ("advanced",), aged=True)
    assert kept(rotating, [original, copy]) == {
        original: ("failed", None, 7, False, "real"),
        copy: ("failed", None, None, False, f"moved to generation {now} without its turn of key rot_turn: "
                                            "7 was taken there")}


def test_rows_restored_into_a_generation_never_current_are_kept_and_sent(rotating, redis_server):
    """A dump restores each row into the partition it came from: one that
    was never current here counts as ended when the rotation first finds
    it, and is kept outbox.retention like the others; its pending events
    are sent, its records kept."""
    client = redis_server.client()
    rotating.configure(enabled="off")
    clean_oldest(rotating)
    spare = (current(rotating) + 1) % 3
    with rotating.connect() as conn:
        with conn.cursor().copy(f"COPY outbox.log_{spare} (event_type, queue, generation) FROM STDIN") as copy:
            for _ in range(20):
                copy.write_row(("restored", "q_rot_restored", spare))
    restored = {str(r[0]) for r in rotating.sql(f"SELECT id FROM outbox.log_{spare}")}
    assert len(restored) == 20
    assert rotate(rotating)[0] == "ended"
    for _ in range(5):
        assert rotate(rotating) == (None, 0)
    rotating.configure(enabled="on")
    wait_until(lambda: set(queued_ids(client, "q_rot_restored")) == restored, message="the restored events sent")


def test_a_snapshot_taken_before_the_moves_committed_holds_the_truncation(rotating):
    """A repeatable-read reader whose snapshot was taken while the moves
    were not yet committed sees a moved event only where it was: the
    truncation waits for that snapshot, whenever its transaction began."""
    rotating.configure(enabled="off")
    clean_oldest(rotating)
    event = str(rotating.value("SELECT outbox_enqueue('later', '{}', queue => 'q_rot_snap', delay => '1 day')"))
    rotate_to_oldest(rotating)
    mover = rotating.connect(autocommit=False)
    reader = rotating.connect(autocommit=False)
    try:
        assert mover.execute("SELECT step, events FROM outbox.rotate('2 seconds', 1000, false)").fetchone() \
            == ("moved", 1)
        reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT 1")
        mover.commit()
        rotating.age_generations()
        assert rotate(rotating)[0] == "waiting"
        assert reader.execute("SELECT count(*) FROM outbox.events WHERE id = %s", (event,)).fetchone()[0] == 1
        reader.commit()
    finally:
        mover.close()
        reader.close()
    rotate_until(rotating, ("truncated",), aged=True)
    assert kept(rotating, [event])[event][0] == "pending"


def test_an_acknowledgement_that_did_not_see_its_event_move_is_kept(rotating, redis_server):
    """Acknowledgements on: an event awaiting its acknowledgement moves on.
    An outbox_ack() whose snapshot predates the move writes the outcome in
    the generation the event was in; it follows the event before that
    generation is truncated, and the event stays processed."""
    client = redis_server.client()
    event = awaiting_ack_in_the_oldest(rotating, client, "q_rot_ack")
    acknowledged_unseeing_the_move(rotating, event)
    assert rotating.value("SELECT count(*) FROM outbox.outcomes WHERE %s = ANY (events)", (event,)) == 1
    assert kept(rotating, [event])[event][0] == "processed"
    assert rotating.value("SELECT count(*) FROM outbox.moved") == 0
