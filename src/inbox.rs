//! The inbox (docs/guides/effects-once.md): `outbox_inbox_claim()`, which a task
//! calls in the transaction that makes its effects, so that a message run
//! twice makes them once. The table is in sql/inbox.sql; the dispatchers
//! purge it after `outbox.inbox_retention`.

use pgrx::prelude::*;

use crate::counters::{self, Counter};

/// The longest consumer name, in bytes.
const MAX_CONSUMER_BYTES: usize = 255;

/// Claims message `id` for `consumer` in the calling transaction block:
/// true when this transaction is the first to claim it, false when it was
/// claimed already (by another transaction that committed, or by this one). A claim another
/// transaction holds and has not ended makes this wait for it; if that
/// rolls back, this one claims. SECURITY DEFINER: the workers' role needs
/// EXECUTE on this function, nothing on the table.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn outbox_inbox_claim(id: Option<pgrx::Uuid>, consumer: default!(Option<&str>, "''")) -> bool {
    let Some(id) = id else {
        refuse("outbox_inbox_claim: id must not be null".to_string());
    };
    let Some(consumer) = consumer else {
        refuse("outbox_inbox_claim: consumer must not be null (use '' for a single consumer)".to_string());
    };
    if consumer.len() > MAX_CONSUMER_BYTES {
        refuse(format!(
            "outbox_inbox_claim: consumer is {} bytes, the limit is {MAX_CONSUMER_BYTES} bytes",
            consumer.len()
        ));
    }
    // SAFETY: a read of the transaction state.
    if !unsafe { pg_sys::IsTransactionBlock() } {
        ereport!(
            PgLogLevel::ERROR,
            PgSqlErrorCode::ERRCODE_NO_ACTIVE_SQL_TRANSACTION,
            "outbox_inbox_claim: must be called inside a transaction block (BEGIN … COMMIT), in the \
             transaction that makes the effects: in autocommit the claim would commit on its own"
        );
    }
    let claimed = Spi::connect_mut(|client| {
        let inserted =
            client.update(include_str!("../sql/inbox/claim.sql"), None, &[id.into(), consumer.into()])?;
        Ok::<_, pgrx::spi::SpiError>(!inserted.is_empty())
    })
    .unwrap_or_else(|e| error!("outbox_inbox_claim: {e}"));
    if !claimed {
        counters::add(Counter::InboxDuplicates, 1);
    }
    claimed
}

fn refuse(message: String) -> ! {
    ereport!(PgLogLevel::ERROR, PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, message);
    unreachable!("ereport(ERROR) does not return")
}
