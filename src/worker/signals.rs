//! The dispatcher's signals, as PostgreSQL's own workers handle them
//! (worker_spi): SIGTERM is `die`, so that a shutdown or
//! `pg_terminate_backend` also ends a lock wait or a long statement at
//! once; SIGHUP only notes a reload, which the loop (or a broker wait)
//! performs. Nothing ever holds signals back: the Redis socket is waited on
//! together with the latch (see `wait.rs`).

use std::cell::Cell;

use pgrx::prelude::*;

unsafe extern "C-unwind" {
    /// tcop/tcopprot.h and postmaster/interrupt.h: the handlers themselves,
    /// not pgrx's guarded wrappers (a signal handler must be the C symbol).
    fn die(signal: i32);
    fn SignalHandlerForConfigReload(signal: i32);
}

thread_local! {
    /// The configuration was re-read since the loop last looked.
    static RELOADED: Cell<bool> = const { Cell::new(false) };
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

/// Re-reads the configuration files if a SIGHUP asked for it; returns
/// whether it did.
pub fn reload_if_requested() -> bool {
    // SAFETY: a flag set by the signal handler, read on the main thread,
    // as PostgreSQL's own workers do.
    if unsafe { (&raw const pg_sys::ConfigReloadPending).read_volatile() } == 0 {
        return false;
    }
    reload();
    true
}

/// Re-reads the configuration files, as a SIGHUP asks (and answers one
/// that is waiting).
pub fn reload() {
    // SAFETY: the flag is cleared on the main thread, before the read, as
    // PostgreSQL's own workers do.
    unsafe {
        (&raw mut pg_sys::ConfigReloadPending).write_volatile(0);
        pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP);
    }
    RELOADED.set(true);
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

/// A SIGTERM or a reload is waiting, or a reload was done (inside a broker
/// wait) and the loop has not applied it yet: a long piece of work stops
/// early.
pub fn interrupt_pending() -> bool {
    // SAFETY: reads of flags the handlers set.
    let signalled = unsafe {
        (&raw const pg_sys::ProcDiePending).read_volatile() != 0
            || (&raw const pg_sys::ConfigReloadPending).read_volatile() != 0
    };
    signalled || RELOADED.get()
}
