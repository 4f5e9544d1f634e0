//! A dispatcher: wait for a wake, claim, push, mark, and the rest of its
//! work (reports, housekeeping, the broker's connection), written once for
//! both hosts ([`Host`]): a background worker in the server, the sidecar's
//! dispatchers beside it.

mod broker;
mod host;
mod housekeeping;
mod push;
mod reports;
mod settings;

use std::time::{Duration, Instant};

use crate::backoff;
use crate::broker_url;
use crate::guc;
use crate::metrics::{Counter, Counters, WakeSource};
use crate::store::{Bounds, Claim, Home, Outcome, Store, StoreError};
use broker::Broker;
pub use host::{Held, Host, State, Turn};
use push::{Pushed, RetryPolicy};
pub use settings::Settings;

/// How soon a statement that failed (a lock not granted, say) is tried
/// again: at first after a second, then backing off (with jitter) up to ten
/// seconds while it keeps failing.
const STORE_RETRY_MIN: Duration = Duration::from_secs(1);
const STORE_RETRY_MAX: Duration = Duration::from_secs(10);

pub struct Dispatcher<H: Host> {
    index: usize,
    host: H,
    settings: Settings,
    store: Store<H::Db>,
    broker: Broker<H::Waiter>,
    origin: String,
    /// The last push's outcome, not yet recorded (a statement failed).
    unsettled: Outcome,
    /// Claims left by an earlier life of this dispatcher were released.
    released_own: bool,
    /// The database this dispatcher serves (its name when it started).
    database: String,
    /// The extension was found.
    extension_found: bool,
    /// This database holds its own events, not a copy's.
    at_home: bool,
    /// [`Host::asked`] as the current step began.
    asked: u64,
    /// The last statement failed with this error (which `last_error` shows).
    store_failing: Option<String>,
    /// Consecutive failed statements.
    store_attempt: u32,
    /// No statement before this, after a failed one.
    store_retry_at: Option<Instant>,
    housekeeping: housekeeping::Schedule,
    reports: reports::Collector,
    /// The deprecated settings this dispatcher has warned of (once each).
    deprecation_told: Vec<&'static str>,
    /// When the last claim that took every event in line began: the next
    /// lingers until `outbox.linger` after it.
    drained_at: Option<Instant>,
    /// When the queue is to be claimed from without asking first: when the
    /// last drain asked (the poll, an event coming due), or at once after
    /// what may have put events in line (reports passing keys on,
    /// housekeeping that did, a reload). Before then, a step (a wake, a host's poll,
    /// the reports' poll, a heartbeat) asks whether there is anything to
    /// claim ([`Store::in_line`], read only): an empty claim writes its
    /// position and takes a transaction id.
    drain_at: Instant,
}

impl<H: Host> Dispatcher<H> {
    /// Dispatcher `index` of `database`, in `host`, its transactions on
    /// `db`; its messages say they come from `origin`.
    pub fn new(
        index: usize,
        host: H,
        db: H::Db,
        database: String,
        origin: String,
        settings: Settings,
    ) -> Self {
        Dispatcher {
            index,
            broker: Broker::new(index, host.waiter(&settings.broker), &settings.broker),
            host,
            store: Store::new(db, index, settings.statement_timeout, settings.awaiting(), settings.keys),
            settings,
            origin,
            unsettled: Outcome::default(),
            released_own: false,
            database,
            extension_found: false,
            at_home: false,
            asked: 0,
            store_failing: None,
            store_attempt: 0,
            store_retry_at: None,
            housekeeping: housekeeping::Schedule::new(),
            reports: reports::Collector::new(),
            deprecation_told: Vec::new(),
            drained_at: None,
            drain_at: Instant::now(),
        }
    }

    /// Counts what ended the last sleep: commits, `outbox_wake()` calls
    /// (each source once), or else the timer (the safety poll, or whatever
    /// else fell due first).
    pub fn count_wake(&self, timed_out: bool) {
        let sources = self.host.take_wake_sources();
        for source in WakeSource::ALL {
            if sources & (1 << source as u8) != 0 {
                self.host.counters().woke(source);
            }
        }
        if sources == 0 && timed_out {
            self.host.counters().woke(WakeSource::Poll);
        }
    }

