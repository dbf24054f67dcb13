//! The fleet, with the real tools: a real Prometheus scrapes a live `tracer trace --metrics`
//! during the incident workload and its answers equal the session's; the alert rules pass
//! promtool's checks and unit tests; every PromQL expression of the rules and the dashboard
//! evaluates and names only metrics tracer exports; the manifests validate against the
//! Kubernetes schemas; a process in a crafted pod cgroup gets its pod's names from a stub of
//! the Kubernetes API; and 100 concurrent scrapers do not slow event delivery.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener},
    os::unix::process::CommandExt as _,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use crate::common::*;
use serde_json::Value;

fn deploy(rel: &str) -> PathBuf {
    workspace().join("deploy").join(rel)
}

fn metrics_addr(trace: &Trace) -> SocketAddr {
    trace.started["metrics"]
        .as_str()
        .unwrap_or_else(|| panic!("no metrics address in {}", trace.started))
        .parse()
        .unwrap()
}

/// The value of one series in a text exposition (labels in the order tracer writes them).
fn sample(page: &str, name_and_labels: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

/// A Prometheus server on loopback scraping `target` every second.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(target: SocketAddr) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: tracer\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus (Debian package prometheus: scripts/setup.sh installs it)");
        let p = Prometheus {
            child,
            addr,
            _dir: dir,
        };
        wait_until(
            Duration::from_secs(30),
            "prometheus to become ready",
            || get(addr, "/-/ready").map(|(c, _)| c) == Some(200),
        );
        p
    }

    /// An instant query: its result vector, or the error Prometheus gave.
    fn query(&self, promql: &str) -> Result<Vec<Value>, String> {
        let mut encoded = String::new();
        for b in promql.bytes() {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                encoded.push(b as char);
            } else {
                encoded.push_str(&format!("%{b:02X}"));
            }
        }
        let (_, body) = get(self.addr, &format!("/api/v1/query?query={encoded}"))
            .ok_or("no answer from prometheus")?;
        let v: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if v["status"] != "success" {
            return Err(format!("{promql}: {body}"));
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// `promql`'s single value per `label`, waiting (up to 15 s) until it equals `want`.
    fn values_by(
        &self,
        promql: &str,
        label: &str,
        want: &BTreeMap<String, f64>,
    ) -> BTreeMap<String, f64> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let got: BTreeMap<String, f64> = self
                .query(promql)
                .unwrap()
                .iter()
                .map(|r| {
                    (
                        r["metric"][label].as_str().unwrap_or_default().to_owned(),
                        r["value"][1].as_str().unwrap().parse().unwrap(),
                    )
                })
                .collect();
            if &got == want || Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every expression of the rules and the dashboard, with Grafana's variables given values.
fn expressions() -> Vec<(String, String)> {
    let mut all = Vec::new();
    for doc in yaml(&deploy("prometheus/tracer-rules.yaml")) {
        for group in doc["groups"].as_array().unwrap() {
            for rule in group["rules"].as_array().unwrap() {
                all.push((
                    format!("rule {}", rule["alert"].as_str().unwrap()),
                    rule["expr"].as_str().unwrap().to_owned(),
                ));
            }
        }
    }
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(deploy("kubernetes/tracer-dashboard.json")).unwrap(),
    )
    .unwrap();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "1m")
                .replace("$node", ".*")
                .replace("$pod_name", ".*");
            all.push((format!("panel {}", panel["title"]), expr));
        }
    }
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = var["query"]["query"].as_str() {
            // label_values(METRIC, LABEL) is Grafana's; the metric in it must exist.
            let metric = q
                .trim_start_matches("label_values(")
                .split(',')
                .next()
                .unwrap();
            all.push((format!("variable {}", var["name"]), metric.to_owned()));
        }
    }
    all
}

