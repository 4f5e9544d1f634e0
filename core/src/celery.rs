//! An outbox event as a Celery task message: protocol v2 inside the kombu
//! Redis transport's JSON envelope.
//!
//! A stock Celery worker crashes or loops on a message that lacks
//! `properties`, `delivery_tag`, `delivery_info.exchange`/`routing_key`,
//! `headers.id`, a three-element body or valid base64, so every message this
//! module emits carries all of them; the unit tests decode and check each one.

use std::borrow::Cow;
use std::fmt::{self, Write};

use serde_json::{Map, Value};
use uuid::Uuid;

/// Celery's default `argsrepr`/`kwargsrepr` limit (`saferepr` maxsize).
const REPR_MAX_BYTES: usize = 1024;

/// Headers the protocol owns. An event's own `headers` cannot override them:
/// a user header called `id` would otherwise change the task id.
const PROTOCOL_HEADERS: &[&str] = &[
    "lang",
    "task",
    "id",
    "root_id",
    "parent_id",
    "group",
    "group_index",
    "shadow",
    "eta",
    "expires",
    "retries",
    "timelimit",
    "argsrepr",
    "kwargsrepr",
    "origin",
    "ignore_result",
    "replaced_task_nesting",
    "stamped_headers",
    "stamps",
    "outbox_event_type",
    "outbox_created_at",
    "outbox_report_to",
    "outbox_send",
    // Set by outbox_dispatch.inbox.once() on the request of a run it skipped.
    "outbox_duplicate",
];

/// Protocol headers an event may set: a task enqueued from inside a running
/// task chains to it (`outbox_dispatch.enqueue` fills them in).
const LINEAGE_HEADERS: &[&str] = &["root_id", "parent_id"];

/// What the encoder needs of one claimed event. Borrowed: the worker keeps
/// the rows it claimed and encodes them without copying.
#[derive(Debug, Clone, Copy)]
pub struct TaskMessage<'a> {
    pub id: Uuid,
    pub task: &'a str,
    pub queue: &'a str,
    pub priority: u8,
    pub event_type: &'a str,
    /// `created_at` as PostgreSQL prints it (ISO 8601).
    pub created_at: &'a str,
    /// The payload's JSON text.
    pub payload: &'a str,
    /// Positional arguments, a JSON array's text, when the event has both
    /// kinds: the payload (an object) is then the keyword arguments.
    pub args: Option<&'a str>,
    /// The event's own headers, a JSON object's text, if any.
    pub headers: Option<&'a str>,
    /// When the task expires (ISO 8601), Celery's `expires`.
    pub expires: Option<&'a str>,
    /// The Redis list a worker running `outbox_dispatch.celery` reports the
    /// task's outcome to.
    pub report_to: &'a str,
    /// This send of the event (a fresh value per claim), which the report
    /// names: a report is taken only for the send it answers.
    pub send: Uuid,
}

/// Why one event cannot become a message. Never the broker's fault: the
/// worker dead-letters such an event at once instead of retrying it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodeError {
    PayloadNotJson(String),
    HeadersNotObject,
    HeadersNotJson(String),
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EncodeError::PayloadNotJson(e) => write!(f, "payload is not valid JSON: {e}"),
            EncodeError::HeadersNotObject => write!(f, "headers must be a JSON object"),
            EncodeError::HeadersNotJson(e) => write!(f, "headers are not valid JSON: {e}"),
        }
    }
}

impl std::error::Error for EncodeError {}

