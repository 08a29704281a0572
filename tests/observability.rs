//! Observability and deployment artefacts checked against a running tokenonce: every metric the
//! Grafana dashboard (dashboards/tokenonce.json) and the alert rules name exists after real
//! traffic and follows Prometheus conventions; Debian's real `prometheus` scrapes tokenonce and
//! answers queries; `promtool` accepts and unit-tests conf/prometheus/. (The Kubernetes
//! manifests: tests/kubernetes.rs.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serde_yaml_ng::Value as Yaml;
use support::*;

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// Every `tokenonce_[a-z_]+` and `process_[a-z_]+` (the standard process metrics) token in
/// `text`.
fn metric_tokens(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for prefix in ["tokenonce_", "process_"] {
        let mut rest = text;
        while let Some(i) = rest.find(prefix) {
            let word_start = !rest[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
            let tail = &rest[i..];
            let end = tail.find(|c: char| !(c.is_ascii_lowercase() || c == '_')).unwrap_or(tail.len());
            if word_start {
                out.insert(tail[..end].to_owned());
            }
            rest = &tail[end..];
        }
    }
    out
}

/// The standard `process_*` families (prometheus' process collector): named by Prometheus'
/// own conventions, so not `tokenonce_`-prefixed; the dashboard shows the ones it needs.
fn is_process_family(family: &str) -> bool {
    family.starts_with("process_")
}

/// One sample line of the text exposition format.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

impl Sample {
    fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// A parsed `/metrics` scrape.
#[derive(Debug, Default)]
struct Scrape {
    /// Family name to its `# TYPE`.
    types: BTreeMap<String, String>,
    /// Family name to its `# HELP` text.
    helps: BTreeMap<String, String>,
    samples: Vec<Sample>,
}

impl Scrape {
    fn parse(text: &str) -> Self {
        let mut s = Self::default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE line");
                s.types.insert(name.to_owned(), kind.to_owned());
            } else if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
                s.helps.insert(name.to_owned(), help.to_owned());
            } else if !line.is_empty() && !line.starts_with('#') {
                s.samples.push(parse_sample(line));
            }
        }
        s
    }

    fn sample_names(&self) -> BTreeSet<&str> {
        self.samples.iter().map(|s| s.name.as_str()).collect()
    }

    /// The family a sample name belongs to (`x_bucket` of histogram `x` is `x`).
    fn family_of<'a>(&self, sample: &'a str) -> &'a str {
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = sample.strip_suffix(suffix) {
                if self.types.get(base).is_some_and(|t| t == "histogram" || t == "summary") {
                    return base;
                }
            }
        }
        sample
    }

    /// Sum of the samples named `name` whose labels include every pair of `labels`.
    fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(*v)))
            .map(|s| s.value)
            .sum()
    }
}

fn parse_sample(line: &str) -> Sample {
    let (name, rest) = match line.find(['{', ' ']) {
        Some(i) => (&line[..i], &line[i..]),
        None => panic!("bad sample line {line:?}"),
    };
    let mut labels = Vec::new();
    let mut rest = rest;
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices().peekable();
        let mut end = None;
        let mut key = String::new();
        while let Some((i, c)) = chars.next() {
            match c {
                '}' => {
                    end = Some(i + 1);
                    break;
                }
                ',' | ' ' => {}
                '=' => {
                    assert_eq!(chars.next().map(|(_, c)| c), Some('"'), "label value must be quoted: {line}");
                    let mut value = String::new();
                    loop {
                        match chars.next().map(|(_, c)| c) {
                            Some('\\') => match chars.next().map(|(_, c)| c) {
                                Some('n') => value.push('\n'),
                                Some(other) => value.push(other),
                                None => panic!("bad escape in {line}"),
                            },
                            Some('"') => break,
                            Some(other) => value.push(other),
                            None => panic!("unterminated label value in {line}"),
                        }
                    }
                    labels.push((std::mem::take(&mut key), value));
                }
                other => key.push(other),
            }
        }
        rest = &body[end.expect("closing brace")..];
    }
    let value = rest.split_whitespace().next().expect("sample value");
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().unwrap_or_else(|e| panic!("{line}: {e}")),
    };
    Sample { name: name.to_owned(), labels, value }
}

