//! The fake's `/v1/responses` and `/v1/messages`, shaped like the vLLM 0.32 recordings
//! (`tests/fixtures/vllm/responses_*`, `messages_*`): Responses echo the prompt ids only with
//! `enable_response_messages` (`input_messages[0].tokens`; `return_token_ids` is ignored), both
//! take `kv_transfer_params.prompt_token_ids` on the decode, Messages never echo ids, and a
//! `previous_response_id` the engine did not store is a 404.

use axum::http::HeaderMap;
use serde_json::{json, Value};

use super::{error_body, fake_render_chat, fake_tokenize, ids_json, output_ids, token_text, FakeConfig, Reply};

/// The text the fake renders a Responses request to (`instructions` as a system turn, a
/// string `input` as one user turn).
pub fn fake_render_responses(body: &Value) -> String {
    let mut messages = Vec::new();
    if let Some(i) = body["instructions"].as_str() {
        messages.push(json!({"role": "system", "content": i}));
    }
    match &body["input"] {
        Value::String(s) => messages.push(json!({"role": "user", "content": s})),
        Value::Array(items) => messages.extend(items.iter().cloned()),
        _ => {}
    }
    fake_render_chat(&json!({"messages": messages}))
}

/// The text the fake renders a Messages request to (`system` as a system turn).
fn fake_render_messages(body: &Value) -> String {
    let mut messages = Vec::new();
    if let Some(s) = body["system"].as_str() {
        messages.push(json!({"role": "system", "content": s}));
    }
    messages.extend(body["messages"].as_array().into_iter().flatten().cloned());
    fake_render_chat(&json!({"messages": messages}))
}

/// The prompt: the reused ids (0.32+) or the rendered text, tokenized.
fn prompt(config: &FakeConfig, body: &Value, render: fn(&Value) -> String) -> Result<Vec<u64>, (u16, String)> {
    let reused = body["kv_transfer_params"].get("prompt_token_ids").filter(|_| config.version.as_str() >= "0.32.0");
    match reused {
        None => Ok(fake_tokenize(&render(body))),
        Some(ids) => ids
            .as_array()
            .filter(|a| !a.is_empty())
            .and_then(|a| a.iter().map(|v| v.as_u64().filter(|&i| i < 151_936)).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| {
                error_body(
                    400,
                    "BadRequestError",
                    "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers.",
                    Some("kv_transfer_params.prompt_token_ids"),
                )
            }),
    }
}

fn kv_json(config: &FakeConfig, body: &Value, id: &str, n_prompt: usize) -> String {
    if body["kv_transfer_params"]["do_remote_decode"].as_bool() != Some(true) {
        return "null".into();
    }
    if let Some(raw) = &config.kv_params_raw {
        return raw.clone();
    }
    if config.connector {
        return super::nixl_kv_params(id, n_prompt);
    }
    "null".into()
}

/// The id vLLM answers a Responses request under: its `request_id`, else one of its own
/// (here `resp_` and the `x-request-id`).
pub(super) fn response_id(headers: &HeaderMap, body: &Value) -> String {
    let rid = headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("0000");
    body["request_id"].as_str().map_or_else(|| format!("resp_{rid}"), str::to_owned)
}

