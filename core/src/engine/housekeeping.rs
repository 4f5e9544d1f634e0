//! Housekeeping: the sweepers of stuck claims, of events pending from
//! this cluster's future (a restore's) and of unacknowledged events, the
//! sweep for keys left without a head, and the lifecycle: the rotation
//! (sql/rotation.sql), the batches it leaves without events, and the purge
//! of the inbox. One dispatcher at a time does it (a turn of the host's), for
//! at most [`BATCHES`] transactions of each kind and [`BUDGET`] a step: what
//! is left falls due again at once, after the next drain, so a large purge
//! never stalls delivery.

use std::time::{Duration, Instant};

use super::{Host, Settings, Turn};
use crate::metrics::Counter;
use crate::store::sql::Db;
use crate::store::{Store, StoreError, FORGET_BATCH, SWEEP_BATCH};

/// Sweeper transactions per step.
const BATCHES: usize = 10;

/// The time a step's housekeeping may take, from its start; each kind runs
/// one transaction however late: the dispatcher delivers nothing
/// meanwhile, and a stream of commits waits (ten transactions of forgotten
/// batches held it up to 600 ms).
const BUDGET: Duration = Duration::from_millis(20);

/// How soon housekeeping whose statement failed is tried again, doubling
/// while it keeps failing (never later than its own interval); meanwhile the
/// dispatcher goes on delivering.
const RETRY: Duration = Duration::from_secs(10);

/// Pages of a partition a transaction of the scan for a restore's rows
/// reads (sql/worker/reline_restored.sql): 8 MB.
const RESTORE_SCAN_PAGES: i64 = 1000;

/// Period of the sweep for keys no statement passed on
/// (docs/guides/per-key-order.md): the longest such a key waits, while the
/// sweep succeeds.
const KEY_SWEEP: Duration = Duration::from_secs(10);

/// When each kind of housekeeping falls due.
pub struct Schedule {
    next_sweep: Instant,
    next_lifecycle: Instant,
    next_key_sweep: Instant,
    /// Consecutive failures of each, for the retry's backoff.
    sweep_failures: u32,
    lifecycle_failures: u32,
    key_sweep_failures: u32,
    /// What ran since the last look may have put events in line (a sweep
    /// that returned some, keys passed on, the rotation's moves).
    lined: bool,
    /// The partition whose rows a restore wrote with the triggers off is
    /// being read, from this page on.
    restore_scan: Option<RestoreScan>,
}

/// A partition of the log whose triggers a restore or a copy left off,
/// read a range of pages at a time.
#[derive(Debug, Clone, Copy)]
struct RestoreScan {
    generation: i32,
    next_page: i64,
    pages: i64,
}

impl Schedule {
    /// Everything is due at once after a start.
    pub fn new() -> Schedule {
        Schedule {
            next_sweep: Instant::now(),
            next_lifecycle: Instant::now(),
            next_key_sweep: Instant::now(),
            sweep_failures: 0,
            lifecycle_failures: 0,
            key_sweep_failures: 0,
            lined: false,
            restore_scan: None,
        }
    }

    /// After a reload: a shorter interval takes effect now.
    pub fn reschedule(&mut self, settings: &Settings) {
        let now = Instant::now();
        self.next_sweep = self.next_sweep.min(now + settings.sweep_interval);
        self.next_lifecycle = self.next_lifecycle.min(now + settings.lifecycle_interval);
    }

    /// Whether what ran since the last call may have put events in line.
    pub fn take_lined(&mut self) -> bool {
        std::mem::take(&mut self.lined)
    }

    /// The next time something falls due.
    pub fn next_due(&self) -> Instant {
        self.next_sweep.min(self.next_lifecycle).min(self.next_key_sweep)
    }

