//! The claim (sql/worker/claim.sql): the frontier's bounds in, the claimed
//! events and what moves the frontier out.

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiClient, SpiError, SpiErrorCodes};

use std::time::{Duration, Instant};

use outbox_core::frontier::{Bounds, Claimed, Frontier, Kind, Micros, Snapshot, Source, Xid};

use super::{pg_uuid, report_running, uuid_of, ClaimTime, ClaimedEvent, Plans};

/// What one claim took.
pub struct Taken {
    pub events: Vec<ClaimedEvent>,
    /// The claim's token; `None` when nothing was claimed.
    pub claimed_at: Option<ClaimTime>,
    /// What the frontier advances by once the claim commits.
    pub snapshot: Snapshot,
    pub now: Micros,
    pub read: Vec<Claimed>,
    /// How long the statement ran.
    pub took: Duration,
    /// Rows the scans locked differ from rows claimed (a row locked twice):
    /// nothing says how far the scans got.
    pub uncounted: bool,
}

impl Taken {
    /// Moves `frontier` past what this claim of up to `limit` rows within
    /// `bounds` read; once it has committed.
    pub fn advance(&self, frontier: &mut Frontier, bounds: &Bounds, limit: usize) {
        if self.uncounted {
            frontier.failed(bounds);
        } else {
            frontier.advance(bounds, limit, &self.snapshot, self.now, &self.read, self.took);
        }
    }
}

fn time(at: Micros) -> Option<TimestampWithTimeZone> {
    TimestampWithTimeZone::try_from(at).ok()
}

/// A column the statement always fills came back empty.
fn missing() -> SpiError {
    SpiError::SpiError(SpiErrorCodes::NoAttribute)
}

fn xid(text: Option<String>) -> Result<Xid, SpiError> {
    text.as_deref().and_then(|t| t.parse().ok()).ok_or_else(missing)
}

/// Claims up to `limit` events for `dispatcher` within `bounds`, as of
/// `claimed_at` (another claim's, whose batch these join) or now.
pub fn claim(
    client: &mut SpiClient<'_>,
    plans: &Plans,
    dispatcher: i32,
    limit: usize,
    bounds: &Bounds,
    claimed_at: Option<ClaimTime>,
) -> Result<Taken, SpiError> {
    let segments = &bounds.segments;
    let kind: Vec<&str> = segments
        .iter()
        .map(|s| match s.kind {
            Kind::Behind(_) => "behind",
            Kind::Fresh => "fresh",
            Kind::Sweep => "sweep",
        })
        .collect();
    let ended: Vec<Option<String>> = segments
        .iter()
        .map(|s| match s.kind {
            Kind::Behind(xid) => Some(xid.to_string()),
            _ => None,
        })
        .collect();
    let after_xid: Vec<String> = segments.iter().map(|s| s.after.0.to_string()).collect();
    let after_id: Vec<pgrx::Uuid> = segments.iter().map(|s| pg_uuid(s.after.1)).collect();
    let before: Vec<String> = segments.iter().map(|s| s.before.to_string()).collect();
    let behind: Vec<String> = bounds.behind.iter().map(|(x, _)| x.to_string()).collect();
    let behind_after: Vec<Option<pgrx::Uuid>> = bounds.behind.iter().map(|(_, a)| a.map(pg_uuid)).collect();
    let came_due = bounds.came_due;
    let args: [DatumWithOid; 16] = [
        (limit as i32).into(),
        dispatcher.into(),
        kind.into(),
        ended.into(),
        after_xid.into(),
        after_id.into(),
        before.into(),
        bounds.passed.0.to_string().into(),
        pg_uuid(bounds.passed.1).into(),
        behind.into(),
        behind_after.into(),
        came_due.and_then(|c| time(c.after.0)).into(),
        came_due.map(|c| pg_uuid(c.after.1)).into(),
        bounds.due_by.and_then(time).into(),
        came_due.and_then(|c| time(c.until)).into(),
        claimed_at.into(),
    ];
    report_running(&plans.claim.text);
    let started = Instant::now();
    // Every row carries the statement's own columns: read them once.
    let table = client.update(&plans.claim.plan, None, &args)?.first();
    let took = started.elapsed();
    let snapshot = Snapshot {
        xmax: xid(table.get(21)?)?,
        xip: table
            .get::<Vec<Option<String>>>(22)?
            .unwrap_or_default()
            .into_iter()
            .map(xid)
            .collect::<Result<_, _>>()?,
    };
    let now = table.get::<ClaimTime>(18)?.ok_or_else(missing)?.into_inner();
    let token = table.get::<ClaimTime>(19)?.ok_or_else(missing)?;
    let locked = table.get::<i64>(20)?.ok_or_else(missing)?;
    let table = table.rewind();
    let mut claimed = Taken {
        events: Vec::with_capacity(table.len()),
        claimed_at: None,
        snapshot,
        now,
        read: Vec::with_capacity(table.len()),
        took,
        uncounted: false,
    };
    for row in table {
        let Some(id) = row.get::<pgrx::Uuid>(1)? else {
            continue;
        };
        let id = uuid_of(id);
        claimed.events.push(ClaimedEvent {
            id,
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
            send: row.get::<pgrx::Uuid>(14)?.map_or(uuid::Uuid::nil(), uuid_of),
        });
        let source = match row.get::<i64>(15)? {
            Some(segment) => Source::Segment(segment as usize),
            None => Source::CameDue,
        };
        let available_at = row.get::<TimestampWithTimeZone>(17)?.ok_or_else(missing)?;
        claimed.read.push(Claimed {
            source,
            key: (xid(row.get(16)?)?, id),
            available_at: available_at.into_inner(),
        });
    }
    if !claimed.events.is_empty() {
        claimed.claimed_at = Some(token);
        claimed.uncounted = locked != claimed.events.len() as i64;
    }
    Ok(claimed)
}
