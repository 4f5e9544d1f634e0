//! The Redis end: one connection, batches pushed in pipelined round trips
//! of bounded size, and a clear line between the broker's fault (the
//! connection, or a condition of the server such as OOM or READONLY) and
//! one event's fault (an error Redis answered for its push, e.g. WRONGTYPE).
//!
//! Every operation (connect with TLS and AUTH, a push's round trip, a PING)
//! has one deadline, `timeout`, and waits through the caller's [`Wait`].
//!
//! With a `sentinel://` URL every connect asks the sentinels where the
//! master is and checks that it is one (ROLE); a READONLY reply then means a
//! failover, and the next connect asks again. With `wait_replicas`, each
//! round trip ends with a WAIT: messages count as delivered only once that
//! many replicas have them, so a failover cannot lose them.

use std::time::Instant;

use crate::broker_url::{BrokerUrl, Endpoints};
use crate::link::{Link, Wait};
use crate::report;
use crate::resp::{self, Limits, Reply};

use super::errors::{broker_text, not_redis, scrub};
use super::keys::Keys;
use super::plan::{plan_round_trips, RoundTrip};
use super::secrets::password_from_file;
use super::sentinel::ask_sentinels;
use super::{tls_config, BrokerConfig, Condition, Delivery, KeyBatch, Persistence, Pushed, SinkError};

/// How the server persists data, from its CONFIG GET replies.
fn persistence_from_config(save: &Reply, appendonly: &Reply) -> Persistence {
    let value = |reply: &Reply| match reply {
        Reply::Array(Some(pair)) if pair.len() == 2 => pair[1].text(),
        _ => None,
    };
    match (value(save), value(appendonly)) {
        (Some(save), Some(aof)) => match (!save.trim().is_empty(), aof == "yes") {
            (false, false) => Persistence::None,
            (true, false) => Persistence::Snapshots,
            (false, true) => Persistence::AppendOnly,
            (true, true) => Persistence::SnapshotsAndAppendOnly,
        },
        _ => Persistence::Unknown,
    }
}

pub struct RedisSink {
    config: BrokerConfig,
    url: BrokerUrl,
    keys: Keys,
    link: Option<Link>,
    display_url: String,
    /// The master of the current (or last) connection, `host:port`.
    master: Option<String>,
    /// The server knows `EVAL_RO` (Redis 7 and later): the report read then
    /// runs during a `CLIENT PAUSE WRITE` (a failover) as a plain read would.
    read_only_scripts: bool,
    /// The digest of the reports [`RedisSink::reports`] read last, which
    /// [`RedisSink::forget_reports`] trims only if they are still the
    /// list's head.
    read_digest: Option<String>,
}

/// Lua: the digest of the list `items` (SHA-1 over each item's length and
/// bytes), as the report read and the trim both compute it.
const DIGEST: &str = "local function digest(items) \
                          local parts = {} \
                          for i, item in ipairs(items) do parts[i] = #item .. ':' .. item end \
                          return redis.sha1hex(table.concat(parts)) \
                      end ";

impl RedisSink {
    /// Takes the parsed URL and the key options; connects lazily.
    pub fn new(config: &BrokerConfig, url: BrokerUrl) -> Result<RedisSink, SinkError> {
        let display_url = url.display();
        if matches!(url.endpoints, Endpoints::Sentinels(_)) && config.sentinel_master.is_empty() {
            return Err(SinkError::InvalidConfig(
                "outbox.redis_url names sentinels: set outbox.redis_sentinel_master to the master's name \
                 (kombu's master_name)"
                    .into(),
            ));
        }
        let keys = Keys::new(&config.key_prefix, &config.priority_steps, &config.priority_separator)
            .map_err(SinkError::InvalidConfig)?;
        Ok(RedisSink {
            config: config.clone(),
            url,
            keys,
            link: None,
            display_url,
            master: None,
            read_only_scripts: true,
            read_digest: None,
        })
    }

    /// The lists messages and reports go to.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The master of the current or last connection, `host:port`.
    pub fn master(&self) -> Option<&str> {
        self.master.as_deref()
    }

    /// What a refusal means: with sentinels, READONLY is a failover.
    pub fn refusal(&self, condition: Condition, reply: String) -> SinkError {
        match (&self.url.endpoints, condition) {
            (Endpoints::Sentinels(_), Condition::ReadOnly) => SinkError::Failover(reply),
            _ => SinkError::Refused(condition, reply),
        }
    }

    /// The broker's address with any credentials masked.
    pub fn display_url(&self) -> &str {
        &self.display_url
    }

    pub fn is_connected(&self) -> bool {
        self.link.is_some()
    }

    pub fn disconnect(&mut self) {
        self.link = None;
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.config.timeout
    }

