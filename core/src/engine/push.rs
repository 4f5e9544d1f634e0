//! Claimed events → Celery messages grouped by destination (a Redis list,
//! an AMQP queue) → a push → what became of each event.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use super::Host;
use crate::backoff;
use crate::celery::{self, TaskMessage};
use crate::link::{Interest, Interrupted, Wait};
use crate::metrics::{Counter, Counters, PushFailure};
use crate::sink::{Condition, Delivery, KeyBatch, Sink, SinkError};
use crate::store::{Batch, ClaimedEvent, Failure, Head, Outcome};

/// How the dispatcher treats one event's failure.
pub struct RetryPolicy {
    pub max_retries: i32,
    pub backoff: Duration,
}

impl RetryPolicy {
    fn failure(&self, event: &ClaimedEvent, error: String, retryable: bool) -> Failure {
        let failures = event.retry_count.saturating_add(1);
        let dead = !retryable || failures >= self.max_retries;
        let delay = if dead {
            Duration::ZERO
        } else {
            backoff::retry_delay(self.backoff, failures as u32, backoff::random_unit())
        };
        Failure { id: event.id, position: event.position.clone(), dead, error, delay }
    }
}

/// What a push did: the outcome to record, and the broker's failure, if it
/// failed (a connection lost, a deadline, a condition it refused events
/// for): the dispatcher then backs off and reconnects.
pub struct Pushed {
    pub outcome: Outcome,
    pub failure: Option<SinkError>,
}

/// What every message of a push carries besides its event.
pub struct Envelope<'a> {
    /// Who sends it (Celery's `origin`).
    pub origin: &'a str,
    /// Where the worker reports the task's outcome; empty: nowhere.
    pub report_to: &'a str,
}

/// The dispatcher's wait during a push: a pause of the broker (a RabbitMQ
/// alarm) is shown in `outbox.workers.last_error` while it lasts, and
/// counted as a refusal of its condition.
struct ShowingPauses<'a, H> {
    waiter: &'a mut dyn Wait,
    host: &'a H,
}

impl<H: Host> Wait for ShowingPauses<'_, H> {
    fn wait(&mut self, socket: Option<(RawFd, Interest)>, deadline: Instant) -> Result<(), Interrupted> {
        self.waiter.wait(socket, deadline)
    }

    fn check(&mut self) -> Result<(), Interrupted> {
        self.waiter.check()
    }

    fn paused(&mut self, why: Option<&str>) {
        if why.is_some() {
            self.host.counters().refused(Condition::Blocked);
        }
        self.host.set_error(why);
    }
}

/// Encodes and pushes `events`, claimed as `batch`; an expired event
/// is not sent but failed. When the broker fails part way, what its
/// earlier round trips confirmed stays dispatched, and the rest goes back
/// to pending, no retry spent. A broker that pauses publishing (an alarm)
/// is waited for until `pause_until` at the latest, an instant the claim
/// fixes (see [`super::Settings::pause_limit`]).
#[allow(clippy::too_many_arguments)]
pub fn push<H: Host>(
    sink: &mut Sink,
    waiter: &mut dyn Wait,
    host: &H,
    events: &[ClaimedEvent],
    batch: Option<Batch>,
    pause_until: Instant,
    envelope: &Envelope<'_>,
    policy: &RetryPolicy,
) -> Pushed {
    let counters: &Counters = host.counters();
    let mut outcome = Outcome { batch, ..Outcome::default() };
    let mut batches: Vec<KeyBatch> = Vec::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    let mut by_key: HashMap<String, usize> = HashMap::new();
    let now = unix_now();
    // Fresh delivery tags for this push: one draw from the OS's random
    // source, then one apart (a draw per message cost a system call each).
    let tags = uuid::Uuid::new_v4().as_u128();

    for (i, event) in events.iter().enumerate() {
        if let Some((expires, _)) = event.expires.as_ref().filter(|(_, at)| *at <= now) {
            outcome.failures.push(policy.failure(
                event,
                format!("expired at {expires} before it was sent"),
                false,
            ));
            counters.add(Counter::Expired, 1);
            continue;
        }
        let mut message = String::with_capacity(event.payload.len() * 2 + 1024);
        let encoded = celery::encode(
            &TaskMessage {
                id: event.id,
                task: &event.task,
                queue: &event.queue,
                priority: event.priority,
                event_type: &event.event_type,
                created_at: &event.created_at,
                payload: &event.payload,
                args: event.args.as_deref(),
                headers: event.headers.as_deref(),
                expires: event.expires.as_ref().map(|(text, _)| text.as_str()),
                report_to: envelope.report_to,
                send: event.send,
            },
            envelope.origin,
            uuid::Uuid::from_u128(tags.wrapping_add(i as u128)),
            &mut message,
        );
        if let Err(e) = encoded {
            outcome.failures.push(policy.failure(event, e.to_string(), false));
            counters.push_failed(PushFailure::Unencodable, 1);
            continue;
        }
        let key = sink.destination(&event.queue, event.priority);
        let slot = *by_key.entry(key.clone()).or_insert_with(|| {
            batches.push(KeyBatch { key, messages: Vec::new() });
            members.push(Vec::new());
            batches.len() - 1
        });
        batches[slot].messages.push(message);
        members[slot].push(i);
    }

    if batches.is_empty() {
        return Pushed { outcome, failure: None };
    }
    let pushed = sink.push(&batches, &mut ShowingPauses { waiter, host }, pause_until);
    let now = unix_now();
    let mut latencies = Vec::with_capacity(events.len());
    let mut failure = pushed.failure;
    let mut unsent = 0;
    for (delivery, i) in pushed.deliveries.into_iter().zip(members.into_iter().flatten()) {
        let event = &events[i];
        match delivery {
            Delivery::Delivered => {
                outcome.dispatched.push(event.id);
                if let Some(key) = &event.head {
                    outcome.heads.push(Head { id: event.id, key: key.clone() });
                }
                latencies.push((now - event.created_epoch).max(0.0));
            }
            Delivery::Rejected(error) => {
                counters.push_failed(PushFailure::RedisError, 1);
                outcome.failures.push(policy.failure(event, format!("{}: {error}", sink.kind()), true));
            }
            // Refused once (basic.nack): released, no retry spent; the
            // connection and the other queues go on. A second refusal is
            // the message's own fault (Rejected).
            Delivery::Refused(Condition::Nacked, _) => {
                counters.push_failed(PushFailure::Refused, 1);
                counters.refused(Condition::Nacked);
                outcome.released.push((event.id, event.position.clone()));
            }
            Delivery::Refused(condition, error) => {
                counters.push_failed(PushFailure::Refused, 1);
                outcome.released.push((event.id, event.position.clone()));
                failure.get_or_insert_with(|| sink.refusal(condition, error));
            }
            Delivery::Unsent => {
                unsent += 1;
                outcome.released.push((event.id, event.position.clone()));
            }
        }
    }
    if let Some(e) = failure.as_ref().filter(|e| unsent > 0 && **e != SinkError::Interrupted) {
        counters.push_failed(PushFailure::of(e), unsent);
    }
    if !latencies.is_empty() {
        counters.observe_batch(&latencies);
    }
    Pushed { outcome, failure }
}

/// Seconds since the Unix epoch.
fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}
