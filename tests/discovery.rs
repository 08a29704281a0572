//! Pools discovered by DNS, against a real DNS server: dnsmasq on loopback, answering a name
//! from a hosts file the test rewrites (SIGHUP makes it read the file again), with fake
//! engines on their own loopback addresses (127.0.0.2, 127.0.0.3, ...) sharing one port.
//! Endpoints that appear are probed and then used, one that leaves while a request holds it
//! lets that request finish and gets no new one, one that stays keeps its state (its
//! ejection), ranks expand per address, a DNS server that is down or answers nothing keeps
//! the last set (counted), a pool with no answer yet serves nothing (502) until its name has
//! an address, and a reload carries the discovered endpoints over.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use parking_lot::Mutex;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use support::*;

/// The name the engines are published under (dnsmasq answers `tokenonce.test` itself:
/// NXDOMAIN for a name without an address, never a forward).
const NAME: &str = "engines.tokenonce.test";

/// dnsmasq serving [`NAME`] from a hosts file on a loopback port; killed on drop.
struct Dns {
    child: Child,
    addr: SocketAddr,
    hosts: PathBuf,
    /// Lines dnsmasq logged (it logs each read of the hosts file).
    log: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
}

impl Dns {
    /// Starts dnsmasq answering [`NAME`] with `ips`, on a free port (bounded: 10 tries, each
    /// waiting up to 10 s for it to have read the hosts file).
    async fn start(ips: &[&str]) -> Self {
        let id = |flag: &str| String::from_utf8(Command::new("id").arg(flag).output().unwrap().stdout).unwrap();
        let (user, group) = (id("-un"), id("-gn"));
        for _ in 0..10 {
            let dir = tempfile::tempdir().unwrap();
            let hosts = dir.path().join("hosts");
            write_hosts(&hosts, ips);
            // A port the kernel just gave out and took back: free, unless another test takes it first.
            let port = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let mut child = Command::new("dnsmasq")
                .args(["--no-daemon", "--log-facility=-", "--no-resolv", "--no-hosts", "--bind-interfaces"])
                .args(["--listen-address=127.0.0.1", "--local=/tokenonce.test/", "--pid-file="])
                .arg(format!("--port={port}"))
                .arg(format!("--addn-hosts={}", hosts.display()))
                // Root drops to `nobody` by default, which could not read the test's files.
                .arg(format!("--user={}", user.trim()))
                .arg(format!("--group={}", group.trim()))
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("dnsmasq (Debian's dnsmasq-base, installed by .ci/setup)");
            let log = Arc::new(Mutex::new(Vec::new()));
            let stderr = child.stderr.take().unwrap();
            let lines = Arc::clone(&log);
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    lines.lock().push(line);
                }
            });
            let dns = Self { child, addr: SocketAddr::from(([127, 0, 0, 1], port)), hosts, log, _dir: dir };
            if dns.wait_reads(1).await {
                return dns;
            }
            // Not up (its port taken, most likely): killed on drop; another port.
            eprintln!("dnsmasq did not come up: {:?}", dns.log.lock());
        }
        panic!("dnsmasq did not start");
    }

    /// Waits (bounded: 10 s) until dnsmasq has read its hosts file `n` times; false if not.
    async fn wait_reads(&self, n: usize) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        let hosts = self.hosts.display().to_string();
        while Instant::now() < deadline {
            let reads = self.log.lock().iter().filter(|l| l.contains("read ") && l.contains(&hosts)).count();
            if reads >= n {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// Publishes `ips` under [`NAME`] (none: the name has no address) and waits until dnsmasq
    /// read them.
    async fn publish(&self, ips: &[&str]) {
        let before = self.log.lock().iter().filter(|l| l.contains("read ")).count();
        write_hosts(&self.hosts, ips);
        let status = Command::new("kill").arg("-HUP").arg(self.child.id().to_string()).status().unwrap();
        assert!(status.success());
        assert!(self.wait_reads(before + 1).await, "dnsmasq did not read its hosts file again");
    }

    /// Stops the server: lookups fail from now on.
    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.stop();
    }
}

