"""The migration operation that installs the outbox, or updates it to
the package's release (:func:`outbox_dispatch.install.install`), in the
migration's transaction. The app's own migrations run it; a project that
wants the functions elsewhere than ``public`` runs it in a migration of
its own, with ``schema``."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from django.db import migrations

from outbox_dispatch.install import How, install


class InstallOutbox(migrations.operations.base.Operation):
    """Installs or updates the outbox: ``CREATE EXTENSION outbox_dispatch``
    (or ``ALTER EXTENSION ... UPDATE``) where the server loaded the
    library, else the script of this release (``how`` forces one:
    ``"extension"`` or ``"script"``). Not reversed: an outbox holds events
    the application committed; drop it by hand if that is meant."""

    reversible = False
    reduces_to_sql = False
    atomic = True

    def __init__(self, schema: str = "public", how: Optional[str] = None) -> None:
        self.schema = schema
        self.how = how

    def deconstruct(self) -> Tuple[str, Tuple[Any, ...], dict[str, Any]]:
        kwargs: dict[str, Any] = {}
        if self.schema != "public":
            kwargs["schema"] = self.schema
        if self.how is not None:
            kwargs["how"] = self.how
        return self.__class__.__name__, (), kwargs

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        connection = schema_editor.connection
        if connection.vendor != "postgresql":
            raise RuntimeError(f"InstallOutbox: outbox_dispatch needs PostgreSQL, not {connection.vendor}")
        if schema_editor.collect_sql:
            raise RuntimeError("InstallOutbox: sqlmigrate cannot show it: the SQL depends on the database")
        with connection.cursor() as cursor:
            done = install(cursor, self.schema, None if self.how is None else How(self.how))
        if getattr(schema_editor, "verbosity", 1):
            print(f"  outbox_dispatch: {done}")

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        raise NotImplementedError("InstallOutbox is not reversed: the outbox holds the application's events")

    def describe(self) -> str:
        return f"Install or update the outbox (functions in schema {self.schema})"
