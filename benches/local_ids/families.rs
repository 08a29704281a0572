//! CPU per request of local ids per model family, as production computes them
//! (`LocalIds::render` then `LocalIds::encode`: the chat template and the pool's segment cache,
//! Harmony's and Mistral's renderers straight to ids), for (a) a long first request, a
//! multi-turn conversation grown to `TARGET_TOKENS` in the family's own tokenizer, on a cold
//! segment cache (the pool having served one other conversation, as a running pool has), and
//! (b) its follow-up turn (an answer and a new question) on the cache (a) warmed.
//! The requests and their ids go to a JSON file that `tests/e2e/families/render_cost.py`
//! sends to vLLM's render server, which measures vLLM's CPU for the same requests and checks
//! vLLM's ids equal these.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokenonce::config::LocalIdsMode;
use tokenonce::local::{LocalIds, Policy};
use tokenonce::openai::Api;
use tokenonce::parity::Tokenizer;
use tokenonce::render::{ChatTemplate, LoadOptions, Mistral};

use super::{cpu, exchange, process_cpu, sentences, Rng, PROSE};

/// Tokens of every family's first request: a long conversation most of these models serve
/// (Phi-3.5's and Gemma 3's contexts included), the same for each family.
pub const TARGET_TOKENS: usize = 32_000;
/// Bounds the family rounds whatever `--runs` says.
const MAX_SECONDS: u64 = 300;
/// The families' folders (`tests/e2e/families/setup.py`), unless `TOKENONCE_FAMILIES_DIR`.
const FAMILIES_ENV: &str = "TOKENONCE_FAMILIES_DIR";
/// The family folders, in report order; Qwen3 is the e2e tier's `tiny-qwen3`.
const FAMILIES: [&str; 6] = ["llama3_1", "gemma3", "deepseek_v3", "phi3_5", "mistral", "gptoss"];
/// Where the requests and their ids are written unless `--requests-out PATH`.
const REQUESTS_OUT: &str = "target/bench-families/requests.json";

/// One family: its folder and what builds a fresh pool renderer (a cold segment cache).
struct Family {
    name: String,
    folder: PathBuf,
    renderer: Renderer,
}

enum Renderer {
    Template { template: Arc<ChatTemplate>, tokenizer: Arc<Tokenizer> },
    Mistral(Arc<Mistral>),
}

impl Family {
    /// Loads the folder as a pool with `tokenizer` set to it does (`config/resources.rs`):
    /// Mistral's renderer for a tekken folder, else its chat template (Harmony for gpt-oss).
    fn load(name: &str, folder: &Path) -> Result<Self, String> {
        let options = LoadOptions::default();
        let pool_tokenizer = Tokenizer::load(folder)?;
        let renderer = match Mistral::for_folder(folder, &options, pool_tokenizer.tekken()) {
            Some(mistral) => Renderer::Mistral(Arc::new(mistral.map_err(|e| e.to_string())?)),
            None => {
                let template = ChatTemplate::load(folder, options).map_err(|e| e.to_string())?;
                Renderer::Template { template: Arc::new(template), tokenizer: Arc::new(pool_tokenizer) }
            }
        };
        Ok(Self { name: name.to_owned(), folder: folder.to_path_buf(), renderer })
    }

    /// A pool's renderer as a config load builds it: an empty segment cache.
    fn fresh(&self) -> LocalIds {
        let policy = Policy { mode: LocalIdsMode::Shadow, verify_after: 1, recheck: 0.0 };
        match &self.renderer {
            Renderer::Template { template, tokenizer } => {
                LocalIds::new(&self.name, Arc::clone(template), Arc::clone(tokenizer), policy).unwrap()
            }
            Renderer::Mistral(mistral) => LocalIds::mistral(&self.name, Arc::clone(mistral), policy),
        }
    }

    /// The ids without the segment cache: the template's text encoded whole (a chat
    /// template's family), or the renderer's own (Harmony, Mistral: no cache to bypass).
    fn reference_ids(&self, body: &[u8]) -> Vec<u32> {
        match &self.renderer {
            Renderer::Template { template, tokenizer } if template.harmony().is_none() => {
                let text = tokenonce::render::render_chat(template, body).unwrap().text;
                tokenizer.library().unwrap().encode(text, false).unwrap().get_ids().to_vec()
            }
            _ => self.fresh().ids(Api::Chat, body).unwrap().0,
        }
    }
}

