"""The demo's Celery application: stock Celery 5 executing what
outbox_dispatch pushed to Redis, with outbox_dispatch.celery imported so
that each outcome comes back to outbox.events."""

import os

from celery import Celery

app = Celery("outbox_demo", broker=os.environ["OUTBOX_DEMO_BROKER"])
app.conf.update(
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    imports=["outbox_dispatch.celery"],
)


class CardDeclined(Exception):
    pass


@app.task(name="accounts.send_welcome_email")
def send_welcome_email(user_id, email):
    print(f"[demo] welcome email to user {user_id} <{email}>", flush=True)


@app.task(name="billing.charge")
def charge(user_id, cents, currency="EUR"):
    print(f"[demo] charging user {user_id} {cents / 100:.2f} {currency}", flush=True)
    raise CardDeclined(f"card of user {user_id} declined for {cents / 100:.2f} {currency}")
