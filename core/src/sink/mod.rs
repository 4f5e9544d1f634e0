//! The broker end: where committed events go, as Celery messages to Redis
//! (`redis.rs`) or RabbitMQ over AMQP 0-9-1 (`amqp/`), or as records of
//! Kafka topics (`kafka/`), chosen by the URL's scheme. Each pushes
//! batches in round trips of bounded size, each with one deadline, and
//! draws the same line between the broker's fault
//! (the connection, a condition of the server: never an event's retry) and
//! one event's fault (an error the broker answered for that message).

mod amqp;
mod errors;
mod kafka;
mod keys;
mod plan;
mod redis;
mod secrets;
mod sentinel;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::broker_url::{self, BrokerUrl};
use crate::link::Wait;

pub use amqp::{AmqpSink, QueueKind, QueueShape};
pub use errors::{Condition, Reason, SinkError};
pub use kafka::{
    Compression, Event, Form, KafkaShape, KafkaSink, KeyForm, Mechanism, Record, Routing, Topics,
};
pub use keys::{Keys, KOMBU_PRIORITY_STEPS, KOMBU_SEPARATOR};
pub use redis::RedisSink;

/// Where the broker is and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// `redis://`, `rediss://` (TLS), `sentinel://`, `amqp://`, `amqps://`,
    /// `kafka://` or `kafkas://`.
    pub url: String,
    /// The deadline of every operation: a connect (with TLS and AUTH), one
    /// round trip of a push, a PING.
    pub timeout: Duration,
    /// PEM file of the certificate authorities trusted for `rediss://` and `amqps://`;
    /// `None`: the system's. The server's certificate is verified either way.
    pub tls_ca_file: Option<PathBuf>,
    /// PEM files of the client's own certificate (its chain) and key, sent
    /// to a TLS broker that asks for one; `None`: none.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// File holding the password, which then stays out of the URL (and so
    /// out of the server log, where PostgreSQL prints a changed setting).
    pub password_file: Option<PathBuf>,
    /// Most bytes of messages sent in one round trip; a batch above it is
    /// pushed in several.
    pub max_batch_bytes: usize,
    /// For `sentinel://` URLs: the master's name at the sentinels (kombu's
    /// `master_name`).
    pub sentinel_master: String,
    /// File holding the sentinels' own password, when they require one.
    pub sentinel_password_file: Option<PathBuf>,
    /// Replicas that must have each round trip's messages (WAIT) before
    /// they count as delivered; 0: none asked.
    pub wait_replicas: u32,
    /// kombu's `global_keyprefix`, `priority_steps` (comma-separated) and
    /// `sep`: which lists a worker with those transport options reads.
    pub key_prefix: String,
    pub priority_steps: String,
    pub priority_separator: String,
    /// AMQP: how queues the dispatcher declares are made (Celery's
    /// `task_default_queue_type` and `task_queue_max_priority`).
    pub queues: QueueShape,
    /// AMQP: how long the broker may hear nothing from the dispatcher
    /// before it closes the connection (the negotiated heartbeat).
    pub heartbeat: Duration,
    /// Kafka: how events become records.
    pub kafka: KafkaShape,
}

impl BrokerConfig {
    /// `url` with nothing else asked: no files, no sentinel master, no
    /// replicas to wait for, kombu's keys.
    pub fn plain(url: &str, timeout: Duration, max_batch_bytes: usize) -> BrokerConfig {
        BrokerConfig {
            url: url.into(),
            timeout,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            password_file: None,
            max_batch_bytes,
            sentinel_master: String::new(),
            sentinel_password_file: None,
            wait_replicas: 0,
            key_prefix: String::new(),
            priority_steps: KOMBU_PRIORITY_STEPS.into(),
            priority_separator: KOMBU_SEPARATOR.into(),
            queues: QueueShape::default(),
            heartbeat: Duration::from_secs(60),
            kafka: KafkaShape::default(),
        }
    }
}

/// Messages bound for one destination, in order: a Redis list (pushed with
/// multi-value LPUSHes, so that a BRPOP consumer sees them first to last)
/// or an AMQP queue, each message kombu's envelope (`celery::encode`); or
/// a Kafka topic, each message a [`Record`].
#[derive(Debug, Default)]
pub struct KeyBatch<M = String> {
    pub key: String,
    pub messages: Vec<M>,
}

/// What became of one message of a push.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// In the list.
    Delivered,
    /// The broker refused it for a reason of its own or of its
    /// destination: Redis answered an error that belongs to the message or
    /// its key; RabbitMQ would not declare its queue, returned it, took it
    /// for too large, or refused it twice. It spends one of the event's
    /// retries.
    Rejected(String),
    /// The broker answered a condition of its own, and the reply: not
    /// delivered, and not the message's fault.
    Refused(Condition, String),
    /// Refused for a condition of the broker's in part of it only (a Kafka
    /// partition whose replicas are short), where the rest of the
    /// connection goes on: back in line after the delay, not the
    /// message's fault, and no failure of the push.
    Deferred(Condition, String, Duration),
    /// Its round trip failed, or never ran after an earlier one failed:
    /// not known to be delivered, and not the message's fault.
    Unsent,
}

