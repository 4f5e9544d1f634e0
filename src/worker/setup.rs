//! What a dispatcher sets up once connected, before its loop: the settings
//! it pins whatever the database and role settings say, and the allocator.

use std::ffi::{CStr, CString};

use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;

/// Settings every dispatcher runs with, overriding `ALTER DATABASE … SET` and
/// `ALTER ROLE … SET`: the database owner chooses those, and the dispatcher
/// runs as the bootstrap superuser.
const PINNED: [(&CStr, &CStr); 16] = [
    // Names resolve in pg_catalog only: a function or operator planted in a
    // schema the owner controls is never called with our rights.
    (c"search_path", c"pg_catalog, pg_temp"),
    // A mark lost in a crash only re-sends the event with the same task id,
    // and a lost claim leaves it pending: never lost, at most sent twice.
    // The transactions that something outside PostgreSQL relies on (a
    // batch about to be pushed, reports about to be trimmed from Redis)
    // commit synchronously (store.rs, durable_commit).
    (c"synchronous_commit", c"off"),
    // A lock held by someone else delays dispatch visibly (state blocked,
    // last_error), not silently and not forever.
    (c"lock_timeout", c"1s"),
    // In a deadlock with a session (a DROP EXTENSION, a TRUNCATE taking
    // the tables in another order), the dispatcher checks first and is the
    // one rolled back: it tries again, the session's command goes through.
    (c"deadlock_timeout", c"100ms"),
    // PostgreSQL arms this one for top-level statements only, never under
    // SPI: the store arms the deadline of each transaction itself
    // (outbox.statement_timeout). None is cut short by the owner's limit.
    (c"statement_timeout", c"0"),
    // The claim reads a page of events in index order (claim.sql): a
    // bitmap scan, which the planner picks while the statistics are old
    // (after a bulk load, before autovacuum's analyze), would read the
    // whole rest of the window and sort it, at every claim. Every
    // statement of the dispatchers reads an index range or a row.
    (c"enable_bitmapscan", c"off"),
    // The same for a sort: outbox.log is partitioned (one partition per
    // generation), and a page in index order is the partitions' index
    // scans merged (Merge Append); a sort of all of them, which the planner
    // picks while it thinks the window small, reads the window whole.
    // (Sorts of a page or of a round's arrays still run: nothing else
    // could.)
    (c"enable_sort", c"off"),
    // A switch off is a cost of 10^10 to the planner (before PostgreSQL
    // 18): far above jit_above_cost, it would compile every claim (670 ms
    // of a 690 ms claim, measured). No statement of theirs runs long
    // enough to gain from JIT.
    (c"jit", c"off"),
    (c"idle_in_transaction_session_timeout", c"0"),
    // An error the dispatcher handles (a lock not granted, a batch that
    // cannot be made) must stay an error, not end the process.
    (c"exit_on_error", c"off"),
    // Each statement of a claim sees what committed before it (claim.sql),
    // and the dispatcher writes.
    (c"default_transaction_isolation", c"read committed"),
    (c"default_transaction_read_only", c"off"),
    // Times travel as text in the messages' headers (outbox_created_at):
    // ISO 8601, in UTC, whatever the database's own style.
    (c"DateStyle", c"ISO, YMD"),
    (c"IntervalStyle", c"postgres"),
    (c"TimeZone", c"UTC"),
    // The dispatchers' own inserts (batches) wake nobody and NOTIFY nobody
    // (wake.rs); outbox.default_queue, the one other outbox setting a
    // database may set, they never read.
    (c"outbox.notify", c"off"),
];

/// PostgreSQL 17 and later arm `transaction_timeout` in every transaction,
/// a background worker's too, and end the process when it fires: the
/// dispatchers have their own deadline (`outbox.statement_timeout`).
#[cfg(any(feature = "pg17", feature = "pg18"))]
const PINNED_SINCE_17: [(&CStr, &CStr); 1] = [(c"transaction_timeout", c"0")];
#[cfg(not(any(feature = "pg17", feature = "pg18")))]
const PINNED_SINCE_17: [(&CStr, &CStr); 0] = [];