    /// Connects (TCP, TLS, AUTH, SELECT) and proves the connection with a
    /// PING, all within one timeout; returns how the server persists data.
    /// The files are read at each connect, so a rotated password or CA file
    /// takes effect at the next one.
    pub fn connect(&mut self, waiter: &mut dyn Wait) -> Result<Persistence, SinkError> {
        self.link = None;
        let deadline = self.deadline();
        let password = match &self.config.password_file {
            Some(path) => Some(password_from_file("outbox.broker_password_file", path)?),
            None => self.url.password.clone(),
        };
        let tls = self.url.tls.then(|| tls_config(&self.config)).transpose()?;
        let (host, port) = match &mut self.url.endpoints {
            Endpoints::Direct(host, port) => (host.clone(), *port),
            Endpoints::Sentinels(sentinels) => ask_sentinels(sentinels, &self.config, waiter, deadline)?,
            Endpoints::Amqp(_) | Endpoints::Kafka(_) => unreachable!("only Redis URLs make a Redis sink"),
        };
        let sentinel = matches!(self.url.endpoints, Endpoints::Sentinels(_));
        self.master = Some(format!("{host}:{port}"));
        let mut link =
            Link::connect(&host, port, tls, waiter, deadline).map_err(|e| SinkError::from_link(e, false))?;

        let mut commands = Vec::new();
        let mut checked = 0;
        if let Some(password) = &password {
            match &self.url.username {
                Some(user) => resp::command(&mut commands, &["AUTH", user, password]),
                None => resp::command(&mut commands, &["AUTH", password]),
            }
            checked += 1;
        }
        if self.url.db != 0 {
            resp::command(&mut commands, &["SELECT", &self.url.db.to_string()]);
            checked += 1;
        }
        resp::command(&mut commands, &["PING"]);
        resp::command(&mut commands, &["CONFIG", "GET", "save"]);
        resp::command(&mut commands, &["CONFIG", "GET", "appendonly"]);
        if sentinel {
            resp::command(&mut commands, &["ROLE"]);
        }
        let replies = link
            .round_trip(&commands, checked + 3 + usize::from(sentinel), waiter, deadline)
            .map_err(|e| SinkError::from_link(e, false))?;
        // AUTH, SELECT and PING must succeed; CONFIG may be refused by ACLs.
        // A server's error text may quote a command's arguments (an unknown
        // command's does): never the password, nor the user name.
        let secrets = [password.as_deref(), self.url.username.as_deref()];
        if let (Some(_), Reply::Error(e)) = (&password, &replies[0]) {
            return Err(SinkError::Connect(format!("AUTH refused: {}", scrub(e, &secrets))));
        }
        for reply in &replies[..checked] {
            match reply {
                Reply::Status(ok) if ok == "OK" => {}
                Reply::Error(e) => return Err(SinkError::from_reply(&scrub(e, &secrets), false)),
                other => return Err(not_redis(&format!("AUTH or SELECT answered {}", other.describe()))),
            }
        }
        match &replies[checked] {
            Reply::Status(pong) if pong == "PONG" => {}
            Reply::Error(e) => return Err(SinkError::from_reply(&scrub(e, &secrets), false)),
            other => return Err(not_redis(&format!("PING answered {}", other.describe()))),
        }
        if sentinel {
            // Between a failover and the sentinels' noticing it, they may
            // still name the old master; ROLE may be denied by ACLs.
            if let Reply::Array(Some(role)) = &replies[checked + 3] {
                match role.first().and_then(Reply::text) {
                    Some(role) if role != "master" => {
                        return Err(SinkError::Failover(format!(
                            "the sentinels name {host}:{port}, which is a {role}, as master \"{}\"",
                            self.config.sentinel_master
                        )))
                    }
                    _ => {}
                }
            }
        }
        let wanted = self.config.wait_replicas;
        if wanted > 0 {
            // Pushes to a master short of replicas would fail their WAIT and
            // be pushed again and again, each time a duplicate: wait for
            // the replicas here instead, before any push.
            let mut probe = Vec::new();
            resp::command(&mut probe, &["WAIT", &wanted.to_string(), &self.wait_millis()]);
            let replies =
                link.round_trip(&probe, 1, waiter, deadline).map_err(|e| SinkError::from_link(e, false))?;
            match &replies[0] {
                Reply::Integer(n) if *n >= i64::from(wanted) => {}
                other => {
                    let replicas =
                        if let Reply::Integer(n) = other { n.to_string() } else { other.describe() };
                    return Err(SinkError::Refused(
                        Condition::NoReplicas,
                        format!("NOREPLICAS {host}:{port} has {replicas} of the {wanted} replicas outbox.redis_wait_replicas asks for"),
                    ));
                }
            }
        }
        self.link = Some(link);
        Ok(persistence_from_config(&replies[checked + 1], &replies[checked + 2]))
    }

    /// How long a WAIT may take: half the deadline, the rest is the push's.
    fn wait_millis(&self) -> String {
        (self.config.timeout.as_millis() / 2).max(1).to_string()
    }

