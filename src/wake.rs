//! Waking the dispatchers when a transaction that added events commits.
//!
//! PostgreSQL refuses LISTEN in a background worker, and NOTIFY serializes
//! committers on one lock, so the trigger only marks the transaction; one
//! transaction callback per backend, registered the first time, sets the
//! dispatchers' latches at commit, once the rows are visible (the approach
//! of PostgreSQL's own ApplyLauncherWakeupAtCommit). A rollback or PREPARE
//! clears the mark: prepared transactions are left to the safety poll.

use std::cell::Cell;

use pgrx::pg_sys::XactEvent;
use pgrx::prelude::*;

use crate::slots::{self, WakeSource};

thread_local! {
    /// Wake the dispatchers at commit, for this source.
    static WAKE_AT_COMMIT: Cell<Option<WakeSource>> = const { Cell::new(None) };
    /// Ask the launcher for dispatchers at commit.
    static ASK_AT_COMMIT: Cell<bool> = const { Cell::new(false) };
    static CALLBACK_REGISTERED: Cell<bool> = const { Cell::new(false) };
    static MUTED: Cell<bool> = const { Cell::new(false) };
}

/// Called by a dispatcher as it starts: its own inserts (the batches of
/// accumulated subscriptions) wake nobody. It claims them in the same
/// transaction, or drains on until a claim finds nothing; and the
/// statement-level trigger fires even for an insert of no rows, which
/// would have the dispatcher wake itself after every claim.
pub fn mute() {
    MUTED.set(true);
}

/// Is this process a dispatcher, whose inserts wake nobody?
pub fn muted() -> bool {
    MUTED.get()
}

/// Wake the dispatchers when the current transaction commits: for
/// `source` `Commit`, events were added (paused dispatchers sleep on);
/// `Manual`, `outbox_wake()` was called, or this extension dropped.
pub fn at_commit(source: WakeSource) {
    register();
    if WAKE_AT_COMMIT.get() != Some(WakeSource::Manual) {
        WAKE_AT_COMMIT.set(Some(source));
    }
}

/// Ask the launcher for this database's dispatchers when the current
/// transaction commits, unless they run and found the extension: what
/// `outbox_wake()` does, and `CREATE EXTENSION` calls it.
pub fn ask_at_commit() {
    register();
    ASK_AT_COMMIT.set(true);
}

fn register() {
    if !CALLBACK_REGISTERED.replace(true) {
        // SAFETY: registered once per backend, for the life of the backend.
        unsafe { pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut()) };
    }
}

/// Wake the dispatchers now.
pub fn now() {
    slots::wake_database(WakeSource::Manual);
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: XactEvent::Type, _arg: *mut std::ffi::c_void) {
    match event {
        XactEvent::XACT_EVENT_COMMIT | XactEvent::XACT_EVENT_PARALLEL_COMMIT => {
            if let Some(source) = WAKE_AT_COMMIT.take() {
                slots::wake_database(source);
            }
            if ASK_AT_COMMIT.replace(false) {
                slots::ask_for_dispatchers();
            }
        }
        XactEvent::XACT_EVENT_ABORT
        | XactEvent::XACT_EVENT_PARALLEL_ABORT
        | XactEvent::XACT_EVENT_PREPARE => {
            WAKE_AT_COMMIT.set(None);
            ASK_AT_COMMIT.set(false);
        }
        _ => {}
    }
}
