//! JSON as CPython reads and writes it: `json.loads` (order kept, last duplicate key wins,
//! `NaN`/`Infinity` accepted, exact integers) into [`PyValue`], and `json.dumps` with
//! `ensure_ascii`, `indent`, `separators` and `sort_keys`, floats in Python's `repr`.
//! Pure; knows nothing of chat requests or templates.

use std::fmt::Write as _;

/// A value as Python holds the result of `json.loads`.
#[derive(Debug, Clone, PartialEq)]
pub enum PyValue {
    /// `None`.
    Null,
    /// `True` / `False`.
    Bool(bool),
    /// An `int`, exactly as its decimal digits (optional `-`, no leading zeros, `-0` → `0`).
    Int(String),
    /// A `float` (from a fraction, an exponent, `NaN`, `Infinity` or an overflow).
    Float(f64),
    /// A `str` (never holding a lone surrogate: such input is refused).
    Str(String),
    /// A `list`.
    List(Vec<PyValue>),
    /// A `dict`: insertion order; a repeated key keeps its first place and takes the last value.
    Dict(Vec<(String, PyValue)>),
}

impl PyValue {
    /// The value under `key` when this is a dict.
    pub fn get(&self, key: &str) -> Option<&PyValue> {
        match self {
            PyValue::Dict(items) => items.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The string when this is a `str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            PyValue::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// Why `json.loads` would fail on an input, or why it cannot be represented faithfully here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadsError {
    /// Python raises `json.JSONDecodeError`.
    #[error("invalid JSON at byte {0}")]
    Invalid(usize),
    /// Valid for Python but not representable as UTF-8 (a lone surrogate escape).
    #[error("lone surrogate escape at byte {0}")]
    LoneSurrogate(usize),
    /// An integer longer than CPython's 4300-digit conversion limit (a `ValueError`, not a
    /// decode error, in Python).
    #[error("integer with more than 4300 digits at byte {0}")]
    IntTooLong(usize),
    /// Nesting deeper than this parser follows (Python's limit is the recursion limit).
    #[error("nesting deeper than {MAX_DEPTH}")]
    TooDeep,
}

const MAX_DEPTH: usize = 256;
const MAX_INT_DIGITS: usize = 4300;

/// `json.loads(text)` for a `str` argument.
///
/// # Errors
/// [`LoadsError`] where Python raises, or where the result holds a lone surrogate.
pub fn loads(text: &str) -> Result<PyValue, LoadsError> {
    let mut p = Parser { s: text.as_bytes(), i: 0, depth: 0 };
    p.ws();
    let v = p.value()?;
    p.ws();
    if p.i != p.s.len() {
        return Err(LoadsError::Invalid(p.i));
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    depth: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.s.get(self.i..self.i + lit.len()) == Some(lit.as_bytes()) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self) -> Result<PyValue, LoadsError> {
        let at = self.i;
        match self.peek() {
            Some(b'{') => self.nested(Self::object),
            Some(b'[') => self.nested(Self::array),
            Some(b'"') => self.string().map(PyValue::Str),
            Some(b'n') if self.eat("null") => Ok(PyValue::Null),
            Some(b't') if self.eat("true") => Ok(PyValue::Bool(true)),
            Some(b'f') if self.eat("false") => Ok(PyValue::Bool(false)),
            Some(b'N') if self.eat("NaN") => Ok(PyValue::Float(f64::NAN)),
            Some(b'I') if self.eat("Infinity") => Ok(PyValue::Float(f64::INFINITY)),
            Some(b'-') if self.eat("-Infinity") => Ok(PyValue::Float(f64::NEG_INFINITY)),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(LoadsError::Invalid(at)),
        }
    }

    fn nested(&mut self, f: fn(&mut Self) -> Result<PyValue, LoadsError>) -> Result<PyValue, LoadsError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(LoadsError::TooDeep);
        }
        let v = f(self);
        self.depth -= 1;
        v
    }

    fn object(&mut self) -> Result<PyValue, LoadsError> {
        self.i += 1; // '{'
        let mut items: Vec<(String, PyValue)> = Vec::new();
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(PyValue::Dict(items));
        }
        loop {
            self.ws();
            if self.peek() != Some(b'"') {
                return Err(LoadsError::Invalid(self.i));
            }
            let key = self.string()?;
            self.ws();
            if self.peek() != Some(b':') {
                return Err(LoadsError::Invalid(self.i));
            }
            self.i += 1;
            self.ws();
            let v = self.value()?;
            match items.iter_mut().find(|(k, _)| *k == key) {
                Some(slot) => slot.1 = v,
                None => items.push((key, v)),
            }
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(PyValue::Dict(items));
                }
                _ => return Err(LoadsError::Invalid(self.i)),
            }
        }
    }

    fn array(&mut self) -> Result<PyValue, LoadsError> {
        self.i += 1; // '['
        let mut items = Vec::new();
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(PyValue::List(items));
        }
        loop {
            self.ws();
            items.push(self.value()?);
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(PyValue::List(items));
                }
                _ => return Err(LoadsError::Invalid(self.i)),
            }
        }
    }

    fn hex4(&mut self) -> Result<u32, LoadsError> {
        let at = self.i;
        let digits = self.s.get(self.i..self.i + 4).ok_or(LoadsError::Invalid(at))?;
        let text = std::str::from_utf8(digits).map_err(|_| LoadsError::Invalid(at))?;
        if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(LoadsError::Invalid(at));
        }
        self.i += 4;
        u32::from_str_radix(text, 16).map_err(|_| LoadsError::Invalid(at))
    }

    /// A string starting at `"`; Python's strict mode: raw control characters are refused.
    fn string(&mut self) -> Result<String, LoadsError> {
        self.i += 1; // '"'
        let mut out = String::new();
        loop {
            let start = self.i;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.i += 1;
            }
            let chunk = self.s.get(start..self.i).ok_or(LoadsError::Invalid(start))?;
            out.push_str(std::str::from_utf8(chunk).map_err(|_| LoadsError::Invalid(start))?);
            match self.peek() {
                Some(b'"') => {
                    self.i += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    let at = self.i;
                    self.i += 1;
                    let c = self.peek().ok_or(LoadsError::Invalid(at))?;
                    self.i += 1;
                    match c {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let u = self.hex4()?;
                            let code = if (0xD800..0xDC00).contains(&u) {
                                // Python pairs it only with an immediately following \uDC00-DFFF.
                                let save = self.i;
                                if self.eat("\\u") {
                                    let lo = self.hex4()?;
                                    if (0xDC00..0xE000).contains(&lo) {
                                        0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00)
                                    } else {
                                        self.i = save;
                                        return Err(LoadsError::LoneSurrogate(at));
                                    }
                                } else {
                                    return Err(LoadsError::LoneSurrogate(at));
                                }
                            } else if (0xDC00..0xE000).contains(&u) {
                                return Err(LoadsError::LoneSurrogate(at));
                            } else {
                                u
                            };
                            out.push(char::from_u32(code).ok_or(LoadsError::Invalid(at))?);
                        }
                        _ => return Err(LoadsError::Invalid(at)),
                    }
                }
                _ => return Err(LoadsError::Invalid(self.i)),
            }
        }
    }

    /// Python's `NUMBER_RE`: `(-?(?:0|[1-9]\d*))(\.\d+)?([eE][-+]?\d+)?`.
    fn number(&mut self) -> Result<PyValue, LoadsError> {
        let start = self.i;
        let digits = |p: &mut Self| {
            let s = p.i;
            while matches!(p.peek(), Some(b'0'..=b'9')) {
                p.i += 1;
            }
            p.i - s
        };
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek() {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                digits(self);
            }
            _ => return Err(LoadsError::Invalid(start)),
        }
        let int_end = self.i;
        let mut is_float = false;
        if self.peek() == Some(b'.') {
            let save = self.i;
            self.i += 1;
            if digits(self) == 0 {
                // "1." : the regex stops before the dot; the dot is then extra data.
                self.i = save;
            } else {
                is_float = true;
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            let save = self.i;
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if digits(self) == 0 {
                self.i = save;
            } else {
                is_float = true;
            }
        }
        let text = self.s.get(start..self.i).ok_or(LoadsError::Invalid(start))?;
        let text = std::str::from_utf8(text).map_err(|_| LoadsError::Invalid(start))?;
        if is_float {
            let f: f64 = text.parse().map_err(|_| LoadsError::Invalid(start))?;
            return Ok(PyValue::Float(f));
        }
        let _ = int_end;
        let (neg, mag) = match text.strip_prefix('-') {
            Some(m) => (true, m),
            None => (false, text),
        };
        if mag.len() > MAX_INT_DIGITS {
            return Err(LoadsError::IntTooLong(start));
        }
        Ok(PyValue::Int(if neg && mag != "0" { format!("-{mag}") } else { mag.to_string() }))
    }
}

