//! One connection to a Kafka broker: size-prefixed requests and responses
//! (kafka-protocol encodes and decodes them), matched by correlation id,
//! over our own [`Link`], so every wait is the caller's (the latch inside
//! PostgreSQL). The versions spoken are agreed at connect (ApiVersions),
//! and SASL is done there too.

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use kafka_protocol::messages::{
    ApiKey, ApiVersionsRequest, ApiVersionsResponse, RequestHeader, ResponseHeader, SaslAuthenticateRequest,
    SaslHandshakeRequest,
};
use kafka_protocol::protocol::{Decodable, Encodable, Request, StrBytes};

use super::sasl::{self, Mechanism, Scram};
use crate::link::{Link, Wait};
use crate::sink::errors::{broker_text, scrub};
use crate::sink::SinkError;

/// The largest response taken: a metadata response of a large cluster
/// fits many times over; a peer announcing more is not a broker to trust,
/// and nothing it sends is buffered beyond this.
pub const MAX_RESPONSE: usize = 16 * 1024 * 1024;

/// The client id brokers log and quota by.
const CLIENT_ID: &str = "outbox_dispatch";

/// The versions of each API this client speaks; the broker's range is
/// intersected with it at connect and the highest common one used.
#[derive(Debug, Clone, Copy)]
struct Spoken {
    api: ApiKey,
    min: i16,
    max: i16,
}

const SPOKEN: [Spoken; 5] = [
    Spoken { api: ApiKey::Produce, min: 3, max: 9 },
    Spoken { api: ApiKey::Metadata, min: 1, max: 12 },
    Spoken { api: ApiKey::InitProducerId, min: 0, max: 4 },
    Spoken { api: ApiKey::SaslHandshake, min: 1, max: 1 },
    Spoken { api: ApiKey::SaslAuthenticate, min: 0, max: 1 },
];

/// The versions agreed with one broker, by [`SPOKEN`]'s order; `None`
/// where the broker offers none this client speaks.
#[derive(Debug, Clone, Copy, Default)]
pub struct Versions([Option<i16>; SPOKEN.len()]);

impl Versions {
    /// What this client and a broker offering `offered` (ApiVersions'
    /// answer: key, min, max) agree on.
    pub fn agree(offered: &[(i16, i16, i16)]) -> Versions {
        let mut agreed = Versions::default();
        for (slot, spoken) in SPOKEN.iter().enumerate() {
            agreed.0[slot] =
                offered.iter().find(|(key, ..)| *key == spoken.api as i16).and_then(|(_, min, max)| {
                    let (low, high) = ((*min).max(spoken.min), (*max).min(spoken.max));
                    (low <= high).then_some(high)
                });
        }
        agreed
    }

    /// The version of `api` to speak, or why there is none.
    pub fn of(&self, api: ApiKey) -> Result<i16, SinkError> {
        let slot = SPOKEN.iter().position(|s| s.api == api).expect("an API this client speaks");
        self.0[slot].ok_or_else(|| {
            let spoken = SPOKEN[slot];
            SinkError::Connect(format!(
                "the broker speaks no version of {api:?} this client does ({} to {})",
                spoken.min, spoken.max
            ))
        })
    }
}

/// A connection to one broker.
pub struct Conn {
    link: Link,
    /// Bytes received and not yet taken: at most one response and a read.
    inbox: Vec<u8>,
    next_correlation: i32,
    pub versions: Versions,
    /// The broker asked for no request before this (an answer's
    /// `throttle_time_ms`: a quota; KIP-219).
    quiet_until: Option<Instant>,
    /// When the connection is to be replaced: most of the way through the
    /// SASL session the broker granted (SaslAuthenticate's
    /// `session_lifetime_ms`, KIP-368), after which it closes it.
    replace_at: Option<Instant>,
}

/// How far into a SASL session's lifetime its connection is replaced, in
/// hundredths: Kafka's own client re-authenticates between 85 and 95.
const REPLACED_AT: u32 = 85;

