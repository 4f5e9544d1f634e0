//! The AMQP 0-9-1 end (RabbitMQ): one connection, driven through the same
//! non-blocking [`Link`] as Redis, framed by `amq-protocol`'s codec.
//!
//! - `connection.rs`: the connection, its frames and channels, and what
//!   concerns all of it: heartbeats, `connection.close`, and the broker's
//!   alarms (`connection.blocked` pauses publishing until
//!   `connection.unblocked`: the connection stays).
//! - `declare.rs`: before a queue's first message on a connection, what
//!   Celery declares for it, a queue that exists used as it is.
//! - `message.rs`: kombu's envelope as the message py-amqp publishes.
//! - `confirm.rs`: channel 1 publishes in confirm mode; a round trip
//!   publishes its messages (`mandatory`) and waits until the broker has
//!   settled every one. A channel the broker closes over one queue or one
//!   message fails those alone; the others go in the same round trip.
//! - `reports.rs`: channel 2 reads reports with `basic.get`, acknowledged
//!   only once recorded, and never handed back to the queue meanwhile.
//!
//! Every operation has one deadline; every frame is bounded by the
//! negotiated `frame_max`, and a report's body by
//! [`crate::report::MAX_REPORT_BYTES`].

mod confirm;
mod connection;
mod declare;
mod message;
mod reports;

use std::time::Instant;

use amq_protocol::protocol::{basic, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, ShortString};

use crate::broker_url::{BrokerUrl, Endpoints};
use crate::link::{Link, LinkError, Wait};

use super::errors::scrub;
use super::plan::plan_round_trips;
use super::secrets::password_from_file;
use super::{tls_config, BrokerConfig, Condition, Delivery, KeyBatch, Persistence, Pushed, SinkError};
use confirm::Refusals;
use connection::Session;

/// The channel that publishes (in confirm mode).
const PUBLISH: u16 = 1;
/// The channel that reads reports.
const REPORTS: u16 = 2;
/// The largest frame the dispatcher accepts and sends.
const FRAME_MAX: u32 = 128 * 1024;
/// Bytes of a frame besides its payload: type, channel, size, end.
const FRAME_OVERHEAD: usize = 8;
/// AMQP's class id of `basic`, whose content headers carry messages.
const BASIC: u16 = 60;
/// The largest message body published until the broker says otherwise:
/// RabbitMQ 3's default `max_message_size` (128 MiB). A broker that takes
/// less closes the channel for a larger one, saying its limit, which the
/// connection then keeps to.
const MAX_BODY_BYTES: usize = 128 << 20;

crate::named! {
    /// The kind of queue declared, as Celery's `task_default_queue_type`.
    pub enum QueueKind {
        Classic = "classic",
        Quorum = "quorum",
    }
}

/// How the dispatcher declares a queue that does not exist: what a Celery
/// worker configured the same way declares, so that either may declare it
/// first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueShape {
    pub kind: QueueKind,
    /// `x-max-priority` (Celery's `task_queue_max_priority`); 0: none.
    pub max_priority: u8,
}

impl Default for QueueShape {
    fn default() -> QueueShape {
        QueueShape { kind: QueueKind::Classic, max_priority: 0 }
    }
}

impl QueueShape {
    /// The arguments of `queue.declare`. A classic queue names no type, as
    /// Celery declares it: RabbitMQ takes an absent `x-queue-type` and
    /// `classic` for different arguments.
    fn arguments(self) -> FieldTable {
        let mut arguments = FieldTable::default();
        if self.kind == QueueKind::Quorum {
            arguments.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
        }
        if self.max_priority > 0 {
            arguments.insert("x-max-priority".into(), AMQPValue::LongLongInt(self.max_priority.into()));
        }
        arguments
    }

    /// As a declaration's failure names it.
    fn describe(self) -> String {
        match self.max_priority {
            0 => self.kind.name().to_string(),
            max => format!("{}, x-max-priority {max}", self.kind.name()),
        }
    }
}

pub struct AmqpSink {
    config: BrokerConfig,
    url: BrokerUrl,
    display_url: String,
    session: Option<Box<Session>>,
    /// The node of the current (or last) connection, `host:port`.
    node: Option<String>,
    /// The index of the node a connect tries first: the last that took one.
    first_node: usize,
    /// Messages the broker refused once (`basic.nack`): a second refusal
    /// is the message's own fault. Kept across connections.
    refusals: Refusals,
}

/// Why one step of a session failed: the connection (or the broker), or
/// a channel the broker closed (the connection stays), and why.
enum Fault {
    Sink(SinkError),
    Channel(u16, String),
}

impl From<SinkError> for Fault {
    fn from(e: SinkError) -> Fault {
        Fault::Sink(e)
    }
}

