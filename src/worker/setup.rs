//! What a dispatcher sets up once connected, before its loop: the settings
//! it pins whatever the database and role settings say, the allocator, and
//! the name it gives as the messages' origin.

use std::ffi::CStr;

use pgrx::prelude::*;

/// Settings every dispatcher runs with, overriding `ALTER DATABASE … SET` and
/// `ALTER ROLE … SET`: the database owner chooses those, and the dispatcher
/// runs as the bootstrap superuser.
const PINNED: [(&CStr, &CStr); 12] = [
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
    (c"idle_in_transaction_session_timeout", c"0"),
    // SKIP LOCKED claims need read committed, and the dispatcher writes.
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

/// Pins [`PINNED`]; called once connected to the database, whose own
/// settings are applied by then.
pub fn pin_settings() {
    for (name, value) in PINNED {
        // SAFETY: setting a GUC by name on the main thread; an override
        // beats the database, role and configuration-file sources.
        unsafe {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_OVERRIDE,
            );
        }
    }
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

/// `outbox_dispatch@<host>`: the messages' `origin` header.
pub fn origin() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string());
    format!("outbox_dispatch@{host}")
}
