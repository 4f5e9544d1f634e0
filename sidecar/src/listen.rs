//! Wakes the dispatchers of this process when a commit asks (a NOTIFY): on
//! `outbox_dispatch_wake`, which `outbox_wake()` notifies (an adoption, a
//! retry, a subscription ended), and on the channel the database's
//! `outbox.notify_channel` names, which the insert trigger notifies where
//! `outbox.notify` is on. Without NOTIFY, the dispatchers poll
//! (`--poll-interval`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use postgres::fallible_iterator::FallibleIterator;

use outbox_core::backoff;
use outbox_core::metrics::WakeSource;

use crate::connect::{chain, pin_session, Connector};
use crate::host::{wake_all, Bell, Process};
use crate::log;

/// The channel `outbox_wake()` notifies.
const WAKE_CHANNEL: &str = "outbox_dispatch_wake";
/// How often the listener looks whether the process stops.
const LOOK: Duration = Duration::from_millis(250);
const RECONNECT_MIN: Duration = Duration::from_secs(1);
const RECONNECT_MAX: Duration = Duration::from_secs(30);

/// Listens until the process stops, connecting again whenever the
/// connection fails; the dispatchers are woken after each reconnect, for
/// what was notified meanwhile.
pub fn listen(process: &Process, bells: &[Arc<Bell>], connector: &Connector) {
    let mut attempt = 0u32;
    while !process.stopping() {
        let started = Instant::now();
        let Err(why) = listening(process, bells, connector) else {
            return;
        };
        // A session that listened a while starts the backoff again.
        if started.elapsed() > RECONNECT_MAX {
            attempt = 0;
        }
        let delay = backoff::reconnect_delay(RECONNECT_MIN, RECONNECT_MAX, attempt, backoff::random_unit());
        attempt = attempt.saturating_add(1);
        log::warning(&format!("the listener: {why}; connecting again in {:.1}s", delay.as_secs_f64()));
        let until = Instant::now() + delay;
        while !process.stopping() && Instant::now() < until {
            std::thread::sleep(LOOK.min(until - Instant::now()));
        }
    }
}

fn listening(process: &Process, bells: &[Arc<Bell>], connector: &Connector) -> Result<(), String> {
    let mut client = connector.connect(Duration::from_secs(10))?;
    pin_session(&mut client)?;
    let channel: String = client
        .query_one(
            "SELECT coalesce(pg_catalog.current_setting('outbox.notify_channel', true), 'outbox_new')",
            &[],
        )
        .map_err(|e| chain(&e))?
        .get(0);
    client.batch_execute(&format!("LISTEN {WAKE_CHANNEL}")).map_err(|e| chain(&e))?;
    // The database's channel apart: a bad one loses the inserts' NOTIFY
    // (the poll still finds them), never outbox_wake()'s.
    if channel.is_empty() || channel.len() > 63 {
        log::warning(&format!(
            "outbox.notify_channel is {} bytes, not 1 to 63: inserts' NOTIFY is not listened to",
            channel.len()
        ));
    } else if let Err(e) = client.batch_execute(&format!("LISTEN \"{}\"", channel.replace('"', "\"\""))) {
        log::warning(&format!("LISTEN on outbox.notify_channel: {}", chain(&e)));
    }
    wake_all(bells, WakeSource::Manual);
    while !process.stopping() {
        {
            let mut notifications = client.notifications();
            let mut received = notifications.timeout_iter(LOOK);
            while let Some(notification) = received.next().map_err(|e| chain(&e))? {
                let source = if notification.channel() == WAKE_CHANNEL {
                    WakeSource::Manual
                } else {
                    WakeSource::Commit
                };
                wake_all(bells, source);
            }
        }
        if client.is_closed() {
            return Err("the connection was closed".into());
        }
    }
    Ok(())
}
