//! An event as a Kafka record, as Debezium's outbox event router makes
//! it: the key is the event's `ordering_key` (its id when it has none),
//! the value its payload as given, and the headers its id (`id`), its type
//! (`eventType`) and the event's own headers (`traceparent`, …). A
//! subscription's delivery is its event's record, `id` the event's own
//! (what consumers dedupe on), with its subscription and its own id beside
//! it; an accumulated subscription's batch is one record whose value is the
//! list of its members.

use bytes::Bytes;
use serde_json::Value;
use uuid::Uuid;

/// One event, ready to be put in a record batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub key: Bytes,
    /// `None`: a tombstone.
    pub value: Option<Bytes>,
    pub headers: Vec<(String, Bytes)>,
}

/// The headers records carry, which an event's own cannot replace.
pub const ID_HEADER: &str = "id";
pub const TYPE_HEADER: &str = "eventType";
pub const SUBSCRIPTION_HEADER: &str = "outbox_subscription_id";
pub const DELIVERY_HEADER: &str = "outbox_delivery_id";
/// What a delivery's headers name its event by for Celery; `id` says it
/// on a record.
const EVENT_HEADER: &str = "outbox_event_id";
const RESERVED: [&str; 5] = [ID_HEADER, TYPE_HEADER, SUBSCRIPTION_HEADER, DELIVERY_HEADER, EVENT_HEADER];

/// What a subscription made of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing<'a> {
    /// Nothing: the event as it was enqueued.
    Direct,
    /// A plain subscription's delivery of `event`.
    Delivery { event: Uuid, subscription: i64 },
    /// An accumulated subscription's batch: `args` (a JSON array's text)
    /// holds one argument, the list of its members.
    Batch { subscription: i64, args: &'a str },
}

/// How events become records, beyond what they hold: `outbox.kafka_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Form {
    /// `outbox.kafka_tombstones`: a keyed event with a `null` payload is
    /// sent as a tombstone.
    pub tombstones: bool,
    /// `outbox.kafka_key_format`.
    pub key: KeyForm,
}

/// The bytes of a record's key (`outbox.kafka_key_format`), as the Kafka
/// Connect converter a Debezium connector is configured with writes a
/// string key: the partition is the hash of those bytes, so a key lands
/// where that connector's records of the same key do only in its form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyForm {
    /// The key's UTF-8 bytes: `StringConverter`'s.
    #[default]
    String,
    /// The key as a JSON string (`"order-1"`): `JsonConverter`'s with
    /// `schemas.enable=false`.
    Json,
}

impl KeyForm {
    pub const ALL: [KeyForm; 2] = [KeyForm::String, KeyForm::Json];

    fn bytes(self, key: &str) -> Bytes {
        match self {
            KeyForm::String => Bytes::copy_from_slice(key.as_bytes()),
            KeyForm::Json => Bytes::from(Value::from(key).to_string()),
        }
    }
}

/// What an event is made of, as far as Kafka is concerned.
pub struct Event<'a> {
    /// The row's id: the event's, a delivery's or a batch's.
    pub id: Uuid,
    pub ordering_key: Option<&'a str>,
    pub event_type: &'a str,
    /// The payload's JSON text.
    pub payload: &'a str,
    /// The event's own headers, a JSON object's text, if any.
    pub headers: Option<&'a str>,
    pub routing: Routing<'a>,
}