/// `POST /v1/responses`.
pub(super) fn responses(config: &FakeConfig, headers: &HeaderMap, body: &Value) -> Result<Reply, (u16, String)> {
    if let Some(prev) = body["previous_response_id"].as_str() {
        if !config.stored_responses.iter().any(|s| s == prev) {
            return Err(error_body(
                404,
                "invalid_request_error",
                &format!("Response with id '{prev}' not found."),
                Some("response_id"),
            ));
        }
    }
    let ids = prompt(config, body, fake_render_responses)?;
    let max = body["max_output_tokens"].as_u64().unwrap_or(16) as usize;
    let out = output_ids(&ids, max);
    let rid = headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("0000");
    let id = response_id(headers, body);
    let text: String = out.iter().map(|&t| token_text(t)).collect();
    let text_json = serde_json::to_string(&text).unwrap();
    let (n, m) = (ids.len(), out.len());
    let cached = config.cached_tokens.unwrap_or(0);
    let usage = format!("{{\"input_tokens\":{n},\"input_tokens_details\":{{\"cached_tokens\":{cached},\"cache_write_tokens\":0,\"input_tokens_per_turn\":[],\"cached_tokens_per_turn\":[]}},\"output_tokens\":{m},\"output_tokens_details\":{{\"reasoning_tokens\":0,\"tool_output_tokens\":0,\"output_tokens_per_turn\":[],\"tool_output_tokens_per_turn\":[]}},\"total_tokens\":{}}}", n + m);
    let echo = body["enable_response_messages"].as_bool() == Some(true) && !config.omit_prompt_ids;
    let prompt_tokens = config.corrupt_prompt_ids.clone().unwrap_or_else(|| ids_json(&ids));
    let (input_messages, output_messages) = if echo {
        (
            format!("[{{\"message\":\"<prompt>\",\"tokens\":{prompt_tokens},\"type\":\"raw_message_tokens\"}}]"),
            format!("[{{\"message\":{text_json},\"tokens\":{},\"type\":\"raw_message_tokens\"}}]", ids_json(&out)),
        )
    } else {
        ("null".into(), "null".into())
    };
    let kv = kv_json(config, body, &id, n);
    let output = format!("[{{\"id\":\"msg_{rid}\",\"content\":[{{\"annotations\":[],\"text\":{text_json},\"type\":\"output_text\",\"logprobs\":null}}],\"role\":\"assistant\",\"status\":\"completed\",\"type\":\"message\"}}]");
    let response = |status: &str, output: &str, usage: &str| {
        format!("{{\"id\":\"{id}\",\"created_at\":1796126654,\"incomplete_details\":null,\"instructions\":null,\"metadata\":null,\"model\":\"{}\",\"object\":\"response\",\"output\":{output},\"parallel_tool_calls\":true,\"temperature\":0.0,\"tool_choice\":\"none\",\"tools\":[],\"top_p\":1.0,\"background\":false,\"max_output_tokens\":{max},\"status\":\"{status}\",\"usage\":{usage},\"user\":null,\"kv_transfer_params\":{kv},\"ec_transfer_params\":null,\"input_messages\":{input_messages},\"output_messages\":{output_messages}}}", config.model)
    };
    if body["stream"].as_bool() != Some(true) {
        return Ok(Reply::Json(response("completed", &output, &usage)));
    }
    let event = |kind: &str, data: String| format!("event: {kind}\ndata: {data}\n\n");
    let mut events = vec![event(
        "response.created",
        format!(
            "{{\"response\":{},\"sequence_number\":0,\"type\":\"response.created\"}}",
            response("in_progress", "[]", "null")
        ),
    )];
    for (i, &t) in out.iter().enumerate() {
        let delta = serde_json::to_string(&token_text(t)).unwrap();
        events.push(event(
            "response.output_text.delta",
            format!("{{\"content_index\":0,\"delta\":{delta},\"item_id\":\"msg_{rid}\",\"output_index\":0,\"sequence_number\":{},\"type\":\"response.output_text.delta\"}}", i + 1),
        ));
    }
    events.push(event(
        "response.completed",
        format!(
            "{{\"response\":{},\"sequence_number\":{},\"type\":\"response.completed\"}}",
            response("completed", &output, &usage),
            m + 1
        ),
    ));
    Ok(Reply::Sse(events))
}

