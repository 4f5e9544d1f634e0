//! The claim (sql/worker/lock_cursor.sql, then sql/worker/claim.sql): the
//! next page of the window the cursor reads, as one batch.

use uuid::Uuid;

use super::sql::{get, take, Arg, DbError, Stmt, Tx};
use super::{Batch, ClaimedEvent, Key, Position};
use crate::report::send_of;

/// How much one claim may take: events (`outbox.batch_size`), and bytes
/// of what the dispatcher reads of them, their payloads, args and headers
/// as text (`outbox.max_batch_bytes`; an event larger comes alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub events: usize,
    pub bytes: usize,
}

/// What one claim took.
pub struct Taken {
    pub events: Vec<ClaimedEvent>,
    /// The batch they make; `None` when nothing was claimed.
    pub batch: Option<Batch>,
    /// It took every event in line: shorter than its bounds allow, and not
    /// for its bytes.
    pub drained: bool,
}

/// A column the statement always fills came back empty.
fn missing(column: &str) -> DbError {
    DbError::internal(format!("claim.sql returned no {column}"))
}

/// Claims what `bounds` allow for `dispatcher`: waits for the claim
/// before to commit, then reads with a snapshot taken after it.
pub fn claim(tx: &mut dyn Tx, dispatcher: i32, bounds: Bounds) -> Result<Taken, DbError> {
    if tx.run(Stmt::LockCursor, &[])?.touched == 0 {
        tx.run(Stmt::RestoreTurn, &[])?;
        tx.run(Stmt::LockCursor, &[])?;
    }
    let args = [
        Arg::Int4(Some(bounds.events.min(i32::MAX as usize) as i32)),
        Arg::Int4(Some(dispatcher)),
        Arg::Int8(Some(bounds.bytes.min(i64::MAX as usize) as i64)),
    ];
    let table = tx.run(Stmt::Claim, &args)?.rows;
    let mut taken = Taken { events: Vec::with_capacity(table.len()), batch: None, drained: true };
    for mut row in table {
        let row = &mut row[..];
        taken.drained = get::<bool>(row, 19)?.unwrap_or(true);
        let Some(id) = get::<Uuid>(row, 0)? else {
            continue;
        };
        if taken.batch.is_none() {
            taken.batch = Some(Batch { id: get::<i64>(row, 17)?.ok_or_else(|| missing("batch"))? });
        }
        let position: Position = take::<String>(row, 13)?.ok_or_else(|| missing("position"))?;
        let subscription = get::<i64>(row, 16)?.unwrap_or(0);
        let head = match (get::<bool>(row, 14)?, take::<String>(row, 15)?) {
            (Some(true), Some(ordering_key)) => Some(Key { ordering_key, subscription }),
            _ => None,
        };
        let expires = take::<String>(row, 11)?.zip(get::<f64>(row, 12)?);
        taken.events.push(ClaimedEvent {
            id,
            event_type: take(row, 1)?.unwrap_or_default(),
            payload: take(row, 2)?.unwrap_or_default(),
            queue: take(row, 3)?.unwrap_or_default(),
            task: take(row, 4)?.unwrap_or_default(),
            headers: take(row, 5)?,
            priority: get::<i64>(row, 6)?.unwrap_or(0).clamp(0, 9) as u8,
            retry_count: get::<i64>(row, 7)?.unwrap_or(0).clamp(0, i32::MAX as i64) as i32,
            created_at: take(row, 8)?.unwrap_or_default(),
            created_epoch: get(row, 9)?.unwrap_or(0.0),
            args: take(row, 10)?,
            expires,
            send: send_of(get::<Uuid>(row, 18)?.unwrap_or(Uuid::nil()), id),
            position,
            head,
            subscription,
            event_id: get::<Uuid>(row, 21)?,
            generation: get::<i64>(row, 20)?.ok_or_else(|| missing("generation"))? as i16,
            refused: None,
        });
    }
    // The page's order, (pending_xid, id): the order they are pushed in.
    taken.events.sort_by_cached_key(|e| (e.position.parse::<u64>().unwrap_or(u64::MAX), e.id));
    Ok(taken)
}
