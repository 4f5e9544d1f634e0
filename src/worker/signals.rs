//! Holding signals back while the dispatcher talks to Redis.
//!
//! A socket read or write with a timeout is not restarted after a signal
//! handler runs, SA_RESTART or not: it fails with EINTR. PostgreSQL signals
//! its processes routinely (SIGUSR1 for invalidation catch-up, SIGHUP for a
//! reload), and an interrupted Redis call would look like a broken
//! connection: the batch given back, a reconnect after seconds. So signals
//! wait while Redis is spoken to, never longer than `outbox.redis_timeout`,
//! and are delivered as soon as the call returns; their handlers only set
//! flags and the latch, which the loop looks at next.

use std::mem::MaybeUninit;

/// Signals are held from `hold()` until this is dropped.
pub struct Held(libc::sigset_t);

pub fn hold() -> Held {
    // SAFETY: plain sigset manipulation; the faults a program causes itself
    // (SIGSEGV and kin) are left deliverable.
    unsafe {
        let mut all = MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigfillset(all.as_mut_ptr());
        let mut all = all.assume_init();
        for fault in [libc::SIGSEGV, libc::SIGBUS, libc::SIGFPE, libc::SIGILL, libc::SIGABRT] {
            libc::sigdelset(&mut all, fault);
        }
        let mut previous = MaybeUninit::<libc::sigset_t>::uninit();
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, previous.as_mut_ptr());
        Held(previous.assume_init())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved by `hold`; pending signals are
        // delivered here.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}