impl Record {
    /// The record of `event`, its key as `form.key` says. With
    /// `form.tombstones`, a keyed event whose payload is JSON `null`
    /// becomes a tombstone (a null value: what a compacted topic deletes
    /// its key by), as Debezium's `route.tombstone.on.empty.payload` does.
    /// The error is the event's own fault (headers that are not a JSON
    /// object).
    pub fn of(event: &Event<'_>, form: Form) -> Result<Record, String> {
        let key = match event.ordering_key {
            Some(key) => form.key.bytes(key),
            None => form.key.bytes(&event.id.to_string()),
        };
        let tombstone = form.tombstones && event.ordering_key.is_some() && event.payload.trim() == "null";
        let value = match event.routing {
            Routing::Batch { args, .. } => Some(Bytes::from(members(args)?)),
            _ => (!tombstone).then(|| Bytes::copy_from_slice(event.payload.as_bytes())),
        };
        let id = match event.routing {
            Routing::Delivery { event, .. } => event,
            _ => event.id,
        };
        let mut headers = vec![
            (ID_HEADER.to_string(), Bytes::from(id.to_string())),
            (TYPE_HEADER.to_string(), Bytes::copy_from_slice(event.event_type.as_bytes())),
        ];
        match event.routing {
            Routing::Direct => {}
            Routing::Delivery { subscription, .. } => {
                headers.push((SUBSCRIPTION_HEADER.to_string(), Bytes::from(subscription.to_string())));
                headers.push((DELIVERY_HEADER.to_string(), Bytes::from(event.id.to_string())));
            }
            Routing::Batch { subscription, .. } => {
                headers.push((SUBSCRIPTION_HEADER.to_string(), Bytes::from(subscription.to_string())));
            }
        }
        if let Some(text) = event.headers {
            let Ok(Value::Object(own)) = serde_json::from_str::<Value>(text) else {
                return Err("headers must be a JSON object".into());
            };
            for (name, value) in own {
                if RESERVED.contains(&name.as_str()) {
                    continue;
                }
                let value = match value {
                    Value::String(text) => text,
                    other => other.to_string(),
                };
                headers.push((name, Bytes::from(value)));
            }
        }
        Ok(Record { key, value, headers })
    }

    /// About the bytes the record takes in a batch.
    pub fn size(&self) -> usize {
        const OVERHEAD: usize = 24;
        OVERHEAD
            + self.key.len()
            + self.value.as_ref().map_or(0, Bytes::len)
            + self.headers.iter().map(|(name, value)| name.len() + value.len() + 4).sum::<usize>()
    }
}

