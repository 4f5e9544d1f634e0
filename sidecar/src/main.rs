//! `outbox-dispatch`: outbox_dispatch where no background worker can be
//! loaded (a managed PostgreSQL). `install` puts the schema and the SQL API
//! into a database as its owner; `sql` prints the same script for a
//! migration to run.

mod connect;
mod install;
mod script;

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "\
usage: outbox-dispatch install [--dsn DSN] [--schema NAME] [--tls-ca-file PATH]
       outbox-dispatch sql [--schema NAME] [--no-transaction]
       outbox-dispatch --version

  install  installs the outbox schema and the SQL API into the database of
           DSN (or of the environment's OUTBOX_DSN), as that role, in one
           transaction; does nothing where this release is installed
  sql      prints the same script (in a transaction, unless
           --no-transaction: for a migration tool that opens its own)

  --schema NAME       the schema of the functions (outbox_enqueue() ...);
                      public by default
  --tls-ca-file PATH  the authorities the server's certificate must chain
                      to (or OUTBOX_TLS_CA_FILE); the system's by default.
                      TLS is used unless the DSN says sslmode=disable
Options take their value as the next argument, or after an equals sign.
";

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
enum Command {
    Install { dsn: String, schema: String, ca_file: Option<PathBuf> },
    Sql { schema: String, transaction: bool },
    Version,
}

/// The environment's defaults of the options.
#[derive(Default)]
struct Environment {
    dsn: Option<String>,
    ca_file: Option<String>,
}

fn parse(args: &[String], env: Environment) -> Result<Command, String> {
    let Some((verb, rest)) = args.split_first() else {
        return Err("a command is needed".to_string());
    };
    let mut dsn = env.dsn;
    let mut ca_file = env.ca_file;
    let mut schema = "public".to_string();
    let mut transaction = true;
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
        match name {
            "--dsn" if verb == "install" => dsn = Some(value().ok_or_else(|| needs(name))?),
            "--tls-ca-file" if verb == "install" => ca_file = Some(value().ok_or_else(|| needs(name))?),
            "--schema" => schema = value().ok_or_else(|| needs(name))?,
            "--no-transaction" if verb == "sql" && inline.is_none() => transaction = false,
            _ if name.starts_with("--") => return Err(format!("{verb}: unknown option {name}")),
            _ => return Err(format!("{verb}: unexpected argument {} (not shown)", position + 1)),
        }
    }
    match verb.as_str() {
        "install" => {
            let dsn = dsn.ok_or("install: --dsn or OUTBOX_DSN names the database")?;
            Ok(Command::Install { dsn, schema, ca_file: ca_file.map(PathBuf::from) })
        }
        "sql" => Ok(Command::Sql { schema, transaction }),
        "--version" | "version" => Ok(Command::Version),
        other if other.starts_with("--") => {
            Err(format!("unknown option {}", other.split('=').next().unwrap_or("")))
        }
        _ => Err("unknown command (not shown)".to_string()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let env = Environment {
        dsn: std::env::var("OUTBOX_DSN").ok(),
        ca_file: std::env::var("OUTBOX_TLS_CA_FILE").ok(),
    };
    let command = match parse(&args, env) {
        Ok(command) => command,
        Err(why) => {
            eprintln!("outbox-dispatch: {why}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match command {
        Command::Version => println!("outbox-dispatch {}", script::VERSION),
        Command::Sql { schema, transaction } => match script::script(&schema) {
            Ok(sql) if transaction => print!("BEGIN;\n{sql}COMMIT;\n"),
            Ok(sql) => print!("{sql}"),
            Err(e) => {
                eprintln!("outbox-dispatch: {e}");
                return ExitCode::from(2);
            }
        },
        Command::Install { dsn, schema, ca_file } => {
            let result = connect::connect(&dsn, ca_file.as_deref())
                .map_err(install::InstallError::Refused)
                .and_then(|mut client| install::install(&mut client, &schema));
            match result {
                Ok(install::Installed::Now) => {
                    println!("outbox-dispatch: installed outbox_dispatch {}", script::VERSION)
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

    #[test]
    fn install_takes_its_dsn_from_the_command_line_or_the_environment() {
        let env = || Environment { dsn: Some("env".into()), ca_file: None };
        assert_eq!(
            parse(&args("install --dsn postgresql://a@h/db"), env()),
            Ok(Command::Install {
                dsn: "postgresql://a@h/db".into(),
                schema: "public".into(),
                ca_file: None
            })
        );
        assert_eq!(
            parse(&args("install --schema=app --tls-ca-file /ca.pem"), env()),
            Ok(Command::Install { dsn: "env".into(), schema: "app".into(), ca_file: Some("/ca.pem".into()) })
        );
        assert!(parse(&args("install"), Environment::default()).unwrap_err().contains("OUTBOX_DSN"));
    }

    #[test]
    fn unknown_or_incomplete_arguments_are_named_but_never_shown() {
        let none = Environment::default;
        assert!(parse(&args("sql --dsn x"), none()).unwrap_err().contains("unknown option --dsn"));
        assert!(parse(&args("install --dsn"), none()).unwrap_err().contains("--dsn needs a value"));
        for line in [
            "install postgresql://u:S3CRET@h/db",
            "install --dns=postgresql://u:S3CRET@h/db",
            "postgresql://u:S3CRET@h/db",
            "--dsn=postgresql://u:S3CRET@h/db",
        ] {
            let error = parse(&args(line), none()).unwrap_err();
            assert!(!error.contains("S3CRET"), "{line}: {error}");
        }
        assert_eq!(
            parse(&args("sql --no-transaction"), none()),
            Ok(Command::Sql { schema: "public".into(), transaction: false })
        );
    }
}
