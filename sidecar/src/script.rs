//! The install script without the library: the extension's own SQL files,
//! with `sql/standalone/` in place of what the library defines, put
//! together the way `CREATE EXTENSION` would run them.
//!
//! The files are the extension's, changed only by these rules:
//! - `@extschema@` becomes the schema asked for (quoted);
//! - `@version@` becomes this release;
//! - `@include <file>@` becomes the text of `sql/<file>` as a dollar-quoted
//!   literal, for `EXECUTE`: one copy of each statement for both hosts;
//! - the regions between `-- extension only: begin` and `-- extension
//!   only: end` are left out (`pg_extension_config_dump`, which only
//!   `CREATE EXTENSION` may call).

use std::fmt;

/// The files in the order they run: the extension's (src/lib.rs), with the
/// library's functions (sql/standalone/host.sql) after the tables.
const PARTS: [(&str, &str); 14] = [
    HEAD,
    ("schema.sql", include_str!("../../sql/schema.sql")),
    SETTING_PLACE,
    UUID_V7,
    WRITE_PATH,
    ("standalone/host.sql", include_str!("../../sql/standalone/host.sql")),
    ("subscriptions.sql", include_str!("../../sql/subscriptions.sql")),
    ("keys.sql", include_str!("../../sql/keys.sql")),
    ("inbox.sql", include_str!("../../sql/inbox.sql")),
    ("rotation.sql", include_str!("../../sql/rotation.sql")),
    ("events.sql", include_str!("../../sql/events.sql")),
    ("api.sql", include_str!("../../sql/api.sql")),
    LEASES,
    ("standalone/tail.sql", include_str!("../../sql/standalone/tail.sql")),
];

const HEAD: (&str, &str) = ("standalone/head.sql", include_str!("../../sql/standalone/head.sql"));
const SETTING_PLACE: (&str, &str) =
    ("standalone/setting_place.sql", include_str!("../../sql/standalone/setting_place.sql"));
const UUID_V7: (&str, &str) = ("standalone/uuid_v7.sql", include_str!("../../sql/standalone/uuid_v7.sql"));
const WRITE_PATH: (&str, &str) =
    ("standalone/write_path.sql", include_str!("../../sql/standalone/write_path.sql"));
const LEASES: (&str, &str) = ("standalone/leases.sql", include_str!("../../sql/standalone/leases.sql"));
const UPDATE_FROM: (&str, &str) =
    ("standalone/update_from.sql", include_str!("../../sql/standalone/update_from.sql"));
const UPDATE_END: (&str, &str) = ("standalone/update.sql", include_str!("../../sql/standalone/update.sql"));

/// The releases an install updates, oldest first, each with the files that
/// take it to the next: an update runs those of its release and of every
/// later one. 0.10.0 and 1.0.0 differ in where settings belong (three have
/// new names) and in the ids before PostgreSQL 18 (ordered to the
/// microsecond, not the millisecond): files that `CREATE OR REPLACE` their
/// objects. From 1.0.0 on, a step is the extension's own update script
/// (`sql/upgrade/`, but its regions only the extension may run), what
/// changed of the library's functions in SQL (`sql/standalone/updates/`),
/// and the install's own files that create or replace all they hold
/// (`sql/standalone/setting_place.sql`, which 1.1.0's new settings changed,
/// and `write_path.sql`) or are new (`leases.sql`).
const UPDATES: [(&str, &[(&str, &str)]); 2] = [
    ("0.10.0", &[SETTING_PLACE, UUID_V7]),
    (
        "1.0.0",
        &[
            (
                "upgrade/outbox_dispatch--1.0.0--1.1.0.sql",
                include_str!("../../sql/upgrade/outbox_dispatch--1.0.0--1.1.0.sql"),
            ),
            (
                "standalone/updates/1.0.0--1.1.0.sql",
                include_str!("../../sql/standalone/updates/1.0.0--1.1.0.sql"),
            ),
            SETTING_PLACE,
            WRITE_PATH,
            LEASES,
        ],
    ),
];

