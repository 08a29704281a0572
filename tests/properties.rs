//! Property tests (proptest) of the fuzz targets' oracles (`tests/oracles/mod.rs`) on
//! generated JSON, SSE and TOML, plus every committed fuzz seed (`fuzz/corpus/`) run through
//! its target's oracle. Case counts are bounded so the file runs in a few seconds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod oracles;

use proptest::prelude::*;
use proptest::sample::select;
use tokenonce::kv::wire::{BlockKeys, Event, EventBatch, Removed, Stored, WireHash};
use tokenonce::kv::{BlockHasher, ExtraKeys};
use tokenonce::openai::{Api, PromptIds};

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

// === generators ===

fn ws() -> impl Strategy<Value = &'static str> {
    select(vec!["", "", "", " ", "\n", "\t ", "\r\n"])
}

/// Keys the code reads, some spelled with escapes, and a few it does not.
fn key() -> impl Strategy<Value = String> {
    select(vec![
        "model",
        "mod\\u0065l",
        "stream",
        "n",
        "echo",
        "return_token_ids",
        "messages",
        "content",
        "type",
        "typ\\u0065",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "min_completion_tokens",
        "stream_options",
        "kv_transfer_params",
        "prompt_token_ids",
        "token_ids",
        "usage",
        "prompt_tokens",
        "prompt_tokens_details",
        "cached_tokens",
        "choices",
        "x",
        "",
        "\\\"q",
        "é",
    ])
    .prop_map(|k| format!("\"{k}\""))
}

/// Scalars, including texts JSON refuses (leading zeros, `+1`, `NaN`, a bare `.5`).
fn scalar() -> impl Strategy<Value = String> {
    prop_oneof![
        select(vec![
            "null",
            "true",
            "false",
            "0",
            "-0",
            "1",
            "2",
            "1.0",
            "2.50",
            "1e3",
            "1E-2",
            "-1.5e+7",
            "4294967295"
        ])
        .prop_map(str::to_owned),
        select(vec!["4294967296", "18446744073709551616", "1e400", "01", "+1", ".5", "NaN", "tru"])
            .prop_map(str::to_owned),
        select(vec![
            r#""""#,
            r#""text""#,
            r#""image_url""#,
            r#""\u00e9""#,
            r#""a\"b""#,
            r#""\ud800""#,
            r#""\n""#,
            "\"é\"",
            r#""{\"usage\":1}""#
        ])
        .prop_map(str::to_owned),
        any::<u32>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        "[a-z ]{0,8}".prop_map(|s| format!("\"{s}\"")),
    ]
}

fn join(items: Vec<String>) -> String {
    items.join(",")
}

fn array_of(inner: impl Strategy<Value = String>, max: usize) -> impl Strategy<Value = String> {
    (prop::collection::vec((ws(), inner, ws()), 0..max), ws()).prop_map(|(items, end)| {
        format!("[{}{end}]", join(items.into_iter().map(|(a, v, b)| format!("{a}{v}{b}")).collect()))
    })
}

fn object_of(
    k: impl Strategy<Value = String>,
    v: impl Strategy<Value = String>,
    max: usize,
) -> impl Strategy<Value = String> {
    (prop::collection::vec((ws(), k, ws(), v), 0..max), ws()).prop_map(|(members, end)| {
        format!("{{{}{end}}}", join(members.into_iter().map(|(a, k, b, v)| format!("{a}{k}{b}:{v}")).collect()))
    })
}

fn json() -> impl Strategy<Value = String> {
    scalar().prop_recursive(4, 64, 6, |inner| prop_oneof![array_of(inner.clone(), 5), object_of(key(), inner, 5)])
}