    pub fn log_start(&mut self) {
        for (former, new) in guc::RENAMED {
            if self.settings.deprecated.contains(&former) && !self.deprecation_told.contains(&former) {
                self.host.warning(&format!(
                    "outbox dispatcher {}: {former} is deprecated, and read because {new} is at its \
                     default: set {new} instead",
                    self.index
                ));
                self.deprecation_told.push(former);
            }
        }
        let s = &self.settings;
        if let Some(set) = s.processing_timeout_set {
            self.host.warning(&format!(
                "outbox dispatcher {}: outbox.processing_timeout ({}s) is shorter than the longest push \
                 (outbox.broker_timeout per round trip of outbox.batch_size events of outbox.max_payload_bytes, \
                 outbox.max_batch_bytes per round trip); using {}s",
                self.index,
                set.as_secs(),
                s.processing_timeout.as_secs()
            ));
        }
        if s.broker.wait_replicas == 0 && s.broker.url.starts_with("sentinel://") {
            self.host.warning(&format!(
                "outbox dispatcher {}: outbox.broker_url names sentinels and outbox.redis_wait_replicas is set to 0: \
                 a failover can lose the events pushed just before it (set it to 1 or more, or reset it)",
                self.index
            ));
        }
        self.host.log(&format!(
            "outbox_dispatcher_starting worker={} database={} broker_url={} broker_password_file={:?} \
             broker_tls_ca_file={:?} enabled={} batch_size={} max_batch_bytes={} \
             poll_interval={:?} max_retries={} retry_backoff={:?} broker_timeout={:?} \
             reconnect_delay={:?}..{:?} heartbeat_interval={:?} processing_timeout={:?} \
             ack_timeout={:?} max_redeliveries={} statement_timeout={:?} sweep_interval={:?} retention={:?} lifecycle_interval={:?} \
             report_key={:?} redis_sentinel_master={:?} redis_wait_replicas={} redis_key_prefix={:?} \
             priority_steps={:?} priority_separator={:?} amqp_queue_type={} amqp_max_priority={}",
            self.index,
            self.database,
            broker_url::redact(&s.broker.url),
            s.broker.password_file,
            s.broker.tls_ca_file,
            s.enabled,
            s.batch_size,
            s.broker.max_batch_bytes,
            s.poll_interval,
            s.max_retries,
            s.retry_backoff,
            s.broker.timeout,
            s.reconnect_delay_min,
            s.reconnect_delay_max,
            s.heartbeat_interval,
            s.processing_timeout,
            s.ack_timeout,
            s.max_redeliveries,
            s.statement_timeout,
            s.sweep_interval,
            s.retention,
            s.lifecycle_interval,
            s.report_key.as_deref().unwrap_or(""),
            s.broker.sentinel_master,
            s.broker.wait_replicas,
            s.broker.key_prefix,
            s.broker.priority_steps,
            s.broker.priority_separator,
            s.broker.queues.kind.name(),
            s.broker.queues.max_priority,
        ));
    }

    pub fn reconfigure(&mut self, settings: Settings) {
        if settings == self.settings {
            return;
        }
        if settings.broker != self.settings.broker {
            self.broker.replace(&settings.broker, &self.host);
        }
        self.store.set_statement_timeout(settings.statement_timeout);
        self.store.set_awaited(settings.awaiting());
        self.store.set_key_policy(settings.keys);
        self.settings = settings;
        self.drain_at = Instant::now();
        self.housekeeping.reschedule(&self.settings);
        self.broker.reschedule(&self.settings);
        self.host.log(&format!("outbox dispatcher {} reloaded its settings", self.index));
        self.log_start();
    }

    /// The host it runs in.
    pub fn host(&self) -> &H {
        &self.host
    }

    /// One step of work; returns how long to sleep unless woken.
    pub fn step(&mut self) -> Duration {
        let nap = self.work();
        self.host.counters().add(Counter::KeyTurns, self.store.take_key_turns());
        nap
    }

