//! `outbox-dispatch`: outbox_dispatch where no background worker can be
//! loaded (a managed PostgreSQL). `install` puts the schema and the SQL API
//! into a database as its owner; `sql` prints the same script for a
//! migration to run; `run` delivers its events.

mod connect;
mod file;
mod host;
mod install;
mod listen;
mod log;
mod metrics;
mod private_file;
mod run;
mod script;
mod store;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use outbox_core::guc::{Declared, Kind, Parsed, Unit};

use run::{RunConfig, OWN_SETTINGS};

const USAGE: &str = "\
usage: outbox-dispatch install [--dsn DSN] [--schema NAME] [--tls-ca-file PATH]
                               [--config FILE]
       outbox-dispatch sql [--schema NAME] [--no-transaction] [--update-from RELEASE]
       outbox-dispatch run [--dsn DSN] [--tls-ca-file PATH] [--config FILE]
                           [--broker-url URL]
                           [--dispatchers N] [--poll-interval TIME]
                           [--metrics-listen HOST:PORT]
                           [--broker-password-file PATH] [--broker-tls-ca-file PATH]
                           [--sentinel-password-file PATH]
       outbox-dispatch --version

  install  installs the outbox schema and the SQL API into the database of
           DSN (or of the environment's OUTBOX_DSN), as that role, in one
           transaction; does nothing where this release is installed, and
           updates an outbox an earlier release installed (0.10.0, 1.0.0)
  sql      prints the same script (in a transaction, unless
           --no-transaction: for a migration tool that opens its own);
           with --update-from, the script that updates that release
  run      delivers the events of the database of DSN until SIGTERM or
           SIGINT (SIGHUP reads the settings again). The outbox.* settings
           are the database's (outbox.settings, ALTER DATABASE ... SET);
           the broker's URL and files are the sidecar's own

  --schema NAME       the schema of the functions (outbox_enqueue() ...);
                      public by default
  --tls-ca-file PATH  the authorities the server's certificate must chain
                      to (or OUTBOX_TLS_CA_FILE); the system's by default.
                      TLS is used unless the DSN says sslmode=disable
  --broker-url URL    the broker, as kombu writes it (or OUTBOX_BROKER_URL);
                      redis://127.0.0.1:6379/0 by default
  --dispatchers N     dispatchers of this process, each on a connection of
                      its own (or OUTBOX_DISPATCHERS); 1 by default
  --poll-interval T   the longest a dispatcher sleeps without a NOTIFY (or
                      OUTBOX_POLL_INTERVAL): 20ms by default; a number of
                      milliseconds, or with a unit (250ms, 1s)
  --metrics-listen HOST:PORT
                      serves /metrics there (or OUTBOX_METRICS_LISTEN);
                      nowhere by default
  --broker-password-file, --broker-tls-ca-file, --sentinel-password-file
                      (or OUTBOX_BROKER_PASSWORD_FILE, ...): as
                      outbox.broker_password_file, outbox.broker_tls_ca_file
                      and outbox.redis_sentinel_password_file
  --config FILE       a TOML file of what the environment may say (or
                      OUTBOX_CONFIG): a key per variable in lower case
                      (dsn = '...', broker_url = '...', dispatchers = 2);
                      the environment wins over it, an option over both
Options take their value as the next argument, or after an equals sign.
";

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
enum Command {
    Install { dsn: String, schema: String, ca_file: Option<PathBuf> },
    Sql { schema: String, transaction: bool, from: Option<String> },
    Run(RunConfig),
    Version,
}

/// `--dispatchers`, as a setting is declared.
const DISPATCHERS: Declared =
    Declared { name: "--dispatchers", kind: Kind::Int { default: 1, min: 1, max: 64, unit: Unit::None } };
/// `--poll-interval`.
const POLL_INTERVAL: Declared = Declared {
    name: "--poll-interval",
    kind: Kind::Int { default: 20, min: 1, max: 3_600_000, unit: Unit::Ms },
};

/// The value of an integer option, or its default.
fn number(option: &Declared, value: Option<String>) -> Result<i32, String> {
    match value.map(|v| option.parse(&v)).unwrap_or_else(|| Ok(option.default())) {
        Ok(Parsed::Int(n)) => Ok(n),
        Ok(other) => Err(format!("{}: {other:?} is not a number", option.name)),
        Err(e) => Err(e.to_string()),
    }
}

/// `parse`'s view of the environment: the value of a variable.
type Environment<'a> = &'a dyn Fn(&str) -> Option<String>;

fn parse(args: &[String], env: Environment) -> Result<Command, String> {
    let Some((verb, rest)) = args.split_first() else {
        return Err("a command is needed".to_string());
    };
    let mut dsn = env("OUTBOX_DSN");
    let mut ca_file = env("OUTBOX_TLS_CA_FILE");
    let mut dispatchers = env("OUTBOX_DISPATCHERS");
    let mut poll_interval = env("OUTBOX_POLL_INTERVAL");
    let mut metrics_listen = env("OUTBOX_METRICS_LISTEN");
    let mut own: Vec<(&'static str, String)> =
        OWN_SETTINGS.iter().filter_map(|(_, var, setting)| env(var).map(|v| (*setting, v))).collect();
    let mut schema = "public".to_string();
    let mut transaction = true;
    let mut from = None;
    let mut rest = rest.iter().enumerate();
    while let Some((position, arg)) = rest.next() {
        // A value may hold a password: an argument is named by its option
        // alone, never echoed.
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(value.to_string())),
            _ => (arg.as_str(), None),
        };
        let mut value = || inline.clone().or_else(|| rest.next().map(|(_, v)| v.clone()));
        let needs = |name: &str| format!("{name} needs a value");
        let connects = verb == "install" || verb == "run";
        match name {
            "--dsn" if connects => dsn = Some(value().ok_or_else(|| needs(name))?),
            // Read by main() before: see `configured`.
            "--config" if connects => drop(value().ok_or_else(|| needs(name))?),
            "--tls-ca-file" if connects => ca_file = Some(value().ok_or_else(|| needs(name))?),
            "--schema" if verb != "run" => schema = value().ok_or_else(|| needs(name))?,
            "--dispatchers" if verb == "run" => dispatchers = Some(value().ok_or_else(|| needs(name))?),
            "--poll-interval" if verb == "run" => poll_interval = Some(value().ok_or_else(|| needs(name))?),
            "--metrics-listen" if verb == "run" => metrics_listen = Some(value().ok_or_else(|| needs(name))?),
            _ if verb == "run" && OWN_SETTINGS.iter().any(|(option, _, _)| *option == name) => {
                let setting = OWN_SETTINGS.iter().find(|(option, _, _)| *option == name).map(|(_, _, s)| *s);
                let setting = setting.expect("found above");
                let value = value().ok_or_else(|| needs(name))?;
                own.retain(|(s, _)| *s != setting);
                own.push((setting, value));
            }
            "--no-transaction" if verb == "sql" && inline.is_none() => transaction = false,
            "--update-from" if verb == "sql" => from = Some(value().ok_or_else(|| needs(name))?),
            _ if name.starts_with("--") => return Err(format!("{verb}: unknown option {name}")),
            _ => return Err(format!("{verb}: unexpected argument {} (not shown)", position + 1)),
        }
    }
    match verb.as_str() {
        "install" => {
            let dsn = dsn.ok_or("install: --dsn or OUTBOX_DSN names the database")?;
            Ok(Command::Install { dsn, schema, ca_file: ca_file.map(PathBuf::from) })
        }
        "sql" => Ok(Command::Sql { schema, transaction, from }),
        "run" => Ok(Command::Run(RunConfig {
            dsn: dsn.ok_or("run: --dsn or OUTBOX_DSN names the database")?,
            tls_ca_file: ca_file.map(PathBuf::from),
            dispatchers: number(&DISPATCHERS, dispatchers)? as usize,
            poll_interval: Duration::from_millis(number(&POLL_INTERVAL, poll_interval)? as u64),
            metrics_listen,
            own,
        })),
        "--version" | "version" => Ok(Command::Version),
        other if other.starts_with("--") => {
            Err(format!("unknown option {}", other.split('=').next().unwrap_or("")))
        }
        _ => Err("unknown command (not shown)".to_string()),
    }
}

