//! outbox_dispatch: the transactional outbox inside PostgreSQL.
//!
//! Applications insert events in their own transactions; background
//! workers deliver the committed ones to Redis as Celery tasks: a launcher
//! per server starts a group of dispatchers in each database served. The pure
//! logic (message encoding, backoff, the Redis sink) is in the
//! `outbox_core` crate; this crate is the PostgreSQL glue around it.

use pgrx::prelude::*;

mod api;
mod commands;
mod config;
mod counters;
mod inbox;
mod keys;
mod launcher;
mod secrets;
mod slots;
mod state;
mod subscriptions;
mod views;
mod wake;
mod worker;

::pgrx::pg_module_magic!();

/// The first column of the first row of `query`, run read-only.
/// `Spi::get_one` runs its query as an update, which takes a transaction
/// id: a scrape would write a commit record and spend an id, and a
/// parallel worker cannot take one at all.
pub(crate) fn read_one<T: FromDatum + IntoDatum>(query: &str) -> Result<Option<T>, pgrx::spi::SpiError> {
    Spi::connect(|client| client.select(query, Some(1), &[])?.first().get_one())
}

extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
extension_sql_file!(
    "../sql/subscriptions.sql",
    name = "subscriptions",
    requires = [
        "schema",
        api::outbox_wake,
        subscriptions::outbox_routed_to_default,
        subscriptions::outbox_subscribe,
        subscriptions::outbox_unsubscribe,
        subscriptions::outbox_subscriptions_changed
    ]
);
extension_sql_file!(
    "../sql/keys.sql",
    name = "keys",
    requires = ["schema", "subscriptions", keys::outbox_key_taken, keys::outbox_turn_fits]
);
extension_sql_file!("../sql/inbox.sql", name = "inbox", requires = ["schema"]);
extension_sql_file!("../sql/rotation.sql", name = "rotation", requires = ["schema", api::outbox_uuid_v7]);
extension_sql_file!(
    "../sql/events.sql",
    name = "events",
    requires = ["schema", "subscriptions", "keys", "rotation"]
);
extension_sql_file!("../sql/api.sql", name = "api", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // SAFETY: a flag the postmaster sets while loading preloaded libraries.
    let preloading = unsafe { pg_sys::process_shared_preload_libraries_in_progress };
    config::register(preloading);
    if !preloading {
        warning!(
            "outbox_dispatch is loaded without shared_preload_libraries: no dispatcher will run. \
             Add it to shared_preload_libraries in postgresql.conf and restart the server."
        );
        return;
    }
    slots::init();
    counters::init();
    launcher::init();
    launcher::register();
    commands::install();
    secrets::install();
}
