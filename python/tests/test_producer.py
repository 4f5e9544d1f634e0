"""enqueue() without a database: what it sends to outbox_enqueue(), through
the DB-API cursor protocol (a recording cursor stands in for the driver;
tests/test_enqueue.py runs it against PostgreSQL with every driver)."""

import datetime as dt
import json
import uuid

import pytest

from outbox_dispatch import enqueue, publish


class Recorder:
    """A DB-API cursor that records the call and returns an id."""

    def __init__(self):
        self.calls = []

    def execute(self, sql, params):
        self.calls.append((sql, params))

    def fetchone(self):
        return ("0190b5a8-3c4e-7d2a-9b1f-2e6a5c4d3b2a",)

    @property
    def sent(self):
        [(sql, params)] = self.calls
        names = ("event_type", "payload", "queue", "task", "headers", "delay", "priority", "expires", "args",
                 "ordering_key")
        return dict(zip(names, params))


class Named:
    name = "shop.send_receipt"


def test_args_and_kwargs_and_the_task_name():
    cursor = Recorder()
    event = enqueue(cursor, Named(), args=(1, "a"), kwargs={"lang": "fr"}, queue="emails", priority=3)
    assert event == uuid.UUID("0190b5a8-3c4e-7d2a-9b1f-2e6a5c4d3b2a")
    sent = cursor.sent
    assert (sent["event_type"], sent["task"], sent["queue"], sent["priority"]) == (
        "shop.send_receipt", "shop.send_receipt", "emails", 3)
    assert json.loads(sent["payload"]) == {"lang": "fr"} and json.loads(sent["args"]) == [1, "a"]
    assert sent["delay"] is None and sent["expires"] is None and sent["headers"] is None


def test_without_args_the_payload_alone_carries_the_kwargs():
    cursor = Recorder()
    enqueue(cursor, "t", event_type="order.created")
    assert (cursor.sent["payload"], cursor.sent["args"], cursor.sent["event_type"]) == ("{}", None, "order.created")
    assert cursor.sent["priority"] == 0


def test_times_in_celery_forms():
    cursor = Recorder()
    enqueue(cursor, "t", countdown=dt.timedelta(seconds=90), expires=3600)
    assert (cursor.sent["delay"], cursor.sent["expires"]) == ("90.000000 seconds", "3600.000000 seconds")

    cursor = Recorder()
    soon = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=10)
    enqueue(cursor, "t", eta=soon.replace(tzinfo=None), expires=soon + dt.timedelta(minutes=5))
    delay = float(cursor.sent["delay"].split()[0])
    expires = float(cursor.sent["expires"].split()[0])
    assert 590 < delay <= 600 and 890 < expires <= 900

    cursor = Recorder()
    enqueue(cursor, "t", eta=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc))
    assert cursor.sent["delay"] == "0.000000 seconds", "an eta in the past: at once"


def test_datetimes_and_uuids_travel_as_kombu_encodes_them():
    cursor = Recorder()
    when = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)
    enqueue(cursor, "t", kwargs={"when": when, "ref": uuid.UUID(int=1)})
    from kombu.utils.json import loads

    assert loads(cursor.sent["payload"]) == {"when": when, "ref": uuid.UUID(int=1)}


def test_the_callers_headers_win_over_the_lineage_and_trace():
    cursor = Recorder()
    enqueue(cursor, "t", headers={"traceparent": "mine", "tenant": "a"})
    assert json.loads(cursor.sent["headers"]) == {"traceparent": "mine", "tenant": "a"}


def test_bad_calls_are_refused_before_the_database():
    with pytest.raises(ValueError, match="countdown or eta"):
        enqueue(Recorder(), "t", countdown=1, eta=dt.datetime.now())
    with pytest.raises(TypeError, match="task must be a Celery task or a task name"):
        enqueue(Recorder(), 42)
    with pytest.raises(TypeError, match="kwargs cannot be sent as JSON"):
        enqueue(Recorder(), "t", kwargs={"x": object()})
    with pytest.raises(TypeError, match="conn must be a DB-API connection"):
        enqueue(object(), "t")
    with pytest.raises(TypeError, match="enqueue: ordering_key must be a string or None, not int"):
        enqueue(Recorder(), "t", ordering_key=42)


def test_an_ordering_key_travels_as_given():
    cursor = Recorder()
    enqueue(cursor, "t", ordering_key="order:42")
    assert cursor.sent["ordering_key"] == "order:42"
    cursor = Recorder()
    publish(cursor, "order.paid", {"order": 42}, ordering_key="order:42")
    assert cursor.sent["ordering_key"] == "order:42"
    cursor = Recorder()
    enqueue(cursor, "t")
    assert cursor.sent["ordering_key"] is None


def test_publish_sends_no_task_so_that_subscriptions_route_the_event():
    cursor = Recorder()
    event = publish(cursor, "order.created", {"order": 7}, countdown=5, priority=2, headers={"h": 1})
    assert event == uuid.UUID("0190b5a8-3c4e-7d2a-9b1f-2e6a5c4d3b2a")
    sent = cursor.sent
    assert (sent["event_type"], sent["task"], sent["args"], sent["priority"]) == ("order.created", None, None, 2)
    assert json.loads(sent["payload"]) == {"order": 7} and json.loads(sent["headers"]) == {"h": 1}
    assert sent["delay"] == "5.000000 seconds"


def test_publish_refuses_what_it_cannot_send():
    with pytest.raises(TypeError, match="publish: event_type must be a non-empty string"):
        publish(Recorder(), "")
    with pytest.raises(TypeError, match="publish: payload cannot be sent as JSON"):
        publish(Recorder(), "order.created", {"x": object()})
    with pytest.raises(ValueError, match="publish: give countdown or eta, not both"):
        publish(Recorder(), "order.created", countdown=1, eta=dt.datetime.now())


def test_asyncpg_gets_every_argument_as_text_cast_by_the_statement():
    """asyncpg types a parameter as the server infers it: each is sent as
    text, and the statement's casts make it what outbox_enqueue() takes
    (priority among them, which DB-API drivers send as a number)."""
    from outbox_dispatch.producer import ENQUEUE

    assert "priority => CAST($7::pg_catalog.text AS integer)" in ENQUEUE.numbered_sql
    assert "delay => CAST($6::pg_catalog.text AS interval)" in ENQUEUE.numbered_sql
    assert "ordering_key => $10::pg_catalog.text" in ENQUEUE.numbered_sql
    assert ENQUEUE.format_sql.count("%s") == ENQUEUE.numbered_sql.count("::pg_catalog.text") == 10
