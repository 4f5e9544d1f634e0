"""One SQL function called through whatever connection the application
has, in that connection's transaction: a DB-API connection or cursor
(psycopg 3, psycopg2, Django's ``connection``) or a SQLAlchemy
``Connection`` or ``Session``; or, awaited, an asynchronous one: psycopg's
``AsyncConnection`` or ``AsyncCursor``, an asyncpg connection (or a pool's),
or a SQLAlchemy ``AsyncConnection`` or ``AsyncSession``."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, TypeVar

if TYPE_CHECKING:
    from typing_extensions import Concatenate, ParamSpec

    P = ParamSpec("P")


class Call:
    """``SELECT function(name => value, …)``, from a template whose ``{n}``
    are the n-th of ``names``: rendered with ``%s`` (DB-API drivers and
    psycopg's asynchronous ones), with ``:name`` (SQLAlchemy's ``text()``,
    each parameter a string) and with ``$n::pg_catalog.text`` (asyncpg,
    which types a parameter as the server infers it): where a driver types
    the parameters, each is sent as text, and the template's casts make it
    what the function takes. The function resolves through the
    connection's search_path: the extension's schema (public by default)
    must be on it."""

    def __init__(self, template: str, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.format_sql = template.format(*["%s"] * len(self.names))
        self.named_sql = template.format(*[f":{name}" for name in self.names])
        self.numbered_sql = template.format(*[f"${n}::pg_catalog.text" for n in range(1, len(self.names) + 1)])

    def scalar(self, conn: Any, values: Sequence[Any], caller: str) -> Any:
        """The one value the call returns, run on ``conn``."""
        refuse_asynchronous(conn, caller)
        if type(conn).__module__.startswith("sqlalchemy"):
            return conn.execute(self._statement(), self._texts_by_name(values)).scalar_one()
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

    async def scalar_async(self, conn: Any, values: Sequence[Any], caller: str) -> Any:
        """The one value the call returns, run on the asynchronous ``conn``."""
        module = type(conn).__module__
        if module.startswith("sqlalchemy"):
            return (await conn.execute(self._statement(), self._texts_by_name(values))).scalar_one()
        if module.startswith("asyncpg"):
            return await conn.fetchval(self.numbered_sql, *_texts(values))
        if hasattr(conn, "fetchone"):  # psycopg's AsyncCursor
            await conn.execute(self.format_sql, tuple(values))
            row = await conn.fetchone()
        else:
            row = await (await conn.execute(self.format_sql, tuple(values))).fetchone()
        return row[0]


    def _statement(self) -> Any:
        """SQLAlchemy's ``text()`` of the call, each parameter a string:
        its drivers that type parameters (asyncpg; psycopg's, which casts
        them) send text, which the template's casts make what the
        function takes."""
        from sqlalchemy import String, bindparam, text

        return text(self.named_sql).bindparams(*(bindparam(name, type_=String()) for name in self.names))

    def _texts_by_name(self, values: Sequence[Any]) -> Dict[str, Optional[str]]:
        return dict(zip(self.names, _texts(values)))


def _texts(values: Sequence[Any]) -> List[Optional[str]]:
    """Each value as text, as PostgreSQL reads a literal (None: NULL)."""
    return [None if value is None else str(value) for value in values]


R = TypeVar("R")


def with_connection(build: Callable[P, Any]) -> Callable[[Callable[..., R]], Callable[Concatenate[Any, P], R]]:
    """``call(conn, *args, **kwargs)``, which runs what ``build(*args,
    **kwargs)`` makes of its arguments on ``conn``, with ``conn`` and
    ``build``'s parameters as its own: for type checkers, and for
    ``help()``. One list of parameters for the synchronous and the awaited
    calls."""

    def decorate(call: Callable[..., R]) -> Callable[Concatenate[Any, P], R]:
        built = inspect.signature(build)
        conn = inspect.Parameter("conn", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Any")
        call.__signature__ = built.replace(  # type: ignore[attr-defined]
            parameters=[conn, *built.parameters.values()], return_annotation=inspect.signature(call).return_annotation
        )
        return call

    return decorate


def asynchronous(conn: Any) -> bool:
    """Whether ``conn`` is one whose calls are awaited: asyncpg's, SQLAlchemy's
    asyncio extension's, or one whose ``execute`` is a coroutine (psycopg's
    ``AsyncConnection`` and ``AsyncCursor``)."""
    module = type(conn).__module__
    return module.startswith(("asyncpg", "sqlalchemy.ext.asyncio")) or inspect.iscoroutinefunction(
        getattr(type(conn), "execute", None)
    )


def refuse_synchronous(conn: Any, caller: str) -> None:
    """A TypeError for a synchronous ``conn`` given to an awaited call."""
    if not asynchronous(conn):
        raise TypeError(
            f"{caller}: conn must be an asynchronous connection (psycopg's AsyncConnection or AsyncCursor, "
            f"an asyncpg connection, a SQLAlchemy AsyncConnection or AsyncSession), not {type(conn).__name__}: "
            "outbox_dispatch.aio is for those, the rest of the package for the others"
        )


def refuse_asynchronous(conn: Any, caller: str) -> None:
    """A TypeError naming what to call instead, for an asynchronous ``conn``
    given to a synchronous call (whose statement would never run)."""
    if asynchronous(conn):
        raise TypeError(
            f"{caller}: conn is asynchronous ({type(conn).__name__}): "
            f"await outbox_dispatch.aio.{caller}(conn, ...) in its place"
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


async def in_autocommit_async(conn: Any, caller: str) -> bool:
    """:func:`in_autocommit` for an asynchronous ``conn`` (a TypeError
    for another): an asyncpg connection outside ``conn.transaction()``;
    SQLAlchemy's by its driver connection's ``autocommit`` (its
    ``AUTOCOMMIT`` isolation level); psycopg's as the synchronous ones."""
    refuse_synchronous(conn, caller)
    module = type(conn).__module__
    if module.startswith("asyncpg"):
        return not conn.is_in_transaction()
    if module.startswith("sqlalchemy"):
        connection = await conn.connection() if hasattr(conn, "sync_session") else conn  # an AsyncSession's
        raw = await connection.get_raw_connection()
        return getattr(raw.dbapi_connection, "autocommit", False) is True
    return in_autocommit(conn)


def _in_transaction(conn: Any) -> bool:
    """Whether the driver connection has a transaction open (psycopg 3 and
    psycopg2 both tell, through ``conn.info.transaction_status``: 0 is idle)."""
    status = getattr(getattr(conn, "info", None), "transaction_status", 0)
    return int(status) != 0