/// The values of the file `--config` (or `OUTBOX_CONFIG`) names, by the
/// variable each stands for; none without one.
fn configured(args: &[String], env: Environment) -> Result<HashMap<String, String>, String> {
    let mut path = env("OUTBOX_CONFIG");
    let mut rest = args.iter().skip(1);
    while let Some(arg) = rest.next() {
        if arg == "--config" {
            path = rest.next().cloned();
        } else if let Some(given) = arg.strip_prefix("--config=") {
            path = Some(given.to_string());
        }
    }
    path.map_or_else(|| Ok(HashMap::new()), |path| file::read(Path::new(&path)))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let env = |name: &str| std::env::var(name).ok();
    let parsed = configured(&args, &env)
        .and_then(|file| parse(&args, &|name| env(name).or_else(|| file.get(name).cloned())));
    let command = match parsed {
        Ok(command) => command,
        Err(why) => {
            eprintln!("outbox-dispatch: {why}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match command {
        Command::Version => println!("outbox-dispatch {}", script::VERSION),
        Command::Run(config) => return ExitCode::from(run::run(config) as u8),
        Command::Sql { schema, transaction, from } => {
            let sql = match from.as_deref() {
                None => script::script(&schema),
                Some(from) => script::update(from, &schema),
            };
            match sql {
                Ok(sql) if transaction => print!("BEGIN;\n{sql}COMMIT;\n"),
                Ok(sql) => print!("{sql}"),
                Err(e) => {
                    eprintln!("outbox-dispatch: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        Command::Install { dsn, schema, ca_file } => {
            let result = connect::connect(&dsn, ca_file.as_deref())
                .map_err(install::InstallError::Refused)
                .and_then(|mut client| install::install(&mut client, &schema));
            match result {
                Ok(install::Installed::Now) => {
                    println!("outbox-dispatch: installed outbox_dispatch {}", script::VERSION)
                }
                Ok(install::Installed::Updated(from)) => {
                    println!("outbox-dispatch: updated outbox_dispatch {from} to {}", script::VERSION)
                }
                Ok(install::Installed::Already) => {
                    println!(
                        "outbox-dispatch: outbox_dispatch {} is installed already: nothing to do",
                        script::VERSION
                    )
                }
                Err(e) => {
                    eprintln!("outbox-dispatch: install: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    ExitCode::SUCCESS
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

    #[test]
    fn install_takes_its_dsn_from_the_command_line_or_the_environment() {
        let env = |name: &str| (name == "OUTBOX_DSN").then(|| "env".to_string());
        assert_eq!(
            parse(&args("install --dsn postgresql://a@h/db"), &env),
            Ok(Command::Install {
                dsn: "postgresql://a@h/db".into(),
                schema: "public".into(),
                ca_file: None
            })
        );
        assert_eq!(
            parse(&args("install --schema=app --tls-ca-file /ca.pem"), &env),
            Ok(Command::Install { dsn: "env".into(), schema: "app".into(), ca_file: Some("/ca.pem".into()) })
        );
        assert!(parse(&args("install"), &none).unwrap_err().contains("OUTBOX_DSN"));
    }

    #[test]
    fn unknown_or_incomplete_arguments_are_named_but_never_shown() {
        assert!(parse(&args("sql --dsn x"), &none).unwrap_err().contains("unknown option --dsn"));
        assert!(parse(&args("install --dsn"), &none).unwrap_err().contains("--dsn needs a value"));
        for line in [
            "install postgresql://u:S3CRET@h/db",
            "install --dns=postgresql://u:S3CRET@h/db",
            "postgresql://u:S3CRET@h/db",
            "--dsn=postgresql://u:S3CRET@h/db",
            "run --dsn x --broker-ulr=redis://:S3CRET@h",
            "run --dsn x redis://:S3CRET@h",
        ] {
            let error = parse(&args(line), &none).unwrap_err();
            assert!(!error.contains("S3CRET"), "{line}: {error}");
        }
        assert_eq!(
            parse(&args("sql --no-transaction"), &none),
            Ok(Command::Sql { schema: "public".into(), transaction: false, from: None })
        );
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
        let Ok(Command::Run(config)) = parse(&args("run --broker-url amqp://h --dispatchers=3"), &env) else {
            panic!("run parses");
        };
        assert_eq!(config.dsn, "postgresql://a@h/db");
        assert_eq!(config.dispatchers, 3);
        assert_eq!(config.poll_interval, Duration::from_secs(1));
        let own: std::collections::HashMap<_, _> = config.own.into_iter().collect();
        assert_eq!(own["outbox.broker_url"], "amqp://h");
        assert_eq!(own["outbox.broker_password_file"], "/run/secret");
        let Ok(Command::Run(config)) = parse(&args("run"), &env) else { panic!("run parses") };
        assert_eq!(config.poll_interval, Duration::from_secs(1));
        assert_eq!(config.dispatchers, 1);
    }

    #[test]
    fn every_key_of_a_config_file_reaches_run_and_the_environment_wins() {
        let path = std::env::temp_dir().join(format!("outbox-dispatch-{}.toml", std::process::id()));
        let keys = file::KEYS.map(|key| match key {
            "dispatchers" => format!("{key} = 4"),
            "poll_interval" => format!("{key} = '2s'"),
            _ => format!("{key} = 'file:{key}'"),
        });
        std::fs::write(&path, keys.join("\n")).unwrap();
        let line = args(&format!("run --config {}", path.display()));
        let env = |name: &str| (name == "OUTBOX_BROKER_URL").then(|| "redis://env".to_string());
        let file = configured(&line, &env).unwrap();
        std::fs::remove_file(&path).unwrap();
        let Ok(Command::Run(config)) = parse(&line, &|name| env(name).or_else(|| file.get(name).cloned()))
        else {
            panic!("run parses");
        };
        assert_eq!(config.dsn, "file:dsn");
        assert_eq!(config.tls_ca_file, Some("file:tls_ca_file".into()));
        assert_eq!(config.dispatchers, 4);
        assert_eq!(config.poll_interval, Duration::from_secs(2));
        assert_eq!(config.metrics_listen.as_deref(), Some("file:metrics_listen"));
        let own: HashMap<_, _> = config.own.into_iter().collect();
        assert_eq!(own["outbox.broker_url"], "redis://env");
        assert_eq!(own["outbox.broker_password_file"], "file:broker_password_file");
        assert_eq!(own["outbox.broker_tls_ca_file"], "file:broker_tls_ca_file");
        assert_eq!(own["outbox.redis_sentinel_password_file"], "file:sentinel_password_file");
        assert!(configured(&args("run --config=/nonexistent/x.toml"), &none)
            .unwrap_err()
            .contains("--config"));
        assert!(parse(&args("run --dsn x --config"), &none).unwrap_err().contains("--config needs a value"));
    }

    #[test]
    fn run_refuses_numbers_out_of_range_naming_the_option_and_the_limit() {
        let env = |name: &str| (name == "OUTBOX_DSN").then(|| "x".to_string());
        let error = parse(&args("run --dispatchers 0"), &env).unwrap_err();
        assert!(error.contains("\"--dispatchers\"") && error.contains("1 .. 64"), "{error}");
        let error = parse(&args("run --poll-interval 5min5"), &env).unwrap_err();
        assert!(error.contains("--poll-interval"), "{error}");
        assert!(parse(&args("run"), &none).unwrap_err().contains("OUTBOX_DSN"));
        assert!(parse(&args("install --broker-url x"), &none)
            .unwrap_err()
            .contains("unknown option --broker-url"));
    }
}
