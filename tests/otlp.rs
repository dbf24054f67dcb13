//! Metrics over OTLP: a live `tracer trace --otlp-endpoint` pushes to a real OTLP/HTTP receiver
//! (an HTTP server decoding with OpenTelemetry's own protobuf classes, tests/python/
//! otlp_receiver.py) the values its Prometheus endpoint serves, named by OTLP's conventions;
//! and a collector that is down, then slow, costs the recording nothing, its dropped batches
//! counted and the reason said once.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use crate::common::*;
use serde_json::Value;

/// The receiver, on loopback; each request it took is a line of `out`.
struct Receiver {
    child: Child,
    port: u16,
    out: PathBuf,
}

impl Receiver {
    fn start(dir: &Path, port: u16, delay_file: Option<&Path>) -> Receiver {
        Receiver::start_with(dir, port, delay_file, None)
    }

    /// [`Receiver::start`], over https with `tls` (certificate, key) when given.
    fn start_with(
        dir: &Path,
        port: u16,
        delay_file: Option<&Path>,
        tls: Option<(&Path, &Path)>,
    ) -> Receiver {
        let out = dir.join(format!("received-{port}.jsonl"));
        let port_file = dir.join(format!("port-{port}"));
        let mut cmd = Command::new("python3");
        cmd.env("PYTHONPATH", pylib())
            .arg(workspace().join("tests/python/otlp_receiver.py"))
            .arg(&out)
            .arg("--port-file")
            .arg(&port_file)
            .args(["--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        if let Some(f) = delay_file {
            cmd.arg("--delay-file").arg(f);
        }
        if let Some((cert, key)) = tls {
            cmd.arg("--tls").arg(cert).arg(key);
        }
        let child = cmd.spawn().expect("python3");
        wait_until(
            Duration::from_secs(30),
            "the OTLP receiver to listen",
            || port_file.exists(),
        );
        let port = std::fs::read_to_string(&port_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        Receiver { child, port, out }
    }

    /// Every request taken so far.
    fn batches(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Series whose value moves on its own (the database's size) or with the pushing itself.
fn moving(name: &str) -> bool {
    name.starts_with("tracer_db_bytes") || name.starts_with("tracer_otlp_")
}

/// "name{k=v,...}" with the labels in name order.
fn key(name: &str, labels: &BTreeMap<String, String>) -> String {
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{name}{{{}}}", labels.join(","))
}

/// The page's numbers are read with Rust's parser and the receiver's JSON with serde_json:
/// both must give the nearest double (serde_json's `float_roundtrip`), or one value a unit in
/// the last place apart reads as a difference (0.9115679053936317 read as ...316 once).
#[test]
fn json_numbers_read_as_the_pages_numbers_do() {
    for text in [
        "0.9115679053936317",
        "0.1",
        "2.5e-308",
        "123456789.12345679",
    ] {
        let json: f64 = serde_json::from_str(text).unwrap();
        assert_eq!(json, text.parse::<f64>().unwrap(), "{text}");
    }
}

/// The series of a text exposition (bucket bounds as numbers).
fn page_series(page: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in page
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').unwrap();
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let mut map = BTreeMap::new();
        // Values hold no `",` (pids, names, ops, bounds).
        for pair in labels.split("\",").filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once("=\"").unwrap();
            let v = v.trim_end_matches('"');
            let v = if k == "le" && v != "+Inf" {
                v.parse::<f64>().unwrap().to_string()
            } else {
                v.to_owned()
            };
            map.insert(k.to_owned(), v);
        }
        if !moving(name) {
            out.insert(key(name, &map), value.parse().unwrap());
        }
    }
    out
}

/// The same series from one OTLP request, named back as Prometheus names them (the unit's
/// suffix, `_total` on sums, a histogram's cumulative buckets).
fn otlp_series(batch: &Value) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for m in batch["metrics"].as_array().unwrap() {
        let unit = match m["unit"].as_str().unwrap() {
            "By" => "_bytes",
            "s" => "_seconds",
            "1" => "_ratio",
            _ => "",
        };
        let base = format!("{}{unit}", m["name"].as_str().unwrap());
        for p in m["points"].as_array().unwrap() {
            let labels: BTreeMap<String, String> = p["attrs"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                .collect();
            let mut put = |name: String, labels: &BTreeMap<String, String>, v: f64| {
                if !moving(&name) {
                    out.insert(key(&name, labels), v);
                }
            };
            match m["kind"].as_str().unwrap() {
                "gauge" => put(base.clone(), &labels, p["value"].as_f64().unwrap()),
                "sum" => put(
                    format!("{base}_total"),
                    &labels,
                    p["value"].as_f64().unwrap(),
                ),
                "histogram" => {
                    let mut cumulative = 0;
                    let bounds = p["bounds"].as_array().unwrap();
                    for (i, n) in p["buckets"].as_array().unwrap().iter().enumerate() {
                        cumulative += n.as_u64().unwrap();
                        let le = bounds
                            .get(i)
                            .map_or("+Inf".to_owned(), |b| b.as_f64().unwrap().to_string());
                        let mut with_le = labels.clone();
                        with_le.insert("le".into(), le);
                        put(format!("{base}_bucket"), &with_le, cumulative as f64);
                    }
                    put(format!("{base}_sum"), &labels, p["sum"].as_f64().unwrap());
                    put(
                        format!("{base}_count"),
                        &labels,
                        p["count"].as_f64().unwrap(),
                    );
                }
                other => panic!("a {other} metric: {m}"),
            }
        }
    }
    out
}

#[test]
fn otlp_pushes_the_values_the_metrics_endpoint_serves() {
    let Some(fx) = Fixture::scoped() else { return };
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start(dir.path(), 0, None);
    let endpoint = format!("http://127.0.0.1:{}", receiver.port);
    let trace = fx.trace_with_env(
        &["libcudart.so.12", "libsimtorch.so"],
        &[
            "--metrics",
            "127.0.0.1:0",
            "--otlp-endpoint",
            &endpoint,
            "--otlp-interval",
            "500ms",
            "--quiet",
        ],
        &[("OTEL_RESOURCE_ATTRIBUTES", "k8s.node.name=node-7")],
    );
    assert_eq!(trace.started["otlp"], format!("{endpoint}/v1/metrics"));
    let metrics: SocketAddr = trace.started["metrics"].as_str().unwrap().parse().unwrap();
    let out = incident_workload(&fx.sim).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("OutOfMemoryError"));
    let pid = workload_result(&out.stdout)["pid"].as_u64().unwrap();
    // Once nothing moves, the last request pushed holds every series the page serves, with its
    // value.
    let mut last = (BTreeMap::new(), BTreeMap::new());
    let agreed = (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        let (Some(page), Some(batch)) = (
            get(metrics, "/metrics").map(|(_, body)| body),
            receiver.batches().pop(),
        ) else {
            return false;
        };
        last = (page_series(&page), otlp_series(&batch));
        last.0 == last.1
    });
    let (served, pushed) = last;
    if !agreed {
        let differ: Vec<_> = served
            .iter()
            .filter(|(k, v)| pushed.get(*k) != Some(v))
            .map(|(k, v)| format!("{k}: page {v}, OTLP {:?}", pushed.get(k)))
            .chain(
                pushed
                    .keys()
                    .filter(|k| !served.contains_key(*k))
                    .map(|k| format!("{k}: OTLP only")),
            )
            .collect();
        panic!("the page and the last OTLP request differ: {differ:#?}");
    }
    let calls = format!("tracer_calls_total{{comm=python3,op=cudaMalloc,pid={pid}}}");
    assert!(
        served.get(&calls).is_some_and(|&n| n > 100.0),
        "{calls} in {served:#?}"
    );
    let batch = receiver.batches().pop().unwrap();
    let resource = &batch["resource"];
    assert_eq!(resource["service.name"], "tracer");
    assert_eq!(resource["k8s.node.name"], "node-7");
    assert!(resource["host.name"].is_string(), "{resource}");
    for m in batch["metrics"].as_array().unwrap() {
        let name = m["name"].as_str().unwrap();
        assert!(!name.ends_with("_total"), "{name}");
        if m["kind"] == "sum" {
            // Cumulative (2) and monotonic, counting from the recording's start.
            assert_eq!(
                (m["temporality"].as_i64(), m["monotonic"].as_bool()),
                (Some(2), Some(true)),
                "{m}"
            );
            assert!(m["points"][0]["start_ns"].as_u64().unwrap() > 0);
        }
    }
    let unit = |name: &str| {
        batch["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == name)
            .map(|m| m["unit"].as_str().unwrap().to_owned())
    };
    assert_eq!(unit("tracer_call_duration").as_deref(), Some("s"));
    assert_eq!(unit("tracer_device_memory").as_deref(), Some("By"));
    let stopped = trace.stop(SIGINT);
    assert!(
        stopped.stderr.contains(", 0 dropped, 0 failed attempt(s)"),
        "{}",
        stopped.stderr
    );
}

#[test]
fn a_collector_down_then_slow_costs_the_recording_nothing_and_is_said_once() {
    // Beside other scoped tests: what it asserts is counted (batches dropped, attempts failed,
    // calls stored), never timed.
    let Some(fx) = Fixture::scoped() else { return };
    let dir = tempfile::tempdir().unwrap();
    // Down: nothing listens on the port yet.
    let port = free_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let trace = fx.trace_with_env(
        &["libcudart.so.12", "libsimtorch.so"],
        &[
            "--otlp-endpoint",
            &endpoint,
            "--otlp-interval",
            "200ms",
            "--quiet",
        ],
        &[("OTEL_EXPORTER_OTLP_TIMEOUT", "400")],
    );
    let workload = incident_workload(&fx.sim)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    trace.wait_for_stderr("cannot export metrics to");
    // Slow: it takes the connection, then answers after the sender gave up.
    let delay = dir.path().join("delay");
    std::fs::write(&delay, "2").unwrap();
    let receiver = Receiver::start(dir.path(), port, Some(&delay));
    wait_until(
        Duration::from_secs(30),
        "a request to the slow collector",
        || !receiver.batches().is_empty(),
    );
    let out = workload.wait_with_output().unwrap();
    let pid = workload_result(&out.stdout)["pid"].as_u64().unwrap();
    // Back to answering at once: said once more, that it recovered.
    std::fs::write(&delay, "0").unwrap();
    trace.wait_for_stderr("takes metrics again");
    let stopped = trace.stop(SIGINT);
    let said = |text: &str| stopped.stderr.matches(text).count();
    assert_eq!(said("cannot export metrics to"), 1, "{}", stopped.stderr);
    assert_eq!(said("takes metrics again"), 1, "{}", stopped.stderr);
    // Batches were dropped, and counted, while it was down and slow.
    let line = stopped
        .stderr
        .lines()
        .find(|l| l.contains(" metric batch(es) sent to "))
        .unwrap_or_else(|| panic!("{}", stopped.stderr));
    let figure = |after: &str| -> u64 {
        line.split(after)
            .next()
            .unwrap()
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(figure(" dropped") > 0, "{line}");
    assert!(figure(" failed attempt") > 2, "{line}");
    assert!(figure(" metric batch") > 0, "{line}");
    // The recording lost nothing: every call the kernel counted is stored.
    assert_eq!(stopped.counter("dropped_ring_full"), 0);
    assert_eq!(
        stopped.counter("events_stored"),
        stopped.counter("submitted"),
        "{:#}",
        stopped.summary
    );
    let stored = scalar(
        &fx.db,
        &format!(
            "SELECT (SELECT count(*) FROM events WHERE pid = {pid}) + (SELECT count(*) FROM tensor_events WHERE pid = {pid})"
        ),
    );
    assert!(stored > 1000, "{stored}");
}

/// The DaemonSet shows both ways out: the Prometheus endpoint it serves, and the OTLP
/// collector it pushes to once the standard variable is set, with the downward API naming the
/// node, pod and namespace for the OTLP resource.
#[test]
fn the_daemonset_shows_both_ways_out() {
    let path = workspace().join("deploy/kubernetes/daemonset.yaml");
    let docs = yaml(&path);
    let container = &docs[0]["spec"]["template"]["spec"]["containers"][0];
    let args = container["args"].to_string();
    assert!(args.contains("--metrics="), "{args}");
    let env: BTreeMap<&str, &Value> = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap(),
                &e["valueFrom"]["fieldRef"]["fieldPath"],
            )
        })
        .collect();
    assert_eq!(env["NODE_NAME"], "spec.nodeName");
    assert_eq!(env["POD_NAME"], "metadata.name");
    assert_eq!(env["POD_NAMESPACE"], "metadata.namespace");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.contains("OTEL_EXPORTER_OTLP_ENDPOINT"),
        "the OTLP way is not shown"
    );
}

