//! One AMQP connection: the handshake, frames in and out within the
//! negotiated size, channels opened and answered, and what concerns the
//! whole connection, dealt with as it comes: heartbeats, a
//! `connection.close`, and the broker's alarms.
//!
//! An alarm (`connection.blocked`: memory or disk) is a pause: the broker
//! stops reading from the connection until `connection.unblocked`. The
//! connection stays; during a push, every wait meanwhile runs to the
//! push's pause deadline ([`Session::pause_until`]: an instant fixed by
//! the claim, which no alarm moves), in waits on the socket and the
//! caller's latch, and the caller is told ([`Wait::paused`]). Once it
//! lifts, the round trip under way has a fresh timeout, from the lift or
//! the pause deadline, whichever is first. Outside a push, an alarm
//! stretches nothing.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame, ProtocolVersion, WriteContext};
use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::protocol::{channel, confirm, connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};

use crate::link::{Link, LinkError, Wait};

use super::{lost, protocol, Fault, FRAME_MAX, FRAME_OVERHEAD, MAX_BODY_BYTES, PUBLISH, REPORTS};
use crate::sink::errors::broker_text;
use crate::sink::{Condition, SinkError};

/// How long a send waits on a socket the broker does not read before it
/// looks at what the broker said meanwhile (an alarm stretches the
/// deadline).
const LISTEN_EVERY: Duration = Duration::from_millis(200);

/// Bytes read from a busy socket by one look between sends, at most.
const LISTEN_BYTES: usize = 1 << 20;

/// Bytes of frames a round trip's send may keep for later beyond the
/// bytes it sends (what the broker may owe: a confirm or a return of each
/// message sent, a close). A peer that sends more while the round trip is
/// sent is no broker to trust.
const ARRIVED_SLACK: usize = 64 << 10;

/// What a frame kept costs at least, counted against that room: its
/// bytes in memory, besides its size on the wire. (A confirm takes 21
/// bytes on the wire, a message sent far more.)
const FRAME_COST: usize = 128;

/// The smallest `frame_max` AMQP 0-9-1 allows a peer to offer.
pub(super) const MIN_FRAME_MAX: u32 = 4096;

/// One open connection and what was set up on it.
pub(super) struct Session {
    pub(super) link: Link,
    /// Bytes received and not yet framed: at most one frame and one read.
    inbox: Vec<u8>,
    /// Frames read while sending, not yet taken, and their sizes on the
    /// wire; in all, `arrived_bytes`.
    arrived: VecDeque<(AMQPFrame, usize)>,
    arrived_bytes: usize,
    pub(super) frame_max: usize,
    /// The publish sequence number of the next message (confirm mode).
    pub(super) next_seq: u64,
    /// Queues made sure of (their exchange, queue and binding).
    pub(super) declared: HashSet<String>,
    /// The largest body the broker takes: [`MAX_BODY_BYTES`], or what it
    /// said when it closed the channel over a larger one, and its words.
    pub(super) max_body: (usize, Option<String>),
    pub(super) reports: ReportChannel,
    alarm: Alarm,
    /// `BrokerConfig::timeout`.
    timeout: Duration,
    /// During a push: how long an alarm may pause it, at most (derived
    /// from the claim: no alarm moves it). `None`: no pause is waited for.
    pub(super) pause_until: Option<Instant>,
}

/// What channel 2 holds.
#[derive(Default)]
pub(super) struct ReportChannel {
    pub(super) open: bool,
    /// Report queues made sure of on it.
    pub(super) queues: HashSet<String>,
    /// Reports read and not yet acknowledged.
    pub(super) held: Option<Held>,
}

/// Reports read on channel 2 and not yet acknowledged (reports.rs reads
/// and acknowledges them; the connection drops them when the broker
/// closes the channel).
pub(super) struct Held {
    pub(super) queue: String,
    /// The delivery tag of the last of them.
    pub(super) last_tag: u64,
    pub(super) bodies: Vec<Vec<u8>>,
}

/// The broker's alarms, as this connection saw them.
enum Alarm {
    Clear,
    /// `connection.blocked`: the broker reads nothing from this connection.
    Blocked {
        reason: String,
    },
    /// `connection.unblocked`, at this instant.
    Lifted(Instant),
}

impl Session {
    pub(super) fn new(link: Link, timeout: Duration) -> Session {
        Session {
            link,
            inbox: Vec::new(),
            arrived: VecDeque::new(),
            arrived_bytes: 0,
            frame_max: FRAME_MAX as usize,
            next_seq: 1,
            declared: HashSet::new(),
            max_body: (MAX_BODY_BYTES, None),
            reports: ReportChannel::default(),
            alarm: Alarm::Clear,
            timeout,
            pause_until: None,
        }
    }

