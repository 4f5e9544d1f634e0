//! Reports: what a Celery worker running `outbox_dispatch.celery` says
//! became of a task, sent back through the broker.
//!
//! A report is one JSON object in the Redis list the message named in its
//! `outbox_report_to` header, naming the event and the send it answers (the
//! message's `outbox_send` header, fresh for every send):
//! `{"id": "<event id>", "send": "<send id>", "outcome": "processed"}` or
//! `{"id": "…", "send": "…", "outcome": "failed", "error": "ValueError: …"}`.
//! The dispatchers take a report only for the send of the event it names
//! (`sql/worker/apply_reports.sql`): one that names no send, or another
//! send (a late report of an earlier one, a guess), changes nothing.

use serde_json::Value;
use uuid::Uuid;

/// The send of event `event` in a batch whose send is `send`: what its
/// message carries (the `outbox_send` header) and a report of it must
/// name. A digest of the two (the first 16 bytes of SHA-256 over their
/// bytes), so that a worker that saw one message of a batch learns nothing
/// of its other events' sends; `outbox.send_of()` in SQL is the same, and
/// checks the reports.
pub fn send_of(send: Uuid, event: Uuid) -> Uuid {
    let mut input = [0u8; 32];
    input[..16].copy_from_slice(send.as_bytes());
    input[16..].copy_from_slice(event.as_bytes());
    let digest = ring::digest::digest(&ring::digest::SHA256, &input);
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest.as_ref()[..16]);
    Uuid::from_bytes(bytes)
}

/// The longest `last_error` a report may set; longer text is cut (on a
/// character boundary) with a marker.
pub const MAX_ERROR_BYTES: usize = 8192;

/// The largest report read: the companion keeps its reports well below
/// (its error text is cut to `MAX_ERROR_BYTES`); a larger one is dropped
/// unread, as malformed.
pub const MAX_REPORT_BYTES: usize = 16 * 1024;

/// What became of one task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The task returned.
    Processed,
    /// The task raised after its own retries, or the worker refused the
    /// message (unknown task, expired, revoked, rejected); the text says
    /// which and why.
    Failed(String),
}

impl Outcome {
    /// The event status it leads to.
    pub fn status(&self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Failed(_) => "failed",
        }
    }

    pub fn error(&self) -> Option<&str> {
        match self {
            Outcome::Processed => None,
            Outcome::Failed(error) => Some(error),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub id: Uuid,
    /// The send it answers.
    pub send: Uuid,
    pub outcome: Outcome,
}

/// Why a report was not understood.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub String);

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed report: {}", self.0)
    }
}

impl Report {
    pub fn parse(bytes: &[u8]) -> Result<Report, Malformed> {
        if bytes.is_empty() {
            return Err(Malformed(format!("empty, or over {MAX_REPORT_BYTES} bytes (cut unread)")));
        }
        let value: Value = serde_json::from_slice(bytes).map_err(|e| Malformed(e.to_string()))?;
        let field = |name: &str| value.get(name).and_then(Value::as_str);
        let id = field("id").ok_or_else(|| Malformed("no \"id\"".into()))?;
        let id = Uuid::parse_str(id).map_err(|e| Malformed(format!("\"id\": {e}")))?;
        let send = field("send").ok_or_else(|| {
            Malformed("no \"send\" (from an outbox_dispatch.celery older than 0.4.0? update it)".into())
        })?;
        let send = Uuid::parse_str(send).map_err(|e| Malformed(format!("\"send\": {e}")))?;
        let outcome = match field("outcome") {
            Some("processed") => Outcome::Processed,
            Some("failed") => {
                let error = field("error").filter(|e| !e.is_empty()).unwrap_or("failed (no error given)");
                // A NUL cannot be stored in PostgreSQL's text.
                Outcome::Failed(cut(&error.replace('\0', ""), MAX_ERROR_BYTES))
            }
            Some(other) => return Err(Malformed(format!("unknown \"outcome\" {other:?}"))),
            None => return Err(Malformed("no \"outcome\"".into())),
        };
        Ok(Report { id, send, outcome })
    }
}

