//! What an engine says of its own pressure, read from vLLM's `GET /metrics` (the Prometheus
//! text format): a pure reader, bounded and suspicious. Only the series named here are read;
//! any value of theirs that cannot be true rejects the whole read with a named reason.
//!
//! A small hand reader rather than a crate: the one maintained-looking parser
//! (`prometheus-parse` 0.2) builds every sample of the page (vLLM's histograms: hundreds)
//! through regexes, while this reads five series in one pass and skips the rest.
//!
//! vLLM 0.32 (`vllm/v1/metrics/loggers.py`) labels its per-engine series `model_name` and
//! `engine` (the data-parallel rank's index, `"0"` without data parallelism):
//! `vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (0 to 1;
//! `vllm:gpu_cache_usage_perc` before 0.10), `vllm:cache_config_info` (value 1, the cache
//! config as labels, among them `num_gpu_blocks` and `block_size`, `"None"` when unset), and,
//! with LoRA on, `vllm:lora_requests_info` (no `engine` label; labels `max_lora`,
//! `running_lora_adapters` and `waiting_lora_adapters`, comma-separated; its value the time it
//! was set, and every combination seen stays a series: the latest is the current one).

use std::collections::BTreeMap;

/// Largest `/metrics` page read (vLLM 0.32's is about 55 kB per engine).
pub const MAX_METRICS_BYTES: usize = 1 << 20;

/// A count (requests, blocks, block size) above this is not believed.
pub const MAX_COUNT: f64 = 1e9;

/// Most engines (data-parallel ranks) one page may describe.
pub const MAX_ENGINES: usize = 1024;

/// Most LoRA adapters one list may name, and the longest name.
pub const MAX_LORAS: usize = 1024;
const MAX_LORA_NAME: usize = 256;

/// One engine's pressure as its `/metrics` reported it (a server's ranks summed when the
/// endpoint is the whole server).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineLoad {
    /// Requests queued, not yet scheduled (`vllm:num_requests_waiting`).
    pub waiting: u64,
    /// Requests in the running batch (`vllm:num_requests_running`).
    pub running: u64,
    /// Share of its KV-cache blocks in use, 0 to 1 (`vllm:kv_cache_usage_perc`; a whole
    /// server's ranks averaged).
    pub kv_usage: f64,
    /// KV-cache blocks it holds (`vllm:cache_config_info{num_gpu_blocks}`; ranks summed).
    pub num_gpu_blocks: Option<u64>,
    /// Tokens per KV-cache block (`vllm:cache_config_info{block_size}`).
    pub block_size: Option<u32>,
    /// LoRA adapters in its running batch (`vllm:lora_requests_info{running_lora_adapters}`).
    pub loras_running: Vec<String>,
    /// LoRA adapters its queued requests name (`{waiting_lora_adapters}`).
    pub loras_waiting: Vec<String>,
    /// Adapters it can hold at once (`{max_lora}`; none: LoRA off).
    pub max_loras: Option<u32>,
}

/// The numbers of an [`EngineLoad`] a routing cost reads, copied without its lists (a pick
/// reads one per candidate).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Pressure {
    /// Requests queued, not yet scheduled.
    pub waiting: u64,
    /// Requests in the running batch.
    pub running: u64,
    /// Share of its KV-cache blocks in use, 0 to 1.
    pub kv_usage: f64,
}

impl EngineLoad {
    /// Its numbers a routing cost reads.
    pub fn pressure(&self) -> Pressure {
        Pressure { waiting: self.waiting, running: self.running, kv_usage: self.kv_usage }
    }
}

/// Why a page was not believed (the whole read is dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// Over [`MAX_METRICS_BYTES`].
    #[error("page over {MAX_METRICS_BYTES} bytes")]
    TooLarge,
    /// A line of a series read here is not UTF-8 or not `name{labels} value [timestamp]`.
    #[error("a series line cannot be read")]
    Malformed,
    /// The same series (name and engine) twice.
    #[error("a series given twice")]
    Duplicate,
    /// NaN or an infinity.
    #[error("a value is not finite")]
    NotFinite,
    /// A count or usage below zero.
    #[error("a value is negative")]
    Negative,
    /// A count with a fraction.
    #[error("a count is not whole")]
    Fractional,
    /// A KV-cache usage above 1.
    #[error("a usage is above 1")]
    UsageOutOfRange,
    /// A count above [`MAX_COUNT`], or more engines or adapters than can be true.
    #[error("a count is absurd")]
    Absurd,
    /// The engine's waiting, running or KV usage is not on the page.
    #[error("the engine's load is not on the page")]
    Missing,
}

