//! A pooler in transaction mode (pgbouncer's `pool_mode = transaction`,
//! Supabase's port 6543, Neon's `-pooler` endpoints) hands each
//! transaction of a connection to whichever server session is free: what
//! the sidecar keeps in its session (its settings, its prepared statements,
//! LISTEN, the lease of its dispatcher number, which lives with the
//! session) would be another client's between two of its transactions, and
//! two dispatchers would share one number. Such a connection is found out
//! as it is made, and refused.
//!
//! Found out how: a mark set in the session, and its backend's pid, must
//! stay from one transaction to the next, and must not show in another
//! connection made meanwhile, which holds a transaction open so that the
//! pooler cannot hand both the same session at once. Each query is a
//! simple one (no prepared statement, which such a pooler loses too) and
//! is cancelled after [`TIMEOUT`]: a pooler with no session free for the
//! second connection is refused as well.

use std::fmt;
use std::sync::mpsc;
use std::time::Duration;

use postgres::{Client, SimpleQueryMessage};

use crate::connect::{chain, Connector};

/// How long each query of the check may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Why a connection is not one to run on.
#[derive(Debug)]
pub enum Refusal {
    /// Its session is not its own: what was seen.
    Pooled(String),
    /// The check could not be made (a connection failed).
    Failed(String),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Pooled(seen) => write!(
                f,
                "the connection goes through a pooler in transaction mode ({seen}): the sidecar keeps its \
                 settings, prepared statements, LISTEN and the lease of its dispatcher number in its session, \
                 which such a pooler gives other clients between transactions, and two dispatchers would then \
                 share one number and send each other's batches again; connect to the server directly, or \
                 through a pooler in session mode (pgbouncer's pool_mode = session, Supabase's session port \
                 5432, Neon's endpoint without -pooler)"
            ),
            Refusal::Failed(why) => write!(f, "checking for a pooler: {why}"),
        }
    }
}

/// Refuses `client` when its session is not its own (see the module's
/// documentation); `connector` makes the second connection.
pub fn refuse_pooled(client: &mut Client, connector: &Connector) -> Result<(), Refusal> {
    let mark = uuid::Uuid::new_v4().simple().to_string();
    let first = ask(client, connector, &format!("{PID}, pg_catalog.set_config('{MARK}', '{mark}', false)"))?;
    let mut other = connector.connect(TIMEOUT).map_err(Refusal::Failed)?;
    // Its transaction held open: this connection's next cannot be in the
    // same session, but in its own.
    let held = ask(&mut other, connector, &format!("BEGIN; {PID}, {READ_MARK}"))?;
    if held.1 == mark || held.0 == first.0 {
        return Err(Refusal::Pooled(format!(
            "another connection was handed this connection's session, backend pid {}",
            held.0
        )));
    }
    let again = ask(client, connector, &format!("{PID}, {READ_MARK}"));
    drop(other);
    let again = again.map_err(|e| {
        Refusal::Pooled(format!(
            "with a second connection's transaction open, this connection had no session within {}s ({e})",
            TIMEOUT.as_secs()
        ))
    })?;
    if again.0 != first.0 {
        return Err(Refusal::Pooled(format!(
            "its backend pid was {} in one transaction and {} in the next",
            first.0, again.0
        )));
    }
    if again.1 != mark {
        return Err(Refusal::Pooled("a setting made in its session was gone in its next transaction".into()));
    }
    Ok(())
}

/// The mark's setting, and the queries of the check.
const MARK: &str = "outbox_dispatch.session";
const PID: &str = "SELECT pg_catalog.pg_backend_pid()::pg_catalog.text";
const READ_MARK: &str = "coalesce(pg_catalog.current_setting('outbox_dispatch.session', true), '')";

/// The first row's two columns of the simple query `sql` (the last
/// statement's), cancelled after [`TIMEOUT`].
fn ask(client: &mut Client, connector: &Connector, sql: &str) -> Result<(String, String), Refusal> {
    let token = client.cancel_token();
    let (done, finished) = mpsc::channel::<()>();
    let canceller = connector.clone();
    let timer = std::thread::spawn(move || {
        if finished.recv_timeout(TIMEOUT) == Err(mpsc::RecvTimeoutError::Timeout) {
            canceller.cancel(&token);
        }
    });
    let answered = client.simple_query(sql);
    drop(done);
    let _ = timer.join();
    let messages = answered.map_err(|e| Refusal::Failed(chain(&e)))?;
    messages
        .iter()
        .rev()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => {
                Some((row.get(0).unwrap_or_default().to_string(), row.get(1).unwrap_or_default().to_string()))
            }
            _ => None,
        })
        .ok_or_else(|| Refusal::Failed(format!("no row from: {sql}")))
}
