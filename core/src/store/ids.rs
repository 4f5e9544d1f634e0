//! Ids a writer copies. An event's id is its Celery task's id, by which a
//! consumer's inbox knows a task it ran: a writer that wrote an event with
//! the id of another's still to be sent would have its own run in that
//! one's place, and the other dropped as run already. Each generation's
//! primary key refuses a copy within it; across generations, the claim
//! refuses one before it is sent: an event whose id an event of another
//! generation written no later already has is dead-lettered unsent
//! (sql/worker/reused.sql).
//!
//! Only ids that may be copies are looked up: an id made by
//! `outbox_uuid_v7()` (the default) once its event's generation had begun
//! (a minute's margin) names no event of another generation still kept,
//! which were all made before. Any other (a writer's own, another
//! version's) costs a look in each partition's primary key.

use uuid::Uuid;

use super::sql::{get, Arg, DbError, Stmt, Tx};
use super::ClaimedEvent;

/// Ids made this long after their generation began are its own.
const MARGIN_MS: f64 = 60_000.0;

/// Marks the events of `events` whose id copies an earlier event's as
/// refused.
pub fn refuse_copies(tx: &mut dyn Tx, events: &mut [ClaimedEvent]) -> Result<(), DbError> {
    if events.is_empty() {
        return Ok(());
    }
    let mut began = [f64::INFINITY; 3];
    for row in tx.run(Stmt::GenerationsBegan, &[])?.rows {
        if let (Some(generation), Some(at)) = (get::<i64>(&row, 0)?, get::<f64>(&row, 1)?) {
            if let Some(slot) = began.get_mut(generation as usize) {
                *slot = at;
            }
        }
    }
    let doubtful: Vec<usize> = (0..events.len())
        .filter(|&i| {
            let event = &events[i];
            let began = began.get(event.generation as usize).copied().unwrap_or(f64::INFINITY);
            made_at(event.id).is_none_or(|made| made < began + MARGIN_MS)
        })
        .collect();
    if doubtful.is_empty() {
        return Ok(());
    }
    let args = [
        Arg::UuidArray(doubtful.iter().map(|&i| events[i].id).collect()),
        Arg::Int8Array(doubtful.iter().map(|&i| i64::from(events[i].generation)).collect()),
        Arg::texts(doubtful.iter().map(|&i| events[i].created_at.clone())),
    ];
    let mut copies = Vec::new();
    for row in tx.run(Stmt::Reused, &args)?.rows {
        copies.extend(get::<Uuid>(&row, 0)?);
    }
    for event in events.iter_mut().filter(|e| copies.contains(&e.id)) {
        event.refused = Some(format!(
            "its id {} names an event written before it in another generation: not sent (an event's id \
             is its task's, which a consumer's inbox would take for that event's)",
            event.id
        ));
    }
    Ok(())
}

/// When a UUIDv7 was made, in milliseconds since the epoch (its first 48
/// bits); `None` for another version.
fn made_at(id: Uuid) -> Option<f64> {
    if id.get_version_num() != 7 {
        return None;
    }
    let b = id.as_bytes();
    Some(u64::from_be_bytes([0, 0, b[0], b[1], b[2], b[3], b[4], b[5]]) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_of_a_v7_id_is_its_first_48_bits() {
        let id = Uuid::parse_str("01890a5d-ac96-774b-bcce-b302099a8057").unwrap();
        assert_eq!(made_at(id), Some(1_688_096_058_518.0));
        assert_eq!(made_at(Uuid::new_v4()), None);
    }
}
