"""The admin of the outbox: events, dead letters and blocked keys, with
filters by status and the actions retry (``outbox_retry(id)``: a failed
event back in line, its retries reset) and discard (``outbox_discard()``:
a pending or failed event deleted, never sent; the outbox's owner alone).

The outbox's tables grow to millions of rows: no page counts them all.
The paginator counts the rows of the page's query up to
:data:`EXACT_UP_TO` (``count(*)`` over the query with a ``LIMIT``), and
past that takes the planner's estimate (``EXPLAIN``);
``show_full_result_count`` is off, facets are never counted, and the lists
are in id order (UUIDv7, the order the events were made), newest first,
not sorted by a column.

``outbox.events`` is a union of one branch per kind of row, each read
through its own index: PostgreSQL cannot read such a union in id order,
and a page of it sorts every row its filter keeps. So a list of events
reads the newest rows first: the ids above a floor (the
:data:`WINDOWS`-th newest row of ``outbox.log``, a walk of its primary
keys), a filter each branch takes into its own scan, widening the window
tenfold until it holds the page; only a page beyond the widest window
reads the whole list."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.core.paginator import Paginator
from django.db import connections, transaction
from django.utils.functional import cached_property

from outbox_dispatch.django.models import BlockedKey, DeadLetter, Event
from outbox_dispatch.replay import discard


#: The most rows a list counts; past them, the planner's estimate.
EXACT_UP_TO = 10_000

#: The newest rows of ``outbox.log`` a list of events reads first, in turn
#: until one holds what is asked for (see above).
WINDOWS = (1_000, 10_000, 100_000, 1_000_000)


def newest(queryset: Any, rows: int) -> tuple[Any, bool]:
    """The part of ``queryset`` (newest first) that holds its first
    ``rows`` rows, read from the newest rows of ``outbox.log`` (the ids
    above a floor), and whether it holds them: ``(queryset, True)`` where
    its order is not the ids' or the log is shorter than a window; the
    widest window's part and ``False`` when even that holds fewer."""
    if list(queryset.query.order_by or queryset.model._meta.ordering) != ["-id"]:
        return queryset, True
    part = queryset
    with connections[queryset.db].cursor() as cursor:
        for window in WINDOWS:
            cursor.execute("SELECT l.id FROM outbox.log AS l ORDER BY l.id DESC OFFSET %s LIMIT 1", [window - 1])
            floor = cursor.fetchone()
            if floor is None:
                return queryset, True
            part = queryset.filter(id__gte=floor[0])
            if part.order_by()[:rows].count() >= rows:
                return part, True
    return part, False


class EstimatedCountPaginator(Paginator):
    """Pages whose count is exact up to :data:`EXACT_UP_TO` rows and the
    planner's estimate past them: the last pages' numbers of a long list
    are approximate. A list newest first reads its newest rows first
    (:func:`newest`)."""

    @cached_property
    def count(self) -> int:
        # Unordered: a count stops at its LIMIT, where a sort reads everything.
        queryset = self.object_list.order_by()
        query, params = queryset.query.sql_with_params()
        with connections[queryset.db].cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM ({query} LIMIT {EXACT_UP_TO + 1}) AS listed", params)
            counted = int(cursor.fetchone()[0])
            if counted <= EXACT_UP_TO:
                return counted
            cursor.execute(f"EXPLAIN (FORMAT JSON) {query}", params)
            plan = cursor.fetchone()[0]
        if isinstance(plan, str):
            plan = json.loads(plan)
        return max(counted, int(plan[0]["Plan"]["Plan Rows"]))

    def page(self, number: Any) -> Any:
        number = self.validate_number(number)
        bottom = (number - 1) * self.per_page
        top = bottom + self.per_page
        if top + self.orphans >= self.count:
            top = self.count
        part, held = newest(self.object_list, top)
        return self._get_page((part if held else self.object_list)[bottom:top], number, self)