    fn work(&mut self) -> Duration {
        // Before any lookup of the extension: a commit that asks after
        // this makes an "absent" found below stale.
        self.asked = self.host.asked();
        // Backing off after a failed statement or connect: a wake does not
        // cut it short (a persistent failure would be retried at the rate
        // of commits).
        let now = Instant::now();
        let connect_at = self.broker.reconnect_at();
        if let Some(at) = [self.store_retry_at, connect_at].into_iter().flatten().filter(|at| *at > now).max()
        {
            return at - now;
        }
        // The first look, paused or not: the launcher starts the other
        // dispatchers, or lets the database go, on what it finds. Paused,
        // each wake looks again: a dropped extension lets the database go.
        if !self.extension_found || !self.settings.enabled {
            match self.store.extension_exists() {
                Err(e) => return self.store_failed(&e),
                Ok(false) => return self.leave_for_extension(),
                Ok(true) => self.found_extension(),
            }
        }
        let poll = self.settings.poll_interval;
        if !self.at_home {
            match self.store.home(self.host.database_oid()) {
                Err(e) => return self.store_failed(&e),
                Ok(None) => return self.leave_for_extension(),
                Ok(Some(Home::Own)) => self.at_home = true,
                Ok(Some(Home::Adopted(original))) => {
                    self.host.log(&format!(
                        "outbox dispatcher {}: database \"{}\" is a copy of the database of OID {original} \
                         with no event to send or confirm: serving it as its own",
                        self.index, self.database
                    ));
                    self.at_home = true;
                }
                Ok(Some(Home::CopyOf(original, schema))) => return self.wait_for_adoption(original, &schema),
            }
        }
        if !self.settings.enabled {
            // Paused, nothing is sent: a broker that expects heartbeats
            // (RabbitMQ) would close the connection. Closed here instead,
            // made again on resuming.
            self.broker.disconnect(&self.host);
            self.host.set_state(State::Paused);
            return poll;
        }
        self.host.resume();
        self.housekeep_and_drain_if_it_lined();
        if !self.broker.connected() {
            match self.store.extension_exists() {
                Err(e) => return self.store_failed(&e),
                Ok(false) => return self.leave_for_extension(),
                Ok(true) => {}
            }
            if let Some(wait) = self.broker.connect(&self.host, &self.settings) {
                return wait;
            }
        }
        if !self.released_own {
            match self.store.release_own() {
                Err(e) => return self.store_failed(&e),
                Ok(0) => {}
                Ok(released) => self.host.log(&format!(
                    "outbox dispatcher {} released {released} events it held before it restarted",
                    self.index
                )),
            }
            self.released_own = true;
        }
        if let Some(wait) = self.broker.heartbeat_if_due(&self.host, &self.settings) {
            return wait;
        }
        let now = Instant::now();
        let due = now >= self.drain_at;
        let nap = match if due { Ok(true) } else { self.store.in_line() } {
            Ok(true) => {
                let nap = self.drain();
                self.drain_at = Instant::now() + nap;
                nap
            }
            // Nothing to claim: idle, as an empty claim would have shown
            // it (a statement succeeded: a failure before is over).
            Ok(false) => {
                self.store_recovered();
                self.host.set_state(State::Idle);
                self.drain_at - now
            }
            Err(e) => return self.store_failed(&e),
        };
        if let Some(wait) = self.collect_reports() {
            return wait;
        }
        let now = Instant::now();
        let reports_due = self.settings.report_key.as_ref().map(|_| self.reports.next_due());
        [Some(self.housekeeping.next_due()), Some(self.broker.next_heartbeat()), reports_due]
            .into_iter()
            .flatten()
            .map(|at| at.saturating_duration_since(now))
            .fold(nap, Duration::min)
    }

    /// Records what Celery workers reported, when reports are on; returns
    /// the wait when the broker or a statement failed.
    fn collect_reports(&mut self) -> Option<Duration> {
        let key = self.settings.report_key.as_deref()?;
        let (sink, waiter) = self.broker.session().filter(|(sink, _)| sink.is_connected())?;
        let collected =
            self.reports.collect_if_due(self.index, key, &self.host, &mut self.store, sink, waiter);
        match collected {
            // Keys passed on: their next heads are in line.
            Ok(true) => {
                self.drain_at = Instant::now();
                None
            }
            Ok(false) => None,
            Err(reports::CollectError::Broker(e)) => Some(self.broker.failed(&e, &self.host, &self.settings)),
            Err(reports::CollectError::Store(e)) => Some(self.store_failed(&e)),
        }
    }

    /// A statement failed and was rolled back: show why (in the log once
    /// while it repeats), try again soon, later the longer it keeps failing.
    fn store_failed(&mut self, error: &StoreError) -> Duration {
        self.host.set_state(State::Blocked);
        self.show_store_error(error);
        let delay = backoff::reconnect_delay(
            STORE_RETRY_MIN,
            STORE_RETRY_MAX,
            self.store_attempt,
            backoff::random_unit(),
        );
        self.store_attempt = self.store_attempt.saturating_add(1);
        self.store_retry_at = Some(Instant::now() + delay);
        delay
    }

    /// Shows a statement's error in `last_error`, and logs it unless it
    /// repeats the last one.
    fn show_store_error(&mut self, error: &StoreError) {
        let message = error.to_string();
        // Set every time: a broker success in between may have cleared it.
        self.host.set_error(Some(&message));
        if self.store_failing.as_deref() != Some(message.as_str()) {
            self.host.log(&format!(
                "outbox dispatcher {}: {message}; trying again in {}s to {}s",
                self.index,
                STORE_RETRY_MIN.as_secs(),
                STORE_RETRY_MAX.as_secs()
            ));
            self.store_failing = Some(message);
        }
    }