/// https: the collector's certificate, signed by no CA the system trusts, is refused (said
/// once, nothing sent) until OTEL_EXPORTER_OTLP_CERTIFICATE names it; then every batch goes.
#[test]
fn otlp_over_https_trusts_the_certificate_it_is_given() {
    let Some(fx) = Fixture::new() else { return };
    let dir = tempfile::tempdir().unwrap();
    // A CA of the test's own, and the collector's certificate signed by it.
    let file = |name: &str| dir.path().join(name);
    std::fs::write(
        file("leaf.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .current_dir(dir.path())
            .args(args)
            .output()
            .expect("openssl");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "key.pem",
        "-out",
        "leaf.csr",
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        "leaf.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "leaf.ext",
        "-out",
        "cert.pem",
    ]);
    let (cert, key, ca) = (file("cert.pem"), file("key.pem"), file("ca.pem"));
    let receiver = Receiver::start_with(dir.path(), 0, None, Some((&cert, &key)));
    let endpoint = format!("https://127.0.0.1:{}", receiver.port);
    let run = |env: &[(&str, &str)]| {
        let trace = fx.trace_with_env(
            &["libcudart.so.12"],
            &[
                "--otlp-endpoint",
                &endpoint,
                "--otlp-interval",
                "200ms",
                "--quiet",
                "--duration",
                "2",
            ],
            env,
        );
        trace.stop(0)
    };
    let untrusted = run(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "1000")]);
    assert_eq!(
        untrusted.stderr.matches("cannot export metrics to").count(),
        1,
        "{}",
        untrusted.stderr
    );
    assert!(
        untrusted.stderr.contains("certificate"),
        "{}",
        untrusted.stderr
    );
    assert!(receiver.batches().is_empty());
    let cert_path = ca.to_str().unwrap();
    let trusted = run(&[("OTEL_EXPORTER_OTLP_CERTIFICATE", cert_path)]);
    assert!(
        trusted.stderr.contains(", 0 dropped, 0 failed attempt(s)"),
        "{}",
        trusted.stderr
    );
    assert!(!receiver.batches().is_empty());
    assert_eq!(receiver.batches()[0]["resource"]["service.name"], "tracer");
}

