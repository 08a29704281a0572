//! Validated prompt token ids kept as the raw JSON array text they arrived in: checked in one
//! pass over the bytes and spliced into the decode body without becoming a `Vec<u32>` and back.

use std::fmt;

use bytes::Bytes;
use wide::u8x16;

use super::json::lies_inside;

/// Why an id array was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdsError {
    /// Not a JSON array of plain non-negative integers (floats, negatives, strings, nesting).
    #[error("prompt ids are not an array of non-negative integers ({0})")]
    Malformed(&'static str),
    /// The array is empty.
    #[error("prompt ids are empty")]
    Empty,
    /// The array length disagrees with `usage.prompt_tokens`.
    #[error("prompt ids count {count} != usage.prompt_tokens {expected}")]
    CountMismatch { count: usize, expected: u64 },
    /// An id is at or above the vocabulary size of the route's tokenizer.
    #[error("prompt id {id} is outside the tokenizer's vocabulary of {bound}")]
    OutOfVocab { id: u64, bound: u32 },
}

/// A JSON array of token ids that passed validation; holds its raw text and count.
#[derive(Clone, PartialEq, Eq)]
pub struct PromptIds {
    /// ASCII JSON array text (validated); a slice of the prefill answer when it came from one.
    raw: Bytes,
    count: usize,
}

impl fmt::Debug for PromptIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PromptIds({} ids, {} bytes)", self.count, self.raw.len())
    }
}

impl PromptIds {
    /// Validates `raw` (JSON array text) and, if given, its length against `expected`.
    ///
    /// # Errors
    /// [`IdsError`] naming the first rule broken.
    pub fn parse(raw: &str, expected: Option<u64>) -> Result<Self, IdsError> {
        Self::parse_within(raw, expected, None)
    }

    /// [`PromptIds::parse`], and every id below `vocab` (one compare per id, in the same pass).
    ///
    /// # Errors
    /// [`IdsError`] naming the first rule broken.
    pub fn parse_within(raw: &str, expected: Option<u64>, vocab: Option<u32>) -> Result<Self, IdsError> {
        // JSON's four whitespace bytes only: `str::trim` would also take e.g. U+00A0, which
        // no JSON parser (the decode engine's included) accepts.
        let raw = raw.trim_matches([' ', '\t', '\n', '\r']);
        // Compact arrays (what vLLM sends) in one branch-light pass; anything else, and every
        // refusal with its reason, through the full scanner.
        let count = match count_compact(raw.as_bytes(), vocab) {
            Some(n) => n,
            None => count_ids(raw.as_bytes(), vocab)?,
        };
        Self::counted(raw, count, expected)
    }

    /// Ids whose text `raw` a scanner already validated and counted (`count`); checks the
    /// count against `expected`.
    pub(crate) fn counted(raw: &str, count: usize, expected: Option<u64>) -> Result<Self, IdsError> {
        Self::counted_in(None, raw.as_bytes(), count, expected)
    }

    /// [`Self::counted`], keeping `raw` as a slice of `source` (no copy) when it lies inside.
    /// `raw` is the validated array text (ASCII: digits, commas, brackets, JSON whitespace).
    pub(crate) fn counted_in(
        source: Option<&Bytes>,
        raw: &[u8],
        count: usize,
        expected: Option<u64>,
    ) -> Result<Self, IdsError> {
        if count == 0 {
            return Err(IdsError::Empty);
        }
        if let Some(expected) = expected {
            if count as u64 != expected {
                return Err(IdsError::CountMismatch { count, expected });
            }
        }
        let raw = match source.filter(|s| lies_inside(s, raw)) {
            Some(source) => source.slice_ref(raw),
            None => Bytes::copy_from_slice(raw),
        };
        Ok(Self { raw, count })
    }

    /// The JSON array text as shared bytes (no copy).
    pub fn shared(&self) -> &Bytes {
        &self.raw
    }

    /// Builds from ids already held as integers (used by the relay cache and tests).
    pub fn from_ids(ids: &[u32]) -> Self {
        let mut raw = String::with_capacity(ids.len() * 7 + 2);
        raw.push('[');
        for (i, id) in ids.iter().enumerate() {
            if i > 0 {
                raw.push(',');
            }
            raw.push_str(&id.to_string());
        }
        raw.push(']');
        Self { raw: Bytes::from(raw), count: ids.len() }
    }