/// Id arrays: mostly valid, some with the element forms JSON or u32 refuse.
fn ids_text() -> impl Strategy<Value = String> {
    let element = prop_oneof![
        8 => any::<u32>().prop_map(|n| n.to_string()),
        2 => (0u32..300).prop_map(|n| n.to_string()),
        1 => select(vec!["-0", "01", "00", "1.0", "1e3", "-1", "4294967296", "\"1\"", "[1]", "null", "", " 7"])
            .prop_map(str::to_owned),
    ];
    prop_oneof![
        8 => array_of(element, 8),
        1 => select(vec!["[]", "[1,]", "[1", "1", "[1]x", "\u{a0}[1]", "[1]\u{c}", "\u{feff}[1]", "[1 2]", "{}"])
            .prop_map(str::to_owned),
        1 => "\\PC{0,12}",
    ]
}

fn part() -> impl Strategy<Value = String> {
    (
        select(vec!["\"type\"", "\"typ\\u0065\"", "\"t\\u0079pe\""]),
        select(vec!["\"text\"", "\"image_url\"", "\"input_audio\"", "null", "5"]),
    )
        .prop_map(|(k, v)| format!("{{{k}:{v},\"text\":\"a\"}}"))
}

fn message() -> impl Strategy<Value = String> {
    let content = prop_oneof![scalar(), array_of(part(), 4), array_of(prop_oneof![part(), scalar()], 3),];
    prop_oneof![
        8 => content.prop_map(|c| format!("{{\"role\":\"user\",\"content\":{c}}}")),
        1 => scalar(),
    ]
}

/// Members a request body may carry, with values of the right and of the wrong type.
fn request_member() -> impl Strategy<Value = String> {
    prop_oneof![
        select(vec!["\"m\"", "5", "null", "\"\\u00e9\""]).prop_map(|v| format!("\"model\":{v}")),
        select(vec!["true", "false", "null", "\"yes\"", "1"]).prop_map(|v| format!("\"stream\":{v}")),
        select(vec!["1", "2", "0", "null", "1.0", "-1", "\"2\""]).prop_map(|v| format!("\"n\":{v}")),
        select(vec!["true", "false", "null", "0"]).prop_map(|v| format!("\"echo\":{v}")),
        select(vec!["true", "false", "\"x\""]).prop_map(|v| format!("\"return_token_ids\":{v}")),
        array_of(message(), 4).prop_map(|v| format!("\"messages\":{v}")),
        prop_oneof![scalar(), array_of(scalar(), 3), array_of(array_of(scalar(), 2), 2), ids_text()]
            .prop_map(|v| format!("\"prompt\":{v}")),
        select(vec![
            "\"max_tokens\":50",
            "\"max_completion_tokens\":60",
            "\"min_tokens\":3",
            "\"min_completion_tokens\":2",
            "\"stream_options\":{\"include_usage\":true}",
            "\"temperature\":0.70",
            "\"kv_transfer_params\":{\"a\":1}",
            "\"kv_transfer_params\":null",
        ])
        .prop_map(str::to_owned),
        (key(), json()).prop_map(|(k, v)| format!("{k}:{v}")),
    ]
}

fn request_body() -> impl Strategy<Value = String> {
    (prop::collection::vec((ws(), request_member()), 0..8), ws()).prop_map(|(members, end)| {
        format!("{{{}{end}}}", join(members.into_iter().map(|(a, m)| format!("{a}{m}")).collect()))
    })
}