/// The family folders present: `TOKENONCE_FAMILIES_DIR` (default: the e2e venv's), Qwen3
/// from the tokenizer the Qwen3 bench reads.
fn families(qwen3_tokenizer: &Path) -> Vec<Family> {
    let dir = std::env::var_os(FAMILIES_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| qwen3_tokenizer.parent().and_then(Path::parent).unwrap_or(Path::new(".")).join("families"));
    let mut found = Vec::new();
    let qwen3 = if qwen3_tokenizer.is_dir() { qwen3_tokenizer } else { qwen3_tokenizer.parent().unwrap() };
    let named = std::iter::once(("qwen3", qwen3.to_path_buf()))
        .chain(FAMILIES.iter().map(|f| (*f, dir.join(f))))
        .filter(|(name, _)| super::picked(name));
    for (name, folder) in named {
        if !folder.is_dir() {
            println!(
                "{name}: no folder at {} (python3 tests/e2e/families/setup.py builds them), skipped",
                folder.display()
            );
            continue;
        }
        let (load, family) = cpu(|| Family::load(name, &folder));
        match family {
            Ok(family) => {
                println!("{name}: {} loaded in {:.0} ms CPU", folder.display(), load.as_secs_f64() * 1e3);
                found.push(family);
            }
            Err(e) => println!("{name}: {} does not load ({e}), skipped", folder.display()),
        }
    }
    found
}

/// The conversation every family gets, longest first: a system prompt and exchanges (each
/// family takes the shortest prefix reaching `TARGET_TOKENS`), with where each exchange ends.
fn conversation(seed: u64) -> Conversation {
    /// Enough for 32k tokens in the least dense of these tokenizers (~2.6 bytes a token).
    const BYTES: usize = TARGET_TOKENS * 5;
    let mut rng = Rng(seed);
    let mut messages = vec![("system".to_owned(), format!("You are a careful assistant. {}", sentences(&mut rng, 12)))];
    let mut ends = Vec::new();
    while messages.iter().map(|(_, c)| c.len()).sum::<usize>() < BYTES {
        exchange(&mut rng, &mut messages);
        ends.push(messages.len());
    }
    Conversation { messages, ends }
}

/// Messages, and the end of each exchange (one past its answer).
struct Conversation {
    messages: Vec<(String, String)>,
    ends: Vec<usize>,
}

impl Conversation {
    /// The request after `exchanges` exchanges: the last one's answer left for the model.
    fn request(&self, exchanges: usize) -> &[(String, String)] {
        &self.messages[..self.ends[exchanges - 1] - 1]
    }
}

/// The turn a follow-up adds: the answer to the last question and the next question.
fn follow_up() -> [(String, String); 2] {
    let mut rng = Rng(7);
    let answer: Vec<&str> = (0..8).map(|_| rng.pick(PROSE)).collect();
    let question: Vec<&str> = (0..3).map(|_| rng.pick(PROSE)).collect();
    [("assistant".to_owned(), answer.join(" ")), ("user".to_owned(), question.join(" "))]
}

/// The chat body of `messages` (model named as the render server serves it).
fn body(family: &str, messages: &[(String, String)]) -> String {
    let messages: Vec<_> = messages.iter().map(|(role, content)| json!({"role": role, "content": content})).collect();
    json!({"model": family, "messages": messages}).to_string()
}

/// The two requests of one family with their ids and token counts.
struct Requests {
    /// Another conversation of as many exchanges, served first by each fresh pool: its
    /// tokenizer's word cache warm, as a pool's is after earlier conversations.
    other: String,
    other_tokens: usize,
    other_messages: usize,
    first: String,
    follow_up: String,
    first_ids: Vec<u32>,
    follow_up_ids: Vec<u32>,
    messages: usize,
}