impl Fault {
    /// As the broker's fault: a closed channel is a refusal.
    fn into_sink(self, doing: &str) -> SinkError {
        match self {
            Fault::Sink(e) => e,
            Fault::Channel(_, why) => SinkError::Refused(Condition::ChannelClosed, format!("{doing}: {why}")),
        }
    }
}

fn lost(error: LinkError) -> SinkError {
    SinkError::from_link(error, true)
}

fn protocol(what: impl std::fmt::Display) -> SinkError {
    SinkError::ConnectionLost(format!("AMQP protocol error: {what}"))
}

/// Whether messages can be published to `queue` as Celery does (to the
/// exchange named like it): RabbitMQ refuses to declare names starting
/// with `amq.`, and the empty name is the default exchange's.
fn publishable_queue(queue: &str) -> Result<(), String> {
    short(queue, "the queue's name")?;
    if queue.is_empty() || queue.starts_with("amq.") {
        return Err(format!("RabbitMQ reserves the queue name \"{queue}\" (empty, or starting with amq.)"));
    }
    Ok(())
}

fn short(text: &str, what: &str) -> Result<ShortString, String> {
    ShortString::try_new(text).map_err(|_| format!("{what} is longer than AMQP's 255 bytes"))
}

impl AmqpSink {
    pub fn new(config: &BrokerConfig, url: BrokerUrl) -> Result<AmqpSink, SinkError> {
        let display_url = url.display();
        short(&url.vhost, "the vhost")
            .map_err(|e| SinkError::InvalidConfig(format!("invalid outbox.broker_url {display_url}: {e}")))?;
        Ok(AmqpSink {
            config: config.clone(),
            url,
            display_url,
            session: None,
            node: None,
            first_node: 0,
            refusals: Refusals::default(),
        })
    }

    pub fn master(&self) -> Option<&str> {
        self.node.as_deref()
    }

    pub fn display_url(&self) -> &str {
        &self.display_url
    }

    pub fn is_connected(&self) -> bool {
        self.session.is_some()
    }

    pub fn disconnect(&mut self) {
        self.session = None;
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.config.timeout
    }

    /// Connects to the first node that takes the connection, in the URL's
    /// order from the last node that took one, each within one timeout:
    /// TCP, TLS, the AMQP handshake (PLAIN authentication, the vhost), the
    /// publishing channel in confirm mode. A node that refuses, fails or
    /// does not answer in time passes the turn to the next.
    pub fn connect(&mut self, waiter: &mut dyn Wait) -> Result<Persistence, SinkError> {
        self.session = None;
        let password = match &self.config.password_file {
            Some(path) => Some(password_from_file("outbox.broker_password_file", path)?),
            None => self.url.password.clone(),
        };
        let user = self.url.username.clone().unwrap_or_else(|| "guest".into());
        let password = password.unwrap_or_else(|| "guest".into());
        let tls = self.url.tls.then(|| tls_config(&self.config)).transpose()?;
        let Endpoints::Amqp(nodes) = &self.url.endpoints else { unreachable!("an AMQP sink has AMQP nodes") };
        let mut failure = SinkError::Connect("no node".into());
        for turn in 0..nodes.len() {
            let index = (self.first_node + turn) % nodes.len();
            let (host, port) = &nodes[index];
            let deadline = Instant::now() + self.config.timeout;
            let link = match Link::connect(host, *port, tls.clone(), waiter, deadline) {
                Ok(link) => link,
                Err(LinkError::Interrupted) => return Err(SinkError::Interrupted),
                Err(e) => {
                    failure = SinkError::from_link(e, false);
                    continue;
                }
            };
            self.node = Some(format!("{host}:{port}"));
            let mut session = Session::new(link, self.config.timeout);
            let opened =
                session.open(&user, &password, &self.url.vhost, self.config.heartbeat, waiter, deadline);
            let secrets = [Some(password.as_str()), Some(user.as_str())];
            match opened {
                Ok(()) => {
                    self.session = Some(Box::new(session));
                    self.first_node = index;
                    return Ok(Persistence::Durable);
                }
                Err(SinkError::Connect(e) | SinkError::ConnectionLost(e)) => {
                    failure = SinkError::Connect(scrub(&e, &secrets))
                }
                Err(SinkError::Interrupted) => return Err(SinkError::Interrupted),
                Err(e) => failure = e,
            }
        }
        Err(failure)
    }

