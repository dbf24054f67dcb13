//! Pushing the metrics to an OpenTelemetry collector over OTLP/HTTP (protobuf): where to
//! (`--otlp-endpoint`, else the standard `OTEL_EXPORTER_OTLP_*` variables), and a sender on a
//! thread of its own, so that a collector that is down or slow never blocks or slows the
//! recording. Batches wait in a bounded queue; past its bound the oldest is dropped (each batch
//! holds every series cumulatively, so the newest stands for those before it) and counted. A
//! failed export is retried with backoff, and said once when it starts failing and once when
//! it recovers, never per batch.

use std::{
    collections::VecDeque,
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc, Condvar, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::{header, Request, StatusCode};

use crate::exit::user_error;
pub use crate::present::otlp::OtlpCounts;

/// Batches waiting at most; an older one is dropped (counted) when a newer comes.
pub const QUEUE_BATCHES: usize = 8;
/// Retries wait from the first to the last of these, doubling.
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_MOST: Duration = Duration::from_secs(30);
/// The standard variables' defaults: an export every 60 s, each given 10 s.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// What the OTLP/HTTP path of metrics is, under a base endpoint.
const METRICS_PATH: &str = "/v1/metrics";

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
        }))
    }
}

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

/// Shared between the recording and the sender.
struct Queue {
    batches: Mutex<VecDeque<Bytes>>,
    wake: Condvar,
    closing: std::sync::atomic::AtomicBool,
    /// 1 while a batch is being sent.
    sending: AtomicU64,
    /// The collector is failing: tracer stopping does not wait for it.
    failing: std::sync::atomic::AtomicBool,
    sent: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
}

/// The sender, and what the recording hands it.
pub struct OtlpPusher {
    queue: Arc<Queue>,
    thread: Option<std::thread::JoinHandle<()>>,
    endpoint: String,
    resource: Vec<(String, String)>,
    pub interval: Duration,
    timeout: Duration,
    last: Mutex<Option<Instant>>,
}

