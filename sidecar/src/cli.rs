//! The command line, with clap: its commands and options, their help, and
//! what each resolves to with the environment's `OUTBOX_*` variables and
//! the `--config` file under them (an option wins over the environment,
//! the environment over the file).
//!
//! A value may hold a password: no error shows one. clap's own messages
//! quote what they refuse; [`refusal`] says them again from the kind of
//! error and the names of the options alone.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use outbox_core::broker_url::BrokerUrl;
use outbox_core::guc::{Declared, Kind, Parsed, Unit};

use crate::log::{Format, Level};
use crate::private_file::{self, Rule};
use crate::replay::{Filter, Replay};
use crate::run::{RunConfig, OWN_SETTINGS};
use crate::{connect, file, script};

/// What `--help` ends with: the exit statuses.
const EXIT_STATUSES: &str = "\
Exit status:
  0  done (run: stopped by SIGTERM or SIGINT, its last pushes marked)
  1  failed: install, resend or discard refused or failed, its DSN or
     connection included (the message says why); run: the dispatchers still busy at the
     stop's deadline, or a thread or a pipe could not be made
  2  bad usage: an unknown command or option, a value out of range, a
     file refused, before anything was done; run: its DSN or
     --metrics-listen refused
  3  run: the outbox is not installed in the database, or at another
     release, or the extension outbox_dispatch serves it

The DSN is libpq's (a connection string or a URI), with its PG* variables,
service file and password file. Values never show in an error, nor in the
log: a password given as an argument shows in ps to every local user, so
give it in a file (--dsn-file, --broker-url-file, a password file), the
environment or --config (a file no one else may read).";

#[derive(Parser)]
#[command(
    name = "outbox-dispatch",
    version = script::VERSION,
    about = "outbox_dispatch where no background worker can be loaded (a managed PostgreSQL): \
             installs the outbox as SQL, and delivers its events from beside the server",
    after_help = EXIT_STATUSES,
    propagate_version = true,
    subcommand_required = true,
    arg_required_else_help = true
)]
struct Cli {
    /// How log lines are written: text (the time, PostgreSQL's severity,
    /// the message) or json (one object a line) [env: OUTBOX_LOG_FORMAT]
    #[arg(long, global = true, value_enum, value_name = "FORMAT")]
    log_format: Option<Format>,
    /// The least severe messages written: info, warning or error
    /// [env: OUTBOX_LOG_LEVEL]
    #[arg(long, global = true, value_enum, value_name = "LEVEL")]
    log_level: Option<Level>,
    #[command(subcommand)]
    verb: Verb,
}

#[derive(Subcommand)]
enum Verb {
    /// Installs the outbox schema and the SQL API into the database, as
    /// the DSN's role, in one transaction; does nothing where this release
    /// is installed, and updates an outbox an earlier release installed
    /// (0.10.0, 1.0.0)
    #[command(after_help = EXIT_STATUSES)]
    Install {
        #[command(flatten)]
        connection: Connection,
        /// The schema of the functions (outbox_enqueue() ...)
        #[arg(long, value_name = "NAME", default_value = "public")]
        schema: String,
    },
    /// Prints the install script (for a migration tool to run)
    #[command(after_help = EXIT_STATUSES)]
    Sql {
        /// The schema of the functions (outbox_enqueue() ...)
        #[arg(long, value_name = "NAME", default_value = "public")]
        schema: String,
        /// Without BEGIN and COMMIT: for a tool that opens its own
        /// transaction
        #[arg(long)]
        no_transaction: bool,
        /// The script that updates an outbox this release installed
        #[arg(long, value_name = "RELEASE")]
        update_from: Option<String>,
    },
    /// Delivers the events of the database until SIGTERM or SIGINT
    /// (SIGHUP reads the settings again). The outbox.* settings are the
    /// database's (outbox.settings, ALTER DATABASE ... SET); the broker's
    /// URL and files are the sidecar's own
    #[command(after_help = EXIT_STATUSES)]
    Run(Box<RunArgs>),
    /// Sends again the events already sent or dead-lettered that the
    /// filters name (outbox_resend(), the outbox's owner alone): at most
    /// --max-events (what it sent may be sent again by a second call: the
    /// dispatchers send it meanwhile)
    #[command(after_help = EXIT_STATUSES)]
    Resend(Box<ReplayArgs>),
    /// Deletes the events not sent yet, or dead-lettered, that the filters
    /// name: they are never sent (outbox_discard(), the outbox's owner
    /// alone): at most --max-events a call, every one with --all
    #[command(after_help = EXIT_STATUSES)]
    Discard(Box<ReplayArgs>),
    /// Prints the version (as --version does)
    #[command(hide = true)]
    Version,
}

