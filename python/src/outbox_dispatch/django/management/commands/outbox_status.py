"""``manage.py outbox_status``: the outbox's events per status with their
age (``outbox.status``), and what each dispatcher is doing
(``outbox.workers``)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand
from django.db import connections


class Command(BaseCommand):
    help = "Shows the outbox's events per status (outbox.status) and its dispatchers (outbox.workers)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--database", default="default", help="the database alias (default: default)")

    def handle(self, *args: Any, **options: Any) -> None:
        with connections[options["database"]].cursor() as cursor:
            for view in ("outbox.status", "outbox.workers"):
                cursor.execute(f"TABLE {view}")
                names = [column[0] for column in cursor.description]
                rows = [["" if value is None else str(value) for value in row] for row in cursor.fetchall()]
                self.stdout.write(view)
                widths = [max([len(n), *(len(r[i]) for r in rows)]) for i, n in enumerate(names)]
                for line in [names, *rows]:
                    self.stdout.write("  " + "  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip())