    /// A `basic.qos` round trip on the publishing channel: any answer
    /// proves the connection (and clears frames that came meanwhile).
    pub fn ping(&mut self, waiter: &mut dyn Wait) -> Result<(), SinkError> {
        let deadline = self.deadline();
        let qos = basic::AMQPMethod::Qos(basic::Qos { prefetch_count: 0, global: false });
        let result = self.with_session(|s| {
            s.call(PUBLISH, AMQPClass::Basic(qos), waiter, deadline, |m| {
                matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_)))
            })
            .map_err(|f| f.into_sink("basic.qos"))
        });
        result.map(drop)
    }

    /// Up to `max` reports from `queue`, fetched with `basic.get` and left
    /// unacknowledged until [`AmqpSink::forget_reports`]; until then, a
    /// read returns the same reports again. The queue is made sure of first
    /// (used as it is when it exists). A channel the broker closes over
    /// this queue (a permission, arguments that differ) is the read's
    /// refusal: the connection and the pushes go on.
    pub fn reports(
        &mut self,
        queue: &str,
        max: usize,
        waiter: &mut dyn Wait,
    ) -> Result<Result<Vec<Vec<u8>>, String>, SinkError> {
        let deadline = self.deadline();
        let shape = self.config.queues;
        let name =
            match short(queue, "the report queue's name (outbox.report_key, a colon, the database's OID)") {
                Ok(name) => name,
                Err(e) => return Ok(Err(e)),
            };
        self.with_session(|s| {
            let mut read = s.read_reports(&name, shape, max, waiter, deadline);
            // The queue was deleted since it was declared on this
            // connection: declared again at once, as workers are reporting.
            if matches!(&read, Err(Fault::Channel(REPORTS, why)) if why.starts_with("404 ")) {
                read = s.read_reports(&name, shape, max, waiter, deadline);
            }
            match read {
                Ok(reports) => Ok(Ok(reports)),
                Err(Fault::Channel(REPORTS, why)) => Ok(Err(why)),
                Err(fault) => Err(fault.into_sink("reading reports")),
            }
        })
    }

    /// Acknowledges every report read so far (`basic.ack`, multiple).
    pub fn forget_reports(
        &mut self,
        _queue: &str,
        n: usize,
        waiter: &mut dyn Wait,
    ) -> Result<Result<(), String>, SinkError> {
        let deadline = self.deadline();
        self.with_session(|s| s.forget_reports(n, waiter, deadline)).map(Ok)
    }

    /// Publishes every batch in round trips of about `max_batch_bytes`,
    /// each settled before the next is sent. When a round trip fails, what
    /// the broker settled of it before the failure stands. An alarm pauses
    /// a round trip until `pause_until` at the latest, whatever the alarms
    /// say (a block, an unblock, a block again).
    pub fn push(&mut self, batches: &[KeyBatch], waiter: &mut dyn Wait, pause_until: Instant) -> Pushed {
        let total = batches.iter().map(|b| b.messages.len()).sum();
        let mut deliveries = Vec::with_capacity(total);
        for trip in plan_round_trips(batches, self.config.max_batch_bytes) {
            let deadline = self.deadline();
            let shape = self.config.queues;
            let failure = match self.session.as_mut() {
                Some(session) => {
                    session.pause_until = Some(pause_until);
                    let (settled, failure) =
                        session.publish(batches, &trip, shape, &mut self.refusals, waiter, deadline);
                    session.pause_until = None;
                    deliveries.extend(settled);
                    failure
                }
                None => Some(SinkError::ConnectionLost("not connected".into())),
            };
            if let Some(failure) = failure {
                self.session = None;
                deliveries.resize(total, Delivery::Unsent);
                return Pushed { deliveries, failure: Some(failure) };
            }
        }
        Pushed { deliveries, failure: None }
    }

    /// Runs `step` on the session; drops the session when it fails with
    /// the broker's fault.
    fn with_session<T>(
        &mut self,
        step: impl FnOnce(&mut Session) -> Result<T, SinkError>,
    ) -> Result<T, SinkError> {
        let session = self.session.as_mut().ok_or(SinkError::ConnectionLost("not connected".into()))?;
        let result = step(session);
        if result.is_err() {
            self.session = None;
        }
        result
    }
}

/// The unit tests' message: a Celery envelope for `queue` at `priority`
/// with `payload`, under a fresh task id.
#[cfg(test)]
fn sample_envelope(queue: &str, priority: u8, payload: &str) -> String {
    let message = crate::celery::TaskMessage {
        id: uuid::Uuid::new_v4(),
        task: "t",
        queue,
        priority,
        event_type: "e",
        created_at: "2026-12-01T00:00:00Z",
        payload,
        args: None,
        headers: None,
        expires: None,
        report_to: "",
        send: uuid::Uuid::nil(),
    };
    let mut envelope = String::new();
    crate::celery::encode(&message, "host", uuid::Uuid::nil(), &mut envelope).unwrap();
    envelope
}

#[cfg(test)]
mod tests;
