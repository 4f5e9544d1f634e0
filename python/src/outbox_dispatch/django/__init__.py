"""outbox_dispatch for Django: add ``"outbox_dispatch.django"`` to
``INSTALLED_APPS`` and ``manage.py migrate`` installs the outbox into the
database (``CREATE EXTENSION`` where the library is loaded, else the
script ``outbox-dispatch sql`` prints: :mod:`outbox_dispatch.install`).

- :func:`enqueue` and :func:`publish` on Django's connection (``using``,
  ``"default"`` by default), in its transaction: inside
  ``transaction.atomic()``, refused in autocommit as the package's are;
- the admin (``outbox_dispatch.django.admin``): events, dead letters and
  blocked keys, with retry, and filters by status;
- ``manage.py outbox_status``, ``outbox_retry`` and ``outbox_sidecar``;
- :class:`~outbox_dispatch.django.operations.InstallOutbox`, the migration
  operation, for a migration of the project's own.
"""

from __future__ import annotations

import uuid
from typing import Any, Mapping, Optional, Sequence

import outbox_dispatch

__all__ = ["enqueue", "publish"]


def enqueue(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    *,
    using: str = "default",
    **options: Any,
) -> uuid.UUID:
    """:func:`outbox_dispatch.enqueue` on Django's connection ``using``
    (a database alias), with the same options (``queue``, ``countdown``,
    ``eta``, ``expires``, ``priority``, ``headers``, ``event_type``,
    ``ordering_key``, ``allow_autocommit``)."""
    from django.db import connections

    return outbox_dispatch.enqueue(connections[using], task, args, kwargs, **options)


def publish(
    event_type: str, payload: Optional[Mapping[str, Any]] = None, *, using: str = "default", **options: Any
) -> uuid.UUID:
    """:func:`outbox_dispatch.publish` on Django's connection ``using``."""
    from django.db import connections

    return outbox_dispatch.publish(connections[using], event_type, payload, **options)
