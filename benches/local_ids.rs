//! CPU per request of tokenizing a rendered chat prompt locally (`tokenonce::tokens`), with the
//! real Qwen3 tokenizer the e2e tier installs, at the longest prompt the e2e model allows
//! (~45k tokens of its 49,152): (a) a first turn with a cold segment cache, (b) a follow-up
//! adding ~200 tokens with the cache warm from the first, each against (c) no cache (the
//! whole text encoded, `encode(text, false)` without offsets). Then a 10-turn conversation on
//! one cache: its hit rate and CPU per turn. Then, per model family (Qwen3 and each folder
//! `tests/e2e/families/setup.py` builds under `TOKENONCE_FAMILIES_DIR`), the whole local-ids
//! cost of a 32k-token first request and of its follow-up turn (`local_ids/families.rs`), the
//! requests written for `tests/e2e/families/render_cost.py` (vLLM's CPU for the same ones).
//!
//! Run: `cargo bench --bench local_ids` (after `bash tests/e2e/vllm/setup.sh` installed the
//! model; `TOKENONCE_TOKENIZER=path` names another `tokenizer.json` or model folder; `--runs N`
//! interleaved rounds, default 20; `--families-only` or `--no-families` runs one part;
//! `--family NAME` (repeatable) picks families; `--requests-out PATH` names the requests file,
//! default `target/bench-families/requests.json`). Times are the bench thread's CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`: steadier than wall time on a shared machine; encoding is
//! single-threaded), min / median / p90 in ms. Every id list is checked against the uncached
//! one outside the timing. Timings are printed, never asserted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

#[path = "common/mod.rs"]
mod common;
#[path = "local_ids/families.rs"]
mod families;

use std::time::{Duration, Instant};

use tokenonce::tokens::{SegmentCache, Segmenter};

/// Tokens of the first turn's prompt: the e2e model's 49,152 less room for a follow-up and an
/// answer.
const TARGET_TOKENS: usize = 45_000;
/// Tokens a follow-up adds (the assistant's answer and the next user message).
const FOLLOW_UP_TOKENS: usize = 200;
/// Turns of the hit-rate sequence.
const TURNS: usize = 10;
/// Bounds the whole run whatever `--runs` says.
const MAX_SECONDS: u64 = 240;

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The whole process's CPU time (every thread).
fn process_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Whether a command-line flag is given.
fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

/// The value after each `name` on the command line.
fn values(name: &str) -> Vec<String> {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2).filter(|w| w[0] == name).map(|w| w[1].clone()).collect()
}

/// Whether the family `name` is measured (`--family` names some, else all).
fn picked(name: &str) -> bool {
    let picked = values("--family");
    picked.is_empty() || picked.iter().any(|p| p == name)
}

/// CPU time of `f`, and its value.
fn cpu<T>(f: impl FnOnce() -> T) -> (Duration, T) {
    let t = thread_cpu();
    let v = f();
    (thread_cpu() - t, v)
}

// === a realistic conversation ===

/// xorshift64*: the same conversation every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[(self.next() % items.len() as u64) as usize]
    }
}

const PROSE: &[&str] = &[
    "The decode engine reads the prompt ids the prefill echoed, so the prompt is rendered and tokenized once.",
    "Could you check why the nightly job failed after the dependency upgrade?",
    "I looked at the logs: the connection pool ran out of slots at 02:14 UTC, right when the backup started.",
    "Let's compare the p50 and p99 latencies before and after the change; the median barely moved.",
    "Here is the plan: first reproduce it locally, then bisect the commits between v1.8.2 and v1.9.0.",
    "Zürich's café on the corner serves crème brûlée and a naïve espresso, or so the review claims.",
    "The function returns early when the buffer is empty, which hides the error from the caller.",
    "We measured 1,284 requests per second on 16 cores, with 37% of the time spent in JSON parsing.",
    "Note that the retry budget is per route, not per endpoint, so one bad replica can exhaust it.",
    "Summarize the thread in three bullet points and suggest an owner for each follow-up.",
    "Thanks, that works. One more question: does the cache survive a configuration reload?",
    "In short: yes, as long as the tokenizer file did not change; the fingerprint is the same.",
    "日本語のテキストも混ざることがあります。例えば、ユーザーの名前や住所など。",
    "Les journaux montrent une erreur de délai d'attente après trente secondes.",
];

