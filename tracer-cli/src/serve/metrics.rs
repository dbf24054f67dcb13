//! The metrics endpoint (`tracer trace --metrics ADDR`): read-only HTTP on a thread of its own.
//! A scrape copies the page the recording last published (once a second); it never touches the
//! event path. At most `max_connections` at once: one more is closed at once, unread, and
//! counted; a connection gets one request and [`CONNECTION_TIMEOUT`] to make it.
//!
//! Paths: `/metrics` (Prometheus text format), `/healthz` (200 while tracer runs: liveness),
//! `/readyz` (200 while tracing, else 503 with the reason). No authentication: bind loopback
//! (the default) or restrict the port (a NetworkPolicy in Kubernetes).

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, RwLock,
    },
    time::Duration,
};

use anyhow::{Context as _, Result};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{body::Incoming, Method, Request, Response, StatusCode};

/// One request per connection, made within this long.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 8;

/// What the endpoint serves, replaced whole by [`MetricsServer::publish`].
struct Page {
    metrics: RwLock<Bytes>,
    ready: AtomicBool,
    reason: RwLock<Bytes>,
    refused: AtomicU64,
}

pub struct MetricsServer {
    page: Arc<Page>,
    addr: SocketAddr,
}

/// `PORT` (on 127.0.0.1), `IP:PORT` or `[IPv6]:PORT`.
pub fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = s.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    // IPv6:PORT unbracketed, as "$(POD_IP):9400" makes on an IPv6 cluster.
    s.rsplit_once(':')
        .and_then(|(ip, port)| {
            Some(SocketAddr::new(
                ip.parse::<std::net::Ipv6Addr>().ok()?.into(),
                port.parse().ok()?,
            ))
        })
        .ok_or_else(|| {
            format!("{s:?} is not PORT, IP:PORT or [IPv6]:PORT (e.g. 9400 for 127.0.0.1:9400)")
        })
}

impl MetricsServer {
    /// Binds `addr` (the caller sees a taken port or a foreign address at once) and serves it
    /// on a thread of its own.
    pub fn start(addr: SocketAddr, max_connections: usize) -> Result<MetricsServer> {
        let listener = std::net::TcpListener::bind(addr)
            .with_context(|| format!("listening on {addr} for --metrics"))?;
        listener
            .set_nonblocking(true)
            .context("making the metrics socket non-blocking")?;
        let addr = listener
            .local_addr()
            .context("reading the metrics address")?;
        let page = Arc::new(Page {
            metrics: RwLock::new(Bytes::new()),
            ready: AtomicBool::new(false),
            reason: RwLock::new(Bytes::from_static(b"starting\n")),
            refused: AtomicU64::new(0),
        });
        let serving = Arc::clone(&page);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the metrics endpoint's runtime")?;
        std::thread::Builder::new()
            .name("tracer-metrics".into())
            .spawn(move || {
                runtime.block_on(async move {
                    match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => accept(listener, serving, max_connections.max(1)).await,
                        Err(e) => eprintln!("tracer: the metrics endpoint stopped: {e}"),
                    }
                })
            })
            .context("starting the metrics endpoint's thread")?;
        Ok(MetricsServer { page, addr })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections refused so far (over the limit).
    pub fn refused(&self) -> u64 {
        self.page.refused.load(Ordering::Relaxed)
    }

    /// Replaces what is served: the metrics page and whether tracer is ready (tracing), with
    /// the reason when not.
    pub fn publish(&self, metrics: String, ready: bool, reason: &str) {
        if let Ok(mut m) = self.page.metrics.write() {
            *m = Bytes::from(metrics);
        }
        if let Ok(mut r) = self.page.reason.write() {
            *r = Bytes::from(format!("{reason}\n"));
        }
        self.page.ready.store(ready, Ordering::Relaxed);
    }
}

async fn accept(listener: tokio::net::TcpListener, page: Arc<Page>, max_connections: usize) {
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(_) => {
                // Out of descriptors or a connection reset before it was taken: try again
                // shortly rather than spin.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            page.refused.fetch_add(1, Ordering::Relaxed);
            // Closed unread: the client sees the connection end at once.
            drop(stream);
            continue;
        };
        let page = Arc::clone(&page);
        tokio::spawn(async move {
            let io = hyper_util::rt::TokioIo::new(stream);
            let service = hyper::service::service_fn(move |req| {
                let page = Arc::clone(&page);
                async move { Ok::<_, std::convert::Infallible>(respond(&req, &page)) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .max_buf_size(8192)
                .serve_connection(io, service);
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, connection).await;
            drop(slot);
        });
    }
}

fn respond(req: &Request<Incoming>, page: &Page) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: Bytes, kind: &'static str| {
        let mut r = Response::new(Full::new(body));
        *r.status_mut() = status;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static(kind),
        );
        r
    };
    const PLAIN: &str = "text/plain; charset=utf-8";
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            Bytes::from_static(b"read-only: GET\n"),
            PLAIN,
        );
    }
    let read = |lock: &RwLock<Bytes>| lock.read().map(|b| b.clone()).unwrap_or_default();
    match req.uri().path() {
        "/metrics" => text(
            StatusCode::OK,
            read(&page.metrics),
            crate::present::metrics::CONTENT_TYPE,
        ),
        "/healthz" => text(StatusCode::OK, Bytes::from_static(b"ok\n"), PLAIN),
        "/readyz" if page.ready.load(Ordering::Relaxed) => {
            text(StatusCode::OK, Bytes::from_static(b"tracing\n"), PLAIN)
        }
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, read(&page.reason), PLAIN),
        _ => text(
            StatusCode::NOT_FOUND,
            Bytes::from_static(b"not found: /metrics, /healthz, /readyz\n"),
            PLAIN,
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use super::*;

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_what_was_published_and_refuses_beyond_the_limit() {
        let server = MetricsServer::start(parse_addr("0").unwrap(), 2).unwrap();
        let addr = server.local_addr();
        assert!(addr.ip().is_loopback());
        assert!(get(addr, "/readyz").starts_with("HTTP/1.1 503"));
        server.publish("tracer_tracing 1\n".into(), true, "");
        let page = get(addr, "/metrics");
        assert!(
            page.starts_with("HTTP/1.1 200") && page.ends_with("tracer_tracing 1\n"),
            "{page}"
        );
        assert!(get(addr, "/readyz").starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/healthz").starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/other").starts_with("HTTP/1.1 404"));
        // Two idle connections hold both slots: a third is closed at once, unanswered.
        let _a = std::net::TcpStream::connect(addr).unwrap();
        let _b = std::net::TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let started = std::time::Instant::now();
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        let _ = write!(c, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        assert!(out.is_empty(), "{out}");
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(server.refused(), 1);
    }

    #[test]
    fn addresses() {
        assert_eq!(parse_addr("9400").unwrap().to_string(), "127.0.0.1:9400");
        assert_eq!(parse_addr("0.0.0.0:1").unwrap().to_string(), "0.0.0.0:1");
        assert_eq!(parse_addr("[::1]:2").unwrap().to_string(), "[::1]:2");
        assert_eq!(
            parse_addr("fd00::7:9400").unwrap().to_string(),
            "[fd00::7]:9400"
        );
        assert!(parse_addr("localhost").is_err());
        assert!(parse_addr("10.0.0.1").is_err());
    }
}
