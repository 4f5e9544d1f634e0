"""The outbox, installed (or updated) by the app's first migration, and
its views' models, unmanaged. A later release of the package adds a
migration that runs InstallOutbox again, which updates the outbox."""

from __future__ import annotations

from django.db import migrations, models

from outbox_dispatch.django.models import STATUSES
from outbox_dispatch.django.operations import InstallOutbox


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        InstallOutbox(),
        migrations.CreateModel(
            name="Event",
            fields=[
                ("id", models.UUIDField(primary_key=True, serialize=False)),
                ("event_type", models.TextField()),
                ("payload", models.JSONField()),
                ("queue", models.TextField()),
                ("task", models.TextField(null=True)),
                ("headers", models.JSONField(null=True)),
                ("priority", models.SmallIntegerField()),
                ("status", models.TextField(choices=STATUSES)),
                ("retry_count", models.IntegerField()),
                ("created_at", models.DateTimeField()),
                ("available_at", models.DateTimeField()),
                ("last_error", models.TextField(null=True)),
                ("args", models.JSONField(null=True)),
                ("expires_at", models.DateTimeField(null=True)),
                ("event_id", models.UUIDField(null=True)),
                ("subscription_id", models.BigIntegerField(null=True)),
                ("deliveries", models.IntegerField()),
                ("ordering_key", models.TextField(null=True)),
                ("key_state", models.TextField(null=True)),
                ("batch", models.BigIntegerField(null=True)),
            ],
            options={"managed": False, "db_table": 'outbox"."events', "ordering": ["-id"], "verbose_name": "event"},
        ),
        migrations.CreateModel(
            name="DeadLetter",
            fields=[
                ("id", models.UUIDField(primary_key=True, serialize=False)),
                ("event_type", models.TextField()),
                ("queue", models.TextField()),
                ("task", models.TextField()),
                ("payload", models.JSONField()),
                ("headers", models.JSONField(null=True)),
                ("retry_count", models.IntegerField()),
                ("last_error", models.TextField(null=True)),
                ("created_at", models.DateTimeField()),
                ("deliveries", models.IntegerField()),
                ("args", models.JSONField(null=True)),
                ("event_id", models.UUIDField(null=True)),
                ("subscription_id", models.BigIntegerField(null=True)),
                ("ordering_key", models.TextField(null=True)),
                ("holds_key", models.BooleanField()),
            ],
            options={"managed": False, "db_table": 'outbox"."dead_letters', "ordering": ["-id"],
                     "verbose_name": "dead letter"},
        ),
        migrations.CreateModel(
            name="BlockedKey",
            fields=[
                ("ordering_key", models.TextField(primary_key=True, serialize=False)),
                ("subscription_id", models.BigIntegerField(null=True)),
                ("head", models.UUIDField(null=True)),
                ("status", models.TextField(choices=STATUSES, null=True)),
                ("since", models.DateTimeField(null=True)),
                ("last_error", models.TextField(null=True)),
                ("waiting", models.BigIntegerField()),
            ],
            options={"managed": False, "db_table": 'outbox"."blocked_keys', "ordering": ["ordering_key"],
                     "verbose_name": "blocked key"},
        ),
    ]
