//! The AMQP 0-9-1 end (RabbitMQ): one connection, driven through the same
//! non-blocking [`Link`] as Redis, framed by `amq-protocol`'s codec.
//!
//! - Channel 1 publishes, in confirm mode: a round trip publishes its
//!   messages (`mandatory`) and then waits until the broker has confirmed
//!   every one. Only a `basic.ack` makes a message delivered; a
//!   `basic.return` before it makes it unroutable (that event's fault); a
//!   `basic.nack`, `connection.blocked` (an alarm), a closed channel or
//!   connection are the broker's, and never spend a retry.
//! - Before a queue's first message on a connection, the exchange and
//!   queue Celery would declare are declared: a direct exchange named like
//!   the queue, a durable queue of [`QueueShape`], bound by its own name.
//!   A queue that exists with other arguments closes the channel with
//!   RabbitMQ's reason, shown as the dispatcher's error.
//! - Channel 2 reads reports with `basic.get`; they are acknowledged only
//!   once recorded ([`AmqpSink::forget_reports`]).
//!
//! Every operation has one deadline; every frame is bounded by the
//! negotiated `frame_max`, and a report's body by
//! [`report::MAX_REPORT_BYTES`].

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use amq_protocol::frame::{
    gen_frame, parse_frame, AMQPContentHeader, AMQPFrame, ProtocolVersion, WriteContext,
};
use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::protocol::{basic, channel, confirm, connection, exchange, queue, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use serde_json::Value;

use crate::broker_url::{BrokerUrl, Endpoints};
use crate::celery;
use crate::link::{Link, LinkError, Wait};
use crate::report;

use super::errors::scrub;
use super::plan::{plan_round_trips, RoundTrip};
use super::secrets::password_from_file;
use super::tls::tls_config;
use super::{BrokerConfig, Condition, Delivery, KeyBatch, Persistence, Pushed, SinkError};

/// The channel that publishes (in confirm mode).
const PUBLISH: u16 = 1;
/// The channel that reads reports.
const REPORTS: u16 = 2;
/// The largest frame the dispatcher accepts and sends.
const FRAME_MAX: u32 = 128 * 1024;
/// Bytes of a frame besides its payload: type, channel, size, end.
const FRAME_OVERHEAD: usize = 8;
/// `basic.get`s sent together when reading reports.
const GETS_PER_TRIP: usize = 100;
/// AMQP's class id of `basic`, whose content headers carry messages.
const BASIC: u16 = 60;
/// The largest message body published: RabbitMQ's default
/// `max_message_size` (128 MiB), above which it would close the channel.
const MAX_BODY_BYTES: usize = 128 << 20;

crate::named! {
    /// The kind of queue declared, as Celery's `task_default_queue_type`.
    pub enum QueueKind {
        Classic = "classic",
        Quorum = "quorum",
    }
}

/// How the dispatcher declares a queue: what a Celery worker configured
/// the same way declares, so that either may declare it first.
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
}

pub struct AmqpSink {
    config: BrokerConfig,
    url: BrokerUrl,
    display_url: String,
    session: Option<Session>,
    /// The node of the current (or last) connection, `host:port`.
    node: Option<String>,
    /// The index of the node a connect tries first: the last that took one.
    first_node: usize,
}

