//! The dispatcher's broker: the connection, made again with a backoff
//! after a failure, proved by a PING when a heartbeat falls due, and shown
//! by the host (connected, last heartbeat, persistence, last error).

use std::time::{Duration, Instant};

use super::{Host, Settings, State};
use crate::backoff;
use crate::link::Wait;
use crate::metrics::Counter;
use crate::sink::{BrokerConfig, Persistence, Sink, SinkError};

pub struct Broker<W> {
    /// The dispatcher, as the log names it.
    index: usize,
    sink: Result<Sink, SinkError>,
    waiter: W,
    /// Consecutive failed connection attempts.
    reconnect_attempt: u32,
    /// No connection attempt before this.
    next_connect: Option<Instant>,
    /// When the broker was last found failing, until the next connect.
    lost_at: Option<Instant>,
    /// The master the last connection reached, `host:port`.
    last_master: Option<String>,
    /// The broker's lack of persistence was logged.
    persistence_warned: bool,
    next_heartbeat: Instant,
}

impl<W: Wait> Broker<W> {
    pub fn new(index: usize, waiter: W, config: &BrokerConfig) -> Self {
        Broker {
            index,
            sink: Sink::new(config),
            waiter,
            reconnect_attempt: 0,
            next_connect: None,
            lost_at: None,
            last_master: None,
            persistence_warned: false,
            next_heartbeat: Instant::now(),
        }
    }

    /// The broker's settings changed: a new sink, not connected, to be
    /// connected at once.
    pub fn replace<H: Host<Waiter = W>>(&mut self, config: &BrokerConfig, host: &H) {
        self.sink = Sink::new(config);
        self.waiter = host.waiter(config);
        host.set_connected(false);
        self.reconnect_attempt = 0;
        self.next_connect = None;
    }

    /// Closes the connection (while paused), without any backoff.
    pub fn disconnect(&mut self, host: &impl Host) {
        if let Ok(sink) = &mut self.sink {
            sink.disconnect();
        }
        host.set_connected(false);
    }

    /// The settings were reloaded: the next heartbeat is due within the
    /// (new) interval.
    pub fn reschedule(&mut self, settings: &Settings) {
        let now = Instant::now();
        self.next_heartbeat = self.next_heartbeat.min(now + settings.heartbeat_interval);
    }

    pub fn connected(&self) -> bool {
        self.sink.as_ref().is_ok_and(Sink::is_connected)
    }

    /// While not connected: no connection attempt before this.
    pub fn reconnect_at(&self) -> Option<Instant> {
        self.next_connect.filter(|_| !self.connected())
    }

    /// When the next heartbeat is due.
    pub fn next_heartbeat(&self) -> Instant {
        self.next_heartbeat
    }

    /// The sink and the wait its operations run with; `None` when the
    /// settings give no sink (the error is the connect's).
    pub fn session(&mut self) -> Option<(&mut Sink, &mut W)> {
        self.sink.as_mut().ok().map(|sink| (sink, &mut self.waiter))
    }

    /// Connects when the backoff allows; returns the wait when it did not.
    pub fn connect(&mut self, host: &impl Host, settings: &Settings) -> Option<Duration> {
        let now = Instant::now();
        if let Some(at) = self.next_connect.filter(|at| *at > now) {
            return Some(at - now);
        }
        host.report_running(c"outbox: connecting to the broker");
        let result = match &mut self.sink {
            Ok(sink) => sink.connect(&mut self.waiter),
            Err(e) => Err(e.clone()),
        };
        match result {
            Ok(persistence) => {
                let url = self.sink.as_ref().map_or("", Sink::display_url).to_string();
                let kind = self.sink.as_ref().map_or("the broker", Sink::kind);
                let node = self.sink.as_ref().map_or("node", Sink::node_kind);
                let master = self.sink.as_ref().ok().and_then(Sink::master).map(str::to_string);
                let paused = self.lost_at.take().map(|at| at.elapsed());
                if let Some(paused) = paused {
                    host.counters().broker_unavailable(paused);
                    host.log(&format!(
                        "outbox dispatcher {} reconnected to {kind} at {url} ({node} {}) after {:.1}s",
                        self.index,
                        master.as_deref().unwrap_or("?"),
                        paused.as_secs_f64()
                    ));
                }
                if let (Some(before), Some(now)) = (&self.last_master, &master) {
                    if before != now {
                        host.counters().add(Counter::MasterChanges, 1);
                        host.log(&format!(
                            "outbox dispatcher {}: the {kind} {node} moved from {before} to {now}",
                            self.index
                        ));
                    }
                }
                self.last_master = master;
                self.note_persistence(persistence, &url, host);
                self.reconnect_attempt = 0;
                self.next_connect = None;
                host.set_connected(true);
                self.answered(host, settings);
                host.set_error(None);
                None
            }
            Err(e) => Some(self.failed(&e, host, settings)),
        }
    }

    /// Shows how the broker keeps messages, and warns once when it keeps
    /// them only in memory: "nothing lost" then ends at a Redis restart.
    fn note_persistence(&mut self, persistence: Persistence, url: &str, host: &impl Host) {
        host.set_persistence(persistence);
        if persistence == Persistence::None && !std::mem::replace(&mut self.persistence_warned, true) {
            host.warning(&format!(
                "outbox dispatcher {}: Redis at {url} persists nothing (no RDB snapshots, no AOF): \
                 messages in its lists are lost if it restarts",
                self.index
            ));
        }
    }

    /// The broker just answered: that is as good as a heartbeat.
    pub fn answered(&mut self, host: &impl Host, settings: &Settings) {
        host.heartbeat();
        self.next_heartbeat = Instant::now() + settings.heartbeat_interval;
    }

    /// Records a broker failure; returns the delay before the next attempt.
    /// An interrupted operation (a reload changed the broker) is no failure:
    /// the connection is dropped and the loop goes on at once.
    pub fn failed(&mut self, error: &SinkError, host: &impl Host, settings: &Settings) -> Duration {
        if let Ok(sink) = &mut self.sink {
            sink.disconnect();
        }
        host.set_connected(false);
        if *error == SinkError::Interrupted {
            return Duration::ZERO;
        }
        self.lost_at.get_or_insert_with(Instant::now);
        let delay = backoff::reconnect_delay(
            settings.reconnect_delay_min,
            settings.reconnect_delay_max,
            self.reconnect_attempt,
            backoff::random_unit(),
        );
        self.reconnect_attempt = self.reconnect_attempt.saturating_add(1);
        self.next_connect = Some(Instant::now() + delay);
        host.counters().reconnect(error);
        host.set_state(State::Reconnecting);
        host.set_error(Some(&error.to_string()));
        host.log(&format!(
            "outbox dispatcher {}: {error} (reason {}); reconnecting in {:.1}s",
            self.index,
            error.reason().name(),
            delay.as_secs_f64()
        ));
        delay
    }

    /// PINGs the broker when a heartbeat is due; returns the reconnect wait
    /// when it failed.
    pub fn heartbeat_if_due(&mut self, host: &impl Host, settings: &Settings) -> Option<Duration> {
        let now = Instant::now();
        if now < self.next_heartbeat {
            return None;
        }
        self.next_heartbeat = now + settings.heartbeat_interval;
        host.report_running(c"outbox: PING to the broker");
        let sink = self.sink.as_mut().expect("connected before the heartbeat");
        match sink.ping(&mut self.waiter) {
            Ok(()) => {
                self.answered(host, settings);
                None
            }
            Err(e) => Some(self.failed(&e, host, settings)),
        }
    }
}
