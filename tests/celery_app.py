"""The Celery application the integration tests and the demo run: a stock
Celery 5 worker, consuming what outbox_dispatch pushed. Each task records
what it received in the Redis hash `executed`, keyed by task id."""

import json
import os

import redis
from celery import Celery

BROKER = os.environ.get("OUTBOX_TEST_BROKER", "redis://127.0.0.1:6379/0")

app = Celery("outbox_tests", broker=BROKER)
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_ignore_result=True,
)

# Where tasks record what they ran: the broker unless it is no Redis.
_results = redis.Redis.from_url(os.environ.get("OUTBOX_TEST_NOTES", BROKER))


@app.task(name="tests.record", bind=True)
def record(self, *args, **kwargs):
    received = {
        "args": list(args),
        "kwargs": kwargs,
        "event_type": self.request.get("outbox_event_type"),
        "traceparent": self.request.get("traceparent"),
    }
    _results.hset("executed", self.request.id, json.dumps(received))
    return received