/// One open connection and what was set up on it.
struct Session {
    link: Link,
    /// Bytes received and not yet framed: at most one frame and one read.
    inbox: Vec<u8>,
    frame_max: usize,
    /// The publish sequence number of the next message (confirm mode).
    next_seq: u64,
    /// Queues whose exchange, queue and binding were declared.
    declared: HashSet<String>,
    /// Channel 2 is open, with these report queues declared on it.
    reports_open: bool,
    report_queues: HashSet<String>,
    /// The delivery tag of the last report read and not yet acknowledged.
    last_report: Option<u64>,
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
        Ok(AmqpSink { config: config.clone(), url, display_url, session: None, node: None, first_node: 0 })
    }

    pub fn master(&self) -> Option<&str> {
        self.node.as_deref()
    }

    pub fn refusal(&self, condition: Condition, reply: String) -> SinkError {
        SinkError::Refused(condition, reply)
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
            Some(path) => Some(password_from_file("outbox.redis_password_file", path)?),
            None => self.url.password.clone(),
        };
        let user = self.url.username.clone().unwrap_or_else(|| "guest".into());
        let password = password.unwrap_or_else(|| "guest".into());
        let tls = self.url.tls.then(|| tls_config(self.config.tls_ca_file.as_deref())).transpose()?;
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
            let mut session = Session {
                link,
                inbox: Vec::new(),
                frame_max: FRAME_MAX as usize,
                next_seq: 1,
                declared: HashSet::new(),
                reports_open: false,
                report_queues: HashSet::new(),
                last_report: None,
            };
            let opened =
                session.open(&user, &password, &self.url.vhost, self.config.heartbeat, waiter, deadline);
            let secrets = [Some(password.as_str()), Some(user.as_str())];
            match opened {
                Ok(()) => {
                    self.session = Some(session);
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
    /// unacknowledged until [`AmqpSink::forget_reports`]. The queue is
    /// declared first (as the dispatcher declares queues). A channel the
    /// broker closes over this queue (a permission, arguments that differ)
    /// is the read's refusal: the connection and the pushes go on.
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
    pub fn forget_reports(&mut self, _queue: &str, n: usize, waiter: &mut dyn Wait) -> Result<(), SinkError> {
        let deadline = self.deadline();
        self.with_session(|s| {
            let Some(tag) = s.last_report.take().filter(|_| n > 0) else { return Ok(()) };
            let ack = basic::AMQPMethod::Ack(basic::Ack { delivery_tag: tag, multiple: true });
            s.send(&[AMQPFrame::Method(REPORTS, AMQPClass::Basic(ack))], waiter, deadline)
        })
    }

    /// Publishes every batch in round trips of about `max_batch_bytes`,
    /// each confirmed before the next is sent. When a round trip fails, what
    /// the broker confirmed (or returned) of it before the failure stands.
    pub fn push(&mut self, batches: &[KeyBatch], waiter: &mut dyn Wait) -> Pushed {
        let total = batches.iter().map(|b| b.messages.len()).sum();
        let mut deliveries = Vec::with_capacity(total);
        for trip in plan_round_trips(batches, self.config.max_batch_bytes) {
            let deadline = self.deadline();
            let shape = self.config.queues;
            let failure = match self.session.as_mut() {
                Some(session) => {
                    let (settled, failure) = session.publish(batches, &trip, shape, waiter, deadline);
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

/// What a message becomes on the wire: kombu's envelope (as the Redis
/// transport stores it, [`celery::encode`]) taken apart into the body and
/// the properties py-amqp would publish.
struct Outgoing {
    body: Vec<u8>,
    properties: AMQPProperties,
    /// The task id (`correlation_id`), which a `basic.return` names.
    id: String,
    /// The queue the worker reports to (`outbox_report_to`); empty: none.
    report_to: String,
}

fn outgoing(envelope: &str) -> Result<Outgoing, String> {
    let Ok(Value::Object(mut envelope)) = serde_json::from_str::<Value>(envelope) else {
        return Err("the message is not a kombu envelope".into());
    };
    let text = |value: Option<&Value>| value.and_then(Value::as_str).unwrap_or_default().to_string();
    let body = celery::base64_decode(&text(envelope.get("body"))).ok_or("the message body is not base64")?;
    let Some(Value::Object(properties)) = envelope.remove("properties") else {
        return Err("the message has no properties".into());
    };
    let Some(Value::Object(headers)) = envelope.remove("headers") else {
        return Err("the message has no headers".into());
    };
    let id = text(properties.get("correlation_id"));
    let report_to = text(headers.get("outbox_report_to"));
    let priority = properties.get("priority").and_then(Value::as_u64).unwrap_or(0).min(255) as u8;
    let mut amqp = AMQPProperties::default()
        .with_content_type(short(&text(envelope.get("content-type")), "the content type")?)
        .with_content_encoding(short(&text(envelope.get("content-encoding")), "the content encoding")?)
        .with_headers(table(headers)?)
        .with_delivery_mode(2)
        .with_priority(priority)
        .with_correlation_id(short(&id, "the task id")?);
    let reply_to = text(properties.get("reply_to"));
    if !reply_to.is_empty() {
        amqp = amqp.with_reply_to(short(&reply_to, "reply_to")?);
    }
    Ok(Outgoing { body, properties: amqp, id, report_to })
}

/// A JSON object as an AMQP table, as py-amqp encodes Python values: None
/// void, integers signed 64-bit, other numbers doubles, strings long
/// strings, lists arrays, dicts tables.
fn table(object: serde_json::Map<String, Value>) -> Result<FieldTable, String> {
    let mut table = FieldTable::default();
    for (key, value) in object {
        let name = short(&key, "a header's name")?;
        table.insert(name, amqp_value(value)?);
    }
    Ok(table)
}

fn amqp_value(value: Value) -> Result<AMQPValue, String> {
    Ok(match value {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => AMQPValue::LongString(s.into()),
        Value::Array(items) => AMQPValue::FieldArray(FieldArray::from(
            items.into_iter().map(amqp_value).collect::<Result<Vec<_>, _>>()?,
        )),
        Value::Object(object) => AMQPValue::FieldTable(table(object)?),
    })
}

/// The confirms of one round trip.
struct Confirms {
    /// Publish sequence number → index of the message in the round trip.
    pending: HashMap<u64, usize>,
    /// Task id → index, for returns.
    ids: HashMap<String, usize>,
    /// Why a message was returned, by index.
    returned: HashMap<usize, String>,
}

impl Session {
    /// The AMQP handshake, then the publishing channel in confirm mode.
    fn open(
        &mut self,
        user: &str,
        password: &str,
        vhost: &str,
        heartbeat: Duration,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), SinkError> {
        let refused = |e: Fault| match e {
            Fault::Sink(SinkError::ConnectionLost(why)) => SinkError::Connect(why),
            Fault::Sink(e) => e,
            Fault::Channel(_, why) => SinkError::Connect(why),
        };
        self.send(&[AMQPFrame::ProtocolHeader(ProtocolVersion::amqp_0_9_1())], waiter, deadline)?;
        let start = match self.method(PUBLISH, waiter, deadline).map_err(refused)? {
            (0, AMQPClass::Connection(connection::AMQPMethod::Start(start))) => start,
            (_, other) => {
                return Err(SinkError::Connect(format!(
                    "expected connection.start, got {}",
                    method_name(&other)
                )))
            }
        };
        let mechanisms = String::from_utf8_lossy(start.mechanisms.as_bytes()).to_string();
        if !mechanisms.split_whitespace().any(|m| m == "PLAIN") {
            return Err(SinkError::Connect(format!(
                "the broker offers no PLAIN authentication (it offers {mechanisms})"
            )));
        }
        let mut capabilities = FieldTable::default();
        for capability in ["publisher_confirms", "connection.blocked", "authentication_failure_close"] {
            capabilities.insert(capability.into(), AMQPValue::Boolean(true));
        }
        let mut client = FieldTable::default();
        client.insert("product".into(), AMQPValue::LongString("outbox_dispatch".into()));
        client.insert("version".into(), AMQPValue::LongString(env!("CARGO_PKG_VERSION").into()));
        client.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
        let start_ok = connection::StartOk {
            client_properties: client,
            mechanism: "PLAIN".into(),
            response: LongString::from(format!("\0{user}\0{password}")),
            locale: "en_US".into(),
        };
        let start_ok = AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok));
        self.send(&[AMQPFrame::Method(0, start_ok)], waiter, deadline)?;
        let tune = match self.method(PUBLISH, waiter, deadline).map_err(refused)? {
            (0, AMQPClass::Connection(connection::AMQPMethod::Tune(tune))) => tune,
            (_, other) => {
                return Err(SinkError::Connect(format!(
                    "expected connection.tune, got {}",
                    method_name(&other)
                )))
            }
        };
        let frame_max = match tune.frame_max {
            0 => FRAME_MAX,
            offered => offered.min(FRAME_MAX),
        };
        self.frame_max = frame_max as usize;
        let tune_ok = connection::TuneOk {
            channel_max: REPORTS,
            frame_max,
            heartbeat: heartbeat.as_secs().clamp(1, u16::MAX.into()) as u16,
        };
        let open = connection::Open { virtual_host: vhost.into() };
        self.send(
            &[
                AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok))),
                AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Open(open))),
            ],
            waiter,
            deadline,
        )?;
        match self.method(PUBLISH, waiter, deadline).map_err(refused)? {
            (0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))) => {}
            (_, other) => {
                return Err(SinkError::Connect(format!(
                    "expected connection.open-ok, got {}",
                    method_name(&other)
                )))
            }
        }
        self.open_channel(PUBLISH, waiter, deadline).map_err(refused)?;
        let select = AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select { nowait: false }));
        self.call(PUBLISH, select, waiter, deadline, |m| {
            matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)))
        })
        .map_err(refused)?;
        Ok(())
    }

    fn open_channel(&mut self, id: u16, waiter: &mut dyn Wait, deadline: Instant) -> Result<(), Fault> {
        let open = AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}));
        self.call(id, open, waiter, deadline, |m| {
            matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))
        })
        .map(drop)
    }

    /// Sends `method` on `channel` and reads its answer, which `expected`
    /// must accept.
    fn call(
        &mut self,
        channel: u16,
        method: AMQPClass,
        waiter: &mut dyn Wait,
        deadline: Instant,
        expected: impl Fn(&AMQPClass) -> bool,
    ) -> Result<AMQPClass, Fault> {
        self.send(&[AMQPFrame::Method(channel, method)], waiter, deadline)?;
        self.answer(channel, waiter, deadline, expected)
    }

    /// The next method on `channel`, which `expected` must accept.
    fn answer(
        &mut self,
        channel: u16,
        waiter: &mut dyn Wait,
        deadline: Instant,
        expected: impl Fn(&AMQPClass) -> bool,
    ) -> Result<AMQPClass, Fault> {
        match self.method(channel, waiter, deadline)? {
            (c, method) if c == channel && expected(&method) => Ok(method),
            (c, method) => {
                Err(Fault::Sink(protocol(format!("unexpected {} on channel {c}", method_name(&method)))))
            }
        }
    }

    /// Encodes and sends `frames`.
    fn send(
        &mut self,
        frames: &[AMQPFrame],
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), SinkError> {
        let mut bytes = Vec::new();
        for frame in frames {
            bytes = gen_frame(frame)(WriteContext::from(bytes))
                .map_err(|e| protocol(format!("cannot encode: {e}")))?
                .write;
        }
        self.link.send(&bytes, waiter, deadline).map_err(lost)
    }

    /// The next method frame, with what concerns the whole connection
    /// dealt with on the way: heartbeats skipped, `connection.close`
    /// answered (the connection is lost, with the broker's reason),
    /// `connection.blocked` a refusal, a `channel.close` answered and
    /// returned as [`Fault::Channel`] (the report channel's only to a
    /// caller working on it, `owner`: publishing goes on without it).
    fn method(
        &mut self,
        owner: u16,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(u16, AMQPClass), Fault> {
        loop {
            match self.frame(waiter, deadline)? {
                AMQPFrame::Heartbeat => {}
                AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(close))) => {
                    let ok = AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {}));
                    let _ = self.send(&[AMQPFrame::Method(0, ok)], waiter, deadline);
                    return Err(Fault::Sink(SinkError::ConnectionLost(format!(
                        "RabbitMQ closed the connection: {} {}",
                        close.reply_code, close.reply_text
                    ))));
                }
                AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Blocked(blocked))) => {
                    return Err(Fault::Sink(SinkError::Refused(
                        Condition::Blocked,
                        format!("RabbitMQ blocked the connection: {}", blocked.reason),
                    )));
                }
                AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Unblocked(_))) => {}
                AMQPFrame::Method(c, AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                    if c != PUBLISH && !(c == REPORTS && self.reports_open) {
                        return Err(Fault::Sink(protocol(format!(
                            "channel.close of channel {c}, never opened"
                        ))));
                    }
                    let ok = AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
                    self.send(&[AMQPFrame::Method(c, ok)], waiter, deadline)?;
                    if c == REPORTS {
                        // What it read and did not acknowledge goes back to
                        // the queue; it is opened afresh at the next read.
                        self.forget_report_channel();
                        if owner != REPORTS {
                            continue;
                        }
                    }
                    return Err(Fault::Channel(c, format!("{} {}", close.reply_code, close.reply_text)));
                }
                AMQPFrame::Method(c, method) => return Ok((c, method)),
                other => return Err(Fault::Sink(protocol(format!("unexpected {}", frame_kind(&other))))),
            }
        }
    }

    /// The next frame, read within the deadline. A frame larger than
    /// `frame_max` is refused from its header, before its bytes are read.
    fn frame(&mut self, waiter: &mut dyn Wait, deadline: Instant) -> Result<AMQPFrame, SinkError> {
        loop {
            if let Some(frame) = self.take_frame()? {
                return Ok(frame);
            }
            if Instant::now() >= deadline {
                return Err(SinkError::Timeout);
            }
            waiter.check().map_err(|_| SinkError::Interrupted)?;
            self.link.read_some(&mut self.inbox, waiter, deadline).map_err(lost)?;
        }
    }

    fn take_frame(&mut self) -> Result<Option<AMQPFrame>, SinkError> {
        if self.inbox.starts_with(b"AMQP") {
            return Err(protocol("the broker does not speak AMQP 0-9-1 (it answered with its own version)"));
        }
        if self.inbox.len() < 7 {
            return Ok(None);
        }
        let size = u32::from_be_bytes([self.inbox[3], self.inbox[4], self.inbox[5], self.inbox[6]]) as usize;
        if size + FRAME_OVERHEAD > self.frame_max {
            return Err(protocol(format!(
                "a frame of {size} bytes, above the {} negotiated",
                self.frame_max
            )));
        }
        if self.inbox.len() < size + FRAME_OVERHEAD {
            return Ok(None);
        }
        let whole = &self.inbox[..size + FRAME_OVERHEAD];
        let frame = match parse_frame(whole) {
            Ok((&[], frame)) => frame,
            Ok(_) => return Err(protocol("a frame longer than its size")),
            Err(e) => return Err(protocol(format!("a malformed frame ({e})"))),
        };
        self.inbox.drain(..size + FRAME_OVERHEAD);
        Ok(Some(frame))
    }

    /// The content (header and body frames) after a `basic.return` or
    /// `basic.get-ok` on `channel`: its properties, and its body when at
    /// most `keep` bytes long (else an empty body: its bytes are read and
    /// dropped, never held).
    fn content(
        &mut self,
        channel: u16,
        keep: usize,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(AMQPProperties, Vec<u8>), SinkError> {
        let header = match self.frame(waiter, deadline)? {
            AMQPFrame::Header(c, header) if c == channel => header,
            other => return Err(protocol(format!("expected a content header, got {}", frame_kind(&other)))),
        };
        let size = usize::try_from(header.body_size).unwrap_or(usize::MAX);
        let mut body = Vec::new();
        let mut read = 0;
        while read < size {
            match self.frame(waiter, deadline)? {
                AMQPFrame::Body(c, bytes) if c == channel => {
                    read += bytes.len();
                    if size <= keep {
                        body.extend_from_slice(&bytes);
                    }
                }
                other => {
                    return Err(protocol(format!("expected a content body, got {}", frame_kind(&other))))
                }
            }
        }
        if read != size {
            return Err(protocol("a content body longer than its header said"));
        }
        Ok((header.properties, body))
    }

    /// Declares, once per connection, what Celery declares for `queue`: a
    /// durable direct exchange named like it, the durable queue, and the
    /// binding by the queue's name. All are sent together, then answered
    /// in order.
    fn declare(
        &mut self,
        queues: &[&str],
        shape: QueueShape,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), SinkError> {
        let fresh: Vec<&str> = queues.iter().copied().filter(|q| !self.declared.contains(*q)).collect();
        if fresh.is_empty() {
            return Ok(());
        }
        let mut frames = Vec::with_capacity(fresh.len() * 3);
        for name in &fresh {
            let name = ShortString::from(*name);
            let declare_exchange = exchange::Declare {
                exchange: name.clone(),
                kind: "direct".into(),
                passive: false,
                durable: true,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: FieldTable::default(),
            };
            let declare_queue = queue::Declare {
                queue: name.clone(),
                passive: false,
                durable: true,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: shape.arguments(),
            };
            let bind = queue::Bind {
                queue: name.clone(),
                exchange: name.clone(),
                routing_key: name,
                nowait: false,
                arguments: FieldTable::default(),
            };
            frames.push(AMQPFrame::Method(
                PUBLISH,
                AMQPClass::Exchange(exchange::AMQPMethod::Declare(declare_exchange)),
            ));
            frames.push(AMQPFrame::Method(
                PUBLISH,
                AMQPClass::Queue(queue::AMQPMethod::Declare(declare_queue)),
            ));
            frames.push(AMQPFrame::Method(PUBLISH, AMQPClass::Queue(queue::AMQPMethod::Bind(bind))));
        }
        self.send(&frames, waiter, deadline)?;
        for name in fresh {
            let doing = format!(
                "declaring queue \"{name}\" ({}{}) and its exchange",
                shape.kind.name(),
                if shape.max_priority > 0 {
                    format!(", x-max-priority {}", shape.max_priority)
                } else {
                    String::new()
                }
            );
            let mut answer = |s: &mut Session, expected: fn(&AMQPClass) -> bool| {
                s.answer(PUBLISH, waiter, deadline, expected).map_err(|f| f.into_sink(&doing))
            };
            answer(self, |m| matches!(m, AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_))))?;
            answer(self, |m| matches!(m, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))))?;
            answer(self, |m| matches!(m, AMQPClass::Queue(queue::AMQPMethod::BindOk(_))))?;
            self.declared.insert(name.to_string());
        }
        Ok(())
    }

    /// Makes sure, once per connection, that the report queue `name`
    /// exists, on channel 2: a queue that exists is used as it is (a
    /// passive declaration, which no argument can contradict); one that
    /// does not is declared of `shape`.
    fn ensure_report_queue(
        &mut self,
        name: &ShortString,
        shape: QueueShape,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), Fault> {
        if self.report_queues.contains(name.as_str()) {
            return Ok(());
        }
        let declared = |m: &AMQPClass| matches!(m, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_)));
        let declare = |passive| {
            let arguments = if passive { FieldTable::default() } else { shape.arguments() };
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: name.clone(),
                passive,
                durable: true,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments,
            }))
        };
        self.open_report_channel(waiter, deadline)?;
        match self.call(REPORTS, declare(true), waiter, deadline, declared) {
            Ok(_) => {}
            Err(Fault::Channel(REPORTS, why)) if why.starts_with("404 ") => {
                self.open_report_channel(waiter, deadline)?;
                self.call(REPORTS, declare(false), waiter, deadline, declared)?;
            }
            Err(fault) => return Err(fault),
        }
        self.report_queues.insert(name.to_string());
        Ok(())
    }

    fn open_report_channel(&mut self, waiter: &mut dyn Wait, deadline: Instant) -> Result<(), Fault> {
        if !self.reports_open {
            self.reports_open = true;
            self.open_channel(REPORTS, waiter, deadline)?;
        }
        Ok(())
    }

    /// One round trip of a push: its queues declared, its messages
    /// published (`mandatory`), then every confirm awaited. Returns what
    /// became of each message, and the broker's failure that ended the
    /// round trip early, if one did: what was confirmed before it stands.
    fn publish(
        &mut self,
        batches: &[KeyBatch],
        trip: &RoundTrip,
        shape: QueueShape,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> (Vec<Delivery>, Option<SinkError>) {
        let mut deliveries = Vec::new();
        let mut bytes = Vec::new();
        let mut confirms =
            Confirms { pending: HashMap::new(), ids: HashMap::new(), returned: HashMap::new() };
        let mut queues = Vec::new();
        let mut report_queues = Vec::new();
        for command in &trip.commands {
            let queue = batches[command.batch].key.as_str();
            if let Err(e) = publishable_queue(queue) {
                deliveries.extend(std::iter::repeat_n(Delivery::Rejected(e), command.messages.len()));
                continue;
            }
            queues.push(queue);
            for envelope in &batches[command.batch].messages[command.messages.clone()] {
                match self.frames(queue, envelope, &mut bytes) {
                    Ok((id, report_to)) => {
                        if !report_to.is_empty() && !report_queues.contains(&report_to) {
                            report_queues.push(report_to);
                        }
                        let index = deliveries.len();
                        confirms.pending.insert(self.next_seq, index);
                        confirms.ids.insert(id, index);
                        self.next_seq += 1;
                        deliveries.push(Delivery::Unsent);
                    }
                    Err(e) => deliveries.push(Delivery::Rejected(e)),
                }
            }
        }
        queues.dedup();
        let sent = self.declare(&queues, shape, waiter, deadline).and_then(|()| {
            // The report queue exists before any message naming it does:
            // a worker's report to a queue not yet declared would be lost.
            // One that cannot be declared (a permission) is the report
            // read's refusal, logged there: the push goes on.
            for name in report_queues.iter().filter_map(|name| ShortString::try_new(name.as_str()).ok()) {
                match self.ensure_report_queue(&name, shape, waiter, deadline) {
                    Ok(()) | Err(Fault::Channel(REPORTS, _)) => {}
                    Err(fault) => return Err(fault.into_sink("declaring the report queue")),
                }
            }
            if confirms.pending.is_empty() {
                return Ok(());
            }
            self.link.send(&bytes, waiter, deadline).map_err(lost)?;
            self.await_confirms(&mut confirms, &mut deliveries, waiter, deadline)
        });
        (deliveries, sent.err())
    }

    /// Appends to `bytes` the frames that publish `envelope` to `queue`
    /// (`basic.publish`, its content header, its body in frames of
    /// `frame_max`); returns the task id the message carries and the queue
    /// it asks the worker to report to. A message
    /// RabbitMQ could not take is refused here, as that event's fault:
    /// headers that do not fit in one frame, a body above
    /// [`MAX_BODY_BYTES`].
    fn frames(&self, queue: &str, envelope: &str, bytes: &mut Vec<u8>) -> Result<(String, String), String> {
        let message = outgoing(envelope)?;
        if message.body.len() > MAX_BODY_BYTES {
            return Err(format!(
                "the message takes {} bytes, above RabbitMQ's default max_message_size ({MAX_BODY_BYTES})",
                message.body.len()
            ));
        }
        let header = AMQPFrame::Header(
            PUBLISH,
            AMQPContentHeader {
                class_id: BASIC,
                body_size: message.body.len() as u64,
                properties: message.properties,
            },
        );
        let header = gen_frame(&header)(WriteContext::from(Vec::new()))
            .map_err(|e| format!("its properties cannot be encoded: {e}"))?
            .write;
        if header.len() > self.frame_max {
            return Err(format!(
                "its properties and headers take {} bytes, above the frame size negotiated with RabbitMQ ({})",
                header.len(),
                self.frame_max
            ));
        }
        let publish = basic::Publish {
            exchange: queue.into(),
            routing_key: queue.into(),
            mandatory: true,
            immediate: false,
        };
        let publish = AMQPFrame::Method(PUBLISH, AMQPClass::Basic(basic::AMQPMethod::Publish(publish)));
        let mut encoded =
            gen_frame(&publish)(WriteContext::from(std::mem::take(bytes))).map_err(|e| e.to_string())?.write;
        encoded.extend_from_slice(&header);
        for chunk in message.body.chunks(self.frame_max - FRAME_OVERHEAD) {
            encoded = gen_frame(&AMQPFrame::Body(PUBLISH, chunk.to_vec()))(WriteContext::from(encoded))
                .map_err(|e| e.to_string())?
                .write;
        }
        *bytes = encoded;
        Ok((message.id, message.report_to))
    }

    /// Reads confirms (and returns) until every message of the round trip
    /// is settled, each into its place in `deliveries`.
    fn await_confirms(
        &mut self,
        confirms: &mut Confirms,
        deliveries: &mut [Delivery],
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), SinkError> {
        while !confirms.pending.is_empty() {
            let (c, method) =
                self.method(PUBLISH, waiter, deadline).map_err(|f| f.into_sink("publishing"))?;
            if c != PUBLISH {
                return Err(protocol(format!("unexpected {} on channel {c}", method_name(&method))));
            }
            match method {
                AMQPClass::Basic(basic::AMQPMethod::Ack(ack)) => {
                    for index in settle(&mut confirms.pending, ack.delivery_tag, ack.multiple, self.next_seq)?
                    {
                        deliveries[index] = match confirms.returned.remove(&index) {
                            Some(why) => Delivery::Rejected(why),
                            None => Delivery::Delivered,
                        };
                    }
                }
                AMQPClass::Basic(basic::AMQPMethod::Nack(nack)) => {
                    for index in
                        settle(&mut confirms.pending, nack.delivery_tag, nack.multiple, self.next_seq)?
                    {
                        deliveries[index] = Delivery::Refused(
                            Condition::Nacked,
                            "RabbitMQ did not take the message (basic.nack)".into(),
                        );
                    }
                }
                AMQPClass::Basic(basic::AMQPMethod::Return(returned)) => {
                    let (properties, _) = self.content(PUBLISH, 0, waiter, deadline)?;
                    let id =
                        properties.correlation_id().as_ref().map(ToString::to_string).unwrap_or_default();
                    let Some(index) = confirms.ids.get(&id) else {
                        return Err(protocol("a basic.return of no message of this round trip"));
                    };
                    // Declared on this connection, yet unroutable: the
                    // queue went away. Declared again before the next try.
                    self.declared.remove(returned.routing_key.as_str());
                    confirms.returned.insert(
                        *index,
                        format!(
                            "unroutable: RabbitMQ returned the message ({} {}): no queue is bound to exchange \"{}\" \
                             with routing key \"{}\"",
                            returned.reply_code, returned.reply_text, returned.exchange, returned.routing_key
                        ),
                    );
                }
                other => {
                    return Err(protocol(format!(
                        "unexpected {} while awaiting confirms",
                        method_name(&other)
                    )))
                }
            }
        }
        Ok(())
    }

    /// The broker closed channel 2: it is opened, and its queue declared,
    /// afresh at the next read; what it read goes back to the queue.
    fn forget_report_channel(&mut self) {
        self.reports_open = false;
        self.report_queues.clear();
        self.last_report = None;
    }

    /// Reads up to `max` reports with pipelined `basic.get`s on channel 2.
    fn read_reports(
        &mut self,
        queue: &ShortString,
        shape: QueueShape,
        max: usize,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, Fault> {
        self.open_report_channel(waiter, deadline)?;
        // Reports read and never acknowledged (their recording failed): back
        // to the queue, to be read again now; an acknowledgement of later
        // ones must not cover them.
        if let Some(tag) = self.last_report.take() {
            let nack = basic::Nack { delivery_tag: tag, multiple: true, requeue: true };
            self.send(
                &[AMQPFrame::Method(REPORTS, AMQPClass::Basic(basic::AMQPMethod::Nack(nack)))],
                waiter,
                deadline,
            )?;
        }
        self.ensure_report_queue(queue, shape, waiter, deadline)?;
        let mut reports = Vec::new();
        while reports.len() < max {
            let asked = GETS_PER_TRIP.min(max - reports.len());
            let get = || {
                let get = basic::Get { queue: queue.clone(), no_ack: false };
                AMQPFrame::Method(REPORTS, AMQPClass::Basic(basic::AMQPMethod::Get(get)))
            };
            self.send(&(0..asked).map(|_| get()).collect::<Vec<_>>(), waiter, deadline)?;
            let mut empty = false;
            for _ in 0..asked {
                match self.method(REPORTS, waiter, deadline)? {
                    (REPORTS, AMQPClass::Basic(basic::AMQPMethod::GetOk(ok))) => {
                        let (_, body) = self.content(REPORTS, report::MAX_REPORT_BYTES, waiter, deadline)?;
                        self.last_report = Some(ok.delivery_tag);
                        reports.push(body);
                    }
                    (REPORTS, AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_))) => empty = true,
                    (c, other) => {
                        return Err(Fault::Sink(protocol(format!(
                            "unexpected {} on channel {c}",
                            method_name(&other)
                        ))))
                    }
                }
            }
            if empty {
                break;
            }
        }
        Ok(reports)
    }
}

