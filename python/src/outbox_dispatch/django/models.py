"""The outbox's views as Django models, unmanaged (the outbox's own SQL
makes them): :class:`Event` (``outbox.events``), :class:`DeadLetter`
(``outbox.dead_letters``) and :class:`BlockedKey` (``outbox.blocked_keys``).
Read them; change events through the SQL API (``outbox_retry()``,
:func:`outbox_dispatch.django.enqueue`), which the admin's actions call."""

from __future__ import annotations

from django.db import models

#: What an event is now (outbox.event_status).
STATUSES = [(s, s) for s in ("pending", "processing", "dispatched", "processed", "failed")]


class Written(models.Model):
    """The columns an event and a dead letter share."""

    id = models.UUIDField(primary_key=True)
    event_type = models.TextField()
    payload = models.JSONField()
    queue = models.TextField()
    headers = models.JSONField(null=True)
    retry_count = models.IntegerField()
    created_at = models.DateTimeField()
    last_error = models.TextField(null=True)
    args = models.JSONField(null=True)
    event_id = models.UUIDField(null=True)
    subscription_id = models.BigIntegerField(null=True)
    deliveries = models.IntegerField()
    ordering_key = models.TextField(null=True)

    class Meta:
        abstract = True
        # UUIDv7: in the order they were made, newest first.
        ordering = ["-id"]


class Event(Written):
    task = models.TextField(null=True)
    priority = models.SmallIntegerField()
    status = models.TextField(choices=STATUSES)
    available_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True)
    key_state = models.TextField(null=True)
    batch = models.BigIntegerField(null=True)

    class Meta(Written.Meta):
        managed = False
        db_table = 'outbox"."events'
        verbose_name = "event"

    def __str__(self) -> str:
        return f"{self.event_type} {self.id}"


class DeadLetter(Written):
    task = models.TextField()
    holds_key = models.BooleanField()

    class Meta(Written.Meta):
        managed = False
        db_table = 'outbox"."dead_letters'
        verbose_name = "dead letter"

    def __str__(self) -> str:
        return f"{self.task} {self.id}"


class BlockedKey(models.Model):
    """A key whose head is not about to be sent. The view has no key of
    one column: a key of several subscriptions is several rows, which the
    admin lists (and retries) together by ``ordering_key``."""

    ordering_key = models.TextField(primary_key=True)
    subscription_id = models.BigIntegerField(null=True)
    head = models.UUIDField(null=True)
    status = models.TextField(null=True, choices=STATUSES)
    since = models.DateTimeField(null=True)
    last_error = models.TextField(null=True)
    waiting = models.BigIntegerField()

    class Meta:
        managed = False
        db_table = 'outbox"."blocked_keys'
        ordering = ["ordering_key"]
        verbose_name = "blocked key"

    def __str__(self) -> str:
        return str(self.ordering_key)
