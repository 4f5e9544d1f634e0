//! kombu's envelope (as the Redis transport stores it, [`celery::encode`])
//! taken apart into what py-amqp publishes: the body, and the properties
//! with the protocol-2 headers as an AMQP table.

use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable};
use serde_json::Value;

use crate::celery;

use super::short;

/// The least urgent of outbox's priorities: they run from 0 (the most
/// urgent) to 9, as kombu's Redis transport orders its lists. AMQP orders
/// the other way (a queue delivers its highest `priority` first): level
/// `p` is published as `9 - p`.
pub(super) const LEAST_URGENT: u8 = 9;

/// What a message becomes on the wire.
pub(super) struct Outgoing {
    pub(super) body: Vec<u8>,
    pub(super) properties: AMQPProperties,
    /// The task id (`correlation_id`), which a `basic.return` names.
    pub(super) id: String,
    /// The queue the worker reports to (`outbox_report_to`); empty: none.
    pub(super) report_to: String,
}

pub(super) fn outgoing(envelope: &str) -> Result<Outgoing, String> {
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
    let level =
        properties.get("priority").and_then(Value::as_u64).unwrap_or(0).min(LEAST_URGENT.into()) as u8;
    let mut amqp = AMQPProperties::default()
        .with_content_type(short(&text(envelope.get("content-type")), "the content type")?)
        .with_content_encoding(short(&text(envelope.get("content-encoding")), "the content encoding")?)
        .with_headers(table(headers)?)
        .with_delivery_mode(2)
        .with_priority(LEAST_URGENT - level)
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

#[cfg(test)]
mod tests {
    use super::*;

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
        // Level 7 of outbox's ten (0 the most urgent) is AMQP's 2 (9 the most).
        assert_eq!((*p.delivery_mode(), *p.priority()), (Some(2), Some(2)));
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

    #[test]
    fn the_most_urgent_level_is_amqps_highest_priority() {
        let priority = |level: u8| {
            let envelope = super::super::sample_envelope("q", level, "{}");
            outgoing(&envelope).unwrap().properties.priority().unwrap()
        };
        assert_eq!((priority(0), priority(3), priority(9)), (9, 6, 0));
    }
}
