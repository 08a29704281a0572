//! Table tests of the plan: request in, plan out, for every fallback reason and both modes.

use super::relay::{plan as relay_plan, Found, RelayPlan, Search};
use super::*;
use crate::config::{RelayHandoff, ReuseShare};
use crate::handoff::CacheKey;

const ON: ReusePolicy = ReusePolicy::new(ReuseShare::ON, RelayHandoff::Cache, None);
const OFF: ReusePolicy = ReusePolicy::new(ReuseShare::OFF, RelayHandoff::Cache, None);
const V32: DecodeVersion = DecodeVersion::Known(Version(0, 32, 0));
const V26: DecodeVersion = DecodeVersion::Known(Version(0, 26, 1));

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":9,"temperature":0.50}"#;
const CMPL: &str = r#"{"model":"m","prompt":"hello","max_tokens":5}"#;
/// A prefill answer for CHAT / CMPL: three ids, NIXL-style kv params with an integer port.
const CHAT_ANSWER: &str = r#"{"prompt_token_ids":[1,2,3],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":2}},"kv_transfer_params":{"remote_port":5600,"remote_engine_id":"e"}}"#;
const CMPL_ANSWER: &str =
    r#"{"choices":[{"prompt_token_ids":[7,8]}],"usage":{"prompt_tokens":2},"kv_transfer_params":null}"#;

const RESP: &str = r#"{"model":"m","input":[{"role":"user","content":"hi"}],"max_output_tokens":9,"temperature":0.50}"#;
/// A Responses prefill answer (`enable_response_messages`): the ids in `input_messages`.
const RESP_ANSWER: &str = r#"{"usage":{"input_tokens":3,"input_tokens_details":{"cached_tokens":2}},"input_messages":[{"message":"x","tokens":[4,5,6],"type":"raw_message_tokens"}],"kv_transfer_params":{"remote_port":5600}}"#;
const MSG: &str = r#"{"model":"m","max_tokens":9,"messages":[{"role":"user","content":"hi"}]}"#;
const V31: DecodeVersion = DecodeVersion::Known(Version(0, 31, 0));

fn parsed(api: Api, body: &str) -> (RawObject<'_>, RequestView) {
    let obj = RawObject::parse(body).unwrap();
    let view = RequestView::parse(api, &obj).unwrap();
    (obj, view)
}

fn json(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes).unwrap()
}

