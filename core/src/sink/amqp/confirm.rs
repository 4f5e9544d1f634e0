//! One round trip of a push on channel 1, in confirm mode: its queues made
//! sure of, its messages published (`mandatory`), then every one settled
//! by the broker. Only a `basic.ack` makes a message delivered.
//!
//! What belongs to one queue or one message fails those alone, and the
//! others go out in the same round trip:
//! - a queue the broker will not let be declared closes the channel: for
//!   a reason of the destination's own (403 ACCESS_REFUSED, 406
//!   PRECONDITION_FAILED), that queue's messages fail with it; for any
//!   other (404 after the active declaration: a classic queue whose home
//!   node is down; 5xx), they are refused as the broker's condition, no
//!   retry spent;
//! - a channel closed while publishing, naming an exchange not writable
//!   (403) or a size (`max_message_size`, which the connection then keeps
//!   to), fails the messages it names; one naming an exchange deleted
//!   since it was declared (404) refuses them (the broker's condition: it
//!   is declared again); the channel is opened again and the rest
//!   published again. A size is believed only in RabbitMQ's
//!   own words (406, "message size N is larger than [configured] max size
//!   M"), when N is the body of a message of that round trip and M is at
//!   least [`MIN_MAX_BODY`];
//! - a `basic.return` (no queue bound) fails that message;
//! - a `basic.nack` (a queue that rejects publishes when full, or one
//!   that cannot take the message) is taken for the broker's condition
//!   the first time, for the message's own the second.
//!
//! A channel closed for a reason that names neither, the connection, a
//! deadline: the broker's fault, never an event's retry.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::Instant;

use amq_protocol::frame::{gen_frame, AMQPContentHeader, AMQPFrame, WriteContext};
use amq_protocol::protocol::{basic, AMQPClass};
use amq_protocol::types::ShortString;

use crate::link::Wait;
use crate::sink::errors::broker_text;
use crate::sink::plan::RoundTrip;
use crate::sink::{Condition, Delivery, KeyBatch, SinkError};

use super::connection::{method_name, Session};
use super::message::outgoing;
use super::{protocol, publishable_queue, Fault, QueueShape, BASIC, FRAME_OVERHEAD, PUBLISH};

/// Messages refused once remembered at most, per dispatcher.
const REFUSALS_KEPT: usize = 10_000;

/// The smallest `max_message_size` believed: below it, a channel closed
/// naming a limit is no broker's (RabbitMQ takes far larger messages), and
/// every message would fail before it is sent.
const MIN_MAX_BODY: usize = 4096;

/// Messages the broker refused (`basic.nack`), by task id, until they are
/// refused again or delivered.
#[derive(Default)]
pub(super) struct Refusals(HashSet<String>);

impl Refusals {
    /// Notes a refusal of `id`; returns whether it is the second.
    fn again(&mut self, id: &str) -> bool {
        if self.0.remove(id) {
            return true;
        }
        if self.0.len() >= REFUSALS_KEPT {
            self.0.clear();
        }
        self.0.insert(id.to_string());
        false
    }

    fn forget(&mut self, id: &str) {
        self.0.remove(id);
    }
}

/// One message of a round trip.
struct Message<'a> {
    queue: &'a str,
    /// Its frames in [`Trip::bytes`]; empty when it was refused before
    /// being sent.
    frames: Range<usize>,
    id: String,
    body: usize,
    delivery: Delivery,
}

/// A round trip's messages, encoded.
struct Trip<'a> {
    messages: Vec<Message<'a>>,
    bytes: Vec<u8>,
    /// Queues that messages ask workers to report to.
    report_queues: Vec<String>,
}

/// The confirms awaited of one publishing.
#[derive(Default)]
struct Confirms {
    /// Publish sequence number → index of the message in the round trip.
    pending: HashMap<u64, usize>,
    /// Task id → index, for returns.
    ids: HashMap<String, usize>,
    /// Why a message was returned, by index.
    returned: HashMap<usize, String>,
    /// Whether the broker nacked any message.
    nacked: bool,
}

/// What a channel closed while publishing names as its cause.
#[derive(Debug, PartialEq, Eq)]
enum Blame {
    /// Messages larger than this many bytes (`406 PRECONDITION_FAILED -
    /// message size … is larger than configured max size …`).
    LargerThan(usize),
    /// The messages for the exchange of this name (`404 NOT_FOUND - no
    /// exchange '…'`, `403 ACCESS_REFUSED - access to exchange '…' …`).
    Exchange(String),
}

