//! Per-key order (README, "Per-key order"): the glue around the SQL in
//! sql/keys/ and sql/keys.sql.
//!
//! An event with an `ordering_key` takes its turn as it is inserted
//! (`outbox_take_turn()`): under its key's advisory lock, held to its
//! commit, it gets the next `key_seq` and becomes the key's head, or waits
//! behind the key's unfinished events. Only heads are claimed. When a head
//! is finished, the statement that finished it passes the key on ([`pass`]):
//! the next waiting event becomes the head.

use pgrx::prelude::*;
use pgrx::spi::{Query, SpiClient, SpiError};

use crate::config::KeyPolicy;
use crate::counters::{self, Counter};
use crate::slots::WakeSource;
use crate::wake;

/// The key of an event: its `ordering_key`, and its subscription (0 for an
/// event's own key: a delivery's key is its subscription's).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    pub ordering_key: String,
    pub subscription: i64,
}

/// A finished head, which lets its key go.
#[derive(Debug, Clone)]
pub struct Head {
    pub id: pgrx::Uuid,
    pub key: Key,
}

/// What [`pass`] did.
#[derive(Debug, Default)]
pub struct Passed {
    /// Heads that let their key go.
    pub passed: u64,
    /// Events that became their key's head.
    pub promoted: u64,
    /// Heads left holding their key: its lock was taken (a producer of the
    /// key had not committed yet). To pass again later.
    pub deferred: Vec<Head>,
}

pub const LOCK: &str = include_str!("../sql/keys/lock.sql");
pub const PASS: &str = include_str!("../sql/keys/pass.sql");

/// Passes on the keys of `heads` that are `finished` (processed, or as the
/// policy says), and starts the `stranded` keys (events waiting, no head),
/// in the current transaction: first their locks (`lock`, [`LOCK`]; waiting
/// for them with `wait`, else only the free ones), then, in a statement
/// that sees what their producers committed meanwhile, the passing
/// (`pass`, [`PASS`]). A statement each, run as prepared plans by the
/// dispatchers, as text by the SQL functions.
pub fn pass<L, P>(
    client: &mut SpiClient<'_>,
    (lock, pass): (L, P),
    heads: Vec<Head>,
    stranded: &[Key],
    finished: KeyPolicy,
    wait: bool,
) -> Result<Passed, SpiError>
where
    for<'c> L: Query<'c>,
    for<'c> P: Query<'c>,
{
    if heads.is_empty() && stranded.is_empty() {
        return Ok(Passed::default());
    }
    let keys = heads.iter().map(|h| &h.key).chain(stranded);
    let names: Vec<String> = keys.clone().map(|k| k.ordering_key.clone()).collect();
    let subscriptions: Vec<i64> = keys.map(|k| k.subscription).collect();
    let mut locked = std::collections::HashSet::new();
    for row in client.update(lock, None, &[names.into(), subscriptions.into(), wait.into()])? {
        let ordering_key = row.get::<String>(1)?.unwrap_or_default();
        locked.insert(Key { ordering_key, subscription: row.get::<i64>(2)?.unwrap_or(0) });
    }
    let (ready, deferred): (Vec<Head>, Vec<Head>) = heads.into_iter().partition(|h| locked.contains(&h.key));
    let stranded: Vec<&Key> = stranded.iter().filter(|k| locked.contains(*k)).collect();
    let args = [
        ready.iter().map(|h| h.id).collect::<Vec<_>>().into(),
        stranded.iter().map(|k| k.ordering_key.clone()).collect::<Vec<_>>().into(),
        stranded.iter().map(|k| k.subscription).collect::<Vec<_>>().into(),
        finished.failed.into(),
        finished.dispatched.into(),
    ];
    let counts = client.update(pass, Some(1), &args)?.first();
    let count = |n| counts.get::<i64>(n).map(|c| c.unwrap_or(0) as u64);
    Ok(Passed { passed: count(1)?, promoted: count(2)?, deferred })
}

/// A head read from a row: columns `id`, `ordering_key` and subscription
/// (0 for none) at `first`, `first + 1`, `first + 2`; `None` for an event
/// without a key.
pub fn head_of(row: &pgrx::spi::SpiHeapTupleData<'_>, first: usize) -> Result<Option<Head>, SpiError> {
    let (Some(id), Some(ordering_key)) = (row.get::<pgrx::Uuid>(first)?, row.get::<String>(first + 1)?)
    else {
        return Ok(None);
    };
    let subscription = row.get::<i64>(first + 2)?.unwrap_or(0);
    Ok(Some(Head { id, key: Key { ordering_key, subscription } }))
}

/// The key event `id` holds, if it is its key's head; once its lock is
/// taken, waiting for a producer of the key to commit: for `outbox_ack()`
/// and `outbox_skip()`, before they change the event (they then hold no
/// lock of its row while they wait, which a dispatcher would wait for).
pub fn lock_key_of(client: &mut SpiClient<'_>, id: pgrx::Uuid) -> Result<Option<Key>, SpiError> {
    let held = client.select(include_str!("../sql/keys/key_of.sql"), Some(1), &[id.into()])?;
    let Some(row) = held.into_iter().next() else {
        return Ok(None);
    };
    let key = Key {
        ordering_key: row.get::<String>(1)?.unwrap_or_default(),
        subscription: row.get::<i64>(2)?.unwrap_or(0),
    };
    let args = [vec![key.ordering_key.clone()].into(), vec![key.subscription].into(), true.into()];
    client.update(LOCK, None, &args)?;
    Ok(Some(key))
}

/// Passes on the key of `head`, finished in the caller's transaction (by
/// `outbox_ack()`, or `outbox_skip()` with `finished` saying a failed or
/// dispatched head counts), its lock taken by [`lock_key_of`]; wakes the
/// dispatchers at commit for the new head. Returns whether it let its key
/// go.
pub fn pass_now(client: &mut SpiClient<'_>, head: Head, finished: KeyPolicy) -> Result<bool, SpiError> {
    let passed = pass(client, (LOCK, PASS), vec![head], &[], finished, true)?;
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
    let sql = std::ffi::CString::new(query.sql).expect("no NUL in SQL files");
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

/// Lets a key go on without its head: a dead-lettered head (failed under
/// `outbox.key_on_failure = block`) stays in the dead letters, a head sent
/// and never reported stays dispatched, and the next event of the key is
/// sent. Returns whether the event held its key and let it go (one still
/// pending or being sent does not). SECURITY DEFINER, as `outbox_ack()`:
/// EXECUTE on this function, not UPDATE on the table.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn outbox_skip(id: pgrx::Uuid) -> bool {
    Spi::connect_mut(|client| {
        let Some(key) = lock_key_of(client, id)? else {
            return Ok(false);
        };
        pass_now(client, Head { id, key }, KeyPolicy { failed: true, dispatched: true })
    })
    .unwrap_or_else(|e| error!("outbox_skip: {e}"))
}
