//! The request's tools as mistral-common 1.13 takes them in vLLM's Mistral mode: each
//! `Tool.from_openai` (a function with a valid name, its description, its parameters), the
//! parameters' JSON schema checked as Draft 7's meta-schema would accept it.

use super::pyjson::PyValue;
use super::Unsupported::{self, Unverified};

/// The request's tools as `Tool.model_dump(exclude strict)` gives them to the encoder.
pub(super) fn parse_tools(req: &PyValue) -> Result<Vec<PyValue>, Unsupported> {
    let tools = match req.get("tools") {
        None | Some(PyValue::Null) => return Ok(Vec::new()),
        // vLLM 0.32 in Mistral mode refuses it while rendering (400, "`tools` must not be an
        // empty array"); token-in would skip that rendering and answer it.
        Some(PyValue::List(tools)) if tools.is_empty() => return Err(Unsupported::VllmRejects("tools: []")),
        Some(PyValue::List(tools)) => tools,
        Some(_) => return Err(Unsupported::VllmRejects("tools not a list")),
    };
    tools.iter().map(parse_tool).collect()
}

fn parse_tool(tool: &PyValue) -> Result<PyValue, Unsupported> {
    if tool.get("type").and_then(PyValue::as_str) != Some("function") {
        return Err(Unverified("tool type other than function"));
    }
    let function = tool.get("function").ok_or(Unsupported::VllmRejects("tool without a function"))?;
    let name = match function.get("name") {
        Some(PyValue::Str(name)) if valid_name(name) => name.clone(),
        Some(PyValue::Str(_)) => return Err(Unsupported::VllmRejects("tool name not [a-zA-Z0-9_-]{1,64}")),
        _ => return Err(Unsupported::VllmRejects("tool without a string name")),
    };
    let description = match function.get("description") {
        None | Some(PyValue::Null) => String::new(),
        Some(PyValue::Str(d)) => d.clone(),
        Some(_) => return Err(Unverified("tool description not a string")),
    };
    let parameters = match function.get("parameters") {
        None | Some(PyValue::Null) => PyValue::Dict(Vec::new()),
        Some(p @ PyValue::Dict(_)) => {
            check_schema(p)?;
            p.clone()
        }
        Some(_) => return Err(Unverified("tool parameters not an object")),
    };
    let function = PyValue::Dict(vec![
        ("name".into(), PyValue::Str(name)),
        ("description".into(), PyValue::Str(description)),
        ("parameters".into(), parameters),
    ]);
    Ok(PyValue::Dict(vec![("type".into(), PyValue::Str("function".into())), ("function".into(), function)]))
}

/// A tool schema that Draft 7's meta-schema accepts for sure (mistral-common checks it with
/// `jsonschema`): the common keywords with values of their types; anything else is refused
/// rather than judged.
fn check_schema(schema: &PyValue) -> Result<(), Unsupported> {
    const TYPES: [&str; 7] = ["array", "boolean", "integer", "null", "number", "object", "string"];
    let unverified = |_| Unverified("tool schema keyword not checked here");
    let PyValue::Dict(fields) = schema else {
        return match schema {
            PyValue::Bool(_) => Ok(()),
            _ => Err(Unverified("tool schema not an object")),
        };
    };
    let is_type = |v: &PyValue| matches!(v, PyValue::Str(s) if TYPES.contains(&s.as_str()));
    let is_count = |v: &PyValue| matches!(v, PyValue::Int(digits) if !digits.starts_with('-'));
    for (key, value) in fields {
        let ok = match key.as_str() {
            "type" => match value {
                PyValue::List(types) => !types.is_empty() && types.iter().all(is_type) && !has_duplicates(types),
                v => is_type(v),
            },
            "properties" | "definitions" | "$defs" => match value {
                PyValue::Dict(props) => {
                    props.iter().try_for_each(|(_, s)| check_schema(s))?;
                    true
                }
                _ => false,
            },
            "items" | "additionalProperties" | "not" => match value {
                PyValue::List(schemas) if key == "items" => {
                    schemas.iter().try_for_each(check_schema)?;
                    true
                }
                s => {
                    check_schema(s)?;
                    true
                }
            },
            "anyOf" | "oneOf" | "allOf" => match value {
                PyValue::List(schemas) if !schemas.is_empty() => {
                    schemas.iter().try_for_each(check_schema)?;
                    true
                }
                _ => false,
            },
            "required" => match value {
                PyValue::List(names) => names.iter().all(|n| n.as_str().is_some()) && !has_duplicates(names),
                _ => false,
            },
            "enum" | "examples" => matches!(value, PyValue::List(_)),
            "description" | "title" | "$comment" | "format" => value.as_str().is_some(),
            "default" | "const" => true,
            "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum" => {
                matches!(value, PyValue::Int(_) | PyValue::Float(_))
            }
            "minLength" | "maxLength" | "minItems" | "maxItems" | "minProperties" | "maxProperties" => is_count(value),
            "uniqueItems" => matches!(value, PyValue::Bool(_)),
            _ => return Err(unverified(())),
        };
        if !ok {
            return Err(Unverified("tool schema keyword with a value Draft 7 may refuse"));
        }
    }
    Ok(())
}

fn has_duplicates(values: &[PyValue]) -> bool {
    values.iter().enumerate().any(|(i, v)| values.iter().skip(i + 1).any(|w| w == v))
}

/// `^[a-zA-Z0-9_-]{1,64}$` (refusing the trailing newline Python's `$` would let through).
pub(super) fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(text: &str) -> Result<(), Unsupported> {
        check_schema(&crate::render::pyjson::loads(text).unwrap())
    }

    /// Common keywords with values of their types pass; anything else is refused, not judged.
    #[test]
    fn tool_schemas_pass_only_when_draft_7_surely_accepts_them() {
        let ok = r#"{"type": "object", "properties": {"x": {"type": ["string", "null"], "enum": ["a"]}},
            "required": ["x"], "additionalProperties": false, "items": [{"minItems": 1}]}"#;
        assert_eq!(schema(ok), Ok(()));
        assert!(schema(r#"{"pattern": "^a"}"#).is_err());
        assert!(schema(r#"{"type": ["string", "string"]}"#).is_err());
        assert!(schema(r#"{"minLength": -1}"#).is_err());
        assert!(schema(r#"{"properties": {"x": {"if": {}}}}"#).is_err());
    }

    /// `^[a-zA-Z0-9_-]{1,64}$`, without the trailing newline Python's `$` lets through.
    #[test]
    fn function_names_follow_mistral_commons_pattern() {
        assert!(valid_name("get_weather-2"));
        assert!(!valid_name(""));
        assert!(!valid_name("f\n"));
        assert!(!valid_name(&"a".repeat(65)));
    }
}