/// With `--dump-on-oom`, the collector hears of each OOM as one log record on OTLP's logs path,
/// beside the metrics: severity ERROR, event `tracer.oom`, the job, rank, node, pid, device,
/// verdict, the bytes asked and short, and the dump's folder.
#[test]
fn each_oom_reaches_the_collector_as_one_log_record() {
    let Some(fx) = Fixture::scoped() else { return };
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start(dir.path(), 0, None);
    let dumps = dir.path().join("dumps");
    std::fs::create_dir(&dumps).unwrap();
    let endpoint = format!("http://127.0.0.1:{}", receiver.port);
    let trace = fx.trace(
        &["libcudart.so.12", "libcuda.so.1", "libsimtorch.so"],
        &[
            "--otlp-endpoint",
            &endpoint,
            "--dump-on-oom",
            dumps.to_str().unwrap(),
            "--quiet",
        ],
    );
    let out = Command::new("python3")
        .arg(workspace().join("demos/workloads/train.py"))
        .args(["oom", "--speed", "5", "--duration", "20", "--cudart"])
        .arg(fx.sim.join("libcudart.so.12"))
        .env("SIMCUDA_MEM", "1GiB")
        .env("RANK", "5")
        .env("TORCHELASTIC_RUN_ID", "otlpjob")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let pid = workload_result(&out.stdout)["pid"].as_u64().unwrap();
    let logs = || -> Vec<Value> {
        receiver
            .batches()
            .into_iter()
            .filter_map(|b| b.get("logs").cloned())
            .flat_map(|l| l.as_array().cloned().unwrap_or_default())
            .collect()
    };
    wait_until(Duration::from_secs(10), "the OOM's log record", || {
        !logs().is_empty()
    });
    let stopped = trace.stop(SIGINT);
    let records = logs();
    assert_eq!(records.len(), 1, "{records:#?}");
    let r = &records[0];
    assert_eq!(
        (&r["severity_number"], &r["severity_text"], &r["event_name"]),
        (&17.into(), &"ERROR".into(), &"tracer.oom".into()),
        "{r:#}"
    );
    let a = &r["attributes"];
    assert_eq!(
        (&a["job"], &a["rank"], &a["pid"]),
        (&"run-otlpjob".into(), &"5".into(), &pid.into()),
        "{r:#}"
    );
    let written = &stopped.summary["dumps"]["written"][0];
    assert_eq!(&a["dump"], written, "{r:#}");
    assert!(PathBuf::from(a["dump"].as_str().unwrap())
        .join("explain.json")
        .exists());
    // The verdict and figures are explain's, in the folder.
    let explained: Value = serde_json::from_slice(
        &std::fs::read(PathBuf::from(a["dump"].as_str().unwrap()).join("explain.json")).unwrap(),
    )
    .unwrap();
    let holder = &explained["holders"][0];
    assert_eq!(a["verdict"], holder["verdict"], "{r:#}");
    assert_eq!(a["asked_bytes"], holder["arithmetic"]["asked"], "{r:#}");
    assert_eq!(a["device"], holder["device"], "{r:#}");
    assert!(a["node"].as_str().is_some_and(|n| !n.is_empty()), "{r:#}");
}