/// The statements `@include` may name.
const INCLUDES: [(&str, &str); 9] = [
    ("ack.sql", include_str!("../../sql/ack.sql")),
    ("ack_lock.sql", include_str!("../../sql/ack_lock.sql")),
    ("inbox/claim.sql", include_str!("../../sql/inbox/claim.sql")),
    ("keys/fits.sql", include_str!("../../sql/keys/fits.sql")),
    ("keys/key_of.sql", include_str!("../../sql/keys/key_of.sql")),
    ("keys/lock.sql", include_str!("../../sql/keys/lock.sql")),
    ("keys/pass.sql", include_str!("../../sql/keys/pass.sql")),
    ("keys/taken.sql", include_str!("../../sql/keys/taken.sql")),
    ("metrics/gauges.sql", include_str!("../../sql/metrics/gauges.sql")),
];

/// The release the script installs.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

const BEGIN: &str = "-- extension only: begin";
const END: &str = "-- extension only: end";
/// What a schema's name may not hold: it is put into dollar-quoted and
/// quoted literals (PostgreSQL refuses the same in `@extschema@`).
const UNQUOTABLE: [char; 4] = ['$', '\'', '"', '\\'];
const QUOTE: &str = "$outbox_sql$";

/// Why a script could not be put together: a fault of the SQL files, which
/// the unit tests catch before a release.
#[derive(Debug, PartialEq, Eq)]
pub enum ScriptError {
    /// `sql/<file>`: an `extension only` region without its end.
    Unclosed(&'static str),
    /// `sql/<file>` includes a file that is not in [`INCLUDES`].
    UnknownInclude(&'static str, String),
    /// An included file holds the quote that would end its literal.
    Quote(&'static str),
    /// The schema's name is empty or longer than PostgreSQL keeps.
    SchemaName(String),
    /// The schema's name holds a character of [`UNQUOTABLE`].
    Unquotable(String),
    /// No update of this release starts from that one.
    NoUpdate(String),
}

impl fmt::Display for ScriptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScriptError::Unclosed(file) => write!(f, "sql/{file}: \"{BEGIN}\" without \"{END}\""),
            ScriptError::UnknownInclude(file, name) => {
                write!(f, "sql/{file} includes {name}, which is not known")
            }
            ScriptError::Quote(file) => write!(f, "sql/{file} holds {QUOTE}, which quotes it"),
            ScriptError::NoUpdate(from) => {
                let known: Vec<&str> = UPDATES.iter().map(|(release, _)| *release).collect();
                write!(f, "{VERSION} updates only {}, not {from}", known.join(", "))
            }
            ScriptError::Unquotable(name) => {
                write!(
                    f,
                    "--schema \"{name}\" holds one of $ ' \" \\, which the script's literals cannot quote"
                )
            }
            ScriptError::SchemaName(name) => {
                write!(f, "--schema is {} bytes (\"{name}\"), it must be 1 to 63 bytes", name.len())
            }
        }
    }
}

impl std::error::Error for ScriptError {}

/// The whole install script, for the functions' schema `schema`: what
/// `outbox-dispatch install` runs in one transaction, and `outbox-dispatch
/// sql` prints for a migration.
pub fn script(schema: &str) -> Result<String, ScriptError> {
    put_together(schema, &PARTS)
}

/// The script that updates a database installed at release `from` to this
/// one, for the functions' schema `schema`.
pub fn update(from: &str, schema: &str) -> Result<String, ScriptError> {
    let Some(step) = UPDATES.iter().position(|(release, _)| *release == from) else {
        return Err(ScriptError::NoUpdate(from.to_string()));
    };
    let files = UPDATES[step..].iter().flat_map(|(_, files)| files.iter());
    let parts: Vec<(&'static str, &'static str)> =
        [HEAD, UPDATE_FROM].iter().chain(files).chain([UPDATE_END].iter()).copied().collect();
    put_together(schema, &parts).map(|sql| sql.replace("@from@", UPDATES[step].0))
}

/// `parts` one after the other, each under its name, with the rules of the
/// module's documentation applied.
fn put_together(schema: &str, parts: &[(&'static str, &'static str)]) -> Result<String, ScriptError> {
    if schema.is_empty() || schema.len() > 63 {
        return Err(ScriptError::SchemaName(schema.to_string()));
    }
    if schema.contains(UNQUOTABLE) {
        return Err(ScriptError::Unquotable(schema.to_string()));
    }
    let quoted = quote_ident(schema);
    let mut out = String::new();
    for &(file, text) in parts {
        out.push_str(&format!("-- sql/{file}\n"));
        let kept = without_extension_only(file, text)?;
        let included = expand_includes(file, &kept)?;
        out.push_str(&included.replace("@extschema@", &quoted).replace("@version@", VERSION));
        out.push('\n');
    }
    Ok(out)
}

