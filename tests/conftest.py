import pytest

from harness import CeleryWorker, Cluster, Redis


@pytest.fixture(scope="session")
def redis_server():
    server = Redis()
    yield server
    server.close()


@pytest.fixture(scope="session")
def cluster(redis_server):
    """One cluster for the tests that need no special postmaster settings."""
    pg = Cluster(redis_server.url)
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
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
    cluster.sql("ALTER SYSTEM RESET ALL")
    cluster.configure(enabled="on")
    cluster.sql("TRUNCATE outbox.log, outbox.batches, outbox.outcomes")
    redis_server.client().flushdb()
    yield cluster


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "broker_only: what it tests is the broker's side alone (a cluster, a restart, an alarm): "
        ".ci/run runs it under its first PostgreSQL version only")