fn write_hosts(path: &std::path::Path, ips: &[&str]) {
    let text: String = ips.iter().map(|ip| format!("{ip} {NAME}\n")).collect();
    std::fs::write(path, text).unwrap();
}

/// Fake engines on `ips`, all on one port (bounded: 20 tries at finding a port free on every
/// address).
async fn engines<const N: usize>(ips: [&str; N], config: FakeConfig) -> (u16, [FakeVllm; N]) {
    for _ in 0..20 {
        let first: SocketAddr = format!("{}:0", ips[0]).parse().unwrap();
        let Some(head) = FakeVllm::start_at(first, config.clone()).await else { continue };
        let port: u16 = head.host_port().rsplit_once(':').unwrap().1.parse().unwrap();
        let mut all = vec![head];
        for ip in &ips[1..] {
            let at = SocketAddr::new(ip.parse::<IpAddr>().unwrap(), port);
            match FakeVllm::start_at(at, config.clone()).await {
                Some(e) => all.push(e),
                None => break,
            }
        }
        if all.len() == N {
            return (port, all.try_into().ok().unwrap());
        }
    }
    panic!("no port free on every engine address");
}

/// A prefill pool discovered from [`NAME`] (`discover` as given, looked up every 100 ms)
/// and a static decode pool of `decode`, on orchestrate route `pd`; `pool_extra` goes in the
/// prefill pool.
fn config(discover: &str, decode: &FakeVllm, pool_extra: &str) -> String {
    format!(
        "[pools.prefill]\ndiscover = \"{discover}\"\ndiscover_interval_ms = 100\n{pool_extra}\n[pools.decode]\nendpoints = [\"{}\"]\n\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n[routes.match]\npaths = [\"/v1/chat/completions\"]\n",
        decode.host_port()
    )
}

/// tokenonce asking `dns` (with `upstream_extra` more `[upstream]` lines).
async fn proxy(dns: &Dns, text: &str, upstream_extra: &str) -> TokenOnce {
    let settings =
        Settings { upstream_extra: format!("dns_server = \"{}\"\n{upstream_extra}", dns.addr), ..Settings::default() };
    TokenOnce::start_with(text, &settings).await
}

const ENDPOINTS: &str = r#"tokenonce_pool_endpoints{pool="prefill"}"#;
const EJECTED: &str = r#"tokenonce_upstream_ejected{pool="prefill"}"#;

