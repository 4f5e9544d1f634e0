import pytest

from harness import CeleryWorker, Redis
from standalone import new_cluster


@pytest.fixture(scope="session")
def redis_server():
    server = Redis()
    yield server
    server.close()


@pytest.fixture(scope="session")
def cluster(redis_server):
    """One cluster for the tests that need no special postmaster settings."""
    pg = new_cluster(redis_server.url)
    try:
        pg.install()
        yield pg
    finally:
        pg.close()


@pytest.fixture(scope="session")
def celery_worker(redis_server):
    worker = CeleryWorker(redis_server.url)
    yield worker
    worker.close()


@pytest.fixture
def outbox(cluster, redis_server):
    """The shared cluster with an empty outbox and an empty Redis."""
    cluster.reset(enabled="on")
    cluster.empty()
    redis_server.client().flushdb()
    yield cluster


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "broker_only: what it tests is the broker's side alone (a cluster, a restart, an alarm, "
        "a peer's faults, Kafka's protocol): .ci/run runs it under its first PostgreSQL version only")