/// `text` if it fits in `max` bytes, else its longest prefix that does with
/// room for a marker, and the marker.
fn cut(text: &str, max: usize) -> String {
    const MARKER: &str = " … (cut)";
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max - MARKER.len();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MARKER}", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0190b5a8-3c4e-7d2a-9b1f-2e6a5c4d3b2a";
    const SEND: &str = "5b0e2f4e-9d8c-4b7a-8e6f-1a2b3c4d5e6f";

    #[test]
    fn a_send_is_the_digest_sql_checks() {
        // SELECT outbox.send_of(SEND, ID), or Python's
        // uuid.UUID(bytes=sha256(send.bytes + id.bytes).digest()[:16]).
        let send = send_of(Uuid::parse_str(SEND).unwrap(), Uuid::parse_str(ID).unwrap());
        assert_eq!(send.to_string(), "0871e2a3-de77-654b-9a64-9582b505e066");
        assert_ne!(send, send_of(Uuid::parse_str(ID).unwrap(), Uuid::parse_str(SEND).unwrap()));
    }

    #[test]
    fn processed_and_failed_reports_parse() {
        let processed = Report::parse(
            format!(r#"{{"id": "{ID}", "send": "{SEND}", "outcome": "processed"}}"#).as_bytes(),
        );
        let expected = Report {
            id: Uuid::parse_str(ID).unwrap(),
            send: Uuid::parse_str(SEND).unwrap(),
            outcome: Outcome::Processed,
        };
        assert_eq!(processed, Ok(expected.clone()));
        // A duplicate the inbox skipped (outbox_dispatch.inbox.once) is processed.
        let duplicate = Report::parse(
            format!(r#"{{"id": "{ID}", "send": "{SEND}", "outcome": "processed", "duplicate": true}}"#)
                .as_bytes(),
        );
        assert_eq!(duplicate, Ok(expected));
        let failed = Report::parse(
            format!(r#"{{"id": "{ID}", "send": "{SEND}", "outcome": "failed", "error": "ValueError: no"}}"#)
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(failed.outcome, Outcome::Failed("ValueError: no".into()));
        assert_eq!(failed.outcome.status(), "failed");
        assert_eq!(failed.outcome.error(), Some("ValueError: no"));
    }

    #[test]
    fn a_failure_without_error_still_says_something() {
        let failed =
            Report::parse(format!(r#"{{"id": "{ID}", "send": "{SEND}", "outcome": "failed"}}"#).as_bytes())
                .unwrap();
        assert_eq!(failed.outcome.error(), Some("failed (no error given)"));
    }

    #[test]
    fn malformed_reports_are_refused_with_the_reason() {
        let cases = [
            ("not json".to_string(), "expected"),
            (r#"{"outcome": "processed"}"#.to_string(), "no \"id\""),
            (r#"{"id": "x", "outcome": "processed"}"#.to_string(), "\"id\""),
            (format!(r#"{{"id": "{ID}", "outcome": "processed"}}"#), "no \"send\""),
            (format!(r#"{{"id": "{ID}", "send": "1", "outcome": "processed"}}"#), "\"send\""),
            (format!(r#"{{"id": "{ID}", "send": "{SEND}"}}"#), "no \"outcome\""),
            (format!(r#"{{"id": "{ID}", "send": "{SEND}", "outcome": "done"}}"#), "unknown \"outcome\""),
            (String::new(), "empty, or over"),
        ];
        for (text, reason) in cases {
            let err = Report::parse(text.as_bytes()).unwrap_err();
            assert!(err.0.contains(reason), "{text}: {err}");
        }
    }

    #[test]
    fn long_errors_are_cut_on_a_char_boundary() {
        let long = "é".repeat(MAX_ERROR_BYTES);
        let text = format!(r#"{{"id": "{ID}", "send": "{SEND}", "outcome": "failed", "error": "{long}"}}"#);
        let error = Report::parse(text.as_bytes()).unwrap().outcome.error().unwrap().to_string();
        assert!(error.len() <= MAX_ERROR_BYTES);
        assert!(error.ends_with("(cut)"));
    }
}
