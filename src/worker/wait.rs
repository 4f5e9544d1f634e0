//! How a dispatcher waits: on its latch, together with the Redis socket
//! when there is one, as PostgreSQL's walreceiver waits on libpq's socket.
//!
//! A commit's wake, a SIGHUP or a SIGTERM sets the latch and so ends any
//! wait at once: SIGTERM exits here (`CHECK_FOR_INTERRUPTS`, with `die`
//! installed), and a SIGHUP reloads the configuration and abandons the
//! broker operation only when the broker's settings changed.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use pgrx::prelude::*;

use outbox_core::link::{Interest, Interrupted, Wait, NAP};
use outbox_core::sink::BrokerConfig;

use super::signals;

/// Sleeps on the latch for at most `timeout`; returns whether the time ran
/// out (rather than a wake). Exits if the postmaster died or a SIGTERM came.
pub fn for_wake(timeout: Duration) -> bool {
    let events = latch(None, timeout);
    events & pg_sys::WL_TIMEOUT as i32 != 0
}

/// Sleeps on the latch until `until`, whatever commits come meanwhile, so
/// that theirs are claimed together; returns false, at once, when a
/// SIGTERM or a reload is waiting. Processes no interrupt itself: after a
/// reload the caller records what it sent and goes on; a SIGTERM ends the
/// process at the record's first interrupt check, and what it pushed and
/// did not record is sent again after the restart (at least once).
pub fn linger(until: Instant) -> bool {
    loop {
        if signals::interrupt_pending() {
            return false;
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        wait_latch(None, left);
    }
}

/// One `WaitLatchOrSocket`; the latch is reset and interrupts are
/// processed before returning.
fn latch(socket: Option<(RawFd, Interest)>, timeout: Duration) -> i32 {
    let events = wait_latch(socket, timeout);
    signals::process_interrupts();
    events
}

/// One `WaitLatchOrSocket`, the latch reset if it was set; exits if the
/// postmaster died.
fn wait_latch(socket: Option<(RawFd, Interest)>, timeout: Duration) -> i32 {
    // Rounded up: a wait of less than a millisecond is not a busy loop.
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as std::ffi::c_long;
    let mut wanted = pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH;
    let fd = match socket {
        Some((fd, Interest::Readable)) => {
            wanted |= pg_sys::WL_SOCKET_READABLE;
            fd
        }
        Some((fd, Interest::Writable)) => {
            wanted |= pg_sys::WL_SOCKET_WRITEABLE;
            fd
        }
        None => pg_sys::PGINVALID_SOCKET,
    };
    // SAFETY: the process latch and an open socket of ours.
    unsafe {
        let events =
            pg_sys::WaitLatchOrSocket(pg_sys::MyLatch, wanted as i32, fd, ms, pg_sys::PG_WAIT_EXTENSION);
        if events & pg_sys::WL_LATCH_SET as i32 != 0 {
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        events
    }
}

/// The [`Wait`] of broker operations.
pub struct Waiter {
    /// The broker settings the operation runs with: a reload that changes
    /// them abandons it.
    pub config: BrokerConfig,
}

impl Wait for Waiter {
    fn wait(&mut self, socket: Option<(RawFd, Interest)>, deadline: Instant) -> Result<(), Interrupted> {
        let left = deadline.saturating_duration_since(Instant::now());
        let timeout = if socket.is_some() { left } else { left.min(NAP) };
        let events = latch(socket, timeout);
        if events & pg_sys::WL_LATCH_SET as i32 != 0 {
            return self.reload();
        }
        Ok(())
    }

    fn check(&mut self) -> Result<(), Interrupted> {
        signals::process_interrupts();
        self.reload()
    }
}

impl Waiter {
    /// Performs a pending reload; the operation is abandoned when it
    /// changed the broker's settings (the connection's: not the pause a
    /// push may wait, which derives from `outbox.processing_timeout` and
    /// the batch's size and is fixed at the claim). Else it goes on, and
    /// the rest applies once it is done.
    fn reload(&self) -> Result<(), Interrupted> {
        if !signals::reload_pending() {
            return Ok(());
        }
        let before = crate::config::current();
        signals::reload_if_requested();
        let after = crate::config::current();
        if after.broker != self.config {
            return Err(Interrupted);
        }
        // Each reload is read twice (signals.rs): the read that changed
        // nothing says nothing.
        if after == before {
            return Ok(());
        }
        log!(
            "outbox dispatcher reloaded its settings during a broker operation; the broker's are unchanged: \
             the operation goes on, the rest applies once it is done"
        );
        Ok(())
    }
}
