//! TOML text → any serde type whose fields all have defaults, reporting every problem of the
//! text at once (it knows no key of tokenonce's config). serde stops at a value's first error,
//! so the text is deserialized again with each failing value left out (its field then takes
//! its default), until it goes through; every error met on the way is a [`Problem`] at its key
//! path and line:column, and so is every key no struct has (with the key of its table it
//! likely meant). Messages speak of TOML's values (`must be a list, not "x"`), not serde's
//! types. The spanned tree kept here ([`Doc`]) lets checks that follow place their problems
//! by key path too.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::ops::Range;

use serde::de::value::StrDeserializer;
use serde::de::DeserializeOwned;
use serde::de::{self, DeserializeSeed, Deserializer, IntoDeserializer, MapAccess, SeqAccess, Unexpected, Visitor};
use toml::de::{DeTable, DeValue};
use toml::Spanned;

/// One thing wrong with a TOML text, at its key and place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line, when known.
    pub line: usize,
    /// 1-based column, when known.
    pub column: usize,
    /// Dotted key path, e.g. `routes[0].decode_pool`.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}: {}", self.line, self.column, self.key, self.message)
    }
}

/// The parsed document: its text and where each key path's key and value are.
pub struct Doc<'a> {
    source: &'a str,
    places: HashMap<String, Place>,
}

/// Where a key and its value are in the text.
#[derive(Debug, Clone)]
struct Place {
    key: Range<usize>,
    value: Range<usize>,
}

impl Doc<'_> {
    /// A problem at the value of `path` (at no place when the file does not have it).
    pub fn at_value(&self, path: &str, message: impl Into<String>) -> Problem {
        self.problem(path, self.places.get(path).map(|p| p.value.clone()), message)
    }

    /// A problem at the table `table`, about its key `name` (a key it lacks, say).
    pub fn at_table(&self, table: &str, name: &str, message: impl Into<String>) -> Problem {
        let span = self.places.get(table).map(|p| p.value.clone());
        self.problem(&join(table, name), span, message)
    }

    /// True when the file writes `path`.
    pub fn has(&self, path: &str) -> bool {
        self.places.contains_key(path)
    }

    fn problem(&self, path: &str, span: Option<Range<usize>>, message: impl Into<String>) -> Problem {
        let (line, column) = span.map_or((0, 0), |s| line_col(self.source, s.start));
        Problem { line, column, key: shown_key(path).to_owned(), message: message.into() }
    }
}

/// `table.name`, or `name` at the top.
fn join(table: &str, name: &str) -> String {
    if table.is_empty() {
        name.to_owned()
    } else {
        format!("{table}.{name}")
    }
}

/// The key a problem names: an element of a list of values is its list
/// (`pools.p.endpoints`, not `pools.p.endpoints[1]`); tables in a list keep their index.
fn shown_key(path: &str) -> &str {
    let mut key = path;
    while let Some(open) = key.strip_suffix(']').and_then(|k| k.rfind('[')) {
        key = key.get(..open).unwrap_or(key);
    }
    key
}

fn line_col(source: &str, offset: usize) -> (usize, usize) {
    let before = source.get(..offset).unwrap_or(source);
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map_or(before.len(), |nl| before.len() - nl - 1) + 1;
    (line, column)
}

/// Reads `source`: the value when the text went into it (problems of unknown keys and bad
/// values may still be listed: their fields hold defaults), the problems, and the document
/// for the checks. A syntax error is the one problem, with no value.
pub fn read<T: DeserializeOwned>(source: &str) -> (Option<T>, Vec<Problem>, Doc<'_>) {
    let mut doc = Doc { source, places: HashMap::new() };
    let root = match DeTable::parse(source) {
        Ok(table) => Node::table(String::new(), table.span(), table.into_inner(), &mut doc.places),
        Err(e) => {
            let problem = doc.problem("(syntax)", e.span(), e.message());
            return (None, vec![problem], doc);
        }
    };
    let mut left_out = BTreeSet::new();
    let mut problems = Vec::new();
    // Each round leaves one more value out, so this ends within one round per value.
    for _ in 0..=doc.places.len() {
        let unknown = RefCell::new(Vec::new());
        let ctx = Ctx { left_out: &left_out, unknown: &unknown };
        match T::deserialize(NodeDe { node: &root, ctx: &ctx }) {
            Ok(config) => {
                let unknown = unknown.into_inner();
                problems.extend(unknown.iter().map(|(n, keys)| doc.problem(n, doc.key_span(n), unknown_key(n, keys))));
                return (Some(config), problems, doc);
            }
            Err(e) => {
                let path = e.path.unwrap_or_default();
                problems.push(doc.problem(&path, e.span, e.message));
                if path.is_empty() || !left_out.insert(path) {
                    break;
                }
            }
        }
    }
    (None, problems, doc)
}