    /// The ids as a compact JSON array text. (ASCII by construction; the check is one pass.)
    pub fn as_json(&self) -> &str {
        std::str::from_utf8(&self.raw).unwrap_or("[]")
    }

    /// Length of the JSON array text in bytes.
    pub fn json_len(&self) -> usize {
        self.raw.len()
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Always false: an empty array never validates.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Decodes the ids into integers (one pass; the text was validated already).
    pub fn to_vec(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.count);
        let mut current: Option<u32> = None;
        for &b in self.raw.iter() {
            if b.is_ascii_digit() {
                let digit = u32::from(b - b'0');
                current = Some(current.unwrap_or(0).saturating_mul(10).saturating_add(digit));
            } else if let Some(v) = current.take() {
                out.push(v);
            }
        }
        out
    }
}

/// The element count of a compact array `[d,d,...]` (no whitespace) whose elements are all
/// integers without leading zeros and under 10 digits (so within `u32`), each below `vocab` when
/// given; `None` for anything else (including valid arrays with whitespace or 10-digit ids, and
/// an id past the vocabulary), which `count_ids` decides and names.
///
/// The shape is checked by folds over the bytes and over shifted copies of them, which the
/// compiler vectorizes (about 4.5 instructions per byte under callgrind, against 12.5 for the
/// element-by-element memchr walk it replaced, and 19 for serde's scan of the same array).
/// Only the vocabulary gate walks the elements.
pub(crate) fn count_compact(bytes: &[u8], vocab: Option<u32>) -> Option<usize> {
    compact_array_at(bytes, vocab).filter(|&(len, _)| len == bytes.len()).map(|(_, count)| count)
}

/// The compact array that `bytes` starts with (`[d,d,...]`, as [`count_compact`] takes it):
/// its length with both brackets, and its element count. One pass finds its end and checks
/// it (a search for the `]` first was a second pass over 232 KB of 37k ids); `None` when what
/// `bytes` starts with is not one.
pub(crate) fn compact_array_at(bytes: &[u8], vocab: Option<u32>) -> Option<(usize, usize)> {
    let after = bytes.strip_prefix(b"[")?;
    let (len, commas) = compact_run(after)?;
    if after.get(len) != Some(&b']') {
        return None;
    }
    if let Some(bound) = vocab {
        all_below(after.get(..len)?, bound)?;
    }
    Some((len + 2, commas + 1))
}

/// Bit i set where byte i of `block` is a comma, a digit, a zero (16 bytes per vector op).
#[inline(always)]
fn masks(block: &[u8; 64]) -> (u64, u64, u64) {
    let (mut comma, mut digit, mut zero) = (0u64, 0u64, 0u64);
    for (k, lane) in block.chunks_exact(16).enumerate() {
        let v = u8x16::new(lane.try_into().unwrap_or([0; 16]));
        let shift = 16 * k;
        comma |= u64::from(v.simd_eq(u8x16::splat(b',')).to_bitmask()) << shift;
        digit |= u64::from((v - u8x16::splat(b'0')).simd_lt(u8x16::splat(10)).to_bitmask()) << shift;
        zero |= u64::from(v.simd_eq(u8x16::splat(b'0')).to_bitmask()) << shift;
    }
    (comma, digit, zero)
}

/// The masks of one 64-byte block: commas, digits, zeros.
#[derive(Clone, Copy)]
struct Block {
    comma: u64,
    digit: u64,
    zero: u64,
}

/// Flaws starting in block `a` (bit i: at its byte i), seen with block `b` after it: an empty
/// element (",,"), a zero that starts an element with a digit after it, ten bytes without a
/// comma. `before_a`: whether the byte before `a` is a comma (or the start).
#[inline(always)]
fn flaws(a: Block, b: Block, before_a: bool) -> u64 {
    let c = (u128::from(b.comma) << 64) | u128::from(a.comma);
    let d = (u128::from(b.digit) << 64) | u128::from(a.digit);
    let z = u128::from(a.zero);
    let empty = c & (c >> 1);
    let starts = (c << 1) | u128::from(before_a);
    let leading_zero = starts & z & (d >> 1);
    // Ten bytes from j on without a comma, in doublings: 2, 4, 8, then 8 at j and at j + 2.
    let run2 = !c & (!c >> 1);
    let run4 = run2 & (run2 >> 2);
    let run8 = run4 & (run4 >> 4);
    let run = run8 & (run8 >> 2);
    (empty | leading_zero | run) as u64
}