/// Prefill answers shaped like vLLM's, with the fields that matter perturbed.
fn prefill_answer() -> impl Strategy<Value = String> {
    let count = prop_oneof![
        (0u64..12).prop_map(|n| n.to_string()),
        select(vec!["null", "1.0", "\"3\"", "-1"]).prop_map(str::to_owned)
    ];
    let details = prop_oneof![
        Just("null".to_owned()),
        count.clone().prop_map(|c| format!("{{\"cached_tokens\":{c},\"audio_tokens\":0}}")),
        scalar(),
    ];
    let usage = prop_oneof![
        8 => (count, details).prop_map(|(c, d)| format!("{{\"prompt_tokens\":{c},\"total_tokens\":9,\"prompt_tokens_details\":{d}}}")),
        1 => scalar(),
        1 => json(),
    ];
    let ids = prop_oneof![ids_text(), Just("null".to_owned())];
    let choice = (ids.clone(), ids.clone()).prop_map(|(p, t)| {
        format!(
            "{{\"index\":0,\"text\":\"a\",\"prompt_token_ids\":{p},\"token_ids\":{t},\"finish_reason\":\"length\"}}"
        )
    });
    let choices = prop_oneof![8 => array_of(choice, 3), 1 => scalar(), 1 => array_of(scalar(), 2)];
    let kv = prop_oneof![Just("null".to_owned()), object_of(key(), json(), 3), scalar()];
    (ids, usage, choices, kv, prop::collection::vec((key(), json()), 0..2), any::<u8>()).prop_map(
        |(ids, usage, choices, kv, extra, order)| {
            let mut m = vec![
                format!("\"id\":\"cmpl-1\",\"choices\":{choices}"),
                format!("\"usage\":{usage}"),
                format!("\"prompt_token_ids\":{ids}"),
                format!("\"kv_transfer_params\":{kv}"),
            ];
            m.extend(extra.into_iter().map(|(k, v)| format!("{k}:{v}")));
            let len = m.len();
            m.rotate_left(usize::from(order) % len);
            format!("{{{}}}", m.join(","))
        },
    )
}

fn sse_stream() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        select(vec![
            "data: {\"a\":1}",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4}}",
            "data: {\"usage\":{\"prompt_tokens\":1},",
            "data:  {\"usage\":null}",
            "data: \"x\":[1,",
            "data: 2]}",
            "data: [DONE]",
            "data",
            "data:",
            "database: 1",
            ": keep-alive",
            "event: x",
            "id: 3",
        ])
        .prop_map(|s| s.as_bytes().to_vec()),
        select(vec!["\n", "\n", "\n\n", "\r\n", "\r", "\r\r\n", " "]).prop_map(|s| s.as_bytes().to_vec()),
        prop::collection::vec(any::<u8>(), 0..4),
    ];
    prop::collection::vec(piece, 0..24).prop_map(|ps| ps.concat())
}

