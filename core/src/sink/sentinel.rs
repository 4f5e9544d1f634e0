//! Sentinel discovery: which host is the master, asked of the sentinels
//! in turn within the connect's deadline.

use std::time::Instant;

use crate::link::{Link, Wait};
use crate::resp::{self, Reply};

use super::errors::scrub;

use super::secrets::password_from_file;
use super::{BrokerConfig, SinkError};

/// Asks each sentinel in turn where the master is, each within its share of
/// the deadline; the first that answers moves to the front, as redis-py's
/// Sentinel does.
pub(super) fn ask_sentinels(
    sentinels: &mut [(String, u16)],
    config: &BrokerConfig,
    waiter: &mut dyn Wait,
    deadline: Instant,
) -> Result<(String, u16), SinkError> {
    let password = match &config.sentinel_password_file {
        Some(path) => Some(password_from_file("outbox.redis_sentinel_password_file", path)?),
        None => None,
    };
    let mut failures = Vec::new();
    for i in 0..sentinels.len() {
        let now = Instant::now();
        let share = deadline.saturating_duration_since(now) / (sentinels.len() - i) as u32;
        let (host, port) = &sentinels[i];
        match ask_sentinel(host, *port, password.as_deref(), &config.sentinel_master, waiter, now + share) {
            Ok(master) => {
                sentinels[..=i].rotate_right(1);
                return Ok(master);
            }
            Err(SinkError::Interrupted) => return Err(SinkError::Interrupted),
            Err(e) => failures.push(format!("{host}:{port}: {e}")),
        }
    }
    Err(SinkError::Connect(format!("no sentinel named the master: {}", failures.join("; "))))
}

fn ask_sentinel(
    host: &str,
    port: u16,
    password: Option<&str>,
    master: &str,
    waiter: &mut dyn Wait,
    deadline: Instant,
) -> Result<(String, u16), SinkError> {
    let mut link =
        Link::connect(host, port, None, waiter, deadline).map_err(|e| SinkError::from_link(e, false))?;
    let mut commands = Vec::new();
    if let Some(password) = password {
        resp::command(&mut commands, &["AUTH", password]);
    }
    resp::command(&mut commands, &["SENTINEL", "get-master-addr-by-name", master]);
    let mut replies = link
        .round_trip(&commands, 1 + usize::from(password.is_some()), waiter, deadline)
        .map_err(|e| SinkError::from_link(e, false))?;
    match replies.pop() {
        Some(Reply::Array(Some(address))) if address.len() == 2 => {
            let host = address[0].text().unwrap_or_default();
            let port = address[1].text().and_then(|p| p.parse().ok());
            port.map(|port| (host, port)).ok_or_else(|| {
                SinkError::Connect(format!(
                    "the sentinel named the master at an odd address ({}, {})",
                    address[0].describe(),
                    address[1].describe()
                ))
            })
        }
        Some(Reply::Array(None)) | Some(Reply::Bulk(None)) => {
            Err(SinkError::Connect(format!("knows no master named \"{master}\"")))
        }
        Some(Reply::Error(e)) => Err(SinkError::Connect(scrub(&e, &[password]))),
        other => Err(SinkError::Connect(format!(
            "unexpected reply: {}",
            other.as_ref().map_or("none".into(), Reply::describe)
        ))),
    }
}
