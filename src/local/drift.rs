//! History drift: how many tokens of a conversation's earlier prompt a follow-up turn no longer
//! repeats token for token, and from where, because the chat template renders a past turn
//! otherwise than it rendered it as the latest one (Qwen3 drops the reasoning of earlier
//! assistant turns): the prefix-cache misses a template causes. Pure: the caller renders.

use crate::render::pyjson::{self, DumpsOptions, PyValue};

/// Where a follow-up turn's prompt leaves the conversation as it stood when its last assistant
/// turn was generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drift {
    /// Tokens the two have in common from the start.
    pub at: usize,
    /// Tokens of the earlier conversation from `at` on that the follow-up renders otherwise
    /// (0: the follow-up repeats it whole).
    pub changed: usize,
}

impl Drift {
    /// The drift of `now` (the follow-up's prompt ids) from `then` (the conversation's ids up
    /// to the end of its last assistant turn, rendered as the latest turn).
    pub fn between(then: &[u32], now: &[u32]) -> Self {
        let at = then.iter().zip(now).take_while(|(a, b)| a == b).count();
        Self { at, changed: then.len() - at }
    }
}

/// The chat body of the conversation as it stood when the last assistant message of `body`
/// had just been generated: the messages up to and including it, rendered without a
/// generation prompt (the template renders it as the latest turn, reasoning included where it
/// keeps it), other fields as sent. `None` when no message follows an assistant message, when
/// the request continues its final message, or when the body is not a JSON object with a
/// message list.
pub fn previous_turn(body: &[u8]) -> Option<Vec<u8>> {
    let PyValue::Dict(fields) = pyjson::loads(std::str::from_utf8(body).ok()?).ok()? else { return None };
    if fields.iter().any(|(k, v)| k == "continue_final_message" && *v == PyValue::Bool(true)) {
        return None;
    }
    let messages = fields.iter().find_map(|(k, v)| match (k.as_str(), v) {
        ("messages", PyValue::List(m)) => Some(m),
        _ => None,
    })?;
    let is_assistant = |m: &PyValue| m.get("role").and_then(PyValue::as_str) == Some("assistant");
    let last = messages.iter().rposition(is_assistant).filter(|&i| i + 1 < messages.len())?;
    let kept = PyValue::List(messages.iter().take(last + 1).cloned().collect());
    let mut then: Vec<(String, PyValue)> = fields
        .iter()
        .filter(|(k, _)| k != "add_generation_prompt")
        .map(|(k, v)| (k.clone(), if k == "messages" { kept.clone() } else { v.clone() }))
        .collect();
    then.push(("add_generation_prompt".to_owned(), PyValue::Bool(false)));
    let compact = DumpsOptions { separators: Some((",".to_owned(), ":".to_owned())), ..DumpsOptions::default() };
    Some(pyjson::dumps(&PyValue::Dict(then), &compact).into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_previous_turn_ends_at_the_last_assistant_message() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b","reasoning_content":"r"},{"role":"user","content":"c"}],"add_generation_prompt":true,"max_tokens":3}"#;
        let then = String::from_utf8(previous_turn(body).unwrap()).unwrap();
        assert_eq!(
            then,
            r#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b","reasoning_content":"r"}],"max_tokens":3,"add_generation_prompt":false}"#
        );
        for none in [
            &br#"{"messages":[{"role":"user","content":"a"}]}"#[..],
            br#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}"#,
            br#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"user","content":"c"}],"continue_final_message":true}"#,
            br#"[1]"#,
        ] {
            assert_eq!(previous_turn(none), None, "{}", String::from_utf8_lossy(none));
        }
    }

    #[test]
    fn drift_counts_the_earlier_tokens_from_the_first_difference() {
        assert_eq!(Drift::between(&[1, 2, 3], &[1, 2, 3, 4]), Drift { at: 3, changed: 0 });
        assert_eq!(Drift::between(&[1, 2, 9, 9, 5], &[1, 2, 5, 6]), Drift { at: 2, changed: 3 });
        assert_eq!(Drift::between(&[], &[1]), Drift { at: 0, changed: 0 });
    }
}
