//! vLLM's content-format detection (`_detect_content_format`) done by scanning a chat
//! template's text: "openai" (content as text parts) when it loops over a message's content,
//! "string" when nothing content-like is looped over, unknown otherwise (refused).

/// The statements of a template (`{% ... %}`), their whitespace controls trimmed.
fn statements(source: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        let after = rest.get(open + 2..).unwrap_or_default();
        let end = after.find("%}").unwrap_or(after.len());
        out.push(
            after.get(..end).unwrap_or_default().trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace()),
        );
        rest = after.get(end..).unwrap_or_default();
    }
    out
}

/// A `for` statement's target and iterated expression.
fn for_loop(statement: &str) -> Option<(&str, &str)> {
    let (target, iter) = statement.strip_prefix("for ")?.split_once(" in ")?;
    Some((target.trim(), iter.trim()))
}

/// How vLLM's `_detect_content_format` reads the template: `Some(true)` for "openai" when
/// it certainly says so (a `for` over `M['content']` or `M.content`, `M` the target of a
/// loop over `messages` or a name set from it, e.g. `loop_messages = messages[1:]`),
/// `Some(false)` for "string" when no loop iterates anything named like content nor a macro's
/// parameter, `None` when only vLLM's AST walk can tell (that one is refused).
pub(super) fn content_format_is_openai(source: &str) -> Option<bool> {
    let statements = statements(source);
    let loops: Vec<(&str, &str)> = statements.iter().filter_map(|s| for_loop(s)).collect();
    // a macro may be handed a message's content under another name; vLLM follows the calls
    let macro_params: Vec<&str> = statements
        .iter()
        .filter_map(|s| s.strip_prefix("macro ")?.split_once('(')?.1.split_once(')'))
        .flat_map(|(params, _)| params.split(',').map(|p| p.split('=').next().unwrap_or_default().trim()))
        .collect();
    if loops.iter().any(|(_, iter)| macro_params.contains(iter)) {
        return None;
    }
    if !loops.iter().any(|(_, iter)| iter.contains("content")) {
        return Some(false);
    }
    // names holding the messages: `messages`, and those set from it (a slice at most)
    let mut lists = vec!["messages"];
    for s in &statements {
        if let Some((name, value)) = s.strip_prefix("set ").and_then(|a| a.split_once('=')) {
            let (name, value) = (name.trim(), value.trim());
            let base = value.split('[').next().unwrap_or_default().trim();
            if lists.contains(&base) && name.chars().all(|c| c.is_alphanumeric() || c == '_') {
                lists.push(name);
            }
        }
    }
    let messages: Vec<&str> = loops
        .iter()
        .filter(|(target, iter)| {
            lists.contains(&iter.split('[').next().unwrap_or_default().trim())
                && target.chars().all(|c| c.is_alphanumeric() || c == '_')
        })
        .map(|(target, _)| *target)
        .collect();
    let over_content = loops.iter().any(|(_, iter)| {
        messages.iter().any(|m| *iter == format!("{m}['content']") || *iter == format!("{m}.content"))
    });
    over_content.then_some(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_looping_over_content_is_openai_format() {
        let openai = "{% for message in messages %}{% for part in message['content'] %}{% endfor %}{% endfor %}";
        assert_eq!(content_format_is_openai(openai), Some(true));
        let sliced = "{%- set loop_messages = messages[1:] -%}{%- for m in loop_messages -%}{%- for c in m.content -%}";
        assert_eq!(content_format_is_openai(sliced), Some(true));
        let string = "{% for message in messages %}{{ message.content }}{% endfor %}";
        assert_eq!(content_format_is_openai(string), Some(false));
        // a loop over something content-like that is not a message's content: only vLLM's AST walk knows
        assert_eq!(content_format_is_openai("{% for c in contents %}{% endfor %}"), None);
        assert_eq!(content_format_is_openai("{# for x in content #}{{ 'for a in content' }}"), Some(false));
        // a macro looping over its parameter may be handed message.content
        let in_macro = "{% macro parts(c, sep='') %}{% for p in c %}{% endfor %}{% endmacro %}";
        assert_eq!(content_format_is_openai(in_macro), None);
    }
}
