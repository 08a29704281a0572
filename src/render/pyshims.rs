//! The shims that make minijinja render as jinja2 does under transformers: the environment
//! (`trim_blocks`, Python's tests, filters and string methods, `tojson`, `raise_exception`),
//! Python's `str()` of values, `strftime_now`, and Python values turned into template values.

use std::sync::atomic::{AtomicUsize, Ordering};

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, UndefinedBehavior, Value};

use super::load::LoadError;
use super::pyjson::{self, DumpsOptions, PyValue, Writer};
use super::strftime::strftime;
use super::Unsupported;

/// Marks the error `raise_exception` returns, to tell it from a renderer limitation.
const RAISED: &str = "template raised: ";

/// The context variable through which `tojson` counts the `NaN`s it writes in one render.
pub(super) const NAN_SINK: &str = "__tokenonce_nan_sink";

/// The counter behind [`NAN_SINK`], read by the renderer once the template is done.
#[derive(Debug, Default)]
pub(super) struct NanSink(pub(super) AtomicUsize);

impl minijinja::value::Object for NanSink {}

/// A render error as a fallback reason: `raise_exception`'s own message, else a feature the
/// renderer lacks.
pub(super) fn classify(e: Error) -> Unsupported {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = cur {
        if let Some(me) = err.downcast_ref::<Error>() {
            if let Some(detail) = me.detail() {
                if let Some(msg) = detail.strip_prefix(RAISED) {
                    return Unsupported::TemplateRaised(msg.to_string());
                }
            }
        }
        cur = err.source();
    }
    Unsupported::TemplateFeature(format!("{e:#}"))
}

/// The environment transformers' `_compile_jinja_template` sets up, in minijinja.
pub(super) fn new_environment() -> Result<Environment<'static>, LoadError> {
    let mut env = Environment::new();
    let mut syntax = minijinja::syntax::SyntaxConfig::builder();
    syntax.trim_blocks(true).lstrip_blocks(true).keep_trailing_newline(false);
    let config = syntax.build().map_err(|e| LoadError::Unsupported(Unsupported::TemplateFeature(e.to_string())))?;
    env.set_syntax(config);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_unknown_method_callback(python_methods);
    env.add_filter("tojson", tojson);
    env.add_filter("trim", |v: &Value, chars: Option<&str>| py_strip(&py_str(v), chars, true, true));
    // A float is printed as Python's str() prints it (1e+16, not 10000000000000000.0).
    env.set_formatter(|out, state, value| {
        if value.kind() == ValueKind::Number && !value.is_integer() {
            out.write_str(&py_str(value)).map_err(|_| Error::new(ErrorKind::WriteFailure, "formatter"))
        } else {
            minijinja::escape_formatter(out, state, value)
        }
    });
    // jinja2's floor/ceil rounding divides, so it gives a float even for an int.
    env.add_filter(
        "round",
        |value: Value, precision: Option<i32>, method: Option<&str>, kwargs: Kwargs| -> Result<Value, Error> {
            let directed = matches!(method, Some("ceil" | "floor"))
                || matches!(kwargs.get::<Option<&str>>("method"), Ok(Some("ceil" | "floor")));
            let rounded = minijinja::filters::round(value, precision, method, kwargs)?;
            if directed && rounded.is_integer() {
                let f = i128::try_from(rounded.clone()).map(|i| i as f64).unwrap_or(f64::NAN);
                return Ok(Value::from(f));
            }
            Ok(rounded)
        },
    );
    // jinja2's tests are Python's: None is not iterable; strings and dicts are sequences.
    env.add_test("iterable", |v: &Value| {
        matches!(
            v.kind(),
            ValueKind::String
                | ValueKind::Bytes
                | ValueKind::Seq
                | ValueKind::Map
                | ValueKind::Iterable
                | ValueKind::Undefined
        )
    });
    env.add_test("sequence", |v: &Value| {
        matches!(
            v.kind(),
            ValueKind::String | ValueKind::Bytes | ValueKind::Seq | ValueKind::Map | ValueKind::Undefined
        )
    });
    env.add_function("raise_exception", |msg: Value| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{msg}")))
    });
    Ok(env)
}

