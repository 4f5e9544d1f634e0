//! Reports on channel 2: read with pipelined `basic.get`s, acknowledged
//! once recorded. Reports whose recording failed are not handed back to
//! the queue (a quorum queue counts every return against its delivery
//! limit, and drops a report past it, leaving its event `dispatched` for
//! good): they stay unacknowledged on the channel, and the next read
//! returns them again. A read that fails part way closes the channel or
//! the connection, which hands what it read back (the broker does): once
//! per loss, not once per failed recording.

use std::time::Instant;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, AMQPClass};
use amq_protocol::types::ShortString;

use crate::link::Wait;
use crate::report;
use crate::sink::SinkError;

use super::connection::{method_name, Held, Session};
use super::{protocol, Fault, QueueShape, REPORTS};

/// `basic.get`s sent together when reading reports.
const GETS_PER_TRIP: usize = 100;

impl Session {
    pub(super) fn open_report_channel(
        &mut self,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), Fault> {
        if !self.reports.open {
            self.reports.open = true;
            self.open_channel(REPORTS, waiter, deadline)?;
        }
        Ok(())
    }

    /// Up to `max` reports of `queue`: those read before and not yet
    /// acknowledged, if any, else new ones.
    pub(super) fn read_reports(
        &mut self,
        queue: &ShortString,
        shape: QueueShape,
        max: usize,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, Fault> {
        self.open_report_channel(waiter, deadline)?;
        match self.reports.held.take() {
            Some(held) if held.queue == queue.as_str() => {
                let bodies = held.bodies.clone();
                self.reports.held = Some(held);
                return Ok(bodies);
            }
            // Of a report queue no longer read (outbox.report_key changed):
            // back to it, for whoever reads it.
            Some(held) => {
                let nack = basic::Nack { delivery_tag: held.last_tag, multiple: true, requeue: true };
                let nack = AMQPClass::Basic(basic::AMQPMethod::Nack(nack));
                self.send(&[AMQPFrame::Method(REPORTS, nack)], waiter, deadline)?;
            }
            None => {}
        }
        self.ensure_report_queue(queue, shape, waiter, deadline)?;
        let mut held = Held { queue: queue.to_string(), last_tag: 0, bodies: Vec::new() };
        while held.bodies.len() < max {
            let asked = GETS_PER_TRIP.min(max - held.bodies.len());
            let get = || {
                let get = basic::Get { queue: queue.clone(), no_ack: false };
                AMQPFrame::Method(REPORTS, AMQPClass::Basic(basic::AMQPMethod::Get(get)))
            };
            self.send(&(0..asked).map(|_| get()).collect::<Vec<_>>(), waiter, deadline)?;
            let mut empty = false;
            for _ in 0..asked {
                match self.method(REPORTS, waiter, deadline)? {
                    (REPORTS, AMQPClass::Basic(basic::AMQPMethod::GetOk(ok))) => {
                        let (_, body) = self.content(REPORTS, report::MAX_REPORT_BYTES, waiter, deadline)?;
                        held.last_tag = ok.delivery_tag;
                        held.bodies.push(body);
                    }
                    (REPORTS, AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_))) => empty = true,
                    (c, other) => {
                        return Err(Fault::Sink(protocol(format!(
                            "unexpected {} on channel {c}",
                            method_name(&other)
                        ))))
                    }
                }
            }
            if empty {
                break;
            }
        }
        let bodies = held.bodies.clone();
        self.reports.held = (held.last_tag > 0).then_some(held);
        Ok(bodies)
    }

    /// Acknowledges every report read so far (`basic.ack`, multiple), once
    /// recorded (`n` of them; none: nothing to do).
    pub(super) fn forget_reports(
        &mut self,
        n: usize,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), SinkError> {
        if n == 0 {
            return Ok(());
        }
        let Some(held) = self.reports.held.take() else { return Ok(()) };
        let ack = basic::AMQPMethod::Ack(basic::Ack { delivery_tag: held.last_tag, multiple: true });
        self.send(&[AMQPFrame::Method(REPORTS, AMQPClass::Basic(ack))], waiter, deadline)
    }
}