fn toml_text() -> impl Strategy<Value = String> {
    let endpoint = select(vec![
        "\"127.0.0.1:8100\"",
        "\"prefill-0.svc:8000\"",
        "\"[::1]:8200\"",
        "\"bad host\"",
        "\"a:0\"",
        "\"h:99999\"",
        "1",
    ]);
    let pool = (
        select(vec!["decode", "prefill", "p-1", "\"we ird\""]),
        prop::collection::vec(endpoint, 0..3),
        prop::option::of(select(vec!["\"round_robin\"", "\"least_in_flight\"", "\"random\""])),
        prop::option::of(select(vec!["\"0.32.0\"", "\"v0.27\"", "\"x\""])),
    )
        .prop_map(|(name, eps, balance, version)| {
            let mut s = format!("[pools.{name}]\nendpoints = [{}]\n", eps.join(", "));
            if let Some(b) = balance {
                s += &format!("balance = {b}\n");
            }
            if let Some(v) = version {
                s += &format!("vllm_version = {v}\n");
            }
            s
        });
    let number = select(vec!["0", "1", "-5", "30000", "99999999999", "\"1\"", "1.5"]);
    let route = (
        select(vec!["\"r\"", "\"r\"", "\"a-b.c\"", "\"bad name\"", "\"\""]),
        select(vec!["\"orchestrate\"", "\"relay\"", "\"passthrough\"", "\"other\""]),
        prop::option::of(select(vec![
            "{ pool = \"prefill\" }",
            "{ pool = \"nope\" }",
            "{ header = \"x-prefiller-host-port\", allow = [\"10.0.0.0/8\", \"prefill-0.svc\"] }",
            "{ header = \"x y\", allow = [\"bad/cidr!\"] }",
            "{ header = \"h\" }",
            "{ pool = \"prefill\", header = \"h\" }",
            "{ pool = \"prefill\", allow = [\"10.0.0.1\"] }",
        ])),
        select(vec!["\"decode\"", "\"missing\""]),
        prop::option::of(number.clone()),
        prop::option::of(select(vec!["\"cache\"", "\"stateless\"", "\"x\""])),
        prop::option::of(select(vec!["[\"/v1/completions\"]", "[\"v1\"]", "[]"])),
        prop::option::of(select(vec!["\"Qwen/*\"", "\"[\"", "\"a{b\""])),
    )
        .prop_map(|(name, mode, prefill, decode, timeout, handoff, paths, model)| {
            let mut s = format!("[[routes]]\nname = {name}\nmode = {mode}\ndecode_pool = {decode}\n");
            if let Some(p) = prefill {
                s += &format!("prefill = {p}\n");
            }
            if let Some(t) = timeout {
                s += &format!("prefill_timeout_ms = {t}\n");
            }
            if let Some(h) = handoff {
                s += &format!("relay_handoff = {h}\n");
            }
            if paths.is_some() || model.is_some() {
                s += "[routes.match]\n";
                if let Some(p) = paths {
                    s += &format!("paths = {p}\n");
                }
                if let Some(m) = model {
                    s += &format!("model = {m}\n");
                }
            }
            s
        });
    let server = prop::option::of((
        select(vec!["\"0.0.0.0:8000\"", "\"nowhere\"", "\"[::]:80\""]),
        prop::option::of(number.clone()),
        prop::option::of(select(vec!["\"json\"", "\"text\"", "\"xml\""])),
    ))
    .prop_map(|s| match s {
        None => String::new(),
        Some((listen, threads, format)) => {
            let mut out = format!("[server]\nlisten = {listen}\n");
            if let Some(t) = threads {
                out += &format!("threads = {t}\n");
            }
            if let Some(f) = format {
                out += &format!("log_format = {f}\n");
            }
            out
        }
    });
    let extra = select(vec![
        "",
        "",
        "[cache]\nttl_ms = 0\n",
        "[defaults]\npassthrough_pool = \"prefill\"\n",
        "[upstream]\nidle_timeout_ms = 5000\n",
        "[oops]\n",
        "x = \n",
    ]);
    (
        server,
        prop::collection::vec(pool, 0..3),
        prop::collection::vec(route, 0..3),
        extra,
        prop::option::of((any::<usize>(), any::<char>())),
    )
        .prop_map(|(server, pools, routes, extra, garbage)| {
            let mut text = format!("{server}{}{extra}{}", pools.concat(), routes.concat());
            if let Some((at, c)) = garbage {
                let mut at = at % (text.len() + 1);
                while !text.is_char_boundary(at) {
                    at -= 1;
                }
                text.insert(at, c);
            }
            text
        })
}

fn api() -> impl Strategy<Value = Api> {
    select(vec![Api::Chat, Api::Completions])
}

// === properties ===

proptest! {
    #![proptest_config(config(1024))]

    /// The SSE decoder yields the same events whatever the cut points.
    #[test]
    fn sse_events_do_not_depend_on_cuts(stream in sse_stream(), cuts in prop::collection::vec(0usize..400, 0..12)) {
        oracles::check_sse(&stream, &cuts);
    }

    /// Splices stay valid JSON with untouched members byte-identical.
    #[test]
    fn raw_object_splices_keep_other_members(text in prop_oneof![4 => object_of(key(), json(), 6), 1 => json()], k in key(), v in json()) {
        let k: String = serde_json::from_str(&k).unwrap_or_default();
        oracles::check_raw_object(&text, &k, &v);
    }

    /// The id validator agrees with serde_json on what an integer array is.
    #[test]
    fn prompt_ids_agree_with_serde(text in ids_text()) {
        oracles::check_prompt_ids(&text);
    }

    /// from_ids always gives a text the validator and serde_json read back identically.
    #[test]
    fn prompt_ids_from_integers_round_trip(ids in prop::collection::vec(any::<u32>(), 1..40)) {
        oracles::check_prompt_ids(PromptIds::from_ids(&ids).as_json());
    }

    /// The request view reads what serde_json sees.
    #[test]
    fn request_view_matches_serde(api in api(), body in request_body()) {
        oracles::check_request_view(api, &body);
    }

    /// Both rewrites change only their documented keys.
    #[test]
    fn rewrites_touch_only_their_keys(
        api in api(),
        body in request_body(),
        kv in prop::option::of(prop_oneof![object_of(key(), json(), 4), json()]),
        ids in prop::option::of(ids_text()),
        want_ids in any::<bool>(),
    ) {
        let ids = ids.and_then(|t| PromptIds::parse(&t, None).ok());
        oracles::check_rewrites(api, &body, kv.as_deref(), ids.as_ref(), want_ids);
    }

    /// The handoff and the response rewrites read and change what serde_json sees.
    #[test]
    fn handoff_and_response_rewrites_match_serde(api in api(), body in prop_oneof![4 => prefill_answer(), 1 => json()], cached in 0u64..1000) {
        oracles::check_handoff(api, body.as_bytes(), cached);
    }

    /// The config parser never panics, places every problem inside the text, and keeps the
    /// model's invariants when it accepts.
    #[test]
    fn config_problems_are_placed_and_ok_is_valid(text in toml_text()) {
        oracles::check_config(&text);
    }
}

