"""outbox_dispatch.celery's sending policy, without a broker: a report that
cannot be appended is retried, then logged, and never raised into the task."""

import logging

import pytest

import outbox_dispatch.celery as companion


class Channel:
    def __init__(self, client):
        self.client = client

    def basic_publish(self, message, exchange, routing_key, mandatory, confirm_timeout):
        self.client.published(message, exchange, routing_key, mandatory, confirm_timeout)


class Transport:
    def __init__(self, driver_type):
        self.driver_type = driver_type


class Connection:
    def __init__(self, client, driver_type):
        self.default_channel = Channel(client)
        self.transport = Transport(driver_type)
        self.released = False

    def release(self):
        self.released = True


class Conf:
    broker_transport_options = {"visibility_timeout": 60}


class App:
    """Hands out connections (Redis's, or py-amqp's with `amqp`) whose
    client fails `failures` times."""

    conf = Conf()

    def __init__(self, failures, amqp=False):
        self.failures = failures
        self.pushed = []
        self.opened = 0
        self.options = []
        self.driver_type = "amqp" if amqp else "redis"

    def connection_for_write(self, transport_options):
        self.opened += 1
        self.options.append(transport_options)
        return Connection(self, self.driver_type)

    def rpush(self, key, body):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("broker gone")
        self.pushed.append((key, body))

    def published(self, message, exchange, routing_key, mandatory, confirm_timeout):
        assert (exchange, mandatory, confirm_timeout) == ("", True, companion.TIMEOUT_SECONDS)
        assert message.properties["delivery_mode"] == 2
        assert message.properties["content_type"] == "application/json"
        self.rpush(routing_key, message.body)


@pytest.fixture(autouse=True)
def fresh_link(monkeypatch):
    monkeypatch.setattr(companion, "_link", companion._Link())
    monkeypatch.setattr(companion, "PAUSE_SECONDS", 0)


def test_a_failed_append_reconnects_and_succeeds():
    app = App(failures=2)
    companion._send(app, "reports", "t1", b"{}")
    assert app.pushed == [("reports", b"{}")]
    assert app.opened == 3, "a fresh connection after each failure"


def test_a_report_that_cannot_be_sent_is_logged_not_raised(caplog):
    app = App(failures=companion.ATTEMPTS)
    with caplog.at_level(logging.ERROR, logger="outbox_dispatch.celery"):
        companion._send(app, "reports", "t2", b"{}")
    assert app.pushed == []
    assert "could not report the outcome of task t2" in caplog.text


def test_the_connection_is_kept_between_reports():
    app = App(failures=0)
    for n in range(3):
        companion._send(app, "reports", f"t{n}", b"{}")
    assert app.opened == 1 and len(app.pushed) == 3


def test_on_amqp_a_report_is_a_confirmed_mandatory_persistent_message():
    app = App(failures=1, amqp=True)
    companion._send(app, "reports:5", "t1", b'{"id": "t1"}')
    assert app.pushed == [("reports:5", b'{"id": "t1"}')]
    assert app.opened == 2
    # The app's own transport options are kept; confirms and deadlines added.
    assert app.options[0] == {"visibility_timeout": 60, "confirm_publish": True,
                              "read_timeout": companion.TIMEOUT_SECONDS, "write_timeout": companion.TIMEOUT_SECONDS}
