//! The metrics of the Prometheus page (present/metrics.rs) as one OTLP export request
//! (`tracer trace --otlp-endpoint`): the same families, series and values, named by OTLP's
//! conventions. A counter loses its `_total` and becomes a cumulative monotonic sum; a unit
//! written as the name's suffix (`_bytes`, `_seconds`) becomes the metric's unit (`By`, `s`);
//! a histogram's cumulative Prometheus buckets become OTLP's per-bucket counts over the same
//! bounds; labels become attributes (the same bounded set).

use opentelemetry_proto::tonic::{
    collector::metrics::v1::ExportMetricsServiceRequest,
    common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue},
    metrics::v1::{
        metric::Data, number_data_point, AggregationTemporality, Gauge, Histogram,
        HistogramDataPoint, Metric, NumberDataPoint, ResourceMetrics, ScopeMetrics, Sum,
    },
    resource::v1::Resource,
};
use prometheus::proto::{MetricFamily, MetricType};

/// What the OTLP sender did (serve/otlp.rs), shown in the metrics and the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct OtlpCounts {
    /// Batches the collector took.
    pub sent: u64,
    /// Batches dropped: past the queue's bound while the collector was down or slow, refused
    /// by it, or still waiting when tracer stopped.
    pub dropped: u64,
    /// Export attempts that failed (each retried, unless refused for good).
    pub failed: u64,
}

/// Unit suffixes of the page's names and their units in UCUM, as OTLP writes them.
const UNITS: &[(&str, &str)] = &[("_bytes", "By"), ("_seconds", "s"), ("_ratio", "1")];

/// A metric's OTLP name and unit from its Prometheus name.
pub fn name_and_unit(prometheus_name: &str, counter: bool) -> (String, &'static str) {
    let mut name = prometheus_name;
    if counter {
        name = name.strip_suffix("_total").unwrap_or(name);
    }
    for (suffix, unit) in UNITS {
        if let Some(stem) = name.strip_suffix(suffix) {
            return (stem.to_owned(), unit);
        }
    }
    (name.to_owned(), "")
}

/// The export request of `families` at `now_ns`; counters and histograms count from
/// `start_ns` (the recording's start); `resource`: who sent it (node, pod, service).
pub fn request(
    families: &[MetricFamily],
    resource: &[(String, String)],
    start_ns: u64,
    now_ns: u64,
) -> ExportMetricsServiceRequest {
    let metrics = families
        .iter()
        .filter_map(|f| metric(f, start_ns, now_ns))
        .collect();
    ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(Resource {
                attributes: resource.iter().map(|(k, v)| attribute(k, v)).collect(),
                ..Default::default()
            }),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(InstrumentationScope {
                    name: "tracer".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..Default::default()
                }),
                metrics,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    }
}

fn attribute(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value.to_owned())),
        }),
    }
}

fn metric(f: &MetricFamily, start_ns: u64, now_ns: u64) -> Option<Metric> {
    let kind = f.get_field_type();
    let (name, unit) = name_and_unit(f.name(), kind == MetricType::COUNTER);
    let labels = |m: &prometheus::proto::Metric| -> Vec<KeyValue> {
        m.get_label()
            .iter()
            .map(|l| attribute(l.name(), l.value()))
            .collect()
    };
    let number = |m: &prometheus::proto::Metric, v: f64, start: u64| NumberDataPoint {
        attributes: labels(m),
        start_time_unix_nano: start,
        time_unix_nano: now_ns,
        value: Some(number_data_point::Value::AsDouble(v)),
        ..Default::default()
    };
    let data = match kind {
        MetricType::GAUGE => Data::Gauge(Gauge {
            data_points: f
                .get_metric()
                .iter()
                .map(|m| number(m, m.get_gauge().get_value(), 0))
                .collect(),
        }),
        MetricType::COUNTER => Data::Sum(Sum {
            data_points: f
                .get_metric()
                .iter()
                .map(|m| number(m, m.get_counter().get_value(), start_ns))
                .collect(),
            aggregation_temporality: AggregationTemporality::Cumulative as i32,
            is_monotonic: true,
        }),
        MetricType::HISTOGRAM => Data::Histogram(Histogram {
            data_points: f
                .get_metric()
                .iter()
                .map(|m| histogram_point(m, labels(m), start_ns, now_ns))
                .collect(),
            aggregation_temporality: AggregationTemporality::Cumulative as i32,
        }),
        // The page makes no other kind.
        _ => return None,
    };
    Some(Metric {
        name,
        description: f.help().to_owned(),
        unit: unit.to_owned(),
        data: Some(data),
        ..Default::default()
    })
}