/// Python's `repr(float)`: shortest round-trip digits; exponent form when the decimal
/// exponent is below -4 or at least 16 (`1e+16`, `1e-05`), else positional with `.0`.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // Rust's `{:e}` is the shortest round-trip representation: "d[.ddd]e[-]x".
    let sci = format!("{f:e}");
    let (mantissa, exp) = match sci.split_once('e') {
        Some(parts) => parts,
        None => return sci,
    };
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    // decpt as CPython's float_repr uses it: value = 0.DIGITS * 10^decpt.
    let decpt = exp + 1;
    let n = i32::try_from(digits.len()).unwrap_or(i32::MAX);
    let mut out = String::from(sign);
    if (-4 < decpt) && (decpt <= 16) {
        if decpt <= 0 {
            out.push_str("0.");
            for _ in 0..(-decpt) {
                out.push('0');
            }
            out.push_str(&digits);
        } else if decpt >= n {
            out.push_str(&digits);
            for _ in 0..(decpt - n) {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            let cut = usize::try_from(decpt).unwrap_or(0);
            let (a, b) = digits.split_at(cut.min(digits.len()));
            out.push_str(a);
            out.push('.');
            out.push_str(b);
        }
    } else {
        let (first, rest) = digits.split_at(1.min(digits.len()));
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let e = decpt - 1;
        let _ = write!(out, "e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs());
    }
    out
}

/// The options of `json.dumps` that chat templates use.
#[derive(Debug, Clone, Default)]
pub struct DumpsOptions {
    /// `ensure_ascii` (transformers' `tojson` default: false).
    pub ensure_ascii: bool,
    /// `indent`: `None`, or the string each level adds (an int `n` is `n` spaces).
    pub indent: Option<String>,
    /// `separators` (item, key); default `(", ", ": ")`, or `(",", ": ")` with an indent.
    pub separators: Option<(String, String)>,
    /// `sort_keys`.
    pub sort_keys: bool,
}

/// Python's `json.dumps` string escaping (`ensure_ascii` chooses `\uXXXX` for non-ASCII).
pub fn dump_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `json.dumps(value, ...)` of a [`PyValue`].
pub fn dumps(value: &PyValue, opts: &DumpsOptions) -> String {
    let mut w = Writer::new(opts);
    w.value(value, 0);
    w.out
}

/// A `json.dumps` writer over any tree shape (also used for template values).
pub struct Writer<'o> {
    /// The text written so far.
    pub out: String,
    opts: &'o DumpsOptions,
    item_sep: String,
    key_sep: String,
}