fn lookups(result: &str) -> String {
    format!(r#"tokenonce_discovery_lookups_total{{pool="prefill",result="{result}"}}"#)
}

/// The endpoints of pool `prefill` the scrape reports a health gauge for.
async fn reported(proxy: &TokenOnce) -> Vec<String> {
    let text = proxy.metrics().await;
    let mut names: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with("tokenonce_upstream_healthy{") && l.contains(r#"pool="prefill""#))
        .filter_map(|l| l.split("endpoint=\"").nth(1)?.split('"').next().map(str::to_owned))
        .collect();
    names.sort();
    names
}

/// Waits (bounded: 10 s) until the pool's reported endpoints are `want`.
async fn wait_members(proxy: &TokenOnce, want: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut want = want.to_vec();
    want.sort();
    loop {
        let got = reported(proxy).await;
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "members {got:?}, wanted {want:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Endpoints appear and are probed, then used; one leaves while its prefill is in flight
/// (that request completes, new ones avoid it); one that stays keeps its ejection while the
/// set around it changes.
#[tokio::test(flavor = "multi_thread")]
async fn members_follow_the_name_and_those_that_stay_keep_their_state() {
    let (port, [a, b, c]) = engines(["127.0.0.2", "127.0.0.3", "127.0.0.4"], FakeConfig::default()).await;
    let decode = FakeVllm::start(FakeConfig::default()).await;
    let dns = Dns::start(&["127.0.0.2"]).await;
    let extra = "eject_after_failures = 1\neject_base_ms = 120000\n";
    let proxy = proxy(&dns, &config(&format!("{NAME}:{port}"), &decode, ""), extra).await;
    let (ea, eb, ec) = (a.host_port(), b.host_port(), c.host_port());

    // Appears, probed, used.
    proxy.wait_health("prefill", &ea, true).await;
    assert_eq!(proxy.metric(ENDPOINTS).await, 1.0);
    assert_eq!(proxy.chat("Hello there!").await.0, 200);
    assert_eq!(a.posts().len(), 1);

    // A slow prefill holds `a` while `a` leaves the name and `b`, `c` join.
    a.configure(|f| f.delay = Duration::from_secs(4));
    let held = {
        let url = format!("{}/v1/chat/completions", proxy.url);
        tokio::spawn(async move { post_json(&url, &chat_body("Hold on", json!({})), &[]).await })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.posts().len() < 2 {
        assert!(Instant::now() < deadline, "the held prefill never reached a");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    dns.publish(&["127.0.0.3", "127.0.0.4"]).await;
    wait_members(&proxy, &[eb.clone(), ec.clone()]).await;
    assert!(!held.is_finished(), "precondition: the held prefill is still in flight when its endpoint leaves");
    proxy.wait_health("prefill", &eb, true).await;
    proxy.wait_health("prefill", &ec, true).await;
    for _ in 0..4 {
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
    }
    let (status, _, text) = held.await.unwrap();
    assert_eq!(status, 200, "the request holding the leaver finished: {text}");
    assert_eq!(a.posts().len(), 2, "no new request went to the leaver");
    assert!(!b.posts().is_empty() && !c.posts().is_empty(), "both newcomers served");

    // `b` fails once and is ejected; the set changes around it and its ejection stays.
    b.configure(|f| f.fail_with = Some((503, "{\"error\":\"engine\"}".into())));
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.metric(EJECTED).await < 1.0 {
        assert!(Instant::now() < deadline, "b was never ejected");
        assert_eq!(proxy.chat("Hello there!").await.0, 200, "a failed prefill fails over to c");
    }
    b.configure(|f| f.fail_with = None);
    dns.publish(&["127.0.0.2", "127.0.0.3", "127.0.0.4"]).await;
    wait_members(&proxy, &[ea.clone(), eb.clone(), ec.clone()]).await;
    assert_eq!(proxy.metric(ENDPOINTS).await, 3.0);
    assert_eq!(proxy.metric(EJECTED).await, 1.0, "b stayed in the name and kept its ejection");
    let before = b.posts().len();
    a.configure(|f| f.delay = Duration::ZERO);
    proxy.wait_health("prefill", &ea, true).await;
    for _ in 0..4 {
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
    }
    assert_eq!(b.posts().len(), before, "an ejected endpoint that stays is still skipped");
}

/// The name answering nothing, then the DNS server gone: each lookup is counted by its
/// result and the pool keeps serving on its last set.
#[tokio::test(flavor = "multi_thread")]
async fn a_dns_failure_or_an_empty_answer_keeps_the_last_set() {
    let (port, [a]) = engines(["127.0.0.2"], FakeConfig::default()).await;
    let decode = FakeVllm::start(FakeConfig::default()).await;
    let mut dns = Dns::start(&["127.0.0.2"]).await;
    let proxy = proxy(&dns, &config(&format!("{NAME}:{port}"), &decode, ""), "").await;
    proxy.wait_health("prefill", &a.host_port(), true).await;

    dns.publish(&[]).await;
    assert!(proxy.metric_reaches_within(&lookups("empty"), 1.0, Duration::from_secs(10)).await >= 1.0);
    assert_eq!(proxy.metric(ENDPOINTS).await, 1.0, "an empty answer keeps the last set");
    assert_eq!(proxy.chat("Hello there!").await.0, 200);

    dns.stop();
    let deadline = Instant::now() + Duration::from_secs(15);
    while proxy.metric(&lookups("failed")).await < 1.0 {
        assert!(Instant::now() < deadline, "no failed lookup counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(reported(&proxy).await, vec![a.host_port()], "a DNS outage keeps the last set");
    assert_eq!(proxy.chat("Hello there!").await.0, 200);
    assert!(proxy.metric(&lookups("ok")).await >= 1.0);
}

/// A discovered pool whose name has had no address since the start has no endpoint: its
/// prefills answer 502 `prefill_unavailable` (no internal address in the message) until the
/// name gets one, which the next lookup brings in.
#[tokio::test(flavor = "multi_thread")]
async fn a_pool_with_no_answer_yet_serves_nothing_until_its_name_has_an_address() {
    let (port, [a]) = engines(["127.0.0.2"], FakeConfig::default()).await;
    let decode = FakeVllm::start(FakeConfig::default()).await;
    let dns = Dns::start(&[]).await;
    let proxy = proxy(&dns, &config(&format!("{NAME}:{port}"), &decode, ""), "").await;
    assert!(proxy.metric_reaches_within(&lookups("empty"), 1.0, Duration::from_secs(10)).await >= 1.0);
    assert_eq!(proxy.metric(ENDPOINTS).await, 0.0);
    let (status, text) = proxy.chat("Hello there!").await;
    assert_eq!(status, 502, "{text}");
    assert_openai_error(&text, "prefill_unavailable");
    assert!(!text.contains("127.0.0."), "no internal address reaches the client: {text}");
    assert!(decode.posts().is_empty(), "no decode without a prefill");

    dns.publish(&["127.0.0.2"]).await;
    proxy.wait_health("prefill", &a.host_port(), true).await;
    assert_eq!(proxy.chat("Hello there!").await.0, 200);
    assert_eq!(a.posts().len(), 1);
}

/// `name:port#0-1` makes two endpoints of each address, each leg naming its rank; with the
/// DNS server gone, reloads (one leaving the pool as it was, one changing its balance) keep
/// the discovered endpoints.
#[tokio::test(flavor = "multi_thread")]
async fn ranks_expand_per_address_and_a_reload_keeps_the_discovered_set() {
    let ranked = FakeConfig { dp_size: 2, ..FakeConfig::default() };
    let (port, [a, b]) = engines(["127.0.0.2", "127.0.0.3"], ranked).await;
    let decode = FakeVllm::start(FakeConfig::default()).await;
    let mut dns = Dns::start(&["127.0.0.2", "127.0.0.3"]).await;
    let text = config(&format!("{NAME}:{port}#0-1"), &decode, "");
    let proxy = proxy(&dns, &text, "").await;
    let names: Vec<String> =
        [&a, &b].iter().flat_map(|e| (0..2).map(move |r| format!("{}#{r}", e.host_port()))).collect();
    wait_members(&proxy, &names).await;
    for name in &names {
        proxy.wait_health("prefill", name, true).await;
    }
    for _ in 0..8 {
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
    }
    for engine in [&a, &b] {
        let mut ranks: Vec<String> = engine
            .posts()
            .iter()
            .filter_map(|r| r.headers.get("x-data-parallel-rank").map(|v| v.to_str().unwrap().to_owned()))
            .collect();
        ranks.sort();
        ranks.dedup();
        assert_eq!(ranks, ["0", "1"], "each rank of {} served", engine.host_port());
    }

    dns.stop();
    proxy.reload(&format!("{text}\n[pools.spare]\nendpoints = [\"{}\"]\n", decode.host_port())).await;
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(reported(&proxy).await, sorted, "an unchanged pool keeps its members");
    proxy.reload(&config(&format!("{NAME}:{port}#0-1"), &decode, "balance = \"least_in_flight\"\n")).await;
    assert_eq!(proxy.metric(ENDPOINTS).await, 4.0, "a rebuilt pool starts from its predecessor's addresses");
    for _ in 0..4 {
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
    }
}