class OutboxAdmin(admin.ModelAdmin):
    """Read only (the SQL API changes events), paged without counting."""

    paginator = EstimatedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER if hasattr(admin, "ShowFacets") else None
    list_per_page = 50
    sortable_by: tuple[str, ...] = ()

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_retry_permission(self, request: Any) -> bool:
        """Retrying is changing the outbox: the permission to change events."""
        return bool(request.user.has_perm("outbox_dispatch.change_event"))

    def has_discard_permission(self, request: Any) -> bool:
        """Discarding deletes events: the permission to delete them."""
        return bool(request.user.has_perm("outbox_dispatch.delete_event"))


def retried(modeladmin: OutboxAdmin, request: Any, ids: list[Any]) -> None:
    """``outbox_retry(id)`` for each id in one transaction; says how many
    were failed (and so went back in line)."""
    db = modeladmin.model.objects.db
    with transaction.atomic(using=db), connections[db].cursor() as cursor:
        cursor.execute("SELECT count(*) FILTER (WHERE outbox_retry(i)) FROM unnest(%s::uuid[]) AS i",
                       ([str(i) for i in ids if i is not None],))
        done = cursor.fetchone()[0]
    skipped = len(ids) - done
    modeladmin.message_user(request, f"{done} sent again" + (f"; {skipped} not failed, left as they are"
                                                              if skipped else ""), messages.SUCCESS)


def discarded(modeladmin: OutboxAdmin, request: Any, ids: list[Any]) -> None:
    """``outbox_discard(ids)`` for the selected events in one transaction,
    :data:`DISCARDED_AT_ONCE` a call; says how many were deleted (pending or
    failed: what is being sent or was sent is left)."""
    db = modeladmin.model.objects.db
    with transaction.atomic(using=db):
        done = sum(discard(connections[db], ids=ids[i:i + DISCARDED_AT_ONCE], max_events=DISCARDED_AT_ONCE)
                   for i in range(0, len(ids), DISCARDED_AT_ONCE))
    left = len(ids) - done
    modeladmin.message_user(request, f"{done} discarded" + (f"; {left} neither pending nor failed, left as they are"
                                                            if left else ""), messages.SUCCESS)


#: The events one outbox_discard() call takes (its max_events).
DISCARDED_AT_ONCE = 1000


@admin.action(description="Discard the selected pending or failed events: they are never sent",
              permissions=["discard"])
def discard_events(modeladmin: OutboxAdmin, request: Any, queryset: Any) -> None:
    discarded(modeladmin, request, list(queryset.values_list("id", flat=True)))


@admin.action(description="Retry the selected failed events", permissions=["retry"])
def retry_events(modeladmin: OutboxAdmin, request: Any, queryset: Any) -> None:
    retried(modeladmin, request, list(queryset.values_list("id", flat=True)))


@admin.action(description="Retry the selected keys' failed heads", permissions=["retry"])
def retry_heads(modeladmin: OutboxAdmin, request: Any, queryset: Any) -> None:
    retried(modeladmin, request, list(queryset.values_list("head", flat=True)))


@admin.register(Event)
class EventAdmin(OutboxAdmin):
    list_display = ("id", "event_type", "task", "queue", "status", "retry_count", "created_at", "ordering_key")
    list_filter = ("status",)
    search_fields = ("=id", "=event_type")
    actions = [retry_events, discard_events]


@admin.register(DeadLetter)
class DeadLetterAdmin(OutboxAdmin):
    list_display = ("id", "task", "queue", "retry_count", "deliveries", "last_error", "created_at", "holds_key")
    list_filter = ("holds_key",)
    search_fields = ("=id", "=task")
    actions = [retry_events, discard_events]


@admin.register(BlockedKey)
class BlockedKeyAdmin(OutboxAdmin):
    list_display = ("ordering_key", "subscription_id", "head", "status", "since", "waiting", "last_error")
    list_display_links = None
    list_filter = ("status",)
    ordering = ("ordering_key",)
    actions = [retry_heads]