    /// Runs what has fallen due, unless another dispatcher has the turn. The
    /// sweepers and the purge fail on their own: each is tried again after
    /// [`RETRY`], then later while it keeps failing; the first error is
    /// returned.
    pub fn run_if_due(
        &mut self,
        dispatcher: usize,
        host: &impl Host,
        store: &mut Store<impl Db>,
        settings: &Settings,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        if now < self.next_due() {
            return Ok(());
        }
        let Some(_turn) = host.take_turn(Turn::Housekeeping) else {
            return Ok(());
        };
        let until = now + BUDGET;
        let mut first_error = None;
        if now >= self.next_sweep {
            match sweep(dispatcher, host, store, settings, until, &mut self.restore_scan) {
                Ok((more, lined)) => {
                    self.lined |= lined;
                    self.sweep_failures = 0;
                    self.next_sweep = next(now, more, settings.sweep_interval);
                }
                Err(e) => {
                    self.next_sweep = now + retry(&mut self.sweep_failures, settings.sweep_interval);
                    first_error.get_or_insert(e);
                }
            }
        }
        if now >= self.next_key_sweep {
            match store.sweep_keys() {
                Ok(promoted) => {
                    self.lined |= promoted > 0;
                    if promoted > 0 {
                        host.log(&format!("outbox dispatcher {dispatcher}: {promoted} keys left without a head were passed on"));
                    }
                    self.key_sweep_failures = 0;
                    self.next_key_sweep = now + KEY_SWEEP;
                }
                Err(e) => {
                    self.next_key_sweep = now + retry(&mut self.key_sweep_failures, KEY_SWEEP);
                    first_error.get_or_insert(e);
                }
            }
        }
        if now >= self.next_lifecycle {
            let acks = !settings.ack_timeout.is_zero();
            let rotated =
                rotate_some(dispatcher, host, store, settings.retention, acks, until).and_then(|again| {
                    sweep_some(host, FORGET_BATCH, until, || store.forget_batches())
                        .map(|(_, more)| again.unless(more))
                });
            // Each on its own: one that fails holds up the other's round
            // no more than the backoff.
            let claims = sweep_some(host, SWEEP_BATCH, until, || store.purge_inbox(settings.inbox_retention));
            match rotated.and_then(|again| claims.map(|(_, more)| again.unless(more))) {
                Ok(again) => {
                    self.lined = true;
                    self.lifecycle_failures = 0;
                    self.next_lifecycle = match again {
                        Again::Now => now,
                        Again::Soon => now + RETRY.min(settings.lifecycle_interval),
                        Again::Later => now + settings.lifecycle_interval,
                    };
                }
                Err(e) => {
                    self.next_lifecycle =
                        now + retry(&mut self.lifecycle_failures, settings.lifecycle_interval);
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// The stuck and unacknowledged sweepers; returns whether work is left,
/// and whether they put events in line.
fn sweep(
    dispatcher: usize,
    host: &impl Host,
    store: &mut Store<impl Db>,
    settings: &Settings,
    until: Instant,
    restore_scan: &mut Option<RestoreScan>,
) -> Result<(bool, bool), StoreError> {
    let (rescued, more_stuck) =
        sweep_some(host, SWEEP_BATCH, until, || store.sweep_stuck(settings.processing_timeout))?;
    host.counters().add(Counter::StuckRescued, rescued);
    if rescued > 0 {
        host.log(&format!(
            "outbox dispatcher {dispatcher}: {rescued} events stuck in processing returned to pending"
        ));
    }
    let (strays, more_strays) = sweep_some(host, SWEEP_BATCH, until, || store.sweep_strays())?;
    if strays > 0 {
        host.log(&format!(
            "outbox dispatcher {dispatcher}: {strays} pending events with a transaction id no claim \
             reads (a restore's, in this cluster's future or before every window) were put in line"
        ));
    }
    let (relined, more_restored) = reline_restored(dispatcher, host, store, until, restore_scan)?;
    let restored = strays + relined;
    host.counters().add(Counter::StraysRelined, restored);
    let mut failed = 0;
    let (swept, more_unacked) = if settings.ack_timeout.is_zero() {
        (0, false)
    } else {
        sweep_some(host, SWEEP_BATCH, until, || {
            let (resent, gave_up) = store.sweep_unacked(settings.ack_timeout, settings.max_redeliveries)?;
            failed += gave_up;
            Ok(resent + gave_up)
        })?
    };
    let resent = swept - failed;
    host.counters().add(Counter::UnackedResent, resent);
    host.counters().add(Counter::UnackedFailed, failed);
    if resent > 0 || failed > 0 {
        host.log(&format!(
            "outbox dispatcher {dispatcher}: {resent} unacknowledged events will be sent again, \
             {failed} failed (their last_error says why)"
        ));
    }
    Ok((more_stuck || more_strays || more_restored || more_unacked, rescued + restored + resent > 0))
}

/// The rows a restore or a copy wrote with the log's triggers off, inside
/// windows the claims had read: each partition that shows it
/// (`outbox.triggers_off()`) is read a range of pages at a time and the
/// rows no claim sent are put in line (sql/worker/reline_restored.sql),
/// then its triggers fire always again; one whose triggers are still
/// disabled (the restore under way) waits, and is named. Returns how many
/// were put in line, and whether work is left.
fn reline_restored(
    dispatcher: usize,
    host: &impl Host,
    store: &mut Store<impl Db>,
    until: Instant,
    scan: &mut Option<RestoreScan>,
) -> Result<(u64, bool), StoreError> {
    if scan.is_none() {
        let off = store.triggers_off()?;
        for partition in off.iter().filter(|p| p.disabled) {
            host.warning(&format!(
                "outbox dispatcher {dispatcher}: the triggers of outbox.log_{} are disabled (a restore or a \
                 copy with its triggers off?): the rows written meanwhile are put in line once they are \
                 enabled again, and nothing of that partition is rotated out until then",
                partition.generation
            ));
        }
        *scan = off.iter().find(|p| !p.disabled).map(|p| RestoreScan {
            generation: p.generation,
            next_page: 0,
            pages: p.pages,
        });
    }
    let mut relined = 0;
    while let Some(current) = scan.as_mut() {
        if current.next_page >= current.pages {
            store.fire_always(current.generation)?;
            host.log(&format!(
                "outbox dispatcher {dispatcher}: the rows written into outbox.log_{} with its triggers off are \
                 in line; its triggers fire always again",
                current.generation
            ));
            *scan = None;
            return Ok((relined, true));
        }
        let pages = current.next_page..current.next_page + RESTORE_SCAN_PAGES;
        relined += store.reline_restored(current.generation, pages.clone())?;
        current.next_page = pages.end;
        if host.interrupt_pending() || Instant::now() >= until {
            return Ok((relined, true));
        }
    }
    Ok((relined, false))
}

/// The wait before a failed part runs again: [`RETRY`], doubling with each
/// consecutive failure, at most `interval`.
fn retry(failures: &mut u32, interval: Duration) -> Duration {
    let wait = RETRY.saturating_mul(1 << (*failures).min(16)).min(interval.max(RETRY));
    *failures = failures.saturating_add(1);
    wait
}

/// Due again at once when work is left, else after the interval.
fn next(now: Instant, more: bool, interval: Duration) -> Instant {
    if more {
        now
    } else {
        now + interval
    }
}

/// When the lifecycle is due again.
enum Again {
    /// More may be due at once.
    Now,
    /// The rotation waits for a transaction to end: most are short (a
    /// dispatcher's own, begun before the last moves).
    Soon,
    /// Nothing is due before the next interval.
    Later,
}

impl Again {
    /// Now when `more` is left, else as it was.
    fn unless(self, more: bool) -> Again {
        if more {
            Again::Now
        } else {
            self
        }
    }
}

/// Up to [`BATCHES`] steps of the rotation (sql/rotation.sql), while
/// each does something and the time lasts.
fn rotate_some(
    dispatcher: usize,
    host: &impl Host,
    store: &mut Store<impl Db>,
    retention: Duration,
    acks: bool,
    until: Instant,
) -> Result<Again, StoreError> {
    for _ in 0..BATCHES {
        let Some((step, events)) = store.rotate(retention, acks)? else {
            return Ok(Again::Later);
        };
        match step.as_str() {
            "truncated" => {
                host.counters().add(Counter::Purged, events);
                host.log(&format!(
                    "outbox dispatcher {dispatcher}: the oldest generation was truncated ({events} events)"
                ));
            }
            "moved" if events > 0 => {
                host.log(&format!("outbox dispatcher {dispatcher}: {events} events still needed moved to the current generation"));
            }
            "waiting" => return Ok(Again::Soon),
            _ => {}
        }
        if host.interrupt_pending() || Instant::now() >= until {
            return Ok(Again::Now);
        }
    }
    Ok(Again::Now)
}

/// Repeats a sweep of up to `batch` rows a transaction until it finds
/// less than a full batch, for at most [`BATCHES`] transactions and, after
/// the first, until `until`; returns the rows swept and whether more may be
/// left.
fn sweep_some(
    host: &impl Host,
    batch: usize,
    until: Instant,
    mut sweep: impl FnMut() -> Result<u64, StoreError>,
) -> Result<(u64, bool), StoreError> {
    let mut total = 0;
    for _ in 0..BATCHES {
        let n = sweep()?;
        total += n;
        if n < batch as u64 || host.interrupt_pending() || Instant::now() >= until {
            return Ok((total, n >= batch as u64));
        }
    }
    Ok((total, true))
}
