//! What the cluster says of itself: its brokers' addresses and each
//! topic's partitions and their leaders, asked of the bootstrap connection
//! for a topic not seen, seen too long ago (Kafka's `metadata.max.age.ms`),
//! or forgotten after its leader moved.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::metadata_response::MetadataResponseTopic;
use kafka_protocol::messages::{ApiKey, MetadataRequest, TopicName};
use kafka_protocol::protocol::StrBytes;

use super::faults::Fault;
use super::wire::{failed, Conn};
use crate::link::Wait;
use crate::sink::errors::broker_text;
use crate::sink::{Condition, SinkError};

/// How long a topic's metadata is used before it is asked again: Kafka's
/// producer's default `metadata.max.age.ms`, so that partitions added to a
/// topic are seen by every dispatcher within this.
pub const MAX_AGE: Duration = Duration::from_secs(300);

/// How long the metadata of a topic with a partition being elected (no
/// leader) is used: its partition rests meanwhile, and its next push asks
/// again, at most this often.
const LEADERLESS_AGE: Duration = Duration::from_secs(1);

/// How long to wait before asking again of a topic being created.
const CREATING: Duration = Duration::from_millis(100);

/// The most topics one metadata request asks about.
const GROUP: usize = 100;

/// The leader of each of a topic's partitions (`None`: none now).
pub type Leaders = Vec<Option<i32>>;

/// What the metadata said of a topic.
pub enum TopicState {
    Known(Leaders),
    /// The error that fails its records, and whose fault it is.
    Failed(Fault, String),
}

#[derive(Default)]
pub struct Cluster {
    brokers: HashMap<i32, (String, u16)>,
    /// Each topic's leaders, and until when they are used.
    topics: HashMap<String, (Leaders, Instant)>,
}

impl Cluster {
    /// The address the metadata gave broker `node`.
    pub fn address(&self, node: i32) -> Option<(String, u16)> {
        self.brokers.get(&node).cloned()
    }

    /// Forgets what was said of `topic`: it is asked again at its next use.
    pub fn forget(&mut self, topic: &str) {
        self.topics.remove(topic);
    }

    /// The state of each of `wanted`, asking `bootstrap` of those not known
    /// (or known too long). A topic being created (LEADER_NOT_AVAILABLE, as
    /// auto-creation answers at first) is asked again until `deadline`.
    pub fn states<'a>(
        &mut self,
        bootstrap: &mut Conn,
        wanted: impl Iterator<Item = &'a str>,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<HashMap<String, TopicState>, SinkError> {
        let mut states = HashMap::new();
        let mut asked: Vec<String> = Vec::new();
        let mut seen = HashSet::new();
        for topic in wanted.filter(|t| seen.insert(*t)) {
            match self.topics.get(topic).filter(|(_, used_until)| Instant::now() < *used_until) {
                Some((leaders, _)) => {
                    states.insert(topic.to_string(), TopicState::Known(leaders.clone()));
                }
                None => asked.push(topic.to_string()),
            }
        }
        while !asked.is_empty() {
            // At most GROUP topics a request, so that an answer stays small.
            let group: Vec<String> = asked.drain(..asked.len().min(GROUP)).collect();
            let version = bootstrap.versions.of(ApiKey::Metadata)?;
            let topics = group
                .iter()
                .map(|t| {
                    MetadataRequestTopic::default()
                        .with_name(Some(TopicName(StrBytes::from_string(t.clone()))))
                })
                .collect();
            let answer = bootstrap.call(
                &MetadataRequest::default().with_topics(Some(topics)),
                version,
                waiter,
                deadline,
            )?;
            for broker in &answer.brokers {
                if let Ok(port) = u16::try_from(broker.port) {
                    self.brokers.insert(broker.node_id.0, (broker.host.to_string(), port));
                }
            }
            let wanted: HashSet<&String> = group.iter().collect();
            let mut again = HashSet::new();
            for topic in &answer.topics {
                let Some(name) = topic.name.as_ref().map(|n| n.0.to_string()).filter(|n| wanted.contains(n))
                else {
                    continue;
                };
                let state = match failed(topic.error_code) {
                    None => match leaders(topic) {
                        // A partition without a leader is being elected:
                        // asked again soon.
                        Some(leaders) => {
                            let age =
                                if leaders.iter().all(Option::is_some) { MAX_AGE } else { LEADERLESS_AGE };
                            self.topics.insert(name.clone(), (leaders.clone(), Instant::now() + age));
                            TopicState::Known(leaders)
                        }
                        None => TopicState::Failed(
                            Fault::Broker(Condition::Unavailable),
                            format!(
                                "the metadata of {} has no partitions, or not each once",
                                broker_text(&name)
                            ),
                        ),
                    },
                    Some(error)
                        if error == "LEADER_NOT_AVAILABLE" && Instant::now() + CREATING < deadline =>
                    {
                        again.insert(name);
                        continue;
                    }
                    Some(error) => TopicState::Failed(
                        Fault::of_topic(topic.error_code),
                        format!("{error}: topic {name}"),
                    ),
                };
                states.insert(name, state);
            }
            if let Some(missing) = group.iter().find(|t| !states.contains_key(*t) && !again.contains(*t)) {
                return Err(SinkError::ConnectionLost(format!(
                    "Kafka protocol error: the metadata answer left out the topic {}",
                    broker_text(missing)
                )));
            }
            if !again.is_empty() {
                let nap = Instant::now() + CREATING;
                while Instant::now() < nap {
                    waiter.wait(None, nap).map_err(|_| SinkError::Interrupted)?;
                }
            }
            asked.extend(again);
        }
        Ok(states)
    }
}

/// The leaders of a topic's partitions, by partition index; `None` when
/// the answer does not describe partitions 0 to n-1 once each.
fn leaders(topic: &MetadataResponseTopic) -> Option<Leaders> {
    let count = topic.partitions.len();
    if count == 0 {
        return None;
    }
    let mut leaders = vec![None; count];
    let mut seen = vec![false; count];
    for partition in &topic.partitions {
        let index = usize::try_from(partition.partition_index).ok().filter(|i| *i < count)?;
        if std::mem::replace(&mut seen[index], true) {
            return None;
        }
        let leader = partition.leader_id.0;
        leaders[index] = (partition.error_code == 0 && leader >= 0).then_some(leader);
    }
    Some(leaders)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kafka_protocol::messages::metadata_response::MetadataResponsePartition;
    use kafka_protocol::messages::BrokerId;

    fn topic(partitions: &[(i32, i32, i16)]) -> MetadataResponseTopic {
        MetadataResponseTopic::default().with_partitions(
            partitions
                .iter()
                .map(|&(index, leader, error)| {
                    MetadataResponsePartition::default()
                        .with_partition_index(index)
                        .with_leader_id(BrokerId(leader))
                        .with_error_code(error)
                })
                .collect(),
        )
    }

    #[test]
    fn leaders_are_taken_only_from_a_whole_answer() {
        assert_eq!(leaders(&topic(&[(1, 7, 0), (0, 8, 0)])), Some(vec![Some(8), Some(7)]));
        // No leader now, or one in error: none.
        assert_eq!(leaders(&topic(&[(0, -1, 0), (1, 7, 5)])), Some(vec![None, None]));
        for odd in [&[][..], &[(0, 1, 0), (0, 1, 0)], &[(0, 1, 0), (2, 1, 0)], &[(-1, 1, 0)]] {
            assert_eq!(leaders(&topic(odd)), None, "{odd:?}");
        }
    }
}