/// A response head from the framing headers that matter, and some body bytes after it.
fn response_head() -> impl Strategy<Value = Vec<u8>> {
    let header = prop::sample::select(vec![
        "Content-Length: 5",
        "content-length: 5, 5",
        "Content-Length: 7",
        "Content-Length: +5",
        "Content-Length: 99999999999999999999",
        "Transfer-Encoding: chunked",
        "transfer-encoding: gzip",
        "Transfer-Encoding: gzip, chunked",
        "Transfer-Encoding: chunked, gzip",
        "Transfer-Encoding: ",
        "Connection: close",
        "Connection: keep-alive",
        "X-A: 1",
    ]);
    let body =
        prop::sample::select(vec!["", "hello", "5\r\nhello\r\n0\r\n\r\n", "5;a=1\r\nhel", "0\r\nx: 1\r\n\r\nHTTP/1.1"]);
    (
        prop::sample::select(vec!["HTTP/1.1", "HTTP/1.0"]),
        prop::sample::select(vec![200u16, 204, 304, 101, 100, 404]),
        prop::collection::vec(header, 0..4),
        body,
    )
        .prop_map(|(version, status, headers, body)| {
            let mut raw = format!("{version} {status} X\r\n");
            for h in headers {
                raw += h;
                raw += "\r\n";
            }
            format!("{raw}\r\n{body}").into_bytes()
        })
}

proptest! {
    #![proptest_config(config(512))]

    /// A chunk-encoded body (random sizes, extensions, trailers) reads back exactly.
    #[test]
    fn chunked_bodies_read_back_exactly(body in prop::collection::vec(any::<u8>(), 0..2000), seed in any::<u8>(), cuts in prop::collection::vec(0usize..2500, 0..12)) {
        oracles::check_h1_chunked(&body, seed, &cuts);
    }

    /// Response heads frame their bodies by RFC 9112 §6.3.
    #[test]
    fn response_heads_follow_the_framing_table(raw in response_head(), to_head in any::<bool>(), cuts in prop::collection::vec(0usize..200, 0..8)) {
        oracles::check_h1_head(&raw, to_head, &cuts);
    }

    /// Random bytes as a chunked body: never a panic, the same result whatever the cuts,
    /// equal to the one-pass reference.
    #[test]
    fn random_chunked_bytes_match_the_reference(raw in prop::collection::vec(prop::sample::select(b"0123456789abcdefABCDEF;= \t\r\nx:".to_vec()), 0..300), seed in any::<u8>()) {
        let mut data = vec![5u8, seed];
        data.extend_from_slice(&raw);
        oracles::fuzz_h1(&data);
    }
}

