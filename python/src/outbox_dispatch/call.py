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