/// The run of digits and commas that `bytes` starts with, when it is `d,d,...` (no empty
/// element, no leading zero, no element of 10 digits or more): its length and comma count.
/// Read 64 bytes at a time into bit masks (commas, digits, zeros; 16 bytes per vector
/// compare), the run ending at the first other byte, each block's flaws found with the next
/// block's masks (a byte-at-a-time fold was over twice the time: docs/performance.md).
fn compact_run(bytes: &[u8]) -> Option<(usize, usize)> {
    let mut commas = 0u64;
    let mut bad = 0u64;
    let mut prev: Option<Block> = None;
    let mut before_prev = true;
    let mut at = 0usize;
    // The run's last bytes (under 64): those of the block where another byte ends it.
    let rest = loop {
        let Some(chunk) = bytes.get(at..at + 64) else {
            let tail = bytes.get(at..)?;
            let stop = tail.iter().position(|&b| !(b.is_ascii_digit() || b == b',')).unwrap_or(tail.len());
            break tail.get(..stop)?;
        };
        let chunk: &[u8; 64] = chunk.try_into().ok()?;
        let (comma, digit, zero) = masks(chunk);
        let other = !(comma | digit);
        if other != 0 {
            break chunk.get(..other.trailing_zeros() as usize)?;
        }
        let block = Block { comma, digit, zero };
        commas += u64::from(comma.count_ones());
        if let Some(p) = prev {
            bad |= flaws(p, block, before_prev);
            before_prev = p.comma >> 63 == 1;
        }
        prev = Some(block);
        at += 64;
    };
    let len = at + rest.len();
    let run = bytes.get(..len)?;
    let (&first, &last) = (run.first()?, run.last()?);
    if first == b',' || last == b',' {
        return None;
    }
    // The last bytes, padded with commas (no stray byte, no run), then a block of commas.
    let mut padded = [b','; 64];
    padded.get_mut(..rest.len()).unwrap_or_default().copy_from_slice(rest);
    let (comma, digit, zero) = masks(&padded);
    let valid = (1u64 << rest.len()) - 1; // rest.len() < 64
    let tail = Block { comma, digit, zero };
    commas += u64::from((comma & valid).count_ones());
    if let Some(p) = prev {
        bad |= flaws(p, tail, before_prev);
        before_prev = p.comma >> 63 == 1;
    }
    let end = Block { comma: u64::MAX, digit: 0, zero: 0 };
    // Pairs of padding commas are not empty elements: only flaws starting at real bytes.
    bad |= flaws(tail, end, before_prev) & valid;
    (bad == 0).then_some((len, commas as usize))
}

/// `Some(())` when every element of `inner` (shape already checked: 1 to 9 digits each) is
/// below `bound`: one compare per id.
fn all_below(inner: &[u8], bound: u32) -> Option<()> {
    let value = |e: &[u8]| e.iter().fold(0u32, |n, &d| n * 10 + u32::from(d.wrapping_sub(b'0')));
    inner.split(|&b| b == b',').all(|e| value(e) < bound).then_some(())
}