#[derive(Args)]
struct ReplayArgs {
    #[command(flatten)]
    connection: Connection,
    /// The schema of the functions (outbox_enqueue() ...)
    #[arg(long, value_name = "NAME", default_value = "public")]
    schema: String,
    /// An event's id (again for more)
    #[arg(long = "id", value_name = "UUID")]
    ids: Vec<String>,
    /// The events of this queue
    #[arg(long, value_name = "NAME")]
    queue: Option<String>,
    /// The events of this task
    #[arg(long, value_name = "NAME")]
    task: Option<String>,
    /// The events of this event type
    #[arg(long, value_name = "NAME")]
    event_type: Option<String>,
    /// The events of this status: dispatched, processed or failed to send
    /// again; pending or failed to discard
    #[arg(long, value_name = "STATUS")]
    status: Option<String>,
    /// The events created at or after this time (a timestamp PostgreSQL
    /// reads)
    #[arg(long, value_name = "TIME")]
    created_after: Option<String>,
    /// The events created before this time
    #[arg(long, value_name = "TIME")]
    created_before: Option<String>,
    /// The most events one call takes: 1 to 100000
    #[arg(long, value_name = "N", default_value_t = 1000)]
    max_events: i32,
    /// discard: calls again while a call takes --max-events
    #[arg(long)]
    all: bool,
}

#[derive(Args)]
struct Connection {
    /// The database: a libpq connection string or URI [env: OUTBOX_DSN].
    /// What it leaves out comes from its service, the PG* variables and
    /// the password file, as libpq's
    #[arg(long, value_name = "DSN", conflicts_with = "dsn_file")]
    dsn: Option<String>,
    /// A file holding the DSN (first line), refused when others may read
    /// it [env: OUTBOX_DSN_FILE]
    #[arg(long, value_name = "PATH")]
    dsn_file: Option<PathBuf>,
    /// The authorities the server's certificate must chain to, where the
    /// DSN names no sslrootcert (it wins), before PGSSLROOTCERT
    /// [env: OUTBOX_TLS_CA_FILE]
    #[arg(long, value_name = "PATH")]
    tls_ca_file: Option<PathBuf>,
    /// A TOML file of what the environment may say: a key per variable in
    /// lower case (dsn = '...', broker_url = '...', dispatchers = 2);
    /// refused when it holds a password others may read
    /// [env: OUTBOX_CONFIG]
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    connection: Connection,
    /// The broker, as kombu writes it; redis://127.0.0.1:6379/0 by
    /// default [env: OUTBOX_BROKER_URL]
    #[arg(long, value_name = "URL", conflicts_with = "broker_url_file")]
    broker_url: Option<String>,
    /// A file holding the broker's URL, refused when others may read it
    /// [env: OUTBOX_BROKER_URL_FILE]
    #[arg(long, value_name = "PATH")]
    broker_url_file: Option<PathBuf>,
    /// Dispatchers of this process, each on a connection of its own: 1 to
    /// 64, 1 by default [env: OUTBOX_DISPATCHERS]
    #[arg(long, value_name = "N")]
    dispatchers: Option<String>,
    /// The longest a dispatcher sleeps without a NOTIFY: milliseconds, or
    /// with a unit (250ms, 1s); 20ms by default [env: OUTBOX_POLL_INTERVAL]
    #[arg(long, value_name = "TIME")]
    poll_interval: Option<String>,
    /// Serves /metrics, /healthz and /readyz there; nowhere by default
    /// [env: OUTBOX_METRICS_LISTEN]
    #[arg(long, value_name = "HOST:PORT")]
    metrics_listen: Option<String>,
    /// As outbox.broker_password_file [env: OUTBOX_BROKER_PASSWORD_FILE]
    #[arg(long, value_name = "PATH")]
    broker_password_file: Option<String>,
    /// As outbox.broker_tls_ca_file [env: OUTBOX_BROKER_TLS_CA_FILE]
    #[arg(long, value_name = "PATH")]
    broker_tls_ca_file: Option<String>,
    /// As outbox.broker_tls_cert_file [env: OUTBOX_BROKER_TLS_CERT_FILE]
    #[arg(long, value_name = "PATH")]
    broker_tls_cert_file: Option<String>,
    /// As outbox.broker_tls_key_file [env: OUTBOX_BROKER_TLS_KEY_FILE]
    #[arg(long, value_name = "PATH")]
    broker_tls_key_file: Option<String>,
    /// As outbox.kafka_sasl_plain_cleartext: on lets SASL PLAIN send the
    /// password over kafka:// in clear text [env:
    /// OUTBOX_KAFKA_SASL_PLAIN_CLEARTEXT]
    #[arg(long, value_name = "on|off")]
    kafka_sasl_plain_cleartext: Option<String>,
    /// As outbox.redis_sentinel_password_file
    /// [env: OUTBOX_SENTINEL_PASSWORD_FILE]
    #[arg(long, value_name = "PATH")]
    sentinel_password_file: Option<String>,
}

