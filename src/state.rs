//! What became of an event in line, for the view `outbox.events`
//! (sql/events.sql): `outbox.state_at(pending_xid, id)` and
//! `outbox.batch_at(pending_xid, id)`, called once per row it reads.
//!
//! Each call site keeps, for the rest of its statement, where the claims
//! have read up to (`outbox.cursor`: a place not read yet is pending) and
//! the last batch it found (its page of a window, whether it was marked
//! or abandoned, and the events it holds an outcome of), and asks
//! `outbox.held_by()` only for a read place outside that page. A statement
//! reads the log mostly in place order, a hundred events a batch: a row
//! costs a comparison of its place, not an index probe.

use std::collections::HashSet;
use std::ffi::{c_char, CStr, CString};

use pgrx::prelude::*;

use outbox_core::place::{Cursor, Page, Place, Snapshot};

/// The batch a call site found last, with what it needs to answer.
struct Held {
    id: i64,
    page: Page,
    marked: bool,
    abandoned: bool,
    /// The events it holds an outcome of (`outbox.state_at()` only).
    outcomes: Option<HashSet<[u8; 16]>>,
}

/// What a call site keeps for its statement (in `fn_extra`).
#[derive(Default)]
struct Site {
    /// Where the claims have read up to, as the statement sees it.
    cursor: Option<Cursor>,
    held: Option<Held>,
    /// The values of `outbox.event_status`: pending, processing,
    /// dispatched, processed.
    statuses: Option<[pg_sys::Datum; 4]>,
}

/// The statements a miss runs, prepared once per backend.
struct Statement {
    sql: &'static str,
    types: &'static [pg_sys::Oid],
    plan: &'static std::thread::LocalKey<std::cell::Cell<pg_sys::SPIPlanPtr>>,
}

thread_local! {
    static HELD_BY_PLAN: std::cell::Cell<pg_sys::SPIPlanPtr> = const { std::cell::Cell::new(std::ptr::null_mut()) };
    static OUTCOMES_PLAN: std::cell::Cell<pg_sys::SPIPlanPtr> = const { std::cell::Cell::new(std::ptr::null_mut()) };
    static CURSOR_PLAN: std::cell::Cell<pg_sys::SPIPlanPtr> = const { std::cell::Cell::new(std::ptr::null_mut()) };
}

static CURSOR: Statement =
    Statement { sql: include_str!("../sql/state/cursor.sql"), types: &[], plan: &CURSOR_PLAN };

static HELD_BY: Statement = Statement {
    sql: include_str!("../sql/state/held_by.sql"),
    types: &[pg_sys::XID8OID, pg_sys::UUIDOID],
    plan: &HELD_BY_PLAN,
};

static OUTCOMES_OF: Statement = Statement {
    sql: include_str!("../sql/state/outcomes_of.sql"),
    types: &[pg_sys::INT8OID],
    plan: &OUTCOMES_PLAN,
};

/// `outbox.state_at(pending_xid xid8, id uuid) RETURNS outbox.event_status`
/// (STRICT): pending (not read yet, no batch holds its place, or the one
/// that did was abandoned), processed (an outcome), processing (its batch
/// not marked), or dispatched (marked).
///
/// # Safety
/// Called by the function manager, as declared in sql/events.sql.
#[no_mangle]
#[pg_guard]
pub unsafe extern "C-unwind" fn outbox_state_at(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the function manager's call, with two arguments not null.
    unsafe {
        let (site, place) = site_and_place(fcinfo);
        let statuses = *site.statuses.get_or_insert_with(|| {
            ["pending", "processing", "dispatched", "processed"]
                .map(|label| pgrx::enum_helper::lookup_enum_by_label("outbox.event_status", label))
        });
        if !site.cursor.get_or_insert_with(cursor).read(&place) {
            return statuses[0];
        }
        let status = match holding(site, &place) {
            None => 0,
            Some(held) => {
                let outcomes = held.outcomes.get_or_insert_with(|| outcomes_of(held.id));
                match (outcomes.contains(&place.1), held.abandoned, held.marked) {
                    (true, _, _) => 3,
                    (false, true, _) => 0,
                    (false, false, false) => 1,
                    (false, false, true) => 2,
                }
            }
        };
        statuses[status]
    }
}

