//! Whether the database has an active subscription, cached per backend, so
//! that an event without a task costs nothing more than before when nobody
//! subscribes (the routing itself is SQL: sql/subscriptions.sql).
//!
//! The cache is dropped by a relcache invalidation of
//! `outbox.all_subscriptions`, which a statement trigger on that table
//! sends at commit of every change (`outbox_subscribe()`, a restore's COPY,
//! a hand-made UPDATE); each look first takes the invalidations already
//! sent, so it is as current as the catalog caches PostgreSQL plans with.

use std::cell::Cell;

use pgrx::prelude::*;

thread_local! {
    /// `Some(active)` once looked up, until the next invalidation.
    static ACTIVE: Cell<Option<bool>> = const { Cell::new(None) };
    /// The table's oid, whose invalidation drops the cache.
    static TABLE: Cell<pg_sys::Oid> = const { Cell::new(pg_sys::InvalidOid) };
    static CALLBACK_REGISTERED: Cell<bool> = const { Cell::new(false) };
}

const LOOKUP: &str = "SELECT 'outbox.all_subscriptions'::pg_catalog.regclass::pg_catalog.oid, \
     EXISTS (SELECT FROM outbox.all_subscriptions WHERE unsubscribed_at IS NULL)";

/// The default of `outbox.events.routed_to`: 0 (routed to none) when no
/// subscription is active, so that the routing trigger, which runs only
/// for NULL, is not called; NULL (the trigger decides) otherwise. SECURITY
/// DEFINER: writers cannot read the subscriptions; the one query, on a
/// cache miss, qualifies every name.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
fn outbox_routed_to_default() -> Option<i32> {
    // SAFETY: takes the invalidations other sessions sent, as every lock
    // acquisition does; cheap when there are none.
    unsafe { pg_sys::AcceptInvalidationMessages() };
    let active = ACTIVE.get().unwrap_or_else(|| {
        let (table, active) = Spi::get_two::<pg_sys::Oid, bool>(LOOKUP)
            .unwrap_or_else(|e| error!("outbox_routed_to_default: {e}"));
        remember(table.unwrap_or(pg_sys::InvalidOid), active.unwrap_or(true))
    });
    if active {
        None
    } else {
        Some(0)
    }
}

fn remember(table: pg_sys::Oid, active: bool) -> bool {
    if !CALLBACK_REGISTERED.replace(true) {
        // SAFETY: registered once per backend, for the life of the backend.
        unsafe {
            pg_sys::CacheRegisterRelcacheCallback(Some(on_relcache_invalidation), pg_sys::Datum::from(0))
        };
    }
    TABLE.set(table);
    ACTIVE.set(Some(active));
    active
}

#[pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    if relid == pg_sys::InvalidOid || relid == TABLE.get() {
        ACTIVE.set(None);
    }
}

/// The role the session acts as: the one `SET ROLE` chose, or the session
/// user. Unlike `current_user`, a SECURITY DEFINER function does not change
/// it: `outbox_subscribe()` records it as the subscription's owner, and
/// `outbox_unsubscribe()` asks whether it may end one.
#[pg_extern(stable, parallel_safe)]
fn outbox_session_role() -> pg_sys::Oid {
    // SAFETY: a plain read of the session's state.
    unsafe { pg_sys::GetOuterUserId() }
}

/// AFTER … FOR EACH STATEMENT on `outbox.all_subscriptions`: every
/// backend's cache is dropped when the change commits (and this one's at
/// once).
#[pg_trigger]
fn outbox_subscriptions_changed<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, pgrx::AllocatedByPostgres>>, pgrx::PgTriggerError> {
    // SAFETY: queues an invalidation of the trigger's own table, sent at
    // commit and applied locally at the end of the command.
    unsafe { pg_sys::CacheInvalidateRelcacheByRelid(trigger.relation()?.oid()) };
    Ok(None)
}
