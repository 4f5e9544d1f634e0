//! Claimed events → Celery messages grouped by Redis list → one pipelined
//! push → what became of each event.

use std::collections::HashMap;
use std::time::Duration;

use outbox_core::backoff;
use outbox_core::celery::{self, TaskMessage};
use outbox_core::sink::{KeyBatch, Sink, SinkError};

use super::store::{ClaimedEvent, Failure, Outcome};
use crate::metrics::{self, PushFailure};

/// How the dispatcher treats one event's failure.
pub struct RetryPolicy {
    pub max_retries: i32,
    pub backoff: Duration,
    pub max_payload_bytes: usize,
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
        Failure { id: event.id, dead, error, delay }
    }
}

/// Encodes and pushes `events`. `Err` means the broker failed and nothing
/// may be assumed delivered; the caller gives the whole batch back.
pub fn push(
    sink: &mut Sink,
    events: &[ClaimedEvent],
    origin: &str,
    policy: &RetryPolicy,
) -> Result<Outcome, SinkError> {
    let mut outcome = Outcome::default();
    let mut batches: Vec<KeyBatch> = Vec::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    let mut by_key: HashMap<String, usize> = HashMap::new();

    for (i, event) in events.iter().enumerate() {
        if event.payload.len() > policy.max_payload_bytes {
            let error = format!(
                "payload is {} bytes, over outbox.max_payload_bytes ({})",
                event.payload.len(),
                policy.max_payload_bytes
            );
            outcome.failures.push(policy.failure(event, error, false));
            metrics::push_failed(PushFailure::Unencodable, 1);
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
                headers: event.headers.as_deref(),
            },
            origin,
            uuid::Uuid::new_v4(),
            &mut message,
        );
        if let Err(e) = encoded {
            outcome.failures.push(policy.failure(event, e.to_string(), false));
            metrics::push_failed(PushFailure::Unencodable, 1);
            continue;
        }
        let key = celery::queue_key(&event.queue, event.priority);
        let slot = *by_key.entry(key.to_string()).or_insert_with(|| {
            batches.push(KeyBatch { key: key.to_string(), messages: Vec::new() });
            members.push(Vec::new());
            batches.len() - 1
        });
        batches[slot].messages.push(message);
        members[slot].push(i);
    }

    if batches.is_empty() {
        return Ok(outcome);
    }
    let results = sink.push(&batches)?;
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let mut latencies = Vec::with_capacity(events.len());
    for (result, indexes) in results.into_iter().zip(members) {
        match result {
            Ok(()) => {
                outcome.dispatched.extend(indexes.iter().map(|i| events[*i].id));
                latencies.extend(indexes.iter().map(|i| (now - events[*i].created_epoch).max(0.0)));
            }
            Err(error) => {
                metrics::push_failed(PushFailure::RedisError, indexes.len() as u64);
                let error = format!("Redis: {error}");
                outcome
                    .failures
                    .extend(indexes.iter().map(|i| policy.failure(&events[*i], error.clone(), true)));
            }
        }
    }
    if !latencies.is_empty() {
        metrics::observe_batch(&latencies);
    }
    Ok(outcome)
}
