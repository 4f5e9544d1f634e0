"""outbox_dispatch.celery's sending policy, without a broker: a report that
cannot be appended is retried, then logged, and never raised into the task."""

import logging

import pytest

import outbox_dispatch.celery as companion


class Channel:
    def __init__(self, client):
        self.client = client


class Connection:
    def __init__(self, client):
        self.default_channel = Channel(client)
        self.released = False

    def release(self):
        self.released = True


class App:
    """Hands out connections whose client fails `failures` times."""

    def __init__(self, failures):
        self.failures = failures
        self.pushed = []
        self.opened = 0

    def connection_for_write(self):
        self.opened += 1
        return Connection(self)

    def rpush(self, key, body):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("broker gone")
        self.pushed.append((key, body))


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
