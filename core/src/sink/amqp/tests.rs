//! The AMQP sink against scripted peers: brokers that nack, block the
//! connection, flood it, close channels over a message or a queue, stop
//! answering, or are no AMQP broker at all.

use super::*;
use crate::link::Poll;
use crate::sink::Reason;
use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame, WriteContext};
use amq_protocol::protocol::{channel, confirm, connection, exchange, queue};
use std::io::{Read, Write};
use std::time::Duration;

fn sink(url: &str) -> AmqpSink {
    sink_within(url, Duration::from_secs(1))
}

fn sink_within(url: &str, timeout: Duration) -> AmqpSink {
    let config = BrokerConfig::plain(url, timeout, 1 << 20);
    AmqpSink::new(&config, BrokerUrl::parse(url).unwrap()).unwrap()
}

fn encode(frames: &[AMQPFrame]) -> Vec<u8> {
    frames.iter().fold(Vec::new(), |bytes, frame| gen_frame(frame)(WriteContext::from(bytes)).unwrap().write)
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
    broker_then(|stream| {
        let mut buf = [0u8; 4096];
        while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
    })
}

/// A peer that answers the handshake as a broker does, whatever the
/// client says, then lets `serve` take the connection.
fn broker_then(serve: impl Fn(&mut std::net::TcpStream) + Send + 'static) -> u16 {
    tuned_broker_then(131072, serve)
}

/// [`broker_then`], offering `frame_max`.
fn tuned_broker_then(frame_max: u32, serve: impl Fn(&mut std::net::TcpStream) + Send + 'static) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    // A small receive buffer (the connections inherit it): a client
    // sending a few MiB waits on what the peer reads.
    let small: libc::c_int = 4096;
    // SAFETY: a valid socket and option.
    unsafe {
        use std::os::fd::AsRawFd;
        let size = std::mem::size_of_val(&small) as libc::socklen_t;
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&small as *const libc::c_int).cast(),
            size,
        );
    }
    let port = listener.local_addr().unwrap().port();
    let tune = connection::Tune { channel_max: 0, frame_max, heartbeat: 60 };
    let opened = encode(&[
        AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Tune(tune))),
        AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {}))),
        AMQPFrame::Method(PUBLISH, AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {}))),
        AMQPFrame::Method(PUBLISH, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {}))),
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
            serve(&mut stream);
        }
    });
    port
}

/// What a scripted broker answers a queue's declaration (passive or
/// not) with, and a message published (its publish sequence number on
/// the channel, its body's size, whether it came whole or its first
/// frame did), besides the default answers (declared, opened); it may
/// also write on the stream itself.
struct Script {
    declare: Box<Declared>,
    message: Box<Published>,
}

type Declared = dyn Fn(&str, bool) -> Vec<AMQPFrame> + Send + Sync;
type Published = dyn Fn(&mut std::net::TcpStream, u64, usize, bool) -> Vec<AMQPFrame> + Send + Sync;

fn ack(tag: u64) -> AMQPFrame {
    AMQPFrame::Method(
        PUBLISH,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack { delivery_tag: tag, multiple: false })),
    )
}

fn close_channel(code: u16, text: &str) -> AMQPFrame {
    let close = channel::Close { reply_code: code, reply_text: text.into(), class_id: 0, method_id: 0 };
    AMQPFrame::Method(PUBLISH, AMQPClass::Channel(channel::AMQPMethod::Close(close)))
}

fn connection_frame(method: connection::AMQPMethod) -> AMQPFrame {
    AMQPFrame::Method(0, AMQPClass::Connection(method))
}

fn blocked(reason: &str) -> AMQPFrame {
    connection_frame(connection::AMQPMethod::Blocked(connection::Blocked { reason: reason.into() }))
}

fn unblocked() -> AMQPFrame {
    connection_frame(connection::AMQPMethod::Unblocked(connection::Unblocked {}))
}