impl Blame {
    /// What `why` (the reply code, then the text) blames, when it is one
    /// of RabbitMQ's own answers to a publish: a size only when it is the
    /// body of a message `sent` in the round trip, above a limit no lower
    /// than [`MIN_MAX_BODY`].
    fn of(why: &str, sent: &[usize]) -> Option<Blame> {
        if let Some(said) = why.strip_prefix("406 PRECONDITION_FAILED - message size ") {
            let (size, limit) = said
                .split_once(" is larger than configured max size ")
                .or_else(|| said.split_once(" is larger than max size "))?;
            let number = |digits: &str| {
                (!digits.is_empty() && digits.len() < 20 && digits.bytes().all(|b| b.is_ascii_digit()))
                    .then(|| digits.parse::<usize>().ok())
                    .flatten()
            };
            let (size, limit) = (number(size)?, number(limit)?);
            let believed = size > limit && limit >= MIN_MAX_BODY && sent.contains(&size);
            return believed.then_some(Blame::LargerThan(limit));
        }
        let named = match reply_code(why) {
            404 => why.strip_prefix("404 NOT_FOUND - no exchange '")?,
            403 => why.strip_prefix("403 ACCESS_REFUSED - access to exchange '")?,
            _ => return None,
        };
        let (name, _) = named.rsplit_once("' in vhost")?;
        Some(Blame::Exchange(name.to_string()))
    }
}

/// The reply code a closed channel's reason starts with (0: none).
fn reply_code(why: &str) -> u16 {
    why.split(' ').next().and_then(|code| code.parse().ok()).unwrap_or(0)
}