/// The list of a batch's members, oldest first (each `{"id",
/// "event_type", "payload"}`, and `"args"` when it has them), from its
/// arguments: the one argument a Celery task of the batch is called with.
fn members(args: &str) -> Result<String, String> {
    match serde_json::from_str::<Value>(args) {
        Ok(Value::Array(mut args)) if args.len() == 1 && args[0].is_array() => Ok(args.remove(0).to_string()),
        _ => Err("a batch's args must be one argument, the list of its members".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event<'a>(key: Option<&'a str>, payload: &'a str, headers: Option<&'a str>) -> Event<'a> {
        Event {
            id: Uuid::from_u128(7),
            ordering_key: key,
            event_type: "order_paid",
            payload,
            headers,
            routing: Routing::Direct,
        }
    }

    const PLAIN: Form = Form { tombstones: false, key: KeyForm::String };
    const TOMBSTONES: Form = Form { tombstones: true, key: KeyForm::String };

    #[test]
    fn a_json_key_is_what_jsonconverter_writes() {
        let json = Form { key: KeyForm::Json, ..PLAIN };
        assert_eq!(&Record::of(&event(Some("order-1"), "{}", None), json).unwrap().key[..], br#""order-1""#);
        assert_eq!(
            &Record::of(&event(Some("a\"b\u{e9}"), "{}", None), json).unwrap().key[..],
            "\"a\\\"b\u{e9}\"".as_bytes()
        );
        let unkeyed = Record::of(&event(None, "{}", None), json).unwrap();
        assert_eq!(&unkeyed.key[..], br#""00000000-0000-0000-0000-000000000007""#);
    }

    fn named(record: &Record) -> Vec<(&str, &[u8])> {
        record.headers.iter().map(|(n, v)| (n.as_str(), &v[..])).collect()
    }

    #[test]
    fn a_record_carries_what_debeziums_router_would() {
        let record = Record::of(
            &event(Some("order-1"), r#"{"n": 1}"#, Some(r#"{"traceparent": "00-a-b-01", "n": 2}"#)),
            PLAIN,
        )
        .unwrap();
        assert_eq!(&record.key[..], b"order-1");
        assert_eq!(record.value.as_deref(), Some(&br#"{"n": 1}"#[..]));
        assert_eq!(
            named(&record),
            [
                ("id", &b"00000000-0000-0000-0000-000000000007"[..]),
                ("eventType", b"order_paid"),
                ("n", b"2"),
                ("traceparent", b"00-a-b-01"),
            ]
        );
        // Without an ordering key, the id is the key: spread evenly.
        let record = Record::of(&event(None, "{}", None), PLAIN).unwrap();
        assert_eq!(&record.key[..], b"00000000-0000-0000-0000-000000000007");
    }

    #[test]
    fn the_protocol_headers_cannot_be_forged() {
        let forged = r#"{"id": "evil", "eventType": "evil", "outbox_subscription_id": "evil",
                         "outbox_delivery_id": "evil", "outbox_event_id": "evil"}"#;
        let record = Record::of(&event(None, "{}", Some(forged)), PLAIN).unwrap();
        assert_eq!(record.headers.len(), 2);
        assert!(record.headers.iter().all(|(_, v)| &v[..] != b"evil"));
        let error = Record::of(&event(None, "{}", Some("[1]")), PLAIN).unwrap_err();
        assert_eq!(error, "headers must be a JSON object");
    }

    #[test]
    fn a_null_payload_with_a_key_is_a_tombstone_when_asked() {
        assert_eq!(Record::of(&event(Some("k"), "null", None), TOMBSTONES).unwrap().value, None);
        assert!(Record::of(&event(Some("k"), "null", None), PLAIN).unwrap().value.is_some());
        assert!(Record::of(&event(None, "null", None), TOMBSTONES).unwrap().value.is_some());
    }

    #[test]
    fn a_delivery_says_its_events_id_and_its_subscriptions() {
        let routing = Routing::Delivery { event: Uuid::from_u128(1), subscription: 42 };
        let own =
            r#"{"outbox_event_id": "00000000-0000-0000-0000-000000000001", "outbox_subscription_id": 42}"#;
        let record =
            Record::of(&Event { routing, ..event(Some("k"), r#"{"n": 1}"#, Some(own)) }, PLAIN).unwrap();
        assert_eq!(
            named(&record),
            [
                ("id", &b"00000000-0000-0000-0000-000000000001"[..]),
                ("eventType", b"order_paid"),
                ("outbox_subscription_id", b"42"),
                ("outbox_delivery_id", b"00000000-0000-0000-0000-000000000007"),
            ]
        );
        assert_eq!(record.value.as_deref(), Some(&br#"{"n": 1}"#[..]));
    }

    #[test]
    fn a_batch_is_one_record_of_its_members() {
        let args = r#"[[{"id": "a", "payload": {"n": 1}}, {"id": "b", "payload": null}]]"#;
        let routing = Routing::Batch { subscription: 9, args };
        let record = Record::of(
            &Event { routing, ..event(None, "{}", Some(r#"{"outbox_subscription_id": 9}"#)) },
            TOMBSTONES,
        )
        .unwrap();
        let value: Value = serde_json::from_slice(record.value.as_deref().unwrap()).unwrap();
        assert_eq!(
            value,
            serde_json::json!([{"id": "a", "payload": {"n": 1}}, {"id": "b", "payload": null}])
        );
        assert_eq!(
            named(&record),
            [
                ("id", &b"00000000-0000-0000-0000-000000000007"[..]),
                ("eventType", b"order_paid"),
                ("outbox_subscription_id", b"9"),
            ]
        );
        for args in ["[]", "[1]", "{}", "[[1], [2]]", "nope"] {
            let routing = Routing::Batch { subscription: 9, args };
            let error = Record::of(&Event { routing, ..event(None, "{}", None) }, PLAIN).unwrap_err();
            assert!(error.contains("list of its members"), "{args}: {error}");
        }
    }
}
