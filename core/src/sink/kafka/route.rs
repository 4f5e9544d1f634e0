//! Where an event goes in Kafka, as Debezium's outbox event router sends
//! it: the topic from `outbox.kafka_topic` (a template over the event's
//! type and queue), the partition from the record's key by Kafka's own
//! default partitioner (murmur2), so that a key lands where a Java producer
//! would put it.

use std::fmt;

/// A piece of the topic template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    EventType,
    Queue,
}

/// `outbox.kafka_topic`, parsed: `outbox.event.{event_type}`, `{queue}`, or
/// a fixed name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    parts: Vec<Part>,
}

/// The most characters of a topic's name (Kafka's `Topic.MAX_NAME_LENGTH`).
pub const TOPIC_MAX: usize = 249;

impl Topics {
    /// Parses the template. Its fixed text must be made of what a topic's
    /// name may hold; the placeholders are `{event_type}` and `{queue}`.
    pub fn parse(template: &str) -> Result<Topics, String> {
        let mut parts = Vec::new();
        let mut rest = template;
        while !rest.is_empty() {
            let text_end = rest.find(['{', '}']).unwrap_or(rest.len());
            if text_end > 0 {
                let text = &rest[..text_end];
                if let Some(c) = text.chars().find(|c| !allowed(*c)) {
                    return Err(format!(
                        "outbox.kafka_topic holds {c:?}: a topic's name is made of ASCII letters, digits, \
                         '.', '_' and '-'"
                    ));
                }
                parts.push(Part::Text(text.to_string()));
                rest = &rest[text_end..];
                continue;
            }
            let close = rest.find('}').filter(|_| rest.starts_with('{'));
            let part = match close.map(|end| &rest[..=end]) {
                Some("{event_type}") => Part::EventType,
                Some("{queue}") => Part::Queue,
                _ => {
                    return Err(
                        "outbox.kafka_topic has a brace that is not {event_type} or {queue}".to_string()
                    )
                }
            };
            parts.push(part);
            rest = &rest[close.expect("matched") + 1..];
        }
        if parts.is_empty() {
            return Err("outbox.kafka_topic is empty: name a topic, or use {event_type} or {queue}".into());
        }
        let fixed: usize = parts.iter().map(|p| if let Part::Text(t) = p { t.len() } else { 0 }).sum();
        if fixed > TOPIC_MAX {
            return Err(format!("outbox.kafka_topic has {fixed} characters besides its placeholders: a topic's name has at most {TOPIC_MAX}"));
        }
        let topics = Topics { parts };
        if topics.parts.iter().all(|p| matches!(p, Part::Text(_))) {
            topics.topic("", "").map_err(|e| format!("outbox.kafka_topic: {e}"))?;
        }
        Ok(topics)
    }

    /// The topic of an event of `event_type` in `queue`; the error says
    /// why the name is not one Kafka takes (the event's own fault).
    pub fn topic(&self, event_type: &str, queue: &str) -> Result<String, InvalidTopic> {
        let mut name = String::new();
        for part in &self.parts {
            name.push_str(match part {
                Part::Text(text) => text,
                Part::EventType => event_type,
                Part::Queue => queue,
            });
        }
        let valid = !name.is_empty()
            && name.len() <= TOPIC_MAX
            && name != "."
            && name != ".."
            && name.chars().all(allowed);
        if valid {
            Ok(name)
        } else {
            Err(InvalidTopic(name))
        }
    }
}

/// A topic name Kafka would refuse (`InvalidTopicException`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidTopic(String);

impl fmt::Display for InvalidTopic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: String = self.0.chars().take(TOPIC_MAX + 1).flat_map(char::escape_default).collect();
        write!(
            f,
            "INVALID_TOPIC_EXCEPTION: \"{shown}\" (from outbox.kafka_topic) is not a Kafka topic name: \
             1 to {TOPIC_MAX} ASCII letters, digits, '.', '_' or '-'"
        )
    }
}

fn allowed(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

/// Kafka's murmur2 (`org.apache.kafka.common.utils.Utils.murmur2`), on
/// which its default partitioner places a keyed record.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let mut h = SEED ^ data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes(chunk.try_into().expect("four bytes"));
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        for (i, byte) in tail.iter().enumerate().rev() {
            h ^= u32::from(*byte) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition of `partitions` a record keyed `key` goes to, as Kafka's
/// default partitioner puts it (`toPositive(murmur2(key)) % partitions`).
pub fn partition(key: &[u8], partitions: usize) -> usize {
    (murmur2(key) & 0x7fff_ffff) as usize % partitions.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_is_kafkas() {
        // Kafka's own test cases (UtilsTest.testMurmur2).
        let cases: [(&[u8], i32); 6] = [
            (b"21", -973932308),
            (b"foobar", -790332482),
            (b"a-little-bit-long-string", -985981536),
            (b"a-little-bit-longer-string", -1486304829),
            (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
            (b"abc", 479470107),
        ];
        for (data, hash) in cases {
            assert_eq!(murmur2(data), hash, "{}", String::from_utf8_lossy(data));
        }
        assert!(partition(b"21", 7) < 7);
        assert_eq!(partition(b"anything", 1), 0);
    }

    #[test]
    fn topics_come_from_the_template() {
        let topics = Topics::parse("outbox.event.{event_type}").unwrap();
        assert_eq!(topics.topic("order_created", "celery").unwrap(), "outbox.event.order_created");
        assert_eq!(Topics::parse("{queue}").unwrap().topic("t", "emails").unwrap(), "emails");
        assert_eq!(Topics::parse("all-events").unwrap().topic("t", "q").unwrap(), "all-events");
        let both = Topics::parse("{queue}.{event_type}-v1").unwrap();
        assert_eq!(both.topic("paid", "billing").unwrap(), "billing.paid-v1");
    }

    #[test]
    fn a_template_kafka_would_refuse_is_refused_whole() {
        for (bad, why) in [
            ("", "empty"),
            ("orders/{event_type}", "'/'"),
            ("{event}", "brace"),
            ("{event_type", "brace"),
            ("x}", "brace"),
            ("ünïcode", "'ü'"),
            ("..", "not a Kafka topic name"),
        ] {
            let error = Topics::parse(bad).unwrap_err();
            assert!(error.contains(why), "{bad}: {error}");
        }
        let long = Topics::parse(&format!("{}{{queue}}", "x".repeat(250))).unwrap_err();
        assert!(long.contains("at most 249"), "{long}");
    }

    #[test]
    fn an_event_that_makes_a_bad_name_is_its_own_fault() {
        let topics = Topics::parse("{event_type}").unwrap();
        for bad in ["order:created", "", ".", "..", &"x".repeat(250), "a\nb"] {
            let error = topics.topic(bad, "q").unwrap_err().to_string();
            assert!(error.starts_with("INVALID_TOPIC_EXCEPTION"), "{error}");
            assert!(!error.contains('\n'), "{error}");
        }
        assert!(topics.topic(&"x".repeat(249), "q").is_ok());
    }
}
