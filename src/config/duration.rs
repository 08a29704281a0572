//! Durations in the file: a string with its unit (`"500ms"`, `"30s"`, `"2m"`, `"1h"`, `"1.5s"`,
//! `"1m30s"`) or an integer in the unit its key ends with (`_ms`, `_seconds`). The fields of
//! `file.rs` name [`millis`] or [`seconds`] in `deserialize_with`; nothing else parses one.
//!
//! A small parser rather than `humantime`: four units are all a timeout needs, and humantime
//! also reads months and years (calendar guesses) and words its errors its own way.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};

/// Nanoseconds in one of each unit a duration may be written in.
const UNITS: [(&str, u128); 4] =
    [("ms", 1_000_000), ("s", 1_000_000_000), ("m", 60 * 1_000_000_000), ("h", 3600 * 1_000_000_000)];
const NANOS_PER_SECOND: u128 = 1_000_000_000;

/// `deserialize_with` of a `_ms` key: a bare integer is milliseconds.
pub fn millis<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    deserializer.deserialize_any(DurationVisitor(Unit::Millis))
}

/// `deserialize_with` of a `_seconds` key: a bare integer is seconds, and a string must come
/// to whole seconds (`"2m"`, not `"1.5s"`).
pub fn seconds<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    deserializer.deserialize_any(DurationVisitor(Unit::Seconds)).map(|d| d.as_secs())
}

/// What a duration as written is wrong with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadDuration {
    /// Not a number and unit (`30 s`, `5sec`, `-1s`).
    #[error("`{text}` is not a duration: write {} or a whole number of {}", .unit.examples(), .unit.name())]
    Text { text: String, unit: Unit },
    /// On a `_seconds` key, a part of a second (`1.5s`, `500ms`).
    #[error("`{0}` is not a whole number of seconds")]
    PartSecond(String),
    /// A negative integer.
    #[error("must not be negative, not {0}")]
    Negative(i64),
}

/// The unit of a duration key's bare integer, by the key's suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// `_ms`
    Millis,
    /// `_seconds`
    Seconds,
}

impl Unit {
    fn name(self) -> &'static str {
        match self {
            Self::Millis => "milliseconds",
            Self::Seconds => "seconds",
        }
    }

    /// Strings the key takes, as a message shows them.
    fn examples(self) -> &'static str {
        match self {
            Self::Millis => "500ms, 30s, 2m",
            Self::Seconds => "30s, 2m, 1h",
        }
    }

    fn of(self, n: u64) -> Duration {
        match self {
            Self::Millis => Duration::from_millis(n),
            Self::Seconds => Duration::from_secs(n),
        }
    }

    /// The duration `text` writes, if this unit's key takes it.
    fn parse(self, text: &str) -> Result<Duration, BadDuration> {
        let d = parse(text).ok_or_else(|| BadDuration::Text { text: text.to_owned(), unit: self })?;
        if self == Self::Seconds && d.subsec_nanos() != 0 {
            return Err(BadDuration::PartSecond(text.to_owned()));
        }
        Ok(d)
    }
}

struct DurationVisitor(Unit);

impl Visitor<'_> for DurationVisitor {
    type Value = Duration;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a duration such as {} or a whole number of {}", self.0.examples(), self.0.name())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
        Ok(self.0.of(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
        u64::try_from(v).map(|v| self.0.of(v)).map_err(|_| E::custom(BadDuration::Negative(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
        self.0.parse(v).map_err(E::custom)
    }
}

/// One or more `NUMBER UNIT` with nothing between (`1m30s`); a number is digits with an
/// optional fraction (`1.5`). `None` for anything else, or past `Duration`'s range.
fn parse(text: &str) -> Option<Duration> {
    let mut rest = text;
    let mut nanos: u128 = 0;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let (number, after) = rest.split_at(rest.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rest.len()));
        let (unit, after) = after.split_at(after.find(|c: char| !c.is_ascii_alphabetic()).unwrap_or(after.len()));
        let (_, per) = UNITS.iter().find(|(name, _)| *name == unit)?;
        nanos = nanos.checked_add(scaled(number, *per)?)?;
        rest = after;
    }
    let seconds = u64::try_from(nanos / NANOS_PER_SECOND).ok()?;
    let sub = u32::try_from(nanos % NANOS_PER_SECOND).ok()?;
    Some(Duration::new(seconds, sub))
}

/// `number` (`30`, `1.5`) of a unit of `per` nanoseconds, in nanoseconds (a fraction finer
/// than a nanosecond dropped).
fn scaled(number: &str, per: u128) -> Option<u128> {
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) if !f.is_empty() && f.len() <= 9 => (w, f),
        Some(_) => return None,
        None => (number, ""),
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || !(fraction.is_empty() || digits(fraction)) {
        return None;
    }
    let mut nanos = whole.parse::<u128>().ok()?.checked_mul(per)?;
    if !fraction.is_empty() {
        let places = 10u128.pow(u32::try_from(fraction.len()).ok()?);
        nanos = nanos.checked_add(fraction.parse::<u128>().ok()?.checked_mul(per)? / places)?;
    }
    Some(nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_with_units_parse() {
        let ms = Duration::from_millis;
        for (text, want) in [
            ("500ms", ms(500)),
            ("30s", ms(30_000)),
            ("2m", ms(120_000)),
            ("1h", ms(3_600_000)),
            ("1.5s", ms(1500)),
            ("0.25m", ms(15_000)),
            ("1m30s", ms(90_000)),
            ("1h0m1ms", ms(3_600_001)),
            ("0s", ms(0)),
        ] {
            assert_eq!(parse(text), Some(want), "{text}");
        }
        for bad in [
            "",
            "30",
            "30 s",
            " 30s",
            "s",
            "5sec",
            "-1s",
            "1.s",
            ".5s",
            "1.5.5s",
            "1e3ms",
            "30S",
            "1d",
            "1.0000000001s",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        assert_eq!(parse(&format!("{}h", u64::MAX)), None, "past Duration's range");
    }

    #[test]
    fn seconds_keys_take_whole_seconds_only() {
        assert_eq!(Unit::Seconds.parse("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(Unit::Seconds.parse("1.5s"), Err(BadDuration::PartSecond("1.5s".into())));
        assert_eq!(
            Unit::Millis.parse("30 s").map_err(|e| e.to_string()),
            Err("`30 s` is not a duration: write 500ms, 30s, 2m or a whole number of milliseconds".into())
        );
    }
}
