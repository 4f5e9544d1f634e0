//! The parts of outbox_dispatch that need no PostgreSQL: the Celery message
//! encoder, backoff arithmetic and the Redis sink. Plain `cargo test` covers
//! them; the extension crate is the thin glue around them.

pub mod backoff;
pub mod celery;
pub mod sink;
