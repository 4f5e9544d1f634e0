//! The dispatcher's signals, as PostgreSQL's own workers handle them
//! (worker_spi): SIGTERM is `die`, so that a shutdown or
//! `pg_terminate_backend` also ends a lock wait or a long statement at
//! once; SIGHUP only notes a reload, which the loop (or a broker wait)
//! performs. Nothing ever holds signals back: the Redis socket is waited on
//! together with the latch (see `wait.rs`).
//!
//! A dispatcher also performs the reloads the launcher counted and it did
//! not read. PostgreSQL drops a SIGHUP that comes while it starts a
//! background worker (which ignores SIGHUP until its own handler is set):
//! a dispatcher forked just before a reload would otherwise keep the
//! settings from before it until the next one. Every reload is thus read
//! twice by a running dispatcher, at its own SIGHUP and at the launcher's
//! count.

use std::cell::Cell;

use pgrx::prelude::*;

use crate::slots;

unsafe extern "C-unwind" {
    /// tcop/tcopprot.h and postmaster/interrupt.h: the handlers themselves,
    /// not pgrx's guarded wrappers (a signal handler must be the C symbol).
    fn die(signal: i32);
    fn SignalHandlerForConfigReload(signal: i32);
}

thread_local! {
    /// The configuration was re-read since the loop last looked.
    static RELOADED: Cell<bool> = const { Cell::new(false) };
    /// A dispatcher's: the launcher's count of reloads ([`slots::reloads`])
    /// as of which it holds the configuration. None in the launcher, which
    /// counts them.
    static READ_AS_OF: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Installs the handlers and unblocks signals; the first thing a
/// dispatcher does.
pub fn install() {
    // SAFETY: PostgreSQL's own handlers, installed as worker_spi does; the
    // postmaster starts background workers with signals blocked.
    unsafe {
        pqsignal(pg_sys::SIGHUP as i32, SignalHandlerForConfigReload);
        pqsignal(pg_sys::SIGTERM as i32, die);
        pg_sys::BackgroundWorkerUnblockSignals();
    }
}

#[cfg(not(feature = "pg18"))]
unsafe fn pqsignal(signal: i32, handler: unsafe extern "C-unwind" fn(i32)) {
    pg_sys::pqsignal(signal, Some(handler));
}

#[cfg(feature = "pg18")]
unsafe fn pqsignal(signal: i32, handler: unsafe extern "C-unwind" fn(i32)) {
    pg_sys::pqsignal_be(signal, Some(handler));
}

/// Has this dispatcher perform the reloads the launcher counts from
/// `as_of` on: the count when the launcher registered it.
pub fn follow_launcher(as_of: u64) {
    READ_AS_OF.set(Some(as_of));
}

/// Re-reads the configuration files if a SIGHUP asked for it, or the
/// launcher counted a reload this dispatcher has not read; returns whether
/// it did.
pub fn reload_if_requested() -> bool {
    if !reload_pending() {
        return false;
    }
    // Noted before the read: a reload counted during it is read again.
    if READ_AS_OF.get().is_some() {
        READ_AS_OF.set(Some(slots::reloads()));
    }
    // SAFETY: the flag is cleared on the main thread, before the read, as
    // PostgreSQL's own workers do.
    unsafe {
        (&raw mut pg_sys::ConfigReloadPending).write_volatile(0);
        pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP);
    }
    RELOADED.set(true);
    true
}

/// Reads the configuration files once as the launcher starts: a SIGHUP
/// that came while PostgreSQL started it was dropped (see above), and
/// nothing counts reloads for the launcher. At the server's start the files
/// are what the postmaster has just read; after the launcher's restart, an
/// edit not yet reloaded is read too, by the launcher alone.
pub fn read_on_start() {
    // SAFETY: the launcher's main thread, outside any transaction, as the
    // checkpointer reads them.
    unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
}

/// A reload is waiting: a SIGHUP's, or one the launcher counted.
pub fn reload_pending() -> bool {
    reload_requested() || launcher_reloaded()
}

/// A SIGHUP is waiting.
pub fn reload_requested() -> bool {
    // SAFETY: a flag the handler sets, read on the main thread.
    unsafe { (&raw const pg_sys::ConfigReloadPending).read_volatile() != 0 }
}

/// The launcher counted a reload this dispatcher has not read.
fn launcher_reloaded() -> bool {
    READ_AS_OF.get().is_some_and(|read| read != slots::reloads())
}

/// Whether the configuration was re-read since the last call.
pub fn take_reloaded() -> bool {
    RELOADED.replace(false)
}

/// Drops a cancel request that came while no statement runs: between two
/// transactions (a statement deadline that fired as its transaction ended,
/// a `pg_cancel_backend`) there is nothing to cancel, and the error it
/// would raise outside a transaction would restart the dispatcher.
pub fn ignore_cancel() {
    // SAFETY: a flag the SIGINT handler sets, cleared on the main thread.
    unsafe { (&raw mut pg_sys::QueryCancelPending).write_volatile(0) };
}

/// Exits if a SIGTERM came (`die` only noted it), after dropping a cancel
/// that came between transactions (see [`ignore_cancel`]).
pub fn process_interrupts() {
    ignore_cancel();
    check_for_interrupts!();
}

/// A SIGTERM or a reload is waiting (a SIGHUP's, or one the launcher
/// counted), or a reload was done (inside a broker wait) and the loop has
/// not applied it yet: a long piece of work stops early.
pub fn interrupt_pending() -> bool {
    // SAFETY: a read of a flag the handler sets.
    let dying = unsafe { (&raw const pg_sys::ProcDiePending).read_volatile() != 0 };
    dying || reload_pending() || RELOADED.get()
}