/// A broker that answers as `script` says.
fn scripted_broker(script: Script) -> u16 {
    let script = std::sync::Arc::new(script);
    broker_then(move |stream| {
        let (mut inbox, mut buf) = (Vec::new(), vec![0u8; 1 << 16]);
        // Messages published since the channel was opened; the body
        // of the one under way: its size, bytes still to come.
        let (mut published, mut body) = (0u64, (0usize, 0usize));
        // The handshake answered the publishing channel's first opening.
        let (mut opened, mut selected) = (false, false);
        while let Ok(n @ 1..) = stream.read(&mut buf) {
            inbox.extend_from_slice(&buf[..n]);
            while let Ok((rest, frame)) = parse_frame(&inbox[..]) {
                let used = inbox.len() - rest.len();
                let answer = match frame {
                    AMQPFrame::Method(c, AMQPClass::Queue(queue::AMQPMethod::Declare(d))) => {
                        match (script.declare)(d.queue.as_str(), d.passive) {
                            answer if !answer.is_empty() => answer,
                            _ => {
                                let ok =
                                    queue::DeclareOk { queue: d.queue, message_count: 0, consumer_count: 0 };
                                vec![AMQPFrame::Method(c, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)))]
                            }
                        }
                    }
                    AMQPFrame::Method(c, AMQPClass::Exchange(exchange::AMQPMethod::Declare(_))) => {
                        let ok = exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {});
                        vec![AMQPFrame::Method(c, AMQPClass::Exchange(ok))]
                    }
                    AMQPFrame::Method(c, AMQPClass::Queue(queue::AMQPMethod::Bind(_))) => {
                        vec![AMQPFrame::Method(
                            c,
                            AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
                        )]
                    }
                    AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Open(_)))
                        if !std::mem::replace(&mut opened, true) =>
                    {
                        Vec::new()
                    }
                    AMQPFrame::Method(_, AMQPClass::Confirm(confirm::AMQPMethod::Select(_)))
                        if !std::mem::replace(&mut selected, true) =>
                    {
                        Vec::new()
                    }
                    AMQPFrame::Method(c, AMQPClass::Channel(channel::AMQPMethod::Open(_))) => {
                        vec![AMQPFrame::Method(
                            c,
                            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
                        )]
                    }
                    AMQPFrame::Method(c, AMQPClass::Channel(channel::AMQPMethod::Close(_))) => {
                        vec![AMQPFrame::Method(
                            c,
                            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                        )]
                    }
                    AMQPFrame::Method(c, AMQPClass::Confirm(confirm::AMQPMethod::Select(_))) => {
                        published = 0;
                        vec![AMQPFrame::Method(
                            c,
                            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
                        )]
                    }
                    AMQPFrame::Header(_, header) => {
                        published += 1;
                        body = (header.body_size as usize, header.body_size as usize);
                        match body.0 {
                            0 => (script.message)(stream, published, 0, true),
                            _ => Vec::new(),
                        }
                    }
                    AMQPFrame::Body(_, bytes) => {
                        let mut answer = Vec::new();
                        if body.1 == body.0 {
                            answer = (script.message)(stream, published, body.0, false);
                        }
                        body.1 = body.1.saturating_sub(bytes.len());
                        if body.1 == 0 {
                            answer.extend((script.message)(stream, published, body.0, true));
                        }
                        answer
                    }
                    _ => Vec::new(),
                };
                inbox.drain(..used);
                if stream.write_all(&encode(&answer)).is_err() {
                    return;
                }
            }
        }
    })
}

fn script(
    message: impl Fn(&mut std::net::TcpStream, u64, usize, bool) -> Vec<AMQPFrame> + Send + Sync + 'static,
) -> Script {
    Script { declare: Box::new(|_, _| Vec::new()), message: Box::new(message) }
}

/// A message for `queue` whose body takes about `payload` bytes.
fn message_for(queue: &str, payload: usize) -> String {
    sample_envelope(queue, 0, &format!("{{\"blob\": \"{}\"}}", "x".repeat(payload)))
}

fn in_a_while() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