/// What one engine's series said, as read.
#[derive(Debug, Default)]
struct Seen {
    waiting: Option<u64>,
    running: Option<u64>,
    kv_usage: Option<f64>,
    /// From `gpu_cache_usage_perc`, used when `kv_cache_usage_perc` is absent.
    gpu_usage: Option<f64>,
    blocks: Option<Option<u64>>,
    block_size: Option<Option<u64>>,
}

/// A sample's labels, as written (unescaped), in order.
type Labels = Vec<(String, String)>;

/// The series this reader reads.
#[derive(Debug, Clone, Copy)]
enum Series {
    Waiting,
    Running,
    KvUsage,
    GpuUsage,
    CacheConfig,
    Lora,
}

impl Series {
    fn of(name: &[u8]) -> Option<Self> {
        Some(match name {
            b"vllm:num_requests_waiting" => Self::Waiting,
            b"vllm:num_requests_running" => Self::Running,
            b"vllm:kv_cache_usage_perc" => Self::KvUsage,
            b"vllm:gpu_cache_usage_perc" => Self::GpuUsage,
            b"vllm:cache_config_info" => Self::CacheConfig,
            b"vllm:lora_requests_info" => Self::Lora,
            _ => return None,
        })
    }
}

/// The latest `lora_requests_info` series: its time and labels.
#[derive(Debug)]
struct Lora {
    at: f64,
    running: Vec<String>,
    waiting: Vec<String>,
    max: Option<u32>,
}

/// Reads the load of `rank` (`None`: the whole server, its ranks summed) from a `/metrics`
/// page.
///
/// # Errors
/// [`Rejected`] naming the first thing on the page that cannot be true; nothing of it is kept.
pub fn read(page: &[u8], rank: Option<u32>) -> Result<EngineLoad, Rejected> {
    if page.len() > MAX_METRICS_BYTES {
        return Err(Rejected::TooLarge);
    }
    let mut engines: BTreeMap<String, Seen> = BTreeMap::new();
    let mut lora: Option<Lora> = None;
    for line in page.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let name_end = line.iter().position(|&b| b == b'{' || b == b' ' || b == b'\t').unwrap_or(line.len());
        let Some(series) = line.get(..name_end).and_then(Series::of) else { continue };
        let rest = line.get(name_end..).unwrap_or_default();
        let (labels, value) = sample(rest)?;
        if let Series::Lora = series {
            let next = lora_of(&labels, value)?;
            if lora.as_ref().is_none_or(|l| next.at >= l.at) {
                lora = Some(next);
            }
            continue;
        }
        let engine = label(&labels, "engine").unwrap_or("0");
        if !engines.contains_key(engine) && engines.len() >= MAX_ENGINES {
            return Err(Rejected::Absurd);
        }
        let seen = engines.entry(engine.to_owned()).or_default();
        match series {
            Series::Waiting => set(&mut seen.waiting, count(value)?)?,
            Series::Running => set(&mut seen.running, count(value)?)?,
            Series::KvUsage => set(&mut seen.kv_usage, usage(value)?)?,
            Series::GpuUsage => set(&mut seen.gpu_usage, usage(value)?)?,
            Series::CacheConfig => {
                set(&mut seen.blocks, count_label(&labels, "num_gpu_blocks")?)?;
                set(&mut seen.block_size, count_label(&labels, "block_size")?)?;
            }
            Series::Lora => {}
        }
    }
    let chosen: Vec<&Seen> = match rank {
        Some(r) => vec![engines.get(r.to_string().as_str()).ok_or(Rejected::Missing)?],
        None => engines.values().collect(),
    };
    let mut load = combine(&chosen)?;
    if let Some(l) = lora {
        (load.loras_running, load.loras_waiting, load.max_loras) = (l.running, l.waiting, l.max);
    }
    Ok(load)
}

