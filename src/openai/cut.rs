//! A prefill answer with its echoed id arrays cut out (each left as `[]`), so the JSON parser
//! reads only the small rest: the ids, ~90 % of a long prompt's answer, are delimited,
//! validated and counted in one purpose-built pass instead of serde's scan plus a second one.
//!
//! Why this is exact: an array of digits and commas is a complete JSON value, and so is `[]`;
//! the bytes before a cut are unchanged, so a parser reaches the cut in the same state and
//! leaves it in the same state. The parse of the rest therefore has the structure of the
//! whole answer, and a member the parser finds at a cut's offset holds that cut's ids.

use serde_json::value::RawValue;

use super::ids::compact_array_at;

/// One cut: where its `[]` sits in the rest, the ids it stands for and their count.
struct Cut<'a> {
    at: usize,
    ids: &'a [u8],
    count: usize,
}

/// Ids that a cut stood for, validated and counted.
pub(crate) struct CutIds<'a> {
    /// The array's text, validated: ASCII digits, commas and brackets.
    pub(crate) raw: &'a [u8],
    pub(crate) count: usize,
}

/// The answer without its id arrays, and the cuts made.
pub(crate) struct CutAnswer<'a> {
    rest: Vec<u8>,
    cuts: Vec<Cut<'a>>,
}

impl<'a> CutAnswer<'a> {
    /// Cuts out every array that follows `key` (e.g. `"prompt_token_ids":[`, ending in `[`)
    /// and is compact ids (digits and commas, each id below `vocab` when given). `None` when
    /// nothing was cut: the answer is read whole.
    pub(crate) fn new(body: &'a [u8], key: &[u8], vocab: Option<u32>) -> Option<Self> {
        let mut rest = Vec::new();
        let mut cuts = Vec::new();
        let mut copied = 0usize;
        // Each search starts past the last array read (no scan of a cut array's ids for the
        // key: a compact array cannot hold it) or past the last key's `[`.
        let finder = memchr::memmem::Finder::new(key);
        let mut from = 0usize;
        while let Some(found) = body.get(from..).and_then(|tail| finder.find(tail)).map(|at| at + from) {
            let open = found + key.len() - 1;
            from = open + 1;
            let Some((len, count)) = body.get(open..).and_then(|tail| compact_array_at(tail, vocab)) else { continue };
            let end = open + len;
            let Some(array) = body.get(open..end) else { break };
            from = end;
            // Validated as ASCII digits, commas and brackets (no UTF-8 check over 232 KB at 37k).
            let ids = array;
            if rest.capacity() == 0 {
                rest.reserve(body.len().saturating_sub(array.len()) + 64);
            }
            rest.extend_from_slice(body.get(copied..open)?);
            cuts.push(Cut { at: rest.len(), ids, count });
            rest.extend_from_slice(b"[]");
            copied = end;
        }
        if cuts.is_empty() {
            return None;
        }
        rest.extend_from_slice(body.get(copied..)?);
        Some(Self { rest, cuts })
    }

    /// The bytes for the parser.
    pub(crate) fn rest(&self) -> &[u8] {
        &self.rest
    }