/// The metric names an expression uses: identifiers that are not functions, keywords,
/// aggregations, label names (in braces or grouping clauses), strings or durations.
fn metric_names(expr: &str) -> BTreeSet<String> {
    const NOT_NAMES: [&str; 22] = [
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "bool",
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "topk",
        "bottomk",
    ];
    const GROUPING: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let mut names = BTreeSet::new();
    let b = expr.as_bytes();
    let mut i = 0;
    let skip_to = |i: &mut usize, end: u8| {
        while *i < b.len() && b[*i] != end {
            *i += 1;
        }
    };
    while i < b.len() {
        match b[i] {
            b'"' => {
                i += 1;
                skip_to(&mut i, b'"');
            }
            b'{' => skip_to(&mut i, b'}'),
            b'[' => skip_to(&mut i, b']'),
            // A number or a duration (`offset 10m`): no name.
            c if c.is_ascii_digit() => {
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.') {
                    i += 1;
                }
                continue;
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b':')
                {
                    i += 1;
                }
                let word = &expr[start..i];
                let rest = expr[i..].trim_start();
                if GROUPING.contains(&word) && rest.starts_with('(') {
                    // Its label list.
                    i = expr.len() - rest.len();
                    skip_to(&mut i, b')');
                } else if !rest.starts_with('(') && !NOT_NAMES.contains(&word) {
                    names.insert(word.to_owned());
                }
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    names
}

#[test]
fn metric_names_are_found_in_expressions() {
    assert_eq!(
        metric_names(
            r#"histogram_quantile(0.99, sum by (le, op) (rate(tracer_call_duration_seconds_bucket{op=~"cudaMalloc.*"}[5m]))) and on(pid) up"#
        ),
        BTreeSet::from([
            "tracer_call_duration_seconds_bucket".to_owned(),
            "up".to_owned()
        ])
    );
    assert_eq!(
        metric_names("x unless x offset 10m or y > 1e3"),
        BTreeSet::from(["x".to_owned(), "y".to_owned()])
    );
    assert_eq!(
        metric_names("max_over_time(a_b[5m]) > c and c > 0"),
        BTreeSet::from(["a_b".to_owned(), "c".to_owned()])
    );
}

#[test]
fn promtool_checks_and_unit_tests_the_rules() {
    let rules = deploy("prometheus/tracer-rules.yaml");
    let check = Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(&rules)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    assert!(String::from_utf8_lossy(&check.stdout).contains("SUCCESS: 11 rules found"));
    let test = Command::new("promtool")
        .args(["test", "rules"])
        .arg(deploy("prometheus/tracer-rules.test.yaml"))
        .output()
        .unwrap();
    assert!(
        test.status.success(),
        "{}",
        String::from_utf8_lossy(&test.stdout)
    );
    // Every alert has a test in which it fires and one in which it stays quiet.
    let tests = std::fs::read_to_string(deploy("prometheus/tracer-rules.test.yaml")).unwrap();
    for doc in yaml(&rules) {
        for group in doc["groups"].as_array().unwrap() {
            for rule in group["rules"].as_array().unwrap() {
                let alert = rule["alert"].as_str().unwrap();
                let blocks: Vec<&str> = tests
                    .split("- eval_time:")
                    .filter(|b| b.contains(&format!("alertname: {alert}\n")))
                    .collect();
                assert!(
                    blocks.iter().any(|b| b.contains("exp_alerts: []")),
                    "{alert} never tested quiet"
                );
                assert!(
                    blocks.iter().any(|b| b.contains("exp_labels")),
                    "{alert} never tested firing"
                );
            }
        }
    }
    // The tests bite: one expectation turned around fails.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(&rules, dir.path().join("tracer-rules.yaml")).unwrap();
    let broken = tests.replacen(
        "      - eval_time: 5m\n        alertname: CudaAllocatorFragmented\n        exp_alerts: []",
        "      - eval_time: 15m\n        alertname: CudaAllocatorFragmented\n        exp_alerts: []",
        1,
    );
    assert_ne!(broken, tests);
    std::fs::write(dir.path().join("t.yaml"), broken).unwrap();
    let failed = Command::new("promtool")
        .args(["test", "rules"])
        .arg(dir.path().join("t.yaml"))
        .output()
        .unwrap();
    assert!(!failed.status.success());
}

#[test]
fn the_manifests_validate_against_the_kubernetes_schemas() {
    let plain = [
        "namespace.yaml",
        "rbac.yaml",
        "daemonset.yaml",
        "service.yaml",
        "networkpolicy.yaml",
    ];
    let validate = |files: &[PathBuf]| {
        Command::new("python3")
            .env("PYTHONPATH", pylib())
            .args(["-m", "kubernetes_validate", "-k", "1.33.0", "--strict"])
            .args(files)
            .output()
            .unwrap()
    };
    let files: Vec<PathBuf> = plain
        .iter()
        .map(|f| deploy(&format!("kubernetes/{f}")))
        .collect();
    let out = validate(&files);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .matches(" passed for resource ")
            .count(),
        7
    );
    // The validator bites: a misspelt field fails.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("daemonset.yaml");
    let text = std::fs::read_to_string(deploy("kubernetes/daemonset.yaml")).unwrap();
    std::fs::write(&bad, text.replacen("hostPID: true", "hostPid: true", 1)).unwrap();
    assert!(!validate(&[bad]).status.success());

    // kustomization.yaml names files that exist; every object is in the tracer namespace.
    let kustomization = &yaml(&deploy("kubernetes/kustomization.yaml"))[0];
    for r in kustomization["resources"].as_array().unwrap() {
        assert!(
            deploy(&format!("kubernetes/{}", r.as_str().unwrap())).exists(),
            "{r}"
        );
    }
    assert_eq!(kustomization["namespace"], "tracer");
}

