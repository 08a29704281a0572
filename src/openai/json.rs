//! Byte-preserving JSON object editing: a top-level object split into ordered members whose
//! values stay the exact bytes they arrived as, so fields we do not rewrite keep their bytes
//! and number types (dynamo#14659: a relayed `2` must not come out as `2.0`).

use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// A JSON object as ordered `(key, raw value)` members.
#[derive(Debug, Clone)]
pub struct RawObject<'a> {
    members: Vec<(Cow<'a, str>, Cow<'a, str>)>,
}

/// The input was not a JSON object (or not JSON at all).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotAnObject(String);

#[derive(Deserialize)]
struct Key<'a>(#[serde(borrow)] Cow<'a, str>);

struct MembersVisitor;

impl<'de> Visitor<'de> for MembersVisitor {
    type Value = Vec<(Cow<'de, str>, Cow<'de, str>)>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
        let mut members = Vec::with_capacity(map.size_hint().unwrap_or(16));
        while let Some((key, value)) = map.next_entry::<Key<'de>, &'de RawValue>()? {
            members.push((key.0, Cow::Borrowed(value.get())));
        }
        Ok(members)
    }
}

struct Members<'a>(Vec<(Cow<'a, str>, Cow<'a, str>)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(MembersVisitor).map(Members)
    }
}

