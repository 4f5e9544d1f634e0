//! `outbox-dispatch`: outbox_dispatch where no background worker can be
//! loaded (a managed PostgreSQL). `install` puts the schema and the SQL API
//! into a database as its owner; `sql` prints the same script for a
//! migration to run.

mod install;
mod script;

use std::process::ExitCode;

const USAGE: &str = "\
usage: outbox-dispatch install [--dsn DSN] [--schema NAME]
       outbox-dispatch sql [--schema NAME] [--no-transaction]
       outbox-dispatch --version

  install  installs the outbox schema and the SQL API into the database of
           DSN (or of the environment's OUTBOX_DSN), as that role, in one
           transaction; does nothing where this release is installed
  sql      prints the same script (in a transaction, unless
           --no-transaction: for a migration tool that opens its own)

  --schema NAME  the schema of the functions (outbox_enqueue() ...); public
";

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
enum Command {
    Install { dsn: String, schema: String },
    Sql { schema: String, transaction: bool },
    Version,
}

fn parse(args: &[String], dsn_from_env: Option<String>) -> Result<Command, String> {
    let Some((verb, rest)) = args.split_first() else {
        return Err("a command is needed".to_string());
    };
    let mut dsn = None;
    let mut schema = "public".to_string();
    let mut transaction = true;
    let mut rest = rest.iter();
    while let Some(arg) = rest.next() {
        let mut value = |name: &str| rest.next().cloned().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--dsn" if verb == "install" => dsn = Some(value("--dsn")?),
            "--schema" => schema = value("--schema")?,
            "--no-transaction" if verb == "sql" => transaction = false,
            other => return Err(format!("{verb}: unknown argument {other:?}")),
        }
    }
    match verb.as_str() {
        "install" => {
            let dsn = dsn.or(dsn_from_env).ok_or("install: --dsn or OUTBOX_DSN names the database")?;
            Ok(Command::Install { dsn, schema })
        }
        "sql" => Ok(Command::Sql { schema, transaction }),
        "--version" | "version" => Ok(Command::Version),
        other => Err(format!("unknown command {other:?}")),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = match parse(&args, std::env::var("OUTBOX_DSN").ok()) {
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
        Command::Install { dsn, schema } => {
            let result = postgres::Client::connect(&dsn, postgres::NoTls)
                .map_err(install::InstallError::from)
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
        assert_eq!(
            parse(&args("install --dsn postgresql://a@h/db"), Some("env".into())),
            Ok(Command::Install { dsn: "postgresql://a@h/db".into(), schema: "public".into() })
        );
        assert_eq!(
            parse(&args("install --schema app"), Some("env".into())),
            Ok(Command::Install { dsn: "env".into(), schema: "app".into() })
        );
        assert!(parse(&args("install"), None).unwrap_err().contains("OUTBOX_DSN"));
    }

    #[test]
    fn unknown_or_incomplete_arguments_are_named() {
        assert!(parse(&args("sql --dsn x"), None).unwrap_err().contains("--dsn"));
        assert!(parse(&args("install --dsn"), None).unwrap_err().contains("--dsn needs a value"));
        assert!(parse(&args("frobnicate"), None).unwrap_err().contains("frobnicate"));
        assert_eq!(
            parse(&args("sql --no-transaction"), None),
            Ok(Command::Sql { schema: "public".into(), transaction: false })
        );
    }
}
