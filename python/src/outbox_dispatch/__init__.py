"""outbox_dispatch: the Python side of the outbox_dispatch PostgreSQL extension.

- :func:`enqueue` puts a Celery task into ``outbox.events`` inside the
  caller's transaction; the extension delivers it after COMMIT.
- :mod:`outbox_dispatch.celery`, imported by a Celery app, reports the
  outcome of every task that came from the outbox back to the database.
"""

from outbox_dispatch.producer import enqueue

__all__ = ["enqueue"]
__version__ = "0.3.0"