/// Appends the envelope of `msg` to `out`. `delivery_tag` must be fresh for
/// every push (kombu keys its unacked hash by it); `origin` names the sender.
pub fn encode(
    msg: &TaskMessage<'_>,
    origin: &str,
    delivery_tag: Uuid,
    out: &mut String,
) -> Result<(), EncodeError> {
    let (args, kwargs) = split_payload(msg.payload, msg.args)?;
    let (extra, lineage) = extra_headers(msg.headers)?;

    let body =
        format!("[{args},{kwargs},{{\"callbacks\":null,\"errbacks\":null,\"chain\":null,\"chord\":null}}]");
    let id = msg.id.hyphenated();

    out.push_str("{\"body\":\"");
    base64_encode(body.as_bytes(), out);
    out.push_str("\",\"content-encoding\":\"utf-8\",\"content-type\":\"application/json\",\"headers\":{");
    // The event's own headers come first so that, should a consumer keep the
    // last of duplicate keys, ours would still win; duplicates are dropped
    // anyway in `extra_headers`.
    for (key, value) in &extra {
        push_json_str(out, key);
        out.push(':');
        out.push_str(&value.to_string());
        out.push(',');
    }
    out.push_str("\"lang\":\"py\",\"task\":");
    push_json_str(out, msg.task);
    let _ = write!(out, ",\"id\":\"{id}\",\"root_id\":");
    match &lineage.root_id {
        Some(root) => push_json_str(out, root),
        None => {
            let _ = write!(out, "\"{id}\"");
        }
    }
    out.push_str(",\"parent_id\":");
    push_optional_json_str(out, lineage.parent_id.as_deref());
    out.push_str(",\"group\":null,\"group_index\":null,\"shadow\":null,\"eta\":null,\"expires\":");
    push_optional_json_str(out, msg.expires);
    out.push_str(",\"retries\":0,\"timelimit\":[null,null],\"argsrepr\":");
    push_json_str(out, truncate(&args, REPR_MAX_BYTES));
    out.push_str(",\"kwargsrepr\":");
    push_json_str(out, truncate(kwargs, REPR_MAX_BYTES));
    out.push_str(",\"origin\":");
    push_json_str(out, origin);
    out.push_str(
        ",\"ignore_result\":false,\"replaced_task_nesting\":0,\"stamped_headers\":null,\
         \"stamps\":{},\"outbox_event_type\":",
    );
    push_json_str(out, msg.event_type);
    out.push_str(",\"outbox_created_at\":");
    push_json_str(out, msg.created_at);
    out.push_str(",\"outbox_report_to\":");
    push_json_str(out, msg.report_to);
    let _ = write!(
        out,
        ",\"outbox_send\":\"{}\"}},\"properties\":{{\"correlation_id\":\"{id}\",\"reply_to\":\"\",\"delivery_mode\":2,\
         \"delivery_info\":{{\"exchange\":\"\",\"routing_key\":",
        msg.send
    );
    push_json_str(out, msg.queue);
    let _ = write!(
        out,
        "}},\"priority\":{},\"body_encoding\":\"base64\",\"delivery_tag\":\"{}\"}}}}",
        msg.priority,
        delivery_tag.hyphenated()
    );
    Ok(())
}

/// Payload mapping: with `args`, those are the positional arguments and
/// the payload (an object) the keyword arguments; otherwise an object is the
/// task's kwargs, an array its args, any other value its single argument.
/// Works on the JSON text without parsing it: PostgreSQL's jsonb output is
/// always valid JSON, and the table's constraints fix the kinds.
fn split_payload<'a>(
    payload: &'a str,
    args: Option<&'a str>,
) -> Result<(Cow<'a, str>, &'a str), EncodeError> {
    let trimmed = payload.trim();
    if let Some(args) = args {
        return Ok((Cow::Borrowed(args.trim()), trimmed));
    }
    match trimmed.as_bytes().first() {
        Some(b'{') => Ok((Cow::Borrowed("[]"), trimmed)),
        Some(b'[') => Ok((Cow::Borrowed(trimmed), "{}")),
        Some(_) => Ok((Cow::Owned(format!("[{trimmed}]")), "{}")),
        None => Err(EncodeError::PayloadNotJson("empty".into())),
    }
}

/// The task this one was enqueued from, if any.
#[derive(Debug, Default)]
struct Lineage {
    root_id: Option<String>,
    parent_id: Option<String>,
}