/// Every panel of the dashboard, rows' nested panels included (rows themselves left out).
fn dashboard_panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(panels: &'a Value, out: &mut Vec<&'a Value>) {
        for p in panels.as_array().into_iter().flatten() {
            if p["type"] == "row" {
                walk(&p["panels"], out);
            } else {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

fn dashboard() -> Value {
    serde_json::from_str(&read_repo("dashboards/tokenonce.json")).expect("dashboards/tokenonce.json is JSON")
}

/// Every panel and row of the dashboard has an id of its own, and no two top-level panels
/// (rows included) share a cell of Grafana's 24-column grid: merges of branches that each
/// added panels gave two the same id and stacked one on another before.
#[test]
fn dashboard_panels_have_unique_ids_and_do_not_overlap() {
    let dashboard = dashboard();
    let top = dashboard["panels"].as_array().expect("panels");
    let mut ids = BTreeMap::new();
    let mut all: Vec<&Value> = top.iter().collect();
    all.extend(top.iter().flat_map(|p| p["panels"].as_array().into_iter().flatten()));
    for p in all {
        let id = p["id"].as_u64().unwrap_or_else(|| panic!("panel {} has no id", p["title"]));
        if let Some(other) = ids.insert(id, p["title"].clone()) {
            panic!("panels {other} and {} share id {id}", p["title"]);
        }
    }
    let cells = |p: &Value| {
        let g = &p["gridPos"];
        let n = |k: &str| g[k].as_u64().unwrap_or_else(|| panic!("panel {} lacks gridPos.{k}", p["title"]));
        (n("x"), n("y"), n("w"), n("h"))
    };
    for (i, a) in top.iter().enumerate() {
        let (ax, ay, aw, ah) = cells(a);
        assert!(ax + aw <= 24, "panel {} is wider than the grid", a["title"]);
        for b in &top[i + 1..] {
            let (bx, by, bw, bh) = cells(b);
            let apart = ax + aw <= bx || bx + bw <= ax || ay + ah <= by || by + bh <= ay;
            assert!(apart, "panels {} and {} overlap", a["title"], b["title"]);
        }
    }
}

/// The PromQL expression of every target of every panel, with the panel title.
fn dashboard_exprs(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for panel in dashboard_panels(dashboard) {
        let title = panel["title"].as_str().unwrap_or("?").to_owned();
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push((title.clone(), target["expr"].as_str().unwrap_or_default().to_owned()));
        }
    }
    out
}

/// The alert rules of conf/prometheus/alerts.yml: (name, expr).
fn alert_rules() -> Vec<(String, String)> {
    let doc: Yaml = serde_yaml_ng::from_str(&read_repo("conf/prometheus/alerts.yml")).expect("alerts.yml is YAML");
    let mut out = Vec::new();
    for group in doc["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().or_else(|| rule["record"].as_str()).expect("alert or record name");
            out.push((name.to_owned(), rule["expr"].as_str().expect("expr").to_owned()));
        }
    }
    out
}

/// Requests sent by [`send_traffic`], by route label.
struct Sent {
    /// On route `pd`.
    pd: f64,
    /// On no route (label `default`).
    default: f64,
}

/// Sends a known mix through tokenonce: 4 requests that reuse ids (chat, streamed chat,
/// completions), one fallback (`n: 2`), an engine 404 (unknown model), a prefill 503, and a
/// request on a raw path no route matches.
async fn send_traffic(proxy: &TokenOnce, prefill: &FakeVllm) -> Sent {
    let chat = format!("{}/v1/chat/completions", proxy.url);
    let cmpl = format!("{}/v1/completions", proxy.url);
    let mut sent = 0.0;
    for (url, body, want) in [
        (&chat, chat_body("Hello there!", json!({})), 200),
        (&chat, chat_body("Hello again!", json!({})), 200),
        (&chat, chat_body("Stream it", json!({"stream": true, "stream_options": {"include_usage": true}})), 200),
        (&cmpl, json!({"model": "tiny-qwen3", "prompt": "Complete me", "max_tokens": 3}), 200),
        (&chat, chat_body("Two answers", json!({"n": 2})), 200),
        (&chat, chat_body("Who?", json!({"model": "no-such-model"})), 404),
    ] {
        let (status, _, text) = post_json(url, &body, &[]).await;
        assert_eq!(status, want, "{body}: {text}");
        sent += 1.0;
    }
    prefill.configure(|c| c.fail_with = Some((503, r#"{"error":"overloaded"}"#.into())));
    let (status, _, text) = post_json(&chat, &chat_body("Prefill down", json!({})), &[]).await;
    prefill.configure(|c| c.fail_with = None);
    assert_eq!(status, 503, "{text}");
    sent += 1.0;
    let (status, _, text) =
        post_json(&format!("{}/v1/raw/secret-path/abc?user=zed", proxy.url), &json!({"x": 1}), &[]).await;
    assert!(status >= 400, "an unknown path is passed through to the fake, which refuses it: {status} {text}");
    Sent { pd: sent, default: 1.0 }
}

/// Scrapes until `tokenonce_requests_total` counts what [`send_traffic`] sent: exactly on route
/// `pd`, at least on `default` (the harness's start-up probe is counted there too). Requests
/// are counted in pingora's logging phase, which may run just after the client has its
/// response. Bounded: 5 s.
async fn scrape_counted(proxy: &TokenOnce, sent: &Sent) -> (String, Scrape) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = proxy.metrics().await;
        let scrape = Scrape::parse(&text);
        let pd = scrape.sum("tokenonce_requests_total", &[("route", "pd")]);
        let default = scrape.sum("tokenonce_requests_total", &[("route", "default")]);
        if pd == sent.pd && default >= sent.default {
            return (text, scrape);
        }
        assert!(
            pd <= sent.pd && Instant::now() < deadline,
            "tokenonce_requests_total: route pd {pd} (sent {}), default {default} (sent {})",
            sent.pd,
            sent.default
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs a command to completion; the binary must exist (no skipping when it is missing).
fn run(program: &str, args: &[&str]) -> std::process::Output {
    Command::new(program).args(args).current_dir(repo("")).output().unwrap_or_else(|e| {
        panic!("cannot run `{program}` ({e}): install Debian's `prometheus` package (it ships promtool), as .ci/setup does")
    })
}

fn assert_success(what: &str, out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---------------------------------------------------------------------------------------------
// a. The dashboard's metrics exist after real traffic; naming and label conventions
// ---------------------------------------------------------------------------------------------

/// After real traffic (reuse, a fallback, an engine 4xx, a prefill 5xx, an unmatched raw
/// path), every metric named in a dashboard panel, a dashboard variable or an alert rule is a
/// series of the scrape; every exported family is shown on the dashboard; names follow
/// Prometheus conventions (promtool agrees) and label values are bounded.
#[tokio::test(flavor = "multi_thread")]
async fn dashboard_and_alert_metrics_exist_after_real_traffic() {
    // The prefill pool checks local ids in shadow, so their series exist too.
    let model = tempfile::tempdir().unwrap();
    write_local_model(model.path());
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    // ... chooses cache-aware and follows KV events (nothing publishes on port 9: the series
    // exist at zero); a spare pool is discovered through a DNS server that never answers (its
    // failed lookups counted).
    let shadow = format!(
        "tokenizer = {:?}\nlocal_ids = \"shadow\"\nbalance = \"cache_aware\"\n[pools.prefill.kv_events]\nport = 9\n",
        model.path().display().to_string()
    );
    let config = format!(
        "{}\n[pools.spare]\ndiscover = \"engines.test:8000\"\n",
        pd_config(&p, &d, "").replacen("\n\n[pools.decode]", &format!("\n{shadow}\n[pools.decode]"), 1)
    );
    let dns = Settings { upstream_extra: "dns_server = \"127.0.0.1:9\"\n".into(), ..Settings::default() };
    let proxy = TokenOnce::start_with(&config, &dns).await;
    proxy.wait_ready(200).await;
    let sent = send_traffic(&proxy, &p).await;
    // The shadow checks run off the request path: wait (bounded) for the verifier's counts.
    proxy
        .metric_reaches(r#"tokenonce_local_ids_checks_total{pool="prefill",result="mismatch",shape="chat"}"#, 1.0)
        .await;
    // The traffic is counted as sent.
    let (text, scrape) = scrape_counted(&proxy, &sent).await;
    let names = scrape.sample_names();
    assert_eq!(scrape.sum("tokenonce_token_reuse_total", &[("route", "pd"), ("result", "applied")]), 4.0);
    assert_eq!(scrape.sum("tokenonce_token_reuse_total", &[("reason", "n_gt_1"), ("result", "fallback")]), 1.0);
    assert_eq!(scrape.sum("tokenonce_upstream_errors_total", &[("stage", "prefill"), ("kind", "status_5xx")]), 1.0);
    assert_eq!(scrape.sum("tokenonce_requests_total", &[("route", "pd"), ("outcome", "client_error")]), 1.0);
    assert_eq!(scrape.sum("tokenonce_requests_total", &[("route", "pd"), ("outcome", "server_error")]), 1.0);
    assert_eq!(scrape.sum("tokenonce_ready", &[]), 1.0);
    assert!(scrape.sum("tokenonce_reused_prompt_tokens_total", &[("route", "pd")]) > 0.0);

    // The dashboard: shape, datasource variable, route variable.
    let dash = dashboard();
    assert!(dash["schemaVersion"].as_u64().is_some_and(|v| (36..=41).contains(&v)), "schemaVersion ~39");
    let vars = dash["templating"]["list"].as_array().expect("templating.list");
    let var = |name: &str| vars.iter().find(|v| v["name"] == name).unwrap_or_else(|| panic!("variable {name}"));
    assert_eq!(var("datasource")["type"], "datasource");
    assert_eq!(var("datasource")["query"], "prometheus");
    assert_eq!(var("route")["definition"], "label_values(tokenonce_requests_total, route)");
    let panels = dashboard_panels(&dash);
    assert!(panels.len() >= 10, "only {} panels", panels.len());
    let mut ids = BTreeSet::new();
    let mut used = BTreeMap::<String, String>::new();
    for panel in &panels {
        let title = panel["title"].as_str().expect("panel title");
        assert!(ids.insert(panel["id"].as_u64().expect("panel id")), "{title}: duplicate id");
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}: datasource must be the variable");
        let targets = panel["targets"].as_array().filter(|t| !t.is_empty());
        for target in targets.unwrap_or_else(|| panic!("{title}: no targets")) {
            assert_eq!(target["datasource"]["uid"], "${datasource}", "{title}");
            let expr = target["expr"].as_str().filter(|e| !e.trim().is_empty());
            let expr = expr.unwrap_or_else(|| panic!("{title}: a target without expr"));
            let tokens = metric_tokens(expr);
            assert!(!tokens.is_empty(), "{title}: {expr} names no tokenonce metric");
            for t in tokens {
                used.entry(t).or_insert_with(|| format!("panel {title:?}"));
            }
        }
    }
    for v in vars {
        for t in metric_tokens(v["definition"].as_str().unwrap_or_default()) {
            used.entry(t).or_insert_with(|| format!("variable {}", v["name"]));
        }
    }
    for (alert, expr) in alert_rules() {
        for t in metric_tokens(&expr) {
            used.entry(t).or_insert_with(|| format!("alert {alert}"));
        }
    }

    // Every metric named there is a series of the scrape (histograms only through their
    // _bucket/_sum/_count series, which is all PromQL can read).
    for (metric, whence) in &used {
        assert!(names.contains(metric.as_str()), "{whence} uses {metric}, which /metrics does not have:\n{text}");
        let family = scrape.family_of(metric);
        assert!(scrape.types.contains_key(family), "{whence}: {metric} has no # TYPE");
    }
    // ... and every exported family is on the dashboard.
    let shown: BTreeSet<&str> = used.keys().map(|m| scrape.family_of(m)).collect();
    for family in scrape.types.keys().filter(|f| !is_process_family(f)) {
        assert!(shown.contains(family.as_str()), "{family} is exported but no dashboard panel shows it");
    }
    for family in ["process_cpu_seconds_total", "process_resident_memory_bytes"] {
        assert!(shown.contains(family), "no dashboard panel shows {family}");
    }

    // Naming conventions.
    for (family, kind) in &scrape.types {
        assert!(family.starts_with("tokenonce_") || is_process_family(family), "{family}: prefix");
        assert!(family.chars().all(|c| c.is_ascii_lowercase() || c == '_'), "{family}: snake_case");
        assert!(scrape.helps.get(family).is_some_and(|h| !h.trim().is_empty()), "{family}: no HELP");
        match kind.as_str() {
            "counter" => assert!(family.ends_with("_total"), "counter {family} must end in _total"),
            // A histogram names its unit (Prometheus's base units: seconds; or prompt tokens).
            "histogram" => assert!(
                family.ends_with("_seconds") || family.ends_with("_tokens"),
                "histogram {family} must end in its unit, _seconds or _tokens"
            ),
            "gauge" => assert!(!family.ends_with("_total"), "gauge {family} must not end in _total"),
            other => panic!("{family}: unexpected type {other}"),
        }
    }
    // Latency buckets span 1 ms to 6 h (the longest deadline the config allows).
    let les: BTreeSet<&str> = scrape
        .samples
        .iter()
        .filter(|s| s.name == "tokenonce_time_to_first_byte_seconds_bucket")
        .filter_map(|s| s.label("le"))
        .collect();
    for le in ["0.001", "120", "1800", "21600", "+Inf"] {
        assert!(les.contains(le), "ttfb buckets lack le={le}: {les:?}");
    }
    // promtool's own lint of the exposition agrees.
    let mut lint = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package `prometheus`, installed by .ci/setup)");
    std::io::Write::write_all(&mut lint.stdin.take().unwrap(), text.as_bytes()).unwrap();
    assert_success("promtool check metrics", &lint.wait_with_output().unwrap());

    // Bounded labels: route names from config, fixed enums; no client path or model string.
    let fixed: &[(&str, &[&str])] = &[
        ("route", &["pd", "default"]),
        ("api", &["chat", "completions", "responses", "messages", "generate", "other"]),
        ("mode", &["orchestrate", "relay", "passthrough"]),
        ("outcome", &["success", "client_error", "server_error", "client_closed"]),
        (
            "stage",
            &[
                "prefill",
                "handoff",
                "decode_first_byte",
                "decode_total",
                "decode",
                "passthrough",
                // timeouts_total
                "connect",
                "first_byte",
                "stream_idle",
                "client_write",
                "release",
            ],
        ),
        ("pool", &["prefill", "decode", "spare"]),
    ];
    for s in &scrape.samples {
        for (k, v) in &s.labels {
            assert!(!v.contains('/') && !v.contains('?'), "{}: raw path in label {k}={v:?}", s.name);
            assert!(!v.contains("no-such-model") && !v.contains("tiny-qwen3"), "{}: model in label {k}={v:?}", s.name);
            if let Some((_, allowed)) = fixed.iter().find(|(key, _)| key == k) {
                assert!(allowed.contains(&v.as_str()), "{}: unexpected {k}={v:?}", s.name);
            }
        }
    }
}

/// The latency the client felt and each endpoint's errors, read from a live scrape: a decode
/// streaming 4 content events 50 ms apart (after a role event with empty content) gives one
/// time to first token, at least 50 ms after the request and after the response head, and 3 inter-token gaps; a streamed completion of 3 tokens 2 gaps under its own `api`; a
/// non-streamed answer one more time to first token and no gap. A prefill endpoint answering
/// 503 and a decode stream broken after its head count against their endpoints, and a reload
/// that removes an endpoint takes its series away. The standard process metrics are there,
/// and every latency histogram's top bucket reaches the longest deadline the config allows.
#[tokio::test(flavor = "multi_thread")]
async fn latency_endpoint_error_and_process_metrics_from_a_live_scrape() {
    let decode = FakeConfig { chunk_delay: Duration::from_millis(50), ..FakeConfig::default() };
    let (p, d, proxy) = pd_setup(FakeConfig::default(), decode, "").await;
    proxy.wait_ready(200).await;
    let chat = format!("{}/v1/chat/completions", proxy.url);
    let count = |family: &str, api: &str| format!(r#"{family}_count{{api="{api}",mode="orchestrate",route="pd"}}"#);
    let ttft = "tokenonce_time_to_first_token_seconds";
    let itl = "tokenonce_inter_token_latency_seconds";
    let streamed = |n: u32| json!({"stream": true, "stream_options": {"include_usage": true}, "max_tokens": n});

    let (status, _, text) = post_json(&chat, &chat_body("Stream four", streamed(4)), &[]).await;
    assert_eq!(status, 200, "{text}");
    let tokens = |key: &str| text.matches(&format!("\"delta\":{{\"{key}\":\"t")).count();
    assert_eq!(tokens("content") + tokens("reasoning"), 4, "4 content events: {text}");
    proxy.assert_reaches(&count(ttft, "chat"), 1.0).await;
    let scrape = Scrape::parse(&proxy.metrics().await);
    let chat_pd = [("route", "pd"), ("api", "chat")];
    assert_eq!(scrape.sum(&format!("{itl}_count"), &chat_pd), 3.0, "N content events, N - 1 gaps");
    let gaps = scrape.sum(&format!("{itl}_sum"), &chat_pd);
    // 150 ms between the first and the last at the engine; a loaded machine may read two
    // events at once (then 0 apart), so only one whole delay is certain.
    assert!(gaps >= 0.05, "3 gaps, 50 ms each at the engine: {gaps}");
    let first_token = scrape.sum(&format!("{ttft}_sum"), &chat_pd);
    let first_byte = scrape.sum("tokenonce_time_to_first_byte_seconds_sum", &chat_pd);
    // The engine waits 50 ms after its role event, so the first token comes at least 50 ms
    // after the request; the head's time is tokenonce's own write, which a loaded machine
    // can delay by a few ms, so it only orders the two.
    assert!(
        first_token >= 0.05 && first_token > first_byte,
        "the head, then the role event, then 50 ms on the first token: {first_token} s vs head {first_byte} s"
    );

    let cmpl = format!("{}/v1/completions", proxy.url);
    let body = with_extra(json!({"model": "tiny-qwen3", "prompt": "Count"}), streamed(3));
    let (status, _, text) = post_json(&cmpl, &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    proxy.assert_reaches(&count(ttft, "completions"), 1.0).await;
    assert_eq!(proxy.metric(&count(itl, "completions")).await, 2.0);

    let (status, _, text) = post_json(&chat, &chat_body("Not streamed", json!({})), &[]).await;
    assert_eq!(status, 200, "{text}");
    proxy.assert_reaches(&count(ttft, "chat"), 2.0).await;
    assert_eq!(proxy.metric(&count(itl, "chat")).await, 3.0, "a non-streamed answer has no gaps");

    // Errors by pool and endpoint: a 5xx head, a stream broken after its head.
    let errors = |pool: &str, endpoint: &str, kind: &str| {
        format!(r#"tokenonce_endpoint_errors_total{{endpoint="{endpoint}",kind="{kind}",pool="{pool}"}}"#)
    };
    assert_eq!(proxy.metric(&errors("prefill", &p.host_port(), "status_5xx")).await, 0.0);
    p.configure(|c| c.fail_with = Some((503, r#"{"error":"overloaded"}"#.into())));
    let (status, _, text) = post_json(&chat, &chat_body("Prefill down", json!({})), &[]).await;
    p.configure(|c| c.fail_with = None);
    assert_eq!(status, 503, "{text}");
    proxy.assert_reaches(&errors("prefill", &p.host_port(), "status_5xx"), 1.0).await;
    d.configure(|c| c.break_stream_after = Some(3));
    let (status, _, text) = post_json(&chat, &chat_body("Break it", streamed(4)), &[]).await;
    d.configure(|c| c.break_stream_after = None);
    assert_eq!(status, 200, "the head went out before the break: {text}");
    proxy.assert_reaches(&errors("decode", &d.host_port(), "stream_broken"), 1.0).await;
    assert_eq!(proxy.metric(&errors("decode", &d.host_port(), "status_5xx")).await, 0.0);

    // The standard process metrics.
    let scrape = Scrape::parse(&proxy.metrics().await);
    assert_eq!(scrape.types.get("process_cpu_seconds_total").map(String::as_str), Some("counter"));
    assert!(scrape.sum("process_cpu_seconds_total", &[]) > 0.0);
    assert!(scrape.sum("process_resident_memory_bytes", &[]) > 1e6, "resident memory in bytes");

    // Every latency histogram reaches the longest deadline the config allows (a whole
    // answer: 6 h; a gap within a stream: the longest idle timeout, 1 h).
    let top_bucket = |family: &str| {
        let les = scrape.samples.iter().filter(|s| s.name == format!("{family}_bucket"));
        les.filter_map(|s| s.label("le")?.parse::<f64>().ok()).filter(|le| le.is_finite()).fold(0.0, f64::max)
    };
    let secs = |ms: u64| Duration::from_millis(ms).as_secs_f64();
    for family in [
        "tokenonce_request_duration_seconds",
        "tokenonce_time_to_first_byte_seconds",
        ttft,
        "tokenonce_stage_duration_seconds",
    ] {
        assert!(top_bucket(family) >= secs(tokenonce::config::MAX_ANSWER_MS), "{family}: {}", top_bucket(family));
    }
    assert!(top_bucket(itl) >= secs(tokenonce::config::MAX_LEG_MS), "{itl}: {}", top_bucket(itl));

    // A reload that removes the prefill endpoint takes its error series away.
    let p2 = FakeVllm::start(FakeConfig::default()).await;
    proxy.reload(&pd_config(&p2, &d, "")).await;
    let text = proxy.metrics().await;
    let endpoint_series = |e: &str| {
        text.lines()
            .filter(|l| l.starts_with("tokenonce_endpoint_errors_total{") && l.contains(&format!("endpoint=\"{e}\"")))
            .count()
    };
    assert_eq!(endpoint_series(&p.host_port()), 0, "{text}");
    assert_eq!(
        endpoint_series(&p2.host_port()),
        tokenonce::metrics::ErrorKind::ALL.len(),
        "every kind of the new endpoint, at 0"
    );
    assert!(endpoint_series(&d.host_port()) > 0, "the decode endpoint stays");
}

// ---------------------------------------------------------------------------------------------
// b. Real Prometheus
// ---------------------------------------------------------------------------------------------

/// A `prometheus` server process; killed on drop.
struct Prometheus {
    child: Child,
    url: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts Debian's `prometheus` on loopback port 0 with conf/prometheus/prometheus.yml
    /// adapted to scrape `target` (host:port) and evaluate the alert rules every second.
    /// Waits until `/-/ready` (bounded: 20 s).
    async fn start(target: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut config: Yaml =
            serde_yaml_ng::from_str(&read_repo("conf/prometheus/prometheus.yml")).expect("prometheus.yml is YAML");
        config["global"]["scrape_interval"] = Yaml::from("1s");
        config["global"]["evaluation_interval"] = Yaml::from("1s");
        let rules = config["rule_files"].as_sequence().expect("rule_files").clone();
        config["rule_files"] = Yaml::Sequence(
            rules
                .iter()
                .map(|r| Yaml::from(path_str(&repo("conf/prometheus").join(r.as_str().expect("rule file")))))
                .collect(),
        );
        let job = config["scrape_configs"]
            .as_sequence_mut()
            .and_then(|jobs| jobs.iter_mut().find(|j| j["job_name"] == "tokenonce"))
            .expect("a scrape job named tokenonce");
        job["static_configs"] = serde_yaml_ng::from_str(&format!("[{{targets: [\"{target}\"]}}]")).unwrap();
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, serde_yaml_ng::to_string(&config).unwrap()).unwrap();

        let log = dir.path().join("prometheus.log");
        let mut command = Command::new("prometheus");
        command
            .arg(format!("--config.file={}", path_str(&config_path)))
            .arg(format!("--storage.tsdb.path={}", path_str(&dir.path().join("data"))))
            // Port 0: the kernel picks; the `Listening on` line (info) says which.
            .arg("--web.listen-address=127.0.0.1:0")
            .arg("--log.level=info");
        let (mut child, listening) = spawn_logged(command, &log, listening_address)
            .expect("Debian's `prometheus` binary is required (apt-get install prometheus; .ci/setup does it)");
        let Ok(Ok(addr)) = tokio::time::timeout(Duration::from_secs(20), listening).await else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("prometheus reported no listen address within 20 s:\n{}", std::fs::read_to_string(&log).unwrap());
        };
        let mut me = Self { child, url: format!("http://{addr}"), log, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = reqwest::get(format!("{}/-/ready", me.url)).await {
                if r.status() == 200 {
                    break;
                }
            }
            if let Ok(Some(status)) = me.child.try_wait() {
                panic!("prometheus exited ({status}):\n{}", me.log_text());
            }
            assert!(Instant::now() < deadline, "prometheus not ready within 20 s:\n{}", me.log_text());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        me
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET an API path; the parsed JSON.
    async fn api(&self, path_and_query: &str) -> Value {
        let resp = reqwest::get(format!("{}{path_and_query}", self.url)).await.unwrap();
        resp.json().await.unwrap()
    }

    /// An instant query (`/api/v1/query`); the whole answer.
    async fn query(&self, promql: &str) -> Value {
        self.api(&format!("/api/v1/query?query={}", urlencode(promql))).await
    }

    /// Polls `promql` until its single value equals `want` (bounded by `deadline`).
    async fn wait_value(&self, promql: &str, want: f64, deadline: Instant) -> Value {
        loop {
            let answer = self.query(promql).await;
            let got = answer["data"]["result"][0]["value"][1].as_str().and_then(|v| v.parse::<f64>().ok());
            if got == Some(want) {
                return answer;
            }
            assert!(
                Instant::now() < deadline,
                "{promql}: got {got:?}, wanted {want}; last answer {answer}\nprometheus log:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// The address of Prometheus's `msg="Listening on" address=127.0.0.1:PORT` log line.
fn listening_address(line: &str) -> Option<std::net::SocketAddr> {
    if !line.contains("msg=\"Listening on\"") {
        return None;
    }
    line.split_whitespace().find_map(|word| word.strip_prefix("address=")).and_then(|a| a.parse().ok())
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Debian's Prometheus scrapes the admin listener every second; after real traffic its query
/// API returns the request and token-reuse counts tokenonce holds, every dashboard expression
/// and variable query evaluates, and every alert rule loads and evaluates without error.
#[tokio::test(flavor = "multi_thread")]
async fn real_prometheus_scrapes_tokenonce_and_answers_queries() {
    let (p, _d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    proxy.wait_ready(200).await;
    let target = proxy.admin.trim_start_matches("http://").to_owned();
    let prom = Prometheus::start(&target).await;
    let sent = send_traffic(&proxy, &p).await;
    scrape_counted(&proxy, &sent).await;

    // Prometheus' sum of every request series equals tokenonce's own.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let own = Scrape::parse(&proxy.metrics().await).sum("tokenonce_requests_total", &[]);
        let answer = prom.query("sum(tokenonce_requests_total)").await;
        let got = answer["data"]["result"][0]["value"][1].as_str().and_then(|v| v.parse::<f64>().ok());
        if got == Some(own) {
            assert!(own >= sent.pd + sent.default);
            break;
        }
        assert!(Instant::now() < deadline, "sum(tokenonce_requests_total): got {got:?}, tokenonce has {own}: {answer}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    prom.wait_value(r#"sum(tokenonce_requests_total{route="pd"})"#, sent.pd, deadline).await;
    let applied = prom.wait_value(r#"tokenonce_token_reuse_total{result="applied"}"#, 4.0, deadline).await;
    let series = &applied["data"]["result"];
    assert_eq!(series.as_array().map(Vec::len), Some(1), "{applied}");
    let metric = &series[0]["metric"];
    assert_eq!(metric["route"], "pd");
    assert_eq!(metric["reason"], "none");
    assert_eq!(metric["job"], "tokenonce");
    assert_eq!(metric["instance"], target.as_str());
    prom.wait_value(r#"sum(tokenonce_token_reuse_total{result="fallback", reason="n_gt_1"})"#, 1.0, deadline).await;
    prom.wait_value(r#"sum(tokenonce_upstream_errors_total{stage="prefill", kind="status_5xx"})"#, 1.0, deadline).await;
    prom.wait_value(r#"up{job="tokenonce"}"#, 1.0, deadline).await;
    prom.wait_value("tokenonce_ready", 1.0, deadline).await;

    // The dashboard's variable queries (Grafana's label_values) as the label API answers them.
    let routes =
        prom.api(&format!("/api/v1/label/route/values?match[]={}", urlencode("tokenonce_requests_total"))).await;
    assert!(routes["data"].as_array().unwrap().contains(&json!("pd")), "{routes}");
    let instances =
        prom.api(&format!("/api/v1/label/instance/values?match[]={}", urlencode("tokenonce_build_info"))).await;
    assert!(instances["data"].as_array().unwrap().contains(&json!(target)), "{instances}");

    // Every panel expression is valid PromQL to this Prometheus (Grafana's variables filled in).
    for (title, expr) in dashboard_exprs(&dashboard()) {
        let promql = expr
            .replace("$__rate_interval", "1m")
            .replace("$__range", "5m")
            .replace("$route", ".*")
            .replace("$instance", ".*");
        let answer = prom.query(&promql).await;
        assert_eq!(answer["status"], "success", "panel {title:?}: {promql}\n{answer}");
    }

    // Every alert rule of alerts.yml is loaded and evaluates cleanly on the real series.
    let want: BTreeSet<String> = alert_rules().into_iter().map(|(name, _)| name).collect();
    loop {
        let rules = prom.api("/api/v1/rules").await;
        let loaded: Vec<&Value> = rules["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .collect();
        let names: BTreeSet<String> = loaded.iter().filter_map(|r| r["name"].as_str().map(str::to_owned)).collect();
        assert_eq!(names, want, "loaded rules differ from alerts.yml");
        let bad: Vec<&&Value> = loaded.iter().filter(|r| r["health"] != "ok").collect();
        if bad.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline && bad.iter().all(|r| r["health"] == "unknown"),
            "rules not healthy: {bad:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The one prefill 503 and the engine 404 stay below every `for:` window: nothing fires.
    let alerts = prom.api("/api/v1/alerts").await;
    let firing: Vec<&Value> =
        alerts["data"]["alerts"].as_array().into_iter().flatten().filter(|a| a["state"] == "firing").collect();
    assert!(firing.is_empty(), "{firing:?}");
}

// ---------------------------------------------------------------------------------------------
// c. promtool on conf/prometheus
// ---------------------------------------------------------------------------------------------

/// `promtool check rules` accepts alerts.yml, `promtool test rules` passes its unit tests (one
/// firing case per alert, a rollout that pages nothing, absent and failing scrapes), and
/// `promtool check config` accepts prometheus.yml; the alerts on prefill errors, reuse
/// fallbacks, decode readiness, capacity evictions and an absent scrape are there.
#[test]
fn promtool_accepts_and_tests_the_alert_rules() {
    assert_success("promtool check rules", &run("promtool", &["check", "rules", "conf/prometheus/alerts.yml"]));
    assert_success("promtool test rules", &run("promtool", &["test", "rules", "conf/prometheus/alerts_test.yml"]));
    assert_success("promtool check config", &run("promtool", &["check", "config", "conf/prometheus/prometheus.yml"]));

    let rules: BTreeMap<String, String> = alert_rules().into_iter().collect();
    for name in [
        "TokenoncePrefillErrorRatioHigh",
        "TokenonceTokenReuseFallbackRatioHigh",
        "TokenonceDecodeNotReady",
        "TokenonceCacheEvictionsByCapacity",
        "TokenonceScrapeAbsent",
    ] {
        assert!(rules.contains_key(name), "alerts.yml lacks {name}");
    }
    assert!(rules["TokenonceDecodeNotReady"].contains("tokenonce_ready == 0"));
    assert!(rules["TokenonceCacheEvictionsByCapacity"].contains(r#"reason="capacity""#));

    // Each alert has a unit test that expects it to fire.
    let tests: Yaml = serde_yaml_ng::from_str(&read_repo("conf/prometheus/alerts_test.yml")).unwrap();
    let mut fired = BTreeSet::new();
    for t in tests["tests"].as_sequence().expect("tests") {
        for case in t["alert_rule_test"].as_sequence().into_iter().flatten() {
            if case["exp_alerts"].as_sequence().is_some_and(|a| !a.is_empty()) {
                fired.insert(case["alertname"].as_str().unwrap().to_owned());
            }
        }
    }
    let names: BTreeSet<String> = rules.keys().cloned().collect();
    assert_eq!(fired, names, "every alert needs a firing case in alerts_test.yml");
}

/// The anchors GitHub gives the headings of a Markdown text: lower case, letters, digits, `-`
/// and `_` kept, spaces made `-`, the rest dropped; a repeated one gets `-1`, `-2`, ...
fn markdown_anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        let Some(title) = line.strip_prefix('#').map(|t| t.trim_start_matches('#')) else { continue };
        if fenced || !title.starts_with(' ') {
            continue;
        }
        let slug: String = title
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let mut anchor = slug.clone();
        let mut n = 0;
        while out.contains(&anchor) {
            n += 1;
            anchor = format!("{slug}-{n}");
        }
        out.insert(anchor);
    }
    out
}

/// A Prometheus duration of whole hours, minutes or seconds (`35m`, `1h30m`), in seconds.
fn prom_seconds(d: &str) -> u64 {
    let (mut total, mut n) = (0, 0);
    for c in d.chars() {
        match c {
            '0'..='9' => n = n * 10 + u64::from(c.to_digit(10).unwrap()),
            'h' | 'm' | 's' => {
                total += n * match c {
                    'h' => 3600,
                    'm' => 60,
                    _ => 1,
                };
                n = 0;
            }
            _ => panic!("duration {d:?}: only h, m and s are read here"),
        }
    }
    total
}

/// Every alert has `annotations.runbook_url` = `docs/operations.md#<its name in lower case>`,
/// and docs/operations.md has that heading (its GitHub anchor), so each alert's link opens its
/// runbook.
#[test]
fn every_alert_links_its_runbook_in_operations_md() {
    let anchors = markdown_anchors(&read_repo("docs/operations.md"));
    assert!(anchors.contains("alerts") && anchors.contains("metrics-admin-listener-metrics"), "{anchors:?}");
    let doc: Yaml = serde_yaml_ng::from_str(&read_repo("conf/prometheus/alerts.yml")).unwrap();
    let mut checked = 0;
    for group in doc["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let Some(name) = rule["alert"].as_str() else { continue };
            let url = rule["annotations"]["runbook_url"].as_str().unwrap_or_else(|| panic!("{name}: no runbook_url"));
            let want = format!("docs/operations.md#{}", name.to_lowercase());
            assert_eq!(url, want, "{name}: runbook_url");
            let anchor = url.split_once('#').unwrap().1;
            assert!(anchors.contains(anchor), "{name}: docs/operations.md has no heading `### {name}` (#{anchor})");
            checked += 1;
        }
    }
    assert!(checked >= 20, "{checked} alerts");
}

/// The readiness alerts do not fire while an engine may still be starting: the critical
/// `TokenonceDecodeNotReady` waits at least the longest startupProbe window
/// (failureThreshold x periodSeconds) of the vLLM containers in conf/k8s, and
/// `TokenonceUpstreamEndpointUnhealthy` counts a never-healthy endpoint only past it.
#[test]
fn readiness_alerts_wait_out_the_engine_start_window_of_the_manifests() {
    fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                yaml_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    yaml_files(&repo("conf/k8s"), &mut files);
    let mut window = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let doc = <Yaml as serde::Deserialize>::deserialize(doc).unwrap();
            let containers = &doc["spec"]["template"]["spec"]["containers"];
            for c in containers.as_sequence().into_iter().flatten() {
                let probe = &c["startupProbe"];
                let is_vllm = c["image"].as_str().is_some_and(|i| i.contains("vllm"));
                if let (true, Some(period), Some(failures)) =
                    (is_vllm, probe["periodSeconds"].as_u64(), probe["failureThreshold"].as_u64())
                {
                    window = window.max(period * failures);
                }
            }
        }
    }
    assert!(window >= 600, "no vLLM startupProbe found in conf/k8s ({files:?})");

    let doc: Yaml = serde_yaml_ng::from_str(&read_repo("conf/prometheus/alerts.yml")).unwrap();
    let rule = |name: &str| {
        doc["groups"]
            .as_sequence()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_sequence().unwrap())
            .find(|r| r["alert"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("alerts.yml lacks {name}"))
            .clone()
    };
    let not_ready = rule("TokenonceDecodeNotReady");
    let wait = prom_seconds(not_ready["for"].as_str().expect("TokenonceDecodeNotReady has a for:"));
    assert!(wait >= window, "TokenonceDecodeNotReady pages after {wait} s, inside the {window} s start window");
    let unhealthy = rule("TokenonceUpstreamEndpointUnhealthy");
    let expr = unhealthy["expr"].as_str().unwrap();
    let offset = expr
        .split("offset ")
        .nth(1)
        .expect("a series-age offset")
        .split(|c: char| c == ')' || c.is_whitespace())
        .next();
    let age = prom_seconds(offset.unwrap()) + prom_seconds(unhealthy["for"].as_str().unwrap());
    assert!(age >= window, "TokenonceUpstreamEndpointUnhealthy counts a new endpoint after {age} s, inside {window} s");
}

/// Text logs written to a file (stderr not a terminal) carry no ANSI colour codes, even with
/// `NO_COLOR` unset: a log collector or `2> tokenonce.log` would keep them as text.
#[tokio::test]
async fn text_logs_to_a_file_carry_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tokenonce.toml");
    std::fs::write(
        &config,
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nlog_format = \"text\"\n\n\
         [pools.decode]\nendpoints = [\"127.0.0.1:9\"]\n\n[[routes]]\nname = \"d\"\nmode = \"passthrough\"\n\
         decode_pool = \"decode\"\n",
    )
    .unwrap();
    let log = dir.path().join("stderr.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tokenonce"))
        .arg("--config")
        .arg(&config)
        .env_remove("NO_COLOR")
        .env("TOKENONCE_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("tokenonce listening") || Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(text.contains("tokenonce listening"), "no startup line within 15 s:\n{text}");
    assert!(!text.contains("\u{1b}["), "ANSI escapes in a log file:\n{text:?}");
}
