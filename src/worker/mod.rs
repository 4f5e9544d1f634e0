//! The dispatcher background worker: wait for a wake, claim, push, mark.
//!
//! The loop reads like PostgreSQL's worker_spi: handle signals, do one step
//! of work, sleep on the latch until a commit wakes us or the next thing
//! falls due. A step never blocks longer than `outbox.redis_timeout`, so
//! SIGTERM and SIGHUP are answered promptly even while Redis is down.

mod push;
mod signals;
mod store;

use std::time::{Duration, Instant};

use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags};
use pgrx::prelude::*;

use outbox_core::backoff;
use outbox_core::sink::{redact_url, Sink, SinkError};

use crate::config::{self, Settings};
use crate::metrics::{self, Counter, PushFailure, WakeSource};
use crate::slots::{self, State};
use push::RetryPolicy;
use store::{Claim, Outcome, Store, SWEEP_BATCH};

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
    // A database that does not exist ends this process with a FATAL inside
    // the connect, before anything could record why: say it beforehand, so
    // that outbox.workers shows it while the postmaster restarts us every
    // RESTART_DELAY. Cleared as soon as the connection is made.
    let database = config::database();
    slot.set_error(Some(&format!(
        "cannot connect to database \"{database}\" (outbox.database); see the server log"
    )));
    BackgroundWorker::connect_worker_to_spi(Some(&database), None);
    slot.set_error(None);
    relax_commit_durability();
    return_large_buffers();

    let mut dispatcher = Dispatcher::new(index, slot, Settings::current());
    dispatcher.log_start();
    while !shutdown_requested() {
        if reload_requested() {
            if config::database() != database {
                log!("outbox dispatcher {index}: outbox.database changed; restarting to connect to it");
                unsafe { pg_sys::proc_exit(1) }
            }
            dispatcher.reconfigure(Settings::current());
        }
        let nap = dispatcher.step();
        let timed_out = wait_for_wake(nap);
        dispatcher.count_wake(timed_out);
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
    /// The extension was found missing (and that was logged).
    extension_missing: bool,
    next_sweep: Instant,
    next_lifecycle: Instant,
    next_heartbeat: Instant,
}

impl Dispatcher {
    fn new(index: usize, slot: slots::Own, settings: Settings) -> Dispatcher {
        Dispatcher {
            index,
            slot,
            sink: Sink::new(&settings.broker),
            settings,
            store: Store::new(index),
            origin: format!("outbox_dispatch@{}", hostname()),
            reconnect_attempt: 0,
            next_connect: None,
            released_own: false,
            extension_missing: false,
            next_sweep: Instant::now(),
            next_lifecycle: Instant::now(),
            next_heartbeat: Instant::now(),
        }
    }

    /// Counts what ended the last sleep: commits, `outbox_wake()` calls
    /// (each source once), or else the timer (the safety poll, or whatever
    /// else fell due first).
    fn count_wake(&self, timed_out: bool) {
        let sources = self.slot.take_wake_sources();
        for source in [WakeSource::Commit, WakeSource::Manual] {
            if sources & (1 << source as u8) != 0 {
                metrics::woke(source);
            }
        }
        if sources == 0 && timed_out {
            metrics::woke(WakeSource::Poll);
        }
    }

    fn log_start(&self) {
        let s = &self.settings;
        log!(
            "outbox_dispatcher_starting worker={} database={} redis_url={} redis_password_file={:?} \
             redis_tls_ca_file={:?} \
             enabled={} batch_size={} \
             poll_interval={:?} max_retries={} retry_backoff={:?} redis_timeout={:?} \
             reconnect_delay={:?}..{:?} heartbeat_interval={:?} processing_timeout={:?} \
             ack_timeout={:?} sweep_interval={:?} retention={:?} lifecycle_interval={:?}",
            self.index,
            config::database(),
            redact_url(&s.broker.url),
            s.broker.password_file,
            s.broker.tls_ca_file,
            s.enabled,
            s.batch_size,
            s.poll_interval,
            s.max_retries,
            s.retry_backoff,
            s.broker.timeout,
            s.reconnect_delay_min,
            s.reconnect_delay_max,
            s.heartbeat_interval,
            s.processing_timeout,
            s.ack_timeout,
            s.sweep_interval,
            s.retention,
            s.lifecycle_interval,
        );
    }