/// The messages a confirm settles: `tag`, or with `multiple` every one up
/// to it; a confirm of nothing pending (any more) settles nothing. A tag
/// never published (`next_seq` is the next to be) is no broker's answer.
fn settle(
    pending: &mut HashMap<u64, usize>,
    tag: u64,
    multiple: bool,
    next_seq: u64,
) -> Result<Vec<usize>, SinkError> {
    if tag == 0 || tag >= next_seq {
        return Err(protocol(format!("a confirm of message {tag}, never published")));
    }
    if !multiple {
        return Ok(pending.remove(&tag).into_iter().collect());
    }
    let settled: Vec<u64> = pending.keys().copied().filter(|seq| *seq <= tag).collect();
    Ok(settled.into_iter().filter_map(|seq| pending.remove(&seq)).collect())
}

/// A method as AMQP numbers it (`class.method`): never its arguments,
/// which a peer fills as it likes.
fn method_name(method: &AMQPClass) -> String {
    format!("method {}.{}", method.get_amqp_class_id(), method.get_amqp_method_id())
}

fn frame_kind(frame: &AMQPFrame) -> String {
    match frame {
        AMQPFrame::ProtocolHeader(_) => "a protocol header".into(),
        AMQPFrame::Method(c, method) => format!("{} on channel {c}", method_name(method)),
        AMQPFrame::Header(c, _) => format!("a content header on channel {c}"),
        AMQPFrame::Body(c, _) => format!("a content body on channel {c}"),
        AMQPFrame::Heartbeat | AMQPFrame::InvalidHeartbeat(_) => "a heartbeat".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::Poll;
    use crate::sink::Reason;
    use std::io::{Read, Write};

    fn sink(url: &str) -> AmqpSink {
        let config = BrokerConfig::plain(url, Duration::from_secs(1), 1 << 20);
        AmqpSink::new(&config, BrokerUrl::parse(url).unwrap()).unwrap()
    }

    fn encode(frames: &[AMQPFrame]) -> Vec<u8> {
        frames
            .iter()
            .fold(Vec::new(), |bytes, frame| gen_frame(frame)(WriteContext::from(bytes)).unwrap().write)
    }

    /// A peer on loopback that sends `greeting` once the client's first
    /// bytes came, then reads and ignores whatever comes.
    fn peer(greeting: Vec<u8>) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("amqp://guest:hunter2@{}//", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut buf = [0u8; 4096];
                if stream.read(&mut buf).is_err() || stream.write_all(&greeting).is_err() {
                    continue;
                }
                while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
            }
        });
        url
    }

    fn start() -> AMQPFrame {
        let start = connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: FieldTable::default(),
            mechanisms: "PLAIN AMQPLAIN".into(),
            locales: "en_US".into(),
        };
        AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(start)))
    }

    /// A peer that answers the handshake as a broker does, whatever the
    /// client says, then reads and ignores what comes.
    fn broker() -> u16 {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let tune = connection::Tune { channel_max: 0, frame_max: 131072, heartbeat: 60 };
        let opened = encode(&[
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Tune(tune))),
            AMQPFrame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
            ),
            AMQPFrame::Method(PUBLISH, AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {}))),
            AMQPFrame::Method(
                PUBLISH,
                AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
            ),
        ]);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut buf = [0u8; 4096];
                for answer in [encode(&[start()]), opened.clone()] {
                    if stream.read(&mut buf).is_err() || stream.write_all(&answer).is_err() {
                        break;
                    }
                }
                while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
            }
        });
        port
    }

    #[test]
    fn a_node_that_does_not_answer_passes_the_turn_to_the_next() {
        // The first node accepts (the kernel does, on listen) and is silent.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (first, second) = (silent.local_addr().unwrap().port(), broker());
        let mut sink = sink(&format!("amqp://127.0.0.1:{first}//;amqp://127.0.0.1:{second}//"));
        let started = Instant::now();
        assert_eq!(sink.connect(&mut Poll).unwrap(), Persistence::Durable);
        assert!(started.elapsed() >= Duration::from_millis(900), "the first node had its time");
        assert_eq!(sink.master(), Some(format!("127.0.0.1:{second}").as_str()));
        // The next connect starts at the node that took the last one.
        let started = Instant::now();
        sink.connect(&mut Poll).unwrap();
        assert!(started.elapsed() < Duration::from_millis(500), "{:?}", started.elapsed());
        assert_eq!(sink.master(), Some(format!("127.0.0.1:{second}").as_str()));
        drop(silent);
    }

    #[test]
    fn a_peer_that_is_no_amqp_broker_is_refused() {
        let garbage = peer(b"+PONG\r\n-ERR what is this\r\n".to_vec());
        let err = sink(&garbage).connect(&mut Poll).unwrap_err();
        assert_eq!(err.reason(), Reason::ConnectFailed, "{err}");
        assert!(err.to_string().contains("AMQP protocol error"), "{err}");
        let other_version = peer(b"AMQP\x00\x00\x09\x00".to_vec());
        let err = sink(&other_version).connect(&mut Poll).unwrap_err();
        assert!(err.to_string().contains("does not speak AMQP 0-9-1"), "{err}");
    }

    #[test]
    fn a_frame_larger_than_negotiated_is_refused_from_its_header() {
        // A method frame that says it is 1 GiB long: refused before any of
        // it is read or held.
        let mut huge = vec![1u8, 0, 0];
        huge.extend_from_slice(&(1u32 << 30).to_be_bytes());
        huge.extend_from_slice(&[0; 64]);
        let err = sink(&peer(huge)).connect(&mut Poll).unwrap_err();
        assert!(err.to_string().contains("a frame of 1073741824 bytes"), "{err}");
        assert!(err.to_string().len() < 200, "{err}");
    }

    #[test]
    fn a_broker_that_stops_answering_times_out_within_one_deadline() {
        // connection.start, then silence after start-ok.
        let started = Instant::now();
        let err = sink(&peer(encode(&[start()]))).connect(&mut Poll).unwrap_err();
        assert_eq!(err, SinkError::Timeout);
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(3), "{took:?}");
    }

    #[test]
    fn the_password_is_never_quoted_back() {
        // A broker that closes the connection quoting the password.
        let close = connection::Close {
            reply_code: 403,
            reply_text: "ACCESS_REFUSED - guest:hunter2 is not welcome".into(),
            class_id: 0,
            method_id: 0,
        };
        let close = AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(close)));
        let err = sink(&peer(encode(&[start(), close]))).connect(&mut Poll).unwrap_err();
        assert!(err.to_string().contains("403 ACCESS_REFUSED"), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn a_broker_without_plain_authentication_is_refused_by_name() {
        let start = connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: FieldTable::default(),
            mechanisms: "EXTERNAL".into(),
            locales: "en_US".into(),
        };
        let start = AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(start)));
        let err = sink(&peer(encode(&[start]))).connect(&mut Poll).unwrap_err();
        assert!(err.to_string().contains("no PLAIN authentication (it offers EXTERNAL)"), "{err}");
    }

    #[test]
    fn confirms_settle_one_or_every_message_up_to_the_tag() {
        let mut pending: HashMap<u64, usize> = (1..=5).map(|seq| (seq, seq as usize - 1)).collect();
        assert_eq!(settle(&mut pending, 2, false, 6).unwrap(), [1]);
        let mut upto = settle(&mut pending, 4, true, 6).unwrap();
        upto.sort();
        assert_eq!(upto, [0, 2, 3]);
        assert!(settle(&mut pending, 4, true, 6).unwrap().is_empty());
        assert_eq!(pending.len(), 1);
        // A confirm of a message never published settles nothing: the
        // peer is no broker to trust.
        for (tag, multiple) in [(6, true), (u64::MAX, true), (0, false), (9, false)] {
            let err = settle(&mut pending, tag, multiple, 6).unwrap_err();
            assert!(err.to_string().contains("never published"), "{err}");
        }
        assert_eq!(pending.len(), 1);
    }

    #[test]
    fn a_kombu_envelope_becomes_what_py_amqp_publishes() {
        let message = celery::TaskMessage {
            id: uuid::Uuid::parse_str("0190b5a8-3c4e-7d2a-9b1f-2e6a5c4d3b2a").unwrap(),
            task: "app.tasks.render",
            queue: "renders",
            priority: 7,
            event_type: "order.paid",
            created_at: "2026-12-01T00:00:00Z",
            payload: r#"{"a": 1}"#,
            args: None,
            headers: Some(r#"{"traceparent": "00-x-y-01", "deep": {"list": [1, 2.5, null, true]}}"#),
            expires: None,
            report_to: "reports:5",
            send: uuid::Uuid::nil(),
        };
        let mut envelope = String::new();
        celery::encode(&message, "host", uuid::Uuid::nil(), &mut envelope).unwrap();
        let out = outgoing(&envelope).unwrap();
        let body: Value = serde_json::from_slice(&out.body).unwrap();
        assert_eq!(body[1], serde_json::json!({"a": 1}));
        let p = &out.properties;
        assert_eq!(p.correlation_id().as_ref().unwrap().as_str(), "0190b5a8-3c4e-7d2a-9b1f-2e6a5c4d3b2a");
        assert_eq!((*p.delivery_mode(), *p.priority()), (Some(2), Some(7)));
        assert_eq!(p.content_type().as_ref().unwrap().as_str(), "application/json");
        assert_eq!(p.content_encoding().as_ref().unwrap().as_str(), "utf-8");
        assert_eq!(p.reply_to(), &None);
        let headers = p.headers().as_ref().unwrap().inner();
        assert_eq!(headers["task"], AMQPValue::LongString("app.tasks.render".into()));
        assert_eq!(headers["retries"], AMQPValue::LongLongInt(0));
        assert_eq!(headers["eta"], AMQPValue::Void);
        assert_eq!(headers["outbox_report_to"], AMQPValue::LongString("reports:5".into()));
        let AMQPValue::FieldTable(deep) = &headers["deep"] else { panic!("{headers:?}") };
        assert_eq!(
            deep.inner()["list"],
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::LongLongInt(1),
                AMQPValue::Double(2.5),
                AMQPValue::Void,
                AMQPValue::Boolean(true)
            ]))
        );
        // A header name AMQP cannot carry is that message's fault.
        let long = format!(r#"{{"{}": 1}}"#, "k".repeat(256));
        let mut envelope = String::new();
        celery::encode(
            &celery::TaskMessage { headers: Some(&long), ..message },
            "host",
            uuid::Uuid::nil(),
            &mut envelope,
        )
        .unwrap();
        assert!(outgoing(&envelope).err().unwrap().contains("longer than AMQP's 255 bytes"));
    }
}