impl<'o> Writer<'o> {
    /// A writer with `json.dumps`'s separator defaults resolved.
    pub fn new(opts: &'o DumpsOptions) -> Self {
        let (item_sep, key_sep) = match &opts.separators {
            Some((i, k)) => (i.clone(), k.clone()),
            None if opts.indent.is_some() => (",".into(), ": ".into()),
            None => (", ".into(), ": ".into()),
        };
        Writer { out: String::new(), opts, item_sep, key_sep }
    }

    /// Writes a string.
    pub fn str(&mut self, s: &str) {
        dump_str(&mut self.out, s, self.opts.ensure_ascii);
    }

    /// Writes a raw token (a number, `true`, `null`, ...).
    pub fn raw(&mut self, s: &str) {
        self.out.push_str(s);
    }

    fn newline(&mut self, level: usize) {
        if let Some(ind) = &self.opts.indent {
            self.out.push('\n');
            for _ in 0..level {
                self.out.push_str(ind);
            }
        }
    }

    /// Writes a list whose items are written by `item(self, index, level)`.
    pub fn list<E>(
        &mut self,
        len: usize,
        level: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> Result<(), E>,
    ) -> Result<(), E> {
        if len == 0 {
            self.out.push_str("[]");
            return Ok(());
        }
        self.out.push('[');
        for i in 0..len {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            self.newline(level + 1);
            item(self, i, level + 1)?;
        }
        self.newline(level);
        self.out.push(']');
        Ok(())
    }

