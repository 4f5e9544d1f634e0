//! `outbox-dispatch`: outbox_dispatch where no background worker can be
//! loaded (a managed PostgreSQL). `install` puts the schema and the SQL API
//! into a database as its owner; `sql` prints the same script for a
//! migration to run; `run` delivers its events; `resend` and `discard`
//! act on the events a filter names.

mod cli;
mod connect;
mod file;
mod host;
mod install;
mod lease;
mod listen;
mod log;
mod metrics;
mod pooler;
mod private_file;
mod replay;
mod run;
mod script;
mod status;
mod store;

use std::process::ExitCode;

use cli::{Command, Usage};

fn main() -> ExitCode {
    // An argument that is not UTF-8 is refused without being shown.
    let Ok(args) = std::env::args_os().skip(1).map(|a| a.into_string()).collect::<Result<Vec<String>, _>>()
    else {
        eprintln!("outbox-dispatch: an argument is not UTF-8 (not shown)");
        return ExitCode::from(2);
    };
    let invocation = match cli::parse(&args, &|name| std::env::var(name).ok()) {
        Ok(invocation) => invocation,
        Err(Usage::Shown(text)) => {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        Err(Usage::Refused(why)) => {
            eprintln!("outbox-dispatch: {why}");
            return ExitCode::from(2);
        }
    };
    log::configure(invocation.log.0, invocation.log.1);
    invocation.warnings.iter().for_each(|w| log::warning(w));
    let command = invocation.command;
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
        Command::Replay { replay, dsn, ca_file, schema, filter, all } => {
            let result = connect::connect(&dsn, ca_file.as_deref())
                .and_then(|mut client| replay::replay(&mut client, replay, &schema, &filter, all));
            match result {
                Ok(n) => println!("outbox-dispatch: {}", replay.done(n)),
                Err(e) => {
                    eprintln!("outbox-dispatch: {e}");
                    return ExitCode::FAILURE;
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