/// Python's `str(x)` of a template value as jinja2's `soft_str` gives it (undefined is "").
fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        ValueKind::Number if !v.is_integer() => match f64::try_from(v.clone()) {
            Ok(f) if f.is_nan() => "nan".into(),
            Ok(f) if f.is_infinite() => (if f > 0.0 { "inf" } else { "-inf" }).into(),
            Ok(f) => pyjson::float_repr(f),
            Err(_) => v.to_string(),
        },
        _ => v.to_string(),
    }
}

/// Python's `str.isspace()` characters (Rust's `char::is_whitespace` lacks U+001C-U+001F).
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn py_strip(s: &str, chars: Option<&str>, left: bool, right: bool) -> String {
    let test = |c: char| match chars {
        Some(set) => set.contains(c),
        None => py_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(test);
    }
    if right {
        out = out.trim_end_matches(test);
    }
    out.to_string()
}

/// Python's string methods: `strip`/`lstrip`/`rstrip` with Python's whitespace, and
/// `split()` without a separator; the rest from minijinja-contrib's pycompat.
fn python_methods(state: &mut State<'_, '_>, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let strip = match method {
            "strip" => Some((true, true)),
            "lstrip" => Some((true, false)),
            "rstrip" => Some((false, true)),
            _ => None,
        };
        if let Some((left, right)) = strip {
            let chars: Option<Value> = match args {
                [] => None,
                [a] => Some(a.clone()),
                _ => return Err(Error::new(ErrorKind::TooManyArguments, "strip takes one argument")),
            };
            return match chars {
                None => Ok(Value::from(py_strip(s, None, left, right))),
                Some(c) if c.is_none() => Ok(Value::from(py_strip(s, None, left, right))),
                Some(c) => match c.as_str() {
                    Some(set) => Ok(Value::from(py_strip(s, Some(set), left, right))),
                    None => Err(Error::new(ErrorKind::InvalidOperation, "strip arg must be None or str")),
                },
            };
        }
        if method == "split" && (args.is_empty() || args.first().is_some_and(Value::is_none)) && args.len() <= 1 {
            return Ok(s.split(py_space).filter(|p| !p.is_empty()).map(Value::from).collect());
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`; positional arguments in that order.
fn tojson(state: &State, value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let mut opts = DumpsOptions::default();
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    let mut given: Vec<(&str, Value)> = Vec::new();
    for (i, v) in args.iter().enumerate() {
        let name =
            names.get(i).ok_or_else(|| Error::new(ErrorKind::TooManyArguments, "tojson takes at most 4 arguments"))?;
        given.push((name, v.clone()));
    }
    for name in names {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            given.push((name, v));
        }
    }
    kwargs.assert_all_used()?;
    for (name, v) in given {
        match name {
            "ensure_ascii" => opts.ensure_ascii = v.is_true(),
            "sort_keys" => opts.sort_keys = v.is_true(),
            "indent" => {
                opts.indent = if v.is_none() {
                    None
                } else if let Some(s) = v.as_str() {
                    Some(s.to_string())
                } else if v.is_integer() {
                    let n = v.as_i64().unwrap_or(0).max(0);
                    Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
                } else {
                    return Err(Error::new(ErrorKind::InvalidOperation, "indent must be an int or str"));
                }
            }
            _ => {
                // separators: a 2-sequence of strings
                if v.is_none() {
                    opts.separators = None;
                } else {
                    let parts: Vec<Value> = v.try_iter()?.collect();
                    match parts.as_slice() {
                        [a, b] => match (a.as_str(), b.as_str()) {
                            (Some(a), Some(b)) => opts.separators = Some((a.to_string(), b.to_string())),
                            _ => return Err(Error::new(ErrorKind::InvalidOperation, "separators must be strings")),
                        },
                        _ => return Err(Error::new(ErrorKind::InvalidOperation, "separators must be a pair")),
                    }
                }
            }
        }
    }
    let mut w = Writer::new(&opts);
    let mut nans = 0;
    dump_value(&mut w, value, 0, &mut nans)?;
    if nans > 0 {
        if let Some(sink) = state.lookup(NAN_SINK).and_then(|v| v.downcast_object::<NanSink>()) {
            sink.0.fetch_add(nans, Ordering::Relaxed);
        }
    }
    Ok(Value::from(w.out))
}

fn dump_value(w: &mut Writer<'_>, v: &Value, level: usize, nans: &mut usize) -> Result<(), Error> {
    let unsupported = |what: &str| Error::new(ErrorKind::InvalidOperation, format!("tojson of {what}"));
    match v.kind() {
        ValueKind::None => w.raw("null"),
        ValueKind::Bool => w.raw(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(PyFloat(f)) = as_float(v) {
                if f.is_nan() {
                    *nans += 1;
                }
                w.raw(&pyjson::float_repr(f));
            } else {
                // integers: minijinja prints them in decimal, as Python does
                w.raw(&v.to_string());
            }
        }
        ValueKind::String => w.str(v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            w.list(items.len(), level, |w, i, l| match items.get(i) {
                Some(x) => dump_value(w, x, l, nans),
                None => Ok(()),
            })?;
        }
        ValueKind::Map => {
            let mut keys = Vec::new();
            let mut values = Vec::new();
            for k in v.try_iter()? {
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or_default().to_string(),
                    _ => return Err(unsupported("a non-string key")),
                };
                values.push(v.get_item(&k)?);
                keys.push(key);
            }
            w.dict(&keys, level, |w, i, l| match values.get(i) {
                Some(x) => dump_value(w, x, l, nans),
                None => Ok(()),
            })?;
        }
        ValueKind::Undefined => return Err(unsupported("Undefined")),
        _ => return Err(unsupported("this value")),
    }
    Ok(())
}

struct PyFloat(f64);

/// The float inside a number value (integers are `None`).
fn as_float(v: &Value) -> Option<PyFloat> {
    if v.is_integer() {
        return None;
    }
    f64::try_from(v.clone()).ok().map(PyFloat)
}

/// `datetime.now().strftime(format)` with the UTC clock and glibc's common directives.
pub(super) fn strftime_now(format: &str) -> Result<String, Error> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    strftime(format, i64::try_from(secs).unwrap_or(0))
}

/// A [`PyValue`] as a template value.
///
/// # Errors
/// [`Unsupported::BigInteger`] for an integer beyond 128 bits.
pub(crate) fn to_value(v: &PyValue) -> Result<Value, Unsupported> {
    Ok(match v {
        PyValue::Null => Value::from(()),
        PyValue::Bool(b) => Value::from(*b),
        PyValue::Int(d) => match d.parse::<i64>() {
            Ok(i) => Value::from(i),
            Err(_) => Value::from(d.parse::<i128>().map_err(|_| Unsupported::BigInteger)?),
        },
        PyValue::Float(f) => Value::from(*f),
        PyValue::Str(s) => Value::from(s.as_str()),
        PyValue::List(items) => Value::from(items.iter().map(to_value).collect::<Result<Vec<_>, _>>()?),
        PyValue::Dict(items) => {
            let mut map: indexmap::IndexMap<Value, Value> = indexmap::IndexMap::new();
            for (k, x) in items {
                map.insert(Value::from(k.as_str()), to_value(x)?);
            }
            Value::from(map)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::load::LoadOptions;
    use crate::render::ChatTemplate;

    fn render(src: &str, ctx: &[(&str, PyValue)]) -> Result<String, Unsupported> {
        let t = ChatTemplate::from_source(src, &[("eos_token", "<|im_end|>")], LoadOptions::default()).map_err(
            |e| match e {
                LoadError::Unsupported(u) => u,
                other => Unsupported::TemplateFeature(other.to_string()),
            },
        )?;
        let ctx = ctx.iter().map(|(k, v)| ((*k).to_string(), to_value(v).unwrap())).collect();
        t.render(false, ctx).map(|r| r.text)
    }

    fn j(s: &str) -> PyValue {
        pyjson::loads(s).unwrap()
    }

    #[test]
    fn tojson_is_transformers_json_dumps() {
        let x = j(r#"{"b": [1, 2.50, 1e16, "<&>'é"], "a": null, "c": true}"#);
        assert_eq!(
            render("{{ x | tojson }}", &[("x", x.clone())]).unwrap(),
            r#"{"b": [1, 2.5, 1e+16, "<&>'é"], "a": null, "c": true}"#
        );
        assert_eq!(render("{{ x | tojson(indent=2) }}", &[("x", j("[1]"))]).unwrap(), "[\n  1\n]");
        assert_eq!(
            render("{{ x | tojson(separators=(',', ':'), sort_keys=true) }}", &[("x", x)]).unwrap(),
            r#"{"a":null,"b":[1,2.5,1e+16,"<&>'é"],"c":true}"#
        );
        assert_eq!(render("{{ 'é' | tojson(ensure_ascii=true) }}", &[]).unwrap(), r#""\u00e9""#);
    }

    #[test]
    fn blocks_are_trimmed_as_transformers_sets_jinja() {
        let src = "{% for m in ms %}\n  {% if m %}\n[{{ m }}]\n  {% endif %}\n{% endfor %}\n";
        assert_eq!(render(src, &[("ms", j("[1, 2]"))]).unwrap(), "[1]\n[2]\n");
    }

    #[test]
    fn special_tokens_and_python_methods_are_available() {
        let src = "{{ eos_token }}|{{ s.strip() }}|{{ s.lstrip('\\x1c ') }}|{{ s.split() | length }}|{{ s.startswith('\\x1c') }}";
        assert_eq!(
            render(src, &[("s", PyValue::Str("\u{1c} a b \u{1c}".into()))]).unwrap(),
            "<|im_end|>|a b|a b \u{1c}|2|True"
        );
    }

    /// jinja2 prints containers with Python's repr; so does minijinja (strings in single quotes).
    #[test]
    fn containers_print_as_python_repr() {
        let src = r#"{{ [1, "a", none, true, 1.5] }}|{{ {"k": "it's", "n": {"x": []}} }}|{{ undefined_name }}|{{ x }}"#;
        assert_eq!(
            render(src, &[("x", j(r#"{"q": "a\"b"}"#))]).unwrap(),
            r#"[1, 'a', None, True, 1.5]|{'k': "it's", 'n': {'x': []}}||{'q': 'a"b'}"#
        );
    }

    /// `is iterable` / `is sequence` as jinja2 answers them (minijinja counts none as iterable).
    #[test]
    fn iterable_and_sequence_tests_follow_python() {
        let src = "{{ n is iterable }} {{ s is iterable }} {{ l is iterable }} {{ d is iterable }} {{ i is iterable }} {{ u is iterable }}|{{ s is sequence }} {{ d is sequence }} {{ n is sequence }} {{ i is sequence }}";
        let ctx = [("n", PyValue::Null), ("s", j(r#""x""#)), ("l", j("[1]")), ("d", j("{}")), ("i", j("3"))];
        assert_eq!(render(src, &ctx).unwrap(), "False True True True False True|True True False False");
        assert_eq!(render("{{ ' xax ' | trim(' x') }}", &[]).unwrap(), "a");
        assert_eq!(
            render("[{{ nothing | trim }}][{{ 1e20 | trim }}][{{ none | trim }}]", &[]).unwrap(),
            "[][1e+20][None]"
        );
    }

    #[test]
    fn raise_exception_is_its_own_outcome() {
        assert_eq!(
            render("{{ raise_exception('no system') }}", &[]),
            Err(Unsupported::TemplateRaised("no system".into()))
        );
        assert!(matches!(render("{{ x.nomethod() }}", &[("x", j("1"))]), Err(Unsupported::TemplateFeature(_))));
    }
}
