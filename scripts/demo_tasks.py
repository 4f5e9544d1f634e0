"""The demo's Celery application: one task, executed by a stock Celery 5
worker from what outbox_dispatch pushed to Redis."""

import os

from celery import Celery

app = Celery("outbox_demo", broker=os.environ["OUTBOX_DEMO_BROKER"])
app.conf.update(broker_connection_retry_on_startup=True, task_ignore_result=True)


@app.task(name="accounts.send_welcome_email")
def send_welcome_email(user_id, email):
    print(f"[demo] welcome email to user {user_id} <{email}>", flush=True)