    /// One PING round trip; drops the connection when it fails.
    pub fn ping(&mut self, waiter: &mut dyn Wait) -> Result<(), SinkError> {
        self.call_expecting(&["PING"], "PONG", waiter)
    }

    /// Up to `max` reports from the head of list `key`, oldest first; they
    /// stay in the list until [`Sink::forget_reports`]. The inner error is
    /// the server refusing this read for a reason of the list's own (the
    /// key holds no list, an ACL): the connection stays. A report over
    /// [`report::MAX_REPORT_BYTES`] is cut to nothing on the server (a
    /// script: its bytes never travel), so the reply stays within the
    /// link's limits whatever a client of the broker appended; it then
    /// reads as malformed, and is counted and dropped like one. The reply
    /// ends with the digest of what was read, kept for the trim.
    pub fn reports(
        &mut self,
        key: &str,
        max: usize,
        waiter: &mut dyn Wait,
    ) -> Result<Result<Vec<Vec<u8>>, String>, SinkError> {
        const READ: &str = "local items = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1) \
                            if #items == 0 then return items end \
                            local read = digest(items) \
                            for i, item in ipairs(items) do \
                                if #item > tonumber(ARGV[2]) then items[i] = '' end \
                            end \
                            items[#items + 1] = read \
                            return items";
        self.read_digest = None;
        let script = format!("{DIGEST}{READ}");
        let (max, most) = (max.to_string(), report::MAX_REPORT_BYTES.to_string());
        let eval = if self.read_only_scripts { "EVAL_RO" } else { "EVAL" };
        let read = [eval, &script, "1", key, &max, &most];
        let reply = match self.exchange_within(&read, Limits::REPORTS, waiter)? {
            // A Redis before 7, or an ACL that denies EVAL_RO (and may
            // allow EVAL): EVAL from now on. When EVAL is denied too, the
            // denial was not EVAL_RO's: it is kept for the next read.
            Reply::Error(e)
                if self.read_only_scripts
                    && (e.starts_with("ERR unknown command")
                        || Condition::of(&e) == Some(Condition::NoPerm)) =>
            {
                self.read_only_scripts = false;
                let read = self.reports(key, max.parse().unwrap_or(0), waiter);
                if matches!(&read, Ok(Err(again)) if Condition::of(again) == Some(Condition::NoPerm)) {
                    self.read_only_scripts = true;
                }
                return read;
            }
            // The list's own fault (WRONGTYPE: the key is not a list), or
            // an ACL denying the script or the key (NOPERM): the read is
            // refused, the connection and the pushes go on.
            Reply::Error(e) if Condition::of(&e).is_none_or(|c| c == Condition::NoPerm) => {
                return Ok(Err(broker_text(&e)))
            }
            reply => self.answer(reply)?,
        };
        let mut items: Vec<Vec<u8>> = match reply {
            Reply::Array(Some(items)) => items
                .into_iter()
                .filter_map(|item| match item {
                    Reply::Bulk(Some(bytes)) => Some(bytes),
                    _ => None,
                })
                .collect(),
            Reply::Array(None) => Vec::new(),
            other => {
                return Err(self.fail(not_redis(&format!("the report read answered {}", other.describe()))))
            }
        };
        self.read_digest = items.pop().and_then(|digest| String::from_utf8(digest).ok());
        Ok(Ok(items))
    }

    /// Drops the first `n` reports of list `key`, once they are recorded:
    /// the ones [`Sink::reports`] read, as workers only append, and only if
    /// they are still the list's head (the same digest). Another collector
    /// that read and trimmed them first (two dispatchers that each believe
    /// they have the turn) leaves this trim nothing to do, rather than
    /// reports nobody read to drop. The inner error is an ACL denying the
    /// trim: the read's refusal, the connection stays.
    pub fn forget_reports(
        &mut self,
        key: &str,
        n: usize,
        waiter: &mut dyn Wait,
    ) -> Result<Result<(), String>, SinkError> {
        const TRIM: &str = "local items = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1) \
                            if #items == tonumber(ARGV[1]) and digest(items) == ARGV[2] then \
                                redis.call('LTRIM', KEYS[1], ARGV[1], -1) \
                                return 1 \
                            end \
                            return 0";
        let Some(digest) = self.read_digest.take() else {
            return Ok(Ok(()));
        };
        let script = format!("{DIGEST}{TRIM}");
        let trim = ["EVAL", &script, "1", key, &n.to_string(), &digest];
        match self.exchange_within(&trim, Limits::REPLY, waiter)? {
            Reply::Integer(_) => Ok(Ok(())),
            // The LTRIM in the script denied by an ACL that let the read's
            // LRANGE through: Redis 7.0 says only that the script's user
            // "can't run this command", later versions NOPERM.
            Reply::Error(e) if e.contains("can't run this command") => Ok(Err(format!(
                "NOPERM the ACL lets the reports be read but not trimmed (LTRIM): {}",
                broker_text(&e)
            ))),
            // As for the read: an ACL denying the script, or the list's
            // own fault.
            Reply::Error(e) if Condition::of(&e).is_none_or(|c| c == Condition::NoPerm) => {
                Ok(Err(broker_text(&e)))
            }
            reply @ Reply::Error(_) => self.answer(reply).map(|_| Ok(())),
            other => Err(self.fail(not_redis(&format!("the report trim answered {}", other.describe())))),
        }
    }

