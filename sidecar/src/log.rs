//! The sidecar's log: one line per message on standard error, with the
//! time in UTC and PostgreSQL's severities, for journald or a container's
//! log. No message carries a password: URLs are redacted where they are
//! made (`outbox_core::broker_url`), the DSN is never printed, and every
//! line is redacted once more of the URLs [`hide`] was given.

use std::io::Write;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use outbox_core::broker_url;

/// The URLs no line may show but redacted.
static HIDDEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// From now on, `url` shows redacted wherever a line would show it.
pub fn hide(url: &str) {
    HIDDEN.lock().unwrap_or_else(|e| e.into_inner()).push(url.to_string());
}

pub fn info(message: &str) {
    line("LOG", message);
}

pub fn warning(message: &str) {
    line("WARNING", message);
}

pub fn error(message: &str) {
    line("ERROR", message);
}

fn line(severity: &str, message: &str) {
    let mut message = message.to_string();
    for url in HIDDEN.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        if let Some(redacted) = broker_url::redact_within(&message, url) {
            message = redacted;
        }
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let text = format!("{} {severity}:  {message}\n", utc(now.as_secs() as i64, now.subsec_millis()));
    // One write per line: the threads' lines do not interleave.
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// `YYYY-MM-DD HH:MM:SS.mmm UTC` of `seconds` since the epoch.
fn utc(seconds: i64, millis: u32) -> String {
    let (days, rest) = (seconds.div_euclid(86_400), seconds.rem_euclid(86_400));
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{millis:03} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::utc;

    #[test]
    fn times_are_civil_dates_in_utc() {
        assert_eq!(utc(0, 0), "1970-01-01 00:00:00.000 UTC");
        assert_eq!(utc(951_782_400, 5), "2000-02-29 00:00:00.005 UTC");
        assert_eq!(utc(1_796_299_199, 999), "2026-12-03 11:59:59.999 UTC");
    }
}