/// A broker whose queues and exchanges all exist, and that blocks the
/// connection (an alarm) when a message is published, for `pause`,
/// then unblocks it and confirms the message.
fn alarmed_broker(pause: Duration) -> u16 {
    broker_then(move |stream| {
        let (mut inbox, mut buf, mut published) = (Vec::new(), [0u8; 65536], 0);
        while let Ok(n @ 1..) = stream.read(&mut buf) {
            inbox.extend_from_slice(&buf[..n]);
            while let Ok((rest, frame)) = parse_frame(&inbox[..]) {
                let used = inbox.len() - rest.len();
                let answer = match frame {
                    AMQPFrame::Method(c, AMQPClass::Queue(queue::AMQPMethod::Declare(d))) => {
                        let ok = queue::DeclareOk { queue: d.queue, message_count: 0, consumer_count: 0 };
                        vec![AMQPFrame::Method(c, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)))]
                    }
                    AMQPFrame::Method(c, AMQPClass::Exchange(exchange::AMQPMethod::Declare(_))) => {
                        let ok = exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {});
                        vec![AMQPFrame::Method(c, AMQPClass::Exchange(ok))]
                    }
                    AMQPFrame::Body(c, _) => {
                        published += 1;
                        let blocked = connection::Blocked { reason: "low on memory".into() };
                        let blocked = AMQPClass::Connection(connection::AMQPMethod::Blocked(blocked));
                        let _ = stream.write_all(&encode(&[AMQPFrame::Method(0, blocked)]));
                        std::thread::sleep(pause);
                        let unblocked = connection::AMQPMethod::Unblocked(connection::Unblocked {});
                        let ack = basic::Ack { delivery_tag: published, multiple: true };
                        vec![
                            AMQPFrame::Method(0, AMQPClass::Connection(unblocked)),
                            AMQPFrame::Method(c, AMQPClass::Basic(basic::AMQPMethod::Ack(ack))),
                        ]
                    }
                    _ => Vec::new(),
                };
                inbox.drain(..used);
                if stream.write_all(&encode(&answer)).is_err() {
                    return;
                }
            }
        }
    })
}

/// A wait on poll(2) that notes what it is told of pauses.
#[derive(Default)]
struct Noting(Vec<Option<String>>);

impl Wait for Noting {
    fn wait(
        &mut self,
        socket: Option<(std::os::fd::RawFd, crate::link::Interest)>,
        deadline: Instant,
    ) -> Result<(), crate::link::Interrupted> {
        Poll.wait(socket, deadline)
    }

    fn paused(&mut self, why: Option<&str>) {
        self.0.push(why.map(str::to_string));
    }
}

fn one_message() -> KeyBatch {
    KeyBatch { key: "q".into(), messages: vec![sample_envelope("q", 0, "{}")] }
}

#[test]
fn a_channel_that_nacked_is_opened_afresh() {
    // RabbitMQ 3.10 nacks every publish to a quorum queue, for good, on
    // a channel that saw the queue's leader die: once nacked, the
    // channel is closed and opened again, on the same connection.
    // The first channel nacks every message; a channel opened since
    // confirms them (its sequence starts again at 1).
    let nacked = std::sync::atomic::AtomicBool::new(false);
    let port = scripted_broker(script(move |_, seq, _, whole| {
        use std::sync::atomic::Ordering::SeqCst;
        if !whole {
            return Vec::new();
        }
        if seq == 1 && nacked.swap(true, SeqCst) {
            return vec![ack(seq)];
        }
        let nack = basic::Nack { delivery_tag: seq, multiple: false, requeue: false };
        vec![AMQPFrame::Method(PUBLISH, AMQPClass::Basic(basic::AMQPMethod::Nack(nack)))]
    }));
    let mut sink = sink(&format!("amqp://127.0.0.1:{port}//"));
    sink.connect(&mut Poll).unwrap();
    let first = sink.push(&[one_message()], &mut Poll, in_a_while());
    assert!(first.failure.is_none(), "{:?}", first.failure);
    assert!(
        matches!(first.deliveries[..], [Delivery::Refused(Condition::Nacked, _)]),
        "{:?}",
        first.deliveries
    );
    let second = sink.push(&[one_message()], &mut Poll, in_a_while());
    assert!(second.failure.is_none(), "{:?}", second.failure);
    assert_eq!(second.deliveries, [Delivery::Delivered]);
    assert!(sink.is_connected());
}

