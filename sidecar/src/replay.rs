//! `outbox-dispatch resend` and `discard`: `outbox_resend()` and
//! `outbox_discard()` (sql/api.sql) with a filter, from beside the server,
//! as the outbox's owner; a discard with `--all` called again while a call
//! takes as many events as it may (what it takes is gone: the calls end).

use postgres::Client;

use crate::connect::chain;
use crate::script::quote_ident;

/// Which function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    Resend,
    Discard,
}

impl Replay {
    fn function(self) -> &'static str {
        match self {
            Replay::Resend => "outbox_resend",
            Replay::Discard => "outbox_discard",
        }
    }

    /// What was done to `n` events, for the command's line.
    pub fn done(self, n: i64) -> String {
        match self {
            Replay::Resend => format!("sent {n} events again"),
            Replay::Discard => format!("discarded {n} events"),
        }
    }
}

/// The events named, as the function's arguments take them (text, cast by
/// the server: an error names the argument).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    pub ids: Vec<String>,
    pub queue: Option<String>,
    pub task: Option<String>,
    pub event_type: Option<String>,
    pub status: Option<String>,
    pub created_after: Option<String>,
    pub created_before: Option<String>,
    pub max_events: i32,
}

/// Runs `replay` with `filter` in the functions' schema `schema`, once, or
/// with `all` until a call takes fewer than `max_events`; returns how many
/// events it took in all.
pub fn replay(
    client: &mut Client,
    replay: Replay,
    schema: &str,
    filter: &Filter,
    all: bool,
) -> Result<i64, String> {
    // Every name below is qualified; nothing the database's settings say
    // of the search path reaches the call (the dispatchers' own pins are
    // not this session's: outbox.* settings are the library's where it is
    // loaded).
    client.batch_execute("SET search_path = pg_catalog, pg_temp").map_err(|e| chain(&e))?;
    let sql = format!(
        "SELECT {}.{}(ids => $1::pg_catalog.text[]::pg_catalog.uuid[], queue => $2, task => $3, event_type => $4, \
         status => $5::pg_catalog.text::outbox.event_status, created_after => $6::pg_catalog.text::pg_catalog.timestamptz, \
         created_before => $7::pg_catalog.text::pg_catalog.timestamptz, max_events => $8)",
        quote_ident(schema),
        replay.function()
    );
    let ids = (!filter.ids.is_empty()).then_some(&filter.ids);
    let mut total = 0;
    loop {
        let taken: i64 = client
            .query_one(
                sql.as_str(),
                &[
                    &ids,
                    &filter.queue,
                    &filter.task,
                    &filter.event_type,
                    &filter.status,
                    &filter.created_after,
                    &filter.created_before,
                    &filter.max_events,
                ],
            )
            .map_err(|e| chain(&e))?
            .get(0);
        total += taken;
        if !all || taken < i64::from(filter.max_events) {
            return Ok(total);
        }
    }
}
