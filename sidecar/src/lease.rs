//! The leases the sidecars coordinate with (`sql/standalone/leases.sql`):
//! rows only the outbox's owner may write, each taken, renewed and given
//! back by a statement of its own on the dispatcher's own connection. A
//! dispatcher's number is its own while its session lives; a turn
//! (housekeeping, reports) is one dispatcher's while its session lives
//! and until it expires, renewed as it is used: a dispatcher that cannot
//! renew in time stops taking it.

use std::time::{Duration, Instant};

use postgres::Client;

use outbox_core::engine::Turn;

use crate::store::Session;

/// The most dispatchers one database's sidecars may run together.
pub const MAX_DISPATCHERS: i32 = 1000;
/// How long a turn is held without being renewed: longer than a turn's
/// use may take (a statement's deadline, `outbox.statement_timeout`, is a
/// minute by default), so that no other dispatcher takes it meanwhile.
const TURN_LEASE: Duration = Duration::from_secs(120);
/// A turn held for less than this longer is renewed as it is used (after
/// 20 seconds of use).
const RENEW_WITHIN: Duration = Duration::from_secs(100);
/// How long a lease statement may take.
const STATEMENT: Duration = Duration::from_secs(5);
/// A turn another dispatcher holds is asked for again after this.
const ASK_AGAIN: Duration = Duration::from_secs(1);
/// A turn unused this long is given back, for another dispatcher to take.
const TURN_IDLE: Duration = Duration::from_secs(2);

/// Why a lease could not be had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseError {
    /// Every number is held: by whom, the lowest first.
    NumbersTaken(String),
    /// The statement failed, or waited too long: what it waited for, where
    /// a session holds the table.
    Failed(String),
}

impl std::fmt::Display for LeaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeaseError::NumbersTaken(holders) => write!(
                f,
                "{MAX_DISPATCHERS} dispatchers serve this database already (outbox.sidecar_leases: {holders})"
            ),
            LeaseError::Failed(why) => f.write_str(why),
        }
    }
}

/// Takes the lowest dispatcher number free for this connection's session,
/// `holder` naming who holds it; held until the session ends.
pub fn take_number(client: &mut Client, holder: &str) -> Result<i32, LeaseError> {
    let taken = client
        .query_one("SELECT outbox.take_dispatcher_number($1, $2)", &[&holder, &MAX_DISPATCHERS])
        .map_err(|e| failed(client, "taking a dispatcher number", &e))?
        .get::<_, Option<i32>>(0);
    match taken {
        Some(n) => Ok(n),
        None => {
            let holders = client
                .query_one(
                    "SELECT pg_catalog.string_agg(pg_catalog.format('%s by %s (backend pid %s)', l.name, l.holder, \
                                                                     l.backend_pid), '; ' ORDER BY l.taken_at) \
                       FROM (SELECT * FROM outbox.sidecar_leases ORDER BY taken_at LIMIT 3) AS l",
                    &[],
                )
                .map_err(|e| failed(client, "reading who holds the dispatcher numbers", &e))?
                .get::<_, Option<String>>(0);
            Err(LeaseError::NumbersTaken(holders.unwrap_or_default()))
        }
    }
}

/// A statement on the leases failed: why, and, where it waited for a lock,
/// the sessions that hold one on the table (which only the owner's may).
fn failed(client: &mut Client, what: &str, error: &postgres::Error) -> LeaseError {
    let why = crate::connect::chain(error);
    let waited = error.as_db_error().is_some_and(|db| db.code().code() == "55P03");
    if !waited {
        return LeaseError::Failed(format!("{what}: {why}"));
    }
    let holders = client
        .query_one(
            "SELECT pg_catalog.string_agg(DISTINCT pg_catalog.format('role %s (pid %s, %s, %s since %s)', \
                                                 a.usename, a.pid, coalesce(a.application_name, ''), \
                                                 coalesce(a.state, '?'), coalesce(a.xact_start::text, '?')), '; ') \
               FROM pg_catalog.pg_locks AS l JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid \
              WHERE l.relation = 'outbox.sidecar_leases'::pg_catalog.regclass AND l.granted \
                AND l.pid <> pg_catalog.pg_backend_pid()",
            &[],
        )
        .ok()
        .and_then(|row| row.get::<_, Option<String>>(0));
    match holders {
        Some(holders) => LeaseError::Failed(format!(
            "{what}: waited for a lock on outbox.sidecar_leases ({why}), which {holders} holds: end it with \
             pg_terminate_backend(pid)"
        )),
        None => LeaseError::Failed(format!("{what}: {why}")),
    }
}

/// A turn as this dispatcher holds it.
#[derive(Clone, Copy)]
struct Held {
    /// It acts on the turn until then at the latest (the lease's expiry,
    /// counted from before the statement that renewed it).
    until: Instant,
    used: Instant,
}

/// The turns of one dispatcher.
#[derive(Default)]
pub struct Turns {
    held: [Option<Held>; Turn::COUNT],
    ask_after: [Option<Instant>; Turn::COUNT],
}

impl Turns {
    /// Whether this dispatcher has `turn` now: held and not about to
    /// expire, else taken or renewed on `session` for `holder`.
    pub fn take(&mut self, session: &Session, turn: Turn, holder: &str) -> Result<bool, LeaseError> {
        let now = Instant::now();
        let i = turn as usize;
        if let Some(held) = &mut self.held[i] {
            if held.until > now + RENEW_WITHIN {
                held.used = now;
                return Ok(true);
            }
        }
        if self.held[i].is_none() && self.ask_after[i].is_some_and(|after| now < after) {
            return Ok(false);
        }
        let sent = Instant::now();
        let ttl = format!("{} seconds", TURN_LEASE.as_secs());
        let taken = session
            .run(STATEMENT, |c| {
                let other = c
                    .query_one(
                        "SELECT outbox.take_lease($1, $2, $3::pg_catalog.text::pg_catalog.interval)",
                        &[&turn.name(), &holder, &ttl],
                    )
                    .map(|row| row.get::<_, Option<String>>(0));
                Ok(other.map_err(|e| failed(c, &format!("taking the {} turn", turn.name()), &e)))
            })
            .map_err(LeaseError::Failed)?;
        match taken {
            Ok(None) => {
                self.held[i] = Some(Held { until: sent + TURN_LEASE, used: now });
                Ok(true)
            }
            Ok(Some(_other)) => {
                self.held[i] = None;
                self.ask_after[i] = Some(now + ASK_AGAIN);
                Ok(false)
            }
            Err(e) => {
                // Not renewed: it acts on the turn no longer.
                self.held[i] = None;
                self.ask_after[i] = Some(now + ASK_AGAIN);
                Err(e)
            }
        }
    }

    /// Gives back the turns unused for [`TURN_IDLE`]: a dispatcher that
    /// stops collecting (its broker is down) or whose housekeeping is done
    /// lets another take them at once.
    pub fn give_back_idle(&mut self, session: &Session) -> Result<(), LeaseError> {
        let now = Instant::now();
        for turn in Turn::ALL {
            let i = turn as usize;
            if self.held[i].is_none_or(|held| now < held.used + TURN_IDLE) {
                continue;
            }
            self.held[i] = None;
            session
                .run(STATEMENT, |c| c.execute("SELECT outbox.give_lease($1)", &[&turn.name()]))
                .map_err(|why| LeaseError::Failed(format!("giving the {} turn back: {why}", turn.name())))?;
        }
        Ok(())
    }
}