#[test]
fn an_alarm_pauses_a_push_on_the_same_connection() {
    // Blocked for longer than the timeout (1 s): the push waits, told
    // of the pause, and its message is confirmed once it lifts.
    let mut sink = sink(&format!("amqp://127.0.0.1:{}//", alarmed_broker(Duration::from_millis(1500))));
    sink.connect(&mut Poll).unwrap();
    let mut waiter = Noting::default();
    let started = Instant::now();
    let pushed = sink.push(&[one_message()], &mut waiter, in_a_while());
    assert_eq!((pushed.deliveries, pushed.failure), (vec![Delivery::Delivered], None));
    assert!(started.elapsed() >= Duration::from_millis(1500));
    assert!(sink.is_connected());
    let [Some(paused), None] = &waiter.0[..] else { panic!("{:?}", waiter.0) };
    assert!(paused.starts_with("RabbitMQ blocked the connection: low on memory"), "{paused}");
    // A pause past the push's pause deadline is the broker's fault.
    let url = format!("amqp://127.0.0.1:{}//", alarmed_broker(Duration::from_secs(5)));
    // (A timeout of 2 s: the alarm comes within it on a loaded machine.)
    let mut sink = sink_within(&url, Duration::from_secs(2));
    sink.connect(&mut Poll).unwrap();
    let started = Instant::now();
    let pushed = sink.push(&[one_message()], &mut Poll, started + Duration::from_secs(3));
    assert_eq!(pushed.deliveries, [Delivery::Unsent]);
    let failure = pushed.failure.unwrap();
    assert_eq!(failure.reason(), Reason::Refused);
    assert!(failure.to_string().contains("for longer than a push may wait"), "{failure}");
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(3) && took < Duration::from_millis(4500), "{took:?}");
}

#[test]
fn no_alarm_extends_a_pause_past_its_deadline() {
    // Blocked, unblocked, blocked again, every 300 ms, for 10 s: each
    // block used to start the pause afresh, each unblock a fresh
    // timeout. The push ends by its pause deadline (1.5 s) and one
    // timeout (1 s) at the latest.
    let port = scripted_broker(script(|stream, _, _, whole| {
        if !whole {
            return Vec::new();
        }
        let stop = Instant::now() + Duration::from_secs(10);
        while Instant::now() < stop {
            for frame in [blocked("low on memory"), unblocked()] {
                if stream.write_all(&encode(&[frame])).is_err() {
                    return Vec::new();
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        }
        Vec::new()
    }));
    let mut sink = sink(&format!("amqp://127.0.0.1:{port}//"));
    sink.connect(&mut Poll).unwrap();
    let started = Instant::now();
    let pushed = sink.push(&[one_message()], &mut Noting::default(), started + Duration::from_millis(1500));
    let took = started.elapsed();
    assert_eq!(pushed.deliveries, [Delivery::Unsent]);
    assert!(took >= Duration::from_millis(1500) && took < Duration::from_millis(2800), "{took:?}");
    let failure = pushed.failure.unwrap();
    assert!(matches!(failure, SinkError::Refused(Condition::Blocked, _) | SinkError::Timeout), "{failure}");
}

/// A broker that, at the first frame of a message's body, blocks the
/// connection and stops reading to send `n` copies of `frame`; then
/// unblocks it, reads on, and confirms the message.
fn flooding_broker(frame: AMQPFrame, n: usize) -> u16 {
    scripted_broker(script(move |stream, seq, _, whole| {
        if whole {
            return vec![ack(seq)];
        }
        let mut flood = encode(&[blocked("low on memory")]);
        flood.extend(encode(&vec![frame.clone(); n]));
        match stream.write_all(&flood) {
            Ok(()) => vec![unblocked()],
            Err(_) => Vec::new(),
        }
    }))
}

/// One message larger than what the sockets' buffers hold between
/// the two ends: sending it waits on the peer.
fn large_batch() -> KeyBatch {
    KeyBatch { key: "q".into(), messages: vec![message_for("q", 8 << 20)] }
}

#[test]
fn heartbeats_a_blocked_peer_floods_are_dropped() {
    // Kept, 100 000 heartbeats would take more than the round trip
    // may leave queued (its own size and some).
    // (A timeout long enough for 8 MiB in a test build.)
    let url = format!("amqp://127.0.0.1:{}//", flooding_broker(AMQPFrame::Heartbeat, 100_000));
    let mut sink = sink_within(&url, Duration::from_secs(20));
    sink.connect(&mut Poll).unwrap();
    let mut waiter = Noting::default();
    let pushed = sink.push(&[large_batch()], &mut waiter, in_a_while());
    assert_eq!((pushed.deliveries, pushed.failure), (vec![Delivery::Delivered], None));
    assert_eq!(waiter.0.len(), 2, "{:?}", waiter.0);
}

#[test]
fn what_a_peer_sends_while_a_round_trip_is_sent_is_bounded() {
    // Frames that are no answer to anything, while it does not read:
    // beyond what the round trip may leave queued, a protocol error
    // (a broker fault), at once rather than at the pause's deadline.
    let qos_ok = AMQPFrame::Method(PUBLISH, AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})));
    let url = format!("amqp://127.0.0.1:{}//", flooding_broker(qos_ok, 100_000));
    let mut sink = sink_within(&url, Duration::from_secs(20));
    sink.connect(&mut Poll).unwrap();
    let started = Instant::now();
    let pushed = sink.push(&[large_batch()], &mut Noting::default(), in_a_while());
    assert_eq!(pushed.deliveries, [Delivery::Unsent]);
    let failure = pushed.failure.unwrap();
    assert_eq!(failure.reason(), Reason::ConnectionLost, "{failure}");
    assert!(failure.to_string().contains("while a round trip of"), "{failure}");
    assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
}