impl RunArgs {
    /// The value of one of [`OWN_SETTINGS`] given by its option.
    fn own(&self, option: &str) -> Option<String> {
        match option {
            "--broker-password-file" => self.broker_password_file.clone(),
            "--broker-tls-ca-file" => self.broker_tls_ca_file.clone(),
            "--broker-tls-cert-file" => self.broker_tls_cert_file.clone(),
            "--broker-tls-key-file" => self.broker_tls_key_file.clone(),
            "--kafka-sasl-plain-cleartext" => self.kafka_sasl_plain_cleartext.clone(),
            "--sentinel-password-file" => self.sentinel_password_file.clone(),
            _ => None,
        }
    }
}

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Command {
    Install {
        dsn: String,
        schema: String,
        ca_file: Option<PathBuf>,
    },
    Sql {
        schema: String,
        transaction: bool,
        from: Option<String>,
    },
    Run(RunConfig),
    Replay {
        replay: Replay,
        dsn: String,
        ca_file: Option<PathBuf>,
        schema: String,
        filter: Filter,
        all: bool,
    },
    Version,
}

/// A command, how its log is written, and what to warn of once it is.
#[derive(Debug)]
pub struct Invocation {
    pub command: Command,
    pub log: (Format, Level),
    pub warnings: Vec<String>,
}

/// Why the command line is not run.
#[derive(Debug, PartialEq, Eq)]
pub enum Usage {
    /// `--help`, `--version`: shown on standard output, exit status 0.
    Shown(String),
    /// Refused: said on standard error, exit status 2.
    Refused(String),
}

/// `--dispatchers`, as a setting is declared.
const DISPATCHERS: Declared =
    Declared { name: "--dispatchers", kind: Kind::Int { default: 1, min: 1, max: 64, unit: Unit::None } };
/// `--poll-interval`.
const POLL_INTERVAL: Declared = Declared {
    name: "--poll-interval",
    kind: Kind::Int { default: 20, min: 1, max: 3_600_000, unit: Unit::Ms },
};

/// The value of an integer option, or its default; the error names the
/// option and the range, not the value.
fn number(option: &Declared, value: Option<String>) -> Result<i32, String> {
    match value.map(|v| option.parse(&v)).unwrap_or_else(|| Ok(option.default())) {
        Ok(Parsed::Int(n)) => Ok(n),
        Ok(_) => Err(format!("{}: not a number", option.name)),
        // PostgreSQL's words may quote the value.
        Err(e) => Err(format!(
            "{}: the value given (not shown) is refused: {}",
            e.name,
            e.why.replace(&format!("\"{}\"", e.value), "it").replace(&e.value, "(not shown)")
        )),
    }
}