impl Doc<'_> {
    fn key_span(&self, path: &str) -> Option<Range<usize>> {
        self.places.get(path).map(|p| p.key.clone())
    }
}

/// The message of an unknown key: the key of its table it most likely meant, else them all.
fn unknown_key(path: &str, keys: &[&str]) -> String {
    let name = path.rsplit('.').next().unwrap_or(path);
    match suggestion(name, keys) {
        Some(meant) => format!("unknown key `{name}`; did you mean `{meant}`?"),
        None => format!("unknown key `{name}`; the keys here are: {}", keys.join(", ")),
    }
}

/// `"; did you mean `x`?"` when one of `names` is close to `written`, else nothing.
fn did_you_mean(written: &str, names: &[&str]) -> String {
    suggestion(written, names).map_or_else(String::new, |meant| format!("; did you mean `{meant}`?"))
}

/// The one of `names` most like `written` (a typo, a missing or extra suffix), if any is close.
fn suggestion<'n>(written: &str, names: &[&'n str]) -> Option<&'n str> {
    // Jaro-Winkler favours a shared start, which is how keys are misspelt (`grace_period_sec`);
    // below 0.8 the "closest" is seldom what was meant.
    const CLOSE: f64 = 0.8;
    names
        .iter()
        .map(|&name| (strsim::jaro_winkler(written, name), name))
        .filter(|(score, _)| *score >= CLOSE)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, name)| name)
}

/// A value of the document with its key path and place.
struct Node {
    path: String,
    /// Its key in its table (empty in a list).
    key: String,
    span: Range<usize>,
    kind: Kind,
}

enum Kind {
    Str(String),
    Int(String, u32),
    Float(String),
    Bool(bool),
    Datetime,
    List(Vec<Node>),
    Table(Vec<Node>),
}

impl Node {
    fn table(path: String, span: Range<usize>, table: DeTable<'_>, places: &mut HashMap<String, Place>) -> Self {
        let children = table
            .into_iter()
            .map(|(key, value)| {
                let (key_span, key) = (key.span(), key.into_inner().into_owned());
                let path = join(&path, &key);
                places.insert(path.clone(), Place { key: key_span, value: value.span() });
                Self { key, ..Self::value(path, value, places) }
            })
            .collect();
        Self { path, key: String::new(), span, kind: Kind::Table(children) }
    }

    fn value(path: String, value: Spanned<DeValue<'_>>, places: &mut HashMap<String, Place>) -> Self {
        let span = value.span();
        let kind = match value.into_inner() {
            DeValue::String(s) => Kind::Str(s.into_owned()),
            DeValue::Integer(i) => Kind::Int(i.as_str().to_owned(), i.radix()),
            DeValue::Float(f) => Kind::Float(f.as_str().to_owned()),
            DeValue::Boolean(b) => Kind::Bool(b),
            DeValue::Datetime(_) => Kind::Datetime,
            DeValue::Table(t) => return Self::table(path, span, t, places),
            DeValue::Array(items) => Kind::List(
                items
                    .iter()
                    .cloned()
                    .enumerate()
                    .map(|(i, item)| {
                        let path = format!("{path}[{i}]");
                        places.insert(path.clone(), Place { key: item.span(), value: item.span() });
                        Self::value(path, item, places)
                    })
                    .collect(),
            ),
        };
        Self { path, key: String::new(), span, kind }
    }

    /// The value as a message shows it (see [`found`]).
    fn unexpected(&self) -> Unexpected<'_> {
        match &self.kind {
            Kind::Str(s) => Unexpected::Str(s),
            Kind::Int(text, 10) | Kind::Float(text) => Unexpected::Other(text),
            Kind::Int(..) => Unexpected::Other("an integer"),
            Kind::Bool(b) => Unexpected::Bool(*b),
            Kind::Datetime => Unexpected::Other("a date-time"),
            Kind::List(_) => Unexpected::Seq,
            Kind::Table(_) => Unexpected::Map,
        }
    }
}

/// What one round of deserializing shares: the values left out, the unknown keys met (each
/// with the keys its table has).
struct Ctx<'a> {
    left_out: &'a BTreeSet<String>,
    unknown: &'a RefCell<Vec<(String, &'static [&'static str])>>,
}