/// One engine's load, or a whole server's: counts and blocks summed, usage averaged, the
/// first block size.
fn combine(engines: &[&Seen]) -> Result<EngineLoad, Rejected> {
    if engines.is_empty() {
        return Err(Rejected::Missing);
    }
    let mut load = EngineLoad::default();
    let mut usage_sum = 0.0;
    let mut blocks = Some(0u64);
    for seen in engines {
        let (Some(waiting), Some(running), Some(usage)) =
            (seen.waiting, seen.running, seen.kv_usage.or(seen.gpu_usage))
        else {
            return Err(Rejected::Missing);
        };
        load.waiting = load.waiting.saturating_add(waiting);
        load.running = load.running.saturating_add(running);
        usage_sum += usage;
        blocks = blocks.zip(seen.blocks.flatten()).map(|(a, b)| a.saturating_add(b));
        load.block_size = load.block_size.or(seen.block_size.flatten().and_then(|b| u32::try_from(b).ok()));
    }
    #[expect(clippy::cast_precision_loss, reason = "at most MAX_ENGINES engines")]
    let n = engines.len() as f64;
    load.kv_usage = usage_sum / n;
    load.num_gpu_blocks = blocks;
    Ok(load)
}

/// Keeps `value` in `slot`, unless the series was seen already.
fn set<T>(slot: &mut Option<T>, value: T) -> Result<(), Rejected> {
    if slot.is_some() {
        return Err(Rejected::Duplicate);
    }
    *slot = Some(value);
    Ok(())
}

/// The labels and value of a sample line, after its name: `{k="v",...} value [timestamp]`.
fn sample(rest: &[u8]) -> Result<(Labels, f64), Rejected> {
    let text = std::str::from_utf8(rest).map_err(|_| Rejected::Malformed)?;
    let (labels, after) = match text.strip_prefix('{') {
        Some(inner) => labels_of(inner)?,
        None => (Vec::new(), text),
    };
    let mut fields = after.split_ascii_whitespace();
    let value = fields.next().ok_or(Rejected::Malformed)?;
    // A timestamp (milliseconds, an integer) may follow; nothing else may.
    if fields.next().is_some_and(|t| t.parse::<i64>().is_err()) || fields.next().is_some() {
        return Err(Rejected::Malformed);
    }
    let value = match value {
        "NaN" | "+Inf" | "-Inf" => return Err(Rejected::NotFinite),
        v => v.parse::<f64>().map_err(|_| Rejected::Malformed)?,
    };
    if !value.is_finite() {
        return Err(Rejected::NotFinite);
    }
    Ok((labels, value))
}

/// The labels of `inner` (what follows `{`) and the text after the closing `}`.
fn labels_of(inner: &str) -> Result<(Labels, &str), Rejected> {
    let mut labels = Vec::new();
    let mut rest = inner.trim_start();
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            return Ok((labels, after));
        }
        let (key, after) = rest.split_once('=').ok_or(Rejected::Malformed)?;
        let key = key.trim();
        let key_ok = key.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        let quoted = after.trim_start().strip_prefix('"').ok_or(Rejected::Malformed)?;
        if !key_ok {
            return Err(Rejected::Malformed);
        }
        let (value, after) = quoted_value(quoted)?;
        labels.push((key.to_owned(), value));
        rest = after.trim_start();
        rest = rest.strip_prefix(',').map_or(rest, str::trim_start);
    }
}

/// A label value up to its closing quote (`\\`, `\"` and `\n` unescaped) and what follows.
fn quoted_value(text: &str) -> Result<(String, &str), Rejected> {
    let mut value = String::new();
    let mut chars = text.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Ok((value, text.get(i + 1..).unwrap_or_default())),
            '\\' => match chars.next() {
                Some((_, 'n')) => value.push('\n'),
                Some((_, e @ ('\\' | '"'))) => value.push(e),
                _ => return Err(Rejected::Malformed),
            },
            c => value.push(c),
        }
    }
    Err(Rejected::Malformed)
}

fn label<'a>(labels: &'a [(String, String)], key: &str) -> Option<&'a str> {
    labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// A gauge that counts: whole, from 0 to [`MAX_COUNT`].
