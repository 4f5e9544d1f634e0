//! libpq's password file (`passfile`, `PGPASSFILE`, `~/.pgpass`): lines
//! of `host:port:database:user:password`, `*` matching any value, `\`
//! escaping `:` and `\`. Read at each connect, when the DSN and
//! `PGPASSWORD` give none; ignored, with a warning, when the group or
//! others may use it, as libpq ignores it.

use std::path::Path;

use super::options::{Endpoint, Host};
use crate::private_file::{self, Refused, Rule};

/// What the password file says for one connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup {
    Found(String),
    /// No such file, or no line for this connection.
    Nothing,
    /// The file is not used: why (a warning for the log).
    Ignored(String),
}

/// The directories of the server's socket that the file names
/// `localhost`, as libpq names its default one.
const LOCAL_SOCKET_DIRS: [&str; 3] = ["/var/run/postgresql", "/run/postgresql", "/tmp"];

/// The password of the first line of `file` that matches.
pub fn lookup(file: &Path, endpoint: &Endpoint, dbname: &str, user: &str) -> Lookup {
    let text = match private_file::read_private(file, Rule::Passfile) {
        Ok(text) => text,
        Err(Refused::Io(_)) => return Lookup::Nothing,
        Err(Refused::Exposed(why)) => {
            return Lookup::Ignored(format!("password file {} is ignored: {why}", file.display()));
        }
    };
    let host = match &endpoint.host {
        Host::Tcp(name) => name.clone(),
        Host::Unix(dir) if LOCAL_SOCKET_DIRS.iter().any(|d| dir == Path::new(d)) => "localhost".into(),
        Host::Unix(dir) => dir.display().to_string(),
    };
    let port = endpoint.port.to_string();
    for line in text.lines().map(|l| l.trim_end_matches('\r')) {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let fields = split(line);
        let [h, p, d, u, password, ..] = fields.as_slice() else { continue };
        let matches = |field: &str, value: &str| field == "*" || field == value;
        if matches(h, &host) && matches(p, &port) && matches(d, dbname) && matches(u, user) {
            return Lookup::Found(password.clone());
        }
    }
    Lookup::Nothing
}

/// A line's fields, unescaped, separated by the `:` not escaped (the
/// password ends at one, as libpq's does).
fn split(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => fields.last_mut().expect("one at least").extend(chars.next()),
            ':' => fields.push(String::new()),
            c => fields.last_mut().expect("one at least").push(c),
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn endpoint(host: Host, port: u16) -> Endpoint {
        Endpoint { host, hostaddr: None, port }
    }

    fn file(text: &str, mode: u32) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!(
            "outbox-pgpass-{}-{mode:o}-{}",
            std::process::id(),
            text.len()
        ));
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn the_first_matching_line_gives_the_password_unescaped() {
        let path = file(
            "# comment\n\
             db.example:5432:app:other:wrong\n\
             db.example:5432:app:owner:s\\:e\\\\c:r\\et\n\
             *:*:*:owner:fallback\r\n\
             localhost:5433:*:*:socket\n",
            0o600,
        );
        let tcp = endpoint(Host::Tcp("db.example".into()), 5432);
        assert_eq!(lookup(&path, &tcp, "app", "owner"), Lookup::Found("s:e\\c".into()));
        assert_eq!(lookup(&path, &tcp, "other_db", "owner"), Lookup::Found("fallback".into()));
        let socket = endpoint(Host::Unix("/var/run/postgresql".into()), 5433);
        assert_eq!(lookup(&path, &socket, "app", "someone"), Lookup::Found("socket".into()));
        let elsewhere = endpoint(Host::Unix("/srv/pg".into()), 5433);
        assert_eq!(lookup(&path, &elsewhere, "app", "someone"), Lookup::Nothing);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_file_others_may_read_is_ignored_naming_why() {
        let path = file("*:*:*:*:S3CRET\n", 0o644);
        let found = lookup(&path, &endpoint(Host::Tcp("h".into()), 5432), "d", "u");
        let Lookup::Ignored(why) = found else { panic!("{found:?}") };
        assert!(why.contains("0644") && why.contains("0600") && !why.contains("S3CRET"), "{why}");
        std::fs::remove_file(path).unwrap();
        assert_eq!(
            lookup(Path::new("/nonexistent/.pgpass"), &endpoint(Host::Tcp("h".into()), 1), "d", "u"),
            Lookup::Nothing
        );
    }
}
