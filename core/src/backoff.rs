//! Delays with jitter: reconnecting to the broker, and retrying one event.
//! Jitter keeps several dispatchers (or several servers sharing a broker)
//! from retrying in lock step.

use std::time::Duration;

/// The longest an event waits between two attempts, however many it failed.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(3600);

/// A uniform sample in `[0, 1)`, from the OS's random source by way of a
/// version 4 UUID: its first 48 bits are random (the version and variant
/// bits come later).
pub fn random_unit() -> f64 {
    let bits = (uuid::Uuid::new_v4().as_u128() >> 80) as u64;
    bits as f64 / (1u64 << 48) as f64
}

/// Delay before reconnect attempt `attempt` (0 for the first after a
/// failure): uniform between `min` and a ceiling that doubles per attempt,
/// never above `max`.
pub fn reconnect_delay(min: Duration, max: Duration, attempt: u32, unit: f64) -> Duration {
    let max = max.max(min);
    let ceiling = min.saturating_mul(1u32 << attempt.min(16)).saturating_mul(2).min(max);
    min + (ceiling - min).mul_f64(unit.clamp(0.0, 1.0))
}

/// Delay before an event that failed `failures` times (1 for the first) is
/// tried again: `base * 2^(failures-1)`, scaled by a factor in `[0.5, 1.5)`,
/// capped at [`MAX_RETRY_DELAY`].
pub fn retry_delay(base: Duration, failures: u32, unit: f64) -> Duration {
    let exponent = failures.saturating_sub(1).min(20);
    let nominal = base.saturating_mul(1u32 << exponent).min(MAX_RETRY_DELAY);
    nominal.mul_f64(0.5 + unit.clamp(0.0, 1.0)).min(MAX_RETRY_DELAY)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn reconnect_stays_between_min_and_max() {
        for attempt in 0..40 {
            for unit in [0.0, 0.3, 0.999] {
                let d = reconnect_delay(S(3), S(10), attempt, unit);
                assert!(d >= S(3) && d <= S(10), "attempt {attempt}: {d:?}");
            }
        }
        assert_eq!(reconnect_delay(S(3), S(10), 0, 0.0), S(3));
        assert_eq!(reconnect_delay(S(3), S(10), 0, 1.0), S(6));
        assert_eq!(reconnect_delay(S(3), S(10), 5, 1.0), S(10));
    }

    #[test]
    fn reconnect_tolerates_max_below_min() {
        assert_eq!(reconnect_delay(S(5), S(1), 3, 0.7), S(5));
    }

    #[test]
    fn retry_grows_exponentially_with_jitter() {
        assert_eq!(retry_delay(S(1), 1, 0.5), S(1));
        assert_eq!(retry_delay(S(1), 2, 0.5), S(2));
        assert_eq!(retry_delay(S(1), 3, 0.5), S(4));
        assert_eq!(retry_delay(S(2), 1, 0.0), S(1));
        assert!(retry_delay(S(2), 1, 0.99) < S(3));
        assert_eq!(retry_delay(S(1), 100, 0.9), MAX_RETRY_DELAY);
    }

    #[test]
    fn random_unit_is_a_unit_sample() {
        let samples: Vec<f64> = (0..1000).map(|_| random_unit()).collect();
        assert!(samples.iter().all(|u| (0.0..1.0).contains(u)));
        assert!(samples.iter().any(|u| *u < 0.5) && samples.iter().any(|u| *u >= 0.5));
    }
}