impl Session {
    /// One round trip of a push. Returns what became of each message, and
    /// the broker's failure that ended the round trip early, if one did:
    /// what was settled before it stands.
    pub(super) fn publish(
        &mut self,
        batches: &[KeyBatch],
        trip: &RoundTrip,
        shape: QueueShape,
        refusals: &mut Refusals,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> (Vec<Delivery>, Option<SinkError>) {
        let mut trip = self.encode(batches, trip);
        let failure = self.publish_trip(&mut trip, shape, refusals, waiter, deadline).err();
        (trip.messages.into_iter().map(|m| m.delivery).collect(), failure)
    }

    /// Encodes every message of `trip`; one that RabbitMQ could not take
    /// is refused here, as that event's fault.
    fn encode<'a>(&self, batches: &'a [KeyBatch], trip: &RoundTrip) -> Trip<'a> {
        let mut encoded = Trip { messages: Vec::new(), bytes: Vec::new(), report_queues: Vec::new() };
        for command in &trip.commands {
            let queue = batches[command.batch].key.as_str();
            for envelope in &batches[command.batch].messages[command.messages.clone()] {
                let start = encoded.bytes.len();
                let framed =
                    publishable_queue(queue).and_then(|()| self.frames(queue, envelope, &mut encoded.bytes));
                let mut message = Message {
                    queue,
                    frames: start..start,
                    id: String::new(),
                    body: 0,
                    delivery: Delivery::Unsent,
                };
                match framed {
                    Ok((id, report_to, body)) => {
                        if !report_to.is_empty() && !encoded.report_queues.contains(&report_to) {
                            encoded.report_queues.push(report_to);
                        }
                        message.frames = start..encoded.bytes.len();
                        message.id = id;
                        message.body = body;
                    }
                    Err(e) => {
                        encoded.bytes.truncate(start);
                        message.delivery = Delivery::Rejected(e);
                    }
                }
                encoded.messages.push(message);
            }
        }
        encoded
    }

    fn publish_trip(
        &mut self,
        trip: &mut Trip<'_>,
        shape: QueueShape,
        refusals: &mut Refusals,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), SinkError> {
        let mut queues: Vec<&str> = trip.unsent().map(|i| trip.messages[i].queue).collect();
        let mut seen = HashSet::new();
        queues.retain(|queue| seen.insert(*queue));
        for queue in queues {
            match self.declare(queue, shape, waiter, deadline) {
                Ok(()) => {}
                Err(Fault::Channel(PUBLISH, why)) => {
                    let code = reply_code(&why);
                    let why =
                        format!("declaring queue \"{queue}\" ({}) and its exchange: {why}", shape.describe());
                    match code {
                        // The destination's own: a permission, arguments
                        // or a type that differ.
                        403 | 406 => trip.reject(|m| m.queue == queue, &why),
                        // The broker's: 404 after the active declaration
                        // (a classic queue whose home node is down), a
                        // 5xx, anything else.
                        _ => trip.refuse(|m| m.queue == queue, &why),
                    };
                    self.open_publishing(waiter, deadline)
                        .map_err(|f| f.into_sink("opening the channel again"))?;
                }
                Err(fault) => return Err(fault.into_sink("declaring queues")),
            }
        }
        // The report queue exists before any message naming it does: a
        // worker's report to a queue not yet declared would be lost. One
        // that cannot be declared (a permission) is the report read's
        // refusal, logged there: the push goes on.
        for name in trip.report_queues.iter().filter_map(|name| ShortString::try_new(name.as_str()).ok()) {
            match self.ensure_report_queue(&name, shape, waiter, deadline) {
                Ok(()) | Err(Fault::Channel(super::REPORTS, _)) => {}
                Err(fault) => return Err(fault.into_sink("declaring the report queue")),
            }
        }
        loop {
            let sending: Vec<usize> = trip.unsent().collect();
            if sending.is_empty() {
                return Ok(());
            }
            let mut confirms = Confirms::default();
            let mut bytes = Vec::with_capacity(trip.bytes.len());
            for &index in &sending {
                let message = &trip.messages[index];
                confirms.pending.insert(self.next_seq, index);
                confirms.ids.insert(message.id.clone(), index);
                self.next_seq += 1;
                bytes.extend_from_slice(&trip.bytes[message.frames.clone()]);
            }
            self.send_listening(&bytes, waiter, deadline)?;
            let why = match self.await_confirms(&mut confirms, &mut trip.messages, refusals, waiter, deadline)
            {
                // A channel that nacked is opened afresh: RabbitMQ 3.x
                // may nack every publish to a quorum queue, for good, on
                // a channel that saw the queue's leader die.
                Ok(()) if confirms.nacked => {
                    return self
                        .reopen_publishing(waiter, deadline)
                        .map_err(|f| f.into_sink("opening the channel again after a basic.nack"))
                }
                Ok(()) => return Ok(()),
                Err(Fault::Channel(PUBLISH, why)) => why,
                Err(fault) => return Err(fault.into_sink("publishing")),
            };
            // Returned before the channel closed: unroutable, whatever
            // else happened.
            for (index, returned) in confirms.returned.drain() {
                trip.messages[index].delivery = Delivery::Rejected(returned);
            }
            let sent: Vec<usize> = sending.iter().map(|&i| trip.messages[i].body).collect();
            let blamed = match Blame::of(&why, &sent) {
                Some(Blame::LargerThan(max)) => {
                    self.max_body = (max, Some(why.clone()));
                    trip.reject(|m| m.body > max, &format!("RabbitMQ closed the channel over it: {why}"))
                }
                Some(Blame::Exchange(name)) => {
                    // As the reason quotes it (escaped).
                    let named = |m: &Message<'_>| broker_text(m.queue) == name;
                    if let Some(queue) = trip.messages.iter().find(|m| named(m)).map(|m| m.queue) {
                        self.declared.remove(queue);
                    }
                    let code = reply_code(&why);
                    let why = format!("publishing to exchange \"{name}\": {why}");
                    match code {
                        // Deleted since this connection declared it: the
                        // broker's as it is now, declared again next time.
                        404 => trip.refuse(named, &why),
                        _ => trip.reject(named, &why),
                    }
                }
                None => 0,
            };
            if blamed == 0 {
                return Err(SinkError::Refused(Condition::ChannelClosed, format!("publishing: {why}")));
            }
            self.open_publishing(waiter, deadline).map_err(|f| f.into_sink("opening the channel again"))?;
        }
    }

    /// Appends to `bytes` the frames that publish `envelope` to `queue`
    /// (`basic.publish`, its content header, its body in frames of
    /// `frame_max`); returns the task id the message carries, the queue it
    /// asks the worker to report to, and its body's size. A message
    /// RabbitMQ could not take is refused: headers that do not fit in one
    /// frame, a body above what the broker takes.
    fn frames(
        &self,
        queue: &str,
        envelope: &str,
        bytes: &mut Vec<u8>,
    ) -> Result<(String, String, usize), String> {
        let message = outgoing(envelope)?;
        let body = message.body.len();
        if body > self.max_body.0 {
            let said = match &self.max_body.1 {
                Some(why) => format!("as it said closing the channel over a larger one: {why}"),
                None => "its default".into(),
            };
            return Err(format!(
                "the message takes {body} bytes, above RabbitMQ's max_message_size ({} bytes, {said})",
                self.max_body.0
            ));
        }
        let header = AMQPFrame::Header(
            PUBLISH,
            AMQPContentHeader { class_id: BASIC, body_size: body as u64, properties: message.properties },
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
        Ok((message.id, message.report_to, body))
    }

    /// Reads confirms (and returns) until every message published is
    /// settled, each into its delivery.
    fn await_confirms(
        &mut self,
        confirms: &mut Confirms,
        messages: &mut [Message<'_>],
        refusals: &mut Refusals,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), Fault> {
        while !confirms.pending.is_empty() {
            let (c, method) = self.method(PUBLISH, waiter, deadline)?;
            if c != PUBLISH {
                return Err(protocol(format!("unexpected {} on channel {c}", method_name(&method))).into());
            }
            match method {
                AMQPClass::Basic(basic::AMQPMethod::Ack(ack)) => {
                    for index in settle(&mut confirms.pending, ack.delivery_tag, ack.multiple, self.next_seq)?
                    {
                        let message = &mut messages[index];
                        message.delivery = match confirms.returned.remove(&index) {
                            Some(why) => Delivery::Rejected(why),
                            None => {
                                refusals.forget(&message.id);
                                Delivery::Delivered
                            }
                        };
                    }
                }
                AMQPClass::Basic(basic::AMQPMethod::Nack(nack)) => {
                    confirms.nacked = true;
                    for index in
                        settle(&mut confirms.pending, nack.delivery_tag, nack.multiple, self.next_seq)?
                    {
                        let message = &mut messages[index];
                        message.delivery = if refusals.again(&message.id) {
                            Delivery::Rejected(
                                "RabbitMQ refused the message twice (basic.nack): its queue rejects publishes \
                                 (x-overflow reject-publish, full) or cannot take it"
                                    .into(),
                            )
                        } else {
                            Delivery::Refused(
                                Condition::Nacked,
                                "RabbitMQ did not take the message (basic.nack)".into(),
                            )
                        };
                    }
                }
                AMQPClass::Basic(basic::AMQPMethod::Return(returned)) => {
                    let (properties, _) = self.content(PUBLISH, 0, waiter, deadline)?;
                    let id =
                        properties.correlation_id().as_ref().map(ToString::to_string).unwrap_or_default();
                    let Some(index) = confirms.ids.get(&id) else {
                        return Err(protocol("a basic.return of no message of this round trip").into());
                    };
                    // Declared on this connection, yet unroutable: the
                    // queue went away. Declared again before the next try.
                    self.declared.remove(returned.routing_key.as_str());
                    confirms.returned.insert(
                        *index,
                        format!(
                            "unroutable: RabbitMQ returned the message ({} {}): no queue is bound to exchange \"{}\" \
                             with routing key \"{}\"",
                            returned.reply_code,
                            broker_text(returned.reply_text.as_str()),
                            broker_text(returned.exchange.as_str()),
                            broker_text(returned.routing_key.as_str())
                        ),
                    );
                }
                other => {
                    return Err(protocol(format!(
                        "unexpected {} while awaiting confirms",
                        method_name(&other)
                    ))
                    .into())
                }
            }
        }
        Ok(())
    }
}

impl Trip<'_> {
    /// The messages still to be published, by index.
    fn unsent(&self) -> impl Iterator<Item = usize> + '_ {
        self.messages.iter().enumerate().filter(|(_, m)| m.delivery == Delivery::Unsent).map(|(i, _)| i)
    }

    /// Fails, for `why`, the unsent messages `blamed` names; returns how
    /// many.
    fn reject(&mut self, blamed: impl Fn(&Message<'_>) -> bool, why: &str) -> usize {
        self.settle(blamed, || Delivery::Rejected(why.to_string()))
    }

    /// Refuses, for `why`, the unsent messages `blamed` names: the
    /// broker's condition, not theirs. Returns how many.
    fn refuse(&mut self, blamed: impl Fn(&Message<'_>) -> bool, why: &str) -> usize {
        self.settle(blamed, || Delivery::Refused(Condition::ChannelClosed, why.to_string()))
    }

    fn settle(&mut self, blamed: impl Fn(&Message<'_>) -> bool, delivery: impl Fn() -> Delivery) -> usize {
        let mut n = 0;
        for message in self.messages.iter_mut().filter(|m| m.delivery == Delivery::Unsent && blamed(m)) {
            message.delivery = delivery();
            n += 1;
        }
        n
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_closed_channel_is_blamed_on_what_it_names() {
        let sent = [100, 9000, 200000000];
        assert_eq!(
            Blame::of(
                "406 PRECONDITION_FAILED - message size 9000 is larger than configured max size 8192",
                &sent
            ),
            Some(Blame::LargerThan(8192))
        );
        assert_eq!(
            Blame::of(
                "406 PRECONDITION_FAILED - message size 200000000 is larger than max size 134217728",
                &sent
            ),
            Some(Blame::LargerThan(134217728))
        );
        assert_eq!(
            Blame::of("404 NOT_FOUND - no exchange 'orders' in vhost '/'", &sent),
            Some(Blame::Exchange("orders".into()))
        );
        assert_eq!(
            Blame::of(
                "403 ACCESS_REFUSED - access to exchange 'it's' in vhost 'v' refused for user 'u'",
                &sent
            ),
            Some(Blame::Exchange("it's".into()))
        );
        assert_eq!(
            Blame::of("406 PRECONDITION_FAILED - message size is larger than max size x", &sent),
            None
        );
        assert_eq!(Blame::of("541 INTERNAL_ERROR", &sent), None);
        assert_eq!(Blame::of("320 CONNECTION_FORCED - exchange 'x", &sent), None);
    }

    #[test]
    fn a_size_limit_is_believed_only_in_rabbitmqs_words_about_a_body_sent() {
        let sent = [100, 9000];
        let of = |why: &str| Blame::of(why, &sent);
        // Any other reply code, or other words.
        assert_eq!(
            of("541 INTERNAL_ERROR - message size 9000 is larger than configured max size 8192"),
            None
        );
        assert_eq!(of("320 CONNECTION_FORCED - larger than anything, max size 4096"), None);
        assert_eq!(of("406 PRECONDITION_FAILED - it is larger than you think; max size 5000"), None);
        assert_eq!(
            of("406 PRECONDITION_FAILED - message size 9000 is larger than configured max size 8192 ok"),
            None
        );
        // A size no message of the round trip had.
        assert_eq!(
            of("406 PRECONDITION_FAILED - message size 9001 is larger than configured max size 8192"),
            None
        );
        // A limit no smaller than the size, or below any broker's.
        assert_eq!(
            of("406 PRECONDITION_FAILED - message size 9000 is larger than configured max size 9000"),
            None
        );
        assert_eq!(
            of("406 PRECONDITION_FAILED - message size 100 is larger than configured max size 10"),
            None
        );
        assert_eq!(
            of("406 PRECONDITION_FAILED - message size 9000 is larger than configured max size 4095"),
            None
        );
        assert_eq!(
            of("406 PRECONDITION_FAILED - message size 9000 is larger than configured max size 4096"),
            Some(Blame::LargerThan(4096))
        );
        // An exchange, only with its reply code.
        assert_eq!(of("406 PRECONDITION_FAILED - no exchange 'orders' in vhost '/'"), None);
        assert_eq!(of("541 INTERNAL_ERROR - access to exchange 'orders' in vhost '/' refused"), None);
    }

    #[test]
    fn a_message_refused_twice_is_its_own_fault() {
        let mut refusals = Refusals::default();
        assert!(!refusals.again("a"));
        assert!(!refusals.again("b"));
        assert!(refusals.again("a"));
        // Counted afresh after the second.
        assert!(!refusals.again("a"));
        // Delivered in between: forgotten.
        refusals.forget("b");
        assert!(!refusals.again("b"));
        // Bounded.
        for i in 0..REFUSALS_KEPT + 1 {
            refusals.again(&i.to_string());
        }
        assert!(refusals.0.len() <= REFUSALS_KEPT);
    }
}