    /// One command, one round trip within the timeout, whose reply must be
    /// the status `expected`; an error reply is the server's condition, any
    /// other reply a server that is not Redis. Drops the connection when it
    /// fails.
    fn call_expecting(
        &mut self,
        args: &[&str],
        expected: &str,
        waiter: &mut dyn Wait,
    ) -> Result<(), SinkError> {
        match self.exchange_within(args, Limits::REPLY, waiter)? {
            Reply::Status(status) if status == expected => Ok(()),
            reply @ Reply::Error(_) => self.answer(reply).map(drop),
            other => Err(self.fail(not_redis(&format!("{} answered {}", args[0], other.describe())))),
        }
    }

    /// One command, one round trip within the timeout, its reply (within
    /// `limits`) as it came, errors included; drops the connection when
    /// the link fails.
    fn exchange_within(
        &mut self,
        args: &[&str],
        limits: Limits,
        waiter: &mut dyn Wait,
    ) -> Result<Reply, SinkError> {
        let deadline = self.deadline();
        let link = self.link.as_mut().ok_or(SinkError::ConnectionLost("not connected".into()))?;
        let mut command = Vec::new();
        resp::command(&mut command, args);
        match link.round_trip_within(&command, 1, limits, waiter, deadline) {
            Ok(mut replies) => Ok(replies.swap_remove(0)),
            Err(e) => Err(self.fail(SinkError::from_link(e, true))),
        }
    }

    /// An error reply as the server's condition (the connection dropped);
    /// any other reply as it is.
    fn answer(&mut self, reply: Reply) -> Result<Reply, SinkError> {
        match reply {
            Reply::Error(e) => {
                let error = match Condition::of(&e) {
                    Some(condition) => self.refusal(condition, e),
                    None => SinkError::from_reply(&e, true),
                };
                Err(self.fail(error))
            }
            reply => Ok(reply),
        }
    }

    /// Pushes every batch, in as few round trips as `max_batch_bytes`
    /// allows, each with its own deadline. When a round trip fails (the
    /// connection, the deadline), the messages of the round trips before it
    /// keep what their replies said, and the rest are [`Delivery::Unsent`].
    pub fn push(&mut self, batches: &[KeyBatch], waiter: &mut dyn Wait) -> Pushed {
        let total = batches.iter().map(|b| b.messages.len()).sum();
        let mut deliveries = Vec::with_capacity(total);
        for trip in plan_round_trips(batches, self.config.max_batch_bytes) {
            match self.push_round_trip(batches, &trip, waiter) {
                Ok(confirmed) => deliveries.extend(confirmed),
                Err(failure) => {
                    deliveries.resize(total, Delivery::Unsent);
                    return Pushed { deliveries, failure: Some(failure) };
                }
            }
        }
        Pushed { deliveries, failure: None }
    }

