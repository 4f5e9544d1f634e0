"""The inbox helpers without a database: what claim() sends, and how once()
refuses what it cannot use (tests/test_inbox.py runs them against
PostgreSQL through a prefork Celery worker)."""

import time
import types
import uuid

import pytest

from outbox_dispatch import inbox


class Recorder:
    """A DB-API cursor that records the call and answers `answer`."""

    def __init__(self, answer):
        self.answer = answer
        self.calls = []

    def execute(self, sql, params):
        self.calls.append((sql, params))

    def fetchone(self):
        return (self.answer,)


def test_claim_names_the_message_and_the_consumer():
    cursor = Recorder(True)
    message = uuid.uuid4()
    assert inbox.claim(cursor, message, "billing") is True
    [(sql, params)] = cursor.calls
    assert "outbox_inbox_claim(id => CAST(%s AS pg_catalog.uuid), consumer => CAST(%s AS pg_catalog.text))" in sql
    assert params == (str(message), "billing")
    assert inbox.claim(Recorder(False), message) is False


def test_claim_refuses_what_it_cannot_send():
    with pytest.raises(TypeError, match="claim: consumer must be a string"):
        inbox.claim(Recorder(True), uuid.uuid4(), 7)
    with pytest.raises(TypeError, match="claim: conn must be a DB-API connection"):
        inbox.claim(object(), uuid.uuid4())


def test_once_refuses_a_using_it_cannot_open():
    task = types.SimpleNamespace(name="t", request=types.SimpleNamespace(id=str(uuid.uuid4())))

    @inbox.once(42)
    def body(task):
        return "ran"

    with pytest.raises(TypeError, match="once: using must be a Django database alias"):
        body(task)


class Transactional:
    """A psycopg-like connection: a context manager with transaction()."""

    def __init__(self, answer):
        self.cursor = Recorder(answer)
        self.transactions = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def transaction(self):
        self.transactions += 1
        return self

    def execute(self, sql, params):
        self.cursor.execute(sql, params)

    def fetchone(self):
        return self.cursor.fetchone()


@pytest.mark.parametrize("first", [True, False])
def test_once_runs_the_body_only_for_the_first_claim(first):
    conn = Transactional(first)
    task = types.SimpleNamespace(name="shop.charge", request=types.SimpleNamespace(id=str(uuid.uuid4())))

    @inbox.once(lambda: conn)
    def body(task, n, conn=None):
        return (n, conn)

    assert body(task, 7) == ((7, conn) if first else None)
    assert conn.transactions == 1
    assert conn.cursor.calls[0][1] == (task.request.id, "shop.charge")
    assert getattr(task.request, inbox.DUPLICATE_ATTRIBUTE, False) is (not first)


class Backend:
    """A result backend holding the first run's outcome, or nothing."""

    def __init__(self, status):
        self.status = status
        self.asked = 0

    def get_task_meta(self, task_id, cache=True):
        self.asked += 1
        return {"status": self.status, "result": 7 if self.status else None}


def duplicate(backend, ignore_result=False, outcome_wait=0.3):
    """A skipped duplicate's request, after the run."""
    conn = Transactional(False)
    request = types.SimpleNamespace(id=str(uuid.uuid4()), ignore_result=ignore_result,
                                    callbacks=[{"task": "next"}], chain=[{"task": "then"}], chord={"task": "joined"})

    @inbox.once(lambda: conn, outcome_wait=outcome_wait)
    def body(task, conn=None):
        return "ran"

    task = types.SimpleNamespace(name="shop.charge", request=request, backend=backend, ignore_result=ignore_result)
    assert body(task) is None
    assert getattr(request, inbox.DUPLICATE_ATTRIBUTE) is True
    return request


def test_a_duplicate_of_a_first_run_that_finished_leaves_its_outcome_to_celery():
    """The result backend holds the first run's SUCCESS, stored after its
    callbacks were sent: the duplicate stores no result (Celery's trace
    reads ignore_result from the request), and has no callbacks, chain or
    chord to send again."""
    request = duplicate(Backend("SUCCESS"))
    assert (request.ignore_result, request.callbacks, request.chain, request.chord) == (True, None, None, None)


@pytest.mark.parametrize("backend, ignore_result", [(None, False), (Backend(None), False), (Backend("SUCCESS"), True)])
def test_a_duplicate_of_a_first_run_that_may_have_died_sends_its_callbacks(backend, ignore_result):
    """No result backend, nothing stored within outcome_wait (the first run
    died after its commit, before its callbacks), or results ignored (the
    backend cannot tell): callbacks, chain and chord are sent, at least
    once, rather than never."""
    started = time.monotonic()
    request = duplicate(backend, ignore_result)
    assert request.callbacks == [{"task": "next"}] and request.chain == [{"task": "then"}]
    assert request.chord == {"task": "joined"} and request.ignore_result is ignore_result
    if isinstance(backend, Backend) and not ignore_result:
        assert 0.3 <= time.monotonic() - started < 2 and backend.asked > 1, "it waited for the outcome"
