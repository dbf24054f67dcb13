//! Pushing the metrics to an OpenTelemetry collector over OTLP/HTTP (protobuf) to where
//! otlp_config.rs says: a sender on a thread of its own, so that a collector that is down or slow never blocks or slows the
//! recording. Batches wait in a bounded queue; past its bound the oldest is dropped (each batch
//! holds every series cumulatively, so the newest stands for those before it) and counted. A
//! failed export is retried with backoff, and said once when it starts failing and once when
//! it recovers, never per batch.

use std::{
    collections::VecDeque,
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

pub use super::otlp_config::OtlpConfig;
use crate::exit::user_error;
pub use crate::present::otlp::OtlpCounts;

/// Batches waiting at most; an older one is dropped (counted) when a newer comes.
pub const QUEUE_BATCHES: usize = 8;
/// Retries wait from the first to the last of these, doubling.
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_MOST: Duration = Duration::from_secs(30);
/// Shared between the recording and the sender.
struct Queue {
    batches: Mutex<VecDeque<Bytes>>,
    wake: Condvar,
    closing: std::sync::atomic::AtomicBool,
    /// A batch is being sent.
    sending: std::sync::atomic::AtomicBool,
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
            sending: Default::default(),
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
            && !self.queue.sending.load(Relaxed)
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
            queue.sending.store(true, Relaxed);
            return Some(b);
        }
        batches = queue.wake.wait(batches).ok()?;
    }
}

async fn send_loop(queue: Arc<Queue>, client: Client, config: OtlpConfig) {
    let (url, signal) = (config.endpoint.to_string(), config.signal);
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
                        "tracer: OTLP: the collector at {url} takes {signal} again ({attempts} failed attempt(s) over {:.0} s; {} batch(es) dropped so far)",
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
                        "tracer: OTLP: the collector at {url} refused a batch of {signal} ({why}): dropped (counted in tracer_otlp_batches_dropped_total); said once until it takes one"
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
                        "tracer: OTLP: cannot export {signal} to {url} ({why}): retrying with backoff ({} s to {} s); the recording goes on, and past {QUEUE_BATCHES} waiting batches the oldest are dropped (counted in tracer_otlp_batches_dropped_total); said once until it recovers",
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
                queue.sending.store(false, Relaxed);
                pause(&queue, backoff);
                backoff = (backoff * 2).min(BACKOFF_MOST);
                continue;
            }
        }
        queue.sending.store(false, Relaxed);
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
}
