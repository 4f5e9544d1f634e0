"""One SQL function called through whatever connection the application
has: a DB-API connection or cursor (psycopg 3, psycopg2, Django's
``connection``) or a SQLAlchemy ``Connection`` or ``Session``, in that
connection's transaction."""

from __future__ import annotations

from typing import Any, Sequence


class Call:
    """``SELECT function(name => value, …)``, from a template whose ``{n}``
    are the n-th of ``names``: rendered once with ``%s`` (DB-API drivers)
    and once with ``:name`` (SQLAlchemy's ``text()``). The function
    resolves through the connection's search_path: the extension's schema
    (public by default) must be on it."""

    def __init__(self, template: str, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.format_sql = template.format(*["%s"] * len(self.names))
        self.named_sql = template.format(*[f":{name}" for name in self.names])

    def scalar(self, conn: Any, values: Sequence[Any], caller: str) -> Any:
        """The one value the call returns, run on ``conn``."""
        if type(conn).__module__.startswith("sqlalchemy"):
            from sqlalchemy import text

            return conn.execute(text(self.named_sql), dict(zip(self.names, values))).scalar_one()
        if hasattr(conn, "fetchone"):
            conn.execute(self.format_sql, tuple(values))
            return conn.fetchone()[0]
        if hasattr(conn, "cursor"):
            cursor = conn.cursor()
            try:
                cursor.execute(self.format_sql, tuple(values))
                return cursor.fetchone()[0]
            finally:
                cursor.close()
        raise TypeError(
            f"{caller}: conn must be a DB-API connection or cursor, or a SQLAlchemy Connection or Session, "
            f"not {type(conn).__name__}"
        )


class AutocommitError(RuntimeError):
    """enqueue() or publish() on a connection that commits every statement
    at once: the event would not be part of the caller's transaction."""


def in_autocommit(conn: Any) -> bool:
    """Whether ``conn`` would commit the event by itself. Django's
    connection (or cursor) says so outside ``atomic()``; SQLAlchemy's
    connection or session, and psycopg's and psycopg2's connection or
    cursor, by their driver connection's ``autocommit``, unless a
    transaction is open on it all the same (psycopg's
    ``conn.transaction()``; psycopg2's ``with conn`` sends its BEGIN only
    with its first statement, so it is seen only after one)."""
    module = type(conn).__module__
    if module.startswith("django"):
        db = getattr(conn, "db", conn)  # a cursor wraps its connection
        return bool(db.get_autocommit())
    if module.startswith("sqlalchemy"):
        connection = conn.connection() if hasattr(conn, "get_bind") else conn  # a Session's
        conn = connection.connection.dbapi_connection
    elif hasattr(conn, "fetchone"):  # a DB-API cursor
        conn = getattr(conn, "connection", conn)
    return getattr(conn, "autocommit", False) is True and not _in_transaction(conn)


def _in_transaction(conn: Any) -> bool:
    """Whether the driver connection has a transaction open (psycopg 3 and
    psycopg2 both tell, through ``conn.info.transaction_status``: 0 is idle)."""
    status = getattr(getattr(conn, "info", None), "transaction_status", 0)
    return int(status) != 0