proptest! {
    #![proptest_config(config(512))]

    /// Pages of vLLM's series with random values, labels and junk: the reader's oracle holds.
    #[test]
    fn engine_metrics_pages_keep_the_readers_bounds(lines in prop::collection::vec(metrics_line(), 0..12), which in any::<u8>()) {
        let mut data = vec![which];
        data.extend_from_slice(lines.concat().as_bytes());
        oracles::fuzz_engine_metrics(&data);
    }

    /// Random bytes over the series' alphabet: the reader's oracle holds.
    #[test]
    fn random_metrics_bytes_keep_the_readers_bounds(raw in prop::collection::vec(prop::sample::select(b"vlm:_nuqestwagikpc{}=\",. 0123456789-+eE#\n\r\\NaIf".to_vec()), 0..400), which in any::<u8>()) {
        let mut data = vec![which];
        data.extend_from_slice(&raw);
        oracles::fuzz_engine_metrics(&data);
    }
}

/// One line of a `/metrics` page: one of the series the reader reads (or another), an engine,
/// and a value true or not.
fn metrics_line() -> impl Strategy<Value = String> {
    let name = prop::sample::select(vec![
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:num_requests_waiting_by_reason",
        "# TYPE vllm:num_requests_waiting",
    ]);
    let value =
        prop::sample::select(vec!["0", "3.0", "0.5", "1", "1.5", "-1", "NaN", "+Inf", "1e9", "1e10", "2.5", "x", ""]);
    let engine = prop::sample::select(vec![
        "",
        "engine=\"0\"",
        "engine=\"1\",model_name=\"m\"",
        "engine=\"2",
        "engine=\"0\",engine=\"1\"",
    ]);
    let info = (0u64..3_000_000_000, 0u64..64, "[a-c,]{0,6}").prop_map(|(blocks, size, loras)| {
        format!("vllm:cache_config_info{{block_size=\"{size}\",engine=\"0\",num_gpu_blocks=\"{blocks}\"}} 1.0\nvllm:lora_requests_info{{max_lora=\"2\",running_lora_adapters=\"{loras}\",waiting_lora_adapters=\"\"}} 1.7e9\n")
    });
    prop_oneof![
        4 => (name, engine, value).prop_map(|(n, e, v)| format!("{n}{{{e}}} {v}\n")),
        1 => info,
    ]
}

/// Block hashes: a few small ones, so stores, removals and the bound meet on the same blocks.
fn kv_hash() -> impl Strategy<Value = WireHash> {
    prop_oneof![3 => (0u64..6).prop_map(WireHash), 1 => any::<u64>().prop_map(WireHash)]
}

/// KV events as vLLM publishes them: stores whose hashes chain their tokens (the hash check's
/// seed and block size) or are drawn, with or without a parent, extra keys, another medium or
/// group, another block size; removals; clears; a type this version does not know.
fn kv_event() -> impl Strategy<Value = Event> {
    let medium = prop::option::of(select(vec!["GPU", "CPU", "STORAGE"]).prop_map(str::to_owned));
    let group = prop::option::of(select(vec![0i64, 0, 1, -1, i64::MAX]));
    let stored = (
        prop::collection::vec(0u32..200_000, 0..100),
        any::<bool>(),
        prop::collection::vec(kv_hash(), 0..5),
        prop::option::of(kv_hash()),
        select(vec![32usize, 32, 16, 0, usize::MAX]),
        prop::option::of("[a-z]{1,8}"),
        medium.clone(),
        group.clone(),
        prop::option::of(prop::collection::vec(
            prop::option::of((prop::collection::vec("[a-z]{1,6}", 0..3), any::<bool>())),
            0..4,
        )),
    )
        .prop_map(|(token_ids, chained, drawn, parent, block_size, lora_name, medium, group_idx, extra)| {
            let block_hashes = if chained {
                let hasher = BlockHasher::new(oracles::KV_SEED, oracles::KV_BLOCK);
                hasher.chain(&token_ids, &ExtraKeys::default()).iter().map(|h| WireHash(h.wire())).collect()
            } else {
                drawn
            };
            Event::BlockStored(Stored {
                block_hashes,
                parent_block_hash: parent.filter(|_| !chained),
                token_ids,
                block_size,
                lora_name,
                medium,
                extra_keys: extra
                    .map(|keys| keys.into_iter().map(|k| k.map(|(texts, other)| BlockKeys { texts, other })).collect()),
                group_idx,
            })
        });
    let removed = (prop::collection::vec(kv_hash(), 0..5), medium, group)
        .prop_map(|(block_hashes, medium, group_idx)| Event::BlockRemoved(Removed { block_hashes, medium, group_idx }));
    prop_oneof![4 => stored, 3 => removed, 1 => Just(Event::AllBlocksCleared), 1 => Just(Event::Other)]
}

