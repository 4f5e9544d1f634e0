//! The parts of outbox_dispatch that need no PostgreSQL: the Celery message
//! encoder, backoff arithmetic, the Redis wire protocol and connection, the
//! sink that pushes batches and collects reports, and the Prometheus exposition. Plain
//! `cargo test` covers them; the extension crate is the thin glue around them.

pub mod backoff;
pub mod broker_url;
pub mod celery;
pub mod databases;
pub mod engine;
pub mod exposition;
pub mod guc;
pub mod launch;
pub mod link;
pub mod metrics;
pub mod named;
pub mod place;
pub mod report;
pub mod resp;
pub mod sink;
pub mod store;
pub mod tls;