impl OtlpPusher {
    /// Starts the sender (its TLS set up for https now, so a bad certificate fails here).
    pub fn start(config: OtlpConfig) -> Result<OtlpPusher> {
        let client = client(config.certificate.as_deref())?;
        let queue = Arc::new(Queue {
            batches: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            closing: Default::default(),
            sending: AtomicU64::new(0),
            failing: Default::default(),
            sent: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("start the OTLP sender's runtime")?;
        let endpoint = config.endpoint.to_string();
        let resource = config.resource.clone();
        let (interval, timeout) = (config.interval, config.timeout);
        let shared = queue.clone();
        let thread = std::thread::Builder::new()
            .name("tracer-otlp".into())
            .spawn(move || runtime.block_on(send_loop(shared, client, config)))
            .context("start the OTLP sender")?;
        Ok(OtlpPusher {
            queue,
            thread: Some(thread),
            endpoint,
            resource,
            interval,
            timeout,
            last: Mutex::new(None),
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Who sends (the export request's resource).
    pub fn resource(&self) -> &[(String, String)] {
        &self.resource
    }

    /// An export is due (one per interval, the first at once).
    pub fn due(&self, now: Instant) -> bool {
        let Ok(mut last) = self.last.lock() else {
            return false;
        };
        if last.is_some_and(|t| now.duration_since(t) < self.interval) {
            return false;
        }
        *last = Some(now);
        true
    }

    /// Queues one encoded export request; never waits on the collector.
    pub fn push(&self, body: Vec<u8>) {
        let Ok(mut batches) = self.queue.batches.lock() else {
            return;
        };
        batches.push_back(Bytes::from(body));
        while batches.len() > QUEUE_BATCHES {
            batches.pop_front();
            self.queue.dropped.fetch_add(1, Relaxed);
        }
        self.queue.wake.notify_one();
    }

    pub fn counts(&self) -> OtlpCounts {
        OtlpCounts {
            sent: self.queue.sent.load(Relaxed),
            dropped: self.queue.dropped.load(Relaxed),
            failed: self.queue.failed.load(Relaxed),
        }
    }

    /// Gives the sender up to one timeout to deliver what waits (the last batch), unless the
    /// collector is failing, then stops it; what is still waiting is dropped and counted.
    pub fn finish(mut self) -> OtlpCounts {
        let deadline = Instant::now() + self.timeout;
        while Instant::now() < deadline && !self.idle() && !self.queue.failing.load(Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.queue.closing.store(true, Relaxed);
        self.queue.wake.notify_all();
        if let Ok(mut batches) = self.queue.batches.lock() {
            let left = batches.len() as u64;
            batches.clear();
            self.queue.dropped.fetch_add(left, Relaxed);
        }
        // The sender ends within its current attempt's timeout; it is not waited for longer.
        if let Some(thread) = self.thread.take() {
            let until = Instant::now() + self.timeout;
            while !thread.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.counts()
    }

    /// Nothing waits and nothing is being sent.
    fn idle(&self) -> bool {
        self.queue
            .batches
            .lock()
            .map(|b| b.is_empty())
            .unwrap_or(true)
            && self.queue.sending.load(Relaxed) == 0
    }
}

type Client = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

/// An HTTP/1 client for http and https (the system's CA certificates, and `certificate`).
fn client(certificate: Option<&std::path::Path>) -> Result<Client> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    roots.add_parsable_certificates(native.certs);
    if let Some(path) = certificate {
        use rustls::pki_types::{pem::PemObject as _, CertificateDer};
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect())
            .map_err(|e| {
                user_error(format!(
                    "OTEL_EXPORTER_OTLP_CERTIFICATE {}: cannot read PEM certificates ({e}): give the collector's CA certificate file",
                    path.display()
                ))
            })?;
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(user_error(format!(
                "OTEL_EXPORTER_OTLP_CERTIFICATE {}: no certificate in it: give the collector's CA certificate (PEM)",
                path.display()
            )));
        }
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .context("set up TLS for OTLP")?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .build();
    Ok(
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(https),
    )
}

/// Why an export failed: retried, or refused for good.
enum Failure {
    Retry(String),
    Refused(String),
}

async fn export(client: &Client, config: &OtlpConfig, body: Bytes) -> Result<(), Failure> {
    let mut req = Request::post(config.endpoint.clone())
        .header(header::CONTENT_TYPE, "application/x-protobuf")
        .header(
            header::USER_AGENT,
            concat!("tracer/", env!("CARGO_PKG_VERSION")),
        );
    for (name, value) in &config.headers {
        req = req.header(name, value);
    }
    let req = req
        .body(Full::new(body))
        .map_err(|e| Failure::Refused(format!("the request could not be made: {e}")))?;
    let attempt = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| Failure::Retry(error_chain(&e)))?;
        let status = resp.status();
        // The body is read (bounded) so the connection can be kept.
        let body = http_body_util::Limited::new(resp.into_body(), 64 << 10)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        if status.is_success() {
            return Ok(());
        }
        let said = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        let why = format!(
            "HTTP {status}{}",
            if said.is_empty() {
                String::new()
            } else {
                format!(": {said}")
            }
        );
        // The specification's retryable answers; any other is final for this batch.
        match status {
            StatusCode::TOO_MANY_REQUESTS
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT => Err(Failure::Retry(why)),
            _ => Err(Failure::Refused(why)),
        }
    };
    match tokio::time::timeout(config.timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(Failure::Retry(format!(
            "no answer within {} ms (OTEL_EXPORTER_OTLP_TIMEOUT)",
            config.timeout.as_millis()
        ))),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

/// The next batch to send (the newest waiting supersedes none: each is sent in turn), or None
/// once tracer stops.
fn next(queue: &Queue) -> Option<Bytes> {
    let mut batches = queue.batches.lock().ok()?;
    loop {
        if queue.closing.load(Relaxed) {
            return None;
        }
        if let Some(b) = batches.pop_front() {
            queue.sending.store(1, Relaxed);
            return Some(b);
        }
        batches = queue.wake.wait(batches).ok()?;
    }
}

async fn send_loop(queue: Arc<Queue>, client: Client, config: OtlpConfig) {
    let url = config.endpoint.to_string();
    let mut failing: Option<(Instant, u64)> = None;
    let mut backoff = BACKOFF_FIRST;
    // The condvar wait blocks this thread: it has nothing else to run meanwhile.
    while let Some(batch) = next(&queue) {
        match export(&client, &config, batch.clone()).await {
            Ok(()) => {
                queue.sent.fetch_add(1, Relaxed);
                queue.failing.store(false, Relaxed);
                if let Some((since, attempts)) = failing.take() {
                    eprintln!(
                        "tracer: OTLP: the collector at {url} takes metrics again ({attempts} failed attempt(s) over {:.0} s; {} batch(es) dropped so far)",
                        since.elapsed().as_secs_f64(),
                        queue.dropped.load(Relaxed)
                    );
                }
                backoff = BACKOFF_FIRST;
            }
            Err(Failure::Refused(why)) => {
                queue.failed.fetch_add(1, Relaxed);
                queue.dropped.fetch_add(1, Relaxed);
                if failing.is_none() {
                    eprintln!(
                        "tracer: OTLP: the collector at {url} refused a batch of metrics ({why}): dropped (counted in tracer_otlp_batches_dropped_total); said once until it takes one"
                    );
                    failing = Some((Instant::now(), 0));
                }
                if let Some(f) = failing.as_mut() {
                    f.1 += 1;
                }
            }
            Err(Failure::Retry(why)) => {
                queue.failed.fetch_add(1, Relaxed);
                queue.failing.store(true, Relaxed);
                if failing.is_none() {
                    eprintln!(
                        "tracer: OTLP: cannot export metrics to {url} ({why}): retrying with backoff ({} s to {} s); the recording goes on, and past {QUEUE_BATCHES} waiting batches the oldest are dropped (counted in tracer_otlp_batches_dropped_total); said once until it recovers",
                        BACKOFF_FIRST.as_secs(),
                        BACKOFF_MOST.as_secs()
                    );
                    failing = Some((Instant::now(), 0));
                }
                if let Some(f) = failing.as_mut() {
                    f.1 += 1;
                }
                // Back at the front, unless newer batches pushed it out meanwhile.
                if let Ok(mut batches) = queue.batches.lock() {
                    if batches.len() < QUEUE_BATCHES {
                        batches.push_front(batch);
                    } else {
                        queue.dropped.fetch_add(1, Relaxed);
                    }
                }
                queue.sending.store(0, Relaxed);
                pause(&queue, backoff);
                backoff = (backoff * 2).min(BACKOFF_MOST);
                continue;
            }
        }
        queue.sending.store(0, Relaxed);
    }
}

/// Waits `how_long`, or less if tracer stops.
fn pause(queue: &Queue, how_long: Duration) {
    let until = Instant::now() + how_long;
    let Ok(mut batches) = queue.batches.lock() else {
        return;
    };
    while !queue.closing.load(Relaxed) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        match queue.wake.wait_timeout(batches, left) {
            Ok((b, _)) => batches = b,
            Err(_) => return,
        }
    }
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
    fn a_certificate_that_cannot_be_read_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let e = format!("{:#}", client(Some(&missing)).err().unwrap());
        assert!(
            e.contains("OTEL_EXPORTER_OTLP_CERTIFICATE") && e.contains("missing.pem"),
            "{e}"
        );
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let e = format!("{:#}", client(Some(&empty)).err().unwrap());
        assert!(e.contains("no certificate in it"), "{e}");
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