    /// One round trip of a push: the deliveries of its messages.
    fn push_round_trip(
        &mut self,
        batches: &[KeyBatch],
        trip: &RoundTrip,
        waiter: &mut dyn Wait,
    ) -> Result<Vec<Delivery>, SinkError> {
        let mut commands = Vec::with_capacity(trip.bytes);
        for command in &trip.commands {
            let messages = &batches[command.batch].messages[command.messages.clone()];
            resp::command_with_values(&mut commands, "LPUSH", &batches[command.batch].key, messages);
        }
        let wait = self.config.wait_replicas;
        if wait > 0 {
            resp::command(&mut commands, &["WAIT", &wait.to_string(), &self.wait_millis()]);
        }
        // A PING with a fresh nonce closes the round trip: its answer must
        // be the last reply, so that a reply too many or too few anywhere
        // in the pipeline shifts it and the round trip counts for nothing,
        // rather than one command's reply being taken for another's.
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        resp::command(&mut commands, &["PING", &nonce]);
        let expected = trip.commands.len() + usize::from(wait > 0) + 1;
        let deadline = self.deadline();
        let link = self.link.as_mut().ok_or(SinkError::ConnectionLost("not connected".into()))?;
        let mut replies = match link.round_trip(&commands, expected, waiter, deadline) {
            Ok(replies) => replies,
            Err(e) => return Err(self.fail(SinkError::from_link(e, true))),
        };
        match replies.pop() {
            Some(Reply::Bulk(Some(echoed))) if echoed == nonce.as_bytes() => {}
            other => {
                let answered = other.as_ref().map_or("nothing".into(), Reply::describe);
                return Err(
                    self.fail(not_redis(&format!("the round trip's closing PING answered {answered}")))
                );
            }
        }
        // Fewer replicas than asked have the messages: not delivered yet,
        // as far as a failover is concerned.
        let unreplicated = match (wait > 0).then(|| replies.pop()).flatten() {
            Some(Reply::Integer(n)) if n >= i64::from(wait) => None,
            Some(Reply::Integer(n)) => Some(format!("NOREPLICAS {n} of {wait} replicas confirmed (WAIT)")),
            Some(other) => Some(format!("NOREPLICAS WAIT answered {}", other.describe())),
            None => None,
        };
        let mut deliveries = Vec::new();
        for (command, reply) in trip.commands.iter().zip(replies) {
            let delivery = match (reply, &unreplicated) {
                (Reply::Error(e), _) => match Condition::of(&e) {
                    Some(condition) => Delivery::Refused(condition, e),
                    None => Delivery::Rejected(e),
                },
                // LPUSH answers the list's length, at least what it pushed:
                // anything else is not Redis having stored them.
                (Reply::Integer(n), _) if n < command.messages.len() as i64 => {
                    return Err(self.fail(not_redis(&format!(
                        "LPUSH of {} messages answered the integer {n}",
                        command.messages.len()
                    ))))
                }
                (Reply::Integer(_), Some(e)) => Delivery::Refused(Condition::NoReplicas, e.clone()),
                (Reply::Integer(_), None) => Delivery::Delivered,
                (other, _) => {
                    return Err(self.fail(not_redis(&format!("LPUSH answered {}", other.describe()))))
                }
            };
            deliveries.extend(std::iter::repeat_n(delivery, command.messages.len()));
        }
        Ok(deliveries)
    }

