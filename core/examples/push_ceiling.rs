//! The Redis side of `make bench`'s raw ceiling: pushes N messages of the
//! size the dispatcher would send, one multi-value LPUSH per batch, one
//! round trip each, through the same client and sink the dispatcher uses.
//! The messages are encoded before the clock starts.
//!
//!     cargo run --release -p outbox_core --example push_ceiling -- URL N BATCH PAYLOAD_BYTES
//!
//! Prints the events per second.

use std::time::{Duration, Instant};

use outbox_core::celery::{self, TaskMessage};
use outbox_core::link::Poll;
use outbox_core::sink::{BrokerConfig, Delivery, KeyBatch, Outgoing, Sink};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, n, batch, payload_bytes] = args.as_slice() else {
        return Err("usage: push_ceiling URL N BATCH PAYLOAD_BYTES".into());
    };
    let (n, batch, payload_bytes): (usize, usize, usize) =
        (n.parse()?, batch.parse()?, payload_bytes.parse()?);

    let payload = format!("{{\"n\": 1, \"pad\": \"{}\"}}", "x".repeat(payload_bytes.saturating_sub(20)));
    let message = |id: uuid::Uuid| {
        let mut out = String::new();
        let task = TaskMessage {
            id,
            task: "bench",
            queue: "bench_ceiling",
            priority: 0,
            event_type: "bench",
            created_at: "2026-01-01 00:00:00+00",
            payload: &payload,
            args: None,
            headers: None,
            expires: None,
            report_to: "outbox_dispatch.reports",
            send: uuid::Uuid::new_v4(),
        };
        celery::encode(&task, "outbox_dispatch@bench", uuid::Uuid::new_v4(), &mut out).map(|_| out)
    };

    // Encoded before the clock starts: this measures Redis and the client.
    let mut batches = Vec::new();
    for start in (0..n).step_by(batch.max(1)) {
        let messages =
            (start..n.min(start + batch)).map(|_| message(uuid::Uuid::now_v7())).collect::<Result<_, _>>()?;
        batches.push(Outgoing::Tasks(vec![KeyBatch { key: "bench_ceiling".into(), messages }]));
    }

    let config = BrokerConfig::plain(url, Duration::from_secs(30), usize::MAX);
    let mut sink = Sink::new(&config)?;
    sink.connect(&mut Poll)?;
    let started = Instant::now();
    for batch in &batches {
        let pushed = sink.push(batch, &mut Poll, Instant::now() + Duration::from_secs(30));
        if let Some(failure) = pushed.failure {
            return Err(failure.into());
        }
        if let Some(refused) = pushed.deliveries.into_iter().find(|d| *d != Delivery::Delivered) {
            return Err(format!("{refused:?}").into());
        }
    }
    println!("{:.0}", n as f64 / started.elapsed().as_secs_f64());
    Ok(())
}