/// The event's headers without the protocol's, and the lineage among them.
fn extra_headers(headers: Option<&str>) -> Result<(Map<String, Value>, Lineage), EncodeError> {
    let Some(text) = headers else {
        return Ok(Default::default());
    };
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(mut map)) => {
            let mut lineage = Lineage::default();
            for (key, slot) in LINEAGE_HEADERS.iter().zip([&mut lineage.root_id, &mut lineage.parent_id]) {
                if let Some(Value::String(id)) = map.get(*key) {
                    *slot = Some(id.clone());
                }
            }
            map.retain(|key, _| !PROTOCOL_HEADERS.contains(&key.as_str()));
            Ok((map, lineage))
        }
        Ok(Value::Null) => Ok(Default::default()),
        Ok(_) => Err(EncodeError::HeadersNotObject),
        Err(e) => Err(EncodeError::HeadersNotJson(e.to_string())),
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends on a char
/// boundary.
fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn push_optional_json_str(out: &mut String, s: Option<&str>) {
    match s {
        Some(s) => push_json_str(out, s),
        None => out.push_str("null"),
    }
}

fn push_json_str(out: &mut String, s: &str) {
    out.push('"');
    // Runs that need no escape are copied whole; what needs one is ASCII,
    // so every cut is on a character boundary.
    let mut rest = s;
    while let Some(at) = rest.bytes().position(|b| b == b'"' || b == b'\\' || b < 0x20) {
        out.push_str(&rest[..at]);
        match rest.as_bytes()[at] {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            b => {
                let _ = write!(out, "\\u{:04x}", b);
            }
        }
        rest = &rest[at + 1..];
    }
    out.push_str(rest);
    out.push('"');
}

const BASE64_ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as Python's `base64.b64decode` expects.
fn base64_encode(input: &[u8], out: &mut String) {
    out.reserve(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        let sextet = |shift: u32| BASE64_ALPHABET[((n >> shift) & 63) as usize] as char;
        out.push(sextet(18));
        out.push(sextet(12));
        out.push(if chunk.len() > 1 { sextet(6) } else { '=' });
        out.push(if chunk.len() > 2 { sextet(0) } else { '=' });
    }
}

