//! The SQL functions written in Rust. `outbox_enqueue()` itself is SQL
//! (sql/api.sql): an INSERT whose trigger does the waking.

use std::ffi::{c_char, CString};

use pgrx::prelude::*;

use outbox_core::store::keys as turns;
use outbox_core::store::sql::{get, Arg, DbError, Stmt, Tx};

use crate::config::KeyPolicy;
use crate::counters::{self, AckSource};
use crate::slots::WakeSource;
use crate::worker::store::SpiTx;
use crate::{config, keys, wake};

extern "C-unwind" {
    /// commands/async.h, which pgrx does not bind.
    fn Async_Notify(channel: *const c_char, payload: *const c_char);
}

/// A new UUIDv7: time-ordered, so the primary key index stays compact.
#[pg_extern(volatile, parallel_safe)]
fn outbox_uuid_v7() -> pgrx::Uuid {
    pgrx::Uuid::from_bytes(*uuid::Uuid::now_v7().as_bytes())
}

/// `outbox.max_payload_bytes` in bytes: what `outbox_enqueue()` compares a
/// payload with, without parsing the setting's text ('1MB') on every call.
#[pg_extern(stable, parallel_safe)]
fn outbox_max_payload_bytes() -> i32 {
    config::MAX_PAYLOAD_BYTES.get()
}

/// `outbox.report_timeout` while reports are on (`outbox.report_key`
/// set); NULL while they are off or it is 0: the view `outbox.unreported`
/// then lists nothing.
#[pg_extern(stable, parallel_safe)]
fn outbox_report_timeout() -> Option<Interval> {
    config::report_timeout().map(|t| Interval::from_micros(t.as_micros().min(i64::MAX as u128) as i64))
}

/// Nudges the dispatchers now, and again when the current transaction
/// commits (rows it changed are visible only then); where none runs, or
/// they have not found the extension, asks the launcher for them at
/// commit (`CREATE EXTENSION` ends with this call).
#[pg_extern(volatile, parallel_unsafe)]
fn outbox_wake() {
    wake::now();
    wake::at_commit(WakeSource::Manual);
    wake::ask_at_commit();
}

/// The consumer confirms an event it was sent once: in flight →
/// processed. Returns whether the event was waiting for it; an event sent
/// more than once is acknowledged only with the send it was
/// ([`outbox_ack_send`]). SECURITY DEFINER: a consumer role needs EXECUTE
/// on this function, not UPDATE on the table.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn outbox_ack(id: pgrx::Uuid) -> bool {
    acknowledge(id, None)
}

/// The consumer confirms an event as the send `send` carried it (the
/// message's `outbox_send` header): in flight → processed, while that is
/// the send the event awaits an outcome of (sql/ack.sql).
#[pg_extern(name = "outbox_ack", volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn outbox_ack_send(id: pgrx::Uuid, send: pgrx::Uuid) -> bool {
    acknowledge(id, Some(send))
}

/// `outbox_ack()`: records the outcome, and passes on the key of an event
/// that holds one (docs/guides/per-key-order.md), once a producer of the
/// key has committed. With `outbox.ack_timeout` > 0, events not
/// acknowledged in time are sent again.
fn acknowledge(id: pgrx::Uuid, send: Option<pgrx::Uuid>) -> bool {
    let id = uuid::Uuid::from_bytes(*id.as_bytes());
    let send = send.map(|s| uuid::Uuid::from_bytes(*s.as_bytes()));
    let (acked, unnamed) = Spi::connect_mut(|client| {
        let tx = &mut SpiTx::unprepared(client);
        turns::lock_key_of(tx, id)?;
        tx.run(Stmt::AckLock, &[Arg::Uuid(Some(id))])?;
        let found = tx.run(Stmt::Ack, &[Arg::Uuid(Some(id)), Arg::Uuid(send)])?;
        let Some(row) = found.rows.first() else {
            return Ok((false, false));
        };
        let (acked, unnamed) = (get::<bool>(row, 0)?.unwrap_or(false), get::<bool>(row, 4)?.unwrap_or(false));
        if let Some(head) = turns::head_of(row, 1)?.filter(|_| acked) {
            keys::pass_now(tx, head, KeyPolicy { failed: false, dispatched: false })?;
        }
        Ok::<_, DbError>((acked, unnamed))
    })
    .unwrap_or_else(|e| error!("outbox_ack: {e}"));
    if unnamed {
        warning!(
            "outbox_ack: event {id} is not acknowledged without its send: it was sent more than once, \
             or its push is not recorded yet; name the send (outbox_ack(id, send), send from the \
             message's outbox_send header)"
        );
    }
    if acked {
        counters::acked(AckSource::Sql, 1);
    }
    acked
}

/// BEFORE INSERT ... FOR EACH STATEMENT on `outbox.log`: every insert path,
/// `outbox_enqueue()` or an ORM's INSERT, wakes the dispatchers at commit,
/// and NOTIFYs `outbox.notify_channel` when `outbox.notify` is on. A
/// dispatcher's own inserts do neither (see [`wake::mute`]).
#[pg_trigger]
fn outbox_events_inserted<'a>(
    _trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, pgrx::AllocatedByPostgres>>, pgrx::PgTriggerError> {
    if wake::muted() {
        return Ok(None);
    }
    wake::at_commit(WakeSource::Commit);
    if let Some(channel) = config::notify_channel() {
        notify(&channel);
    }
    Ok(None)
}

fn notify(channel: &CString) {
    let bytes = channel.as_bytes().len();
    if bytes == 0 || bytes >= pgrx::pg_sys::NAMEDATALEN as usize {
        ereport!(
            PgLogLevel::ERROR,
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!(
                "outbox.notify_channel is {bytes} bytes, it must be 1 to {} bytes (or outbox.notify off)",
                pgrx::pg_sys::NAMEDATALEN - 1
            )
        );
    }
    // SAFETY: both strings outlive the call; Async_Notify copies them.
    unsafe {
        pgrx::pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| Async_Notify(channel.as_ptr(), c"".as_ptr()))
    };
}