impl Ctx<'_> {
    fn kept<'n>(&self, nodes: &'n [Node]) -> impl Iterator<Item = &'n Node> + use<'n, '_> {
        nodes.iter().filter(|n| !self.left_out.contains(&n.path))
    }
}

/// A deserialization error and the value it is about (the innermost one that saw it).
#[derive(Debug)]
struct Error {
    message: String,
    path: Option<String>,
    span: Option<Range<usize>>,
}

impl Error {
    fn at(mut self, node: &Node) -> Self {
        if self.path.is_none() {
            self.path = Some(node.path.clone());
            self.span = Some(node.span.clone());
        }
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// serde's messages reworded in TOML's terms (`must be a list, not "x"` for `invalid type:
/// string "x", expected a sequence`); what a value type says itself is kept.
impl de::Error for Error {
    fn custom<T: fmt::Display>(message: T) -> Self {
        Self { message: message.to_string(), path: None, span: None }
    }

    fn invalid_type(unexp: Unexpected<'_>, exp: &dyn de::Expected) -> Self {
        Self::custom(format!("must be {}, not {}", in_words(&exp.to_string()), found(&unexp)))
    }

    fn invalid_value(unexp: Unexpected<'_>, exp: &dyn de::Expected) -> Self {
        let expected = exp.to_string();
        match (unexp, integer_range(&expected)) {
            (Unexpected::Signed(v), Some((0, _))) if v < 0 => Self::custom(format!("must not be negative, not {v}")),
            (Unexpected::Signed(_) | Unexpected::Unsigned(_), Some((min, max))) => {
                Self::custom(format!("must be a whole number from {min} to {max}, not {}", found(&unexp)))
            }
            _ => Self::invalid_type(unexp, exp),
        }
    }

    fn invalid_length(len: usize, exp: &dyn de::Expected) -> Self {
        Self::custom(format!("must be {}, not a list of {len}", in_words(&exp.to_string())))
    }
}

/// What serde's visitors expect, in the words of a TOML file; anything else is a value
/// type's own words (`a duration such as 30s ...`) and kept.
fn in_words(expected: &str) -> &str {
    if integer_range(expected).is_some() {
        return "a whole number";
    }
    match expected {
        "f32" | "f64" => "a number",
        "a boolean" => "true or false",
        "a sequence" => "a list",
        "a map" => "a table",
        "a character" => "a string of one character",
        _ if expected.starts_with("struct ") => "a table",
        _ => expected,
    }
}

/// The range of an integer type serde names as expected (`u32`), if it is one.
fn integer_range(expected: &str) -> Option<(i128, i128)> {
    Some(match expected {
        "u8" => (0, u8::MAX.into()),
        "u16" => (0, u16::MAX.into()),
        "u32" => (0, u32::MAX.into()),
        "u64" | "usize" => (0, u64::MAX.into()),
        "i8" => (i8::MIN.into(), i8::MAX.into()),
        "i16" => (i16::MIN.into(), i16::MAX.into()),
        "i32" => (i32::MIN.into(), i32::MAX.into()),
        "i64" | "isize" => (i64::MIN.into(), i64::MAX.into()),
        _ => return None,
    })
}

/// A value as a problem names it: strings quoted as in TOML, numbers as written, a list or
/// table by its kind.
fn found(unexp: &Unexpected<'_>) -> String {
    match unexp {
        Unexpected::Str(s) => format!("{s:?}"),
        Unexpected::Bool(b) => b.to_string(),
        Unexpected::Signed(v) => v.to_string(),
        Unexpected::Unsigned(v) => v.to_string(),
        Unexpected::Float(v) => format!("{v:?}"),
        Unexpected::Seq => "a list".into(),
        Unexpected::Map => "a table".into(),
        Unexpected::Other(what) => (*what).to_owned(),
        other => other.to_string(),
    }
}

/// Integer hints: an integer where one is wanted, anything else a type problem.
macro_rules! integer_hints {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.integer(visitor)
        }
    )*};
}

/// Deserializes one node.
struct NodeDe<'a> {
    node: &'a Node,
    ctx: &'a Ctx<'a>,
}

impl<'a> NodeDe<'a> {
    fn at<T>(&self, result: Result<T, Error>) -> Result<T, Error> {
        result.map_err(|e| e.at(self.node))
    }

    /// An integer where one is wanted; anything else is a type problem naming what the field
    /// wants (`must be a whole number`).
    fn integer<'de, V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match &self.node.kind {
            Kind::Int(..) => self.deserialize_any(visitor),
            _ => Err(de::Error::invalid_type(self.node.unexpected(), &visitor)).map_err(|e: Error| e.at(self.node)),
        }
    }
}