/// What a push did: one [`Delivery`] per message, in the order of the
/// batches and their messages, and the broker's failure that ended it
/// early, if one did. The round trips before the failure stand: their
/// messages are delivered (or not) as their replies said.
#[derive(Debug)]
pub struct Pushed {
    pub deliveries: Vec<Delivery>,
    pub failure: Option<SinkError>,
}

crate::named! {
    /// How the server keeps what it is sent, as its configuration says.
    pub enum Persistence {
        /// Neither snapshots nor an append-only file: a restart of Redis
        /// loses every message not yet consumed.
        None = "none",
        Snapshots = "rdb",
        AppendOnly = "aof",
        SnapshotsAndAppendOnly = "rdb+aof",
        /// The configuration could not be read (CONFIG is not allowed).
        Unknown = "unknown",
        /// AMQP: persistent messages in durable queues, kept across a
        /// restart of the broker. Kafka: records the leader acknowledged
        /// with `acks=all` (kept as the topic's replication keeps them).
        Durable = "durable",
    }
}

/// The broker of `outbox.broker_url`.
pub enum Sink {
    Redis(RedisSink),
    Amqp(AmqpSink),
    Kafka(KafkaSink),
}

/// The same call on any broker.
macro_rules! either {
    ($sink:expr, $inner:ident => $call:expr) => {
        match $sink {
            Sink::Redis($inner) => $call,
            Sink::Amqp($inner) => $call,
            Sink::Kafka($inner) => $call,
        }
    };
}

impl Sink {
    /// Parses the URL and the options; connects lazily.
    pub fn new(config: &BrokerConfig) -> Result<Sink, SinkError> {
        let url = BrokerUrl::parse(&config.url).map_err(|e| {
            SinkError::InvalidConfig(format!(
                "invalid outbox.broker_url {}: {e}",
                broker_url::redact(&config.url)
            ))
        })?;
        if url.is_amqp() {
            Ok(Sink::Amqp(AmqpSink::new(config, url)?))
        } else if url.is_kafka() {
            Ok(Sink::Kafka(KafkaSink::new(config, url)?))
        } else {
            Ok(Sink::Redis(RedisSink::new(config, url)?))
        }
    }

    /// Where a Celery message for `queue` at `priority` goes: the Redis
    /// list kombu's worker reads, or the AMQP queue (priority travels in
    /// the message). Kafka takes records, not Celery messages: its topic is
    /// [`KafkaSink::topic`]'s.
    pub fn destination(&self, queue: &str, priority: u8) -> String {
        match self {
            Sink::Redis(sink) => sink.keys().queue(queue, priority),
            Sink::Amqp(_) | Sink::Kafka(_) => queue.to_string(),
        }
    }

    /// Where workers append the reports named `key` in messages: kombu's
    /// client prefixes Redis keys; an AMQP queue is named as it is. (Kafka
    /// has no Celery worker to report: reports are off there.)
    pub fn report_queue(&self, key: &str) -> String {
        match self {
            Sink::Redis(sink) => sink.keys().prefixed(key),
            Sink::Amqp(_) | Sink::Kafka(_) => key.to_string(),
        }
    }

    /// Where reports of `queue` are, as logs name it.
    pub fn report_place(&self, queue: &str) -> String {
        match self {
            Sink::Redis(_) => format!("Redis list \"{queue}\""),
            Sink::Amqp(_) => format!("RabbitMQ queue \"{queue}\""),
            Sink::Kafka(_) => format!("Kafka topic \"{queue}\""),
        }
    }