impl<'a> RawObject<'a> {
    /// Splits `text` into members; fails unless it is exactly one JSON object.
    pub fn parse(text: &'a str) -> Result<Self, NotAnObject> {
        match serde_json::from_str::<Members<'a>>(text) {
            Ok(m) => Ok(Self { members: m.0 }),
            Err(e) => Err(NotAnObject(e.to_string())),
        }
    }

    /// Like [`RawObject::parse`] on bytes that must be UTF-8 and nest at most [`MAX_DEPTH`]
    /// deep (raw members are not parsed here, so the depth is checked for them).
    pub fn parse_bytes(bytes: &'a [u8]) -> Result<Self, NotAnObject> {
        let text = std::str::from_utf8(bytes).map_err(|e| NotAnObject(e.to_string()))?;
        if nests_deeper_than(bytes, MAX_DEPTH) {
            return Err(NotAnObject(format!("nested deeper than {MAX_DEPTH} levels")));
        }
        Self::parse(text)
    }

    /// An empty object.
    pub fn new() -> Self {
        Self { members: Vec::new() }
    }

    /// The raw JSON text of the last member named `key` (JSON parsers keep the last duplicate).
    pub fn get(&self, key: &str) -> Option<&str> {
        self.members.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_ref())
    }

    /// True when `key` is present with a value other than `null`.
    pub fn has_non_null(&self, key: &str) -> bool {
        self.get(key).is_some_and(|v| v.trim() != "null")
    }

    /// Parses the member `key` as `T`; `None` when absent, `Some(Err)` when mistyped.
    pub fn get_as<'s, T: Deserialize<'s>>(&'s self, key: &str) -> Option<Result<T, serde_json::Error>> {
        self.get(key).map(serde_json::from_str)
    }

    /// Sets `key` to the raw JSON `value`, in place of the first occurrence (others dropped),
    /// or appended at the end. The caller guarantees `value` is valid JSON.
    pub fn set_raw(&mut self, key: &str, value: impl Into<Cow<'a, str>>) {
        let value = value.into();
        let mut first = None;
        let mut index = 0;
        self.members.retain(|(k, _)| {
            let keep = if k == key {
                let is_first = first.is_none();
                if is_first {
                    first = Some(index);
                }
                is_first
            } else {
                true
            };
            if keep {
                index += 1;
            }
            keep
        });
        match first.and_then(|i| self.members.get_mut(i)) {
            Some(slot) => slot.1 = value,
            None => self.members.push((Cow::Owned(key.to_owned()), value)),
        }
    }

    /// Removes every member named `key`; true if any was present.
    pub fn remove(&mut self, key: &str) -> bool {
        let before = self.members.len();
        self.members.retain(|(k, _)| k != key);
        self.members.len() != before
    }

    /// Member keys in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.members.iter().map(|(k, _)| k.as_ref())
    }

    /// Member values (raw JSON text) in order.
    pub fn values(&self) -> impl Iterator<Item = &str> {
        self.members.iter().map(|(_, v)| v.as_ref())
    }

    /// Writes the object compactly: members in order, each value byte for byte.
    pub fn to_bytes(&self) -> Vec<u8> {
        let size: usize = self.members.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
        let mut out = Vec::with_capacity(size + 2);
        self.write_to(&mut out);
        out
    }

    /// Appends the compact object to `out`.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        self.write_nesting(out, None);
    }

    /// [`Self::to_bytes`] with the value of member `key` (which must be set; its own value is
    /// ignored) written from `nested`: one allocation and one copy of each value, where
    /// serializing `nested` into a string first would copy its (possibly large) values twice.
    pub fn to_bytes_nesting(&self, key: &str, nested: &RawObject<'_>) -> Vec<u8> {
        let size = |o: &RawObject<'_>| -> usize { o.members.iter().map(|(k, v)| k.len() + v.len() + 4).sum() };
        let mut out = Vec::with_capacity(size(self) + size(nested) + 4);
        self.write_nesting(&mut out, Some((key, nested)));
        out
    }

    /// The bytes of [`Self::to_bytes_nesting`] (or [`Self::to_bytes`] without `nested`) as
    /// [`Pieces`]: values of at least [`SHARE_MIN`] bytes that lie inside `shared` (the
    /// buffer the request arrived in) are referenced there, and a value that is exactly
    /// [`IDS_HOLE`] is `ids`, not copied.
    pub fn to_pieces(
        &self,
        shared: Option<&Bytes>,
        nested: Option<(&str, &RawObject<'_>)>,
        ids: Option<&Bytes>,
    ) -> Pieces {
        let mut out = PiecesWriter { shared, ids, done: Vec::new(), small: Vec::with_capacity(512) };
        self.write_nesting(&mut out, nested);
        out.finish()
    }

    fn write_nesting(&self, out: &mut impl Sink, nested: Option<(&str, &RawObject<'_>)>) {
        out.small().push(b'{');
        for (i, (k, v)) in self.members.iter().enumerate() {
            if i > 0 {
                out.small().push(b',');
            }
            write_json_string(out.small(), k);
            out.small().push(b':');
            match nested {
                Some((key, inner)) if key == k => inner.write_nesting(out, None),
                _ => out.value(v),
            }
        }
        out.small().push(b'}');
    }
}

/// Where [`RawObject::write_nesting`] writes: small bytes, and member values.
trait Sink {
    /// The buffer for small bytes (punctuation, keys, small values).
    fn small(&mut self) -> &mut Vec<u8>;
    /// A member value, byte for byte.
    fn value(&mut self, v: &str) {
        self.small().extend_from_slice(v.as_bytes());
    }
}

impl Sink for Vec<u8> {
    fn small(&mut self) -> &mut Vec<u8> {
        self
    }
}

/// Smallest value referenced in the buffer it came in rather than copied (below it, one
/// more piece for the vectored write costs more than the copy).
pub const SHARE_MIN: usize = 4096;

/// A placeholder value for [`RawObject::to_pieces`]: written as the ids given there (a
/// `static`, so every use is the same address, which is how it is told apart).
pub static IDS_HOLE: &str = "\"tokenonce: prompt ids go here\"";

/// A request body in pieces, in order, for one vectored write: small parts copied into
/// buffers of their own, large values referenced in the buffers they arrived in (so a
/// 37k-token prompt's text and ids are not copied again on their way to an engine).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pieces(Vec<Bytes>);

impl Pieces {
    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.0.iter().map(Bytes::len).sum()
    }

    /// True when there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pieces in order.
    pub fn parts(&self) -> &[Bytes] {
        &self.0
    }

    /// The body as one buffer (a copy unless it is one piece).
    pub fn to_bytes(&self) -> Bytes {
        match self.0.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => Bytes::from(many.concat()),
        }
    }
}

impl From<Bytes> for Pieces {
    fn from(body: Bytes) -> Self {
        Self(vec![body])
    }
}

impl From<Vec<u8>> for Pieces {
    fn from(body: Vec<u8>) -> Self {
        Self(vec![Bytes::from(body)])
    }
}

/// True when `inner` is a part of `outer`'s memory (so `Bytes::slice_ref` can share it).
pub fn lies_inside(outer: &[u8], inner: &[u8]) -> bool {
    let (start, at) = (outer.as_ptr() as usize, inner.as_ptr() as usize);
    at >= start && at + inner.len() <= start + outer.len()
}