    fn fail(&mut self, error: SinkError) -> SinkError {
        self.link = None;
        error
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::Poll;
    use crate::sink::Reason;
    use std::path::PathBuf;
    use std::time::Duration;

    fn config(url: &str) -> BrokerConfig {
        BrokerConfig::plain(url, Duration::from_secs(1), 1 << 20)
    }

    fn redis_sink(config: &BrokerConfig) -> Result<RedisSink, SinkError> {
        let url = BrokerUrl::parse(&config.url).map_err(SinkError::InvalidConfig)?;
        RedisSink::new(config, url)
    }

    fn batch(key: &str, sizes: &[usize]) -> KeyBatch {
        KeyBatch { key: key.into(), messages: sizes.iter().map(|n| "m".repeat(*n)).collect() }
    }

    #[test]
    fn persistence_is_read_from_the_configuration() {
        let pair = |name: &str, value: &str| {
            Reply::Array(Some(vec![Reply::Bulk(Some(name.into())), Reply::Bulk(Some(value.into()))]))
        };
        let p = |save, aof| persistence_from_config(&pair("save", save), &pair("appendonly", aof));
        assert_eq!(p("", "no"), Persistence::None);
        assert_eq!(p("3600 1 300 100", "no"), Persistence::Snapshots);
        assert_eq!(p("", "yes"), Persistence::AppendOnly);
        assert_eq!(p("60 1", "yes"), Persistence::SnapshotsAndAppendOnly);
        let refused = Reply::Error("NOPERM".into());
        assert_eq!(persistence_from_config(&refused, &refused), Persistence::Unknown);
    }

    /// A peer on loopback that reads whatever comes and answers each read
    /// with what `answer` makes of it (its commands, as bytes).
    fn fake(answer: impl Fn(&[u8]) -> Vec<u8> + Send + 'static) -> String {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("redis://:hunter2@{}/0", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut buf = [0u8; 65536];
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 || stream.write_all(&answer(&buf[..n])).is_err() {
                        break;
                    }
                }
            }
        });
        url
    }

    /// Redis's answers to a connect without SELECT (AUTH, PING, CONFIG GET
    /// twice), for fakes that misbehave only after.
    const CONNECTED: &[u8] =
        b"+OK\r\n+PONG\r\n*2\r\n$4\r\nsave\r\n$0\r\n\r\n*2\r\n$10\r\nappendonly\r\n$2\r\nno\r\n";

    #[test]
    fn an_echo_confirms_nothing() {
        // A peer that sends every command back (as an array) is no Redis:
        // its connect is refused, and so would be its answer to LPUSH.
        let url = fake(|commands| commands.to_vec());
        let err = redis_sink(&config(&url)).unwrap().connect(&mut Poll).unwrap_err();
        assert!(err.to_string().contains("protocol error: AUTH or SELECT answered an array"), "{err}");
        let url = fake(|commands| {
            if commands.windows(5).any(|w| w == b"LPUSH") {
                commands.to_vec()
            } else {
                CONNECTED.to_vec()
            }
        });
        let mut sink = redis_sink(&config(&url)).unwrap();
        sink.connect(&mut Poll).unwrap();
        let pushed = sink.push(&[batch("q", &[1, 1])], &mut Poll);
        assert_eq!(pushed.deliveries, [Delivery::Unsent, Delivery::Unsent]);
        assert!(pushed.failure.unwrap().to_string().contains("protocol error"));
        // An integer below what was pushed is no confirmation either.
        let url = fake(|commands| {
            if commands.windows(5).any(|w| w == b"LPUSH") {
                b":1\r\n".to_vec()
            } else {
                CONNECTED.to_vec()
            }
        });
        let mut sink = redis_sink(&config(&url)).unwrap();
        sink.connect(&mut Poll).unwrap();
        assert_eq!(
            sink.push(&[batch("q", &[1, 1])], &mut Poll).deliveries,
            [Delivery::Unsent, Delivery::Unsent]
        );
    }

    #[test]
    fn a_reply_too_many_in_a_round_trip_makes_it_count_for_nothing() {
        // Two lists, two LPUSHes: the peer answers the first with an error
        // and slips in an extra integer before the closing PING's answer;
        // arriving late (after the replies were read), it would shift the
        // PING's answer instead. Either way nothing of it counts.
        let url = fake(|commands| {
            if !commands.windows(5).any(|w| w == b"LPUSH") {
                return CONNECTED.to_vec();
            }
            let nonce = &commands[commands.len() - 34..commands.len() - 2];
            let mut answer = b"-ERR x\r\n:2\r\n:2\r\n$32\r\n".to_vec();
            answer.extend_from_slice(nonce);
            answer.extend_from_slice(b"\r\n");
            answer
        });
        let mut sink = redis_sink(&config(&url)).unwrap();
        sink.connect(&mut Poll).unwrap();
        let pushed = sink.push(&[batch("a", &[1]), batch("b", &[1])], &mut Poll);
        assert_eq!(pushed.deliveries, [Delivery::Unsent, Delivery::Unsent]);
        let failure = pushed.failure.unwrap().to_string();
        assert!(failure.contains("protocol error"), "{failure}");
    }

    #[test]
    fn a_large_answer_where_a_small_one_is_due_is_refused_from_its_header() {
        // A bulk string of 1 MiB answering LPUSH: refused before its bytes
        // are read, and never printed.
        let url = fake(|commands| {
            if commands.windows(5).any(|w| w == b"LPUSH") {
                let mut answer = b"$1048576\r\n".to_vec();
                answer.resize(answer.len() + 1048576, b'x');
                answer
            } else {
                CONNECTED.to_vec()
            }
        });
        let mut sink = redis_sink(&config(&url)).unwrap();
        sink.connect(&mut Poll).unwrap();
        let pushed = sink.push(&[batch("q", &[1; 100])], &mut Poll);
        let failure = pushed.failure.expect("refused").to_string();
        assert!(failure.contains("a bulk string of 1048576 bytes"), "{failure}");
        assert!(failure.len() < 200, "{failure}");
        assert!(pushed.deliveries.iter().all(|d| *d == Delivery::Unsent));
    }

    #[test]
    fn the_password_is_never_quoted_back() {
        // Redis quotes an unknown command's arguments: AUTH renamed away.
        let url = fake(|_| {
            b"-ERR unknown command 'AUTH', with args beginning with: 'hunter2'\r\n+PONG\r\n*0\r\n*0\r\n"
                .to_vec()
        });
        let err = redis_sink(&config(&url)).unwrap().connect(&mut Poll).unwrap_err();
        assert!(err.to_string().contains("AUTH refused: ERR unknown command"), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn a_malformed_url_is_refused_without_echoing_secrets() {
        let err = redis_sink(&config("redis://user:secret@host:notaport/0")).err().expect("refused");
        assert_eq!(err.reason(), Reason::InvalidConfig);
        assert!(!err.to_string().contains("secret"), "{err}");
    }

    #[test]
    fn an_unreadable_ca_file_is_refused_by_name() {
        let missing = PathBuf::from("/nonexistent/ca.pem");
        let tls = BrokerConfig { tls_ca_file: Some(missing.clone()), ..config("rediss://h:6379/0") };
        let err = redis_sink(&tls).unwrap().connect(&mut Poll).unwrap_err();
        assert_eq!(err.reason(), Reason::InvalidConfig);
        assert!(err.to_string().contains("outbox.broker_tls_ca_file /nonexistent/ca.pem"), "{err}");
        // Plain redis:// ignores the CA file: the refusal comes from port 1.
        let plain = BrokerConfig { tls_ca_file: Some(missing), ..config("redis://127.0.0.1:1/0") };
        assert_eq!(
            redis_sink(&plain).unwrap().connect(&mut Poll).unwrap_err().reason(),
            Reason::ConnectFailed
        );
    }

    #[test]
    fn an_unreadable_password_file_is_refused_by_name() {
        let broker = BrokerConfig { password_file: Some("/nonexistent/pw".into()), ..config("redis://h/0") };
        let err = redis_sink(&broker).unwrap().connect(&mut Poll).unwrap_err();
        assert!(err.to_string().contains("cannot read outbox.broker_password_file /nonexistent/pw"), "{err}");
    }

    #[test]
    fn an_unreachable_broker_is_a_connect_error() {
        // Port 1 on loopback: nothing listens there, the refusal is immediate.
        let mut sink = redis_sink(&config("redis://127.0.0.1:1/0")).unwrap();
        let err = sink.connect(&mut Poll).unwrap_err();
        assert!(matches!(err, SinkError::Connect(_)), "{err:?}");
        assert!(!sink.is_connected());
        let pushed = sink.push(&[batch("q", &[1])], &mut Poll);
        assert!(matches!(pushed.failure, Some(SinkError::ConnectionLost(_))));
        assert_eq!(pushed.deliveries, [Delivery::Unsent]);
    }

    #[test]
    fn a_silent_server_times_out_within_one_deadline() {
        // Accepts the connection (the kernel does, on listen) and never answers.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("redis://:pw@{}/0", listener.local_addr().unwrap());
        let started = Instant::now();
        let err = redis_sink(&config(&url)).unwrap().connect(&mut Poll).unwrap_err();
        assert_eq!(err, SinkError::Timeout);
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(3), "{took:?}");
    }

    /// A redis-server of our own on a free port, stopped when dropped.
    struct Server(std::process::Child, u16);

    impl Server {
        fn start(password: &str) -> Server {
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let child = std::process::Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .args(["--requirepass", password])
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("redis-server (make deps installs it)");
            let server = Server(child, port);
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                assert!(Instant::now() < deadline, "redis-server did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
            server
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn run(sink: &mut RedisSink, commands: &[u8], replies: usize) -> Vec<Reply> {
        let deadline = sink.deadline();
        sink.link.as_mut().unwrap().round_trip(commands, replies, &mut Poll, deadline).unwrap()
    }

    #[test]
    fn pushes_reach_a_real_redis_and_its_errors_are_told_apart() {
        let server = Server::start("s3cret");
        let url = format!("redis://:s3cret@127.0.0.1:{}/3", server.1);
        let mut sink = redis_sink(&BrokerConfig { max_batch_bytes: 100, ..config(&url) }).unwrap();
        assert_eq!(sink.connect(&mut Poll).unwrap(), Persistence::None);
        sink.ping(&mut Poll).unwrap();

        let mut admin = redis_sink(&config(&url)).unwrap();
        admin.connect(&mut Poll).unwrap();
        let mut setup = Vec::new();
        resp::command(&mut setup, &["SET", "wrong", "a string"]);
        run(&mut admin, &setup, 1);

        let pushed = sink.push(&[batch("q", &[60, 60, 60]), batch("wrong", &[5])], &mut Poll);
        assert_eq!(pushed.failure, None);
        let deliveries = pushed.deliveries;
        assert_eq!(deliveries[..3], [Delivery::Delivered, Delivery::Delivered, Delivery::Delivered]);
        assert!(
            matches!(&deliveries[3], Delivery::Rejected(e) if e.starts_with("WRONGTYPE")),
            "{deliveries:?}"
        );
        let mut length = Vec::new();
        resp::command(&mut length, &["LLEN", "q"]);
        let replies = run(&mut admin, &length, 1);
        assert_eq!(replies, [Reply::Integer(3)]);

        let mut full = Vec::new();
        resp::command(&mut full, &["CONFIG", "SET", "maxmemory", "1"]);
        resp::command(&mut full, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
        run(&mut admin, &full, 2);
        let deliveries = sink.push(&[batch("q", &[10])], &mut Poll).deliveries;
        assert!(matches!(&deliveries[0], Delivery::Refused(Condition::Oom, _)), "{deliveries:?}");

        let wrong = format!("redis://:wrong@127.0.0.1:{}/0", server.1);
        let err = redis_sink(&config(&wrong)).unwrap().connect(&mut Poll).unwrap_err();
        assert!(matches!(&err, SinkError::Connect(e) if e.starts_with("AUTH refused: WRONGPASS")), "{err:?}");
    }

    #[test]
    fn reports_are_read_then_forgotten_in_order() {
        let server = Server::start("s3cret");
        let url = format!("redis://:s3cret@127.0.0.1:{}/0", server.1);
        let mut sink = redis_sink(&config(&url)).unwrap();
        sink.connect(&mut Poll).unwrap();
        assert!(sink.reports("r", 2, &mut Poll).unwrap().unwrap().is_empty());
        let mut append = Vec::new();
        resp::command(&mut append, &["RPUSH", "r", "a", "b", "c"]);
        run(&mut sink, &append, 1);

        let first = sink.reports("r", 2, &mut Poll).unwrap().unwrap();
        assert_eq!(first, [b"a".to_vec(), b"b".to_vec()]);
        // Appended while the first two were being recorded.
        let mut more = Vec::new();
        resp::command(&mut more, &["RPUSH", "r", "d"]);
        run(&mut sink, &more, 1);
        sink.forget_reports("r", first.len(), &mut Poll).unwrap().unwrap();
        assert_eq!(sink.reports("r", 10, &mut Poll).unwrap().unwrap(), [b"c".to_vec(), b"d".to_vec()]);
        // A report over the limit never travels: it reads as empty.
        let huge = "x".repeat(report::MAX_REPORT_BYTES + 1);
        let mut more = Vec::new();
        resp::command(&mut more, &["RPUSH", "r", &huge, "e"]);
        run(&mut sink, &more, 1);
        assert_eq!(
            sink.reports("r", 10, &mut Poll).unwrap().unwrap(),
            [b"c".to_vec(), b"d".to_vec(), vec![], b"e".to_vec()]
        );
        // A key that holds no list: this read is refused, the link stays.
        let mut string = Vec::new();
        resp::command(&mut string, &["SET", "not_a_list", "x"]);
        run(&mut sink, &string, 1);
        assert!(sink.reports("not_a_list", 10, &mut Poll).unwrap().unwrap_err().starts_with("WRONGTYPE"));
        assert!(sink.is_connected());
    }

    #[test]
    fn two_collectors_reading_one_head_never_trim_reports_nobody_read() {
        let server = Server::start("s3cret");
        let url = format!("redis://:s3cret@127.0.0.1:{}/0", server.1);
        let (mut a, mut b) = (redis_sink(&config(&url)).unwrap(), redis_sink(&config(&url)).unwrap());
        a.connect(&mut Poll).unwrap();
        b.connect(&mut Poll).unwrap();
        let mut append = Vec::new();
        resp::command(&mut append, &["RPUSH", "r", "a", "b", "c", "d", "e"]);
        run(&mut a, &append, 1);
        let read_by_a = a.reports("r", 2, &mut Poll).unwrap().unwrap();
        let read_by_b = b.reports("r", 2, &mut Poll).unwrap().unwrap();
        assert_eq!(read_by_a, read_by_b);
        a.forget_reports("r", 2, &mut Poll).unwrap().unwrap();
        // The head is now "c", "d", which b did not read: kept. (Had they
        // been "a", "b" again, b would trim them: it recorded reports of
        // the very same bytes, which is all a report is.)
        b.forget_reports("r", 2, &mut Poll).unwrap().unwrap();
        assert_eq!(
            a.reports("r", 10, &mut Poll).unwrap().unwrap(),
            [b"c".to_vec(), b"d".to_vec(), b"e".to_vec()]
        );
        // Forgetting twice what was read once trims once.
        a.forget_reports("r", 3, &mut Poll).unwrap().unwrap();
        a.forget_reports("r", 3, &mut Poll).unwrap().unwrap();
        assert!(a.reports("r", 10, &mut Poll).unwrap().unwrap().is_empty());
    }

    /// A sink connected as a user the ACL allows everything but `denied`,
    /// to a server whose list `r` holds "a" (and the server, kept alive).
    fn denied_sink(denied: &str) -> (RedisSink, Server) {
        let server = Server::start("s3cret");
        let mut admin = redis_sink(&config(&format!("redis://:s3cret@127.0.0.1:{}/0", server.1))).unwrap();
        admin.connect(&mut Poll).unwrap();
        let mut setup = Vec::new();
        resp::command(&mut setup, &["ACL", "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all", denied]);
        resp::command(&mut setup, &["RPUSH", "r", "a"]);
        run(&mut admin, &setup, 2);
        let mut sink = redis_sink(&config(&format!("redis://limited:pw@127.0.0.1:{}/0", server.1))).unwrap();
        sink.connect(&mut Poll).unwrap();
        (sink, server)
    }

    #[test]
    fn a_trim_an_acl_denies_is_refused_and_the_link_stays() {
        let (mut sink, _server) = denied_sink("-ltrim");
        assert_eq!(sink.reports("r", 10, &mut Poll).unwrap().unwrap(), [b"a".to_vec()]);
        let refused = sink.forget_reports("r", 1, &mut Poll).unwrap().unwrap_err();
        assert!(
            refused.starts_with("NOPERM the ACL lets the reports be read but not trimmed (LTRIM)"),
            "{refused}"
        );
        assert!(sink.is_connected());
    }

    #[test]
    fn a_report_read_an_acl_denies_is_refused_and_the_link_stays() {
        let (mut sink, _server) = denied_sink("-@scripting");
        let refused = sink.reports("r", 10, &mut Poll).unwrap().unwrap_err();
        assert!(refused.starts_with("NOPERM"), "{refused}");
        assert!(sink.is_connected());
        assert_eq!(sink.push(&[batch("q", &[5])], &mut Poll).deliveries, [Delivery::Delivered]);
    }
}