const CODE: &[&str] = &[
    "```rust\nfn handle(req: &Request) -> Result<Response, Error> {\n    let body = req.body().ok_or(Error::Empty)?;\n    Ok(Response::new(parse(body)?))\n}\n```",
    "```python\ndef retry(fn, attempts=3):\n    for i in range(attempts):\n        try:\n            return fn()\n        except TimeoutError:\n            time.sleep(2 ** i)\n```",
    "```json\n{\"route\": \"/v1/chat/completions\", \"p50_ms\": 41.2, \"p99_ms\": 380.5, \"errors\": 3}\n```",
    "| step | before | after |\n|---|---|---|\n| parse | 1.9 ms | 0.4 ms |\n| encode | 38 ms | 0.3 ms |",
    "- [x] reproduce\n- [ ] bisect\n- [ ] write the regression test",
];

const TOOLS: &[&str] = &["search_logs", "get_weather", "read_file", "run_query", "list_pods"];

fn sentences(rng: &mut Rng, n: usize) -> String {
    let mut out = String::new();
    for i in 0..n {
        if i > 0 {
            out.push(if rng.next().is_multiple_of(5) { '\n' } else { ' ' });
        }
        if rng.next().is_multiple_of(6) {
            out.push_str(rng.pick(CODE));
        } else {
            out.push_str(rng.pick(PROSE));
        }
        // A number of its own, so no two messages are alike.
        if rng.next().is_multiple_of(3) {
            out.push_str(&format!(" (ref #{})", rng.next() % 100_000));
        }
    }
    out
}

/// One exchange: a user message, maybe a tool call and its result, an answer.
fn exchange(rng: &mut Rng, messages: &mut Vec<(String, String)>) {
    let n = 2 + (rng.next() % 6) as usize;
    messages.push(("user".into(), sentences(rng, n)));
    if rng.next().is_multiple_of(3) {
        let tool = rng.pick(TOOLS);
        let call = format!(
            "<tool_call>\n{{\"name\": \"{tool}\", \"arguments\": {{\"query\": \"{}\", \"limit\": {}}}}}\n</tool_call>",
            rng.pick(PROSE).split(' ').take(4).collect::<Vec<_>>().join(" "),
            rng.next() % 50
        );
        messages.push(("assistant".into(), call));
        let result = format!(
            "<tool_response>\n{{\"results\": [\"{}\"], \"took_ms\": {}}}\n</tool_response>",
            rng.pick(PROSE),
            rng.next() % 900
        );
        messages.push(("user".into(), result));
    }
    let n = 3 + (rng.next() % 10) as usize;
    messages.push(("assistant".into(), sentences(rng, n)));
}

/// ChatML as Qwen3's template writes it for plain messages, with the generation prompt.
fn render(messages: &[(String, String)]) -> String {
    let mut text = String::new();
    for (role, content) in messages {
        text.push_str("<|im_start|>");
        text.push_str(role);
        text.push('\n');
        text.push_str(content);
        text.push_str("<|im_end|>\n");
    }
    text.push_str("<|im_start|>assistant\n");
    text
}

/// A system prompt and exchanges until the rendering reaches `TARGET_TOKENS`.
fn conversation(tk: &Segmenter) -> Vec<(String, String)> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut messages = vec![("system".to_owned(), format!("You are a careful assistant. {}", sentences(&mut rng, 12)))];
    // Grow by estimate, then by measurement (one encode per check).
    while render(&messages).len() < TARGET_TOKENS * 3 {
        exchange(&mut rng, &mut messages);
    }
    loop {
        let tokens = tk.encode_whole(&render(&messages)).unwrap().len();
        if tokens >= TARGET_TOKENS {
            return messages;
        }
        for _ in 0..(TARGET_TOKENS - tokens) / 400 + 1 {
            exchange(&mut rng, &mut messages);
        }
    }
}

/// An assistant answer and a user message of about `FOLLOW_UP_TOKENS` tokens together.
fn follow_up(tk: &Segmenter, rng: &mut Rng) -> [(String, String); 2] {
    let mut answer = String::new();
    let mut question = String::new();
    loop {
        let pair = [("assistant".to_owned(), answer.clone()), ("user".to_owned(), question.clone())];
        let tokens = tk.encode_whole(&render(&pair)).unwrap().len();
        if tokens >= FOLLOW_UP_TOKENS {
            return pair;
        }
        let s = rng.pick(PROSE);
        if answer.len() <= question.len() * 2 {
            answer.push_str(s);
            answer.push(' ');
        } else {
            question.push_str(s);
            question.push(' ');
        }
    }
}

