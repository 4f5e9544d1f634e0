//! Round-trip planning: a push's batches cut into pipelined round trips of
//! bounded size, each list's messages kept in order.

use crate::resp;

use super::KeyBatch;

/// One LPUSH: messages `messages` of batch `batch`.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Command {
    pub(super) batch: usize,
    pub(super) messages: std::ops::Range<usize>,
}

/// Commands sent together and answered together.
#[derive(Debug, Default)]
pub(super) struct RoundTrip {
    pub(super) commands: Vec<Command>,
    pub(super) bytes: usize,
}

/// Bytes of an LPUSH besides its values: the array header, the command
/// name, and the key's length prefix.
const COMMAND_OVERHEAD: usize = 32;

/// Cuts `batches` into round trips of about `budget` bytes of commands at
/// most, keeping each list's messages in order. A message larger than the
/// budget travels alone.
pub(super) fn plan_round_trips(batches: &[KeyBatch], budget: usize) -> Vec<RoundTrip> {
    let mut trips = vec![RoundTrip::default()];
    for (b, batch) in batches.iter().enumerate() {
        let size = |i: usize| resp::bulk_len(batch.messages[i].len());
        let overhead = COMMAND_OVERHEAD + batch.key.len();
        let mut start = 0;
        while start < batch.messages.len() {
            let mut bytes = overhead + size(start);
            let full = trips.last().is_some_and(|t| !t.commands.is_empty() && t.bytes + bytes > budget);
            if full {
                trips.push(RoundTrip::default());
            }
            let trip = trips.last_mut().expect("never empty");
            let mut end = start + 1;
            while end < batch.messages.len() && trip.bytes + bytes + size(end) <= budget {
                bytes += size(end);
                end += 1;
            }
            trip.commands.push(Command { batch: b, messages: start..end });
            trip.bytes += bytes;
            start = end;
        }
    }
    trips.retain(|t| !t.commands.is_empty());
    trips
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(key: &str, sizes: &[usize]) -> KeyBatch {
        KeyBatch { key: key.into(), messages: sizes.iter().map(|n| "m".repeat(*n)).collect() }
    }

    #[test]
    fn round_trips_respect_the_budget_and_keep_the_order() {
        let batches = [batch("a", &[400, 400, 400]), batch("b", &[100, 2000, 100])];
        let trips = plan_round_trips(&batches, 1000);
        let plan: Vec<Vec<(usize, std::ops::Range<usize>)>> = trips
            .iter()
            .map(|t| t.commands.iter().map(|c| (c.batch, c.messages.clone())).collect())
            .collect();
        assert_eq!(
            plan,
            vec![
                vec![(0, 0..2)],
                vec![(0, 2..3), (1, 0..1)],
                vec![(1, 1..2)], // larger than the budget: alone
                vec![(1, 2..3)],
            ]
        );
        for trip in &trips[..2] {
            assert!(trip.bytes <= 1000, "{}", trip.bytes);
        }
        let all = plan_round_trips(&batches, usize::MAX);
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].commands.len(), 2);
    }
}