/// Builds [`Pieces`] for [`RawObject::to_pieces`].
struct PiecesWriter<'s> {
    shared: Option<&'s Bytes>,
    ids: Option<&'s Bytes>,
    done: Vec<Bytes>,
    small: Vec<u8>,
}

impl PiecesWriter<'_> {
    /// Ends the small buffer under way (if any) and adds `piece` after it.
    fn push(&mut self, piece: Bytes) {
        if !self.small.is_empty() {
            self.done.push(Bytes::from(std::mem::take(&mut self.small)));
        }
        self.done.push(piece);
    }

    fn finish(mut self) -> Pieces {
        if !self.small.is_empty() || self.done.is_empty() {
            self.done.push(Bytes::from(self.small));
        }
        Pieces(self.done)
    }
}

impl Sink for PiecesWriter<'_> {
    fn small(&mut self) -> &mut Vec<u8> {
        &mut self.small
    }

    fn value(&mut self, v: &str) {
        if let Some(ids) = self.ids.filter(|_| std::ptr::eq(v, IDS_HOLE)) {
            let ids = ids.clone();
            return self.push(ids);
        }
        match self.shared.filter(|s| v.len() >= SHARE_MIN && lies_inside(s, v.as_bytes())) {
            Some(shared) => {
                let piece = shared.slice_ref(v.as_bytes());
                self.push(piece);
            }
            None => self.small.extend_from_slice(v.as_bytes()),
        }
    }
}

impl Default for RawObject<'_> {
    fn default() -> Self {
        Self::new()
    }
}

/// Appends `s` as a JSON string literal.
pub fn write_json_string(out: &mut Vec<u8>, s: &str) {
    // serde_json never fails writing a str into a Vec.
    if serde_json::to_writer(&mut *out, s).is_err() {
        debug_assert!(false, "writing a JSON string into a Vec cannot fail");
    }
}

/// How deep arrays and objects may nest in a request body: serde_json's own limit for typed
/// parsing, so every field tokenonce or an engine parses later is within it.
pub const MAX_DEPTH: usize = 128;

/// True when `bytes` (JSON text) nests arrays and objects deeper than `limit`. One pass,
/// tracking strings so brackets inside them do not count.
pub fn nests_deeper_than(bytes: &[u8], limit: usize) -> bool {
    let mut depth = 0usize;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            // Skip a string's contents (most of a chat body) a machine word at a time.
            b'"' => match string_end(bytes, i + 1) {
                Some(end) => i = end,
                None => return false,
            },
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    false
}

/// Index of the `"` that closes the string whose contents start at `from`.
fn string_end(bytes: &[u8], mut from: usize) -> Option<usize> {
    loop {
        let at = from + memchr::memchr2(b'"', b'\\', bytes.get(from..)?)?;
        if bytes.get(at) == Some(&b'"') {
            return Some(at);
        }
        from = at + 2; // an escape: skip the backslash and the byte it escapes
    }
}