// === report ===

struct Row {
    name: String,
    tokens: usize,
    times: Vec<Duration>,
}

impl Row {
    fn median(&self) -> Duration {
        let mut t = self.times.clone();
        t.sort();
        t[t.len() / 2]
    }

    fn print(&self) {
        let mut t = self.times.clone();
        t.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let p90 = t[(t.len() * 9 / 10).min(t.len() - 1)];
        println!(
            "| {:<44} | {:>6} | {:>9.3} | {:>9.3} | {:>9.3} |",
            self.name,
            self.tokens,
            ms(t[0]),
            ms(t[t.len() / 2]),
            ms(p90)
        );
    }
}

fn main() {
    let path = common::tokenizer_path();
    if !flag("--families-only") {
        qwen3_segments(&path);
    }
    if !flag("--no-families") {
        families::run(&path, common::runs(20), values("--requests-out").last().map(String::as_str));
    }
}

/// The Qwen3 segment-cache measurements (the first part).
fn qwen3_segments(path: &std::path::Path) {
    if !path.exists() {
        eprintln!(
            "local_ids: no tokenizer at {} (run `bash tests/e2e/vllm/setup.sh`, or set TOKENONCE_TOKENIZER to a tokenizer.json or model folder)",
            path.display()
        );
        std::process::exit(2);
    }
    let (load, tk) = cpu(|| Segmenter::load(path).unwrap());
    println!("tokenizer {} loaded in {:.0} ms CPU, {:?}", path.display(), load.as_secs_f64() * 1e3, tk.splitting());

    let messages = conversation(&tk);
    let first = render(&messages);
    let mut rng = Rng(7);
    let mut grown = messages.clone();
    grown.extend(follow_up(&tk, &mut rng));
    let next = render(&grown);
    let first_ids = tk.encode_whole(&first).unwrap();
    let next_ids = tk.encode_whole(&next).unwrap();
    println!(
        "conversation: {} messages, {} tokens ({} KB); follow-up +2 messages, +{} tokens; {} segments",
        messages.len(),
        first_ids.len(),
        first.len() / 1024,
        next_ids.len() - first_ids.len(),
        tk.split(&next).map_or(0, |p| p.iter().filter(|p| matches!(p, tokenonce::tokens::Piece::Text(_))).count())
    );

    let deadline = Instant::now() + Duration::from_secs(MAX_SECONDS);
    let mut cold = Row { name: "(a) first turn, cold cache".into(), tokens: first_ids.len(), times: vec![] };
    let mut whole_first =
        Row { name: "(c) first turn, no cache (whole text)".into(), tokens: first_ids.len(), times: vec![] };
    let mut warm = Row { name: "(b) follow-up, cache warm from (a)".into(), tokens: next_ids.len(), times: vec![] };
    let mut again =
        Row { name: "(b0) first turn again, every segment cached".into(), tokens: first_ids.len(), times: vec![] };
    let mut whole_next =
        Row { name: "(c) follow-up, no cache (whole text)".into(), tokens: next_ids.len(), times: vec![] };
    let mut cache_bytes = 0;
    // One untimed round first: the tokenizer's own word cache (BPE) and the allocator warm up
    // for every variant alike.
    for round in 0..=common::runs(20) {
        if Instant::now() > deadline {
            break;
        }
        let cache = SegmentCache::new(1 << 30, Duration::from_secs(3600));
        let (a, ids_a) = cpu(|| cache.encode(&tk, &first).unwrap());
        let (b, ids_b) = cpu(|| cache.encode(&tk, &next).unwrap());
        let (b0, ids_b0) = cpu(|| cache.encode(&tk, &first).unwrap());
        let (c1, ids_c1) = cpu(|| tk.encode_whole(&first).unwrap());
        let (c2, ids_c2) = cpu(|| tk.encode_whole(&next).unwrap());
        assert!(ids_a == first_ids && ids_c1 == first_ids && ids_b0 == first_ids, "first turn ids differ");
        assert!(ids_b == next_ids && ids_c2 == next_ids, "follow-up ids differ");
        cache_bytes = cache.stats().bytes;
        if round > 0 {
            cold.times.push(a);
            warm.times.push(b);
            again.times.push(b0);
            whole_first.times.push(c1);
            whole_next.times.push(c2);
        }
    }

    println!("\nCPU per request ({} rounds, interleaved), ms:\n", cold.times.len());
    println!("| {:<44} | {:>6} | {:>9} | {:>9} | {:>9} |", "request", "tokens", "min", "median", "p90");
    println!("|{:-<46}|{:->8}|{:->11}|{:->11}|{:->11}|", "", "", "", "", "");
    for row in [&cold, &whole_first, &warm, &whole_next, &again] {
        row.print();
    }
    let ratio = warm.median().as_secs_f64() / cold.median().as_secs_f64();
    let ratio_whole = warm.median().as_secs_f64() / whole_next.median().as_secs_f64();
    println!(
        "\nfollow-up (b) median: {:.3} ms = {:.2} % of the cold first turn (a), {:.2} % of encoding it whole (c); goals: < 0.5 ms {}, < 5 % {}",
        warm.median().as_secs_f64() * 1e3,
        ratio * 100.0,
        ratio_whole * 100.0,
        if warm.median() < Duration::from_micros(500) { "met" } else { "MISSED" },
        if ratio < 0.05 { "met" } else { "MISSED" },
    );
    // Where (b)'s time goes: cutting the text, and encoding only its new segments (the floor).
    let cache = SegmentCache::new(1 << 30, Duration::from_secs(3600));
    cache.encode(&tk, &first).unwrap();
    let before = cache.stats();
    cache.encode(&tk, &next).unwrap();
    let after = cache.stats();
    let new_segments: Vec<&str> = tk
        .split(&next)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|p| match p {
            tokenonce::tokens::Piece::Text(t) if !first.contains(t) => Some(t),
            _ => None,
        })
        .collect();
    let (mut split_times, mut new_times) = (vec![], vec![]);
    for _ in 0..cold.times.len() {
        split_times.push(cpu(|| tk.split(&next).map(|p| p.len())).0);
        new_times.push(cpu(|| new_segments.iter().map(|t| tk.encode_whole(t).unwrap().len()).sum::<usize>()).0);
    }
    let med = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64() * 1e3
    };
    println!(
        "(b) in parts: {} segments looked up ({} misses, {} new texts of {} bytes); cutting the text {:.3} ms, encoding the new texts alone {:.3} ms (medians)",
        after.hits + after.misses - before.hits - before.misses,
        after.misses - before.misses,
        new_segments.len(),
        new_segments.iter().map(|t| t.len()).sum::<usize>(),
        med(split_times),
        med(new_times)
    );
    println!(
        "cache after (a)+(b): {} KB for {} tokens ({:.1} bytes per token: text, ids and bookkeeping)",
        cache_bytes / 1024,
        next_ids.len(),
        cache_bytes as f64 / next_ids.len() as f64
    );

    // A conversation of TURNS requests on one cache, ending at the prompt above: each turn adds
    // the next exchange (the last one the follow-up).
    let ends: Vec<usize> = (0..grown.len()).filter(|&i| grown[i].0 == "user").map(|i| i + 1).collect();
    let ends = &ends[ends.len().saturating_sub(TURNS)..];
    let cache = SegmentCache::new(1 << 30, Duration::from_secs(3600));
    let mut per_turn = Vec::new();
    for &end in ends {
        let text = render(&grown[..end]);
        let (t, ids) = cpu(|| cache.encode(&tk, &text).unwrap());
        assert_eq!(ids, tk.encode_whole(&text).unwrap(), "turn ids differ");
        per_turn.push((ids.len(), t));
    }
    let s = cache.stats();
    println!(
        "\n{}-turn conversation on one cache ({} to {} tokens): segment hit rate {:.1} % ({} hits, {} misses), {:.1} % of text bytes reused; \
         CPU turn 1 (cold) {:.2} ms, turns 2-{} median {:.3} ms",
        per_turn.len(),
        per_turn.first().map_or(0, |p| p.0),
        per_turn.last().map_or(0, |p| p.0),
        s.hit_rate() * 100.0,
        s.hits,
        s.misses,
        s.reused_share() * 100.0,
        per_turn.first().map_or(0.0, |p| p.1.as_secs_f64() * 1e3),
        per_turn.len(),
        {
            let mut later: Vec<Duration> = per_turn.iter().skip(1).map(|p| p.1).collect();
            later.sort();
            later.get(later.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e3)
        }
    );
}
