//! An event as a Kafka record, as Debezium's outbox event router makes
//! it: the key is the event's `ordering_key` (its id when it has none),
//! the value its payload as given, and the headers its id (`id`), its type
//! (`eventType`) and the event's own headers (`traceparent`, …).

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

/// The headers every record carries, which an event's own cannot replace.
pub const ID_HEADER: &str = "id";
pub const TYPE_HEADER: &str = "eventType";

/// What an event is made of, as far as Kafka is concerned.
pub struct Event<'a> {
    pub id: Uuid,
    pub ordering_key: Option<&'a str>,
    pub event_type: &'a str,
    /// The payload's JSON text.
    pub payload: &'a str,
    /// The event's own headers, a JSON object's text, if any.
    pub headers: Option<&'a str>,
}

impl Record {
    /// The record of `event`. With `tombstones`, a keyed event whose
    /// payload is JSON `null` becomes a tombstone (a null value: what a
    /// compacted topic deletes its key by), as Debezium's
    /// `route.tombstone.on.empty.payload` does. The error is the event's own
    /// fault (headers that are not a JSON object).
    pub fn of(event: &Event<'_>, tombstones: bool) -> Result<Record, String> {
        let key = match event.ordering_key {
            Some(key) => Bytes::copy_from_slice(key.as_bytes()),
            None => Bytes::from(event.id.to_string()),
        };
        let tombstone = tombstones && event.ordering_key.is_some() && event.payload.trim() == "null";
        let value = (!tombstone).then(|| Bytes::copy_from_slice(event.payload.as_bytes()));
        let mut headers = vec![
            (ID_HEADER.to_string(), Bytes::from(event.id.to_string())),
            (TYPE_HEADER.to_string(), Bytes::copy_from_slice(event.event_type.as_bytes())),
        ];
        if let Some(text) = event.headers {
            let Ok(Value::Object(own)) = serde_json::from_str::<Value>(text) else {
                return Err("headers must be a JSON object".into());
            };
            for (name, value) in own {
                if name == ID_HEADER || name == TYPE_HEADER {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn event<'a>(key: Option<&'a str>, payload: &'a str, headers: Option<&'a str>) -> Event<'a> {
        Event { id: Uuid::from_u128(7), ordering_key: key, event_type: "order_paid", payload, headers }
    }

    #[test]
    fn a_record_carries_what_debeziums_router_would() {
        let record = Record::of(
            &event(Some("order-1"), r#"{"n": 1}"#, Some(r#"{"traceparent": "00-a-b-01", "n": 2}"#)),
            false,
        )
        .unwrap();
        assert_eq!(&record.key[..], b"order-1");
        assert_eq!(record.value.as_deref(), Some(&br#"{"n": 1}"#[..]));
        let headers: Vec<(&str, &[u8])> = record.headers.iter().map(|(n, v)| (n.as_str(), &v[..])).collect();
        assert_eq!(
            headers,
            [
                ("id", &b"00000000-0000-0000-0000-000000000007"[..]),
                ("eventType", b"order_paid"),
                ("n", b"2"),
                ("traceparent", b"00-a-b-01"),
            ]
        );
        // Without an ordering key, the id is the key: spread evenly.
        let record = Record::of(&event(None, "{}", None), false).unwrap();
        assert_eq!(&record.key[..], b"00000000-0000-0000-0000-000000000007");
    }

    #[test]
    fn the_protocol_headers_cannot_be_forged() {
        let record =
            Record::of(&event(None, "{}", Some(r#"{"id": "evil", "eventType": "evil"}"#)), false).unwrap();
        assert_eq!(record.headers.len(), 2);
        assert!(record.headers.iter().all(|(_, v)| &v[..] != b"evil"));
        let error = Record::of(&event(None, "{}", Some("[1]")), false).unwrap_err();
        assert_eq!(error, "headers must be a JSON object");
    }

    #[test]
    fn a_null_payload_with_a_key_is_a_tombstone_when_asked() {
        assert_eq!(Record::of(&event(Some("k"), "null", None), true).unwrap().value, None);
        assert!(Record::of(&event(Some("k"), "null", None), false).unwrap().value.is_some());
        assert!(Record::of(&event(None, "null", None), true).unwrap().value.is_some());
    }
}