fn count(value: f64) -> Result<u64, Rejected> {
    if value < 0.0 {
        return Err(Rejected::Negative);
    }
    if value > MAX_COUNT {
        return Err(Rejected::Absurd);
    }
    if value.fract() != 0.0 {
        return Err(Rejected::Fractional);
    }
    #[expect(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "whole, 0 to 1e9")]
    Ok(value as u64)
}

/// A share: 0 to 1.
fn usage(value: f64) -> Result<f64, Rejected> {
    if value < 0.0 {
        return Err(Rejected::Negative);
    }
    if value > 1.0 {
        return Err(Rejected::UsageOutOfRange);
    }
    Ok(value)
}

/// A count given as a label (`"None"` or missing: not known).
fn count_label(labels: &[(String, String)], key: &str) -> Result<Option<u64>, Rejected> {
    match label(labels, key) {
        None | Some("None") => Ok(None),
        Some(text) => count(text.parse::<f64>().map_err(|_| Rejected::Malformed)?).map(Some),
    }
}

/// A `lora_requests_info` series: when it was set (its value) and its labels.
fn lora_of(labels: &[(String, String)], at: f64) -> Result<Lora, Rejected> {
    if at < 0.0 {
        return Err(Rejected::Negative);
    }
    let names = |key| -> Result<Vec<String>, Rejected> {
        let list = label(labels, key).unwrap_or_default();
        let names: Vec<String> = list.split(',').filter(|n| !n.is_empty()).map(str::to_owned).collect();
        if names.len() > MAX_LORAS || names.iter().any(|n| n.len() > MAX_LORA_NAME) {
            return Err(Rejected::Absurd);
        }
        Ok(names)
    };
    let max = count_label(labels, "max_lora")?.map(|m| u32::try_from(m).map_err(|_| Rejected::Absurd)).transpose()?;
    Ok(Lora { at, running: names("running_lora_adapters")?, waiting: names("waiting_lora_adapters")?, max })
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: &[u8] = include_bytes!("../../tests/fixtures/engine_metrics/vllm-0.32-idle.txt");
    const BUSY: &[u8] = include_bytes!("../../tests/fixtures/engine_metrics/vllm-0.32-busy.txt");

    /// A two-rank page: rank 0 busy, rank 1 idle.
    const TWO_RANKS: &str = "\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 8.0
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.25
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1000\"} 1.0
vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"1000\"} 1.0
";

    #[test]
    fn the_recorded_idle_page_reads_as_vllm_reported_it() {
        let load = read(IDLE, None).unwrap();
        assert_eq!(load, EngineLoad { num_gpu_blocks: Some(16384), block_size: Some(128), ..EngineLoad::default() });
        assert_eq!(read(IDLE, Some(0)).unwrap(), load, "engine \"0\" is the whole server");
        assert_eq!(read(IDLE, Some(1)), Err(Rejected::Missing));
    }

    #[test]
    fn the_recorded_busy_page_shows_its_queue() {
        let load = read(BUSY, Some(0)).unwrap();
        assert_eq!((load.waiting, load.running), (1, 5), "one queued, five running");
        assert!(load.kv_usage > 0.0 && load.kv_usage < 0.1, "{}", load.kv_usage);
    }

    #[test]
    fn a_rank_reads_its_own_engine_and_the_server_sums_them() {
        let page = TWO_RANKS.as_bytes();
        let r0 = read(page, Some(0)).unwrap();
        assert_eq!((r0.waiting, r0.running, r0.kv_usage, r0.num_gpu_blocks), (3, 8, 0.5, Some(1000)));
        let r1 = read(page, Some(1)).unwrap();
        assert_eq!((r1.waiting, r1.running, r1.kv_usage), (0, 1, 0.25));
        let all = read(page, None).unwrap();
        assert_eq!((all.waiting, all.running, all.kv_usage, all.num_gpu_blocks), (3, 9, 0.375, Some(2000)));
        assert_eq!(all.block_size, Some(16));
    }

    #[test]
    fn the_latest_lora_series_names_the_adapters() {
        let page = format!(
            "{TWO_RANKS}vllm:lora_requests_info{{max_lora=\"2\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"}} 1.7e9\n\
             vllm:lora_requests_info{{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"c\"}} 1.6e9\n"
        );
        let load = read(page.as_bytes(), Some(1)).unwrap();
        assert_eq!(load.loras_running, ["a", "b"]);
        assert!(load.loras_waiting.is_empty());
        assert_eq!(load.max_loras, Some(2));
    }

    #[test]
    fn the_older_usage_name_is_read_when_the_new_one_is_absent() {
        let page = "vllm:num_requests_waiting 1\nvllm:num_requests_running 2\nvllm:gpu_cache_usage_perc{x=\"y\"} 0.75 1700000000000\n";
        let load = read(page.as_bytes(), None).unwrap();
        assert_eq!((load.waiting, load.running, load.kv_usage, load.num_gpu_blocks), (1, 2, 0.75, None));
    }

    #[test]
    fn every_lie_rejects_the_whole_page_by_name() {
        let with = |line: &str| format!("{TWO_RANKS}{line}\n");
        let cases = [
            ("vllm:num_requests_waiting{engine=\"2\"} -1", Rejected::Negative),
            ("vllm:num_requests_waiting{engine=\"2\"} NaN", Rejected::NotFinite),
            ("vllm:num_requests_waiting{engine=\"2\"} +Inf", Rejected::NotFinite),
            ("vllm:num_requests_waiting{engine=\"2\"} 1e300", Rejected::Absurd),
            ("vllm:num_requests_waiting{engine=\"2\"} 2000000000", Rejected::Absurd),
            ("vllm:num_requests_waiting{engine=\"2\"} 1.5", Rejected::Fractional),
            ("vllm:kv_cache_usage_perc{engine=\"2\"} 1.01", Rejected::UsageOutOfRange),
            ("vllm:kv_cache_usage_perc{engine=\"2\"} -0.5", Rejected::Negative),
            ("vllm:num_requests_waiting{engine=\"0\"} 3", Rejected::Duplicate),
            ("vllm:num_requests_waiting{engine=\"2} 3", Rejected::Malformed),
            ("vllm:num_requests_waiting{engine=\"2\"}", Rejected::Malformed),
            ("vllm:num_requests_waiting{engine=\"2\"} 3 x", Rejected::Malformed),
            ("vllm:num_requests_waiting{engine=\"2\"} three", Rejected::Malformed),
            ("vllm:num_requests_waiting{2=\"2\"} 3", Rejected::Malformed),
            ("vllm:num_requests_waiting{engine=\"\\q\"} 3", Rejected::Malformed),
            ("vllm:cache_config_info{engine=\"2\",num_gpu_blocks=\"-4\"} 1", Rejected::Negative),
            ("vllm:cache_config_info{engine=\"2\",num_gpu_blocks=\"4e12\"} 1", Rejected::Absurd),
            ("vllm:cache_config_info{engine=\"2\",block_size=\"x\"} 1", Rejected::Malformed),
            ("vllm:lora_requests_info{max_lora=\"99999999999\"} 1", Rejected::Absurd),
        ];
        for (line, why) in cases {
            assert_eq!(read(with(line).as_bytes(), Some(0)), Err(why), "{line}");
        }
        let mut huge = TWO_RANKS.to_owned();
        huge.push_str(&"#".repeat(MAX_METRICS_BYTES));
        assert_eq!(read(huge.as_bytes(), Some(0)), Err(Rejected::TooLarge));
        let many: String =
            (0..=MAX_ENGINES).map(|e| format!("vllm:num_requests_waiting{{engine=\"{e}\"}} 0\n")).collect();
        assert_eq!(read(many.as_bytes(), None), Err(Rejected::Absurd));
    }

    #[test]
    fn other_series_and_garbage_lines_are_not_read() {
        let page = format!("garbage \u{0}\u{ff}\nvllm:num_requests_waiting_by_reason{{engine=\"0\"}} NaN\n{TWO_RANKS}");
        assert_eq!(read(page.as_bytes(), Some(1)).unwrap().running, 1);
        assert_eq!(read(b"", None), Err(Rejected::Missing));
        assert_eq!(read(b"vllm:num_requests_waiting 1\n", None), Err(Rejected::Missing));
        assert_eq!(read(b"vllm:num_requests_waiting{engine=\"0\"} \xff\n", None), Err(Rejected::Malformed));
    }
}
