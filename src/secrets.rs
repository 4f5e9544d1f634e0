//! The broker's password never reaches the server log, not even through
//! PostgreSQL's own line for a reloaded setting (`parameter
//! "outbox.broker_url" changed to "amqp://user:secret@…"`): an
//! `emit_log_hook`, installed in the postmaster, which logs that line,
//! rewrites it for the settings that hold a URL, with the URL's password
//! replaced as everywhere else the URL is shown. No other message is
//! touched.

use std::ffi::CStr;

use pgrx::prelude::*;

use crate::config;

/// The untranslated form of PostgreSQL's line for a reloaded setting
/// (utils/misc/guc.c), which `ErrorData.message_id` holds whatever the
/// server's language.
const CHANGED: &CStr = c"parameter \"%s\" changed to \"%s\"";

static mut PREVIOUS: pg_sys::emit_log_hook_type = None;

/// Installs the hook; `_PG_init` calls this while preloading, so that the
/// postmaster, which reads the configuration file, and every process it
/// starts have it.
pub fn install() {
    // SAFETY: called once, in the postmaster, before any backend runs.
    unsafe {
        PREVIOUS = pg_sys::emit_log_hook;
        pg_sys::emit_log_hook = Some(emit_log);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn emit_log(edata: *mut pg_sys::ErrorData) {
    if let Some(edata) = edata.as_mut() {
        redact_changed_setting(edata);
    }
    if let Some(previous) = PREVIOUS {
        previous(edata);
    }
}

/// Rewrites `edata`'s message when it is the line for a reloaded URL
/// setting: the new value, quoted in it, is replaced by its redacted form.
///
/// # Safety
/// `edata` is the report being emitted, in `ErrorContext`.
unsafe fn redact_changed_setting(edata: &mut pg_sys::ErrorData) {
    if edata.message_id.is_null() || edata.message.is_null() || CStr::from_ptr(edata.message_id) != CHANGED {
        return;
    }
    let message = CStr::from_ptr(edata.message).to_string_lossy();
    let Some(redacted) = redact(&message, &config::url_settings()) else {
        return;
    };
    if let Ok(redacted) = std::ffi::CString::new(redacted) {
        edata.message = pg_sys::pstrdup(redacted.as_ptr());
    }
}

/// `message` with the value of the first URL setting it names replaced by
/// the redacted URL; `None` when it names none or does not hold its value.
fn redact(message: &str, settings: &[(&str, String)]) -> Option<String> {
    settings
        .iter()
        .filter(|(name, _)| message.contains(name))
        .find_map(|(_, url)| outbox_core::broker_url::redact_within(message, url))
}
