"""Sending events again and discarding them by filter: outbox_resend() and
outbox_discard(), the outbox's owner's alone, bounded per call, refused
with an error that names the argument when they would act on nothing
named, and logged. The hostile cases first: each role class of the docs
refused, a call that names no event, a status they cannot act on."""

import re
import threading
import time
from collections import Counter

import psycopg
import pytest

from harness import ROOT, queued_ids, wait_until
from standalone import HOST, dsn, run

RESEND = "SELECT outbox_resend({})"
DISCARD = "SELECT outbox_discard({})"


@pytest.mark.parametrize("role, documented", [("outbox_writer", "app"), ("outbox_grafana", "grafana"),
                                              ("outbox_ops", "ops")])
def test_no_role_but_the_owner_resends_or_discards(outbox, role, documented):
    outbox.configure(enabled="off")
    event = outbox.value("SELECT outbox_enqueue('e', '{}', queue => 'q_role')")
    with outbox.connect(user=outbox.owner) as conn:
        conn.execute(f"GRANT EXECUTE ON FUNCTION outbox_resend(uuid[], text, text, text, outbox.event_status, "
                     f"timestamptz, timestamptz, integer), outbox_discard(uuid[], text, text, text, "
                     f"outbox.event_status, timestamptz, timestamptz, integer) TO PUBLIC")
    try:
        with outbox.connect_as(role, documented) as conn:
            for call in (RESEND, DISCARD):
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match="only the outbox's owner"):
                    conn.execute(call.format("queue => 'q_role'"))
    finally:
        with outbox.connect(user=outbox.owner) as conn:
            conn.execute("REVOKE EXECUTE ON FUNCTION outbox_resend(uuid[], text, text, text, outbox.event_status, "
                         "timestamptz, timestamptz, integer), outbox_discard(uuid[], text, text, text, "
                         "outbox.event_status, timestamptz, timestamptz, integer) FROM PUBLIC")
    assert outbox.value("SELECT count(*) FROM outbox.log WHERE id = %s", (event,)) == 1


@pytest.mark.parametrize("arguments, refusal", [
    ("", "name the events"),
    ("status => 'pending'", "status is pending, it must be one of dispatched, processed, failed"),
    ("queue => 'q', max_events => 0", "max_events is 0, it must be 1 to 100000"),
    ("queue => 'q', max_events => 100001", "max_events is 100001"),
])
def test_a_resend_that_names_nothing_it_may_send_is_refused(outbox, arguments, refusal):
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=refusal):
        outbox.sql(RESEND.format(arguments))


def test_a_discard_of_what_was_sent_is_refused(outbox):
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="status is dispatched, it must be one of pending, failed"):
        outbox.sql(DISCARD.format("status => 'dispatched'"))


def test_resend_sends_again_what_was_sent_and_dead_lettered_by_filter_in_bounded_calls(outbox, redis_server):
    client = redis_server.client()
    with outbox.connect() as conn:
        sent = [str(r[0]) for r in conn.execute(
            "SELECT outbox_enqueue('e', '{}', queue => 'q_resend', task => t) "
            "FROM unnest('{a,a,a,b}'::text[]) AS t").fetchall()]
        dead = str(conn.execute("INSERT INTO outbox.log (event_type, queue, status, last_error) "
                                "VALUES ('e', 'q_resend', 'failed', 'dead') RETURNING id").fetchone()[0])
    wait_until(lambda: sorted(queued_ids(client, "q_resend")) == sorted(sent), message="the first sends")
    wait_until(lambda: outbox.value("SELECT count(*) FROM outbox.events WHERE status = 'dispatched'") == 4,
               message="marked")
    # Paused: what is sent again stays in line until the calls are done.
    outbox.configure(enabled="off")
    wait_until(lambda: outbox.value("SELECT bool_and(state = 'paused') FROM outbox.workers") is not False,
               message="paused")
    # Bounded: two of task a, then the third; task b's untouched.
    assert outbox.value(RESEND.format("queue => 'q_resend', task => 'a', max_events => 2")) == 2
    assert outbox.value(RESEND.format("queue => 'q_resend', task => 'a', status => 'dispatched', "
                                      "max_events => 2")) == 1
    assert outbox.value(RESEND.format("ids => ARRAY[%s]::uuid[]"), (dead,)) == 1
    outbox.configure(enabled="on")
    wait_until(lambda: len(queued_ids(client, "q_resend")) == 8, message="the events sent again")
    time.sleep(1)
    counts = Counter(queued_ids(client, "q_resend"))
    assert counts == Counter({**{e: 2 for e in sent[:3]}, sent[3]: 1, dead: 1}), counts
    rows = dict(outbox.sql("SELECT id::text, deliveries FROM outbox.events WHERE queue = 'q_resend'"))
    assert [rows[e] for e in sent] == [2, 2, 2, 1] and rows[dead] == 1
    assert outbox.value("SELECT last_error FROM outbox.events WHERE id = %s", (sent[0],)) \
        .startswith("sent again by outbox_resend() (role postgres")
    assert "outbox_resend: role postgres sent 2 events again" in outbox.log_text()


