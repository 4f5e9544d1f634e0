//! The counters and histograms (`outbox_core::metrics`) in shared memory:
//! one set per group of dispatchers, that is per database served. A
//! process counts into its database's set, and `outbox.metrics` shows the
//! set of the database it is read in. Shared memory outlives a dispatcher,
//! so the numbers survive its restarts; a server restart resets them, as
//! it resets PostgreSQL's own statistics, and so does the launcher giving
//! the group to a database anew.

use std::sync::atomic::{AtomicBool, Ordering};

use pgrx::prelude::*;
use pgrx::shmem::AssertPGRXSharedMemory;
use pgrx::{pg_shmem_init, PgAtomic};

use outbox_core::exposition::{Family, Sample};
pub use outbox_core::metrics::{AckSource, Counter, Counters};

use crate::config::MAX_DATABASES;
use crate::slots;

static COUNTERS: PgAtomic<AssertPGRXSharedMemory<[Counters; MAX_DATABASES]>> =
    unsafe { PgAtomic::new(c"outbox_dispatch_metrics") };
static READY: AtomicBool = AtomicBool::new(false);

/// Requests the shared memory; `_PG_init` calls this only while preloading.
pub fn init() {
    pg_shmem_init!(
        COUNTERS = unsafe { AssertPGRXSharedMemory::new(std::array::from_fn(|_| Counters::default())) }
    );
    READY.store(true, Ordering::Relaxed);
}

/// The counters of this process's database, when a group serves it (and
/// the shared memory exists).
pub fn mine() -> Option<&'static Counters> {
    if !READY.load(Ordering::Relaxed) {
        return None;
    }
    // SAFETY: a process global.
    let group = slots::group_of(unsafe { pg_sys::MyDatabaseId })?;
    Some(&COUNTERS.get()[group])
}

/// The counters a dispatcher counts into: its database's. (Only a
/// process that started without the shared memory, which no dispatcher
/// does, counts into a set of its own that nothing shows.)
pub fn here() -> &'static Counters {
    static UNSHARED: std::sync::OnceLock<Counters> = std::sync::OnceLock::new();
    mine().unwrap_or_else(|| UNSHARED.get_or_init(Counters::default))
}

/// Sets group `g`'s counters to zero, as the launcher gives it to a database.
pub fn reset(g: usize) {
    if READY.load(Ordering::Relaxed) {
        COUNTERS.get()[g].reset();
    }
}

pub fn add(counter: Counter, n: u64) {
    here().add(counter, n);
}

pub fn acked(source: AckSource, n: u64) {
    here().acked(source, n);
}

/// The samples of every counter and histogram of this database.
pub fn families() -> Vec<(Family, Vec<Sample>)> {
    mine().map(Counters::families).unwrap_or_default()
}
