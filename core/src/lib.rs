//! The parts of outbox_dispatch that need no PostgreSQL: the Celery message
//! encoder, backoff arithmetic, the Redis sink and the
//! Prometheus exposition. Plain `cargo test` covers
//! them; the extension crate is the thin glue around them.

pub mod backoff;
pub mod celery;
pub mod exposition;
pub mod sink;