/// A broker that closes the publishing channel over the first message
/// of each channel, saying `why` of its body's size (then confirms).
fn closing_broker(why: fn(usize) -> (u16, String)) -> u16 {
    scripted_broker(script(move |_, seq, size, whole| match (whole, seq) {
        (false, _) => Vec::new(),
        (true, 1) => {
            let (code, text) = why(size);
            vec![close_channel(code, &text)]
        }
        (true, seq) => vec![ack(seq)],
    }))
}

#[test]
fn a_size_limit_in_words_of_no_broker_fails_no_message() {
    let cases: [fn(usize) -> (u16, String); 4] = [
        // Another reply code.
        |size| (541, format!("INTERNAL_ERROR - message size {size} is larger than configured max size 100")),
        // Not RabbitMQ's words.
        |_| (406, "PRECONDITION_FAILED - larger than life; max size 100".into()),
        // A size no message had.
        |size| (406, format!("PRECONDITION_FAILED - message size {} is larger than max size 5000", size + 1)),
        // A limit below any broker's.
        |size| {
            (406, format!("PRECONDITION_FAILED - message size {size} is larger than configured max size 10"))
        },
    ];
    for why in cases {
        let mut sink = sink(&format!("amqp://127.0.0.1:{}//", closing_broker(why)));
        sink.connect(&mut Poll).unwrap();
        let pushed = sink.push(&[one_message()], &mut Poll, in_a_while());
        // The broker's fault: no message failed, none learnt too large.
        assert_eq!(pushed.deliveries, [Delivery::Unsent], "{:?}", why(0));
        let failure = pushed.failure.unwrap();
        assert!(matches!(failure, SinkError::Refused(Condition::ChannelClosed, _)), "{failure}");
        sink.connect(&mut Poll).unwrap();
        let pushed = sink.push(&[one_message()], &mut Poll, in_a_while());
        assert!(!matches!(pushed.deliveries[0], Delivery::Rejected(_)), "{:?}", pushed.deliveries);
    }
}

#[test]
fn rabbitmqs_own_size_limit_fails_the_larger_messages_alone() {
    let port = scripted_broker(script(|_, seq, size, whole| match whole {
        false => Vec::new(),
        true if size > 8192 => vec![close_channel(
            406,
            &format!("PRECONDITION_FAILED - message size {size} is larger than configured max size 8192"),
        )],
        true => vec![ack(seq)],
    }));
    let mut sink = sink(&format!("amqp://127.0.0.1:{port}//"));
    sink.connect(&mut Poll).unwrap();
    let large = KeyBatch { key: "q".into(), messages: vec![message_for("q", 20_000)] };
    let pushed = sink.push(&[large], &mut Poll, in_a_while());
    let [Delivery::Rejected(why)] = &pushed.deliveries[..] else { panic!("{:?}", pushed.deliveries) };
    assert!(why.contains("larger than configured max size 8192"), "{why}");
    assert_eq!(pushed.failure, None);
    // The limit learnt fails larger messages before they are sent, and
    // only those.
    let pushed = sink.push(
        &[KeyBatch { key: "q".into(), messages: vec![message_for("q", 20_000), message_for("q", 10)] }],
        &mut Poll,
        in_a_while(),
    );
    assert!(matches!(&pushed.deliveries[..], [Delivery::Rejected(_), Delivery::Delivered]), "{:?}", pushed);
}