/// The bytes of standard base64 with padding, as [`base64_encode`] writes
/// it; `None` for anything else. The AMQP sink takes kombu's envelope
/// apart with it.
pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    let value = |c: u8| BASE64_ALPHABET.iter().position(|a| *a == c).map(|v| v as u32);
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for (i, chunk) in bytes.chunks(4).enumerate() {
        let last = i + 1 == bytes.len() / 4;
        let padding = chunk.iter().rev().take_while(|c| **c == b'=').count();
        if padding > 2 || (padding > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for (j, c) in chunk[..4 - padding].iter().enumerate() {
            n |= value(*c)? << (18 - 6 * j);
        }
        for j in 0..3 - padding {
            out.push((n >> (16 - 8 * j)) as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_reads_back_what_it_wrote() {
        for input in [&b""[..], b"f", b"fo", b"foo", b"foob", b"fooba", b"foobar", &[0, 255, 128, 7]] {
            let mut text = String::new();
            base64_encode(input, &mut text);
            assert_eq!(base64_decode(&text).as_deref(), Some(input));
        }
        for bad in ["Zg=", "Z===", "Zg==Zg==", "Z!==", "Zm9v\n"] {
            assert_eq!(base64_decode(bad), None, "{bad}");
        }
    }

    fn message<'a>(payload: &'a str, headers: Option<&'a str>) -> TaskMessage<'a> {
        TaskMessage {
            id: Uuid::parse_str("0190b5a8-3c4e-7d2a-9b1f-2e6a5c4d3b2a").unwrap(),
            task: "app.tasks.render",
            queue: "renders",
            priority: 0,
            event_type: "render_job_created",
            created_at: "2026-11-29 14:00:00.123456+00",
            payload,
            args: None,
            headers,
            expires: None,
            report_to: "outbox_dispatch.reports",
            send: Uuid::parse_str("5b0e2f4e-9d8c-4b7a-8e6f-1a2b3c4d5e6f").unwrap(),
        }
    }

    fn encode_value(msg: &TaskMessage<'_>) -> (Value, Value) {
        let mut out = String::new();
        encode(msg, "outbox_dispatch@host", Uuid::new_v4(), &mut out).unwrap();
        let envelope: Value = serde_json::from_str(&out).expect("envelope is JSON");
        let body_b64 = envelope["body"].as_str().expect("body is a string");
        let body: Value = serde_json::from_slice(&base64_decode(body_b64).unwrap()).expect("body is JSON");
        (envelope, body)
    }

    #[test]
    fn envelope_has_every_field_a_worker_requires() {
        let msg = message(r#"{"job_id": 7}"#, None);
        let (env, body) = encode_value(&msg);
        let id = msg.id.to_string();
        assert_eq!(env["content-type"], "application/json");
        assert_eq!(env["content-encoding"], "utf-8");
        let h = &env["headers"];
        assert_eq!(h["lang"], "py");
        assert_eq!(h["task"], "app.tasks.render");
        assert_eq!(h["id"], id.as_str());
        assert_eq!(h["root_id"], id.as_str());
        assert_eq!(h["parent_id"], Value::Null);
        assert_eq!(h["retries"], 0);
        assert_eq!(h["timelimit"], serde_json::json!([null, null]));
        assert_eq!(h["origin"], "outbox_dispatch@host");
        assert_eq!(h["outbox_event_type"], "render_job_created");
        assert_eq!(h["outbox_created_at"], "2026-11-29 14:00:00.123456+00");
        assert_eq!(h["outbox_report_to"], "outbox_dispatch.reports");
        assert_eq!(h["outbox_send"], "5b0e2f4e-9d8c-4b7a-8e6f-1a2b3c4d5e6f");
        assert_eq!(h["expires"], Value::Null);
        assert_eq!(h["stamps"], serde_json::json!({}));
        let p = &env["properties"];
        assert_eq!(p["correlation_id"], id.as_str());
        assert_eq!(p["reply_to"], "");
        assert_eq!(p["delivery_mode"], 2);
        assert_eq!(p["delivery_info"]["exchange"], "");
        assert_eq!(p["delivery_info"]["routing_key"], "renders");
        assert_eq!(p["priority"], 0);
        assert_eq!(p["body_encoding"], "base64");
        assert!(Uuid::parse_str(p["delivery_tag"].as_str().unwrap()).is_ok());
        let body = body.as_array().expect("body is an array");
        assert_eq!(body.len(), 3);
        assert_eq!(body[0], serde_json::json!([]));
        assert_eq!(body[1], serde_json::json!({"job_id": 7}));
        assert_eq!(
            body[2],
            serde_json::json!({"callbacks": null, "errbacks": null, "chain": null, "chord": null})
        );
    }

    #[test]
    fn payload_maps_to_args_and_kwargs() {
        let cases = [
            (r#"{"a": 1}"#, serde_json::json!([]), serde_json::json!({"a": 1})),
            (r#"[1, "x"]"#, serde_json::json!([1, "x"]), serde_json::json!({})),
            ("42", serde_json::json!([42]), serde_json::json!({})),
            (r#""text""#, serde_json::json!(["text"]), serde_json::json!({})),
            ("null", serde_json::json!([null]), serde_json::json!({})),
        ];
        for (payload, args, kwargs) in cases {
            let (env, body) = encode_value(&message(payload, None));
            assert_eq!(body[0], args, "args of {payload}");
            assert_eq!(body[1], kwargs, "kwargs of {payload}");
            let argsrepr = env["headers"]["argsrepr"].as_str().unwrap();
            assert_eq!(serde_json::from_str::<Value>(argsrepr).unwrap(), args);
        }
    }

    #[test]
    fn args_and_kwargs_travel_together() {
        let mut msg = message(r#"{"a": 1}"#, None);
        msg.args = Some(r#"[1, "x"]"#);
        let (_, body) = encode_value(&msg);
        assert_eq!(body[0], serde_json::json!([1, "x"]));
        assert_eq!(body[1], serde_json::json!({"a": 1}));
    }

    #[test]
    fn expiry_and_lineage_reach_the_protocol_headers() {
        let headers = r#"{"root_id": "r-1", "parent_id": "p-2", "outbox_report_to": "evil"}"#;
        let mut msg = message("{}", Some(headers));
        msg.expires = Some("2026-11-29T15:00:00.000000+00:00");
        let mut out = String::new();
        encode(&msg, "o", Uuid::new_v4(), &mut out).unwrap();
        assert_eq!(out.matches("\"root_id\":").count(), 1, "one root_id header: {out}");
        let (env, _) = encode_value(&msg);
        let h = &env["headers"];
        assert_eq!(h["root_id"], "r-1");
        assert_eq!(h["parent_id"], "p-2");
        assert_eq!(h["expires"], "2026-11-29T15:00:00.000000+00:00");
        assert_eq!(h["outbox_report_to"], "outbox_dispatch.reports");
    }

    #[test]
    fn delivery_tag_is_fresh_and_id_is_stable() {
        let msg = message("{}", None);
        let (a, _) = encode_value(&msg);
        let (b, _) = encode_value(&msg);
        assert_eq!(a["headers"]["id"], b["headers"]["id"]);
        assert_ne!(a["properties"]["delivery_tag"], b["properties"]["delivery_tag"]);
    }

    #[test]
    fn extra_headers_travel_but_cannot_override_the_protocol() {
        let headers = r#"{"traceparent": "00-abc-def-01", "id": "evil", "task": "evil"}"#;
        let msg = message("{}", Some(headers));
        let mut out = String::new();
        encode(&msg, "o", Uuid::new_v4(), &mut out).unwrap();
        assert_eq!(out.matches("\"id\":").count(), 1, "one id header: {out}");
        let (env, _) = encode_value(&msg);
        assert_eq!(env["headers"]["traceparent"], "00-abc-def-01");
        assert_eq!(env["headers"]["id"], msg.id.to_string().as_str());
        assert_eq!(env["headers"]["task"], "app.tasks.render");
    }

    #[test]
    fn an_event_cannot_mark_its_runs_duplicates() {
        let msg = message("{}", Some(r#"{"outbox_duplicate": true, "tenant": "a"}"#));
        let (env, _) = encode_value(&msg);
        assert!(env["headers"].get("outbox_duplicate").is_none(), "{env}");
        assert_eq!(env["headers"]["tenant"], "a");
    }

    #[test]
    fn headers_that_are_not_an_object_are_refused() {
        let mut out = String::new();
        let err = encode(&message("{}", Some("[1]")), "o", Uuid::new_v4(), &mut out);
        assert_eq!(err, Err(EncodeError::HeadersNotObject));
    }

    #[test]
    fn strings_are_escaped() {
        let mut msg = message("{}", None);
        msg.task = "we\"ird\\task\n\u{1}";
        msg.queue = "q\"ueue";
        msg.event_type = "é\"日本\t\u{1f}x\r\u{7f}ü";
        let (env, _) = encode_value(&msg);
        assert_eq!(env["headers"]["task"], "we\"ird\\task\n\u{1}");
        assert_eq!(env["headers"]["outbox_event_type"], "é\"日本\t\u{1f}x\r\u{7f}ü");
        assert_eq!(env["properties"]["delivery_info"]["routing_key"], "q\"ueue");
    }

    #[test]
    fn reprs_are_truncated_on_a_char_boundary() {
        let long = format!("{{\"k\": \"{}\"}}", "é".repeat(2000));
        let (env, body) = encode_value(&message(&long, None));
        let repr = env["headers"]["kwargsrepr"].as_str().unwrap();
        assert!(repr.len() <= REPR_MAX_BYTES);
        assert_eq!(body[1]["k"].as_str().unwrap().chars().count(), 2000);
    }

    #[test]
    fn base64_round_trips_every_length() {
        let data: Vec<u8> = (0..=255u8).collect();
        for len in 0..40 {
            let mut out = String::new();
            base64_encode(&data[..len], &mut out);
            assert_eq!(out.len() % 4, 0);
            assert_eq!(base64_decode(&out).unwrap(), &data[..len]);
        }
        let mut out = String::new();
        base64_encode(b"any carnal pleas", &mut out);
        assert_eq!(out, "YW55IGNhcm5hbCBwbGVhcw==");
    }
}
