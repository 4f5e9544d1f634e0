//! Files the settings name instead of a value: the passwords (the
//! broker's, the sentinels') and the CA file. Read at each connect, so a
//! rotated one takes effect at the next.

use std::path::Path;

use super::SinkError;

pub(super) fn read_setting_file(setting: &str, path: &Path) -> Result<Vec<u8>, SinkError> {
    std::fs::read(path)
        .map_err(|e| SinkError::InvalidConfig(format!("cannot read {setting} {}: {e}", path.display())))
}

pub(super) fn password_from_file(setting: &str, path: &Path) -> Result<String, SinkError> {
    let text = read_setting_file(setting, path)?;
    let text = String::from_utf8_lossy(&text);
    Ok(text.lines().next().unwrap_or("").to_string())
}