/// Called once connected to the database, whose own settings and the
/// role's are applied by then: sets each of those back to the server's
/// value (see [`undo_database_settings`]), then pins [`PINNED`].
/// Returns the database's name, read once the settings are pinned.
pub fn pin_settings(index: usize) -> String {
    // First of all, before reading anything: run as the bootstrap superuser
    // again, whatever `role` the database asked for, with the pinned
    // timeouts (a database's `transaction_timeout` would end the read).
    set(c"role", c"none");
    pin();
    let database = database_name();
    undo_database_settings(index, &database);
    pin();
    database
}

fn pin() {
    for (name, value) in PINNED.into_iter().chain(PINNED_SINCE_17) {
        set(name, value);
    }
}

/// Sets `name` to `value` over every other source of this session.
fn set(name: &CStr, value: &CStr) -> bool {
    // SAFETY: setting a GUC by name on the main thread; an override beats
    // the database, role and configuration-file sources. A value refused
    // is a WARNING in the log, not an error.
    unsafe {
        pg_sys::set_config_option(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
            pg_sys::GucAction::GUC_ACTION_SET,
            true,
            pg_sys::WARNING as i32,
            false,
        ) > 0
    }
}

/// The longest the read of the database's settings may take.
const READ_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// The settings of this database and of the dispatchers' role (`ALTER
/// DATABASE … SET`, `ALTER ROLE … SET`) are the database owner's to choose,
/// and every one of them reaches a session: `role` would run the
/// dispatcher as another role, `exit_on_error` turn each handled error into
/// a restart, the planner's switches slow every claim. Each goes back to
/// the server's own value: the last line of the configuration files that
/// sets it, else its built-in default (`role`: none). Values given on the
/// server's command line are not seen this way; a setting whose server
/// value cannot be found stays as it is, and the log says so.
fn undo_database_settings(index: usize, database: &str) {
    // Operators unqualified: the search_path is pinned to pg_catalog by now.
    const QUERY: &str = include_str!("../../sql/worker/database_settings.sql");
    let read = super::store::transaction(READ_DEADLINE, || {
        Spi::connect(|client| {
            client
                .select(QUERY, None, &[])?
                .map(|row| Ok((row.get::<String>(1)?.unwrap_or_default(), row.get::<String>(2)?)))
                .collect::<Result<Vec<(String, Option<String>)>, pgrx::spi::SpiError>>()
        })
        .map_err(|e| outbox_core::store::sql::DbError::internal(e.to_string()))
    });
    let settings = match read {
        Ok(settings) => settings,
        Err(e) => {
            warning!("outbox dispatcher {index}: cannot read the settings of its database and role: {e}");
            return;
        }
    };
    if settings.is_empty() {
        return;
    }
    let mut undone = Vec::new();
    for (name, value) in settings {
        let applied = match (CString::new(name.as_str()), value.map(CString::new)) {
            (Ok(n), Some(Ok(v))) => set(&n, &v),
            _ => false,
        };
        if applied {
            undone.push(name);
        } else {
            warning!("outbox dispatcher {index}: cannot set {name} back to the server's value; it stays as the database or role set it");
        }
    }
    log!(
        "outbox dispatcher {index}: ignoring the settings of database \"{database}\" and of its role for: {}",
        undone.join(", ")
    );
}

/// A batch's buffers (messages, the packed commands) run to megabytes and
/// vary in size from batch to batch. By default glibc raises its mmap
/// threshold after the first such buffer is freed and serves the next ones
/// from the heap, which then fragments and keeps the dispatcher's memory
/// high. A fixed threshold maps every buffer over 128 kB and unmaps it when
/// freed: memory stays flat however many events pass.
pub fn return_large_buffers() {
    // SAFETY: mallopt only tunes this process's allocator.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024) };
}

/// The name of the database this process is connected to.
fn database_name() -> String {
    BackgroundWorker::transaction(|| {
        // SAFETY: a catalog lookup inside a transaction, of the database
        // this process is connected to (which cannot be dropped meanwhile).
        let name = unsafe { pg_sys::get_database_name(pg_sys::MyDatabaseId) };
        if name.is_null() {
            String::new()
        } else {
            unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned()
        }
    })
}