    /// Writes a dict of `keys` (already Python `str` keys, in order; sorted here when
    /// `sort_keys`); `item(self, index, level)` writes the value of `keys[index]`.
    pub fn dict<E>(
        &mut self,
        keys: &[String],
        level: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> Result<(), E>,
    ) -> Result<(), E> {
        if keys.is_empty() {
            self.out.push_str("{}");
            return Ok(());
        }
        let mut order: Vec<usize> = (0..keys.len()).collect();
        if self.opts.sort_keys {
            order.sort_by(|a, b| keys.get(*a).cmp(&keys.get(*b)));
        }
        self.out.push('{');
        for (n, i) in order.into_iter().enumerate() {
            if n > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            self.newline(level + 1);
            let key = keys.get(i).map(String::as_str).unwrap_or_default();
            dump_str(&mut self.out, key, self.opts.ensure_ascii);
            let sep = self.key_sep.clone();
            self.out.push_str(&sep);
            item(self, i, level + 1)?;
        }
        self.newline(level);
        self.out.push('}');
        Ok(())
    }

    fn value(&mut self, v: &PyValue, level: usize) {
        match v {
            PyValue::Null => self.raw("null"),
            PyValue::Bool(b) => self.raw(if *b { "true" } else { "false" }),
            PyValue::Int(d) => self.raw(d),
            PyValue::Float(f) => self.raw(&float_repr(*f)),
            PyValue::Str(s) => self.str(s),
            PyValue::List(items) => {
                let _ = self.list::<()>(items.len(), level, |w, i, l| {
                    if let Some(x) = items.get(i) {
                        w.value(x, l);
                    }
                    Ok(())
                });
            }
            PyValue::Dict(items) => {
                let keys: Vec<String> = items.iter().map(|(k, _)| k.clone()).collect();
                let _ = self.dict::<()>(&keys, level, |w, i, l| {
                    if let Some((_, x)) = items.get(i) {
                        w.value(x, l);
                    }
                    Ok(())
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(s: &str) -> String {
        dumps(&loads(s).unwrap(), &DumpsOptions::default())
    }

    /// The float table of vllm-rendering.md, plus CPython's repr boundaries.
    #[test]
    fn floats_are_written_as_python_repr() {
        for (input, want) in [
            ("1.50", "1.5"),
            ("1e5", "100000.0"),
            ("1E-7", "1e-07"),
            ("1e16", "1e+16"),
            ("1e15", "1000000000000000.0"),
            ("1.5e15", "1500000000000000.0"),
            ("1e400", "Infinity"),
            ("-1e400", "-Infinity"),
            ("NaN", "NaN"),
            ("-0.0", "-0.0"),
            ("0.0", "0.0"),
            ("0.0001", "0.0001"),
            ("0.00001", "1e-05"),
            ("0.1", "0.1"),
            ("123.456", "123.456"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
            ("5e-324", "5e-324"),
            ("12345678901234567.0", "1.2345678901234568e+16"),
            ("2.5e-5", "2.5e-05"),
            ("100.0", "100.0"),
            ("3.14159e2", "314.159"),
        ] {
            assert_eq!(roundtrip(input), want, "{input}");
        }
    }

    #[test]
    fn integers_stay_exact_and_minus_zero_is_zero() {
        assert_eq!(roundtrip("-0"), "0");
        assert_eq!(roundtrip("123456789012345678901234567890"), "123456789012345678901234567890");
        assert_eq!(roundtrip("-42"), "-42");
    }

    #[test]
    fn dicts_keep_order_and_the_last_duplicate_wins_in_the_first_place() {
        assert_eq!(roundtrip(r#"{"b":1,"a":2,"b":3}"#), r#"{"b": 3, "a": 2}"#);
        assert_eq!(roundtrip(r#"{"x":[1,{"y":null}],"z":true}"#), r#"{"x": [1, {"y": null}], "z": true}"#);
    }

    #[test]
    fn strings_are_escaped_as_python_with_ensure_ascii_false() {
        assert_eq!(roundtrip(r#""a\u00e9\ud83d\ude00<>&'\u0007\u007f\u2028""#), "\"aé😀<>&'\\u0007\u{7f}\u{2028}\"");
        assert_eq!(roundtrip(r#""\/\b\f\n\r\t\"\\""#), r#""/\b\f\n\r\t\"\\""#);
        let v = loads(r#""é😀""#).unwrap();
        let opts = DumpsOptions { ensure_ascii: true, ..Default::default() };
        assert_eq!(dumps(&v, &opts), r#""\u00e9\ud83d\ude00""#);
    }

    #[test]
    fn indent_and_separators_follow_json_dumps() {
        let v = loads(r#"{"a":[1,2],"b":{},"c":[]}"#).unwrap();
        let opts = DumpsOptions { indent: Some("  ".into()), ..Default::default() };
        assert_eq!(dumps(&v, &opts), "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {},\n  \"c\": []\n}");
        let opts = DumpsOptions { separators: Some((",".into(), ":".into())), sort_keys: true, ..Default::default() };
        let v = loads(r#"{"b":1,"a":2}"#).unwrap();
        assert_eq!(dumps(&v, &opts), r#"{"a":2,"b":1}"#);
    }

    #[test]
    fn python_refusals_are_refused() {
        for bad in [
            "",
            "{",
            "[1,]",
            "{\"a\":1,}",
            "01",
            "1.",
            ".5",
            "+1",
            "'a'",
            "\"\t\"",
            "nul",
            "[1] x",
            "{\"a\" 1}",
            "\"\\x\"",
            "-",
            "1e",
            "inf",
        ] {
            assert!(matches!(loads(bad), Err(LoadsError::Invalid(_))), "{bad:?}");
        }
        assert!(matches!(loads(r#""\ud800""#), Err(LoadsError::LoneSurrogate(_))));
        assert!(matches!(loads(r#""\udc00x""#), Err(LoadsError::LoneSurrogate(_))));
        assert!(matches!(loads(&"9".repeat(4301)), Err(LoadsError::IntTooLong(_))));
        assert!(loads(&"9".repeat(4300)).is_ok());
        assert!(matches!(loads(&"[".repeat(300)), Err(LoadsError::TooDeep)));
    }

    #[test]
    fn whitespace_is_python_json_whitespace() {
        assert!(loads(" \t\r\n{} \n").is_ok());
        assert!(loads("\u{a0}{}").is_err());
    }
}