/// `outbox.batch_at(pending_xid xid8, id uuid) RETURNS bigint` (STRICT):
/// the batch that holds the place, NULL when none does or it was
/// abandoned.
///
/// # Safety
/// Called by the function manager, as declared in sql/events.sql.
#[no_mangle]
#[pg_guard]
pub unsafe extern "C-unwind" fn outbox_batch_at(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the function manager's call, with two arguments not null.
    unsafe {
        let (site, place) = site_and_place(fcinfo);
        match holding(site, &place).filter(|held| !held.abandoned) {
            Some(held) => pg_sys::Datum::from(held.id),
            None => {
                (*fcinfo).isnull = true;
                pg_sys::Datum::from(0)
            }
        }
    }
}

#[no_mangle]
pub extern "C" fn pg_finfo_outbox_state_at() -> &'static pg_sys::Pg_finfo_record {
    &V1
}

#[no_mangle]
pub extern "C" fn pg_finfo_outbox_batch_at() -> &'static pg_sys::Pg_finfo_record {
    &V1
}

static V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };

/// The call site's state, made in its memory context the first time and
/// dropped with it; and the place the call asks about.
///
/// # Safety
/// `fcinfo` is a call of a function declared `(xid8, uuid)` STRICT.
unsafe fn site_and_place<'a>(fcinfo: pg_sys::FunctionCallInfo) -> (&'a mut Site, Place) {
    // SAFETY: as the caller promises; fn_extra is this module's alone.
    unsafe {
        let flinfo = (*fcinfo).flinfo;
        if (*flinfo).fn_extra.is_null() {
            let site =
                pgrx::PgMemoryContexts::For((*flinfo).fn_mcxt).leak_and_drop_on_delete(Site::default());
            (*flinfo).fn_extra = site.cast();
        }
        let args = (*fcinfo).args.as_slice(2);
        let xid = args[0].value.value() as u64;
        let id = *(args[1].value.cast_mut_ptr::<[u8; 16]>());
        (&mut *(*flinfo).fn_extra.cast::<Site>(), (xid, id))
    }
}

/// The batch that holds `place`: the one kept when its page does, else
/// the one `outbox.held_by()` finds (kept in its place).
fn holding<'a>(site: &'a mut Site, place: &Place) -> Option<&'a mut Held> {
    if !site.held.as_ref().is_some_and(|held| held.page.holds(place)) {
        // A place no batch holds (not read yet, a restore's): asked again
        // next time, the kept batch left as it was.
        let found = held_by(place)?;
        site.held = Some(found);
    }
    site.held.as_mut()
}

/// `outbox.held_by()` for `place` (sql/state/held_by.sql).
fn held_by(place: &Place) -> Option<Held> {
    let mut uuid = place.1;
    let values = [pg_sys::Datum::from(place.0), pg_sys::Datum::from(uuid.as_mut_ptr())];
    Spi::connect(|_| {
        // SAFETY: inside the connection pgrx opened; the arguments outlive
        // the call and are of the plan's types; one row of the columns the
        // file selects is read before the connection ends.
        unsafe {
            execute(&HELD_BY, &values)?;
            let row = Row::first()?;
            let page = Page {
                from: match (row.text(2), row.uuid(3)) {
                    (Some(xid), Some(id)) => Some((xid.parse().ok()?, id)),
                    _ => None,
                },
                to: (row.text(4)?.parse().ok()?, row.uuid(5)?),
                prev: Snapshot::parse(&row.text(6)?)?,
                target: Snapshot::parse(&row.text(7)?)?,
            };
            Some(Held {
                id: row.int8(1)?,
                page,
                marked: row.bool(8)?,
                abandoned: row.bool(9)?,
                outcomes: None,
            })
        }
    })
}

/// Where the claims have read up to (sql/state/cursor.sql); with no
/// cursor (an outbox being installed), nothing read.
fn cursor() -> Cursor {
    let nothing = Cursor { prev: Snapshot::parse("0:0:").expect("a snapshot"), target: None, after: None };
    Spi::connect(|_| {
        // SAFETY: as in held_by; the one row is read before the connection
        // ends.
        unsafe {
            execute(&CURSOR, &[])?;
            let row = Row::first()?;
            Some(Cursor {
                prev: Snapshot::parse(&row.text(1)?)?,
                target: row.text(2).and_then(|target| Snapshot::parse(&target)),
                after: match (row.text(3), row.uuid(4)) {
                    (Some(xid), Some(id)) => Some((xid.parse().ok()?, id)),
                    _ => None,
                },
            })
        }
    })
    .unwrap_or(nothing)
}