/// Counts the elements of a JSON array of integers in `0..=u32::MAX` (below `vocab` when
/// given), rejecting anything else.
fn count_ids(bytes: &[u8], vocab: Option<u32>) -> Result<usize, IdsError> {
    let limit = vocab.map_or(u64::MAX, u64::from);
    let mut it = bytes.iter().copied().peekable();
    if it.next() != Some(b'[') {
        return Err(IdsError::Malformed("not an array"));
    }
    let skip_ws = |it: &mut std::iter::Peekable<_>| {
        while matches!(it.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            it.next();
        }
    };
    skip_ws(&mut it);
    if it.peek() == Some(&b']') {
        it.next();
        skip_ws(&mut it);
        return if it.next().is_none() { Ok(0) } else { Err(IdsError::Malformed("trailing bytes")) };
    }
    let mut count = 0usize;
    loop {
        skip_ws(&mut it);
        let mut value: u64 = 0;
        let mut digits = 0usize;
        let mut leading_zero = false;
        while let Some(&b) = it.peek() {
            if !b.is_ascii_digit() {
                break;
            }
            if digits == 1 && leading_zero {
                return Err(IdsError::Malformed("leading zero"));
            }
            if digits == 0 && b == b'0' {
                leading_zero = true;
            }
            value = value * 10 + u64::from(b - b'0');
            digits += 1;
            if value > u64::from(u32::MAX) {
                return Err(IdsError::Malformed("id too large"));
            }
            it.next();
        }
        if digits == 0 {
            return Err(IdsError::Malformed(match it.peek() {
                Some(b'-') => "negative id",
                Some(b'[') => "nested array",
                _ => "not an integer",
            }));
        }
        if value >= limit {
            return Err(IdsError::OutOfVocab { id: value, bound: vocab.unwrap_or(u32::MAX) });
        }
        count += 1;
        skip_ws(&mut it);
        match it.next() {
            Some(b',') => continue,
            Some(b']') => break,
            Some(b'.' | b'e' | b'E') => return Err(IdsError::Malformed("not an integer")),
            _ => return Err(IdsError::Malformed("expected , or ]")),
        }
    }
    skip_ws(&mut it);
    if it.next().is_some() {
        return Err(IdsError::Malformed("trailing bytes"));
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_integer_arrays_and_counts_them() {
        let ids = PromptIds::parse("[151644, 8948,198,0]", Some(4)).unwrap();
        assert_eq!(ids.len(), 4);
        assert_eq!(ids.to_vec(), vec![151644, 8948, 198, 0]);
        assert_eq!(ids.as_json(), "[151644, 8948,198,0]");
        assert_eq!(PromptIds::parse(" [ 1 ] ", None).unwrap().to_vec(), vec![1]);
    }

    #[test]
    fn rejects_what_vllm_would_choke_on() {
        for bad in
            ["[1,-2]", "[1.0]", "[1e3]", "[\"1\"]", "[[1]]", "{}", "[1,]", "[01]", "[4294967296]", "[1] x", "null", ""]
        {
            assert!(matches!(PromptIds::parse(bad, None), Err(IdsError::Malformed(_))), "{bad}");
        }
        assert_eq!(PromptIds::parse("[]", None), Err(IdsError::Empty));
    }

    #[test]
    fn only_json_whitespace_is_trimmed() {
        assert_eq!(PromptIds::parse("\r\n\t [7] \n", None).unwrap().as_json(), "[7]");
        for bad in ["\u{a0}[1]", "[1]\u{c}", "\u{feff}[1]", "\u{2028}[1]", "[1]\u{3000}"] {
            assert!(matches!(PromptIds::parse(bad, None), Err(IdsError::Malformed(_))), "{bad:?}");
            assert!(serde_json::from_str::<Vec<u32>>(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn compact_fast_path_agrees_with_the_full_scanner() {
        for raw in [
            "[1]",
            "[0]",
            "[0,1]",
            "[10,0,7]",
            "[123456789]",
            "[1234567890]",
            "[4294967295]",
            "[4294967296]",
            "[01]",
            "[00]",
            "[1,01]",
            "[0,0]",
            "[1,0]",
            "[1,00]",
            "[10,01,2]",
            "[5,0123]",
            "[1234567890,1]",
            "[1,1234567890]",
            "[123456789,123456789]",
            "[1,]",
            "[,1]",
            "[]",
            "[1,,2]",
            "[1 ,2]",
            "[-1]",
            "[1.5]",
            "[1e3]",
            "[[1]]",
            "[\"1\"]",
            "1",
            "[1",
            "1]",
            "[a]",
        ] {
            let fast = count_compact(raw.as_bytes(), None);
            let full = count_ids(raw.as_bytes(), None).ok();
            if let Some(n) = fast {
                assert_eq!(Some(n), full, "{raw}");
            }
        }
        // What vLLM sends is decided by the fast path itself.
        for raw in ["[1]", "[0,1]", "[10,0,7]", "[123456789,5]", "[0,0]", "[1,0]", "[7,123456789,0]"] {
            assert_eq!(count_compact(raw.as_bytes(), None), count_ids(raw.as_bytes(), None).ok(), "{raw}");
        }
    }

    /// The comma count of `inner` when all of it is one compact run.
    fn compact_shape(inner: &[u8]) -> Option<usize> {
        compact_run(inner).filter(|&(len, _)| len == inner.len()).map(|(_, commas)| commas)
    }

    /// What `compact_shape` decides, element by element.
    fn compact_shape_by_elements(inner: &[u8]) -> Option<usize> {
        let elements: Vec<&[u8]> = inner.split(|&b| b == b',').collect();
        let fine = |e: &&[u8]| {
            !e.is_empty() && e.len() <= 9 && e.iter().all(u8::is_ascii_digit) && (e.len() == 1 || e[0] != b'0')
        };
        (!inner.is_empty() && elements.iter().all(fine)).then(|| elements.len() - 1)
    }

    proptest::proptest! {
        #[test]
        fn compact_shape_agrees_with_a_walk_of_the_elements(inner in "[0-9,x]{0,300}") {
            proptest::prop_assert_eq!(compact_shape(inner.as_bytes()), compact_shape_by_elements(inner.as_bytes()));
        }

        #[test]
        fn array_end_is_found_in_the_shape_pass(text in "[0-9,x\\]]{0,300}") {
            // What the search for the first `]` and then the shape check decided.
            let bytes = format!("[{text}").into_bytes();
            let two_passes = memchr::memchr(b']', &bytes)
                .and_then(|close| compact_shape_by_elements(&bytes[1..close]).map(|commas| (close + 1, commas + 1)));
            proptest::prop_assert_eq!(compact_array_at(&bytes, None), two_passes);
        }

        #[test]
        fn long_arrays_end_where_their_bracket_is(
            ids in proptest::collection::vec(0u32..1_000_000_000, 1..400),
            after in "[\\],x0-9]{0,8}",
        ) {
            let array = format!("[{}]", ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
            let bytes = format!("{array}{after}").into_bytes();
            proptest::prop_assert_eq!(compact_array_at(&bytes, None), Some((array.len(), ids.len())));
            // Cut short, or with its bracket replaced: not an array.
            proptest::prop_assert_eq!(compact_array_at(&bytes[..array.len() - 1], None), None);
            let mut swapped = bytes.clone();
            swapped[array.len() - 1] = b'x';
            proptest::prop_assert_eq!(compact_array_at(&swapped, None), None);
        }

        #[test]
        fn compact_shape_counts_well_formed_arrays(ids in proptest::collection::vec(0u32..1_000_000_000, 1..400)) {
            let inner = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
            proptest::prop_assert_eq!(compact_shape(inner.as_bytes()), Some(ids.len() - 1));
            // One flaw anywhere is found, whichever 64-byte block it falls in.
            for (at, flaw) in [(inner.len() / 2, ",,"), (inner.len(), ",0"), (0, "0")] {
                let mut flawed = inner.clone();
                flawed.insert_str(at, flaw);
                let expected = compact_shape_by_elements(flawed.as_bytes());
                proptest::prop_assert_eq!(compact_shape(flawed.as_bytes()), expected);
            }
        }
    }

    #[test]
    fn count_must_match_usage() {
        assert_eq!(PromptIds::parse("[1,2,3]", Some(4)), Err(IdsError::CountMismatch { count: 3, expected: 4 }));
    }

    #[test]
    fn ids_at_or_past_the_vocabulary_are_refused() {
        assert_eq!(PromptIds::parse_within("[0,4,1]", Some(3), Some(5)).unwrap().len(), 3);
        assert_eq!(
            PromptIds::parse_within("[0, 5,1]", Some(3), Some(5)),
            Err(IdsError::OutOfVocab { id: 5, bound: 5 })
        );
        assert_eq!(
            PromptIds::parse_within("[151669]", None, Some(151669)),
            Err(IdsError::OutOfVocab { id: 151669, bound: 151669 })
        );
        assert!(PromptIds::parse_within("[4294967295]", None, None).is_ok());
        // The compact fast path gates too: it leaves an id past the vocabulary to the full
        // scanner, which names it.
        assert_eq!(count_compact(b"[0,4,1]", Some(5)), Some(3));
        assert_eq!(count_compact(b"[0,5,1]", Some(5)), None);
        assert_eq!(count_compact(b"[123456789]", Some(123456789)), None);
        assert_eq!(PromptIds::parse_within("[0,1,5]", Some(3), Some(5)), Err(IdsError::OutOfVocab { id: 5, bound: 5 }));
        // Shape errors still come first where they occur.
        assert!(matches!(PromptIds::parse_within("[1,-9]", None, Some(5)), Err(IdsError::Malformed(_))));
    }

    #[test]
    fn from_ids_round_trips() {
        let ids = PromptIds::from_ids(&[5, 0, 4294967295]);
        assert_eq!(ids.as_json(), "[5,0,4294967295]");
        assert_eq!(PromptIds::parse(ids.as_json(), Some(3)).unwrap().to_vec(), vec![5, 0, u32::MAX]);
    }
}