/// True when the raw JSON value is `null` (or absent).
pub fn is_null(raw: Option<&str>) -> bool {
    raw.is_none_or(|v| v.trim() == "null")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Large values of the source and the ids become pieces of their own buffers (no copy);
    /// the pieces read as the same bytes the copying writer produces.
    #[test]
    fn pieces_share_large_values_and_the_ids() {
        let big = "x".repeat(SHARE_MIN);
        let source = Bytes::from(format!(r#"{{"messages":["{big}"],"n":1}}"#));
        let mut obj = RawObject::parse(std::str::from_utf8(&source).unwrap()).unwrap();
        let ids = Bytes::from_static(b"[1,2,3]");
        obj.set_raw("prompt", IDS_HOLE);
        let pieces = obj.to_pieces(Some(&source), None, Some(&ids));
        let parts = pieces.parts();
        assert_eq!(parts.len(), 5, "head, messages, middle, ids, tail: {parts:?}");
        assert!(lies_inside(&source, &parts[1]), "the messages are a slice of the source");
        assert!(std::ptr::eq(parts[3].as_ptr(), ids.as_ptr()), "the ids are the ids' own buffer");
        let want = format!(r#"{{"messages":["{big}"],"n":1,"prompt":[1,2,3]}}"#);
        assert_eq!(pieces.to_bytes(), want.as_bytes());
        assert_eq!(pieces.len(), want.len());
        // Small values, and no source: one piece, a copy.
        let small = RawObject::parse(r#"{"a":1}"#).unwrap().to_pieces(Some(&source), None, None);
        assert_eq!(small.parts().len(), 1);
        assert_eq!(small.to_bytes(), &br#"{"a":1}"#[..]);
    }

    #[test]
    fn round_trip_keeps_value_bytes_and_order() {
        let text = r#"{"b": 1.0, "a":2,"nested":{"x":[1, 2.50, 1e3]},"s":"\u00e9"}"#;
        let obj = RawObject::parse(text).unwrap();
        assert_eq!(obj.keys().collect::<Vec<_>>(), ["b", "a", "nested", "s"]);
        assert_eq!(
            String::from_utf8(obj.to_bytes()).unwrap(),
            r#"{"b":1.0,"a":2,"nested":{"x":[1, 2.50, 1e3]},"s":"\u00e9"}"#
        );
    }

    #[test]
    fn set_replaces_in_place_and_drops_duplicates() {
        let mut obj = RawObject::parse(r#"{"a":1,"b":2,"a":3}"#).unwrap();
        assert_eq!(obj.get("a"), Some("3"));
        obj.set_raw("a", "9");
        obj.set_raw("c", "true");
        assert_eq!(obj.to_bytes(), br#"{"a":9,"b":2,"c":true}"#);
    }

    #[test]
    fn remove_and_null_checks() {
        let mut obj = RawObject::parse(r#"{"a":null,"b":2}"#).unwrap();
        assert!(!obj.has_non_null("a"));
        assert!(obj.has_non_null("b"));
        assert!(obj.remove("b"));
        assert!(!obj.remove("b"));
        assert_eq!(obj.to_bytes(), br#"{"a":null}"#);
    }

    #[test]
    fn rejects_non_objects() {
        assert!(RawObject::parse("[1,2]").is_err());
        assert!(RawObject::parse(r#"{"a":"#).is_err());
        assert!(RawObject::parse(r#"{"a":1} x"#).is_err());
        assert!(RawObject::parse_bytes(&[0xff, 0xfe]).is_err());
    }

    #[test]
    fn depth_counts_brackets_outside_strings_only() {
        assert!(!nests_deeper_than(br#"{"a":[[1]]}"#, 3));
        assert!(nests_deeper_than(br#"{"a":[[[1]]]}"#, 3));
        assert!(!nests_deeper_than(br#"{"a":"[[[[[[{{{{\"[[[["}"#, 1), "inside strings, escapes too");
        assert!(!nests_deeper_than(br#"{"a":"\\","b":"[["}"#, 1), "an escaped backslash ends no string early");
        assert!(nests_deeper_than(br#"{"a":"\\",[["#, 2), "brackets after an escaped backslash count");
        assert!(!nests_deeper_than(br#"{"a":"unterminated [[[["#, 1));
        let deep = format!("{{\"m\":{}1{}}}", "[".repeat(200), "]".repeat(200));
        assert!(RawObject::parse_bytes(deep.as_bytes()).is_err());
        let ok = format!("{{\"m\":{}1{}}}", "[".repeat(100), "]".repeat(100));
        assert!(RawObject::parse_bytes(ok.as_bytes()).is_ok());
    }

    /// The byte-at-a-time scan the string skipping replaced: the reference.
    fn reference_depth(bytes: &[u8], limit: usize) -> bool {
        let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
        for &b in bytes {
            if in_string {
                match (escaped, b) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'[' | b'{' => {
                    depth += 1;
                    if depth > limit {
                        return true;
                    }
                }
                b']' | b'}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        false
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]
        #[test]
        fn depth_scan_agrees_with_the_byte_loop(
            text in proptest::collection::vec(proptest::sample::select(b"[]{}\"\\ax,:".to_vec()), 0..64),
            limit in 0usize..6,
        ) {
            proptest::prop_assert_eq!(nests_deeper_than(&text, limit), reference_depth(&text, limit));
        }
    }

    #[test]
    fn escaped_keys_are_matched_decoded() {
        let obj = RawObject::parse(r#"{"mod\u0065l":"m"}"#).unwrap();
        assert_eq!(obj.get("model"), Some(r#""m""#));
    }
}
