//! Collecting what Celery workers running `outbox_dispatch.celery` report:
//! read a batch from the head of the report list, record it in one
//! statement, then trim it off the list.
//!
//! One dispatcher at a time collects (a turn of the host's): two would
//! read the same reports twice. Workers only append, so the trim removes
//! exactly what was read, and the broker's trim drops only a head that is
//! still what was read (Redis: its digest; RabbitMQ acknowledges each
//! delivery): a second collector at once loses nothing. A crash between
//! the commit and the trim reads the batch again, its reports then stale:
//! a report is never lost, at worst counted twice.

use std::time::{Duration, Instant};

use super::{Host, Turn};
use crate::link::Wait;
use crate::metrics::{AckSource, Counter, ReportIgnored};
use crate::report::Report;
use crate::sink::{Sink, SinkError};
use crate::store::sql::Db;
use crate::store::{Store, StoreError};

/// Reports read and recorded per transaction.
pub const BATCH: usize = 1000;

/// Transactions per step; what is left is due again at once.
const BATCHES: usize = 10;

/// How often the list is looked at while it is empty.
const POLL: Duration = Duration::from_millis(100);

/// How soon a read the broker refused is tried again.
const REFUSED_RETRY: Duration = Duration::from_secs(10);

/// Why collecting stopped.
pub enum CollectError {
    Broker(SinkError),
    Store(StoreError),
}

pub struct Collector {
    next_poll: Instant,
    /// A malformed report was logged (once per dispatcher life).
    malformed_logged: bool,
    /// Why the broker last refused to read the list, as logged.
    refusal: Option<String>,
}

impl Collector {
    pub fn new() -> Collector {
        Collector { next_poll: Instant::now(), malformed_logged: false, refusal: None }
    }

    /// The next time the list is due to be read.
    pub fn next_due(&self) -> Instant {
        self.next_poll
    }

    /// Reads and records what workers reported to `key`, when due and when
    /// no other dispatcher has the turn; whether it recorded any (which may
    /// have passed keys on to their next events).
    pub fn collect_if_due(
        &mut self,
        dispatcher: usize,
        key: &str,
        host: &impl Host,
        store: &mut Store<impl Db>,
        sink: &mut Sink,
        waiter: &mut dyn Wait,
    ) -> Result<bool, CollectError> {
        let now = Instant::now();
        if now < self.next_poll {
            return Ok(false);
        }
        self.next_poll = now + POLL;
        let Some(_turn) = host.take_turn(Turn::Reports) else {
            return Ok(false);
        };
        let mut recorded = false;
        let key = &sink.report_queue(key);
        let place = sink.report_place(key);
        for _ in 0..BATCHES {
            let raw = match sink.reports(key, BATCH, waiter).map_err(CollectError::Broker)? {
                Ok(raw) => raw,
                Err(refused) => {
                    self.refused(host, dispatcher, &place, &refused);
                    return Ok(recorded);
                }
            };
            if raw.is_empty() {
                return Ok(recorded);
            }
            let reports = self.parse(host, dispatcher, &place, &raw);
            if !reports.is_empty() {
                let (processed, failed) = store.apply_reports(&reports).map_err(CollectError::Store)?;
                recorded |= processed + failed > 0;
                let counters = host.counters();
                counters.acked(AckSource::Celery, processed);
                counters.add(Counter::TaskFailures, failed);
                counters.reports_ignored(ReportIgnored::Stale, reports.len() as u64 - processed - failed);
            }
            if let Err(refused) = sink.forget_reports(key, raw.len(), waiter).map_err(CollectError::Broker)? {
                self.refused(host, dispatcher, &place, &refused);
                return Ok(recorded);
            }
            if raw.len() < BATCH || host.interrupt_pending() {
                return Ok(recorded);
            }
        }
        self.next_poll = now;
        Ok(recorded)
    }

    /// The broker refused to read the list (Redis: it holds no list, an
    /// ACL; RabbitMQ: the queue's arguments, a permission): logged
    /// when the reason changes, tried again after [`REFUSED_RETRY`]; the
    /// dispatcher goes on pushing meanwhile.
    fn refused(&mut self, host: &impl Host, dispatcher: usize, place: &str, reason: &str) {
        self.next_poll = Instant::now() + REFUSED_RETRY;
        if self.refusal.as_deref() != Some(reason) {
            host.log(&format!(
                "outbox dispatcher {dispatcher}: the broker refused to read the reports of {place}: {reason}; \
                 trying again every {}s",
                REFUSED_RETRY.as_secs()
            ));
            self.refusal = Some(reason.to_string());
        }
    }

    /// The reports understood; the others are counted, and the first one
    /// logged.
    fn parse(&mut self, host: &impl Host, dispatcher: usize, place: &str, raw: &[Vec<u8>]) -> Vec<Report> {
        let mut reports = Vec::with_capacity(raw.len());
        for bytes in raw {
            match Report::parse(bytes) {
                Ok(report) => reports.push(report),
                Err(e) => {
                    host.counters().reports_ignored(ReportIgnored::Malformed, 1);
                    if !std::mem::replace(&mut self.malformed_logged, true) {
                        host.log(&format!(
                            "outbox dispatcher {dispatcher}: ignoring a report in {place}: {e} \
                             (logged once; outbox_reports_ignored_total counts them)"
                        ));
                    }
                }
            }
        }
        reports
    }
}
