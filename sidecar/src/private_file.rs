//! Files that hold a secret: a password file (`.pgpass`), a client
//! certificate's key (`sslkey`), the sidecar's own `--config`,
//! `--dsn-file` and `--broker-url-file`. libpq reads the first two only
//! when other users cannot, and so does the sidecar, for all of them.

use std::fmt;
use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// What others may do to a file that must be private.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// libpq's `.pgpass`: no access at all for the group or others.
    Passfile,
    /// libpq's client key: `u=rw` (0600) or less when the file is the
    /// user's own, `u=rw,g=r` (0640) or less when root owns it (a key a
    /// group of services shares, as Debian's ssl-cert group does); never
    /// any access for others.
    Key,
}

/// Why a file is not private enough to read a secret from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exposed {
    /// A directory, a device, a socket.
    NotAFile,
    /// Its group or others may read or write it; its mode, and the most
    /// the rule allows.
    Open { mode: u32, most: &'static str },
}

impl fmt::Display for Exposed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exposed::NotAFile => write!(f, "not a plain file"),
            Exposed::Open { mode, most } => write!(
                f,
                "others may read or write it (mode {:04o}); it must be {most}: chmod go-rwx",
                mode & 0o7777
            ),
        }
    }
}

/// Whether the file of `meta` is private enough under `rule`, for the
/// process whose effective user is `euid`.
pub fn check(meta: &Metadata, rule: Rule, euid: u32) -> Result<(), Exposed> {
    if !meta.is_file() {
        return Err(Exposed::NotAFile);
    }
    let mode = meta.mode();
    let (allowed, most) = match rule {
        Rule::Passfile => (0, "u=rw (0600) or less"),
        // Root's key may be read by its group; anyone else's, by no one
        // but its owner (libpq checks only the owner's own and root's:
        // a key of a third user is held to the owner's rule here).
        Rule::Key if meta.uid() == 0 && euid != 0 => (0o040, "u=rw,g=r (0640) or less, owned by root"),
        Rule::Key => (0, "u=rw (0600) or less"),
    };
    if mode & 0o077 & !allowed != 0 {
        return Err(Exposed::Open { mode, most });
    }
    Ok(())
}

/// The text of the file at `path` and what it was when read: opened
/// once, so that what is checked is what is read (no file put in its
/// place between the two), and without waiting on a FIFO.
pub fn open(path: &Path) -> std::io::Result<(String, Metadata)> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let meta = file.metadata()?;
    let mut text = String::new();
    if meta.is_file() {
        file.read_to_string(&mut text)?;
    }
    Ok((text, meta))
}

/// Why a private file was not read.
#[derive(Debug)]
pub enum Refused {
    Io(std::io::Error),
    Exposed(Exposed),
}

/// The text of the file at `path` when it is private enough under `rule`.
pub fn read_private(path: &Path, rule: Rule) -> Result<String, Refused> {
    let (text, meta) = open(path).map_err(Refused::Io)?;
    check(&meta, rule, effective_user()).map_err(Refused::Exposed)?;
    Ok(text)
}

/// Reads the file at `path` when it is private enough under `rule`;
/// `what` names it in the errors (an option, a setting).
pub fn read(path: &Path, rule: Rule, what: &str) -> Result<String, String> {
    read_private(path, rule).map_err(|refused| match refused {
        Refused::Io(e) => format!("{what} {}: {e}", path.display()),
        Refused::Exposed(why) => refusal(path, what, &why),
    })
}

/// Says why the file `what` names is refused.
pub fn refusal(path: &Path, what: &str, why: &Exposed) -> String {
    format!("{what} {}: refused, as libpq refuses such a file: {why}", path.display())
}

/// The process's effective user id.
pub fn effective_user() -> u32 {
    // SAFETY: geteuid() cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn file(test: &str, mode: u32) -> (std::path::PathBuf, Metadata) {
        let path =
            std::env::temp_dir().join(format!("outbox-private-{}-{test}-{mode:o}", std::process::id()));
        std::fs::write(&path, "x").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        (path, meta)
    }

    #[test]
    fn a_file_of_ones_own_the_group_or_others_may_use_is_exposed() {
        let me = effective_user();
        for mode in [0o600, 0o400, 0o640, 0o604, 0o660, 0o644, 0o700, 0o610] {
            let (path, meta) = file("own", mode);
            let private = mode & 0o077 == 0;
            assert_eq!(check(&meta, Rule::Passfile, me).is_ok(), private, "{mode:o}");
            assert_eq!(check(&meta, Rule::Key, me).is_ok(), private, "{mode:o}");
            std::fs::remove_file(path).unwrap();
        }
        let dir = std::fs::metadata(std::env::temp_dir()).unwrap();
        assert_eq!(check(&dir, Rule::Passfile, me), Err(Exposed::NotAFile));
    }

    #[test]
    fn a_key_root_owns_may_be_read_by_its_group_and_by_no_one_else() {
        let (path, meta) = file("root", 0o640);
        if meta.uid() == 0 {
            // Another user (euid 1000) reading root's key.
            assert!(check(&meta, Rule::Key, 1000).is_ok());
            let (other, meta) = file("root", 0o644);
            assert!(check(&meta, Rule::Key, 1000).is_err());
            std::fs::remove_file(other).unwrap();
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn the_error_names_the_mode_and_the_rule_never_the_content() {
        let (path, _) = file("error", 0o644);
        std::fs::write(&path, "S3CRET").unwrap();
        let e = read(&path, Rule::Key, "--config").unwrap_err();
        assert!(e.contains("--config") && e.contains("0644") && e.contains("0600"), "{e}");
        assert!(!e.contains("S3CRET"));
        std::fs::remove_file(path).unwrap();
    }
}