/// The shortest conversation prefix whose rendering reaches `TARGET_TOKENS`, and its
/// follow-up (binary search over whole exchanges, on one renderer whose cache the probes share).
fn requests(family: &Family, all: &Conversation, other: &Conversation) -> Requests {
    let probe = family.fresh();
    let tokens = |n: usize| probe.ids(Api::Chat, body(&family.name, all.request(n)).as_bytes()).unwrap().0.len();
    let (mut lo, mut hi) = (1, all.ends.len());
    assert!(tokens(hi) >= TARGET_TOKENS, "{}: the conversation is too short for {TARGET_TOKENS} tokens", family.name);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if tokens(mid) >= TARGET_TOKENS {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let messages = all.request(lo).to_vec();
    let mut grown = messages.clone();
    grown.extend(follow_up());
    let first = body(&family.name, &messages);
    let follow_up = body(&family.name, &grown);
    let first_ids = family.reference_ids(first.as_bytes());
    let follow_up_ids = family.reference_ids(follow_up.as_bytes());
    let other_messages = other.request(lo.min(other.ends.len()));
    let other = body(&family.name, other_messages);
    let other_tokens = family.reference_ids(other.as_bytes()).len();
    Requests {
        other,
        other_tokens,
        other_messages: other_messages.len(),
        first,
        follow_up,
        first_ids,
        follow_up_ids,
        messages: messages.len(),
    }
}

/// CPU times of one request kind over the rounds.
#[derive(Default)]
struct Times {
    render: Vec<Duration>,
    encode: Vec<Duration>,
}

impl Times {
    fn total(&self) -> Vec<Duration> {
        self.render.iter().zip(&self.encode).map(|(r, e)| *r + *e).collect()
    }
}

/// min, median, p90 of `times`, in ms.
fn stats(times: &[Duration]) -> [f64; 3] {
    let mut t = times.to_vec();
    t.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    [ms(t[0]), ms(t[t.len() / 2]), ms(t[(t.len() * 9 / 10).min(t.len() - 1)])]
}

fn median(times: &[Duration]) -> f64 {
    stats(times)[1]
}

/// Runs the family bench: requests built, the file written, interleaved timed rounds, the table.
pub fn run(qwen3_tokenizer: &Path, runs: usize, requests_out: Option<&str>) {
    println!("\n== Local ids per model family: {TARGET_TOKENS}-token first request and its follow-up ==\n");
    let families = families(qwen3_tokenizer);
    if families.is_empty() {
        println!("no family folder found: nothing to measure");
        return;
    }
    let (all, other) = (conversation(0x9e37_79b9_7f4a_7c15), conversation(0x2545_f491_4f6c_dd1d));
    let built: Vec<Requests> = families.iter().map(|f| requests(f, &all, &other)).collect();
    let requests_out = Path::new(requests_out.unwrap_or(REQUESTS_OUT));
    write_requests(requests_out, &families, &built);

    let deadline = Instant::now() + Duration::from_secs(MAX_SECONDS);
    let mut new_pool_times: Vec<Times> = families.iter().map(|_| Times::default()).collect();
    let mut first_times: Vec<Times> = families.iter().map(|_| Times::default()).collect();
    let mut follow_times: Vec<Times> = families.iter().map(|_| Times::default()).collect();
    // the process's CPU over the same calls: work on other threads would show here
    let (mut thread_sum, mut process_sum) = (Duration::ZERO, Duration::ZERO);
    // One untimed round first (tokenizer word caches, allocator), then interleaved rounds:
    // each family in turn, a fresh pool renderer per round.
    for round in 0..=runs {
        if Instant::now() > deadline {
            println!("(stopped after {round} rounds: {MAX_SECONDS} s bound)");
            break;
        }
        for (i, (family, req)) in families.iter().zip(&built).enumerate() {
            let local = family.fresh();
            // a new pool's first request: everything cold (reported, not compared)
            let (r0, rendered) = cpu(|| local.render(Api::Chat, req.other.as_bytes()).unwrap());
            let (e0, _) = cpu(|| local.encode(&rendered).unwrap());
            let process_before = process_cpu();
            let (r1, rendered) = cpu(|| local.render(Api::Chat, req.first.as_bytes()).unwrap());
            let (e1, ids1) = cpu(|| local.encode(&rendered).unwrap());
            let (r2, rendered) = cpu(|| local.render(Api::Chat, req.follow_up.as_bytes()).unwrap());
            let (e2, ids2) = cpu(|| local.encode(&rendered).unwrap());
            process_sum += process_cpu() - process_before;
            assert!(ids1 == req.first_ids, "{}: first request ids differ from the uncached ones", family.name);
            assert!(ids2 == req.follow_up_ids, "{}: follow-up ids differ from the uncached ones", family.name);
            thread_sum += r1 + e1 + r2 + e2;
            if round > 0 {
                new_pool_times[i].render.push(r0);
                new_pool_times[i].encode.push(e0);
                first_times[i].render.push(r1);
                first_times[i].encode.push(e1);
                follow_times[i].render.push(r2);
                follow_times[i].encode.push(e2);
            }
        }
    }

    let rounds = first_times.first().map_or(0, |t| t.render.len());
    if rounds == 0 {
        return;
    }
    println!(
        "\nCPU per request ({rounds} rounds, interleaved; per round each family gets a fresh pool renderer: \
         \"new pool\" is its first request (another conversation, everything cold), \"first\" the measured \
         conversation on a cold segment cache with the tokenizer's word cache warm, \"follow-up\" its next \
         turn; render = template or Harmony/Mistral to text or ids, tokenize = segment cache or none), ms:\n"
    );
    println!(
        "| {:<12} | {:<9} | {:>8} | {:>6} | {:>8} | {:>8} | {:>8} | {:>8} | {:>8} |",
        "family", "request", "messages", "tokens", "render", "tokenize", "min", "median", "p90"
    );
    println!(
        "|{:-<14}|{:-<11}|{:->10}|{:->8}|{:->10}|{:->10}|{:->10}|{:->10}|{:->10}|",
        "", "", "", "", "", "", "", "", ""
    );
    for (i, (family, req)) in families.iter().zip(&built).enumerate() {
        for (kind, times, tokens, messages) in [
            ("new pool", &new_pool_times[i], req.other_tokens, req.other_messages),
            ("first", &first_times[i], req.first_ids.len(), req.messages),
            ("follow-up", &follow_times[i], req.follow_up_ids.len(), req.messages + 2),
        ] {
            let [min, med, p90] = stats(&times.total());
            println!(
                "| {:<12} | {:<9} | {:>8} | {:>6} | {:>8.3} | {:>8.3} | {:>8.3} | {:>8.3} | {:>8.3} |",
                family.name,
                kind,
                messages,
                tokens,
                median(&times.render),
                median(&times.encode),
                min,
                med,
                p90
            );
        }
    }
    let results = json!({
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        "rounds": rounds,
        "families": families.iter().zip(&built).enumerate().map(|(i, (family, req))| json!({
            "family": family.name,
            "new_pool": result(&new_pool_times[i], req.other_tokens, req.other_messages),
            "first": result(&first_times[i], req.first_ids.len(), req.messages),
            "follow_up": result(&follow_times[i], req.follow_up_ids.len(), req.messages + 2),
        })).collect::<Vec<_>>(),
    });
    let results_out = requests_out.with_file_name("tokenonce.json");
    std::fs::write(&results_out, results.to_string()).unwrap();
    println!(
        "\n(render and tokenize: medians; min/median/p90: their sum per request.) Over the timed calls the process \
         used {:.0} ms of CPU, the bench thread {:.0} ms: {:.1} % on other threads (0: the thread times miss nothing)",
        process_sum.as_secs_f64() * 1e3,
        thread_sum.as_secs_f64() * 1e3,
        (process_sum.as_secs_f64() - thread_sum.as_secs_f64()).max(0.0) / process_sum.as_secs_f64() * 100.0
    );
}

/// One request kind's numbers for `tokenonce.json` (beside the requests file), which
/// `render_cost.py` puts beside vLLM's.
fn result(times: &Times, tokens: usize, messages: usize) -> serde_json::Value {
    let [min, median_ms, p90] = stats(&times.total());
    json!({"tokens": tokens, "messages": messages, "render_ms": median(&times.render),
           "tokenize_ms": median(&times.encode), "min_ms": min, "median_ms": median_ms, "p90_ms": p90})
}

/// The requests file `render_cost.py` reads: per family its folder, the two bodies as sent,
/// and the ids tokenonce computed for them.
fn write_requests(path: &Path, families: &[Family], built: &[Requests]) {
    let doc = json!({
        "target_tokens": TARGET_TOKENS,
        "families": families.iter().zip(built).map(|(family, req)| json!({
            "family": family.name,
            "folder": family.folder,
            "requests": [
                {"name": "first", "body": req.first, "ids": req.first_ids},
                {"name": "follow_up", "body": req.follow_up, "ids": req.follow_up_ids},
            ],
        })).collect::<Vec<_>>(),
    });
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::write(path, doc.to_string()).unwrap();
    println!("requests and their ids written to {} (tests/e2e/families/render_cost.py reads them)", path.display());
}
