//! What a dispatcher needs of the process it runs in: in the server, a
//! background worker's slot in shared memory, the latch and PostgreSQL's
//! log (the extension's `src/worker/`); outside it, the sidecar's own.

use std::ffi::CStr;
use std::time::Instant;

use crate::link::Wait;
use crate::metrics::Counters;
use crate::named;
use crate::sink::{BrokerConfig, Persistence};
use crate::store::sql::Db;

named! {
    /// What a dispatcher is doing, as `outbox.workers.state` shows it.
    pub enum State {
        Stopped = "stopped",
        Starting = "starting",
        Idle = "idle",
        Draining = "draining",
        Reconnecting = "reconnecting",
        Paused = "paused",
        /// A statement failed (a lock not granted in time, say): retrying.
        Blocked = "blocked",
        /// Its database is a copy of another: nothing is sent until
        /// `outbox_adopt()`.
        Copy = "copy",
        /// The launcher could not start it: `max_worker_processes` is used up.
        NoWorkerSlot = "no worker slot",
    }
}

named! {
    /// Work one dispatcher at a time does.
    pub enum Turn {
        /// The sweepers and the lifecycle purge.
        Housekeeping = "housekeeping",
        /// Collecting the outcomes Celery workers report: the report list
        /// is read and trimmed from its head, so two at once would read
        /// the same reports twice (the trim drops only a head that is
        /// still what was read: no report is lost even then).
        Reports = "reports",
    }
}

/// A turn held until dropped.
pub type Held = Box<dyn std::any::Any>;

/// The process a dispatcher runs in.
pub trait Host {
    /// Where the dispatcher's transactions run.
    type Db: Db;
    /// How the broker's operations wait (for the socket, a deadline, a
    /// signal).
    type Waiter: Wait;

    /// A wait for the broker's operations under `config`.
    fn waiter(&self, config: &BrokerConfig) -> Self::Waiter;

    // What `outbox.workers` shows of the dispatcher.
    fn set_state(&self, state: State);
    /// Running again (idle), unless it shows a state a step sets.
    fn resume(&self);
    /// The last error (free of credentials); `None` clears it.
    fn set_error(&self, error: Option<&str>);
    fn set_connected(&self, connected: bool);
    /// The broker answered now.
    fn heartbeat(&self);
    fn set_persistence(&self, persistence: Persistence);
    fn add_dispatched(&self, events: u64);
    /// The wakes (bits `1 << WakeSource`) since the dispatcher last looked.
    fn take_wake_sources(&self) -> u8;
    /// Takes `turn` unless another dispatcher of the database has it.
    fn take_turn(&self, turn: Turn) -> Option<Held>;

    /// This database's counters.
    fn counters(&self) -> &Counters;
    /// Shows the dispatcher at `what` (`pg_stat_activity`).
    fn report_running(&self, what: &'static CStr);
    fn log(&self, message: &str);
    fn warning(&self, message: &str);

    /// A shutdown or a reload asks the dispatcher to stop what it does.
    fn interrupt_pending(&self) -> bool;
    /// Waits until `until` for the events of more commits; false when a
    /// shutdown or reload came first.
    fn linger(&self, until: Instant) -> bool;

    /// The outbox was found in the database (`found`), or found missing,
    /// as of the [`Host::asked`] count `asked`.
    fn found_outbox(&self, found: bool, asked: u64);
    /// How many times the database has asked for dispatchers (a `CREATE
    /// EXTENSION` does): a look for the outbox is stale once it changed.
    fn asked(&self) -> u64;
    /// The OID of the database served.
    fn database_oid(&self) -> u32;
    /// Ends the dispatcher: the outbox is not in its database.
    fn leave(&self) -> !;
}
