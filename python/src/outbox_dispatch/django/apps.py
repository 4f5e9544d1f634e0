"""The app's configuration: its label is ``outbox_dispatch``."""

from django.apps import AppConfig


class OutboxDispatchConfig(AppConfig):
    name = "outbox_dispatch.django"
    label = "outbox_dispatch"
    verbose_name = "Outbox"
    default_auto_field = "django.db.models.BigAutoField"