/// `name` as a quoted identifier, as `quote_ident()` would always quote it.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn without_extension_only(file: &'static str, text: &str) -> Result<String, ScriptError> {
    let mut kept = String::with_capacity(text.len());
    let mut skipping = false;
    for line in text.split_inclusive('\n') {
        if line.starts_with(BEGIN) {
            skipping = true;
        } else if line.starts_with(END) {
            skipping = false;
        } else if !skipping {
            kept.push_str(line);
        }
    }
    if skipping {
        return Err(ScriptError::Unclosed(file));
    }
    Ok(kept)
}

fn expand_includes(file: &'static str, text: &str) -> Result<String, ScriptError> {
    const MARK: &str = "@include ";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(MARK) {
        out.push_str(&rest[..start]);
        let after = &rest[start + MARK.len()..];
        let Some(end) = after.find('@') else {
            return Err(ScriptError::UnknownInclude(file, after.lines().next().unwrap_or("").to_string()));
        };
        let name = &after[..end];
        let Some((_, body)) = INCLUDES.iter().find(|(n, _)| *n == name) else {
            return Err(ScriptError::UnknownInclude(file, name.to_string()));
        };
        if body.contains(QUOTE) {
            return Err(ScriptError::Quote(file));
        }
        out.push_str(QUOTE);
        out.push_str(body);
        out.push_str(QUOTE);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_keeps_nothing_only_the_extension_may_run() {
        let sql = script("public").unwrap();
        for absent in ["@extschema@", "@include", "@version@", "pg_extension_config_dump", "MODULE_PATHNAME"]
        {
            assert!(!sql.contains(absent), "{absent} is left in the script");
        }
        assert!(sql.contains("CREATE FUNCTION \"public\".outbox_enqueue("));
        assert!(sql.contains(&format!("VALUES ('{VERSION}')")));
    }

    #[test]
    fn an_update_runs_the_steps_of_its_release_and_every_later_one() {
        let from_first = update("0.10.0", "public").unwrap();
        let from_last = update("1.0.0", "public").unwrap();
        for (_, files) in &UPDATES[1..] {
            for (file, _) in *files {
                let header = format!("-- sql/{file}\n");
                assert!(from_first.contains(&header) && from_last.contains(&header), "{file}");
            }
        }
        assert!(!from_last.contains("-- sql/standalone/uuid_v7.sql\n"));
        for absent in ["@extschema@", "@include", "@version@", "@from@", "\\echo", "pg_extension_config_dump"]
        {
            assert!(!from_first.contains(absent), "{absent} is left in the update");
        }
        assert_eq!(update("0.9.0", "public"), Err(ScriptError::NoUpdate("0.9.0".to_string())));
    }

    #[test]
    fn every_include_is_used_and_quoted_whole() {
        let sql = script("public").unwrap();
        for (name, body) in INCLUDES {
            assert!(sql.contains(&format!("{QUOTE}{body}{QUOTE}")), "{name} is not included");
        }
    }

    #[test]
    fn a_schema_name_is_quoted_and_bounded() {
        assert!(script("my app").unwrap().contains("CREATE FUNCTION \"my app\".outbox_enqueue("));
        assert_eq!(script(""), Err(ScriptError::SchemaName(String::new())));
        let long = "s".repeat(64);
        assert_eq!(script(&long), Err(ScriptError::SchemaName(long.clone())));
        for name in ["x$name$", "o'b", "a\"b", "a\\b"] {
            let refused = script(name).unwrap_err();
            assert_eq!(refused, ScriptError::Unquotable(name.to_string()));
            assert!(refused.to_string().contains("cannot quote"), "{refused}");
        }
    }

    #[test]
    fn a_region_left_open_is_refused() {
        assert_eq!(
            without_extension_only("x.sql", "a\n-- extension only: begin\nb\n"),
            Err(ScriptError::Unclosed("x.sql"))
        );
        assert_eq!(
            without_extension_only("x.sql", "a\n-- extension only: begin\nb\n-- extension only: end\nc\n")
                .unwrap(),
            "a\nc\n"
        );
    }

    #[test]
    fn an_unknown_include_is_refused() {
        assert_eq!(
            expand_includes("x.sql", "EXECUTE @include nope.sql@"),
            Err(ScriptError::UnknownInclude("x.sql", "nope.sql".to_string()))
        );
    }
}