/// Prometheus counts each bucket with those below it; OTLP counts each on its own, and one
/// more above the last bound.
fn histogram_point(
    m: &prometheus::proto::Metric,
    attributes: Vec<KeyValue>,
    start_ns: u64,
    now_ns: u64,
) -> HistogramDataPoint {
    let h = m.get_histogram();
    let buckets = h.get_bucket();
    let mut below = 0;
    let mut bucket_counts: Vec<u64> = buckets
        .iter()
        .map(|b| {
            let own = b.cumulative_count().saturating_sub(below);
            below = b.cumulative_count();
            own
        })
        .collect();
    bucket_counts.push(h.get_sample_count().saturating_sub(below));
    HistogramDataPoint {
        attributes,
        start_time_unix_nano: start_ns,
        time_unix_nano: now_ns,
        count: h.get_sample_count(),
        sum: Some(h.get_sample_sum()),
        bucket_counts,
        explicit_bounds: buckets.iter().map(|b| b.upper_bound()).collect(),
        ..Default::default()
    }
}

/// One OOM as an OTLP log record (`tracer trace --dump-on-oom` with an OTLP endpoint): severity
/// ERROR, the event's name `tracer.oom`, its body a sentence, and as attributes the job, rank,
/// node, pod, pid, device, verdict, the bytes asked and short, and the dump's folder.
pub fn oom_log_request(
    r: &crate::record::dump::OomReport,
    resource: &[(String, String)],
) -> opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest {
    use opentelemetry_proto::tonic::{
        collector::logs::v1::ExportLogsServiceRequest,
        logs::v1::{LogRecord, ResourceLogs, ScopeLogs, SeverityNumber},
    };
    let text = |k: &str, v: &str| KeyValue {
        key: k.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v.to_owned())),
        }),
    };
    let int = |k: &str, v: i64| KeyValue {
        key: k.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::IntValue(v)),
        }),
    };
    let mut attributes = vec![
        text("event.name", "tracer.oom"),
        text("job", &r.job),
        int("pid", i64::from(r.pid)),
        text("dump", &r.dump.display().to_string()),
    ];
    let optional = [
        ("rank", r.rank.clone()),
        ("node", r.node.clone()),
        ("pod_uid", r.pod_uid.clone()),
        ("verdict", r.verdict.clone()),
    ];
    attributes.extend(
        optional
            .iter()
            .filter_map(|(k, v)| Some(text(k, v.as_deref()?))),
    );
    let numbers = [
        ("device", r.device.map(i64::from)),
        ("asked_bytes", r.asked.map(|b| b as i64)),
        ("shortfall_bytes", r.shortfall.map(|b| b as i64)),
    ];
    attributes.extend(numbers.iter().filter_map(|(k, v)| Some(int(k, (*v)?))));
    let body = format!(
        "CUDA out of memory in pid {} ({}{}): {}; evidence in {}",
        r.pid,
        r.job,
        r.rank
            .as_deref()
            .map_or(String::new(), |k| format!(", rank {k}")),
        r.verdict.as_deref().unwrap_or("verdict unknown"),
        r.dump.display()
    );
    let record = LogRecord {
        time_unix_nano: r.ts_ns.max(0) as u64,
        observed_time_unix_nano: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
        severity_number: SeverityNumber::Error as i32,
        severity_text: "ERROR".into(),
        body: Some(AnyValue {
            value: Some(any_value::Value::StringValue(body)),
        }),
        attributes,
        event_name: "tracer.oom".into(),
        ..LogRecord::default()
    };
    ExportLogsServiceRequest {
        resource_logs: vec![ResourceLogs {
            resource: Some(Resource {
                attributes: resource.iter().map(|(k, v)| text(k, v)).collect(),
                ..Resource::default()
            }),
            scope_logs: vec![ScopeLogs {
                scope: Some(InstrumentationScope {
                    name: "tracer".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..InstrumentationScope::default()
                }),
                log_records: vec![record],
                ..ScopeLogs::default()
            }],
            ..ResourceLogs::default()
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_lose_total_and_their_unit_suffix() {
        assert_eq!(
            name_and_unit("tracer_calls_total", true),
            ("tracer_calls".into(), "")
        );
        assert_eq!(
            name_and_unit("tracer_bytes_total", true),
            ("tracer".into(), "By")
        );
        assert_eq!(
            name_and_unit("tracer_gpu_reserved_bytes", false),
            ("tracer_gpu_reserved".into(), "By")
        );
        assert_eq!(
            name_and_unit("tracer_call_duration_seconds", false),
            ("tracer_call_duration".into(), "s")
        );
        // A gauge keeps a `_total` that is part of its name.
        assert_eq!(
            name_and_unit("tracer_x_total", false),
            ("tracer_x_total".into(), "")
        );
    }
}
