//! A client's side: request bodies, POSTs to tokenonce (a plain chat among them), and the
//! answers read (SSE events, OpenAI-shaped errors).

/// A plain chat request body.
pub fn chat_body(user: &str, extra: serde_json::Value) -> serde_json::Value {
    let body = serde_json::json!({
        "model": "tiny-qwen3",
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": user}],
        "max_tokens": 5,
        "temperature": 0
    });
    with_extra(body, extra)
}

/// `body` with the members of `extra` added (replacing those of the same name).
pub fn with_extra(mut body: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

/// The JSON of every `data:` event but `[DONE]`; each must parse (no half event).
pub fn whole_events(text: &str) -> Vec<serde_json::Value> {
    text.split("\n\n")
        .filter(|e| !e.is_empty() && *e != "data: [DONE]")
        .map(|e| {
            let data = e.strip_prefix("data: ").unwrap_or_else(|| panic!("not an event: {e:?} in {text}"));
            serde_json::from_str(data).unwrap_or_else(|_| panic!("half an event: {e:?} in {text}"))
        })
        .collect()
}

/// POSTs raw bytes; returns status, headers and body.
pub async fn post_raw(
    url: &str,
    body: impl Into<reqwest::Body>,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut req = reqwest::Client::new().post(url).header("content-type", "application/json").body(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.text().await.unwrap())
}

/// POSTs JSON.
pub async fn post_json(
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, String) {
    post_raw(url, serde_json::to_vec(body).unwrap(), headers).await
}

/// POSTs a plain chat ([`chat_body`] of `user` with `extra`) and `headers` to
/// `{base}/v1/chat/completions`: status and body.
pub async fn post_chat(base: &str, user: &str, extra: serde_json::Value, headers: &[(&str, &str)]) -> (u16, String) {
    let (status, _, text) = post_json(&format!("{base}/v1/chat/completions"), &chat_body(user, extra), headers).await;
    (status, text)
}

/// Asserts `text` is tokenonce's OpenAI-shaped error with `code` (a message and a type), naming
/// no internal address.
pub fn assert_openai_error(text: &str, code: &str) {
    let json: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|_| panic!("not JSON: {text}"));
    assert_eq!(json["error"]["code"], code, "{text}");
    assert!(json["error"]["message"].is_string() && json["error"]["type"].is_string(), "{text}");
    assert!(!text.contains("127.0.0.1"), "an internal address in {text}");
}