/// `POST /v1/messages`.
pub(super) fn messages(config: &FakeConfig, headers: &HeaderMap, body: &Value) -> Result<Reply, (u16, String)> {
    let ids = prompt(config, body, fake_render_messages)?;
    let max = body["max_tokens"]
        .as_u64()
        .ok_or_else(|| error_body(400, "BadRequestError", "max_tokens is required", Some("max_tokens")))?
        as usize;
    let out = output_ids(&ids, max);
    let rid = headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("0000");
    let id = format!("chatcmpl-{rid}");
    let text: String = out.iter().map(|&t| token_text(t)).collect();
    let (n, m, model) = (ids.len(), out.len(), &config.model);
    let kv = kv_json(config, body, &id, n);
    let kv_member = if kv == "null" { String::new() } else { format!(",\"kv_transfer_params\":{kv}") };
    if body["stream"].as_bool() != Some(true) {
        let text_json = serde_json::to_string(&text).unwrap();
        return Ok(Reply::Json(format!("{{\"id\":\"{id}\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[{{\"type\":\"text\",\"text\":{text_json}}}],\"model\":\"{model}\",\"stop_reason\":\"max_tokens\",\"usage\":{{\"input_tokens\":{n},\"output_tokens\":{m}}}{kv_member}}}")));
    }
    let event = |kind: &str, data: String| format!("event: {kind}\ndata: {data}\n\n");
    let mut events = vec![
        event("message_start", format!("{{\"type\":\"message_start\",\"message\":{{\"id\":\"{id}\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"{model}\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{{\"input_tokens\":{n},\"output_tokens\":0}}}}}}")),
        event("content_block_start", "{\"type\":\"content_block_start\",\"content_block\":{\"type\":\"text\",\"text\":\"\"},\"index\":0}".into()),
    ];
    for &t in &out {
        let delta = serde_json::to_string(&token_text(t)).unwrap();
        events.push(event("content_block_delta", format!("{{\"type\":\"content_block_delta\",\"delta\":{{\"type\":\"text_delta\",\"text\":{delta}}},\"index\":0}}")));
    }
    events.push(event("content_block_stop", "{\"type\":\"content_block_stop\",\"index\":0}".into()));
    events.push(event("message_delta", format!("{{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"max_tokens\",\"stop_sequence\":null}},\"usage\":{{\"input_tokens\":{n},\"output_tokens\":{m}}}}}")));
    events.push(event("message_stop", "{\"type\":\"message_stop\"}".into()));
    Ok(Reply::Sse(events))
}

/// `POST /inference/v1/generate` (`output_mode` "tokens"), shaped like the recordings
/// (`tests/fixtures/vllm/generate_*`): the prompt is `token_ids`, the limits are in
/// `sampling_params` (vLLM's validation 400 without either), the answer is ids.
pub(super) fn generate(config: &FakeConfig, headers: &HeaderMap, body: &Value) -> Result<Reply, (u16, String)> {
    // vLLM's request-validation answer (`err_generate_no_sampling_params`).
    let missing = |field: &str| {
        let message = format!("1 validation error:\n  {{'type': 'missing', 'loc': 'body.{field}', 'msg': 'Field required', 'input': '<dict>'}}");
        error_body(400, "Bad Request", &message, Some(&format!("body.{field}")))
    };
    let ids: Vec<u64> =
        body["token_ids"].as_array().ok_or_else(|| missing("token_ids"))?.iter().filter_map(Value::as_u64).collect();
    let params = body.get("sampling_params").filter(|p| p.is_object()).ok_or_else(|| missing("sampling_params"))?;
    let max = params["max_tokens"].as_u64().unwrap_or(16) as usize;
    let out = output_ids(&ids, max);
    let rid = headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("0000");
    let id = format!("generate-tokens-{rid}");
    let (n, m, model) = (ids.len(), out.len(), &config.model);
    let kv = kv_json(config, body, &id, n);
    let details = config.cached_tokens.map_or("null".to_owned(), |c| format!("{{\"cached_tokens\":{c}}}"));
    let versions = format!("[{{\"version\":\"default\",\"start\":0,\"end\":{m}}}]");
    if body["stream"].as_bool() != Some(true) {
        let usage = format!("{{\"prompt_tokens\":{n},\"total_tokens\":{},\"completion_tokens\":{m},\"prompt_tokens_details\":{details},\"completion_tokens_details\":null}}", n + m);
        return Ok(Reply::Json(format!("{{\"request_id\":\"{id}\",\"model\":\"{model}\",\"created\":1796231186,\"usage\":{usage},\"prompt_logprobs\":null,\"prompt_token_id_logprobs\":null,\"prompt_token_ids\":null,\"mm_placeholders\":null,\"metrics\":null,\"kv_transfer_params\":{kv},\"ec_transfer_params\":null,\"output_mode\":\"tokens\",\"choices\":[{{\"index\":0,\"finish_reason\":\"length\",\"stop_reason\":null,\"token_ids\":{},\"routed_experts\":null,\"sampling_mask\":null,\"weight_versions\":{versions},\"logprobs\":null}}]}}", ids_json(&out))));
    }
    let mut events: Vec<String> = out
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (finish, weights) = if i + 1 == m { ("\"length\"", versions.as_str()) } else { ("null", "null") };
            format!("data: {{\"request_id\":\"{id}\",\"usage\":null,\"output_mode\":\"tokens\",\"choices\":[{{\"index\":0,\"finish_reason\":{finish},\"stop_reason\":null,\"token_ids\":[{t}],\"routed_experts\":null,\"sampling_mask\":null,\"weight_versions\":{weights},\"logprobs\":null}}]}}\n\n")
        })
        .collect();
    if body["stream_options"]["include_usage"].as_bool() == Some(true) {
        let cached = config
            .cached_tokens
            .map_or(String::new(), |c| format!(",\"prompt_tokens_details\":{{\"cached_tokens\":{c}}}"));
        let usage = format!("{{\"prompt_tokens\":{n},\"total_tokens\":{},\"completion_tokens\":{m}{cached}}}", n + m);
        events.push(format!(
            "data: {{\"request_id\":\"{id}\",\"usage\":{usage},\"output_mode\":\"tokens\",\"choices\":[]}}\n\n"
        ));
    }
    events.push("data: [DONE]\n\n".into());
    Ok(Reply::Sse(events))
}