fn kv_batch() -> impl Strategy<Value = EventBatch> {
    let ts = prop_oneof![Just(1_764_900_000.25), any::<f64>()];
    (ts, prop::collection::vec(kv_event(), 0..6), prop::option::of(select(vec![0i64, 1, 7, -1, i64::MIN])))
        .prop_map(|(ts, events, data_parallel_rank)| EventBatch { ts, events, data_parallel_rank })
}

/// A batch as vLLM writes it (hashes as integers or digests), then maybe one change: cut short,
/// one byte overwritten, one inserted, a few appended.
fn kv_payload() -> impl Strategy<Value = (Vec<u8>, bool)> {
    (kv_batch(), any::<bool>(), 0u8..6, any::<prop::sample::Index>(), prop::collection::vec(any::<u8>(), 1..4))
        .prop_map(|(batch, digests, change, at, bytes)| {
            let mut payload = oracles::kv_encode(&batch, digests);
            let i = at.index(payload.len());
            match change {
                1 => payload.truncate(i),
                2 => payload[i] = bytes[0],
                3 => payload.insert(i, bytes[0]),
                4 => payload.extend_from_slice(&bytes),
                _ => {}
            }
            (payload, digests)
        })
}

proptest! {
    #![proptest_config(config(512))]

    /// A KV event batch decodes as the msgpack reference reads it (malformed ones are errors),
    /// is written back to the same batch, and applies to a bounded index as the model says.
    #[test]
    fn kv_batches_match_the_reference((payload, digests) in kv_payload(), max_blocks in 1usize..10, slot in 0usize..2) {
        oracles::check_kv_batch(&payload, digests, max_blocks, slot);
    }

    /// A KV event message: three frames, an 8-byte big-endian sequence, the payload's batch.
    #[test]
    fn kv_messages_frame_and_number(
        topic in select(vec!["", "kv", "kv@rank1"]),
        seq in prop_oneof![4 => any::<u64>().prop_map(|s| s.to_be_bytes().to_vec()), 1 => prop::collection::vec(any::<u8>(), 0..12)],
        (payload, _) in kv_payload(),
        frames in select(vec![3usize, 3, 3, 2, 4, 1, 0]),
    ) {
        let mut all = vec![topic.as_bytes().to_vec(), seq, payload];
        all.resize(frames, Vec::new());
        oracles::check_kv_message(&all);
    }
}

/// Every committed seed passes its target's oracle (the corpora double as regression cases).
#[test]
fn every_fuzz_seed_passes_its_oracle() {
    type Target = (&'static str, fn(&[u8]));
    let targets: [Target; 10] = [
        ("sse_decoder", oracles::fuzz_sse),
        ("json_splice", oracles::fuzz_raw_object),
        ("prompt_ids", oracles::fuzz_prompt_ids),
        ("request_view", oracles::fuzz_request_view),
        ("rewrites", oracles::fuzz_rewrites),
        ("handoff", oracles::fuzz_handoff),
        ("config", oracles::fuzz_config),
        ("h1", oracles::fuzz_h1),
        ("engine_metrics", oracles::fuzz_engine_metrics),
        ("kv_wire", oracles::fuzz_kv_wire),
    ];
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    for (target, check) in targets {
        let mut seeds = 0;
        for entry in std::fs::read_dir(root.join(target)).unwrap() {
            let path = entry.unwrap().path();
            check(&std::fs::read(&path).unwrap());
            seeds += 1;
        }
        assert!(seeds >= 3, "{target}: only {seeds} seeds");
    }
}
