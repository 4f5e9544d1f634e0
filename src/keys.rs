//! Per-key order (docs/guides/per-key-order.md) in a session: `outbox_skip()`,
//! the checks `outbox_take_turn()` (sql/keys.sql) makes under the latest
//! snapshot, and passing a key on from `outbox_ack()`. Passing itself is
//! `outbox_core::store::keys`, which the dispatchers run too.

use pgrx::prelude::*;

use outbox_core::store::keys::{self as turns, Head};
use outbox_core::store::sql::{DbError, Tx};

use crate::config::KeyPolicy;
use crate::counters::{self, Counter};
use crate::slots::WakeSource;
use crate::wake;
use crate::worker::store::SpiTx;

/// Passes on the key of `head`, finished in the caller's transaction (by
/// `outbox_ack()`, or `outbox_skip()` with `finished` saying a failed or
/// dispatched head counts), its lock taken by
/// [`turns::lock_key_of`]; wakes the dispatchers at commit for the new
/// head. Returns whether it let its key go.
pub fn pass_now(tx: &mut dyn Tx, head: Head, finished: KeyPolicy) -> Result<bool, DbError> {
    let passed = turns::pass(tx, vec![head], &[], finished, true)?;
    counters::add(Counter::KeyTurns, passed.promoted);
    if passed.promoted > 0 {
        wake::at_commit(WakeSource::Commit);
    }
    Ok(passed.passed > 0)
}

/// Is the key taken: does its newest event hold it or wait for it? Called
/// by `outbox_take_turn()` under the key's lock. Read as of now, whatever
/// the caller's isolation: a producer at repeatable read or serializable
/// would otherwise miss a producer that committed after its snapshot and
/// before it had the lock, and both events would be heads. The rows this
/// statement inserted before are seen too (as PL/pgSQL sees them).
#[pg_extern(volatile, parallel_unsafe)]
fn outbox_key_taken(ordering_key: &str, subscription: i64) -> bool {
    let key = ordering_key.into_datum().expect("text is never null");
    // SAFETY: the plan takes a text and a bigint, as given.
    unsafe { ask_as_of_now(&TAKEN, [key, subscription.into()]) }
}

/// Does the turn an inserted row brings (`key_seq`, as `key_state`) fit
/// the key: no row of the key has that `key_seq`, every row after it
/// waits, and, for a head, every row before it is finished? (A key's rows
/// in `key_seq` order are the finished ones, its head, then the waiting
/// ones.) A restore's rows fit, in whatever order they come; a copy of a
/// row, into its own key or another, does not, and takes a new turn.
/// Called by `outbox_take_turn()` under the key's lock, read as of now as
/// [`outbox_key_taken`].
#[pg_extern(volatile, parallel_unsafe)]
fn outbox_turn_fits(ordering_key: &str, subscription: i64, key_seq: i64, key_state: &str) -> bool {
    let key = ordering_key.into_datum().expect("text is never null");
    let state = key_state.into_datum().expect("text is never null");
    // SAFETY: the plan takes a text, two bigints and a text, as given.
    unsafe { ask_as_of_now(&FITS, [key, subscription.into(), key_seq.into(), state]) }
}

/// A yes-or-no query of the key's rows, run as of now (whatever the
/// caller's isolation), its plan prepared once per backend.
struct AsOfNow {
    sql: &'static str,
    types: &'static [pg_sys::Oid],
    plan: &'static std::thread::LocalKey<std::cell::Cell<pg_sys::SPIPlanPtr>>,
}

thread_local! {
    static TAKEN_PLAN: std::cell::Cell<pg_sys::SPIPlanPtr> = const { std::cell::Cell::new(std::ptr::null_mut()) };
    static FITS_PLAN: std::cell::Cell<pg_sys::SPIPlanPtr> = const { std::cell::Cell::new(std::ptr::null_mut()) };
}

static TAKEN: AsOfNow = AsOfNow {
    sql: include_str!("../sql/keys/taken.sql"),
    types: &[pg_sys::TEXTOID, pg_sys::INT8OID],
    plan: &TAKEN_PLAN,
};