#[test]
fn the_operator_objects_hold_the_rules_and_scrape_what_the_daemonset_serves() {
    // The PrometheusRule carries exactly the groups promtool tests.
    let rule = &yaml(&deploy("kubernetes/prometheusrule.yaml"))[0];
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(rule["kind"], "PrometheusRule");
    assert_eq!(
        rule["spec"]["groups"],
        yaml(&deploy("prometheus/tracer-rules.yaml"))[0]["groups"]
    );
    // The PodMonitor selects the DaemonSet's pods, on the port tracer listens on.
    let monitor = &yaml(&deploy("kubernetes/podmonitor.yaml"))[0];
    assert_eq!(monitor["kind"], "PodMonitor");
    let ds = &yaml(&deploy("kubernetes/daemonset.yaml"))[0];
    let pod = &ds["spec"]["template"];
    for (k, v) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(&pod["metadata"]["labels"][k], v, "selector {k}");
    }
    let container = &pod["spec"]["containers"][0];
    let port = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == monitor["spec"]["podMetricsEndpoints"][0]["port"])
        .expect("the PodMonitor's port is the container's");
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.contains(&format!("--metrics=$(POD_IP):{}", port["containerPort"]).as_str()),
        "{args:?}"
    );
    assert!(args.contains(&"--keep-serving"));
    // Always on at fleet scale: the allocator's probes armed only while they matter.
    assert!(args.contains(&"--allocator=auto"), "{args:?}");
    assert_eq!(
        monitor["spec"]["podMetricsEndpoints"][0]["path"],
        "/metrics"
    );
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    // The arguments are ones tracer takes.
    let help = Command::new(TRACER)
        .args(["trace", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for a in &args[1..] {
        let flag = a.split('=').next().unwrap();
        assert!(help.contains(flag), "{flag} is not a `tracer trace` option");
    }
}

#[test]
fn a_real_prometheus_scrapes_a_live_trace_and_agrees_with_the_session() {
    let Some(fx) = Fixture::new() else { return };
    // With --dump-on-oom, so that the OOM's verdict is on the page too.
    let dumps = tempfile::tempdir().unwrap();
    let trace = fx.trace(
        &["libcudart.so.12", "libsimtorch.so"],
        &[
            "--metrics",
            "127.0.0.1:0",
            "--quiet",
            "--dump-on-oom",
            dumps.path().to_str().unwrap(),
        ],
    );
    let metrics = metrics_addr(&trace);
    assert!(metrics.ip().is_loopback());
    let prometheus = Prometheus::start(metrics);
    let out = incident_workload(&fx.sim).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("OutOfMemoryError"));
    let result = workload_result(&out.stdout);
    let pid = result["pid"].as_u64().unwrap();
    // Everything the process made is stored a moment after it ends: the database holds as
    // many of its calls as tracer's own live counters saw.
    let seen_live = || -> f64 {
        let Some((_, page)) = get(metrics, "/metrics") else {
            return -1.0;
        };
        let pid_label = format!("pid=\"{pid}\"");
        page.lines()
            .filter(|l| l.starts_with("tracer_calls_total{") && l.contains(&pid_label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let stored = || {
        scalar(
            &fx.db,
            &format!(
                "SELECT (SELECT count(*) FROM events WHERE pid = {pid}) + (SELECT count(*) FROM tensor_events WHERE pid = {pid})"
            ),
        ) as f64
    };
    wait_until(
        Duration::from_secs(20),
        "the process's calls stored",
        || stored() == seen_live(),
    );

    // Calls and errors per op: Prometheus' numbers are the database's.
    let by_op = |sql: String| -> BTreeMap<String, f64> {
        query(&fx.db, &sql)
            .iter()
            .map(|r| {
                (
                    r["op"].as_str().unwrap().to_owned(),
                    r["n"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let sql = |col: &str| {
        by_op(format!(
            "SELECT op, {col} AS n FROM events WHERE pid = {pid} GROUP BY op"
        ))
    };
    let calls = sql("count(*)");
    assert!(calls["cudaMalloc"] > 100.0, "{calls:?}");
    let tensor_ops = by_op(format!(
        "SELECT op, count(*) AS n FROM tensor_events WHERE pid = {pid} GROUP BY op"
    ));
    let mut want = calls.clone();
    want.extend(tensor_ops);
    let got = prometheus.values_by(
        &format!("sum by (op) (tracer_calls_total{{job=\"tracer\",pid=\"{pid}\"}})"),
        "op",
        &want,
    );
    assert_eq!(got, want);
    let errors = sql("sum(ret != 0)");
    let got = prometheus.values_by(
        &format!("sum by (op) (tracer_call_errors_total{{pid=\"{pid}\",op!~\"pytorch:.*\"}})"),
        "op",
        &errors,
    );
    assert_eq!(got, errors);
    assert!(errors["cudaMalloc"] >= 2.0, "{errors:?}");
    let durations = sql("count(*)");
    let got = prometheus.values_by(
        &format!("sum by (op) (tracer_call_duration_seconds_count{{pid=\"{pid}\"}})"),
        "op",
        &durations,
    );
    assert_eq!(got, durations);

    // The allocator's own account at its end: OOMs, retries, allocated, reserved, largest
    // free block.
    let r = &result["result"];
    let one = |promql: &str| -> f64 {
        let v = prometheus.query(promql).unwrap();
        assert_eq!(v.len(), 1, "{promql}: {v:?}");
        v[0]["value"][1].as_str().unwrap().parse().unwrap()
    };
    let of = |name: &str| one(&format!("{name}{{pid=\"{pid}\",device=\"0\"}}"));
    assert_eq!(of("tracer_oom_total"), r["num_ooms"].as_f64().unwrap());
    assert_eq!(
        of("tracer_allocation_retries_total"),
        r["num_alloc_retries"].as_f64().unwrap()
    );
    assert_eq!(of("tracer_allocation_failures_total"), errors["cudaMalloc"]);
    assert_eq!(
        of("tracer_allocator_allocated_bytes"),
        r["allocated"].as_f64().unwrap()
    );
    assert_eq!(
        of("tracer_allocator_reserved_bytes"),
        r["reserved"].as_f64().unwrap()
    );
    assert_eq!(
        of("tracer_allocator_largest_free_block_bytes"),
        r["largest_free_block"].as_f64().unwrap()
    );
    assert!(of("tracer_early_warnings_total") >= 1.0);
    assert_eq!(one("tracer_tracing"), 1.0);
    assert_eq!(one("tracer_session"), trace.session as f64);
    assert_eq!(one("tracer_lost_total{counter=\"dropped_ring_full\"}"), 0.0);
    assert_eq!(one("up{job=\"tracer\"}"), 1.0);

    // The page itself passes promtool's lint; its names are what the rules and dashboard use
    // (the OOM's verdict once its dump's explain is done).
    wait_until(
        Duration::from_secs(10),
        "the OOM's verdict on the page",
        || get(metrics, "/metrics").is_some_and(|(_, p)| p.contains("tracer_oom_verdicts_total{")),
    );
    let (code, page) = get(metrics, "/metrics").unwrap();
    assert_eq!(code, 200);
    let mut lint = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    lint.stdin
        .take()
        .unwrap()
        .write_all(page.as_bytes())
        .unwrap();
    let lint = lint.wait_with_output().unwrap();
    assert!(
        lint.status.success(),
        "{}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );
    assert!(
        !page.contains("ptr=") && !page.contains("size="),
        "unbounded labels"
    );
    let exported: BTreeSet<String> = page
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .flat_map(|l| {
            let mut parts = l.split_whitespace();
            let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
            if kind == "histogram" {
                ["_bucket", "_sum", "_count"]
                    .map(|s| format!("{name}{s}"))
                    .to_vec()
            } else {
                vec![name.to_owned()]
            }
        })
        .collect();
    for (what, expr) in expressions() {
        if let Err(e) = prometheus.query(&expr) {
            panic!("{what} does not evaluate: {e}");
        }
        for name in metric_names(&expr) {
            // Series only while a traced process lives and has asked the device what it has
            // free (the workload has ended here; present/metrics.rs's tests show them).
            let while_asked = name == "tracer_gpu_untraced_bytes";
            assert!(
                name == "up"
                    || exported.contains(&name)
                    || name == "tracer_not_tracing_info"
                    || while_asked,
                "{what} names {name}, which tracer does not export ({exported:?})"
            );
        }
    }
    let stopped = trace.stop(SIGINT);
    assert_eq!(stopped.counter("dropped_ring_full"), 0);
}

/// A cgroup v2 hierarchy to craft a pod's cgroup in.
fn cgroup2_root() -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
        })
        .expect("a cgroup2 mount")
}

/// A stub of the one Kubernetes API endpoint tracer calls: GET /api/v1/pods. Answers every
/// request with `pods` and records the request lines.
fn stub_api(pods: Value) -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    std::thread::spawn(move || {
        for mut s in listener.incoming().map_while(Result::ok) {
            let mut buf = [0u8; 8192];
            let n = s.read(&mut buf).unwrap_or(0);
            let request = String::from_utf8_lossy(&buf[..n]).into_owned();
            log.lock()
                .unwrap()
                .push(request.lines().next().unwrap_or_default().to_owned());
            let body = pods.to_string();
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (addr, seen)
}

#[test]
fn a_process_in_a_pod_cgroup_gets_its_pods_names_from_the_kubernetes_api() {
    let Some(fx) = Fixture::new() else { return };
    let uid = "3f6b1d2e-0a4c-4e8f-9b7d-1c2e3f4a5b6c";
    let container = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";
    // The systemd driver's naming, with containerd: as the kubelet makes it.
    let pod_dir = cgroup2_root()
        .join("kubepods.slice/kubepods-besteffort.slice")
        .join(format!(
            "kubepods-besteffort-pod{}.slice",
            uid.replace('-', "_")
        ));
    let scope = pod_dir.join(format!("cri-containerd-{container}.scope"));
    std::fs::create_dir_all(&scope).unwrap();
    let pods = serde_json::json!({
        "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"},
        "items": [{
            "metadata": {"name": "trainer-0", "namespace": "ml", "uid": uid},
            "spec": {"nodeName": "gpu-node-7", "containers": [{"name": "trainer", "image": "pytorch"}]},
            "status": {"containerStatuses": [{
                "name": "trainer", "image": "pytorch", "imageID": "sha256:0", "ready": true,
                "restartCount": 0, "containerID": format!("containerd://{container}")
            }]}
        }]
    });
    let (api, requests) = stub_api(pods);
    let kubeconfig = fx.db.with_file_name("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stub\n  cluster:\n    server: http://{api}\ncontexts:\n- name: stub\n  context:\n    cluster: stub\n    user: tracer\ncurrent-context: stub\nusers:\n- name: tracer\n  user:\n    token: read-only\n"
        ),
    )
    .unwrap();
    // The DaemonSet passes the node's name: only its pods are listed.
    let trace = fx.trace_with_env(
        &["libcudart.so.12"],
        &[
            "--metrics",
            "127.0.0.1:0",
            "--kubernetes",
            kubeconfig.to_str().unwrap(),
            "--quiet",
        ],
        &[("NODE_NAME", "gpu-node-7")],
    );
    let metrics = metrics_addr(&trace);
    // The workload joins the pod's cgroup, then calls.
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec {} --mix pairs --iters 200 --hold-ms 3000",
            scope.display(),
            fx.sim.join("simdriver").display()
        ))
        .env("SIMCUDA_LATENCY", "default=0")
        .output()
        .unwrap();
    let rep = report(out);
    let pid = rep["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("no pid in {rep}"));
    let series = format!(
        "tracer_calls_total{{pid=\"{pid}\",comm=\"simdriver\",pod_uid=\"{uid}\",pod_namespace=\"ml\",pod_name=\"trainer-0\",container_name=\"trainer\",op=\"cudaMalloc\"}}"
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    let page = loop {
        let (_, page) = get(metrics, "/metrics").unwrap();
        if sample(&page, &series).is_some() || Instant::now() > deadline {
            break page;
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    trace.stop(SIGINT);
    let _ = std::fs::remove_dir(&scope);
    let _ = std::fs::remove_dir(&pod_dir);
    assert_eq!(
        sample(&page, &series),
        Some(200.0),
        "{series} not in:\n{page}"
    );
    // One list, of this node's pods only.
    let requests = requests.lock().unwrap().clone();
    assert!(!requests.is_empty());
    assert!(
        requests[0].starts_with("GET /api/v1/pods?")
            && requests[0].contains("fieldSelector=spec.nodeName%3Dgpu-node-7"),
        "{requests:?}"
    );
}

#[test]
fn a_hundred_concurrent_scrapers_do_not_slow_event_delivery() {
    let Some(fx) = Fixture::new() else { return };
    let trace = fx.trace(
        &["libcudart.so.12"],
        &[
            "--metrics",
            "127.0.0.1:0",
            "--ring-size",
            "256MiB",
            "--quiet",
        ],
    );
    let metrics = metrics_addr(&trace);
    let done = Arc::new(AtomicBool::new(false));
    let (answered, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let scrapers: Vec<_> = (0..100)
        .map(|_| {
            let (done, answered, refused) = (done.clone(), answered.clone(), refused.clone());
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    match get(metrics, "/metrics") {
                        Some((200, page)) if page.contains("tracer_tracing 1") => {
                            answered.fetch_add(1, Ordering::Relaxed)
                        }
                        Some(other) => panic!("unexpected answer {other:?}"),
                        None => refused.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    let rep = report(
        driver(
            &fx.sim,
            &["--mix", "pairs", "--threads", "2", "--duration-ms", "4000"],
            &[("SIMCUDA_LATENCY", "default=0")],
        )
        .output()
        .unwrap(),
    );
    done.store(true, Ordering::Relaxed);
    for s in scrapers {
        s.join().unwrap();
    }
    let (answered, refused) = (
        answered.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
    );
    // The endpoint's own count of refusals is the scrapers' (published within a second).
    let deadline = Instant::now() + Duration::from_secs(5);
    let counted = loop {
        let (_, page) = get(metrics, "/metrics").unwrap();
        let counted = sample(&page, "tracer_metrics_connections_refused_total").unwrap() as u64;
        if counted == refused || Instant::now() > deadline {
            break counted;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let stopped = trace.stop(SIGINT);
    let calls = total_calls(&rep);
    eprintln!("{calls} calls; {answered} scrapes answered, {refused} refused");
    assert!(calls > 10_000, "{rep}");
    assert!(
        answered > 0 && refused > 0,
        "{answered} answered, {refused} refused"
    );
    assert_eq!(counted, refused);
    assert_eq!(stopped.counter("dropped_ring_full"), 0);
    assert_eq!(stopped.counter("events_stored"), calls);
    assert_eq!(scalar(&fx.db, "SELECT count(*) FROM events"), calls);
}

#[test]
fn where_tracing_cannot_start_keep_serving_stays_up_unready_saying_why() {
    if !privileged() {
        return;
    }
    // As nobody, loading BPF programs is refused: the kernel "cannot trace" for this process.
    let dir = dir_with_mode(0o777);
    let port = free_port();
    let mut child = Command::new(TRACER)
        .args(["trace", "--quiet", "--keep-serving", "--metrics"])
        .arg(port.to_string())
        .arg("--db")
        .arg(dir.path().join("t.db"))
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let page = loop {
        // Served from the start, first as "starting", then with why tracing failed.
        if let Some((200, page)) = get(addr, "/metrics") {
            if page.contains("tracer_not_tracing_info") && !page.contains("reason=\"starting\"") {
                break page;
            }
        }
        assert!(Instant::now() < deadline, "no unready page saying why");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(sample(&page, "tracer_tracing"), Some(0.0));
    assert!(page.contains("run it with sudo"), "{page}");
    let (code, reason) = get(addr, "/readyz").unwrap();
    assert_eq!(code, 503);
    assert!(reason.contains("tracing needs root"), "{reason}");
    assert_eq!(get(addr, "/healthz").unwrap().0, 200);
    // Still up a while later, then SIGTERM: the error's exit status.
    std::thread::sleep(Duration::from_secs(2));
    assert!(child.try_wait().unwrap().is_none(), "it exited");
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc_kill(child.id() as i32, 15) };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("--keep-serving"), "{stderr}");
}

#[test]
fn a_killed_tracer_loses_nothing_committed_and_the_next_marks_its_session_crashed() {
    let Some(fx) = Fixture::new() else { return };
    let lib = fx.sim.join("libcudart.so.12");
    let args = ["--lib", lib.to_str().unwrap(), "--quiet"];
    let mut first = Trace::start(&fx.db, &args);
    report(
        driver(
            &fx.sim,
            &["--mix", "pairs", "--iters", "500"],
            &[("SIMCUDA_LATENCY", "default=0")],
        )
        .output()
        .unwrap(),
    );
    // Committed within a second or two of the calls.
    let stored = || {
        scalar(
            &fx.db,
            &format!(
                "SELECT count(*) FROM events WHERE session_id = {}",
                first.session
            ),
        )
    };
    wait_until(Duration::from_secs(10), "the 1000 calls committed", || {
        stored() >= 1000
    });
    let committed = stored();
    assert_eq!(committed, 1000);
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    // A DaemonSet's restart: a new trace on the same database.
    let second = Trace::start(&fx.db, &args);
    let stopped = second.stop(SIGINT);
    assert!(
        stopped
            .stderr
            .contains(&format!("session {} was left running", first.session)),
        "{}",
        stopped.stderr
    );
    let s = &query(
        &fx.db,
        &format!(
            "SELECT status, note FROM sessions WHERE id = {}",
            first.session
        ),
    )[0];
    assert_eq!(s["status"], "crashed", "{s}");
    assert!(
        s["note"]
            .as_str()
            .unwrap()
            .contains("tracer process is gone"),
        "{s}"
    );
    assert_eq!(
        scalar(
            &fx.db,
            &format!(
                "SELECT count(*) FROM events WHERE session_id = {}",
                first.session
            )
        ),
        committed
    );
}

#[test]
fn bad_metrics_addresses_and_export_paths_get_clear_messages() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("t.db");
    let run = |args: &[&str]| {
        Command::new(TRACER)
            .args(args)
            .arg("--db")
            .arg(&db)
            .output()
            .unwrap()
    };
    let stderr = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).into_owned();
    // Not an address.
    let out = run(&["trace", "--metrics", "localhost"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("is not PORT, IP:PORT or [IPv6]:PORT"),
        "{}",
        stderr(&out)
    );
    // A port another program holds: refused before anything is attached or recorded.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = run(&["trace", "--metrics", &port]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("listening on 127.0.0.1:{port} for --metrics"))
            && stderr(&out).contains("pick another --metrics address"),
        "{}",
        stderr(&out)
    );
    assert!(!db.exists(), "nothing recorded");
    // Export: a folder that does not exist, and a session that does not.
    let out = run(&[
        "export",
        "--format",
        "perfetto",
        "-o",
        "/nonexistent/t.perfetto",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("pick a writable path with -o"),
        "{}",
        stderr(&out)
    );
    let target = dir.path().join("t.perfetto");
    let out = run(&[
        "export",
        "--format",
        "perfetto",
        "--session",
        "99",
        "-o",
        target.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}
