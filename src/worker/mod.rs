//! The dispatcher background worker: wait for a wake, claim, push, mark.
//!
//! The loop reads like PostgreSQL's worker_spi: handle signals, do one step
//! of work, sleep on the latch until a commit wakes us or the next thing
//! falls due. A step never blocks longer than `outbox.redis_timeout`, so
//! SIGTERM and SIGHUP are answered promptly even while Redis is down.

mod push;
mod store;

use std::time::{Duration, Instant};

use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::prelude::*;

use outbox_core::backoff;
use outbox_core::sink::{redact_url, Sink, SinkError};

use crate::config::{self, Settings};
use crate::slots::{self, State};
use push::RetryPolicy;
use store::{Claim, Store};

/// How soon the postmaster restarts a dispatcher that exited: after an
/// error, a `pg_terminate_backend`, or a database that does not exist.
const RESTART_DELAY: Duration = Duration::from_secs(5);

/// Registers `count` dispatchers; `_PG_init` calls this while preloading.
pub fn register(count: usize) {
    for index in 0..count {
        BackgroundWorkerBuilder::new(&format!("outbox dispatcher {index}"))
            .set_type("outbox dispatcher")
            .set_library("outbox_dispatch")
            .set_function("outbox_dispatcher_main")
            .set_argument(Some(pg_sys::Datum::from(index)))
            .enable_spi_access()
            .set_start_time(BgWorkerStartTime::RecoveryFinished)
            .set_restart_time(Some(RESTART_DELAY))
            .load();
    }
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn outbox_dispatcher_main(arg: pg_sys::Datum) {
    let index = arg.value();
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let slot = slots::Own::take(index);
    BackgroundWorker::connect_worker_to_spi(Some(&config::database()), None);
    relax_commit_durability();

    let mut dispatcher = Dispatcher::new(index, slot, Settings::current());
    dispatcher.log_start();
    while !shutdown_requested() {
        if reload_requested() {
            dispatcher.reconfigure(Settings::current());
        }
        let nap = dispatcher.step();
        wait_for_wake(nap);
    }
    log!("outbox dispatcher {index} stopping");
    // Exit code 1: a zero exit would unregister the worker until the next
    // server start, and a pg_terminate_backend must not do that.
    unsafe { pg_sys::proc_exit(1) }
}

struct Dispatcher {
    index: usize,
    slot: slots::Own,
    settings: Settings,
    store: Store,
    sink: Result<Sink, SinkError>,
    origin: String,
    /// Consecutive failed connection attempts.
    reconnect_attempt: u32,
    /// No connection attempt before this.
    next_connect: Option<Instant>,
    /// Claims left by an earlier life of this dispatcher were released.
    released_own: bool,
}

impl Dispatcher {
    fn new(index: usize, slot: slots::Own, settings: Settings) -> Dispatcher {
        Dispatcher {
            index,
            slot,
            sink: Sink::new(&settings.redis_url, settings.redis_timeout),
            settings,
            store: Store::new(index),
            origin: format!("outbox_dispatch@{}", hostname()),
            reconnect_attempt: 0,
            next_connect: None,
            released_own: false,
        }
    }

    fn log_start(&self) {
        let s = &self.settings;
        log!(
            "outbox_dispatcher_starting worker={} database={} redis_url={} enabled={} batch_size={} \
             poll_interval={:?} max_retries={} retry_backoff={:?} redis_timeout={:?} \
             reconnect_delay={:?}..{:?}",
            self.index,
            config::database(),
            redact_url(&s.redis_url),
            s.enabled,
            s.batch_size,
            s.poll_interval,
            s.max_retries,
            s.retry_backoff,
            s.redis_timeout,
            s.reconnect_delay_min,
            s.reconnect_delay_max,
        );
    }

    fn reconfigure(&mut self, settings: Settings) {
        if settings == self.settings {
            return;
        }
        if (&settings.redis_url, settings.redis_timeout)
            != (&self.settings.redis_url, self.settings.redis_timeout)
        {
            self.sink = Sink::new(&settings.redis_url, settings.redis_timeout);
            self.slot.set_connected(false);
            self.reconnect_attempt = 0;
            self.next_connect = None;
        }
        self.settings = settings;
        log!("outbox dispatcher {} reloaded its settings", self.index);
        self.log_start();
    }

    /// One step of work; returns how long to sleep unless woken.
    fn step(&mut self) -> Duration {
        let poll = self.settings.poll_interval;
        if !self.settings.enabled {
            self.slot.set_state(State::Paused);
            return poll;
        }
        if !self.connected() {
            if !self
                .store
                .extension_exists()
                .unwrap_or_else(|e| report_store_error(e))
            {
                self.slot.set_state(State::WaitingForExtension);
                return poll;
            }
            if let Some(wait) = self.connect() {
                return wait;
            }
        }
        if !self.released_own {
            let released = self
                .store
                .release_own()
                .unwrap_or_else(|e| report_store_error(e));
            if released > 0 {
                log!(
                    "outbox dispatcher {} released {released} events it held before it restarted",
                    self.index
                );
            }
            self.released_own = true;
        }
        self.drain()
    }

    fn connected(&self) -> bool {
        self.sink.as_ref().is_ok_and(Sink::is_connected)
    }

    /// Connects when the backoff allows; returns the wait when it did not.
    fn connect(&mut self) -> Option<Duration> {
        let now = Instant::now();
        if let Some(at) = self.next_connect.filter(|at| *at > now) {
            return Some(at - now);
        }
        let result = match &mut self.sink {
            Ok(sink) => sink.connect(),
            Err(e) => Err(e.clone()),
        };
        match result {
            Ok(()) => {
                if self.reconnect_attempt > 0 {
                    log!("outbox dispatcher {} reconnected to Redis", self.index);
                }
                self.reconnect_attempt = 0;
                self.next_connect = None;
                self.slot.set_connected(true);
                self.slot.set_error(None);
                None
            }
            Err(e) => Some(self.broker_failed(&e)),
        }
    }

    /// Records a broker failure; returns the delay before the next attempt.
    fn broker_failed(&mut self, error: &SinkError) -> Duration {
        let s = &self.settings;
        let delay = backoff::reconnect_delay(
            s.reconnect_delay_min,
            s.reconnect_delay_max,
            self.reconnect_attempt,
            backoff::random_unit(),
        );
        self.reconnect_attempt = self.reconnect_attempt.saturating_add(1);
        self.next_connect = Some(Instant::now() + delay);
        self.slot.set_state(State::Reconnecting);
        self.slot.set_connected(false);
        self.slot.set_error(Some(&error.to_string()));
        log!(
            "outbox dispatcher {}: {error} (reason {}); reconnecting in {:.1}s",
            self.index,
            error.reason(),
            delay.as_secs_f64()
        );
        delay
    }

    /// Claims, pushes and marks batches until the queue is empty; returns how
    /// long to sleep.
    fn drain(&mut self) -> Duration {
        let poll = self.settings.poll_interval;
        let policy = RetryPolicy {
            max_retries: self.settings.max_retries,
            backoff: self.settings.retry_backoff,
            max_payload_bytes: self.settings.max_payload_bytes,
        };
        loop {
            let claim = self
                .store
                .claim(self.settings.batch_size)
                .unwrap_or_else(|e| report_store_error(e));
            let (events, next_due) = match claim {
                Claim::NoExtension => {
                    self.slot.set_state(State::WaitingForExtension);
                    return poll;
                }
                Claim::Claimed { events, next_due } => (events, next_due),
            };
            if events.is_empty() {
                self.slot.set_state(State::Idle);
                return next_due.map_or(poll, |due| due.min(poll));
            }
            self.slot.set_state(State::Draining);
            let sink = self.sink.as_mut().expect("connected before draining");
            match push::push(sink, &events, &self.origin, &policy) {
                Ok(outcome) => {
                    self.store
                        .mark(&outcome.dispatched, &outcome.failures)
                        .unwrap_or_else(|e| report_store_error(e));
                    self.slot.add_dispatched(outcome.dispatched.len() as u64);
                }
                Err(e) => {
                    self.store
                        .release(events.iter().map(|e| e.id))
                        .unwrap_or_else(|e| report_store_error(e));
                    return self.broker_failed(&e);
                }
            }
            if events.len() < self.settings.batch_size {
                self.slot.set_state(State::Idle);
                return next_due.map_or(poll, |due| due.min(poll));
            }
            if interrupt_pending() {
                return Duration::ZERO;
            }
        }
    }
}

/// An SPI failure is not something the loop can repair: report it as an
/// ERROR, which ends this dispatcher; the postmaster starts it again after
/// `RESTART_DELAY`, and the restarted one releases what this one held.
fn report_store_error(e: pgrx::spi::SpiError) -> ! {
    error!("outbox dispatcher: {e}")
}

fn shutdown_requested() -> bool {
    unsafe { (&raw const pg_sys::ShutdownRequestPending).read_volatile() != 0 }
}

fn interrupt_pending() -> bool {
    shutdown_requested() || unsafe { (&raw const pg_sys::ConfigReloadPending).read_volatile() != 0 }
}

/// Re-reads the configuration files after a SIGHUP.
fn reload_requested() -> bool {
    unsafe {
        if (&raw const pg_sys::ConfigReloadPending).read_volatile() == 0 {
            return false;
        }
        (&raw mut pg_sys::ConfigReloadPending).write_volatile(0);
        pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP);
    }
    true
}

/// Sleeps on the latch for at most `timeout`; a commit wake, SIGHUP or
/// SIGTERM ends the sleep early. Exits at once if the postmaster died.
fn wait_for_wake(timeout: Duration) {
    let ms = timeout.as_millis().min(i32::MAX as u128) as std::ffi::c_long;
    unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            ms,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
    }
    check_for_interrupts!();
}

/// The dispatcher's own status changes need not wait for the WAL flush: a
/// mark lost in a crash only re-sends the event with the same task id, and a
/// lost claim leaves it pending. Never lost, at most sent twice.
fn relax_commit_durability() {
    unsafe {
        pg_sys::SetConfigOption(
            c"synchronous_commit".as_ptr(),
            c"off".as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        );
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}