static FITS: AsOfNow = AsOfNow {
    sql: include_str!("../sql/keys/fits.sql"),
    types: &[pg_sys::TEXTOID, pg_sys::INT8OID, pg_sys::INT8OID, pg_sys::TEXTOID],
    plan: &FITS_PLAN,
};

/// Runs `query` with `values` under the latest snapshot, after making
/// this statement's own rows visible; its one boolean (false for none).
///
/// # Safety
/// `values` are of `query.types`, none null.
unsafe fn ask_as_of_now<const N: usize>(query: &'static AsOfNow, mut values: [pg_sys::Datum; N]) -> bool {
    Spi::connect(|_| {
        // SAFETY: the SPI calls of ri_triggers.c's ri_PerformCheck, inside
        // the connection pgrx opened, on the main thread. The plan is kept
        // for the life of the backend (PostgreSQL's plan cache revalidates
        // it), the arguments outlive the call, and the one result column is
        // a bool.
        unsafe {
            let plan = plan_of(query);
            let nulls = [b' ' as std::ffi::c_char; N];
            pg_sys::CommandCounterIncrement();
            let status = pg_sys::SPI_execute_snapshot(
                plan,
                values.as_mut_ptr(),
                nulls.as_ptr(),
                pg_sys::GetLatestSnapshot(),
                std::ptr::null_mut(),
                true,
                false,
                1,
            );
            if status != pg_sys::SPI_OK_SELECT as i32 {
                error!("outbox_dispatch: a query of the key's rows failed (SPI status {status})");
            }
            if pg_sys::SPI_processed == 0 {
                return false;
            }
            let table = &*pg_sys::SPI_tuptable;
            let mut null = false;
            let datum = pg_sys::SPI_getbinval(*table.vals, table.tupdesc, 1, &mut null);
            !null && bool::from_datum(datum, false).unwrap_or(false)
        }
    })
}

/// The plan of `query`, prepared and kept the first time.
///
/// # Safety
/// Inside an SPI connection.
unsafe fn plan_of(query: &'static AsOfNow) -> pg_sys::SPIPlanPtr {
    let kept = query.plan.get();
    if !kept.is_null() {
        return kept;
    }
    let sql = std::ffi::CString::new(of_this_release(query.sql).into_owned()).expect("no NUL in SQL files");
    let mut types = query.types.to_vec();
    let plan = pg_sys::SPI_prepare(sql.as_ptr(), types.len() as i32, types.as_mut_ptr());
    if plan.is_null() || pg_sys::SPI_keepplan(plan) != 0 {
        error!(
            "outbox_dispatch: cannot prepare a query of the key's rows (SPI error {})",
            std::ptr::addr_of!(pg_sys::SPI_result).read()
        );
    }
    query.plan.set(plan);
    plan
}

/// `sql` as this database's release of the outbox names its table: before
/// 0.10.0 (a database whose extension is not updated yet, whose writers'
/// inserts take turns here), `outbox.events` was the table `outbox.log` is.
fn of_this_release(sql: &str) -> std::borrow::Cow<'_, str> {
    let before_the_log = crate::read_one::<bool>("SELECT pg_catalog.to_regclass('outbox.log') IS NULL")
        .unwrap_or_else(|e| error!("outbox_dispatch: {e}"))
        .unwrap_or(false);
    match before_the_log {
        true => sql.replace("outbox.log", "outbox.events").into(),
        false => sql.into(),
    }
}

/// Lets a key go on without its head: a dead-lettered head (failed under
/// `outbox.key_on_failure = block`) stays in the dead letters, a head sent
/// and never reported stays dispatched, and the next event of the key is
/// sent. Returns whether the event held its key and let it go (one still
/// pending or being sent does not). SECURITY DEFINER, as `outbox_ack()`:
/// EXECUTE on this function, not UPDATE on the table.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn outbox_skip(id: pgrx::Uuid) -> bool {
    let id = uuid::Uuid::from_bytes(*id.as_bytes());
    Spi::connect_mut(|client| {
        let tx = &mut SpiTx::unprepared(client);
        let Some(key) = turns::lock_key_of(tx, id)? else {
            return Ok(false);
        };
        pass_now(tx, Head { id, key }, KeyPolicy { failed: true, dispatched: true })
    })
    .unwrap_or_else(|e: DbError| error!("outbox_skip: {e}"))
}