/// The environment's variables: the value of one.
pub type Environment<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Parses `args` (without the program's name).
pub fn parse(args: &[String], env: Environment) -> Result<Invocation, Usage> {
    let mut command = Cli::command();
    let matches = command
        .try_get_matches_from_mut(std::iter::once("outbox-dispatch".to_string()).chain(args.iter().cloned()))
        .map_err(refusal)?;
    let cli = Cli::from_arg_matches(&matches).map_err(refusal)?;
    let refused = |why: String| Usage::Refused(format!("{why}\n\nFor more information, try '--help'."));
    let log = (
        cli.log_format
            .map_or_else(|| from_env(env, "OUTBOX_LOG_FORMAT", Format::Text), Ok)
            .map_err(&refused)?,
        cli.log_level.map_or_else(|| from_env(env, "OUTBOX_LOG_LEVEL", Level::Info), Ok).map_err(&refused)?,
    );
    let mut warnings = Vec::new();
    let command = match cli.verb {
        Verb::Version => Command::Version,
        Verb::Sql { schema, no_transaction, update_from } => {
            Command::Sql { schema, transaction: !no_transaction, from: update_from }
        }
        Verb::Install { connection, schema } => {
            let Resolved { dsn, ca_file, .. } =
                connection.resolve("install", env, &mut warnings).map_err(&refused)?;
            Command::Install { dsn, schema, ca_file }
        }
        Verb::Run(run) => resolve_run(*run, env, &mut warnings).map_err(&refused)?,
        Verb::Resend(args) => resolve_replay(Replay::Resend, *args, env, &mut warnings).map_err(&refused)?,
        Verb::Discard(args) => {
            resolve_replay(Replay::Discard, *args, env, &mut warnings).map_err(&refused)?
        }
    };
    Ok(Invocation { command, log, warnings })
}

/// A variable of the environment naming one of `T`'s values, or `default`.
fn from_env<T: clap::ValueEnum>(env: Environment, variable: &str, default: T) -> Result<T, String> {
    match env(variable) {
        None => Ok(default),
        Some(value) => T::from_str(&value, true).map_err(|_| {
            let names: Vec<String> = T::value_variants()
                .iter()
                .filter_map(|v| v.to_possible_value())
                .map(|v| v.get_name().into())
                .collect();
            format!("{variable}: the value given (not shown) is not one of {}", names.join(", "))
        }),
    }
}

/// What a command's [`Connection`] options resolve to.
struct Resolved {
    dsn: String,
    ca_file: Option<PathBuf>,
    /// The `--config` file's values, by variable.
    file: HashMap<String, String>,
}

impl Connection {
    /// The DSN, the authorities' file, and the `--config` file's values
    /// under the environment.
    fn resolve(self, verb: &str, env: Environment, warnings: &mut Vec<String>) -> Result<Resolved, String> {
        let path = self.config.or_else(|| env("OUTBOX_CONFIG").map(PathBuf::from));
        let file = path.map_or_else(|| Ok(HashMap::new()), |p| file::read(&p))?;
        let layered = |variable: &str| env(variable).or_else(|| file.get(variable).cloned());
        if self.dsn.as_deref().is_some_and(connect::holds_password) {
            warnings.push(
                "--dsn holds a password, which every local user can read in ps: give it in --dsn-file, \
                 OUTBOX_DSN, PGPASSWORD or a password file"
                    .into(),
            );
        }
        let dsn = secret(self.dsn, self.dsn_file, "--dsn", "OUTBOX_DSN", &layered)?.ok_or_else(|| {
            format!("{verb}: --dsn, --dsn-file, OUTBOX_DSN or OUTBOX_DSN_FILE names the database")
        })?;
        let ca_file = self.tls_ca_file.or_else(|| layered("OUTBOX_TLS_CA_FILE").map(PathBuf::from));
        Ok(Resolved { dsn, ca_file, file })
    }
}

/// A secret given as an option or in a file (`--X-file`), else by the
/// environment or the `--config` file (`VARIABLE`, `VARIABLE_FILE`).
fn secret(
    given: Option<String>,
    given_file: Option<PathBuf>,
    option: &str,
    variable: &str,
    layered: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<String>, String> {
    if given.is_some() {
        return Ok(given);
    }
    if let Some(path) = given_file {
        return read_secret(&path, &format!("{option}-file")).map(Some);
    }
    let variable_file = format!("{variable}_FILE");
    match (layered(variable), layered(&variable_file)) {
        (Some(_), Some(_)) => Err(format!("{variable} and {variable_file}: give one")),
        (Some(value), None) => Ok(Some(value)),
        (None, Some(path)) => read_secret(Path::new(&path), &variable_file).map(Some),
        (None, None) => Ok(None),
    }
}

/// The first line of a file that holds a secret; refused when others may
/// read it.
fn read_secret(path: &Path, what: &str) -> Result<String, String> {
    let text = private_file::read(path, Rule::Key, what)?;
    let line = text.lines().next().unwrap_or_default().trim_end();
    if line.is_empty() {
        return Err(format!("{what} {}: empty", path.display()));
    }
    Ok(line.to_string())
}

fn resolve_replay(
    replay: Replay,
    args: ReplayArgs,
    env: Environment,
    warnings: &mut Vec<String>,
) -> Result<Command, String> {
    let verb = match replay {
        Replay::Resend => "resend",
        Replay::Discard => "discard",
    };
    if args.all && replay == Replay::Resend {
        return Err(
            "resend --all: what a call sends again is sent by the dispatchers meanwhile, and a second call \
                    would send it again: call once a --max-events, with --created-before for the next"
                .into(),
        );
    }
    let Resolved { dsn, ca_file, .. } = args.connection.resolve(verb, env, warnings)?;
    let filter = Filter {
        ids: args.ids,
        queue: args.queue,
        task: args.task,
        event_type: args.event_type,
        status: args.status,
        created_after: args.created_after,
        created_before: args.created_before,
        max_events: args.max_events,
    };
    Ok(Command::Replay { replay, dsn, ca_file, schema: args.schema, filter, all: args.all })
}

fn resolve_run(run: RunArgs, env: Environment, warnings: &mut Vec<String>) -> Result<Command, String> {
    if run
        .broker_url
        .as_deref()
        .is_some_and(|url| BrokerUrl::parse(url).map_or(true, |u| u.password.is_some()))
    {
        warnings.push(
            "--broker-url holds a password, which every local user can read in ps: give it in \
             --broker-url-file, OUTBOX_BROKER_URL or --broker-password-file"
                .into(),
        );
    }
    let mut own: Vec<(&'static str, String)> = Vec::new();
    for (option, variable, setting) in OWN_SETTINGS.iter().filter(|(option, _, _)| *option != "--broker-url")
    {
        if let Some(value) = run.own(option).or_else(|| env(variable)) {
            own.push((setting, value));
        }
    }
    let (broker_url, broker_url_file) = (run.broker_url.clone(), run.broker_url_file.clone());
    let (dispatchers, poll_interval, metrics_listen) =
        (run.dispatchers.clone(), run.poll_interval.clone(), run.metrics_listen.clone());
    let Resolved { dsn, ca_file: tls_ca_file, file } = run.connection.resolve("run", env, warnings)?;
    let layered = |variable: &str| env(variable).or_else(|| file.get(variable).cloned());
    // The file's values of the broker's own settings, under the environment's.
    for (_, variable, setting) in OWN_SETTINGS.iter().filter(|(option, _, _)| *option != "--broker-url") {
        if !own.iter().any(|(s, _)| s == setting) {
            if let Some(value) = file.get(*variable) {
                own.push((setting, value.clone()));
            }
        }
    }
    if let Some(url) = secret(broker_url, broker_url_file, "--broker-url", "OUTBOX_BROKER_URL", &layered)? {
        own.push(("outbox.broker_url", url));
    }
    Ok(Command::Run(RunConfig {
        dsn,
        tls_ca_file,
        dispatchers: number(&DISPATCHERS, dispatchers.or_else(|| layered("OUTBOX_DISPATCHERS")))? as usize,
        poll_interval: Duration::from_millis(number(
            &POLL_INTERVAL,
            poll_interval.or_else(|| layered("OUTBOX_POLL_INTERVAL")),
        )? as u64),
        metrics_listen: metrics_listen.or_else(|| layered("OUTBOX_METRICS_LISTEN")),
        own,
    }))
}

/// clap's error said again without any value given: the kind of error,
/// the options' names (from their definitions, or the part of an unknown
/// one before `=`), the suggestions (names this command defines).
fn refusal(e: clap::Error) -> Usage {
    let text = |kind| match e.get(kind) {
        Some(ContextValue::String(s)) => vec![s.clone()],
        Some(ContextValue::Strings(list)) => list.clone(),
        _ => Vec::new(),
    };
    let arg = text(ContextKind::InvalidArg).into_iter().next().map(|a| shown(&a));
    let arg = arg.as_deref().unwrap_or("an argument");
    let said = match e.kind() {
        ErrorKind::DisplayHelp => return Usage::Shown(e.render().to_string()),
        // The same words for every command (clap names the command's own).
        ErrorKind::DisplayVersion => return Usage::Shown(format!("outbox-dispatch {}\n", script::VERSION)),
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand => {
            return Usage::Refused(format!("a command is needed\n\n{}", Cli::command().render_help()));
        }
        ErrorKind::InvalidSubcommand => "unknown command (not shown)".to_string(),
        ErrorKind::UnknownArgument if arg.starts_with('-') => format!("unknown option {arg}"),
        ErrorKind::UnknownArgument => "unexpected argument (not shown)".to_string(),
        ErrorKind::InvalidValue if text(ContextKind::InvalidValue).iter().all(|v| v.is_empty()) => {
            format!("{arg} needs a value")
        }
        ErrorKind::InvalidValue | ErrorKind::ValueValidation => {
            let valid = text(ContextKind::ValidValue);
            match valid.is_empty() {
                true => format!("{arg}: the value given (not shown) is refused"),
                false => format!("{arg}: the value given (not shown) is not one of {}", valid.join(", ")),
            }
        }
        ErrorKind::ArgumentConflict => {
            let prior = text(ContextKind::PriorArg).iter().map(|a| shown(a)).collect::<Vec<_>>().join(", ");
            format!("{arg} cannot be given with {prior}")
        }
        ErrorKind::MissingRequiredArgument => {
            format!(
                "{} is needed",
                text(ContextKind::InvalidArg).iter().map(|a| shown(a)).collect::<Vec<_>>().join(", ")
            )
        }
        ErrorKind::InvalidUtf8 => "an argument is not UTF-8".to_string(),
        kind => format!("{arg}: {}", kind.as_str().unwrap_or("bad usage")),
    };
    let suggested: Vec<String> =
        [ContextKind::SuggestedSubcommand, ContextKind::SuggestedArg].into_iter().flat_map(text).collect();
    let hint = match suggested.as_slice() {
        [] => String::new(),
        list => format!(
            "; did you mean {}?",
            list.iter().map(|s| format!("'{s}'")).collect::<Vec<_>>().join(" or ")
        ),
    };
    Usage::Refused(format!("{said}{hint}\n\nFor more information, try '--help'."))
}

/// An argument as an error may show it: an option's name (`--dns` of
/// `--dns=...`, `--dsn` of `--dsn <DSN>`), when it is written as names
/// are (`--` and at most 40 lower-case letters, digits and dashes), or a
/// short option's letter; never anything else.
fn shown(arg: &str) -> String {
    let name = arg.split(['=', ' ']).next().unwrap_or_default();
    let long = name.strip_prefix("--").is_some_and(|n| {
        !n.is_empty()
            && n.len() <= 40
            && n.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    });
    match name.as_bytes() {
        _ if long => name.to_string(),
        [b'-', letter, ..] if letter.is_ascii_alphanumeric() => format!("-{}", *letter as char),
        _ => "(not shown)".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_string).collect()
    }

    fn none(_: &str) -> Option<String> {
        None
    }

    fn command(line: &str, env: Environment) -> Result<Command, String> {
        match parse(&args(line), env) {
            Ok(invocation) => Ok(invocation.command),
            Err(Usage::Refused(why)) | Err(Usage::Shown(why)) => Err(why),
        }
    }

    #[test]
    fn install_takes_its_dsn_from_the_command_line_or_the_environment() {
        let env = |name: &str| (name == "OUTBOX_DSN").then(|| "env".to_string());
        assert_eq!(
            command("install --dsn postgresql://a@h/db", &env),
            Ok(Command::Install {
                dsn: "postgresql://a@h/db".into(),
                schema: "public".into(),
                ca_file: None
            })
        );
        assert_eq!(
            command("install --schema=app --tls-ca-file /ca.pem", &env),
            Ok(Command::Install { dsn: "env".into(), schema: "app".into(), ca_file: Some("/ca.pem".into()) })
        );
        assert!(command("install", &none).unwrap_err().contains("OUTBOX_DSN"));
    }

    #[test]
    fn unknown_or_incomplete_arguments_are_named_but_never_shown() {
        assert!(command("sql --dsn x", &none).unwrap_err().contains("unknown option --dsn"));
        assert!(command("install --dsn", &none).unwrap_err().contains("--dsn needs a value"));
        for line in [
            "install postgresql://u:S3CRET@h/db",
            "install --dns=postgresql://u:S3CRET@h/db",
            "postgresql://u:S3CRET@h/db",
            "--dsn=postgresql://u:S3CRET@h/db",
            "run --dsn x --broker-ulr=redis://:S3CRET@h",
            "run --dsn x redis://:S3CRET@h",
            "run --dsn x --log-format=S3CRET",
            "run --dsn x --dispatchers S3CRET",
            "run --dsn=S3CRET --dsn-file=/S3CRET",
            "instal --dsn S3CRET",
            "run --dsn x -pS3CRET",
            "run --dsn x -dsn=S3CRET",
            "run --dsn x --S3CRET",
            "run --dsn x ---S3CRET",
        ] {
            let error = command(line, &none).unwrap_err();
            assert!(!error.contains("S3CRET"), "{line}: {error}");
        }
        assert_eq!(
            command("sql --no-transaction", &none),
            Ok(Command::Sql { schema: "public".into(), transaction: false, from: None })
        );
    }

    #[test]
    fn a_misspelled_command_or_option_is_told_the_right_one() {
        let error = command("instal --dsn x", &none).unwrap_err();
        assert!(error.contains("did you mean 'install'"), "{error}");
        let error = command("run --dsn x --dispachers 2", &none).unwrap_err();
        assert!(error.contains("unknown option --dispachers; did you mean '--dispatchers'"), "{error}");
    }

    #[test]
    fn help_and_version_are_shown_for_every_command() {
        for line in ["--help", "-h", "install --help", "sql -h", "run --help", "help run"] {
            let Err(Usage::Shown(text)) = parse(&args(line), &none) else { panic!("{line}") };
            assert!(text.contains("Usage:"), "{line}: {text}");
        }
        for line in ["--version", "-V", "run -V"] {
            let Err(Usage::Shown(text)) = parse(&args(line), &none) else { panic!("{line}") };
            assert_eq!(text.trim(), format!("outbox-dispatch {}", script::VERSION));
        }
        let Err(Usage::Shown(text)) = parse(&args("--help"), &none) else { panic!() };
        assert!(text.contains("Exit status:") && text.contains("3  run: the outbox is not installed"));
        assert!(matches!(parse(&args(""), &none), Err(Usage::Refused(_))));
        assert!(matches!(command("version", &none), Ok(Command::Version)));
    }

    #[test]
    fn run_takes_the_broker_from_the_command_line_over_the_environment() {
        let env = |name: &str| match name {
            "OUTBOX_DSN" => Some("postgresql://a@h/db".to_string()),
            "OUTBOX_BROKER_URL" => Some("redis://env".to_string()),
            "OUTBOX_BROKER_PASSWORD_FILE" => Some("/run/secret".to_string()),
            "OUTBOX_POLL_INTERVAL" => Some("1s".to_string()),
            _ => None,
        };
        let Ok(Command::Run(config)) = command("run --broker-url amqp://h --dispatchers=3", &env) else {
            panic!("run parses");
        };
        assert_eq!(config.dsn, "postgresql://a@h/db");
        assert_eq!(config.dispatchers, 3);
        assert_eq!(config.poll_interval, Duration::from_secs(1));
        let own: HashMap<_, _> = config.own.into_iter().collect();
        assert_eq!(own["outbox.broker_url"], "amqp://h");
        assert_eq!(own["outbox.broker_password_file"], "/run/secret");
        let Ok(Command::Run(config)) = command("run", &env) else { panic!("run parses") };
        assert_eq!(config.poll_interval, Duration::from_secs(1));
        assert_eq!(config.dispatchers, 1);
    }

    fn private(name: &str, text: &str, mode: u32) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("outbox-cli-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn every_key_of_a_config_file_reaches_run_and_the_environment_wins() {
        let keys: Vec<String> = file::KEYS
            .iter()
            .filter(|key| !matches!(**key, "dsn_file" | "broker_url_file"))
            .map(|key| match *key {
                "dispatchers" => format!("{key} = 4"),
                "poll_interval" => format!("{key} = '2s'"),
                _ => format!("{key} = 'file:{key}'"),
            })
            .collect();
        let path = private("every.toml", &keys.join("\n"), 0o600);
        let line = format!("run --config {}", path.display());
        let env = |name: &str| (name == "OUTBOX_BROKER_URL").then(|| "redis://env".to_string());
        let Ok(Command::Run(config)) = command(&line, &env) else { panic!("run parses") };
        std::fs::remove_file(&path).unwrap();
        assert_eq!(config.dsn, "file:dsn");
        assert_eq!(config.tls_ca_file, Some("file:tls_ca_file".into()));
        assert_eq!(config.dispatchers, 4);
        assert_eq!(config.poll_interval, Duration::from_secs(2));
        assert_eq!(config.metrics_listen.as_deref(), Some("file:metrics_listen"));
        let own: HashMap<_, _> = config.own.into_iter().collect();
        assert_eq!(own["outbox.broker_url"], "redis://env");
        assert_eq!(own["outbox.broker_password_file"], "file:broker_password_file");
        assert_eq!(own["outbox.broker_tls_ca_file"], "file:broker_tls_ca_file");
        assert_eq!(own["outbox.broker_tls_cert_file"], "file:broker_tls_cert_file");
        assert_eq!(own["outbox.kafka_sasl_plain_cleartext"], "file:kafka_sasl_plain_cleartext");
        assert_eq!(own["outbox.redis_sentinel_password_file"], "file:sentinel_password_file");
        assert!(command("run --config=/nonexistent/x.toml", &none).unwrap_err().contains("--config"));
        assert!(command("run --dsn x --config", &none).unwrap_err().contains("--config needs a value"));
    }

    #[test]
    fn secrets_come_from_files_no_one_else_may_read_and_an_argument_holding_one_is_warned_of() {
        let dsn = private("dsn", "host=db password=S3CRET\n", 0o600);
        let url = private("url", "redis://:S3CRET@r/0\n", 0o600);
        let line = format!("run --dsn-file {} --broker-url-file {}", dsn.display(), url.display());
        let invocation = parse(&args(&line), &none).unwrap();
        let Command::Run(config) = invocation.command else { panic!() };
        assert_eq!(config.dsn, "host=db password=S3CRET");
        assert!(config.own.contains(&("outbox.broker_url", "redis://:S3CRET@r/0".to_string())));
        assert!(invocation.warnings.is_empty());
        let env = |name: &str| (name == "OUTBOX_DSN_FILE").then(|| dsn.display().to_string());
        assert!(
            matches!(command("install", &env), Ok(Command::Install { dsn, .. }) if dsn.contains("S3CRET"))
        );
        for mode in [0o644, 0o640, 0o604] {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dsn, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = command(&line, &none).unwrap_err();
            assert!(e.contains("--dsn-file") && e.contains("0600") && !e.contains("S3CRET"), "{e}");
        }
        let line: Vec<String> = ["run", "--dsn", "host=db password=x", "--broker-url", "redis://:pw@r/0"]
            .map(str::to_string)
            .to_vec();
        let warnings = parse(&line, &none).unwrap().warnings;
        assert!(warnings.iter().any(|w| w.starts_with("--dsn holds a password")), "{warnings:?}");
        assert!(warnings.iter().any(|w| w.starts_with("--broker-url holds a password")), "{warnings:?}");
        let quiet = parse(&args("run --dsn host=db --broker-url redis://r/0"), &none).unwrap();
        assert!(quiet.warnings.is_empty());
        assert!(command("run --dsn x --dsn-file /f", &none).unwrap_err().contains("cannot be given with"));
        std::fs::remove_file(dsn).unwrap();
        std::fs::remove_file(url).unwrap();
    }

    #[test]
    fn run_refuses_numbers_out_of_range_naming_the_option_and_the_limit() {
        let env = |name: &str| (name == "OUTBOX_DSN").then(|| "x".to_string());
        let error = command("run --dispatchers 0", &env).unwrap_err();
        assert!(error.contains("--dispatchers") && error.contains("1 .. 64"), "{error}");
        let error = command("run --poll-interval 5min5", &env).unwrap_err();
        assert!(error.contains("--poll-interval") && !error.contains("5min5"), "{error}");
        assert!(command("run", &none).unwrap_err().contains("OUTBOX_DSN"));
        assert!(command("install --broker-url x", &none)
            .unwrap_err()
            .contains("unknown option --broker-url"));
    }

    #[test]
    fn the_log_s_format_and_level_from_an_option_or_the_environment() {
        let env = |name: &str| match name {
            "OUTBOX_LOG_FORMAT" => Some("json".to_string()),
            _ => None,
        };
        let invocation = parse(&args("sql --log-level warning"), &env).unwrap();
        assert_eq!(invocation.log, (Format::Json, Level::Warning));
        let invocation = parse(&args("--log-format text sql"), &env).unwrap();
        assert_eq!(invocation.log, (Format::Text, Level::Info));
        let bad = |name: &str| (name == "OUTBOX_LOG_LEVEL").then(|| "S3CRET".to_string());
        let Err(Usage::Refused(e)) = parse(&args("sql"), &bad) else { panic!() };
        assert!(e.contains("OUTBOX_LOG_LEVEL") && !e.contains("S3CRET"), "{e}");
    }
}