/// A broker whose queue `home` is on a node that is down (404 to a
/// passive and an active declaration alike), or (`code` 403) that the
/// user may not declare; other queues exist.
fn broker_declaring(home: &'static str, code: u16) -> u16 {
    scripted_broker(Script {
        declare: Box::new(move |queue, passive| {
            match (queue == home, passive, code) {
            (false, ..) => Vec::new(),
            (true, true, _) | (true, false, 404) => vec![close_channel(
                404,
                &format!("NOT_FOUND - home node 'rabbit@down' of durable queue '{home}' in vhost '/' is down or inaccessible"),
            )],
            (true, false, _) => vec![close_channel(code, &format!("ACCESS_REFUSED - access to queue '{home}' in vhost '/' refused for user 'guest'"))],
        }
        }),
        message: Box::new(|_, seq, _, whole| if whole { vec![ack(seq)] } else { Vec::new() }),
    })
}

#[test]
fn a_queue_whose_node_is_down_is_the_brokers_fault() {
    let mut sink = sink(&format!("amqp://127.0.0.1:{}//", broker_declaring("down", 404)));
    sink.connect(&mut Poll).unwrap();
    let batches = [
        KeyBatch { key: "down".into(), messages: vec![message_for("down", 10)] },
        KeyBatch { key: "up".into(), messages: vec![message_for("up", 10)] },
    ];
    let pushed = sink.push(&batches, &mut Poll, in_a_while());
    let [Delivery::Refused(Condition::ChannelClosed, why), Delivery::Delivered] = &pushed.deliveries[..]
    else {
        panic!("{:?}", pushed.deliveries)
    };
    assert!(why.contains("404 NOT_FOUND - home node"), "{why}");
    // A permission is the destination's own.
    let mut sink = self::sink(&format!("amqp://127.0.0.1:{}//", broker_declaring("mine", 403)));
    sink.connect(&mut Poll).unwrap();
    let batches = [KeyBatch { key: "mine".into(), messages: vec![message_for("mine", 10)] }];
    let pushed = sink.push(&batches, &mut Poll, in_a_while());
    let [Delivery::Rejected(why)] = &pushed.deliveries[..] else { panic!("{:?}", pushed.deliveries) };
    assert!(why.contains("403 ACCESS_REFUSED"), "{why}");
}

#[test]
fn a_frame_max_below_amqps_minimum_is_refused() {
    let port = tuned_broker_then(16, |stream| {
        let mut buf = [0u8; 4096];
        while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
    });
    let err = sink(&format!("amqp://127.0.0.1:{port}//")).connect(&mut Poll).unwrap_err();
    assert_eq!(err.reason(), Reason::ConnectFailed, "{err}");
    assert!(err.to_string().contains("frame_max 16, below AMQP's minimum of 4096"), "{err}");
}

#[test]
fn a_brokers_words_forge_no_log_line() {
    let port = scripted_broker(script(|stream, _, _, whole| {
        if whole {
            let _ = stream.write_all(&encode(&[blocked("low\nLOG:  forged\u{1b}[2J"), unblocked()]));
            vec![close_channel(541, "INTERNAL_ERROR\n2026-12-01 00:00:00 UTC LOG:  forged")]
        } else {
            Vec::new()
        }
    }));
    let mut sink = sink(&format!("amqp://127.0.0.1:{port}//"));
    sink.connect(&mut Poll).unwrap();
    let mut waiter = Noting::default();
    let pushed = sink.push(&[one_message()], &mut waiter, in_a_while());
    let failure = pushed.failure.unwrap().to_string();
    assert!(failure.contains("INTERNAL_ERROR\\n2026"), "{failure}");
    let noted: String = waiter.0.iter().flatten().cloned().collect();
    assert!(noted.contains("low\\nLOG:  forged\\u{1b}[2J"), "{noted}");
    assert!(!failure.chars().chain(noted.chars()).any(char::is_control), "{failure} {noted}");
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