def test_discard_deletes_what_is_not_sent_and_passes_a_key_on(outbox, redis_server):
    client = redis_server.client()
    outbox.configure(enabled="off")
    with outbox.connect() as conn:
        unwanted = [str(r[0]) for r in conn.execute(
            "SELECT outbox_enqueue('poison', '{}', queue => 'q_discard') FROM generate_series(1, 3)").fetchall()]
        head = str(conn.execute("SELECT outbox_enqueue('k', '{}', queue => 'q_discard', ordering_key => 'k')")
                   .fetchone()[0])
        behind = str(conn.execute("SELECT outbox_enqueue('k', '{}', queue => 'q_discard', ordering_key => 'k')")
                     .fetchone()[0])
    assert outbox.value(DISCARD.format("event_type => 'poison'")) == 3
    assert outbox.value(DISCARD.format("ids => ARRAY[%s]::uuid[]"), (head,)) == 1
    assert outbox.value("SELECT count(*) FROM outbox.log WHERE id = ANY (%s::uuid[])", (unwanted + [head],)) == 0
    outbox.configure(enabled="on")
    wait_until(lambda: queued_ids(client, "q_discard") == [behind], timeout=30,
               message="the key's next event sent once its head was discarded")
    assert "outbox_discard: role postgres discarded 3 events" in outbox.log_text()


def test_a_discard_that_races_a_claim_takes_nothing_the_claim_holds(outbox, redis_server):
    """A claim reads events without writing them: a discard whose snapshot
    was taken before the claim committed would delete an event being
    pushed. It waits for the claims' turn; the event, claimed meanwhile, is
    processing, not taken, and is sent."""
    outbox.configure(processing_timeout="2s", sweep_interval="1s", broker_timeout="200ms", max_payload_bytes="10kB",
                     enabled="off")
    wait_until(lambda: outbox.value("SELECT state FROM outbox.workers") == "paused", message="the pause")
    (event,) = [str(r[0]) for r in outbox.sql("SELECT outbox_enqueue('raced', '{}', queue => 'q_raced_discard')")]
    discarded = {}
    with outbox.connect(autocommit=False) as claim:
        outbox.take_turn(claim)
        outbox.prepare_claim(claim)
        assert [str(r[0]) for r in claim.execute("EXECUTE claim(100, 7)").fetchall()] == [event]
        racing = threading.Thread(target=lambda: discarded.update(
            n=outbox.value("SELECT outbox_discard(ids => ARRAY[%s]::uuid[])", (event,))))
        racing.start()
        time.sleep(1)
        claim.commit()
        racing.join(timeout=30)
    assert discarded == {"n": 0}
    assert outbox.value("SELECT status::text FROM outbox.events WHERE id = %s", (event,)) == "processing"
    outbox.sql("UPDATE outbox.batches SET claimed_at = now() - interval '1 minute' WHERE dispatcher = 7")
    outbox.configure(enabled="on")
    wait_until(lambda: event in queued_ids(redis_server.client(), "q_raced_discard"), message="the event sent")


