//! Where the scans of events out of line until due start in
//! `events_due_idx` (sql/worker/due_bound.sql, due_floor.sql): below the
//! floor, no such event waits, nor ever will. Under a pinned xmin (a long
//! transaction, a replication slot's, a standby's feedback) the entries of
//! every event that came due since stay in the index, dead but not
//! removable; each claim's scan from the index's start would read them
//! all, and a claim would cost as much as the pin is old.

use std::time::{Duration, Instant};

use super::sql::{get, Arg, DbError, Stmt, Tx};

/// How often the floor is raised: the dead entries a scan reads are at
/// most those of the events that came due in this long.
const RAISE_EVERY: Duration = Duration::from_secs(1);

/// The floor, in seconds since the Unix epoch.
#[derive(Debug, Clone, Copy)]
pub struct DueFloor {
    at: f64,
    raised: Option<Instant>,
}

impl Default for DueFloor {
    /// The index's start: nothing is known yet.
    fn default() -> Self {
        DueFloor { at: f64::NEG_INFINITY, raised: None }
    }
}

impl DueFloor {
    /// The floor, as the statements take it.
    pub fn arg(&self) -> Arg {
        Arg::Float8(self.at)
    }

    /// Raises the floor in `tx`, in two statements (the second's snapshot
    /// sees every writer the first did not), unless it was raised less
    /// than [`RAISE_EVERY`] ago. It may come down: a writer that started
    /// before it and took its lock since puts the bound below it.
    pub fn raise(&mut self, tx: &mut dyn Tx) -> Result<(), DbError> {
        if self.raised.is_some_and(|at| at.elapsed() < RAISE_EVERY) {
            return Ok(());
        }
        let bound = get::<f64>(&tx.run(Stmt::DueBound, &[])?.rows[0], 0)?.unwrap_or(f64::NEG_INFINITY);
        let floor = get::<f64>(&tx.run(Stmt::DueFloor, &[self.arg(), Arg::Float8(bound)])?.rows[0], 0)?;
        self.at = floor.unwrap_or(f64::NEG_INFINITY);
        self.raised = Some(Instant::now());
        Ok(())
    }
}
