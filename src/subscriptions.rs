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
use pgrx::PgTryBuilder;

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

/// Subscribes `task` to `event_type` for the role calling (see
/// sql/subscriptions.sql, `outbox_subscription_add`, which checks every
/// argument). Runs as its caller, not SECURITY DEFINER: `current_user`
/// here is the role asking, even inside a maintenance operation (an index
/// expression during ANALYZE runs as the table's owner), which a SECURITY
/// DEFINER function could not tell.
#[pg_extern(volatile, parallel_unsafe)]
fn outbox_subscribe(
    event_type: Option<&str>,
    task: Option<&str>,
    queue: default!(Option<&str>, "NULL"),
    priority: default!(Option<i32>, "NULL"),
    batch_max: default!(Option<i32>, "NULL"),
    batch_wait: default!(Option<Interval>, "NULL"),
) -> Option<i64> {
    let owner = calling_role_name();
    as_extension_owner("outbox_subscription_add($1, $2, $3, $4, $5, $6, $7)", |query| {
        Spi::get_one_with_args::<i64>(
            query,
            &[
                owner.as_str().into(),
                event_type.into(),
                task.into(),
                queue.into(),
                priority.into(),
                batch_max.into(),
                batch_wait.into(),
            ],
        )
    })
}

/// Ends subscription `id` when the role calling has the privileges of the
/// role that subscribed, or of the extension's owner (see
/// `outbox_subscription_end`). Runs as its caller, as `outbox_subscribe`.
#[pg_extern(volatile, parallel_unsafe)]
fn outbox_unsubscribe(id: Option<i64>) -> Option<bool> {
    // SAFETY: a plain read of the session's state.
    let asking = unsafe { pg_sys::GetUserId() };
    as_extension_owner("outbox_subscription_end($1, $2)", |query| {
        Spi::get_one_with_args::<bool>(query, &[asking.into(), id.into()])
    })
}

/// The name of the role running this function (`current_user`).
fn calling_role_name() -> String {
    // SAFETY: the current user exists; PostgreSQL returns a palloc'd copy.
    unsafe {
        let name = pg_sys::GetUserNameFromId(pg_sys::GetUserId(), false);
        std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned()
    }
}

/// Runs `call` with `SELECT <extension schema>.<function>` as the
/// extension's owner, the only role allowed to execute the functions it
/// calls; the role in use before is restored however `call` ends.
fn as_extension_owner<R>(
    function: &str,
    call: impl FnOnce(&str) -> Result<Option<R>, pgrx::spi::SpiError>,
) -> Option<R> {
    let (owner, schema) = Spi::get_two::<pg_sys::Oid, String>(
        "SELECT x.extowner, x.extnamespace::pg_catalog.regnamespace::pg_catalog.text \
           FROM pg_catalog.pg_extension AS x WHERE x.extname OPERATOR(pg_catalog.=) 'outbox_dispatch'",
    )
    .unwrap_or_else(|e| error!("outbox_dispatch: cannot find the extension: {e}"));
    let (Some(owner), Some(schema)) = (owner, schema) else {
        error!("outbox_dispatch: the extension is not created in this database")
    };
    let query = format!("SELECT {schema}.{function}");
    let (mut user, mut context) = (pg_sys::InvalidOid, 0);
    // SAFETY: as PostgreSQL's own code switches users for a call (the
    // security context keeps its restrictions); restored in `finally`.
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
        pg_sys::SetUserIdAndSecContext(owner, context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32);
    }
    PgTryBuilder::new(std::panic::AssertUnwindSafe(|| {
        call(&query).unwrap_or_else(|e| error!("outbox_dispatch: {e}"))
    }))
    .finally(|| {
        // SAFETY: the user and context saved above.
        unsafe { pg_sys::SetUserIdAndSecContext(user, context) }
    })
    .execute()
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