/// The events batch `id` holds an outcome of (sql/state/outcomes_of.sql).
fn outcomes_of(id: i64) -> HashSet<[u8; 16]> {
    Spi::connect(|_| {
        // SAFETY: as in held_by; every row of the one uuid column is read
        // before the connection ends.
        unsafe {
            let processed = execute(&OUTCOMES_OF, &[pg_sys::Datum::from(id)]).unwrap_or(0);
            (0..processed).filter_map(|i| Row(i).uuid(1)).collect()
        }
    })
}

/// Runs `statement`'s plan with `values` (none null), read only, under the
/// calling statement's snapshot; returns how many rows it found.
///
/// # Safety
/// Inside an SPI connection; `values` are of `statement.types`.
unsafe fn execute(statement: &'static Statement, values: &[pg_sys::Datum]) -> Option<u64> {
    // SAFETY: as the caller promises.
    unsafe {
        let plan = plan_of(statement);
        let mut values = values.to_vec();
        let nulls = vec![b' ' as c_char; values.len()];
        let status = pg_sys::SPI_execute_plan(plan, values.as_mut_ptr(), nulls.as_ptr(), true, 0);
        if status != pg_sys::SPI_OK_SELECT as i32 {
            error!("outbox_dispatch: a read of the batches failed (SPI status {status})");
        }
        Some(pg_sys::SPI_processed)
    }
}

/// The plan of `statement`, prepared and kept the first time.
///
/// # Safety
/// Inside an SPI connection.
unsafe fn plan_of(statement: &'static Statement) -> pg_sys::SPIPlanPtr {
    let kept = statement.plan.get();
    if !kept.is_null() {
        return kept;
    }
    let sql = CString::new(statement.sql).expect("no NUL in SQL files");
    let mut types = statement.types.to_vec();
    // SAFETY: as the caller promises.
    unsafe {
        let plan = pg_sys::SPI_prepare(sql.as_ptr(), types.len() as i32, types.as_mut_ptr());
        if plan.is_null() || pg_sys::SPI_keepplan(plan) != 0 {
            error!(
                "outbox_dispatch: cannot prepare a read of the batches (SPI error {})",
                std::ptr::addr_of!(pg_sys::SPI_result).read()
            );
        }
        statement.plan.set(plan);
        plan
    }
}

/// Row `.0` of the last SPI result; columns from 1.
struct Row(u64);

impl Row {
    /// The first row, if there is one.
    ///
    /// # Safety
    /// Inside the SPI connection that ran the statement.
    unsafe fn first() -> Option<Row> {
        // SAFETY: as the caller promises.
        (unsafe { pg_sys::SPI_processed } > 0).then_some(Row(0))
    }

    /// # Safety
    /// Inside the SPI connection that ran the statement; `self.0` is one of
    /// its rows.
    unsafe fn binary(&self, column: i32) -> Option<pg_sys::Datum> {
        // SAFETY: as the caller promises.
        unsafe {
            let table = &*pg_sys::SPI_tuptable;
            let mut null = false;
            let datum =
                pg_sys::SPI_getbinval(*table.vals.add(self.0 as usize), table.tupdesc, column, &mut null);
            (!null).then_some(datum)
        }
    }

    unsafe fn text(&self, column: i32) -> Option<String> {
        // SAFETY: a text column of the row (as binary, above).
        unsafe {
            let datum = self.binary(column)?;
            let text = pg_sys::text_to_cstring(datum.cast_mut_ptr());
            let value = CStr::from_ptr(text).to_str().ok().map(str::to_string);
            pg_sys::pfree(text.cast());
            value
        }
    }

    unsafe fn uuid(&self, column: i32) -> Option<[u8; 16]> {
        // SAFETY: a uuid column of the row (as binary, above).
        unsafe { self.binary(column).map(|datum| *datum.cast_mut_ptr::<[u8; 16]>()) }
    }

    unsafe fn int8(&self, column: i32) -> Option<i64> {
        // SAFETY: an int8 column of the row (as binary, above).
        unsafe { self.binary(column).map(|datum| datum.value() as i64) }
    }

    unsafe fn bool(&self, column: i32) -> Option<bool> {
        // SAFETY: a boolean column of the row (as binary, above).
        unsafe { self.binary(column).map(|datum| datum.value() != 0) }
    }
}