def runbook_statements(host):
    """The SQL the runbook gives (docs/operations/runbook.md) for `host`
    (its rows that begin "sidecar:" are the sidecar's alone), with its
    placeholders filled; those it gives only as a shape (`UPDATE … SET`)
    left out."""
    page = (ROOT / "docs" / "operations" / "runbook.md").read_text()
    found = []
    for line in page.splitlines():
        if line.startswith("| sidecar:") != (host == "sidecar"):
            continue
        for snippet in re.findall(r"`([^`]+)`", line):
            if not re.match(r"(SELECT|TABLE|UPDATE|INSERT|DELETE|ALTER|WITH) ", snippet):
                continue
            statement = snippet.replace("= …", "= NULL").replace("IN (…)", "IN (NULL)").replace("oid = N", "oid = 0")
            if "…" not in statement and statement != "ALTER TABLE":
                found.append(statement)
    return sorted(set(found))


def test_every_runbook_command_runs_as_written(outbox):
    """Each statement of the runbook for this mode runs, as its owner would
    run it, on an outbox that has every kind of row (in a transaction
    rolled back)."""
    statements = runbook_statements(HOST)
    if HOST == "sidecar":
        assert any("outbox.sidecar_leases" in s for s in statements), statements
    else:
        assert any("outbox_resend" in s for s in statements), statements
    outbox.sql("SELECT outbox_enqueue('e', '{}', queue => 'q_runbook')")
    for statement in statements:
        with outbox.connect(autocommit=False, user=outbox.owner) as conn:
            try:
                conn.execute(statement)
            except psycopg.errors.InsufficientPrivilege:
                # The server's own views and settings (pg_reload_conf()):
                # a superuser's, as the runbook's reader is.
                conn.rollback()
                with outbox.connect(autocommit=False) as superuser:
                    superuser.execute(statement)
                    superuser.rollback()
            conn.rollback()


def test_the_command_resends_and_discards_by_filter_until_none_is_left(outbox, redis_server):
    """`outbox-dispatch resend` and `discard`, as the outbox's owner; a
    discard with --all calls again while a call takes --max-events (a
    resend may not: what it sent is sent meanwhile, and would be again)."""
    client = redis_server.client()
    sent = [str(r[0]) for r in outbox.sql(
        "SELECT outbox_enqueue('e', '{}', queue => 'q_cli') FROM generate_series(1, 5)")]
    wait_until(lambda: sorted(queued_ids(client, "q_cli")) == sorted(sent), message="the first sends")
    wait_until(lambda: outbox.value("SELECT count(*) FROM outbox.events WHERE status = 'dispatched'") == 5,
               message="marked")
    to = f"{dsn(outbox, outbox.owner, 'postgres')} sslmode=disable"
    assert run("resend", "--dsn", to, "--queue", "q_cli", "--all").returncode == 2
    resent = run("resend", "--dsn", to, "--queue", "q_cli", "--max-events", "5")
    assert resent.returncode == 0, resent.stderr
    assert resent.stdout.strip() == "outbox-dispatch: sent 5 events again"
    wait_until(lambda: len(queued_ids(client, "q_cli")) == 10, message="sent again")
    outbox.configure(enabled="off")
    later = [str(r[0]) for r in outbox.sql(
        "SELECT outbox_enqueue('e', '{}', queue => 'q_cli', delay => '1 hour') FROM generate_series(1, 5)")]
    discarded = run("discard", "--dsn", to, "--id", later[0])
    assert discarded.returncode == 0 and discarded.stdout.strip() == "outbox-dispatch: discarded 1 events"
    discarded = run("discard", "--dsn", to, "--queue", "q_cli", "--status", "pending", "--max-events", "2", "--all")
    assert discarded.returncode == 0 and discarded.stdout.strip() == "outbox-dispatch: discarded 4 events"
    refused = run("discard", "--dsn", to, "--status", "dispatched", "--queue", "q_cli")
    assert refused.returncode == 1 and "status is dispatched, it must be one of pending, failed" in refused.stderr
    assert "--max-events" in run("resend", "--help").stdout
