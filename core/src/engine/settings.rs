//! What a dispatcher needs of the settings, read at start and after each
//! reload: plain data, so that nothing below the main loop reads a setting
//! itself (the server's GUCs, the sidecar's configuration).

use std::time::Duration;

use crate::sink::BrokerConfig;
use crate::store::KeyPolicy;

/// What a dispatcher needs of the settings, read at start and after each
/// SIGHUP; plain data, so that nothing below the main loop touches a GUC.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub enabled: bool,
    pub broker: BrokerConfig,
    pub batch_size: usize,
    pub poll_interval: Duration,
    /// `outbox.linger`: the least time from a claim that left nothing in
    /// line to the next.
    pub linger: Duration,
    pub max_retries: i32,
    pub retry_backoff: Duration,
    pub reconnect_delay_min: Duration,
    pub reconnect_delay_max: Duration,
    /// `outbox.processing_timeout`, raised to the longest a push may take.
    pub processing_timeout: Duration,
    /// The value set, when it was raised.
    pub processing_timeout_set: Option<Duration>,
    /// How long after its claim a push paused by the broker (an alarm:
    /// `connection.blocked`) may wait for it, at most: the claim's
    /// timeout less the longest push. Not a setting of the connection: a
    /// reload that changes it abandons no push.
    pub pause_limit: Duration,
    /// Zero: acknowledgements are off.
    pub ack_timeout: Duration,
    pub max_redeliveries: i32,
    /// The deadline of every statement a dispatcher runs.
    pub statement_timeout: Duration,
    pub sweep_interval: Duration,
    pub retention: Duration,
    pub inbox_retention: Duration,
    pub lifecycle_interval: Duration,
    pub heartbeat_interval: Duration,
    /// The list workers report this database's outcomes to: see
    /// the host (`outbox.report_key`, a colon and the database's OID); `None`: reports are off.
    pub report_key: Option<String>,
    /// The most bytes of members' JSON one batch of an accumulated
    /// subscription carries.
    pub batch_budget: i64,
    /// When a head lets its key go.
    pub keys: KeyPolicy,
}

impl Settings {
    /// Whether reports or acknowledgements are awaited of what is sent.
    pub fn awaited(&self) -> bool {
        !self.keys.dispatched
    }
}
