//! `--config FILE` (or `OUTBOX_CONFIG`): what the environment may say, in
//! a TOML file, one key per variable, `dsn` for `OUTBOX_DSN`,
//! `broker_url` for `OUTBOX_BROKER_URL` and so on. The environment wins
//! over the file, and the command line over both.
//!
//! A value may hold a password: an error names the line and the key,
//! never a value (nor the line, which TOML's own messages quote).

use std::collections::HashMap;
use std::path::Path;

/// Every key a file may hold: each an `OUTBOX_*` variable in lower case.
pub const KEYS: [&str; 9] = [
    "dsn",
    "tls_ca_file",
    "broker_url",
    "broker_password_file",
    "broker_tls_ca_file",
    "sentinel_password_file",
    "dispatchers",
    "poll_interval",
    "metrics_listen",
];

/// The values of the file at `path`, by the variable each stands for.
pub fn read(path: &Path) -> Result<HashMap<String, String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("--config {}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("--config {}: {e}", path.display()))
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
}