    fn reconfigure(&mut self, settings: Settings) {
        if settings == self.settings {
            return;
        }
        if settings.broker != self.settings.broker {
            self.sink = Sink::new(&settings.broker);
            self.slot.set_connected(false);
            self.reconnect_attempt = 0;
            self.next_connect = None;
        }
        self.settings = settings;
        let now = Instant::now();
        self.next_sweep = self.next_sweep.min(now + self.settings.sweep_interval);
        self.next_lifecycle = self.next_lifecycle.min(now + self.settings.lifecycle_interval);
        self.next_heartbeat = self.next_heartbeat.min(now + self.settings.heartbeat_interval);
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
        self.sweep_if_due();
        if !self.connected() {
            if !self.store.extension_exists().unwrap_or_else(|e| report_store_error(e)) {
                return self.wait_for_extension();
            }
            if let Some(wait) = self.connect() {
                return wait;
            }
        }
        if !self.released_own {
            let released = self.store.release_own().unwrap_or_else(|e| report_store_error(e));
            if released > 0 {
                log!(
                    "outbox dispatcher {} released {released} events it held before it restarted",
                    self.index
                );
            }
            self.released_own = true;
        }
        if let Some(wait) = self.heartbeat_if_due() {
            return wait;
        }
        let nap = self.drain();
        let now = Instant::now();
        [self.next_sweep, self.next_lifecycle, self.next_heartbeat]
            .into_iter()
            .map(|at| at.saturating_duration_since(now))
            .fold(nap, Duration::min)
    }

    /// Runs the sweepers whose time has come, each in bounded batches.
    fn sweep_if_due(&mut self) {
        let now = Instant::now();
        let s = &self.settings;
        let (processing_timeout, ack_timeout, retention) = (s.processing_timeout, s.ack_timeout, s.retention);
        if now >= self.next_sweep {
            self.next_sweep = now + self.settings.sweep_interval;
            let rescued = self.sweep_all(|store| store.sweep_stuck(processing_timeout));
            metrics::add(Counter::StuckRescued, rescued);
            if rescued > 0 {
                log!(
                    "outbox dispatcher {}: {rescued} events stuck in processing returned to pending",
                    self.index
                );
            }
            if !ack_timeout.is_zero() {
                let resent = self.sweep_all(|store| store.sweep_unacked(ack_timeout));
                metrics::add(Counter::UnackedResent, resent);
                if resent > 0 {
                    log!(
                        "outbox dispatcher {}: {resent} unacknowledged events will be sent again",
                        self.index
                    );
                }
            }
        }
        if now >= self.next_lifecycle {
            self.next_lifecycle = now + self.settings.lifecycle_interval;
            let purged = self.sweep_all(|store| store.purge(retention, ack_timeout.is_zero()));
            metrics::add(Counter::Purged, purged);
        }
    }

    /// Repeats a bounded sweep until it finds less than a full batch.
    fn sweep_all(&mut self, mut sweep: impl FnMut(&mut Store) -> Result<u64, pgrx::spi::SpiError>) -> u64 {
        let mut total = 0;
        loop {
            let n = sweep(&mut self.store).unwrap_or_else(|e| report_store_error(e));
            total += n;
            if n < SWEEP_BATCH as u64 || interrupt_pending() {
                return total;
            }
        }
    }

    /// PINGs the broker when a heartbeat is due; returns the reconnect wait
    /// when it failed.
    fn heartbeat_if_due(&mut self) -> Option<Duration> {
        let now = Instant::now();
        if now < self.next_heartbeat {
            return None;
        }
        self.next_heartbeat = now + self.settings.heartbeat_interval;
        let sink = self.sink.as_mut().expect("connected before the heartbeat");
        let pinged = {
            let _held = signals::hold();
            sink.ping()
        };
        match pinged {
            Ok(()) => {
                self.broker_answered();
                None
            }
            Err(e) => Some(self.broker_failed(&e)),
        }
    }