/// The gate decided before the prefill, one row per reason (and the two reuse cases).
#[test]
fn orchestrate_gate_covers_every_pre_prefill_reason() {
    let media = r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
    let rows: &[(&str, Api, &str, ReusePolicy, DecodeVersion, Gate)] = &[
        ("chat on a new decode", Api::Chat, CHAT, ON, V32, Gate::Reuse),
        ("completions on any decode", Api::Completions, CMPL, ON, V26, Gate::Reuse),
        ("route off", Api::Chat, CHAT, OFF, V32, Gate::Fallback(FallbackReason::Disabled)),
        ("old decode", Api::Chat, CHAT, ON, V26, Gate::Fallback(FallbackReason::DecodeVersionOld)),
        (
            "unknown decode",
            Api::Chat,
            CHAT,
            ON,
            DecodeVersion::Unknown,
            Gate::Fallback(FallbackReason::DecodeVersionUnknown),
        ),
        (
            "version skipped",
            Api::Chat,
            CHAT,
            ON,
            DecodeVersion::NotNeeded,
            Gate::Fallback(FallbackReason::DecodeVersionUnknown),
        ),
        ("media", Api::Chat, media, ON, V32, Gate::Fallback(FallbackReason::Media)),
        ("echo", Api::Completions, r#"{"prompt":"a","echo":true}"#, ON, V32, Gate::Fallback(FallbackReason::Echo)),
        ("n > 1", Api::Chat, r#"{"messages":[],"n":2}"#, ON, V32, Gate::Fallback(FallbackReason::NGreaterThanOne)),
        ("batch", Api::Completions, r#"{"prompt":["a","b"]}"#, ON, V32, Gate::Fallback(FallbackReason::BatchPrompt)),
        (
            "ids prompt",
            Api::Completions,
            r#"{"prompt":[1,2]}"#,
            ON,
            V32,
            Gate::Fallback(FallbackReason::PromptIsTokens),
        ),
    ];
    for (name, api, body, policy, version, want) in rows {
        let (obj, view) = parsed(*api, body);
        let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, policy, *version, "req");
        assert_eq!(plan.gate, *want, "{name}");
        let prefill = json(&plan.prefill_body.to_bytes());
        assert_eq!(prefill["max_tokens"], 1, "{name}");
        assert_eq!(prefill["kv_transfer_params"]["do_remote_decode"], true, "{name}");
        assert_eq!(prefill.get("return_token_ids").is_some(), *want == Gate::Reuse, "{name}: ids asked only to reuse");
    }
}

/// Only chat requests that nothing else blocks are worth a `/version` probe.
#[test]
fn the_decode_version_is_asked_only_when_it_decides() {
    let rows: &[(Api, &str, ReusePolicy, bool)] = &[
        (Api::Chat, CHAT, ON, true),
        (Api::Chat, CHAT, OFF, false),
        (Api::Chat, r#"{"messages":[],"n":3}"#, ON, false),
        (Api::Completions, CMPL, ON, false),
    ];
    for (api, body, policy, want) in rows {
        let (_, view) = parsed(*api, body);
        assert_eq!(needs_decode_version(&view, policy, "req"), *want, "{body}");
    }
}

/// Given the prefill's answer: token-in when the ids validate, else the text decode with the
/// reason; the prefill's kv params always travel verbatim, the client's fields keep their bytes.
#[test]
fn after_prefill_builds_the_decode_and_its_outcome() {
    let applied = |tokens, id_bytes| Reuse::Applied { tokens, id_bytes };
    let rows: &[(&str, Api, &str, DecodeVersion, &str, Reuse)] = &[
        ("chat ids", Api::Chat, CHAT, V32, CHAT_ANSWER, applied(3, 7)),
        ("responses ids", Api::Responses, RESP, V32, RESP_ANSWER, applied(3, 7)),
        (
            "responses on 0.31",
            Api::Responses,
            RESP,
            V31,
            RESP_ANSWER,
            Reuse::Fallback(FallbackReason::DecodeVersionOld),
        ),
        (
            "messages echo nothing",
            Api::Messages,
            MSG,
            V32,
            r#"{"usage":{"input_tokens":3}}"#,
            Reuse::Fallback(FallbackReason::IdsNotEchoed),
        ),
        ("completions ids", Api::Completions, CMPL, V26, CMPL_ANSWER, applied(2, 5)),
        ("gate closed", Api::Chat, CHAT, V26, CHAT_ANSWER, Reuse::Fallback(FallbackReason::DecodeVersionOld)),
        (
            "no ids echoed",
            Api::Chat,
            CHAT,
            V32,
            r#"{"prompt_token_ids":null,"usage":{"prompt_tokens":3}}"#,
            Reuse::Fallback(FallbackReason::IdsMissing),
        ),
        (
            "count mismatch",
            Api::Chat,
            CHAT,
            V32,
            r#"{"prompt_token_ids":[1,2],"usage":{"prompt_tokens":3}}"#,
            Reuse::Fallback(FallbackReason::IdsMalformed),
        ),
        (
            "negative id",
            Api::Completions,
            CMPL,
            V32,
            r#"{"choices":[{"prompt_token_ids":[1,-2]}],"usage":{"prompt_tokens":2}}"#,
            Reuse::Fallback(FallbackReason::IdsMalformed),
        ),
        (
            "generate: the client's ids, the handoff",
            Api::Generate,
            r#"{"token_ids":[1,2],"sampling_params":{"max_tokens":9},"max_tokens":null}"#,
            V32,
            r#"{"request_id":"g","usage":{"prompt_tokens":2},"kv_transfer_params":{"remote_port":5600},"choices":[{"token_ids":[9]}]}"#,
            Reuse::Fallback(FallbackReason::PromptIsTokens),
        ),
    ];
    for (name, api, body, version, answer, want) in rows {
        let (obj, view) = parsed(*api, body);
        let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, &ON, *version, "req");
        let step = plan.after_prefill(&Bytes::copy_from_slice(answer.as_bytes())).unwrap();
        assert_eq!(step.reuse, *want, "{name}");
        assert_eq!(step.refused.is_some(), *want == Reuse::Fallback(FallbackReason::IdsMalformed), "{name}");
        let text = String::from_utf8(step.body.to_bytes().to_vec()).unwrap();
        let decode = json(&step.body.to_bytes());
        match (api, want) {
            (Api::Chat, Reuse::Applied { .. }) => {
                assert!(
                    text.contains(
                        r#""kv_transfer_params":{"remote_port":5600,"remote_engine_id":"e","prompt_token_ids":[1,2,3]}"#
                    ),
                    "{name}: {text}"
                );
                assert!(text.contains(r#""temperature":0.50"#), "{name}: client bytes kept");
                assert_eq!(step.cached_tokens, Some(2));
            }
            (Api::Completions, Reuse::Applied { .. }) => {
                assert_eq!(decode["prompt"], serde_json::json!([7, 8]), "{name}")
            }
            (Api::Chat, _) => {
                assert!(decode["kv_transfer_params"].get("prompt_token_ids").is_none(), "{name}: {text}");
                assert_eq!(decode["messages"][0]["content"], "hi", "{name}");
            }
            (Api::Completions, _) => assert_eq!(decode["prompt"], "hello", "{name}"),
            (Api::Responses, Reuse::Applied { .. }) => {
                assert!(
                    text.contains(r#""kv_transfer_params":{"remote_port":5600,"prompt_token_ids":[4,5,6]}"#),
                    "{name}: {text}"
                );
                assert_eq!(decode["max_output_tokens"], 9, "{name}");
                assert_eq!(step.cached_tokens, Some(2));
            }
            (Api::Responses | Api::Messages, _) => {
                assert!(decode["kv_transfer_params"].get("prompt_token_ids").is_none(), "{name}: {text}");
            }
            (Api::Generate, _) => {
                assert_eq!(decode["token_ids"], serde_json::json!([1, 2]), "{name}");
                assert_eq!(decode["sampling_params"]["max_tokens"], 9, "{name}");
                assert_eq!(decode["kv_transfer_params"], serde_json::json!({"remote_port": 5600}), "{name}");
            }
        }
        assert_eq!(decode["max_tokens"], json(body.as_bytes())["max_tokens"], "{name}: the client's limit is restored");
    }
}

#[test]
fn a_prefill_answer_that_is_not_a_completion_is_an_error() {
    let (obj, view) = parsed(Api::Chat, CHAT);
    let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, &ON, V32, "req");
    assert!(plan.after_prefill(&Bytes::copy_from_slice(b"<html>busy</html>")).is_err());
}

/// After a failed prefill, the decode alone gets the client's body byte for byte (no kv
/// params, no ids), for either API and whatever the gate said, counted as `prefill_failed`.
#[test]
fn decode_alone_sends_the_client_body_as_is() {
    for (api, body, policy) in [(Api::Chat, CHAT, ON), (Api::Chat, CHAT, OFF), (Api::Completions, CMPL, ON)] {
        let (obj, view) = parsed(api, body);
        let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, &policy, V32, "req");
        let step = plan.decode_alone();
        assert_eq!(&step.body.to_bytes()[..], body.as_bytes(), "{body}");
        assert_eq!(step.reuse, Reuse::Fallback(FallbackReason::PrefillFailed));
        assert_eq!((step.cached_tokens, step.refused.is_none()), (None, true));
    }
}

/// A client gone before the decode answered: a release leg exactly when the prefill holds
/// KV blocks (it answered `kv_transfer_params`), whatever the reuse outcome; it is the
/// decode with the prefill's params for one token, not streamed. Without kv params (no
/// connector; a decode alone) nothing is released: the prefill holds nothing.
#[test]
fn a_release_leg_exactly_when_the_prefill_holds_kv() {
    let (obj, view) = parsed(Api::Chat, CHAT);
    for (version, answer) in [(V32, CHAT_ANSWER), (V26, CHAT_ANSWER)] {
        let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, &ON, version, "req");
        let step = plan.after_prefill(&Bytes::copy_from_slice(answer.as_bytes())).unwrap();
        assert!(step.holds_kv);
        let release = json(&step.release_body().expect("a release leg"));
        assert_eq!((release["max_tokens"].clone(), release["stream"].clone()), (1.into(), false.into()));
        assert_eq!(release["kv_transfer_params"]["remote_port"], 5600);
        assert_eq!(release["kv_transfer_params"]["remote_engine_id"], "e");
    }
    let (obj, view) = parsed(Api::Completions, CMPL);
    let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, &ON, V32, "req");
    let step = plan.after_prefill(&Bytes::copy_from_slice(CMPL_ANSWER.as_bytes())).unwrap();
    assert!(!step.holds_kv && step.release_body().is_none(), "kv_transfer_params null: nothing held");
    assert!(plan.decode_alone().release_body().is_none());
}

/// Relay: a request is a prefill when its kv params say `do_remote_decode`.
#[test]
fn relay_prefill_asks_for_ids_only_when_they_can_be_used() {
    let prefill = |body: &str, api: Api, policy: ReusePolicy| -> Option<serde_json::Value> {
        let (obj, view) = parsed(api, body);
        match relay_plan(Request { obj: &obj, view: &view, source: None }, &policy, None, "req") {
            RelayPlan::Prefill(p) => p.body().map(|b| json(&b.to_bytes())),
            RelayPlan::Decode(_) => panic!("{body} is a prefill"),
        }
    };
    let kv = r#""kv_transfer_params":{"do_remote_decode":true}"#;
    let chat = format!(r#"{{"messages":[{{"role":"user","content":"x"}}],{kv}}}"#);
    assert_eq!(prefill(&chat, Api::Chat, ON).unwrap()["return_token_ids"], true);
    assert!(prefill(&chat, Api::Chat, OFF).is_none(), "route off: forwarded unchanged");
    let streamed = format!(r#"{{"messages":[],"stream":true,{kv}}}"#);
    assert!(prefill(&streamed, Api::Chat, ON).is_none(), "a streamed prefill cannot be read for ids");
    let n2 = format!(r#"{{"prompt":"a","n":2,{kv}}}"#);
    assert!(prefill(&n2, Api::Completions, ON).is_none());
    let resp = format!(r#"{{"input":"x",{kv}}}"#);
    let body = prefill(&resp, Api::Responses, ON).unwrap();
    assert_eq!(body["enable_response_messages"], true, "Responses echo their ids only this way");
    assert!(body.get("return_token_ids").is_none());
    let msg = format!(r#"{{"max_tokens":1,"messages":[],{kv}}}"#);
    assert!(prefill(&msg, Api::Messages, ON).is_none(), "Messages cannot echo: forwarded unchanged");
}

/// A relayed Responses prefill: its `input_messages` ids are cached, and the raw messages
/// the client did not ask for are nulled again.
#[test]
fn relay_responses_prefill_caches_and_hides_the_raw_messages() {
    let body = r#"{"model":"m","input":"x","kv_transfer_params":{"do_remote_decode":true}}"#;
    let answer = r#"{"id":"r","usage":{"input_tokens":2},"input_messages":[{"message":"p","tokens":[4,5],"type":"raw_message_tokens"}],"output_messages":[{"message":"o","tokens":[9],"type":"raw_message_tokens"}],"kv_transfer_params":null}"#;
    let (obj, view) = parsed(Api::Responses, body);
    let RelayPlan::Prefill(p) = relay_plan(Request { obj: &obj, view: &view, source: None }, &ON, Some("c"), "req")
    else {
        panic!()
    };
    let kept = p.after_prefill(&Bytes::copy_from_slice(answer.as_bytes()));
    assert_eq!(kept.store.unwrap().ids, vec![4, 5]);
    let out = json(&kept.body.unwrap());
    assert!(out["input_messages"].is_null() && out["output_messages"].is_null(), "{out}");
}

#[test]
fn relay_prefill_keeps_ids_in_the_cache_or_in_the_answer() {
    let body =
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"kv_transfer_params":{"do_remote_decode":true}}"#;
    let answer = r#"{"id":"a","prompt_token_ids":[4,5],"usage":{"prompt_tokens":2},"kv_transfer_params":{"remote_request_id":"eng-1","remote_port":1}}"#;
    let (obj, view) = parsed(Api::Chat, body);
    let request = Request { obj: &obj, view: &view, source: None };
    let RelayPlan::Prefill(cache) = relay_plan(request, &ON, Some("client-7"), "req") else { panic!() };
    let kept = cache.after_prefill(&Bytes::copy_from_slice(answer.as_bytes()));
    let entry = kept.store.unwrap();
    assert_eq!(entry.ids, vec![4, 5]);
    assert_eq!(entry.keys[0], CacheKey::RemoteRequestId("eng-1".into()));
    assert_eq!(entry.keys[1], CacheKey::RequestId("client-7".into()));
    assert!(matches!(entry.keys[2], CacheKey::Fingerprint(f) if f == entry.fingerprint));
    assert_eq!(json(&kept.body.unwrap())["prompt_token_ids"], serde_json::Value::Null, "hidden: not asked");

    let stateless = ReusePolicy { relay_handoff: RelayHandoff::Stateless, ..ON };
    let RelayPlan::Prefill(p) = relay_plan(request, &stateless, None, "req") else { panic!() };
    let kept = p.after_prefill(&Bytes::copy_from_slice(answer.as_bytes()));
    assert!(kept.store.is_none() && kept.kept);
    let out = String::from_utf8(kept.body.unwrap().to_vec()).unwrap();
    assert!(
        out.contains(r#""kv_transfer_params":{"remote_request_id":"eng-1","remote_port":1,"prompt_token_ids":[4,5]}"#),
        "{out}"
    );

    let RelayPlan::Prefill(p) = relay_plan(request, &ON, None, "req") else { panic!() };
    let nothing = p.after_prefill(&Bytes::copy_from_slice(br#"{"prompt_token_ids":null,"usage":{"prompt_tokens":2}}"#));
    assert!(!nothing.kept && nothing.store.is_none());
}

/// Relay decodes: where the ids come from, what is counted, what is sent.
#[test]
fn relay_decode_table() {
    let handoff = r#""kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_port":5600}"#;
    let decode_chat = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{handoff}}}"#);
    let inline =
        r#"{"model":"m","messages":[],"kv_transfer_params":{"do_remote_prefill":true,"prompt_token_ids":[9,9]}}"#;
    let bad_inline =
        r#"{"model":"m","messages":[],"kv_transfer_params":{"do_remote_prefill":true,"prompt_token_ids":[1,-2]}}"#;
    let plain = r#"{"model":"m","messages":[{"role":"user","content":"plain"}]}"#;
    let cmpl = format!(r#"{{"model":"m","prompt":"p",{handoff}}}"#);
    let cached = || Found::Ids(PromptIds::from_ids(&[1, 2, 3]));
    // (name, api, body, policy, version, expected search, what the cache gives, reuse, ids sent)
    type Row<'a> = (&'a str, Api, &'a str, ReusePolicy, DecodeVersion, bool, Option<Found>, Reuse, Option<&'a str>);
    let rows: Vec<Row<'_>> = vec![
        (
            "cache hit",
            Api::Chat,
            &decode_chat,
            ON,
            V32,
            true,
            Some(cached()),
            Reuse::Applied { tokens: 3, id_bytes: 7 },
            Some("[1,2,3]"),
        ),
        (
            "cache miss",
            Api::Chat,
            &decode_chat,
            ON,
            V32,
            true,
            Some(Found::Missing),
            Reuse::Fallback(FallbackReason::CacheMiss),
            None,
        ),
        (
            "plain miss not counted",
            Api::Chat,
            plain,
            ON,
            DecodeVersion::NotNeeded,
            true,
            Some(Found::Missing),
            Reuse::NotCounted,
            None,
        ),
        (
            "inline ids",
            Api::Chat,
            inline,
            ON,
            V32,
            false,
            None,
            Reuse::Applied { tokens: 2, id_bytes: 5 },
            Some("[9,9]"),
        ),
        (
            "inline malformed",
            Api::Chat,
            bad_inline,
            ON,
            V32,
            false,
            None,
            Reuse::Fallback(FallbackReason::IdsMalformed),
            None,
        ),
        ("route off", Api::Chat, &decode_chat, OFF, V32, false, None, Reuse::Fallback(FallbackReason::Disabled), None),
        (
            "old decode",
            Api::Chat,
            inline,
            ON,
            V26,
            false,
            None,
            Reuse::Fallback(FallbackReason::DecodeVersionOld),
            None,
        ),
        ("plain, route off", Api::Chat, plain, OFF, V32, false, None, Reuse::NotCounted, None),
        (
            "completions hit",
            Api::Completions,
            &cmpl,
            ON,
            DecodeVersion::NotNeeded,
            true,
            Some(cached()),
            Reuse::Applied { tokens: 3, id_bytes: 7 },
            Some("[1,2,3]"),
        ),
    ];
    for (name, api, body, policy, version, searches_cache, from_cache, want, ids) in rows {
        let (obj, view) = parsed(api, body);
        let RelayPlan::Decode(plan) =
            relay_plan(Request { obj: &obj, view: &view, source: None }, &policy, None, "req")
        else {
            panic!("{name}: a decode")
        };
        let found = match (plan.search(version), from_cache) {
            (Search::Cache { .. }, Some(found)) if searches_cache => found,
            (Search::Done(found), None) if !searches_cache => found,
            (other, _) => panic!("{name}: unexpected search {other:?}"),
        };
        let (body_out, reuse, _) = plan.step(found);
        assert_eq!(reuse, want, "{name}");
        match (ids, body_out) {
            (Some(ids), Some(out)) => {
                let out = json(&out.to_bytes());
                let sent =
                    if api == Api::Chat { &out["kv_transfer_params"]["prompt_token_ids"] } else { &out["prompt"] };
                assert_eq!(sent.to_string(), ids, "{name}");
                if api == Api::Completions {
                    assert_eq!(out["kv_transfer_params"]["remote_port"], 5600, "{name}: handoff kept");
                }
            }
            (None, Some(out)) => {
                assert!(
                    json(&out.to_bytes())["kv_transfer_params"].get("prompt_token_ids").is_none(),
                    "{name}: inline ids dropped"
                );
            }
            (None, None) => assert!(!body.contains("prompt_token_ids"), "{name}: unchanged only without inline ids"),
            (Some(_), None) => panic!("{name}: ids found but body unchanged"),
        }
    }
}

#[test]
fn relay_decode_asks_the_version_only_when_ids_could_apply() {
    let check = |body: &str, cache_empty: bool| {
        let (obj, view) = parsed(Api::Chat, body);
        let RelayPlan::Decode(plan) = relay_plan(Request { obj: &obj, view: &view, source: None }, &ON, None, "req")
        else {
            panic!()
        };
        plan.needs_decode_version(cache_empty)
    };
    let plain = r#"{"messages":[]}"#;
    assert!(!check(plain, true), "plain request, nothing cached: no /version probe");
    assert!(check(plain, false));
    assert!(check(r#"{"messages":[],"kv_transfer_params":{"remote_engine_id":"e"}}"#, true));
}

#[test]
fn the_prefiller_header_is_planned_before_any_leg() {
    use crate::config::parse_allow;
    use crate::plan::AllowedPrefiller;
    let rule = HeaderRule {
        name: "x-prefiller-host-port".into(),
        allow: vec![AllowedPrefiller { entry: parse_allow("127.0.0.0/8").unwrap(), tls: None }],
        trusted_sources: Vec::new(),
        forward_credentials: false,
    };
    let mut headers = http::HeaderMap::new();
    assert_eq!(prefiller_from_header(&headers, &rule, None), Ok(None));
    headers.insert("x-prefiller-host-port", "127.0.0.2:8100".parse().unwrap());
    let named = prefiller_from_header(&headers, &rule, None).map(|n| n.map(|n| n.addr));
    assert_eq!(named, Ok(Some("127.0.0.2:8100".into())));
}

/// Orchestrate routes own the handoff: a client's transfer fields are stripped or refused.
#[test]
fn client_handoff_fields_are_stripped_or_refused() {
    let body = r#"{"messages":[],"kv_transfer_params":{"remote_host":"10.9.9.9"},"temperature":1.0,"vllm_xargs":{"kv_transfer_params":{"a":1},"session_id":"s"}}"#;
    let obj = RawObject::parse(body).unwrap();
    let clean = without_client_handoff(&obj, ClientHandoff::Strip).unwrap().unwrap();
    assert_eq!(clean.to_bytes(), br#"{"messages":[],"temperature":1.0,"vllm_xargs":{"session_id":"s"}}"#);
    let err = without_client_handoff(&obj, ClientHandoff::Reject).unwrap_err();
    assert_eq!((err.status(), err.code()), (400, "invalid_request"));
    assert!(String::from_utf8(err.body()).unwrap().contains(r#""param":"kv_transfer_params""#));
    let xargs_only = RawObject::parse(r#"{"prompt":"p","vllm_xargs":{"ec_transfer_params":{}}}"#).unwrap();
    assert!(without_client_handoff(&xargs_only, ClientHandoff::Reject).is_err());
    let plain = RawObject::parse(r#"{"prompt":"p","vllm_xargs":{"session_id":"s"}}"#).unwrap();
    assert!(without_client_handoff(&plain, ClientHandoff::Reject).unwrap().is_none(), "nothing to remove");
}

/// The Responses prefill leg: `max_output_tokens` 1, not stored, not streamed, ids asked with
/// `enable_response_messages` (vLLM ignores `return_token_ids` there); Messages: `max_tokens`
/// 1 and nothing asked (it cannot echo).
#[test]
fn responses_and_messages_prefill_bodies() {
    let (obj, view) = parsed(Api::Responses, r#"{"input":"hi","max_output_tokens":50,"stream":true,"store":true}"#);
    let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, &ON, V32, "req");
    assert_eq!(plan.gate, Gate::Reuse);
    let p = json(&plan.prefill_body.to_bytes());
    assert_eq!(
        (p["max_output_tokens"].as_u64(), p["stream"].as_bool(), p["store"].as_bool()),
        (Some(1), Some(false), Some(false))
    );
    assert_eq!(p["enable_response_messages"], true);
    assert!(p.get("return_token_ids").is_none() && p.get("max_tokens").is_none());
    assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);

    let (obj, view) = parsed(Api::Messages, MSG);
    let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, &ON, V32, "req");
    assert_eq!(plan.gate, Gate::Fallback(FallbackReason::IdsNotEchoed));
    let p = json(&plan.prefill_body.to_bytes());
    assert_eq!(p["max_tokens"], 1);
    assert!(p.get("return_token_ids").is_none() && p.get("enable_response_messages").is_none());
    assert!(!needs_decode_version(&view, &ON, "req"));
}

/// Responses requests that need the decode's stored answers skip the prefill entirely.
#[test]
fn stateful_responses_go_to_the_decode_alone() {
    for body in [
        r#"{"input":"hi","previous_response_id":"resp_1"}"#,
        r#"{"input":"hi","conversation":"conv_1"}"#,
        r#"{"input":"hi","background":true,"store":true}"#,
    ] {
        let (obj, view) = parsed(Api::Responses, body);
        let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, &ON, V32, "req");
        let step = plan.decode_only().unwrap_or_else(|| panic!("{body}"));
        assert_eq!(step.reuse, Reuse::Fallback(FallbackReason::Stateful));
        assert_eq!(step.body.to_bytes(), body.as_bytes());
    }
    let (obj, view) = parsed(Api::Responses, r#"{"input":"hi","previous_response_id":null,"background":false}"#);
    assert!(orchestrate(Request { obj: &obj, view: &view, source: None }, &ON, V32, "req").decode_only().is_none());
}

/// A request vLLM refuses for a field the prefill leg rewrites goes to the decode alone, as
/// sent (the decode refuses it in vLLM's words; no prefill holds KV for it), without asking
/// the decode's version.
#[test]
fn refusals_the_prefill_would_hide_go_to_the_decode_alone() {
    for (api, body) in [
        (Api::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"stream_options":{"include_usage":true}}"#),
        (Api::Completions, r#"{"prompt":"hi","prompt_logprobs":1,"stream":true}"#),
    ] {
        let (obj, view) = parsed(api, body);
        assert!(!needs_decode_version(&view, &ON, "req"), "{body}");
        let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, &ON, V32, "req");
        let step = plan.decode_only().unwrap_or_else(|| panic!("{body}"));
        assert_eq!(step.reuse, Reuse::Fallback(FallbackReason::VllmRefuses));
        assert_eq!(step.body.to_bytes(), body.as_bytes());
    }
}

/// A fractional `token_reuse` admits a share of request ids, the same ids every time, and a
/// larger share admits a superset. Deterministic: fixed ids, fixed-key hash, so the bound
/// below cannot flake (for 20,000 ids the binomial standard deviation at 0.3 is 0.0032;
/// the bound is 0.015, more than 4.6 of them).
#[test]
fn canary_share_admits_its_fraction_deterministically() {
    let ids: Vec<String> = (0..20_000).map(|i| format!("req-{i}")).collect();
    for share in [0.01, 0.1, 0.3, 0.5, 0.9] {
        let s = ReuseShare::from_fraction(share).unwrap();
        let admitted = ids.iter().filter(|id| s.admits(id)).count();
        let got = admitted as f64 / ids.len() as f64;
        assert!((got - share).abs() < 0.015, "share {share}: admitted {got}");
        // Monotone: raising the share only adds requests.
        let larger = ReuseShare::from_fraction((share + 0.05).min(1.0)).unwrap();
        assert!(ids.iter().all(|id| !s.admits(id) || larger.admits(id)), "share {share}");
    }
    assert!(ids.iter().all(|id| ReuseShare::ON.admits(id) && !ReuseShare::OFF.admits(id)));
    for bad in [-0.1, 1.01, f64::NAN] {
        assert_eq!(ReuseShare::from_fraction(bad), None);
    }
}

/// Left out of the share: the `canary` fallback, no ids asked; in: reuse. Off stays `disabled`.
#[test]
fn canary_gate_counts_the_left_out_requests() {
    let (obj, view) = parsed(Api::Chat, CHAT);
    let half = ReusePolicy { token_reuse: ReuseShare::from_fraction(0.5).unwrap(), ..ON };
    let ids: Vec<String> = (0..200).map(|i| format!("r{i}")).collect();
    let (inside, outside): (Vec<&String>, Vec<&String>) = ids.iter().partition(|id| half.token_reuse.admits(id));
    assert!(!inside.is_empty() && !outside.is_empty());
    let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, &half, V32, inside[0]);
    assert_eq!(plan.gate, Gate::Reuse);
    let plan = orchestrate(Request { obj: &obj, view: &view, source: None }, &half, V32, outside[0]);
    assert_eq!(plan.gate, Gate::Fallback(FallbackReason::Canary));
    assert!(json(&plan.prefill_body.to_bytes()).get("return_token_ids").is_none());
    assert!(!needs_decode_version(&view, &half, outside[0]));
    let zero = ReusePolicy { token_reuse: ReuseShare::from_fraction(0.0).unwrap(), ..ON };
    assert_eq!(
        orchestrate(Request { obj: &obj, view: &view, source: None }, &zero, V32, "x").gate,
        Gate::Fallback(FallbackReason::Disabled)
    );
}