    /// A statement succeeded after failing: the error no longer applies.
    fn store_recovered(&mut self) {
        self.store_answered(None);
    }

    /// A statement succeeded, and what it did failed in part (`failure`:
    /// an accumulated subscription's batch that could not be made), or
    /// not at all: the error shown is that, and nothing flickers between.
    fn store_answered(&mut self, failure: Option<&StoreError>) {
        self.store_attempt = 0;
        self.store_retry_at = None;
        match failure {
            Some(error) => self.show_store_error(error),
            None => {
                if self.store_failing.take().is_some() {
                    self.host.set_error(None);
                }
            }
        }
    }

    /// The extension is not created (or was dropped): the dispatcher says
    /// so and exits, and the launcher lets the database go until a commit
    /// there (`CREATE EXTENSION`'s) asks for dispatchers again. Unless a
    /// look made after saying so finds it: a `CREATE EXTENSION` that
    /// committed meanwhile, seeing the dispatchers still serving, asked
    /// nobody. (It reads the group after its commit, this dispatcher the
    /// catalog after its word: one of the two sees the other.) Then it
    /// returns: the step is to begin again at once.
    fn leave_for_extension(&mut self) -> Duration {
        self.host.found_outbox(false, self.asked);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if let Ok(true) = self.store.extension_exists() {
            self.found_extension();
            return Duration::ZERO;
        }
        if self.index == 0 {
            self.host.log(&format!(
                "outbox dispatcher {}: extension outbox_dispatch is not created in database \"{}\"; \
                 not serving it until CREATE EXTENSION",
                self.index, self.database
            ));
        }
        self.host.leave()
    }

    /// This database is a copy of another, with that one's events: shows
    /// why nothing is sent (and logs it once); returns the sleep.
    /// `outbox_adopt()` wakes the dispatchers as it commits.
    fn wait_for_adoption(&mut self, original: u32, schema: &str) -> Duration {
        let copied = match original {
            0 => "was taken for a copy when it was updated to 0.6.0".to_string(),
            _ => format!("is a copy of the database of OID {original} (CREATE DATABASE ... TEMPLATE)"),
        };
        let message = format!(
            "database \"{}\" {copied} and holds events sent from the original: \
             nothing is sent from here until SELECT {schema}.outbox_adopt() in it",
            self.database
        );
        if self.store_failing.as_deref() != Some(message.as_str()) {
            if self.index == 0 {
                self.host.warning(&format!("outbox dispatcher {}: {message}", self.index));
            }
            self.host.set_error(Some(&message));
            self.store_failing = Some(message);
        }
        self.host.set_state(State::Copy);
        self.settings.poll_interval
    }

    /// The extension exists: the launcher may start the other dispatchers.
    fn found_extension(&mut self) {
        self.extension_found = true;
        self.host.found_outbox(true, self.asked);
    }

