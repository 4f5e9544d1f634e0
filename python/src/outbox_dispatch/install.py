"""The outbox installed into a database, or updated to this release, in
the caller's transaction on a DB-API cursor (psycopg 3 or 2, Django's): a
migration's (:class:`outbox_dispatch.django.operations.InstallOutbox`).

Where the server has loaded the library (``shared_preload_libraries``):
``CREATE EXTENSION outbox_dispatch``, or ``ALTER EXTENSION ... UPDATE``.
Elsewhere (a managed service): the script ``outbox-dispatch sql`` prints,
which the package carries as the command of its release printed it
(``standalone/``, written by ``make package``: scripts/package_sql.py),
after the check ``outbox-dispatch install`` makes of who else may create
in the functions' schema (sql/standalone/others.sql); or the update
script from the release installed. Run it as the role that is to own the
outbox (docs/guides/managed.md, and ``outbox-dispatch run`` as that role).
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Optional

from outbox_dispatch import __version__

#: Where the scripts are, and the schema name they were printed for (their
#: quoted form is replaced by the quoted schema asked for, as the command
#: would have quoted it).
SCRIPTS = Path(__file__).resolve().parent / "standalone"
SCHEMA_PLACEHOLDER = '"@extschema@"'


class How(enum.Enum):
    """How the outbox is installed: ``EXTENSION`` where the library is
    loaded, ``SCRIPT`` elsewhere."""

    EXTENSION = "extension"
    SCRIPT = "script"


class InstallError(RuntimeError):
    """The database is not one to install into, or the package lacks its
    scripts: the reason, and what to do."""


def install(cursor: Any, schema: str = "public", how: Optional[How] = None) -> str:
    """Installs or updates the outbox through ``cursor``, its functions in
    ``schema``; returns what was done. ``how`` forces one way (None: the
    extension where the library is loaded, else the script)."""
    if not isinstance(schema, str) or not 1 <= len(schema.encode()) <= 63 or any(c in schema for c in "$'\"\\"):
        raise InstallError(f"schema must be 1 to 63 bytes without $ ' \" or \\, not {schema!r}")
    extension = _value(cursor, "SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'outbox_dispatch'")
    if how is None:
        loaded = _value(cursor, "SELECT EXISTS (SELECT FROM pg_catalog.pg_settings WHERE name = 'outbox.database')")
        how = How.EXTENSION if extension is not None or loaded else How.SCRIPT
    if how is How.EXTENSION:
        return _extension(cursor, schema, extension)
    if extension is not None:
        raise InstallError(
            f"the database has the extension outbox_dispatch {extension}: it is served by the library's own "
            "dispatchers, and needs no script"
        )
    return _script(cursor, schema)


def _extension(cursor: Any, schema: str, installed: Optional[str]) -> str:
    if installed is None:
        cursor.execute(f"CREATE EXTENSION outbox_dispatch WITH SCHEMA {quote_ident(schema)}")
        return f"created the extension outbox_dispatch {_value(cursor, _EXTENSION_VERSION)}"
    available = _value(cursor, "SELECT default_version FROM pg_catalog.pg_available_extensions "
                               "WHERE name = 'outbox_dispatch'")
    if available == installed:
        return f"the extension outbox_dispatch {installed} is installed already: nothing to do"
    cursor.execute("ALTER EXTENSION outbox_dispatch UPDATE")
    return f"updated the extension outbox_dispatch {installed} to {_value(cursor, _EXTENSION_VERSION)}"


_EXTENSION_VERSION = "SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'outbox_dispatch'"


def _script(cursor: Any, schema: str) -> str:
    installed = _installed(cursor)
    if installed == __version__:
        return f"outbox_dispatch {__version__} is installed already: nothing to do"
    if installed is None:
        _refuse_others(cursor, schema)
        cursor.execute(_read("install.sql", schema))
        _refuse_others(cursor, schema)
        return f"installed outbox_dispatch {__version__}"
    update = SCRIPTS / f"update-from-{installed}.sql"
    if not update.is_file():
        known = sorted(p.name[len("update-from-"):-len(".sql")] for p in SCRIPTS.glob("update-from-*.sql"))
        raise InstallError(
            f"outbox_dispatch {installed} is installed in this database, and {__version__} updates only "
            f"{', '.join(known) or 'none'}: update with the package of {installed}'s next release first"
        )
    _refuse_others(cursor, schema)
    cursor.execute(_read(update.name, schema))
    return f"updated outbox_dispatch {installed} to {__version__}"


def _installed(cursor: Any) -> Optional[str]:
    """The release the script installed, if any; refuses a schema outbox
    of something else, or one the connected role does not own (the sidecar
    and the update run as the outbox's owner)."""
    cursor.execute(
        "SELECT pg_catalog.to_regnamespace('outbox') IS NOT NULL, pg_catalog.to_regclass('outbox.installed') IS NOT NULL,"
        " (SELECT n.nspowner::pg_catalog.regrole::pg_catalog.text FROM pg_catalog.pg_namespace AS n"
        "   WHERE n.nspname = 'outbox'),"
        " (SELECT n.nspowner = r.oid FROM pg_catalog.pg_namespace AS n, pg_catalog.pg_roles AS r"
        "   WHERE n.nspname = 'outbox' AND r.rolname = current_user)"
    )
    schema_exists, table_exists, owner, ours = cursor.fetchone()
    if not schema_exists:
        return None
    if not table_exists:
        raise InstallError("the database has a schema \"outbox\" that outbox_dispatch did not install: rename or drop "
                           "it first")
    if not ours:
        raise InstallError(f"schema \"outbox\" belongs to role {owner}: install and update as {owner}")
    version = _value(cursor, "SELECT version FROM outbox.installed")
    return None if version is None else str(version)


def _refuse_others(cursor: Any, schema: str) -> None:
    """The check of sql/standalone/others.sql, as ``outbox-dispatch
    install`` makes it: nobody else may create in the functions' schema nor
    made an ``outbox_*`` function there."""
    query = _read("others.sql").replace("%", "%%").replace("$1", "%(schema)s")
    cursor.execute(query, {"schema": quote_ident(schema)})
    others = [row[0] for row in cursor.fetchall()]
    if others:
        raise InstallError(
            f"schema \"{schema}\" is open to others: {', '.join(others)} may create in it or made functions there, "
            "which could stand in for outbox_* functions; revoke CREATE from them, or install into a schema only "
            "this role creates in"
        )


def _read(name: str, schema: Optional[str] = None) -> str:
    path = SCRIPTS / name
    if not path.is_file():
        raise InstallError(
            f"this outbox_dispatch package carries no {name}: it was built without its scripts (make package "
            "writes them; from a source tree, scripts/package_sql.py)"
        )
    text = path.read_text(encoding="utf-8")
    return text if schema is None else text.replace(SCHEMA_PLACEHOLDER, quote_ident(schema))


def _value(cursor: Any, query: str) -> Any:
    cursor.execute(query)
    row = cursor.fetchone()
    return None if row is None else row[0]


def quote_ident(name: str) -> str:
    """``name`` as a quoted identifier, as ``quote_ident()`` would always
    quote it."""
    return '"' + name.replace('"', '""') + '"'