impl<'de> Deserializer<'de> for NodeDe<'_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let node = self.node;
        let result = match &node.kind {
            Kind::Str(s) => visitor.visit_str(s),
            Kind::Int(text, radix) => match i128::from_str_radix(text, *radix) {
                Ok(v) => match (i64::try_from(v), u64::try_from(v)) {
                    (Ok(v), _) => visitor.visit_i64(v),
                    (_, Ok(v)) => visitor.visit_u64(v),
                    _ => Err(de::Error::custom("integer out of range")),
                },
                Err(_) => Err(de::Error::custom("integer out of range")),
            },
            Kind::Float(text) => match text.parse::<f64>() {
                Ok(v) => visitor.visit_f64(v),
                Err(_) => Err(de::Error::custom("not a float")),
            },
            Kind::Bool(b) => visitor.visit_bool(*b),
            Kind::Datetime => Err(de::Error::invalid_type(Unexpected::Other("datetime"), &visitor)),
            Kind::List(items) => {
                visitor.visit_seq(ListDe { items: self.ctx.kept(items).collect(), at: 0, ctx: self.ctx })
            }
            Kind::Table(children) => {
                visitor.visit_map(TableDe { entries: self.ctx.kept(children).collect(), at: 0, ctx: self.ctx })
            }
        };
        self.at(result)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        // Not from a list either, which serde's derive would take field by field. A string
        // goes to the visitor: a derived struct refuses it as before, a type written either
        // way (an allowlist entry) takes it.
        if let Kind::Str(s) = &self.node.kind {
            let result = visitor.visit_str(s);
            return self.at(result);
        }
        let Kind::Table(children) = &self.node.kind else {
            return self.at(Err(de::Error::invalid_type(self.node.unexpected(), &visitor)));
        };
        let mut entries = Vec::with_capacity(children.len());
        for child in self.ctx.kept(children) {
            if fields.contains(&child.key.as_str()) {
                entries.push(child);
            } else {
                self.ctx.unknown.borrow_mut().push((child.path.clone(), fields));
            }
        }
        let result = visitor.visit_map(TableDe { entries, at: 0, ctx: self.ctx });
        self.at(result)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        let one_of = variants.join(", ");
        let result = match &self.node.kind {
            Kind::Str(name) if variants.contains(&name.as_str()) => {
                let variant: StrDeserializer<'_, Error> = name.as_str().into_deserializer();
                visitor.visit_enum(variant)
            }
            Kind::Str(name) => {
                let hint = did_you_mean(name, variants);
                Err(de::Error::custom(format!("`{name}` is not one of: {one_of}{hint}")))
            }
            _ => Err(de::Error::custom(format!("must be one of: {one_of}, not {}", found(&self.node.unexpected())))),
        };
        self.at(result)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let node = self.node;
        visitor.visit_some(self).map_err(|e| e.at(node))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _name: &'static str, visitor: V) -> Result<V::Value, Error> {
        let node = self.node;
        visitor.visit_newtype_struct(self).map_err(|e| e.at(node))
    }

    integer_hints! { deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 }

    serde::forward_to_deserialize_any! {
        bool i128 u128 f32 f64 char str string bytes byte_buf unit unit_struct seq tuple tuple_struct map identifier
        ignored_any
    }
}

/// The values of a list, less those left out.
struct ListDe<'a> {
    items: Vec<&'a Node>,
    at: usize,
    ctx: &'a Ctx<'a>,
}

impl<'de> SeqAccess<'de> for ListDe<'_> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, Error> {
        let Some(node) = self.items.get(self.at).copied() else { return Ok(None) };
        self.at += 1;
        seed.deserialize(NodeDe { node, ctx: self.ctx }).map(Some).map_err(|e| e.at(node))
    }
}

/// The entries of a table, less those left out (and, for a struct, those it has no field for).
struct TableDe<'a> {
    entries: Vec<&'a Node>,
    at: usize,
    ctx: &'a Ctx<'a>,
}

impl<'de> MapAccess<'de> for TableDe<'_> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Error> {
        let Some(node) = self.entries.get(self.at) else { return Ok(None) };
        let key: StrDeserializer<'_, Error> = node.key.as_str().into_deserializer();
        seed.deserialize(key).map(Some).map_err(|e| e.at(node))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let node = self.entries.get(self.at).copied().ok_or_else(|| de::Error::custom("a value without its key"))?;
        self.at += 1;
        seed.deserialize(NodeDe { node, ctx: self.ctx }).map_err(|e| e.at(node))
    }
}
