//! Metric samples and their Prometheus text exposition (format 0.0.4).
//! The samples come from shared memory in the extension; turning them into
//! rows and text is pure and tested here.

use std::fmt::Write;

/// Fixed histogram bounds, in the metric's unit, ascending; `+Inf` is
/// implied after the last.
pub const LATENCY_BOUNDS_SECONDS: [f64; 16] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];
pub const BATCH_SIZE_BOUNDS: [f64; 12] =
    [1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0];

/// The bucket (index into the bounds, or `bounds.len()` for `+Inf`) that
/// `value` falls in: the first whose bound is `>= value`.
pub fn bucket_index(bounds: &[f64], value: f64) -> usize {
    bounds.iter().position(|bound| value <= *bound).unwrap_or(bounds.len())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric family: its name (without `_total` for counters, which the
/// samples carry), help text and type.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
}

/// One sample: a full sample name (`outbox_x_total`, `outbox_y_bucket`),
/// its labels, its value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(&'static str, String)>,
    pub value: f64,
}

impl Sample {
    pub fn new(name: impl Into<String>, value: f64) -> Sample {
        Sample { name: name.into(), labels: Vec::new(), value }
    }

    pub fn label(mut self, key: &'static str, value: impl Into<String>) -> Sample {
        self.labels.push((key, value.into()));
        self
    }

    /// The labels as a JSON object, for `outbox.metrics.labels`.
    pub fn labels_object(&self) -> serde_json::Value {
        let map: serde_json::Map<String, serde_json::Value> = self
            .labels
            .iter()
            .map(|(k, v)| ((*k).to_string(), serde_json::Value::String(v.clone())))
            .collect();
        serde_json::Value::Object(map)
    }
}

/// The samples of a histogram from its per-bucket counts (not cumulative;
/// one more than `bounds`, the last for `+Inf`) and sum.
pub fn histogram_samples(name: &str, bounds: &[f64], counts: &[u64], sum: f64) -> Vec<Sample> {
    let mut samples = Vec::with_capacity(bounds.len() + 3);
    let mut cumulative = 0u64;
    for (i, count) in counts.iter().enumerate() {
        cumulative += count;
        let le = bounds.get(i).map_or_else(|| "+Inf".to_string(), |b| format_value(*b));
        samples.push(Sample::new(format!("{name}_bucket"), cumulative as f64).label("le", le));
    }
    samples.push(Sample::new(format!("{name}_sum"), sum));
    samples.push(Sample::new(format!("{name}_count"), cumulative as f64));
    samples
}

/// Renders families and their samples; a sample belongs to the family whose
/// name its own starts with.
pub fn render(families: &[(Family, Vec<Sample>)]) -> String {
    let mut out = String::new();
    for (family, samples) in families {
        // In the Prometheus text format a counter's HELP and TYPE name its
        // samples, `_total` included.
        let suffix = if family.kind == Kind::Counter { "_total" } else { "" };
        let _ = writeln!(out, "# HELP {}{suffix} {}", family.name, escape_help(family.help));
        let _ = writeln!(out, "# TYPE {}{suffix} {}", family.name, family.kind.name());
        for sample in samples {
            out.push_str(&sample.name);
            if !sample.labels.is_empty() {
                out.push('{');
                for (i, (key, value)) in sample.labels.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    let _ = write!(out, "{key}=\"{}\"", escape_label(value));
                }
                out.push('}');
            }
            let _ = writeln!(out, " {}", format_value(sample.value));
        }
    }
    out
}

fn format_value(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else if v.is_nan() {
        "NaN".to_string()
    } else {
        format!("{v}")
    }
}

fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n").replace('"', "\\\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_fall_in_the_first_bucket_that_holds_them() {
        let bounds = [1.0, 5.0, 10.0];
        assert_eq!(bucket_index(&bounds, 0.5), 0);
        assert_eq!(bucket_index(&bounds, 1.0), 0);
        assert_eq!(bucket_index(&bounds, 1.5), 1);
        assert_eq!(bucket_index(&bounds, 10.0), 2);
        assert_eq!(bucket_index(&bounds, 11.0), 3);
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_end_in_count() {
        let samples = histogram_samples("h", &[1.0, 5.0], &[2, 0, 3], 12.5);
        let values: Vec<(String, f64)> = samples
            .iter()
            .map(|s| (s.labels.first().map(|l| l.1.clone()).unwrap_or_default(), s.value))
            .collect();
        assert_eq!(
            values,
            vec![
                ("1".to_string(), 2.0),
                ("5".to_string(), 2.0),
                ("+Inf".to_string(), 5.0),
                (String::new(), 12.5),
                (String::new(), 5.0)
            ]
        );
        assert_eq!(samples[3].name, "h_sum");
        assert_eq!(samples[4].name, "h_count");
    }

    #[test]
    fn text_has_help_type_and_escaped_labels() {
        let family = Family { name: "outbox_x", help: "Things\nseen.", kind: Kind::Counter };
        let text = render(&[(family, vec![Sample::new("outbox_x_total", 3.0).label("reason", "a\"b")])]);
        assert_eq!(
            text,
            "# HELP outbox_x_total Things\\nseen.\n# TYPE outbox_x_total counter\noutbox_x_total{reason=\"a\\\"b\"} 3\n"
        );
    }

    #[test]
    fn labels_become_a_json_object() {
        let s = Sample::new("n", 1.0).label("le", "0.5").label("reason", "timeout");
        assert_eq!(s.labels_object().to_string(), r#"{"le":"0.5","reason":"timeout"}"#);
        assert_eq!(Sample::new("n", 1.0).labels_object().to_string(), "{}");
    }
}
