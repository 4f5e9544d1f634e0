//! The dispatcher background worker: wait for a wake, claim, push, mark.
//!
//! The loop reads like PostgreSQL's worker_spi: handle a reload, do one
//! step of work, sleep on the latch until a commit wakes us or the next
//! thing falls due. SIGTERM (`die`) ends the process wherever it waits: on
//! the latch, on the Redis socket (see `wait.rs`) or on a lock.

mod setup;
pub(crate) mod signals;
pub(crate) mod store;
pub(crate) mod wait;

use std::ffi::CStr;
use std::time::{Duration, Instant};

use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;

use outbox_core::engine::{Dispatcher, Held, Host, State, Turn};
use outbox_core::metrics::Counters;
use outbox_core::sink::{BrokerConfig, Persistence};

use crate::{config, counters, slots};
use store::SpiDb;

/// A dispatcher, started by the launcher (`launcher.rs`) as dispatcher
/// `index` of group `group` ([`slots::argument`]).
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn outbox_dispatcher_main(arg: pg_sys::Datum) {
    let (group, index) = slots::of_argument(arg);
    signals::install();
    crate::wake::mute();
    let slot = slots::Own::take(group, index);
    signals::follow_launcher(slot.reloads_at_start());
    let database = slot.database();
    if database == pg_sys::InvalidOid {
        // The launcher let the group go before this process started.
        return;
    }
    // By OID: a rename does not matter. A database dropped meanwhile ends
    // this process with a FATAL; the launcher sees it gone.
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(database), None);
    if slots::held(database) {
        // A DROP DATABASE (or rename, or copy) is waiting for this database.
        return;
    }
    slot.listen();
    let name = setup::pin_settings(index);
    setup::return_large_buffers();

    let settings = config::current();
    let mut two_urls = warn_of_two_urls(index, false);
    let mut dispatcher = Dispatcher::new(
        index,
        Background { slot },
        SpiDb::default(),
        name,
        outbox_core::engine::origin(),
        settings,
    );
    dispatcher.log_start();
    loop {
        // A SIGTERM that cut a step short exits here, between transactions.
        signals::process_interrupts();
        signals::reload_if_requested();
        if signals::take_reloaded() {
            dispatcher.reconfigure(config::current());
            two_urls = warn_of_two_urls(index, two_urls);
        }
        let nap = dispatcher.step().min(rest());
        // A commit's wake, a reload or a shutdown that came during the step
        // set the latch, but a wait inside PostgreSQL (a lock, a buffer pin)
        // may have reset it since: what they left in shared memory and in
        // the signal flags decides whether to sleep, not the latch.
        let timed_out = if dispatcher.host().slot.wake_pending() || signals::interrupt_pending() {
            false
        } else {
            wait::for_wake(nap)
        };
        dispatcher.count_wake(timed_out);
    }
}

/// Warns when `outbox.broker_url` and its former name `outbox.redis_url`
/// are both set, to different URLs, unless they were at the last read
/// (`warned`): each reload is read twice (`signals.rs`). Returns whether
/// they are.
fn warn_of_two_urls(index: usize, warned: bool) -> bool {
    let conflict = config::broker_url_conflict();
    if conflict && !warned {
        warning!(
            "outbox dispatcher {index}: outbox.broker_url and outbox.redis_url (its former name) are both set, \
             to different URLs: using outbox.broker_url; remove outbox.redis_url"
        );
    }
    conflict
}

/// Before sleeping: show the dispatcher idle and flush its table
/// statistics, as a backend does between queries. PostgreSQL flushes at
/// most once a second; returns how soon the rest may be flushed, so the
/// sleep ends then (`Duration::MAX` when nothing is left).
fn rest() -> Duration {
    // SAFETY: plain statistics and activity reporting.
    let pending_ms = unsafe {
        pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_IDLE, std::ptr::null());
        pg_sys::pgstat_report_stat(false)
    };
    if pending_ms > 0 {
        Duration::from_millis(pending_ms as u64)
    } else {
        Duration::MAX
    }
}

/// A dispatcher as a background worker: its slot in shared memory, the
/// latch, the server's log.
struct Background {
    slot: slots::Own,
}

impl Host for Background {
    type Db = SpiDb;
    type Waiter = wait::Waiter;

    fn waiter(&self, config: &BrokerConfig) -> wait::Waiter {
        wait::Waiter { config: config.clone() }
    }

    fn set_state(&self, state: State) {
        self.slot.set_state(state);
    }

    fn resume(&self) {
        self.slot.resume();
    }

    fn set_error(&self, error: Option<&str>) {
        self.slot.set_error(error);
    }

    fn set_connected(&self, connected: bool) {
        self.slot.set_connected(connected);
    }

    fn heartbeat(&self) {
        self.slot.heartbeat();
    }

    fn set_persistence(&self, persistence: Persistence) {
        self.slot.set_persistence(persistence);
    }

    fn add_dispatched(&self, events: u64) {
        self.slot.add_dispatched(events);
    }

    fn take_wake_sources(&self) -> u8 {
        self.slot.take_wake_sources()
    }

    fn take_turn(&self, turn: Turn) -> Option<Held> {
        self.slot.take_turn(turn).map(|held| Box::new(held) as Held)
    }

    fn counters(&self) -> &Counters {
        counters::here()
    }

    fn report_running(&self, what: &'static CStr) {
        store::report_running(what);
    }

    fn log(&self, message: &str) {
        log!("{message}");
    }

    fn warning(&self, message: &str) {
        warning!("{message}");
    }

    fn interrupt_pending(&self) -> bool {
        signals::interrupt_pending()
    }

    fn linger(&self, until: Instant) -> bool {
        wait::linger(until)
    }

    fn found_outbox(&self, found: bool, asked: u64) {
        self.slot.found_extension(found, asked);
    }

    fn asked(&self) -> u64 {
        slots::asked()
    }

    fn database_oid(&self) -> u32 {
        // SAFETY: a process global, set once connected.
        unsafe { pg_sys::MyDatabaseId }.to_u32()
    }

    fn leave(&self) -> ! {
        // SAFETY: a normal exit; the slot is released by its exit callback.
        unsafe { pg_sys::proc_exit(0) };
        // Declared to return before PostgreSQL 18's headers mark it noreturn.
        #[allow(unreachable_code)]
        {
            unreachable!("proc_exit does not return")
        }
    }
}