    /// The AMQP handshake, then the publishing channel in confirm mode.
    pub(super) fn open(
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
        let mechanisms = broker_text(&String::from_utf8_lossy(start.mechanisms.as_bytes()));
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
            // No content header fits: every message would fail as its own
            // fault. The broker's.
            offered @ ..MIN_FRAME_MAX => {
                return Err(SinkError::Connect(format!(
                    "the broker offers frame_max {offered}, below AMQP's minimum of {MIN_FRAME_MAX} bytes \
                     (its frame_max setting)"
                )))
            }
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
        self.open_publishing(waiter, deadline).map_err(refused)
    }

    /// Opens the publishing channel in confirm mode, at the connection's
    /// start or after the broker closed it: its sequence starts afresh.
    pub(super) fn open_publishing(&mut self, waiter: &mut dyn Wait, deadline: Instant) -> Result<(), Fault> {
        self.open_channel(PUBLISH, waiter, deadline)?;
        self.next_seq = 1;
        let select = AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select { nowait: false }));
        self.call(PUBLISH, select, waiter, deadline, |m| {
            matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)))
        })
        .map(drop)
    }

    /// Closes the publishing channel and opens it again.
    pub(super) fn reopen_publishing(
        &mut self,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), Fault> {
        let close =
            channel::Close { reply_code: 200, reply_text: "reopening".into(), class_id: 0, method_id: 0 };
        self.call(PUBLISH, AMQPClass::Channel(channel::AMQPMethod::Close(close)), waiter, deadline, |m| {
            matches!(m, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
        })?;
        self.open_publishing(waiter, deadline)
    }

    pub(super) fn open_channel(
        &mut self,
        id: u16,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), Fault> {
        let open = AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}));
        self.call(id, open, waiter, deadline, |m| {
            matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))
        })
        .map(drop)
    }

    /// Sends `method` on `channel` and reads its answer, which `expected`
    /// must accept.
    pub(super) fn call(
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
    pub(super) fn answer(
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
    pub(super) fn send(
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

    /// Sends `bytes` (a round trip's publishes), listening to the broker
    /// whenever the socket takes nothing for a while: a broker that stops
    /// reading for an alarm says so, and the send then waits as long as a
    /// pause may last. What else came meanwhile (confirms) is kept for
    /// [`Session::frame`].
    pub(super) fn send_listening(
        &mut self,
        bytes: &[u8],
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), SinkError> {
        let mut sent = 0;
        let room = bytes.len().saturating_add(ARRIVED_SLACK);
        loop {
            let until = self.stretch(deadline);
            let slice = until.min(Instant::now() + LISTEN_EVERY);
            let step = match bytes.get(sent..).filter(|rest| !rest.is_empty()) {
                Some(rest) => self.link.send_some(rest, waiter, slice).map(|n| sent += n),
                None => match self.link.flush(waiter, slice) {
                    Ok(()) => return Ok(()),
                    Err(e) => Err(e),
                },
            };
            match step {
                Ok(()) => {}
                Err(LinkError::Timeout) if Instant::now() < until => {}
                Err(LinkError::Timeout) => return Err(self.expired()),
                Err(e) => return Err(lost(e)),
            }
            self.listen(waiter, room)?;
        }
    }

    /// Reads and frames what the broker sent, without waiting: alarms are
    /// noted and heartbeats dropped, other frames kept in order for
    /// [`Session::frame`], at most `room` bytes of them (more is a
    /// protocol error: memory stays bounded whatever the peer sends).
    fn listen(&mut self, waiter: &mut dyn Wait, room: usize) -> Result<(), SinkError> {
        let mut read = 0;
        while read < LISTEN_BYTES {
            let before = self.inbox.len();
            match self.link.read_some(&mut self.inbox, waiter, Instant::now()) {
                Ok(()) => read += self.inbox.len() - before,
                // Nothing has come.
                Err(LinkError::Timeout) => break,
                Err(e) => return Err(lost(e)),
            }
            loop {
                let before = self.inbox.len();
                let Some(frame) = self.take_frame()? else { break };
                let size = (before - self.inbox.len()).max(FRAME_COST);
                match self.note_alarm(frame, waiter) {
                    None | Some(AMQPFrame::Heartbeat) => {}
                    Some(frame) => {
                        self.arrived_bytes += size;
                        if self.arrived_bytes > room {
                            return Err(protocol(format!(
                                "the broker sent more than {room} bytes of frames while a round trip of \
                                 {} bytes was being sent",
                                room - ARRIVED_SLACK
                            )));
                        }
                        self.arrived.push_back((frame, size));
                    }
                }
            }
        }
        Ok(())
    }

    /// The next method frame, with what concerns the whole connection
    /// dealt with on the way: heartbeats skipped, `connection.close`
    /// answered (the connection is lost, with the broker's reason), a
    /// `channel.close` answered and returned as [`Fault::Channel`] (the
    /// report channel's only to a caller working on it, `owner`:
    /// publishing goes on without it).
    pub(super) fn method(
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
                        close.reply_code,
                        broker_text(close.reply_text.as_str())
                    ))));
                }
                AMQPFrame::Method(c, AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                    if c != PUBLISH && !(c == REPORTS && self.reports.open) {
                        return Err(Fault::Sink(protocol(format!(
                            "channel.close of channel {c}, never opened"
                        ))));
                    }
                    let ok = AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
                    self.send(&[AMQPFrame::Method(c, ok)], waiter, deadline)?;
                    if c == REPORTS {
                        // What it read and did not acknowledge goes back to
                        // the queue; it is opened afresh at the next read.
                        self.reports = ReportChannel::default();
                        if owner != REPORTS {
                            continue;
                        }
                    }
                    let why = format!("{} {}", close.reply_code, broker_text(close.reply_text.as_str()));
                    return Err(Fault::Channel(c, why));
                }
                AMQPFrame::Method(c, method) => return Ok((c, method)),
                other => return Err(Fault::Sink(protocol(format!("unexpected {}", frame_kind(&other))))),
            }
        }
    }

    /// The next frame, read within the deadline (stretched by an alarm).
    /// A frame larger than `frame_max` is refused from its header, before
    /// its bytes are read.
    pub(super) fn frame(&mut self, waiter: &mut dyn Wait, deadline: Instant) -> Result<AMQPFrame, SinkError> {
        loop {
            if let Some((frame, size)) = self.arrived.pop_front() {
                self.arrived_bytes -= size;
                return Ok(frame);
            }
            if let Some(frame) = self.take_frame()? {
                match self.note_alarm(frame, waiter) {
                    Some(frame) => return Ok(frame),
                    None => continue,
                }
            }
            let until = self.stretch(deadline);
            if Instant::now() >= until {
                return Err(self.expired());
            }
            waiter.check().map_err(|_| SinkError::Interrupted)?;
            match self.link.read_some(&mut self.inbox, waiter, until) {
                Ok(()) => {}
                // The deadline passed between the check above and the read.
                Err(LinkError::Timeout) => return Err(self.expired()),
                Err(e) => return Err(lost(e)),
            }
        }
    }

    /// Takes in `connection.blocked` and `connection.unblocked`, telling the
    /// caller; returns any other frame.
    fn note_alarm(&mut self, frame: AMQPFrame, waiter: &mut dyn Wait) -> Option<AMQPFrame> {
        match frame {
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Blocked(blocked))) => {
                let reason = broker_text(blocked.reason.as_str());
                let left = self.pause_until.map(|until| until.saturating_duration_since(Instant::now()));
                waiter.paused(Some(&match left {
                    Some(left) => format!(
                        "RabbitMQ blocked the connection: {reason}; publishing waits until it unblocks \
                         (at most {}s more)",
                        left.as_secs()
                    ),
                    None => format!("RabbitMQ blocked the connection: {reason}"),
                }));
                self.alarm = Alarm::Blocked { reason };
                None
            }
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Unblocked(_))) => {
                waiter.paused(None);
                self.alarm = Alarm::Lifted(Instant::now());
                None
            }
            frame => Some(frame),
        }
    }

    /// `deadline`, as the broker's alarm makes it during a push: while
    /// blocked, the push's pause deadline; once unblocked, a fresh timeout
    /// from then (or from the pause deadline, if it passed). Neither moves
    /// with the alarms: a block, an unblock and a block again wait no
    /// longer than one block.
    fn stretch(&self, deadline: Instant) -> Instant {
        match (&self.alarm, self.pause_until) {
            (Alarm::Blocked { .. }, Some(until)) => deadline.max(until),
            (Alarm::Lifted(at), Some(until)) => deadline.max((*at).min(until) + self.timeout),
            _ => deadline,
        }
    }

    /// The failure of an operation whose (stretched) deadline passed.
    fn expired(&self) -> SinkError {
        match &self.alarm {
            Alarm::Blocked { reason } => SinkError::Refused(
                Condition::Blocked,
                match self.pause_until {
                    Some(_) => format!(
                        "RabbitMQ blocked the connection: {reason}, for longer than a push may wait \
                         (outbox.processing_timeout from the claim, less the longest push)"
                    ),
                    None => format!("RabbitMQ blocked the connection: {reason}, and did not answer in time"),
                },
            ),
            _ => SinkError::Timeout,
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
    pub(super) fn content(
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
}

/// A method as AMQP numbers it (`class.method`): never its arguments,
/// which a peer fills as it likes.
pub(super) fn method_name(method: &AMQPClass) -> String {
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