    /// The ids a cut stood for when `value` (parsed from [`CutAnswer::rest`]) is that cut.
    pub(crate) fn ids_of(&self, value: &RawValue) -> Option<CutIds<'a>> {
        let at = self.offset(value.get())?;
        if value.get() != "[]" {
            return None;
        }
        self.cuts.iter().find(|c| c.at == at).map(|c| CutIds { raw: c.ids, count: c.count })
    }

    /// True when `text`, a value parsed from the rest, spans a cut: its text is not the
    /// answer's, so it must be read from the whole answer. A text from elsewhere (a value
    /// written in its place) holds no cut.
    pub(crate) fn spans_a_cut(&self, text: &str) -> bool {
        self.offset(text).is_some_and(|start| self.cuts.iter().any(|c| c.at >= start && c.at < start + text.len()))
    }

    /// Where `text` starts in the rest, if it is a slice of it.
    fn offset(&self, text: &str) -> Option<usize> {
        let at = (text.as_ptr() as usize).checked_sub(self.rest.as_ptr() as usize)?;
        (at + text.len() <= self.rest.len()).then_some(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::ids::count_compact;
    use proptest::prelude::{prop_assert, prop_assert_eq, Just};

    const KEY: &[u8] = b"\"prompt_token_ids\":[";

    fn value<'r>(rest: &'r [u8], key: &str) -> &'r RawValue {
        let map: std::collections::HashMap<&str, &RawValue> = serde_json::from_slice(rest).unwrap();
        map.get(key).copied().unwrap()
    }

    #[test]
    fn cuts_compact_arrays_and_maps_the_parsed_member_back() {
        let body = br#"{"a":1,"prompt_token_ids":[5,6,7],"kv":{"x":[1]}}"#;
        let cut = CutAnswer::new(body, KEY, None).unwrap();
        assert_eq!(cut.rest(), br#"{"a":1,"prompt_token_ids":[],"kv":{"x":[1]}}"#);
        let ids = cut.ids_of(value(cut.rest(), "prompt_token_ids")).unwrap();
        assert_eq!((ids.raw, ids.count), (&b"[5,6,7]"[..], 3));
        assert!(!cut.spans_a_cut(value(cut.rest(), "kv").get()));
        assert!(cut.spans_a_cut(std::str::from_utf8(cut.rest()).unwrap()), "the whole rest holds the cut");
        assert!(!cut.spans_a_cut("[]"), "a text from elsewhere holds no cut");
    }

    #[test]
    fn leaves_what_is_not_compact_ids_to_the_parser() {
        for body in [
            &br#"{"prompt_token_ids":[1, 2]}"#[..],
            br#"{"prompt_token_ids":[]}"#,
            br#"{"prompt_token_ids":[01]}"#,
            br#"{"prompt_token_ids":[1,-2]}"#,
            br#"{"prompt_token_ids":[1.5]}"#,
            br#"{"prompt_token_ids":[[1]]}"#,
            br#"{"prompt_token_ids" : [1]}"#,
            br#"{"prompt_token_ids":[1"#,
        ] {
            assert!(CutAnswer::new(body, KEY, None).is_none(), "{}", String::from_utf8_lossy(body));
        }
        // Past the vocabulary: left whole, so the full scanner names the id.
        assert!(CutAnswer::new(br#"{"prompt_token_ids":[1,9]}"#, KEY, Some(9)).is_none());
    }

    #[test]
    fn a_key_seen_inside_another_value_is_cut_but_not_taken_for_the_member() {
        // The nested one is cut too; the parsed top-level member maps to its own cut only,
        // and the object holding the nested cut reads as spanning a cut.
        let body = br#"{"kv":{"prompt_token_ids":[9,9]},"prompt_token_ids":[1,2]}"#;
        let cut = CutAnswer::new(body, KEY, None).unwrap();
        let top = cut.ids_of(value(cut.rest(), "prompt_token_ids")).unwrap();
        assert_eq!((top.raw, top.count), (&b"[1,2]"[..], 2));
        assert!(cut.spans_a_cut(value(cut.rest(), "kv").get()));
        assert!(cut.ids_of(value(cut.rest(), "kv")).is_none());
        // A string that merely contains the key's text is never cut (its quotes are escaped).
        let body = br#"{"note":"\"prompt_token_ids\":[1]","prompt_token_ids":[3]}"#;
        let cut = CutAnswer::new(body, KEY, None).unwrap();
        assert_eq!(cut.ids_of(value(cut.rest(), "prompt_token_ids")).unwrap().raw, b"[3]");
        assert_eq!(value(cut.rest(), "note").get(), r#""\"prompt_token_ids\":[1]""#);
    }

    /// The rest with each cut's `[]` replaced by its ids, back in order.
    fn rejoined(cut: &CutAnswer<'_>) -> Vec<u8> {
        let (mut whole, mut copied) = (Vec::new(), 0);
        for c in &cut.cuts {
            whole.extend_from_slice(&cut.rest[copied..c.at]);
            whole.extend_from_slice(c.ids);
            copied = c.at + 2;
        }
        whole.extend_from_slice(&cut.rest[copied..]);
        whole
    }

    proptest::proptest! {
        /// Whatever the body, the cuts put back give it byte for byte, and the arrays cut are
        /// exactly the compact arrays that follow the key.
        #[test]
        fn cuts_rejoin_to_the_body_and_miss_no_array(parts in proptest::collection::vec(
            proptest::prop_oneof![
                "\"prompt_token_ids\":\\[[1-9][0-9]{0,3}(,[0-9]{1,4}){0,4}\\]",
                Just("\"prompt_token_ids\":[".to_owned()),
                Just("\"prompt_token_ids\":".to_owned()),
                "[0-9,]{0,12}",
                Just("]".to_owned()),
                Just("[".to_owned()),
                "[a-z\" :{}]{0,6}",
            ],
            0..16,
        )) {
            let body = parts.concat().into_bytes();
            let expected: Vec<usize> = body
                .windows(KEY.len())
                .enumerate()
                .filter(|(_, w)| *w == KEY)
                .map(|(at, _)| at + KEY.len() - 1)
                .filter(|&open| {
                    let array = memchr::memchr(b']', &body[open..]).map(|c| &body[open..=open + c]);
                    array.and_then(|a| count_compact(a, None)).is_some()
                })
                .collect();
            let Some(cut) = CutAnswer::new(&body, KEY, None) else {
                prop_assert!(expected.is_empty());
                return Ok(());
            };
            prop_assert_eq!(rejoined(&cut), body.clone());
            let found: Vec<usize> = cut.cuts.iter().map(|c| c.ids.as_ptr() as usize - body.as_ptr() as usize).collect();
            prop_assert_eq!(found, expected);
            for c in &cut.cuts {
                prop_assert_eq!(count_compact(c.ids, None), Some(c.count));
            }
        }
    }
}
