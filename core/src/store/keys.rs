//! Per-key order (docs/guides/per-key-order.md): passing a key on, with the SQL
//! in sql/keys/.
//!
//! An event with an `ordering_key` takes its turn as it is inserted
//! (`outbox_take_turn()`): under its key's advisory lock, held to its
//! commit, it gets the next `key_seq` and becomes the key's head, or waits
//! behind the key's unfinished events. Only heads are claimed. When a head
//! is finished, the statement that finished it passes the key on
//! ([`pass`]): the next waiting event becomes the head.

use std::collections::HashSet;

use uuid::Uuid;

use super::sql::{get, Arg, DbError, Stmt, Tx, Value};

/// The key of an event: its `ordering_key`, and its subscription (0 for an
/// event's own key: a delivery's key is its subscription's).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    pub ordering_key: String,
    pub subscription: i64,
}

/// A finished head, which lets its key go.
#[derive(Debug, Clone)]
pub struct Head {
    pub id: Uuid,
    pub key: Key,
}

/// When the head of a key is finished, besides once processed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyPolicy {
    /// Once dispatched: no worker reports it and nobody acknowledges it
    /// (`outbox.report_key` empty, `outbox.ack_timeout` 0).
    pub dispatched: bool,
    /// Once dead-lettered (`outbox.key_on_failure = continue`).
    pub failed: bool,
}

/// What [`pass`] did.
#[derive(Debug, Default)]
pub struct Passed {
    /// Heads that let their key go.
    pub passed: u64,
    /// Events that became their key's head.
    pub promoted: u64,
    /// Heads left holding their key: its lock was taken (a producer of the
    /// key had not committed yet). To pass again later.
    pub deferred: Vec<Head>,
}

/// Passes on the keys of `heads` that are `finished` (processed, or as the
/// policy says), and starts the `stranded` keys (events waiting, no head),
/// in the current transaction: first their locks (sql/keys/lock.sql;
/// waiting for them with `wait`, else only the free ones), then, in a
/// statement that sees what their producers committed meanwhile, the
/// passing (sql/keys/pass.sql).
pub fn pass(
    tx: &mut dyn Tx,
    heads: Vec<Head>,
    stranded: &[Key],
    finished: KeyPolicy,
    wait: bool,
) -> Result<Passed, DbError> {
    if heads.is_empty() && stranded.is_empty() {
        return Ok(Passed::default());
    }
    let keys = heads.iter().map(|h| &h.key).chain(stranded);
    let args = [
        Arg::texts(keys.clone().map(|k| k.ordering_key.clone())),
        Arg::Int8Array(keys.map(|k| k.subscription).collect()),
        Arg::Bool(wait),
    ];
    let mut locked = HashSet::new();
    for row in tx.run(Stmt::LockKeys, &args)?.rows {
        let ordering_key = get::<String>(&row, 0)?.unwrap_or_default();
        locked.insert(Key { ordering_key, subscription: get::<i64>(&row, 1)?.unwrap_or(0) });
    }
    let (ready, deferred): (Vec<Head>, Vec<Head>) = heads.into_iter().partition(|h| locked.contains(&h.key));
    let stranded: Vec<&Key> = stranded.iter().filter(|k| locked.contains(*k)).collect();
    let args = [
        Arg::UuidArray(ready.iter().map(|h| h.id).collect()),
        Arg::texts(stranded.iter().map(|k| k.ordering_key.clone())),
        Arg::Int8Array(stranded.iter().map(|k| k.subscription).collect()),
        Arg::Bool(finished.failed),
        Arg::Bool(finished.dispatched),
    ];
    let counts = tx.run(Stmt::PassKeys, &args)?;
    let row = counts.rows.first().map(Vec::as_slice).unwrap_or_default();
    let count = |n| get::<i64>(row, n).map(|c| c.unwrap_or(0) as u64);
    Ok(Passed { passed: count(0)?, promoted: count(1)?, deferred })
}

/// A head read from a row: columns `id`, `ordering_key` and subscription
/// (0 for none) at `first`, `first + 1`, `first + 2` (from 0); `None` for
/// an event without a key.
pub fn head_of(row: &[Value], first: usize) -> Result<Option<Head>, DbError> {
    let (Some(id), Some(ordering_key)) = (get::<Uuid>(row, first)?, get::<String>(row, first + 1)?) else {
        return Ok(None);
    };
    let subscription = get::<i64>(row, first + 2)?.unwrap_or(0);
    Ok(Some(Head { id, key: Key { ordering_key, subscription } }))
}

/// The key event `id` holds, if it is its key's head; once its lock is
/// taken, waiting for a producer of the key to commit: for `outbox_ack()`
/// and `outbox_skip()`, before they change the event (they then hold no
/// lock of its row while they wait, which a dispatcher would wait for).
pub fn lock_key_of(tx: &mut dyn Tx, id: Uuid) -> Result<Option<Key>, DbError> {
    let held = tx.run(Stmt::KeyOf, &[Arg::Uuid(Some(id))])?;
    let Some(row) = held.rows.first() else {
        return Ok(None);
    };
    let key = Key {
        ordering_key: get::<String>(row, 0)?.unwrap_or_default(),
        subscription: get::<i64>(row, 1)?.unwrap_or(0),
    };
    let args =
        [Arg::texts([key.ordering_key.clone()]), Arg::Int8Array(vec![key.subscription]), Arg::Bool(true)];
    tx.run(Stmt::LockKeys, &args)?;
    Ok(Some(key))
}

/// The heads of keys a transaction finished, to pass on before it commits.
pub(super) struct Turns {
    policy: KeyPolicy,
    /// Finished heads not passed on yet.
    pub(super) heads: Vec<Head>,
    /// Events that became their key's head.
    pub(super) promoted: u64,
}

impl Turns {
    pub(super) fn new(policy: KeyPolicy, heads: Vec<Head>) -> Turns {
        Turns { policy, heads, promoted: 0 }
    }

    /// `head` was processed.
    pub(super) fn finished(&mut self, head: Option<Head>) {
        self.heads.extend(head);
    }

    /// `head` was sent: finished when nothing reports or acknowledges it.
    pub(super) fn dispatched(&mut self, head: Option<Head>) {
        self.heads.extend(head.filter(|_| self.policy.dispatched));
    }

    /// `head` was dead-lettered: it holds its key unless
    /// `outbox.key_on_failure = continue`.
    pub(super) fn failed(&mut self, head: Option<Head>) {
        self.heads.extend(head.filter(|_| self.policy.failed));
    }

    /// Passes the keys on; those a producer holds locked are kept for the
    /// next transaction.
    pub(super) fn pass(&mut self, tx: &mut dyn Tx) -> Result<(), DbError> {
        let heads = std::mem::take(&mut self.heads);
        let passed = pass(tx, heads, &[], self.policy, false)?;
        if passed.promoted > 0 {
            // The new heads may be claimed and sent right after this
            // commits: it must outlive a crash, or the heads that let their
            // keys go would be sent again after them.
            tx.durable_commit()?;
        }
        self.promoted += passed.promoted;
        self.heads = passed.deferred;
        Ok(())
    }
}