impl Conn {
    /// Connects to `host:port` (TLS with `tls`) and agrees the versions,
    /// all by `deadline`.
    pub fn open(
        host: &str,
        port: u16,
        tls: Option<std::sync::Arc<rustls::ClientConfig>>,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<Conn, SinkError> {
        let link =
            Link::connect(host, port, tls, waiter, deadline).map_err(|e| SinkError::from_link(e, false))?;
        let mut conn = Conn {
            link,
            inbox: Vec::new(),
            next_correlation: 0,
            versions: Versions::default(),
            quiet_until: None,
            replace_at: None,
        };
        // Version 0 of ApiVersions: every broker since Kafka 0.10 answers it.
        let offered = conn.call(&ApiVersionsRequest::default(), 0, waiter, deadline).map_err(connecting)?;
        if let Some(error) = failed(offered.error_code) {
            return Err(SinkError::Connect(format!("the broker refused ApiVersions: {error}")));
        }
        conn.versions = Versions::agree(&offered_ranges(&offered));
        conn.versions.of(ApiKey::Produce)?;
        conn.versions.of(ApiKey::Metadata)?;
        Ok(conn)
    }

    /// Authenticates as `user` with `mechanism` (SaslHandshake, then
    /// SaslAuthenticate: KIP-152), by `deadline`. What the broker says is
    /// quoted with the password taken out first.
    pub fn authenticate(
        &mut self,
        mechanism: Mechanism,
        user: &str,
        password: &str,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), SinkError> {
        let handshake =
            SaslHandshakeRequest::default().with_mechanism(StrBytes::from_string(mechanism.name().into()));
        let version = self.versions.of(ApiKey::SaslHandshake)?;
        let answer = self.call(&handshake, version, waiter, deadline).map_err(connecting)?;
        if let Some(error) = failed(answer.error_code) {
            let offered: Vec<&str> = answer.mechanisms.iter().map(|m| m.as_str()).collect();
            return Err(SinkError::Connect(broker_text(&format!(
                "the broker does not take SASL {} ({error}); it offers {}",
                mechanism.name(),
                offered.join(", ")
            ))));
        }
        let mut step = |conn: &mut Conn, bytes| conn.sasl_step(bytes, password, waiter, deadline);
        match mechanism {
            Mechanism::Plain => {
                step(self, sasl::plain(user, password))?;
            }
            Mechanism::ScramSha256 | Mechanism::ScramSha512 => {
                let mut scram = Scram::new(mechanism, user, password, sasl::fresh_nonce());
                let server_first = step(self, scram.first())?;
                let reply = scram.reply(&server_first).map_err(SinkError::Connect)?;
                let server_final = step(self, reply)?;
                scram.verify(&server_final).map_err(SinkError::Connect)?;
            }
        }
        Ok(())
    }

    /// One SaslAuthenticate round trip: the broker's answer, or its refusal
    /// (`password` taken out of what it says).
    fn sasl_step(
        &mut self,
        bytes: Vec<u8>,
        password: &str,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<Bytes, SinkError> {
        let version = self.versions.of(ApiKey::SaslAuthenticate)?;
        let request = SaslAuthenticateRequest::default().with_auth_bytes(Bytes::from(bytes));
        let answer = self.call(&request, version, waiter, deadline).map_err(connecting)?;
        match failed(answer.error_code) {
            None => {
                // A lifetime too long to count from now is none.
                if let Ok(ms @ 1..) = u64::try_from(answer.session_lifetime_ms) {
                    self.replace_at = Duration::from_millis(ms)
                        .checked_mul(REPLACED_AT)
                        .and_then(|d| Instant::now().checked_add(d / 100));
                }
                Ok(answer.auth_bytes)
            }
            Some(error) => {
                let message = answer.error_message.as_ref().map_or("", |m| m.as_str());
                let message = broker_text(&scrub(message, &[Some(password)]));
                Err(SinkError::Connect(format!("SASL authentication failed: {error}: {message}")))
            }
        }
    }

    /// Whether the broker's SASL session on this connection is near its
    /// end: a new connection authenticates again before the broker closes
    /// this one.
    pub fn expiring(&self) -> bool {
        self.replace_at.is_some_and(|at| Instant::now() >= at)
    }

    /// Sends `request` (as `version`) and receives its response, by
    /// `deadline`.
    pub fn call<R: Request>(
        &mut self,
        request: &R,
        version: i16,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<R::Response, SinkError> {
        let correlation = self.send(request, version, waiter, deadline)?;
        self.receive::<R>(correlation, version, waiter, deadline)
    }

    /// Sends `request`; returns the correlation id its response will carry.
    pub fn send<R: Request>(
        &mut self,
        request: &R,
        version: i16,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<i32, SinkError> {
        let correlation = self.next_correlation;
        self.next_correlation = self.next_correlation.wrapping_add(1);
        let frame = encode(request, version, correlation).map_err(SinkError::InvalidConfig)?;
        self.link.send(&frame, waiter, deadline).map_err(|e| SinkError::from_link(e, true))?;
        Ok(correlation)
    }

    /// The broker throttles this connection for `ms` from now (an answer's
    /// `throttle_time_ms`).
    pub fn throttled(&mut self, ms: i32) {
        if ms > 0 {
            self.quiet_until = Some(Instant::now() + Duration::from_millis(ms as u64));
        }
    }

    /// Until when the broker asked for quiet on this connection (an
    /// answer's `throttle_time_ms`), if it still does: Kafka's clients send
    /// nothing to a broker meanwhile.
    pub fn throttled_until(&self) -> Option<Instant> {
        self.quiet_until.filter(|until| Instant::now() < *until)
    }

    /// Receives the response to the request sent as `correlation`: the
    /// next one, as a broker answers a connection's requests in order.
    pub fn receive<R: Request>(
        &mut self,
        correlation: i32,
        version: i16,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<R::Response, SinkError> {
        let frame = self.frame(waiter, deadline)?;
        let api = ApiKey::try_from(R::KEY).expect("a known API");
        decode::<R>(frame, api, version, correlation).map_err(not_kafka)
    }

    /// The next size-prefixed frame, whole; at the deadline, what has come
    /// already is still taken.
    fn frame(&mut self, waiter: &mut dyn Wait, deadline: Instant) -> Result<Bytes, SinkError> {
        loop {
            if let Some(frame) = take_frame(&mut self.inbox).map_err(not_kafka)? {
                return Ok(frame);
            }
            if Instant::now() >= deadline {
                let read = self.link.read_now(&mut self.inbox).map_err(|e| SinkError::from_link(e, true))?;
                if read == 0 {
                    return Err(SinkError::Timeout);
                }
                continue;
            }
            waiter.check().map_err(|_| SinkError::Interrupted)?;
            self.link
                .read_some(&mut self.inbox, waiter, deadline)
                .map_err(|e| SinkError::from_link(e, true))?;
        }
    }
}

/// A request as it goes on the wire: its size, its header, itself.
pub fn encode<R: Request>(request: &R, version: i16, correlation: i32) -> Result<Vec<u8>, String> {
    let api = ApiKey::try_from(R::KEY).expect("a known API");
    let header = RequestHeader::default()
        .with_request_api_key(R::KEY)
        .with_request_api_version(version)
        .with_correlation_id(correlation)
        .with_client_id(Some(StrBytes::from_static_str(CLIENT_ID)));
    let mut body = BytesMut::new();
    header
        .encode(&mut body, api.request_header_version(version))
        .and_then(|()| request.encode(&mut body, version))
        .map_err(|e| format!("cannot encode a Kafka {api:?} request: {e}"))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as i32).to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Takes one whole frame off the front of `inbox`, if it has come.
fn take_frame(inbox: &mut Vec<u8>) -> Result<Option<Bytes>, String> {
    let Some(size) = inbox.get(..4) else { return Ok(None) };
    let size = i32::from_be_bytes(size.try_into().expect("four bytes"));
    if !(4..=MAX_RESPONSE as i32).contains(&size) {
        return Err(format!("a response of {size} bytes (at most {MAX_RESPONSE} are taken)"));
    }
    let end = 4 + size as usize;
    if inbox.len() < end {
        return Ok(None);
    }
    let frame = Bytes::copy_from_slice(&inbox[4..end]);
    inbox.drain(..end);
    Ok(Some(frame))
}

/// The response to `api` (as `version`) in `frame`, which must answer
/// `correlation`.
fn decode<R: Request>(
    mut frame: Bytes,
    api: ApiKey,
    version: i16,
    correlation: i32,
) -> Result<R::Response, String> {
    let header = ResponseHeader::decode(&mut frame, api.response_header_version(version))
        .map_err(|e| format!("a response header that does not decode ({e})"))?;
    if header.correlation_id != correlation {
        return Err(format!(
            "a response to request {} where {correlation} was awaited",
            header.correlation_id
        ));
    }
    R::Response::decode(&mut frame, version)
        .map_err(|e| format!("a {api:?} response that does not decode ({e})"))
}

fn offered_ranges(answer: &ApiVersionsResponse) -> Vec<(i16, i16, i16)> {
    answer.api_keys.iter().map(|k| (k.api_key, k.min_version, k.max_version)).collect()
}

/// A peer whose bytes are not a Kafka response to what was asked: nothing
/// it said counts, and the connection goes.
fn not_kafka(what: String) -> SinkError {
    SinkError::ConnectionLost(format!("Kafka protocol error: {}", broker_text(&what)))
}

/// A failure while connecting is a failure to connect.
fn connecting(error: SinkError) -> SinkError {
    match error {
        SinkError::ConnectionLost(e) => SinkError::Connect(e),
        other => other,
    }
}

/// Kafka's name of an error code (`NOT_LEADER_OR_FOLLOWER`), as its
/// documentation writes them; `None` for no error.
pub fn failed(code: i16) -> Option<String> {
    let error = kafka_protocol::ResponseError::try_from_code(code)?;
    if let kafka_protocol::ResponseError::Unknown(code) = error {
        return Some(format!("UNKNOWN_ERROR_CODE_{code}"));
    }
    let camel = format!("{error:?}");
    let mut name = String::with_capacity(camel.len() + 8);
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    Some(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kafka_protocol::messages::MetadataRequest;

    #[test]
    fn versions_are_the_highest_both_speak() {
        let agreed = Versions::agree(&[(0, 0, 11), (3, 0, 7), (22, 0, 1)]);
        assert_eq!(agreed.of(ApiKey::Produce).unwrap(), 9);
        assert_eq!(agreed.of(ApiKey::Metadata).unwrap(), 7);
        assert_eq!(agreed.of(ApiKey::InitProducerId).unwrap(), 1);
        let none = agreed.of(ApiKey::SaslHandshake).unwrap_err().to_string();
        assert!(none.contains("SaslHandshake") && none.contains("1 to 1"), "{none}");
        // An old broker's Produce (0 to 2) has nothing in common.
        assert!(Versions::agree(&[(0, 0, 2)]).of(ApiKey::Produce).is_err());
    }

    #[test]
    fn error_codes_are_named_as_kafka_documents_them() {
        assert_eq!(failed(0), None);
        assert_eq!(failed(6).unwrap(), "NOT_LEADER_OR_FOLLOWER");
        assert_eq!(failed(10).unwrap(), "MESSAGE_TOO_LARGE");
        assert_eq!(failed(29).unwrap(), "TOPIC_AUTHORIZATION_FAILED");
        assert_eq!(failed(-1).unwrap(), "UNKNOWN_SERVER_ERROR");
        assert_eq!(failed(31000).unwrap(), "UNKNOWN_ERROR_CODE_31000");
    }

    /// A response frame: size, correlation id (header v0), body.
    fn frame(correlation: i32, body: &[u8]) -> Vec<u8> {
        let mut frame = ((4 + body.len()) as i32).to_be_bytes().to_vec();
        frame.extend_from_slice(&correlation.to_be_bytes());
        frame.extend_from_slice(body);
        frame
    }

    #[test]
    fn frames_are_taken_whole_and_bounded() {
        let mut inbox = frame(7, b"abc");
        inbox.extend_from_slice(&[0, 0]);
        let taken = take_frame(&mut inbox).unwrap().unwrap();
        assert_eq!(&taken[..], &[0, 0, 0, 7, b'a', b'b', b'c']);
        assert_eq!(inbox, [0, 0]);
        assert_eq!(take_frame(&mut inbox).unwrap(), None);
        for size in [i32::MAX, -1, 0, 3, MAX_RESPONSE as i32 + 1] {
            let mut garbage = size.to_be_bytes().to_vec();
            assert!(take_frame(&mut garbage).is_err(), "{size}");
        }
    }

    #[test]
    fn an_impossible_array_count_is_an_error() {
        // Metadata v1: throttle-free; brokers is the first field, here
        // claiming two billion entries in a few bytes. The patched codec
        // refuses it before sizing anything by it.
        let mut body = i32::MAX.to_be_bytes().to_vec();
        body.extend_from_slice(&[0; 8]);
        let raw = Bytes::from(frame(1, &body)[4..].to_vec());
        let error = decode::<MetadataRequest>(raw, ApiKey::Metadata, 1, 1).unwrap_err();
        assert!(error.contains("exceeds"), "{error}");
        let wrong = Bytes::from(frame(2, &[])[4..].to_vec());
        let error = decode::<MetadataRequest>(wrong, ApiKey::Metadata, 1, 1).unwrap_err();
        assert!(error.contains("request 2 where 1"), "{error}");
    }

    #[test]
    fn requests_carry_their_size_and_header() {
        let request = MetadataRequest::default().with_topics(Some(Vec::new()));
        let frame = encode(&request, 1, 42).unwrap();
        let size = i32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(size, frame.len() - 4);
        assert_eq!(&frame[4..6], &(ApiKey::Metadata as i16).to_be_bytes());
        assert_eq!(&frame[6..8], &1i16.to_be_bytes());
        assert_eq!(&frame[8..12], &42i32.to_be_bytes());
    }
}
