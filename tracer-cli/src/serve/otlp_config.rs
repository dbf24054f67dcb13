//! Where to push the metrics over OTLP, and how: `--otlp-endpoint`, else the standard
//! `OTEL_EXPORTER_OTLP_*` variables (endpoint, headers, protocol, timeout, certificate), the
//! export interval, and the resource that names the sender. Bad settings are refused before
//! tracing starts, naming the flag or variable and the fix.

use std::{path::PathBuf, time::Duration};

use anyhow::Result;
use hyper::header;

use crate::exit::user_error;

/// What the OTLP/HTTP path of metrics is, under a base endpoint.
const METRICS_PATH: &str = "/v1/metrics";
/// The standard variables' defaults: an export every 60 s, each given 10 s.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and how to push.
#[derive(Clone, Debug)]
pub struct OtlpConfig {
    pub endpoint: hyper::Uri,
    /// Extra request headers (an API key, a tenant): never printed.
    pub headers: Vec<(header::HeaderName, header::HeaderValue)>,
    pub timeout: Duration,
    pub interval: Duration,
    /// A CA certificate (PEM) trusted beside the system's, for https.
    pub certificate: Option<PathBuf>,
    /// Who sends: service, host, node, pod.
    pub resource: Vec<(String, String)>,
    /// What it carries ("metrics", "logs"): said in its diagnostics.
    pub signal: &'static str,
}

/// The standard variable for metrics, else the general one.
fn otel_var(env: &dyn Fn(&str) -> Option<String>, what: &str) -> Option<(String, String)> {
    [
        format!("OTEL_EXPORTER_OTLP_METRICS_{what}"),
        format!("OTEL_EXPORTER_OTLP_{what}"),
    ]
    .into_iter()
    .find_map(|name| env(&name).filter(|v| !v.is_empty()).map(|v| (name, v)))
}

