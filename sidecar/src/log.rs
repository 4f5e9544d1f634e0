//! The sidecar's log: one line per message on standard error, for
//! journald or a container's log: text (the time in UTC and PostgreSQL's
//! severities) or JSON (one object a line: `time`, `level`, `severity`,
//! `message`, `pid`), from the level `--log-level` names up. No message
//! carries a password: URLs are redacted where they are made
//! (`outbox_core::broker_url`), the DSN is never printed, and every line
//! is redacted once more of the URLs [`hide`] was given.

use std::io::Write;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use outbox_core::broker_url;

/// The URLs no line may show but redacted.
static HIDDEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// How lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text = 0,
    Json = 1,
}

/// The least severe messages written (`--log-level`), least severe first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Level {
    Info = 0,
    Warning = 1,
    Error = 2,
}

static FORMAT: AtomicU8 = AtomicU8::new(Format::Text as u8);
static LEVEL: AtomicU8 = AtomicU8::new(Level::Info as u8);

/// From now on, lines are written in `format`, from `level` up.
pub fn configure(format: Format, level: Level) {
    FORMAT.store(format as u8, Ordering::SeqCst);
    LEVEL.store(level as u8, Ordering::SeqCst);
}

/// From now on, `url` shows redacted wherever a line would show it.
pub fn hide(url: &str) {
    HIDDEN.lock().unwrap_or_else(|e| e.into_inner()).push(url.to_string());
}

pub fn info(message: &str) {
    line(Level::Info, message);
}

pub fn warning(message: &str) {
    line(Level::Warning, message);
}

pub fn error(message: &str) {
    line(Level::Error, message);
}

fn line(level: Level, message: &str) {
    if (level as u8) < LEVEL.load(Ordering::SeqCst) {
        return;
    }
    let mut message = message.to_string();
    for url in HIDDEN.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        if let Some(redacted) = broker_url::redact_within(&message, url) {
            message = redacted;
        }
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let time = utc(now.as_secs() as i64, now.subsec_millis());
    let format =
        if FORMAT.load(Ordering::SeqCst) == Format::Json as u8 { Format::Json } else { Format::Text };
    let text = render(format, level, &time, &message);
    // One write per line: the threads' lines do not interleave.
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// One line, its newline included.
fn render(format: Format, level: Level, time: &str, message: &str) -> String {
    let (name, severity) = match level {
        Level::Info => ("info", "LOG"),
        Level::Warning => ("warning", "WARNING"),
        Level::Error => ("error", "ERROR"),
    };
    match format {
        // One line a message: a newline in it would forge another.
        Format::Text => format!("{time} {severity}:  {}\n", printable(message)),
        Format::Json => {
            let object = serde_json::json!({
                "time": format!("{}Z", time.trim_end_matches(" UTC").replacen(' ', "T", 1)),
                "level": name,
                "severity": severity,
                "message": message,
                "pid": std::process::id(),
            });
            format!("{object}\n")
        }
    }
}

/// `text` with its control characters escaped (`\n`, `\u{1b}`).
pub fn printable(text: &str) -> String {
    text.chars().flat_map(|c| if c.is_control() { c.escape_default().collect() } else { vec![c] }).collect()
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
    use super::*;

    #[test]
    fn times_are_civil_dates_in_utc() {
        assert_eq!(utc(0, 0), "1970-01-01 00:00:00.000 UTC");
        assert_eq!(utc(951_782_400, 5), "2000-02-29 00:00:00.005 UTC");
        assert_eq!(utc(1_796_299_199, 999), "2026-12-03 11:59:59.999 UTC");
    }

    #[test]
    fn a_json_line_is_one_object_whatever_the_message_holds() {
        let message = "a \"quoted\" word, a \\, a newline\nand a tab\t and \u{1}";
        let line = render(Format::Json, Level::Warning, "2026-01-02 03:04:05.678 UTC", message);
        assert_eq!(line.matches('\n').count(), 1, "{line}");
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["message"], message);
        assert_eq!(value["level"], "warning");
        assert_eq!(value["severity"], "WARNING");
        assert_eq!(value["time"], "2026-01-02T03:04:05.678Z");
        assert_eq!(render(Format::Text, Level::Info, "t", "m"), "t LOG:  m\n");
        let forged =
            render(Format::Text, Level::Info, "t", "m\n2026-01-01 00:00:00.000 UTC ERROR:  x\u{1b}[2J");
        assert_eq!(forged, "t LOG:  m\\n2026-01-01 00:00:00.000 UTC ERROR:  x\\u{1b}[2J\n");
    }
}