    /// What the broker's address names, as logs say it: Redis's master, a
    /// RabbitMQ node, a Kafka bootstrap server.
    pub fn node_kind(&self) -> &'static str {
        match self {
            Sink::Redis(_) => "master",
            Sink::Amqp(_) => "node",
            Sink::Kafka(_) => "bootstrap server",
        }
    }

    /// The broker's kind, as logs name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Sink::Redis(_) => "Redis",
            Sink::Amqp(_) => "RabbitMQ",
            Sink::Kafka(_) => "Kafka",
        }
    }

    /// The node of the current or last connection, `host:port` (Redis: the
    /// master).
    pub fn master(&self) -> Option<&str> {
        either!(self, sink => sink.master())
    }

    /// What a refusal of `condition` means for this broker.
    pub fn refusal(&self, condition: Condition, reply: String) -> SinkError {
        match self {
            Sink::Redis(sink) => sink.refusal(condition, reply),
            Sink::Amqp(_) | Sink::Kafka(_) => SinkError::Refused(condition, reply),
        }
    }

    /// The broker's address with any credentials masked.
    pub fn display_url(&self) -> &str {
        either!(self, sink => sink.display_url())
    }

    pub fn is_connected(&self) -> bool {
        either!(self, sink => sink.is_connected())
    }

    pub fn disconnect(&mut self) {
        either!(self, sink => sink.disconnect())
    }

    /// Connects and proves the connection, within one timeout; returns how
    /// the broker keeps messages.
    pub fn connect(&mut self, waiter: &mut dyn Wait) -> Result<Persistence, SinkError> {
        either!(self, sink => sink.connect(waiter))
    }

    /// One round trip that proves the connection; drops it when it fails.
    pub fn ping(&mut self, waiter: &mut dyn Wait) -> Result<(), SinkError> {
        either!(self, sink => sink.ping(waiter))
    }

    /// Up to `max` reports from the head of `queue`, oldest first, left
    /// there until [`Sink::forget_reports`]. The inner error is the broker
    /// refusing this read for a reason of the queue's own: the connection
    /// stays.
    pub fn reports(
        &mut self,
        queue: &str,
        max: usize,
        waiter: &mut dyn Wait,
    ) -> Result<Result<Vec<Vec<u8>>, String>, SinkError> {
        match self {
            Sink::Redis(sink) => sink.reports(queue, max, waiter),
            Sink::Amqp(sink) => sink.reports(queue, max, waiter),
            // No Celery worker reads Kafka: nothing reports back.
            Sink::Kafka(_) => Ok(Ok(Vec::new())),
        }
    }

    /// Drops the `n` reports [`Sink::reports`] read last, once recorded.
    /// The inner error is the broker refusing it as it may refuse a read
    /// (Redis: an ACL denying LTRIM): the connection stays.
    pub fn forget_reports(
        &mut self,
        queue: &str,
        n: usize,
        waiter: &mut dyn Wait,
    ) -> Result<Result<(), String>, SinkError> {
        match self {
            Sink::Redis(sink) => sink.forget_reports(queue, n, waiter),
            Sink::Amqp(sink) => sink.forget_reports(queue, n, waiter),
            Sink::Kafka(_) => Ok(Ok(())),
        }
    }

    /// Pushes every batch, in as few round trips as `max_batch_bytes`
    /// allows, each with its own deadline. When a round trip fails, the
    /// messages of the round trips before it keep what the broker said, and
    /// the rest are [`Delivery::Unsent`]. A broker that pauses publishing
    /// (a RabbitMQ alarm) is waited for until `pause_until` at the latest:
    /// an instant the caller derives from its claim, which no alarm moves.
    pub fn push(&mut self, outgoing: &Outgoing, waiter: &mut dyn Wait, pause_until: Instant) -> Pushed {
        match (self, outgoing) {
            (Sink::Redis(sink), Outgoing::Tasks(batches)) => sink.push(batches, waiter),
            (Sink::Amqp(sink), Outgoing::Tasks(batches)) => sink.push(batches, waiter, pause_until),
            (Sink::Kafka(sink), Outgoing::Records(batches)) => sink.push(batches, waiter),
            _ => unreachable!("Outgoing::of gives each broker its form of message"),
        }
    }
}

/// A push's messages, in the form their broker takes.
pub enum Outgoing {
    /// Celery messages, for Redis and RabbitMQ.
    Tasks(Vec<KeyBatch>),
    /// Kafka records, by topic.
    Records(Vec<KeyBatch<Record>>),
}

impl Outgoing {
    /// No messages yet, in the form `sink` takes.
    pub fn of(sink: &Sink) -> Outgoing {
        match sink {
            Sink::Redis(_) | Sink::Amqp(_) => Outgoing::Tasks(Vec::new()),
            Sink::Kafka(_) => Outgoing::Records(Vec::new()),
        }
    }
}

/// TLS for `rediss://` and `amqps://`: the authorities of
/// `outbox.broker_tls_ca_file`, or the system's.
fn tls_config(config: &BrokerConfig) -> Result<std::sync::Arc<rustls::ClientConfig>, SinkError> {
    let identity =
        match (&config.tls_cert_file, &config.tls_key_file) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(
                crate::tls::Identity::read(
                    ("outbox.broker_tls_cert_file", cert),
                    ("outbox.broker_tls_key_file", key),
                )
                .map_err(SinkError::InvalidConfig)?,
            ),
            _ => return Err(SinkError::InvalidConfig(
                "outbox.broker_tls_cert_file and outbox.broker_tls_key_file go together: set both or neither"
                    .into(),
            )),
        };
    crate::tls::client_config("outbox.broker_tls_ca_file", config.tls_ca_file.as_deref(), identity)
        .map_err(SinkError::InvalidConfig)
}