impl OtlpConfig {
    /// From `--otlp-endpoint` (`flag`; "off" turns pushing off) and the standard variables
    /// (`env`); None when neither asks for it.
    pub fn read(
        flag: Option<&str>,
        interval: Option<Duration>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<OtlpConfig>> {
        let endpoint = match flag {
            Some("off") => return Ok(None),
            Some(url) => with_metrics_path(url, "--otlp-endpoint")?,
            None => match (
                env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT").filter(|v| !v.is_empty()),
                env("OTEL_EXPORTER_OTLP_ENDPOINT").filter(|v| !v.is_empty()),
            ) {
                // The signal's own endpoint is used as it is; the general one is a base.
                (Some(url), _) => parse_url(&url, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")?,
                (None, Some(url)) => with_metrics_path(&url, "OTEL_EXPORTER_OTLP_ENDPOINT")?,
                (None, None) => return Ok(None),
            },
        };
        if let Some((name, protocol)) = otel_var(env, "PROTOCOL") {
            if protocol != "http/protobuf" {
                return Err(user_error(format!(
                    "{name}={protocol}: tracer pushes OTLP over HTTP with protobuf only: set it to http/protobuf (a collector's OTLP/HTTP port, 4318 by default)"
                )));
            }
        }
        let headers = match otel_var(env, "HEADERS") {
            Some((name, text)) => parse_headers(&text, &name)?,
            None => Vec::new(),
        };
        let timeout = match otel_var(env, "TIMEOUT") {
            Some((name, ms)) => millis(&ms, &name)?,
            None => DEFAULT_TIMEOUT,
        };
        let interval = match (interval, env("OTEL_METRIC_EXPORT_INTERVAL")) {
            (Some(i), _) => i,
            (None, Some(ms)) if !ms.is_empty() => millis(&ms, "OTEL_METRIC_EXPORT_INTERVAL")?,
            (None, _) => DEFAULT_INTERVAL,
        };
        Ok(Some(OtlpConfig {
            endpoint,
            headers,
            timeout,
            interval,
            certificate: otel_var(env, "CERTIFICATE").map(|(_, path)| PathBuf::from(path)),
            resource: resource(env),
            signal: "metrics",
        }))
    }

    /// The same collector for log records (each OOM, with --dump-on-oom): the signal's own
    /// OTEL_EXPORTER_OTLP_LOGS_ENDPOINT as it is, else the metrics endpoint with `/v1/logs`
    /// for its `/v1/metrics` (or at its root when it has a path of its own).
    pub fn for_logs(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<OtlpConfig> {
        let endpoint = match env("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT").filter(|v| !v.is_empty()) {
            Some(url) => parse_url(&url, "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT")?,
            None => {
                let metrics = self.endpoint.to_string();
                let base = match metrics.strip_suffix(METRICS_PATH) {
                    Some(base) => base.to_owned(),
                    None => format!(
                        "{}://{}",
                        self.endpoint.scheme_str().unwrap_or("http"),
                        self.endpoint.authority().map_or("", |a| a.as_str())
                    ),
                };
                parse_url(&format!("{base}{LOGS_PATH}"), "the OTLP endpoint")?
            }
        };
        Ok(OtlpConfig {
            endpoint,
            signal: "logs",
            ..self.clone()
        })
    }
}

const LOGS_PATH: &str = "/v1/logs";

fn parse_url(url: &str, from: &str) -> Result<hyper::Uri> {
    let uri: hyper::Uri = url.parse().map_err(|e| {
        user_error(format!(
            "{from} {url:?} is not a URL ({e}): give http(s)://HOST:PORT, e.g. http://otel-collector:4318"
        ))
    })?;
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(user_error(format!(
            "{from}: a user or password in the URL would be printed with it: give them as a header in OTEL_EXPORTER_OTLP_HEADERS (e.g. Authorization=Basic%20...) and the URL without them"
        )));
    }
    match uri.scheme_str() {
        Some("http" | "https") if uri.host().is_some() => Ok(uri),
        _ => Err(user_error(format!(
            "{from} {url:?} is not an http(s) URL: give http(s)://HOST:PORT, e.g. http://otel-collector:4318"
        ))),
    }
}

/// A base endpoint with the metrics path added when it names no path of its own.
fn with_metrics_path(url: &str, from: &str) -> Result<hyper::Uri> {
    let uri = parse_url(url, from)?;
    if !matches!(uri.path(), "" | "/") {
        return Ok(uri);
    }
    parse_url(
        &format!("{}{METRICS_PATH}", url.trim_end_matches('/')),
        from,
    )
}

/// "key1=value1,key2=value2", values percent-encoded (the standard's form).
fn parse_headers(text: &str, from: &str) -> Result<Vec<(header::HeaderName, header::HeaderValue)>> {
    text.split(',')
        .filter(|pair| !pair.trim().is_empty())
        .map(|pair| {
            let bad = || {
                user_error(format!(
                    "{from}: {:?} is not key=value (a comma-separated list, values percent-encoded)",
                    pair.split('=').next().unwrap_or("")
                ))
            };
            let (key, value) = pair.split_once('=').ok_or_else(bad)?;
            let name = header::HeaderName::from_bytes(key.trim().as_bytes()).map_err(|_| bad())?;
            let value = header::HeaderValue::from_bytes(&percent_decoded(value.trim()))
                .map_err(|_| bad())?;
            Ok((name, value))
        })
        .collect()
}

fn percent_decoded(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

fn millis(text: &str, from: &str) -> Result<Duration> {
    match text.trim().parse::<u64>() {
        Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
        _ => Err(user_error(format!(
            "{from}={text:?}: give milliseconds, a whole number above 0"
        ))),
    }
}

/// Who sends: the service (OTEL_SERVICE_NAME, else tracer), this host, and the node and pod
/// a DaemonSet's downward API names (NODE_NAME, POD_NAME, POD_NAMESPACE); then
/// OTEL_RESOURCE_ATTRIBUTES, which may override any of them.
fn resource(env: &dyn Fn(&str) -> Option<String>) -> Vec<(String, String)> {
    let mut attrs: Vec<(String, String)> = vec![
        (
            "service.name".into(),
            env("OTEL_SERVICE_NAME")
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "tracer".into()),
        ),
        ("service.version".into(), env!("CARGO_PKG_VERSION").into()),
    ];
    if let Ok(host) = nix::unistd::gethostname() {
        attrs.push(("host.name".into(), host.to_string_lossy().into_owned()));
    }
    for (var, key) in [
        ("NODE_NAME", "k8s.node.name"),
        ("POD_NAME", "k8s.pod.name"),
        ("POD_NAMESPACE", "k8s.namespace.name"),
    ] {
        if let Some(v) = env(var).filter(|v| !v.is_empty()) {
            attrs.push((key.into(), v));
        }
    }
    for pair in env("OTEL_RESOURCE_ATTRIBUTES")
        .unwrap_or_default()
        .split(',')
    {
        if let Some((k, v)) = pair.split_once('=') {
            let (k, v) = (
                k.trim().to_owned(),
                String::from_utf8_lossy(&percent_decoded(v.trim())).into_owned(),
            );
            attrs.retain(|(key, _)| *key != k);
            attrs.push((k, v));
        }
    }
    attrs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_logs_go_to_the_logs_path_of_the_same_collector_unless_their_own_is_set() {
        let none = env_of(&[]);
        let c = OtlpConfig::read(Some("http://collector:4318"), None, &none)
            .unwrap()
            .unwrap();
        let logs = c.for_logs(&none).unwrap();
        assert_eq!(logs.endpoint.to_string(), "http://collector:4318/v1/logs");
        assert_eq!((logs.signal, c.signal), ("logs", "metrics"));
        let own = OtlpConfig::read(Some("http://collector:4318/custom"), None, &none)
            .unwrap()
            .unwrap();
        assert_eq!(
            own.for_logs(&none).unwrap().endpoint.to_string(),
            "http://collector:4318/v1/logs"
        );
        let vars = [("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "http://logs:9000/in")];
        assert_eq!(
            c.for_logs(&env_of(&vars)).unwrap().endpoint.to_string(),
            "http://logs:9000/in"
        );
    }

    #[test]
    fn the_endpoint_comes_from_the_flag_else_the_standard_variables() {
        let none = env_of(&[]);
        assert!(OtlpConfig::read(None, None, &none).unwrap().is_none());
        let c = OtlpConfig::read(Some("http://collector:4318"), None, &none)
            .unwrap()
            .unwrap();
        assert_eq!(c.endpoint.to_string(), "http://collector:4318/v1/metrics");
        assert_eq!((c.interval, c.timeout), (DEFAULT_INTERVAL, DEFAULT_TIMEOUT));
        let vars = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://otel.example:4318/"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=a%20b, x-tenant=7"),
            ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "2500"),
            ("OTEL_METRIC_EXPORT_INTERVAL", "15000"),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                "k8s.node.name=n1,deployment.environment=prod",
            ),
            ("NODE_NAME", "from-downward-api"),
        ];
        let c = OtlpConfig::read(None, None, &env_of(&vars))
            .unwrap()
            .unwrap();
        assert_eq!(
            c.endpoint.to_string(),
            "https://otel.example:4318/v1/metrics"
        );
        assert_eq!(c.headers.len(), 2);
        assert_eq!(c.headers[0].1, "a b");
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.interval, Duration::from_secs(15));
        let attr = |k: &str| {
            c.resource
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(attr("k8s.node.name"), Some("n1"));
        assert_eq!(attr("deployment.environment"), Some("prod"));
        assert_eq!(attr("service.name"), Some("tracer"));
        // The metrics endpoint is used as it is; "off" wins over the variables.
        let vars = [("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://c:9/custom")];
        let c = OtlpConfig::read(None, None, &env_of(&vars))
            .unwrap()
            .unwrap();
        assert_eq!(c.endpoint.to_string(), "http://c:9/custom");
        assert!(OtlpConfig::read(Some("off"), None, &env_of(&vars))
            .unwrap()
            .is_none());
    }

    #[test]
    fn bad_settings_are_refused_naming_the_variable_and_the_fix() {
        let err = |flag: Option<&str>, vars: &[(&str, &str)]| {
            format!(
                "{:#}",
                OtlpConfig::read(flag, None, &env_of(vars)).unwrap_err()
            )
        };
        let e = err(Some("https://user:secret@collector:4318"), &[]);
        assert!(
            e.contains("OTEL_EXPORTER_OTLP_HEADERS") && !e.contains("secret"),
            "{e}"
        );
        let e = err(Some("collector:4318"), &[]);
        assert!(
            e.contains("--otlp-endpoint") && e.contains("http://"),
            "{e}"
        );
        let e = err(
            Some("http://c:4318"),
            &[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")],
        );
        assert!(
            e.contains("OTEL_EXPORTER_OTLP_PROTOCOL=grpc") && e.contains("http/protobuf"),
            "{e}"
        );
        let e = err(
            Some("http://c:4318"),
            &[("OTEL_EXPORTER_OTLP_HEADERS", "novalue")],
        );
        assert!(
            e.contains("OTEL_EXPORTER_OTLP_HEADERS") && e.contains("key=value"),
            "{e}"
        );
        let e = err(
            Some("http://c:4318"),
            &[("OTEL_EXPORTER_OTLP_TIMEOUT", "10s")],
        );
        assert!(e.contains("milliseconds"), "{e}");
    }
}
