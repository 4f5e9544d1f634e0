//! `--config FILE` (or `OUTBOX_CONFIG`): what the environment may say, in
//! a TOML file, one key per variable, `dsn` for `OUTBOX_DSN`,
//! `broker_url` for `OUTBOX_BROKER_URL` and so on. The environment wins
//! over the file, and the command line over both.
//!
//! A value may hold a password: an error names the line and the key,
//! never a value (nor the line, which TOML's own messages quote). A file
//! whose DSN or broker URL holds a password is refused when others may
//! read it, as libpq refuses such a password file.

use std::collections::HashMap;
use std::path::Path;

use outbox_core::broker_url::BrokerUrl;

use crate::private_file::{self, Rule};

/// Every key a file may hold: each an `OUTBOX_*` variable in lower case.
pub const KEYS: [&str; 14] = [
    "dsn",
    "dsn_file",
    "tls_ca_file",
    "broker_url",
    "broker_url_file",
    "broker_password_file",
    "broker_tls_ca_file",
    "broker_tls_cert_file",
    "broker_tls_key_file",
    "kafka_sasl_plain_cleartext",
    "sentinel_password_file",
    "dispatchers",
    "poll_interval",
    "metrics_listen",
];

/// The values of the file at `path`, by the variable each stands for.
pub fn read(path: &Path) -> Result<HashMap<String, String>, String> {
    let (text, meta) = private_file::open(path).map_err(|e| format!("--config {}: {e}", path.display()))?;
    let values = parse(&text).map_err(|e| format!("--config {}: {e}", path.display()))?;
    if holds_password(&values) {
        private_file::check(&meta, Rule::Key, private_file::effective_user()).map_err(|why| {
            format!(
                "{} (its dsn or broker_url holds a password; or move the password to a password file)",
                private_file::refusal(path, "--config", &why)
            )
        })?;
    }
    Ok(values)
}

/// Whether the DSN or the broker's URL holds a password (or cannot be
/// read well enough to tell).
fn holds_password(values: &HashMap<String, String>) -> bool {
    let dsn = values.get("OUTBOX_DSN").is_some_and(|dsn| crate::connect::holds_password(dsn));
    let url = values
        .get("OUTBOX_BROKER_URL")
        .is_some_and(|url| BrokerUrl::parse(url).map_or(true, |u| u.password.is_some()));
    dsn || url
}

/// The values of a file's text, by the variable each stands for.
pub fn parse(text: &str) -> Result<HashMap<String, String>, String> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let line = e.span().map(|span| text[..span.start].matches('\n').count() + 1);
        match line {
            Some(line) => format!("line {line}: {}", e.message()),
            None => e.message().to_string(),
        }
    })?;
    table
        .into_iter()
        .map(|(key, value)| {
            if !KEYS.contains(&key.as_str()) {
                return Err(format!("unknown key {key:?} (the keys: {})", KEYS.join(", ")));
            }
            let value = match value {
                toml::Value::String(s) => s,
                toml::Value::Integer(n) => n.to_string(),
                _ => return Err(format!("{key} must be a string or an integer")),
            };
            Ok((format!("OUTBOX_{}", key.to_uppercase()), value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_the_variables_in_lower_case() {
        let values = parse("dsn = 'host=db'\ndispatchers = 2\nbroker_url = \"redis://r/0\"\n").unwrap();
        assert_eq!(values["OUTBOX_DSN"], "host=db");
        assert_eq!(values["OUTBOX_DISPATCHERS"], "2");
        assert_eq!(values["OUTBOX_BROKER_URL"], "redis://r/0");
    }

    #[test]
    fn errors_name_the_line_or_the_key_and_never_a_value() {
        let secret = "redis://:S3CRET@r/0";
        for text in [
            format!("broker_url = '{secret}'\ndsn = 'a\n"),
            format!("broker_url = '{secret}'\nbroker_url = '{secret}'\n"),
            format!("broker-url = '{secret}'\n"),
            format!("[broker]\nurl = '{secret}'\n"),
            "dispatchers = [1, 2]\n".to_string(),
        ] {
            let e = parse(&text).unwrap_err();
            assert!(!e.contains("S3CRET"), "{e}");
            assert!(e.contains("line 2") || e.contains("key") || e.contains("must be"), "{e}");
        }
        assert!(parse("broker-url = 'x'").unwrap_err().contains("unknown key \"broker-url\""));
    }

    #[test]
    fn a_file_holding_a_password_others_may_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("outbox-config-{}.toml", std::process::id()));
        for (text, secret) in [
            ("dsn = 'host=db password=S3CRET'\n", true),
            ("dsn = 'postgresql://u:S3CRET@db/app'\n", true),
            ("broker_url = 'redis://:S3CRET@r/0'\n", true),
            ("dsn = 'host=db'\nbroker_url = 'redis://r/0'\ndispatchers = 2\n", false),
        ] {
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
            match read(&path) {
                Ok(_) => assert!(!secret, "{text}"),
                Err(e) => {
                    assert!(secret, "{text}: {e}");
                    assert!(e.contains("--config") && e.contains("0644") && !e.contains("S3CRET"), "{e}");
                }
            }
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            assert!(read(&path).is_ok(), "{text}");
        }
        std::fs::remove_file(&path).unwrap();
    }
}