    /// Notes (and logs, once) that the extension is not created; returns
    /// the sleep. `CREATE EXTENSION` wakes the dispatchers when it commits.
    fn wait_for_extension(&mut self) -> Duration {
        if !self.extension_missing {
            self.extension_missing = true;
            log!(
                "outbox dispatcher {}: extension outbox_dispatch is not created in database \"{}\"; \
                 waiting for CREATE EXTENSION",
                self.index,
                config::database()
            );
        }
        self.slot.set_state(State::WaitingForExtension);
        self.settings.poll_interval
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
            Ok(sink) => {
                let _held = signals::hold();
                sink.connect()
            }
            Err(e) => Err(e.clone()),
        };
        match result {
            Ok(()) => {
                if self.reconnect_attempt > 0 {
                    let url = self.sink.as_ref().map_or("", Sink::display_url);
                    log!("outbox dispatcher {} reconnected to Redis at {url}", self.index);
                }
                self.reconnect_attempt = 0;
                self.next_connect = None;
                self.slot.set_connected(true);
                self.broker_answered();
                self.slot.set_error(None);
                None
            }
            Err(e) => Some(self.broker_failed(&e)),
        }
    }

    /// The broker just answered: that is as good as a heartbeat.
    fn broker_answered(&mut self) {
        self.slot.heartbeat();
        self.next_heartbeat = Instant::now() + self.settings.heartbeat_interval;
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
        metrics::reconnect(error);
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
    /// long to sleep. Each batch's outcome is recorded in the transaction
    /// that claims the next one.
    fn drain(&mut self) -> Duration {
        let policy = RetryPolicy {
            max_retries: self.settings.max_retries,
            backoff: self.settings.retry_backoff,
            max_payload_bytes: self.settings.max_payload_bytes,
        };
        // Events given back with a backoff fall due before the poll.
        let mut nap = self.settings.poll_interval;
        let mut settled = Outcome::default();
        loop {
            let claim = self
                .store
                .settle_and_claim(&settled, self.settings.batch_size)
                .unwrap_or_else(|e| report_store_error(e));
            nap = nap.min(account(&settled));
            let (events, next_due) = match claim {
                Claim::NoExtension => return self.wait_for_extension(),
                Claim::Claimed { events, next_due } => (events, next_due),
            };
            self.extension_missing = false;
            if events.is_empty() {
                self.slot.set_state(State::Idle);
                return next_due.map_or(nap, |due| due.min(nap));
            }
            self.slot.set_state(State::Draining);
            let sink = self.sink.as_mut().expect("connected before draining");
            let pushed = {
                let _held = signals::hold();
                push::push(sink, &events, &self.origin, &policy)
            };
            settled = match pushed {
                Ok(outcome) => outcome,
                Err(e) => {
                    metrics::push_failed(PushFailure::of(&e), events.len() as u64);
                    self.store.release(events.iter().map(|e| e.id)).unwrap_or_else(|e| report_store_error(e));
                    return self.broker_failed(&e);
                }
            };
            self.slot.add_dispatched(settled.dispatched.len() as u64);
            if !settled.dispatched.is_empty() {
                self.broker_answered();
            }
            if interrupt_pending() {
                self.store.settle(&settled).unwrap_or_else(|e| report_store_error(e));
                account(&settled);
                return Duration::ZERO;
            }
        }
    }
}

/// Counts the retries and dead letters of a recorded outcome; returns how
/// soon the first retry falls due (`Duration::MAX` without retries).
fn account(settled: &Outcome) -> Duration {
    let retried = settled.failures.iter().filter(|f| !f.dead);
    let soonest = retried.clone().map(|f| f.delay).min().unwrap_or(Duration::MAX);
    let retries = retried.count() as u64;
    metrics::add(Counter::Retries, retries);
    metrics::add(Counter::DeadLetters, settled.failures.len() as u64 - retries);
    soonest
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
/// Returns whether the time ran out.
fn wait_for_wake(timeout: Duration) -> bool {
    let ms = timeout.as_millis().min(i32::MAX as u128) as std::ffi::c_long;
    let events = unsafe {
        let events = pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            ms,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
        events
    };
    check_for_interrupts!();
    events & pg_sys::WL_TIMEOUT as i32 != 0
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

/// A batch's buffers (messages, the packed pipeline) run to megabytes and
/// vary in size from batch to batch. By default glibc raises its mmap
/// threshold after the first such buffer is freed and serves the next ones
/// from the heap, which then fragments and keeps the dispatcher's memory
/// high. A fixed threshold maps every buffer over 128 kB and unmaps it when
/// freed: memory stays flat however many events pass.
fn return_large_buffers() {
    // SAFETY: mallopt only tunes this process's allocator.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024) };
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}
