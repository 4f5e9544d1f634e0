"""outbox.events read at the speed of the table: what it says of every row
agrees with what 1.0.0 derived row by row; a filter on the status reads the
index of the rows that may have it; writes through it are outbox.log's,
and a write of what became of an event is refused, leaving nothing."""

import re

import psycopg
import pytest

from harness import queued_ids, wait_until

# What 1.0.0's view said of each row (the functions it called are kept).
ROW_BY_ROW = """
SELECT l.id::text, outbox.event_status(l.status, l.pending_xid, l.id, l.key_state)::text,
       l.deliveries + (outbox.batch_of(l.pending_xid, l.id) IS NOT NULL)::integer,
       outbox.batch_of(l.pending_xid, l.id)
  FROM outbox.log AS l ORDER BY 1"""
NOW = "SELECT id::text, status::text, deliveries, batch FROM outbox.events ORDER BY 1"


def plan(pg, query):
    """The plan of `query`, where any index would do (an empty partition
    is read whole otherwise, at no cost)."""
    with pg.connect() as conn:
        conn.execute("SET enable_seqscan = off")
        return "\n".join(r[0] for r in conn.execute(f"EXPLAIN {query}"))


def test_a_write_of_what_became_of_an_event_is_refused_and_leaves_nothing(outbox):
    outbox.configure(enabled="off")
    for statement in ["INSERT INTO outbox.events (event_type, status) VALUES ('e', 'failed')",
                      "INSERT INTO outbox.events (event_type, deliveries) VALUES ('e', 3)",
                      "INSERT INTO outbox.events (event_type, batch) VALUES ('e', 1)"]:
        column = re.search(r"\((?:event_type, )(\w+)\)", statement)[1]
        with pytest.raises(psycopg.errors.FeatureNotSupported, match=f'column "{column}" of view "outbox.events"'):
            outbox.sql(statement)
    assert outbox.value("SELECT count(*) FROM outbox.log") == 0
    event = outbox.value("SELECT outbox_enqueue('e', '{}', queue => 'q_refused')")
    for column, value in [("status", "'failed'"), ("deliveries", "7"), ("batch", "1")]:
        with pytest.raises(psycopg.errors.FeatureNotSupported, match=f'column "{column}"'):
            outbox.sql(f"UPDATE outbox.events SET {column} = {value}, last_error = 'x' WHERE id = %s", (event,))
    assert outbox.sql("SELECT status::text, last_error FROM outbox.events WHERE id = %s", (event,)) \
        == [("pending", None)]


def test_an_orm_writes_through_the_view_as_through_the_table(outbox, redis_server):
    """INSERT ... RETURNING with the table's defaults, an UPDATE of a
    payload that leaves a sent event where it is, one of available_at that
    hurries a delayed one, and a DELETE."""
    client = redis_server.client()
    row = outbox.sql("INSERT INTO outbox.events (event_type, queue) VALUES ('orm', 'q_orm') "
                     "RETURNING id, payload, status::text, deliveries, batch, created_at IS NOT NULL, pending_xid")[0]
    sent, payload, status, deliveries, batch, created, pending_xid = row
    assert (payload, status, deliveries, batch, created) == ({}, "pending", 0, None, True) and pending_xid
    wait_until(lambda: str(sent) in queued_ids(client, "q_orm"), message="the ORM's event sent")
    wait_until(lambda: outbox.value("SELECT status::text FROM outbox.events WHERE id = %s", (sent,)) == "dispatched",
               message="marked")
    assert outbox.sql("UPDATE outbox.events SET payload = '{\"edited\": 1}' WHERE id = %s RETURNING status::text",
                      (sent,)) == [("dispatched",)]
    delayed = outbox.value("SELECT outbox_enqueue('e', '{}', queue => 'q_orm', delay => '1 hour')")
    outbox.sql("UPDATE outbox.events SET available_at = now() WHERE id = %s", (delayed,))
    wait_until(lambda: str(delayed) in queued_ids(client, "q_orm"), message="the hurried event")
    assert queued_ids(client, "q_orm").count(str(sent)) == 1
    assert outbox.sql("DELETE FROM outbox.events WHERE id = %s RETURNING id", (sent,)) == [(sent,)]
    assert outbox.value("SELECT count(*) FROM outbox.log WHERE id = %s", (sent,)) == 0


