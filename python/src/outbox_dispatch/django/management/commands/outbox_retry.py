"""``manage.py outbox_retry ID...``: failed events back in line, their
retries reset (``outbox_retry(id)``); ``--failed`` every failed event
(``outbox_retry_failed()``), ``--older-than`` those created before then."""

from __future__ import annotations

import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connections, transaction


class Command(BaseCommand):
    help = "Sends failed events (dead letters) again: by id, or every one (--failed)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("ids", nargs="*", help="the events' ids")
        parser.add_argument("--failed", action="store_true", help="every failed event")
        parser.add_argument("--older-than", help="with --failed: only those created at least this long ago "
                                                 "(a PostgreSQL interval: '1 hour')")
        parser.add_argument("--database", default="default", help="the database alias (default: default)")

    def handle(self, *args: Any, **options: Any) -> None:
        ids, every = options["ids"], options["failed"]
        if bool(ids) == every:
            raise CommandError("give the ids of the events to retry, or --failed")
        if options["older_than"] is not None and not every:
            raise CommandError("--older-than goes with --failed")
        try:
            ids = [str(uuid.UUID(i)) for i in ids]
        except ValueError as e:
            raise CommandError(f"an id is not a UUID: {e}") from None
        db = options["database"]
        with transaction.atomic(using=db), connections[db].cursor() as cursor:
            if every:
                cursor.execute("SELECT outbox_retry_failed(CAST(%s AS interval))", (options["older_than"],))
            else:
                cursor.execute("SELECT count(*) FILTER (WHERE outbox_retry(i)) FROM unnest(%s::uuid[]) AS i", (ids,))
            done = cursor.fetchone()[0]
        self.stdout.write(f"{done} sent again" + ("" if every or done == len(ids) else
                                                   f"; {len(ids) - done} not failed, left as they are"))
