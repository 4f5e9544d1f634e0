//! Making sure, once per connection, that a queue can take what is
//! published to it as Celery publishes (to the direct exchange named like
//! the queue, routing key the queue): passive declarations first, so that
//! a queue or exchange that exists is used as it is, whatever arguments
//! its owner gave it (`x-message-ttl`, a dead-letter exchange, another
//! type) and whether or not this user may configure it. What is missing
//! is declared as Celery would: a durable direct exchange, a durable queue
//! of [`QueueShape`], the binding by the queue's name.

use std::time::Instant;

use amq_protocol::protocol::{exchange, queue, AMQPClass};
use amq_protocol::types::{FieldTable, ShortString};

use crate::link::Wait;

use super::connection::Session;
use super::{Fault, QueueShape, PUBLISH, REPORTS};

impl Session {
    /// Makes sure of `name` on the publishing channel. A channel the broker
    /// closes on the way is this queue's failure ([`Fault::Channel`]); the
    /// caller opens the channel again for the others.
    pub(super) fn declare(
        &mut self,
        name: &str,
        shape: QueueShape,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), Fault> {
        if self.declared.contains(name) {
            return Ok(());
        }
        let name = ShortString::from(name);
        let queue_existed = self.exists(PUBLISH, queue_declare(&name, shape, true), waiter, deadline)?;
        if !queue_existed {
            self.call(PUBLISH, queue_declare(&name, shape, false), waiter, deadline, queue_declared)?;
        }
        let exchange_existed = self.exists(PUBLISH, exchange_declare(&name, true), waiter, deadline)?;
        if !exchange_existed {
            self.call(PUBLISH, exchange_declare(&name, false), waiter, deadline, |m| {
                matches!(m, AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_)))
            })?;
        }
        // Both existed: bound by whoever made them (a missing binding makes
        // a message unroutable, which says so).
        if !(queue_existed && exchange_existed) {
            let bind = queue::Bind {
                queue: name.clone(),
                exchange: name.clone(),
                routing_key: name.clone(),
                nowait: false,
                arguments: FieldTable::default(),
            };
            self.call(PUBLISH, AMQPClass::Queue(queue::AMQPMethod::Bind(bind)), waiter, deadline, |m| {
                matches!(m, AMQPClass::Queue(queue::AMQPMethod::BindOk(_)))
            })?;
        }
        self.declared.insert(name.to_string());
        Ok(())
    }

    /// Makes sure, once per connection, that the report queue `name`
    /// exists, on channel 2: a queue that exists is used as it is; one
    /// that does not is declared of `shape`.
    pub(super) fn ensure_report_queue(
        &mut self,
        name: &ShortString,
        shape: QueueShape,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), Fault> {
        if self.reports.queues.contains(name.as_str()) {
            return Ok(());
        }
        self.open_report_channel(waiter, deadline)?;
        if !self.exists(REPORTS, queue_declare(name, shape, true), waiter, deadline)? {
            self.call(REPORTS, queue_declare(name, shape, false), waiter, deadline, queue_declared)?;
        }
        self.reports.queues.insert(name.to_string());
        Ok(())
    }

    /// Whether a passive declaration on `channel` finds what it names. Not
    /// found closes the channel (404), which is opened again.
    fn exists(
        &mut self,
        channel: u16,
        passive: AMQPClass,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<bool, Fault> {
        let declared = |m: &AMQPClass| {
            matches!(
                m,
                AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))
                    | AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_))
            )
        };
        match self.call(channel, passive, waiter, deadline, declared) {
            Ok(_) => Ok(true),
            Err(Fault::Channel(c, why)) if c == channel && why.starts_with("404 ") => {
                match channel {
                    PUBLISH => self.open_publishing(waiter, deadline)?,
                    _ => self.open_report_channel(waiter, deadline)?,
                }
                Ok(false)
            }
            Err(fault) => Err(fault),
        }
    }
}

fn queue_declared(method: &AMQPClass) -> bool {
    matches!(method, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_)))
}

/// A durable queue of `shape`, or (`passive`) whatever queue has the name.
fn queue_declare(name: &ShortString, shape: QueueShape, passive: bool) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: name.clone(),
        passive,
        durable: true,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: if passive { FieldTable::default() } else { shape.arguments() },
    }))
}

/// A durable direct exchange, or (`passive`) whatever exchange has the name.
fn exchange_declare(name: &ShortString, passive: bool) -> AMQPClass {
    AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
        exchange: name.clone(),
        kind: "direct".into(),
        passive,
        durable: true,
        auto_delete: false,
        internal: false,
        nowait: false,
        arguments: FieldTable::default(),
    }))
}