def test_every_row_says_what_1_0_0_derived_of_it(outbox, redis_server):
    """Events in each state at once: sent and reported (processed),
    sent (dispatched), claimed and not marked (processing), in line and not
    read, delayed, waiting for their key, dead letters. The view says of
    each what 1.0.0's per-row functions say."""
    client = redis_server.client()
    outbox.configure(report_key="", ack_timeout="1h", batch_size=3)
    with outbox.connect() as conn:
        sent = [str(r[0]) for r in conn.execute(
            "SELECT outbox_enqueue('e', '{}', queue => 'q_states') FROM generate_series(1, 7)").fetchall()]
    wait_until(lambda: set(sent) <= set(queued_ids(client, "q_states")), message="the first sent")
    wait_until(lambda: outbox.value("SELECT count(*) FROM outbox.events WHERE status = 'dispatched'") == 7,
               message="marked")
    sends = {m["headers"]["id"]: m["headers"]["outbox_send"]
             for m in (__import__("json").loads(raw) for raw in client.lrange("q_states", 0, -1))}
    for event in sent[:4]:
        assert outbox.value("SELECT outbox_ack(%s, %s)", (event, sends[event])) is True
    outbox.configure(enabled="off")
    wait_until(lambda: outbox.value("SELECT bool_and(state = 'paused') FROM outbox.workers") is not False,
               message="paused")
    with outbox.connect() as conn:
        conn.execute("SELECT outbox_enqueue('e', '{}', queue => 'q_states') FROM generate_series(1, 4)")
        conn.execute("SELECT outbox_enqueue('e', '{}', queue => 'q_states', delay => '1 hour')")
        conn.execute("SELECT outbox_enqueue('e', '{}', queue => 'q_states', ordering_key => 'k') "
                     "FROM generate_series(1, 2)")
        conn.execute("INSERT INTO outbox.log (event_type, queue, status, last_error) "
                     "VALUES ('e', 'q_states', 'failed', 'dead')")
    # Two of the four new ones claimed and not marked.
    unmarked = outbox.claim_as(9, 2)
    assert unmarked
    statuses = dict(outbox.sql("SELECT status::text, count(*) FROM outbox.events GROUP BY 1"))
    assert statuses == {"processed": 4, "dispatched": 3, "processing": 2, "pending": 5, "failed": 1}, statuses
    assert outbox.sql(NOW) == outbox.sql(ROW_BY_ROW)
    for status in statuses:
        assert outbox.value("SELECT count(*) FROM outbox.events WHERE status = %s", (status,)) == statuses[status]


@pytest.mark.parametrize("filter_", ["status = 'failed'", "status = 'pending'", "status IN ('pending', 'processing')",
                                     "status = 'processing'"])
def test_the_status_filters_people_write_read_indexes(outbox, filter_):
    """Each reads no partition of outbox.log whole, and asks nothing of the
    events sent (outbox.state_at()): the one branch that would (rows a
    restore wrote with the triggers off) is never run without such a
    restore."""
    outbox.configure(enabled="off")
    outbox.sql("SELECT outbox_enqueue('e', '{}', queue => 'q_plan') FROM generate_series(1, 3000)")
    outbox.sql("ANALYZE outbox.log")
    query = f"SELECT * FROM outbox.events WHERE {filter_}"
    assert not re.search(r"Seq Scan on log_\d", plan(outbox, query)), plan(outbox, query)
    with outbox.connect() as conn:
        lines = [r[0] for r in conn.execute(f"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) {query}")]
    for i, line in enumerate(lines):
        if "state_at" in line:
            node = next(lines[j] for j in range(i, -1, -1) if "->" in lines[j])
            assert "never executed" in node, "\n".join(lines)
