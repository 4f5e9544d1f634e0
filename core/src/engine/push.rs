//! Claimed events → Celery messages grouped by destination (a Redis list,
//! an AMQP queue) or Kafka records grouped by topic → a push → what became
//! of each event.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use super::Host;
use crate::backoff;
use crate::celery::{self, TaskMessage};
use crate::link::{Interest, Interrupted, Wait};
use crate::metrics::{Counter, Counters, PushFailure};
use crate::sink::{Condition, Delivery, Event, KeyBatch, Outgoing, Record, Routing, Sink, SinkError};
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
        Failure { id: event.id, position: event.position.clone(), dead, error, delay, spent: true }
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

/// Encodes and pushes `events`, claimed as `batch`; an expired event,
/// or one the claim refused, is not sent but failed. When the broker fails part way, what its
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
    let mut outgoing = Outgoing::of(sink);
    let mut members = Members::default();
    let now = unix_now();
    // Fresh delivery tags for this push: one draw from the OS's random
    // source, then one apart (a draw per message cost a system call each).
    let tags = uuid::Uuid::new_v4().as_u128();

    for (i, event) in events.iter().enumerate() {
        if let Some(why) = &event.refused {
            outcome.failures.push(policy.failure(event, why.clone(), false));
            counters.add(Counter::Refused, 1);
            continue;
        }
        if let Some((expires, _)) = event.expires.as_ref().filter(|(_, at)| *at <= now) {
            outcome.failures.push(policy.failure(
                event,
                format!("expired at {expires} before it was sent"),
                false,
            ));
            counters.add(Counter::Expired, 1);
            continue;
        }
        let added = match &mut outgoing {
            Outgoing::Tasks(batches) => {
                let tag = uuid::Uuid::from_u128(tags.wrapping_add(i as u128));
                task(event, envelope, tag).map(|message| {
                    members.add(batches, sink.destination(&event.queue, event.priority), message, i)
                })
            }
            Outgoing::Records(batches) => {
                record(sink, event).map(|(topic, record)| members.add(batches, topic, record, i))
            }
        };
        if let Err(e) = added {
            outcome.failures.push(policy.failure(event, e, false));
            counters.push_failed(PushFailure::Unencodable, 1);
        }
    }

    if members.of.is_empty() {
        return Pushed { outcome, failure: None };
    }
    let pushed = sink.push(&outgoing, &mut ShowingPauses { waiter, host }, pause_until);
    let now = unix_now();
    let mut latencies = Vec::with_capacity(events.len());
    let mut failure = pushed.failure;
    let mut unsent = 0;
    // A refusal counts once a push, however many events it deferred.
    let mut deferred_for: Vec<Condition> = Vec::new();
    for (delivery, i) in pushed.deliveries.into_iter().zip(members.of.into_iter().flatten()) {
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
            // Refused where the rest of the connection goes on (a Kafka
            // partition short of replicas): out of line until the broker
            // may take it, no retry spent, the session kept.
            Delivery::Deferred(condition, error, delay) => {
                counters.push_failed(PushFailure::Refused, 1);
                if !deferred_for.contains(&condition) {
                    deferred_for.push(condition);
                    counters.refused(condition);
                }
                outcome.failures.push(Failure {
                    id: event.id,
                    position: event.position.clone(),
                    dead: false,
                    error: format!("{}: {error}", sink.kind()),
                    delay,
                    spent: false,
                });
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

/// Which events each batch holds, in order: the push's answers come back
/// in that order.
#[derive(Default)]
struct Members {
    of: Vec<Vec<usize>>,
    by_key: HashMap<String, usize>,
}

impl Members {
    /// Adds event `i`'s `message` to the batch bound for `key`.
    fn add<M>(&mut self, batches: &mut Vec<KeyBatch<M>>, key: String, message: M, i: usize) {
        let slot = *self.by_key.entry(key.clone()).or_insert_with(|| {
            batches.push(KeyBatch { key, messages: Vec::new() });
            self.of.push(Vec::new());
            batches.len() - 1
        });
        batches[slot].messages.push(message);
        self.of[slot].push(i);
    }
}

/// The Celery message of `event`, or why it cannot be one.
fn task(event: &ClaimedEvent, envelope: &Envelope<'_>, tag: uuid::Uuid) -> Result<String, String> {
    let mut message = String::with_capacity(event.payload.len() * 2 + 1024);
    celery::encode(
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
        tag,
        &mut message,
    )
    .map_err(|e| e.to_string())?;
    Ok(message)
}

/// The Kafka topic and record of `event`, or why it has none.
fn record(sink: &Sink, event: &ClaimedEvent) -> Result<(String, Record), String> {
    let Sink::Kafka(kafka) = sink else { unreachable!("records are for Kafka") };
    let topic = kafka.topic(&event.event_type, &event.queue)?;
    let record = Record::of(
        &Event {
            id: event.id,
            ordering_key: event.head.as_ref().map(|key| key.ordering_key.as_str()),
            event_type: &event.event_type,
            payload: &event.payload,
            headers: event.headers.as_deref(),
            routing: match (event.subscription, event.event_id, event.args.as_deref()) {
                (0, ..) => Routing::Direct,
                (subscription, Some(event), _) => Routing::Delivery { event, subscription },
                (subscription, None, Some(args)) => Routing::Batch { subscription, args },
                (_, None, None) => return Err("a subscription's batch without its members".into()),
            },
        },
        kafka.form(),
    )?;
    Ok((topic, record))
}

/// Seconds since the Unix epoch.
fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}
