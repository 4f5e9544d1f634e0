//! The claim (sql/worker/lock_cursor.sql, then sql/worker/claim.sql): the
//! next page of the window the cursor reads, as one batch.

use outbox_core::report::send_of;
use pgrx::datum::DatumWithOid;
use pgrx::spi::{SpiClient, SpiError, SpiErrorCodes};

use super::{report_running, uuid_of, Batch, ClaimedEvent, Plans, Position};
use crate::keys::Key;

/// What one claim took.
pub struct Taken {
    pub events: Vec<ClaimedEvent>,
    /// The batch they make; `None` when nothing was claimed.
    pub batch: Option<Batch>,
    /// The claim read its window to the end: the next one starts a new
    /// window, with its own snapshot. Otherwise more is due at once.
    pub ended: bool,
}

/// A column the statement always fills came back empty.
fn missing() -> SpiError {
    SpiError::SpiError(SpiErrorCodes::NoAttribute)
}

/// Claims up to `limit` events for `dispatcher`: waits for the claim
/// before to commit, then reads with a snapshot taken after it.
pub fn claim(
    client: &mut SpiClient<'_>,
    plans: &Plans,
    dispatcher: i32,
    limit: usize,
) -> Result<Taken, SpiError> {
    report_running(&plans.lock_cursor.text);
    if client.update(&plans.lock_cursor.plan, None, &[])?.is_empty() {
        report_running(&plans.restore_turn.text);
        client.update(&plans.restore_turn.plan, None, &[])?;
        report_running(&plans.lock_cursor.text);
        client.update(&plans.lock_cursor.plan, None, &[])?;
    }
    let args: [DatumWithOid; 2] = [(limit as i32).into(), dispatcher.into()];
    report_running(&plans.claim.text);
    let table = client.update(&plans.claim.plan, None, &args)?;
    let mut taken = Taken { events: Vec::with_capacity(table.len()), batch: None, ended: true };
    for row in table {
        taken.ended = row.get::<bool>(21)?.unwrap_or(true);
        let Some(id) = row.get::<pgrx::Uuid>(1)? else {
            continue;
        };
        if taken.batch.is_none() {
            taken.batch = Some(Batch { id: row.get::<i64>(18)?.ok_or_else(missing)? });
        }
        let position: Position = row.get::<String>(14)?.ok_or_else(missing)?;
        let head = match (row.get::<bool>(15)?, row.get::<String>(16)?) {
            (Some(true), Some(ordering_key)) => {
                Some(Key { ordering_key, subscription: row.get::<i64>(17)?.unwrap_or(0) })
            }
            _ => None,
        };
        taken.events.push(ClaimedEvent {
            id: uuid_of(id),
            event_type: row.get(2)?.unwrap_or_default(),
            payload: row.get(3)?.unwrap_or_default(),
            queue: row.get(4)?.unwrap_or_default(),
            task: row.get(5)?.unwrap_or_default(),
            headers: row.get(6)?,
            priority: row.get::<i16>(7)?.unwrap_or(0).clamp(0, 9) as u8,
            retry_count: row.get(8)?.unwrap_or(0),
            created_at: row.get(9)?.unwrap_or_default(),
            created_epoch: row.get(10)?.unwrap_or(0.0),
            args: row.get(11)?,
            expires: row.get::<String>(12)?.zip(row.get::<f64>(13)?),
            send: send_of(row.get::<pgrx::Uuid>(19)?.map_or(uuid::Uuid::nil(), uuid_of), uuid_of(id)),
            position,
            head,
        });
    }
    // The page's order, (pending_xid, id): the order they are pushed in.
    taken.events.sort_by_cached_key(|e| (e.position.parse::<u64>().unwrap_or(u64::MAX), e.id));
    Ok(taken)
}
