"""outbox_dispatch: the Python side of the outbox_dispatch PostgreSQL extension.

- :func:`enqueue` puts a Celery task into ``outbox.events`` inside the
  caller's transaction; the extension delivers it after COMMIT. A
  connection in autocommit mode is refused (:class:`AutocommitError`)
  unless the caller says it is meant.
- :func:`publish` puts an event there for every task subscribed to its
  type (``outbox_subscribe()``), each delivered as a task of its own.
- :mod:`outbox_dispatch.celery`, imported by a Celery app, reports the
  outcome of every task that came from the outbox back to the database.
- :mod:`outbox_dispatch.inbox`: ``once`` makes a task's writes to the
  database happen once per message, however often it is delivered.
- :func:`resend` and :func:`discard`: events sent again, or deleted, by
  filter (``outbox_resend()``, ``outbox_discard()``), as the outbox's owner.
- :mod:`outbox_dispatch.aio`: the same, awaited, on asynchronous
  connections (psycopg, asyncpg, SQLAlchemy's asyncio).
- :mod:`outbox_dispatch.django`: the Django app (``manage.py migrate``
  installs the outbox; the admin; management commands).
"""

from outbox_dispatch.call import AutocommitError
from outbox_dispatch.producer import enqueue, publish
from outbox_dispatch.replay import discard, resend

__all__ = ["AutocommitError", "discard", "enqueue", "publish", "resend"]
__version__ = "1.1.0"