    /// Claims, pushes and marks batches until the queue is empty; returns how
    /// long to sleep. Each batch's outcome is recorded in the transaction
    /// that claims the next one.
    fn drain(&mut self) -> Duration {
        let policy =
            RetryPolicy { max_retries: self.settings.max_retries, backoff: self.settings.retry_backoff };
        // Events given back with a backoff fall due before the poll.
        let mut nap = self.settings.poll_interval;
        loop {
            // A stream of commits, each waking the dispatcher: their
            // events wait a little to go in one claim and one push.
            let lingered = self.drained_at.is_none_or(|at| self.host.linger(at + self.settings.linger));
            if !lingered {
                self.settle();
                return Duration::ZERO;
            }
            let settled = std::mem::take(&mut self.unsettled);
            // No later than the claim's own instant (its transaction's
            // start): the pause deadline counts from here.
            let claiming = Instant::now();
            let bounds =
                Bounds { events: self.settings.batch_size, bytes: self.settings.broker.max_batch_bytes };
            let claim = self.store.settle_and_claim(&settled, bounds, self.settings.batch_budget);
            let claim = match claim {
                Ok(claim) => claim,
                Err(e) => {
                    self.unsettled = settled;
                    return self.store_failed(&e);
                }
            };
            nap = nap.min(account(self.host.counters(), &settled));
            let (events, batch, drained, next_due) = match claim {
                Claim::NoExtension => {
                    self.store_recovered();
                    return self.leave_for_extension();
                }
                Claim::Claimed { flushed, events, batch, drained, next_due } => {
                    self.host.counters().add(Counter::AccumulatedBatches, flushed.batches);
                    self.host.counters().add(Counter::AccumulatedEvents, flushed.events);
                    self.host.counters().add(Counter::DeadLetters, flushed.dead_lettered);
                    let failure = flushed.errors.first().map(|error| StoreError::Failed(error.clone()));
                    self.store_answered(failure.as_ref());
                    (events, batch, drained, next_due)
                }
            };
            self.drained_at = drained.then_some(claiming);
            if events.is_empty() {
                self.host.set_state(State::Idle);
                let retry =
                    self.store.flush_retry_due().map(|at| at.saturating_duration_since(Instant::now()));
                return [next_due, retry].into_iter().flatten().fold(nap, Duration::min);
            }
            self.host.set_state(State::Draining);
            self.host.report_running(c"outbox: pushing a batch to the broker");
            let (sink, waiter) = self.broker.session().expect("connected before draining");
            let envelope = push::Envelope {
                origin: &self.origin,
                report_to: self.settings.report_key.as_deref().unwrap_or(""),
            };
            // An alarm may pause the push until the claim's timeout less
            // the longest push, never later: the stuck sweeper must not
            // hand a live claim to another dispatcher.
            let pause_until = claiming + self.settings.pause_limit;
            let Pushed { outcome, failure } =
                push::push(sink, waiter, &self.host, &events, batch, pause_until, &envelope, &policy);
            self.host.add_dispatched(outcome.dispatched.len() as u64);
            if !outcome.dispatched.is_empty() {
                self.broker.answered(&self.host, &self.settings);
            }
            self.unsettled = outcome;
            if let Some(failure) = failure {
                self.settle();
                return self.broker.failed(&failure, &self.host, &self.settings);
            }
            // Under sustained load the drain may not end for a while:
            // reports are collected as it goes, the push recorded first (a
            // slow collect must not stretch the claim).
            if self.reports_due() {
                if let Some(wait) = self.settle() {
                    return wait;
                }
                if let Some(wait) = self.collect_reports() {
                    return wait;
                }
            }
            // A stream that never empties the line (the linger lets
            // commits gather, so its claims are seldom empty) must not hold
            // off the sweeps, the rotation and the purges.
            self.housekeep();
            if self.host.interrupt_pending() {
                self.settle();
                return Duration::ZERO;
            }
        }
    }

    /// Runs the housekeeping that fell due, as [`Dispatcher::housekeep`];
    /// when it put events in line (a sweep that returned some, keys passed
    /// on, the rotation's moves), the next step claims.
    fn housekeep_and_drain_if_it_lined(&mut self) {
        self.housekeep();
        if self.housekeeping.take_lined() {
            self.drain_at = Instant::now();
        }
    }

    /// Runs the housekeeping that fell due, when this dispatcher has its
    /// turn. A failed sweep or purge is shown and tried again later;
    /// delivery goes on meanwhile.
    fn housekeep(&mut self) {
        if let Err(e) = self.housekeeping.run_if_due(self.index, &self.host, &mut self.store, &self.settings)
        {
            self.show_store_error(&e);
        }
    }

    /// Whether reports are on and due to be collected.
    fn reports_due(&self) -> bool {
        self.settings.report_key.is_some() && self.reports.next_due() <= Instant::now()
    }

    /// Records the last push's outcome now, when no claim is to follow;
    /// kept for the next attempt if the statement fails (then returns the
    /// wait before it).
    fn settle(&mut self) -> Option<Duration> {
        if self.unsettled.is_empty() {
            return None;
        }
        let settled = std::mem::take(&mut self.unsettled);
        match self.store.settle(&settled) {
            Ok(()) => {
                account(self.host.counters(), &settled);
                None
            }
            Err(e) => {
                self.unsettled = settled;
                Some(self.store_failed(&e))
            }
        }
    }
}

/// Counts the retries and dead letters of a recorded outcome; returns how
/// soon the first retry falls due (`Duration::MAX` without retries).
fn account(counters: &Counters, settled: &Outcome) -> Duration {
    let retried = settled.failures.iter().filter(|f| !f.dead);
    let soonest = retried.clone().map(|f| f.delay).min().unwrap_or(Duration::MAX);
    let retries = retried.count() as u64;
    counters.add(Counter::Retries, retries);
    counters.add(Counter::DeadLetters, settled.failures.len() as u64 - retries);
    soonest
}

/// The name of the machine, as the kernel has it.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// `outbox_dispatch@<host>`: the messages' `origin` header.
pub fn origin() -> String {
    format!("outbox_dispatch@{}", hostname())
}
