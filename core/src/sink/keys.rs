//! kombu's key naming: the Redis lists a worker with given transport
//! options reads, priorities included.

/// kombu's Redis key scheme, from its transport options: `global_keyprefix`
/// before every key, and priorities emulated by one list per step, step 0
/// being the queue itself and step s `queue + sep + s`. A message goes to
/// the highest step not above its priority (0 is the highest priority).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
    steps: Vec<u8>,
    separator: String,
}

/// kombu's defaults.
pub const KOMBU_PRIORITY_STEPS: &str = "0,3,6,9";
pub const KOMBU_SEPARATOR: &str = "\x06\x16";

impl Default for Keys {
    fn default() -> Keys {
        Keys::new("", KOMBU_PRIORITY_STEPS, KOMBU_SEPARATOR).expect("kombu's defaults are valid")
    }
}

impl Keys {
    /// `steps` is a comma-separated list (`priority_steps`); the error
    /// names the setting and what is wrong.
    pub fn new(prefix: &str, steps: &str, separator: &str) -> Result<Keys, String> {
        let parsed: Vec<u8> =
            steps.split(',').map(|s| s.trim().parse::<u8>()).collect::<Result<_, _>>().map_err(|_| {
                format!("outbox.priority_steps \"{steps}\" is not a list of numbers 0 to 255")
            })?;
        if parsed.first() != Some(&0) || parsed.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!(
                "outbox.priority_steps \"{steps}\" must start at 0 and ascend (kombu's default: {KOMBU_PRIORITY_STEPS})"
            ));
        }
        if separator.is_empty() {
            return Err("outbox.priority_separator must not be empty".into());
        }
        Ok(Keys { prefix: prefix.to_string(), steps: parsed, separator: separator.to_string() })
    }

    /// The Redis list a message of `priority` for `queue` goes to.
    pub fn queue(&self, queue: &str, priority: u8) -> String {
        let step = self.steps.iter().rev().find(|s| **s <= priority).copied().unwrap_or(0);
        if step == 0 {
            format!("{}{queue}", self.prefix)
        } else {
            format!("{}{queue}{}{step}", self.prefix, self.separator)
        }
    }

    /// Any other key (the report list), as kombu's client prefixes it.
    pub fn prefixed(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_selects_the_kombu_list() {
        let keys = Keys::default();
        assert_eq!(keys.queue("celery", 0), "celery");
        assert_eq!(keys.queue("celery", 2), "celery");
        assert_eq!(keys.queue("celery", 3), "celery\x06\x163");
        assert_eq!(keys.queue("celery", 5), "celery\x06\x163");
        assert_eq!(keys.queue("celery", 6), "celery\x06\x166");
        assert_eq!(keys.queue("celery", 9), "celery\x06\x169");
        assert_eq!(keys.prefixed("outbox_dispatch.reports"), "outbox_dispatch.reports");
    }

    #[test]
    fn kombu_transport_options_shape_the_keys() {
        // Celery's routing guide: priority_steps = list(range(10)), sep = ":".
        let keys = Keys::new("app1:", "0,1,2,3,4,5,6,7,8,9", ":").unwrap();
        assert_eq!(keys.queue("celery", 0), "app1:celery");
        assert_eq!(keys.queue("celery", 4), "app1:celery:4");
        assert_eq!(keys.queue("celery", 9), "app1:celery:9");
        assert_eq!(keys.prefixed("outbox_dispatch.reports"), "app1:outbox_dispatch.reports");
    }

    #[test]
    fn bad_key_options_name_the_setting() {
        for (steps, separator, expected) in [
            ("0,x", ":", "outbox.priority_steps \"0,x\" is not a list"),
            ("1,2", ":", "must start at 0 and ascend"),
            ("0,5,5", ":", "must start at 0 and ascend"),
            ("0,3", "", "outbox.priority_separator must not be empty"),
        ] {
            let err = Keys::new("", steps, separator).unwrap_err();
            assert!(err.contains(expected), "{steps:?} {separator:?}: {err}");
        }
    }
}
