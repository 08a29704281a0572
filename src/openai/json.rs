//! Byte-preserving JSON object editing: a top-level object split into ordered members whose
//! values stay the exact bytes they arrived as, so fields we do not rewrite keep their bytes
//! and number types (dynamo#14659: a relayed `2` must not come out as `2.0`).

use std::borrow::Cow;
use std::fmt;

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

    fn write_nesting(&self, out: &mut Vec<u8>, nested: Option<(&str, &RawObject<'_>)>) {
        out.push(b'{');
        for (i, (k, v)) in self.members.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_json_string(out, k);
            out.push(b':');
            match nested {
                Some((key, inner)) if key == k => inner.write_nesting(out, None),
                _ => out.extend_from_slice(v.as_bytes()),
            }
        }
        out.push(b'}');
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
