//! Whose fault a Kafka error code is: the broker's (a condition: no retry
//! spent) or a record's own (a retry spent, then the dead letter), from
//! Kafka's documented meaning of each (its `Errors` table), not any one
//! broker's habits.

use kafka_protocol::ResponseError as E;

use crate::sink::{Condition, Delivery};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The broker's or the cluster's: no retry spent.
    Broker(Condition),
    /// The record's own, or its topic's: a retry spent, then the dead
    /// letter. `split`: one record of a batch may be the cause.
    Message { split: bool },
}

impl Fault {
    /// The fault of an error code of a produce answer.
    pub fn of(code: i16) -> Fault {
        let Some(error) = E::try_from_code(code) else { return Fault::Broker(Condition::Unavailable) };
        match error {
            E::NotLeaderOrFollower
            | E::LeaderNotAvailable
            | E::FencedLeaderEpoch
            | E::UnknownLeaderEpoch
            | E::ReplicaNotAvailable
            | E::NotController
            // After a metadata answer that knew the topic: it is stale.
            | E::UnknownTopicOrPartition => Fault::Broker(Condition::LeaderMoved),
            E::NotEnoughReplicas | E::NotEnoughReplicasAfterAppend => {
                Fault::Broker(Condition::NotEnoughReplicas)
            }
            E::MessageTooLarge | E::RecordListTooLarge | E::InvalidRecord => Fault::Message { split: true },
            E::TopicAuthorizationFailed | E::InvalidTopicException | E::PolicyViolation => {
                Fault::Message { split: false }
            }
            // Anything else is the broker's: what Kafka calls retriable (a
            // timeout, a storage error, CORRUPT_MESSAGE, which a network
            // fault makes), and what it does not but no record causes (a
            // producer the broker forgot, INVALID_TIMESTAMP, which the
            // dispatcher's clock decides, an unknown code).
            _ => Fault::Broker(Condition::Unavailable),
        }
    }

    /// The fault of a topic's error in a metadata answer: one that does
    /// not exist (auto-creation off) is its records' fault.
    pub fn of_topic(code: i16) -> Fault {
        match E::try_from_code(code) {
            Some(E::UnknownTopicOrPartition) => Fault::Message { split: false },
            _ => Fault::of(code),
        }
    }

    /// What becomes of a record refused for this fault, `error` saying why.
    pub fn verdict(self, error: &str) -> Delivery {
        match self {
            Fault::Broker(condition) => Delivery::Refused(condition, error.to_string()),
            Fault::Message { .. } => Delivery::Rejected(error.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::kafka::wire::failed;

    #[test]
    fn the_brokers_faults_never_spend_a_retry() {
        for code in [2, 3, 5, 6, 7, 8, 9, 13, 19, 20, 32, 45, 47, 56, 59, 74, 75, -1, 31000] {
            assert!(matches!(Fault::of(code), Fault::Broker(_)), "{code}: {:?}", failed(code));
        }
        for code in [10, 18, 87] {
            assert_eq!(Fault::of(code), Fault::Message { split: true }, "{:?}", failed(code));
        }
        for code in [29, 17, 44] {
            assert_eq!(Fault::of(code), Fault::Message { split: false }, "{:?}", failed(code));
        }
        assert_eq!(Fault::of(6), Fault::Broker(Condition::LeaderMoved));
        assert_eq!(Fault::of(19), Fault::Broker(Condition::NotEnoughReplicas));
        // A topic the metadata does not know is its records' fault; at
        // produce, after metadata that knew it, the metadata is stale.
        assert_eq!(Fault::of_topic(3), Fault::Message { split: false });
        assert_eq!(Fault::of_topic(5), Fault::Broker(Condition::LeaderMoved));
    }
}
