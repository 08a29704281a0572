//! Durations in the file: a string with its unit (`"500ms"`, `"1.5s"`, `"1m30s"`, ...) or an
//! integer in the unit its key ends with (`_ms`, `_seconds`), read as the key's kind ([`LegMs`],
//! ...), which carries the key's range and refuses a value outside it, at its key.
//!
//! A small parser rather than `humantime`: four units are all a timeout needs, and humantime
//! also reads months and years (calendar guesses) and words its errors its own way.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserialize, Deserializer, Visitor};

/// Nanoseconds in one of each unit a duration may be written in.
const UNITS: [(&str, u128); 4] =
    [("ms", 1_000_000), ("s", 1_000_000_000), ("m", 60 * 1_000_000_000), ("h", 3600 * 1_000_000_000)];
const NANOS_PER_SECOND: u128 = 1_000_000_000;

/// The longest any one leg's deadline may be (prefill, first byte, stream idle, client write,
/// release, body read); the latency histograms' buckets reach it.
pub const MAX_LEG_MS: u64 = 3_600_000;
/// A non-streamed answer may be a very long generation: the longest deadline of all, which
/// the request-latency buckets reach.
pub const MAX_ANSWER_MS: u64 = 6 * 3_600_000;
/// Ten minutes: the longest connect deadline and the longest time between two polls (health,
/// a pool's lookup, the file watch).
const MAX_POLL_MS: u64 = 600_000;
/// Reading the config file, or a pool's `discover` name, more often than this is no use.
const MIN_POLL_MS: u64 = 100;

/// A deadline of one leg or one wait (prefill, first byte, stream idle, client write, release,
/// a body read, the parity cool-down, the relay cache's wait for its decode): up to an hour.
pub type LegMs = Millis<1, MAX_LEG_MS>;
/// The deadline of a decode's whole answer (not streamed): up to six hours.
pub type AnswerMs = Millis<1, MAX_ANSWER_MS>;
/// A connect deadline, or the time between two health polls: up to ten minutes.
pub type PollMs = Millis<1, MAX_POLL_MS>;
/// How long an idle engine connection is kept: vLLM closes idle keep-alive connections after
/// 5 s, and ours must close first.
pub type IdleMs = Millis<1, 4999>;
/// An endpoint's first ejection: at most the longest ejection (`upstream::endpoint::EJECT_MAX`).
pub type EjectionMs = Millis<1, 120_000>;
/// Time between two lookups of a pool's `discover` name: 100 ms to ten minutes.
pub type DiscoverMs = Millis<MIN_POLL_MS, MAX_POLL_MS>;
/// Time between two reads of the config file: 0 (not watched), or 100 ms to ten minutes.
pub type WatchMs = Millis<MIN_POLL_MS, MAX_POLL_MS, true>;
/// Time between two reads of an engine's `/metrics`: 0 (never read), or 100 ms to ten minutes.
pub type EngineMetricsMs = Millis<MIN_POLL_MS, MAX_POLL_MS, true>;
/// How long a KV events subscriber may stay away before its entries are not believed: up to
/// a day.
pub type StaleMs = Millis<1, 86_400_000>;
/// A shutdown stage, in whole seconds: up to an hour.
pub type ShutdownSeconds = Seconds<1, 3600>;

/// A `_ms` key's duration, checked when read: `MIN` to `MAX` whole milliseconds (a fraction of
/// one is not counted), or also zero (off) when `OFF`. A field of `file.rs` names its kind's
/// [`read`](Self::read) in `deserialize_with` and keeps the plain `Duration` its readers take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Millis<const MIN: u64, const MAX: u64, const OFF: bool = false>(Duration);

impl<const MIN: u64, const MAX: u64, const OFF: bool> Millis<MIN, MAX, OFF> {
    /// `d`, if this kind of key takes it.
    ///
    /// # Errors
    /// [`BadDuration::OutOfRange`] naming the range.
    pub fn new(d: Duration) -> Result<Self, BadDuration> {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        within(ms, MIN, MAX, OFF).map(|()| Self(d))
    }

    /// The duration.
    pub fn get(self) -> Duration {
        self.0
    }

    /// `deserialize_with` of a key of this kind: the duration, checked.
    pub fn read<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        Self::deserialize(deserializer).map(Self::get)
    }
}

impl<'de, const MIN: u64, const MAX: u64, const OFF: bool> Deserialize<'de> for Millis<MIN, MAX, OFF> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let d = deserializer.deserialize_any(DurationVisitor(Unit::Millis))?;
        Self::new(d).map_err(de::Error::custom)
    }
}

/// A `_seconds` key's duration in whole seconds (`"2m"`, not `"1.5s"`), checked when read:
/// `MIN` to `MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seconds<const MIN: u64, const MAX: u64>(u64);

impl<const MIN: u64, const MAX: u64> Seconds<MIN, MAX> {
    /// `seconds`, if this kind of key takes it.
    ///
    /// # Errors
    /// [`BadDuration::OutOfRange`] naming the range.
    pub fn new(seconds: u64) -> Result<Self, BadDuration> {
        within(seconds, MIN, MAX, false).map(|()| Self(seconds))
    }

    /// The seconds.
    pub fn get(self) -> u64 {
        self.0
    }

    /// `deserialize_with` of a key of this kind: the seconds, checked.
    pub fn read<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        Self::deserialize(deserializer).map(Self::get)
    }
}

impl<'de, const MIN: u64, const MAX: u64> Deserialize<'de> for Seconds<MIN, MAX> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let d = deserializer.deserialize_any(DurationVisitor(Unit::Seconds))?;
        Self::new(d.as_secs()).map_err(de::Error::custom)
    }
}

/// `value` (in a key's unit) is `min` to `max`, or zero with `off`.
fn within(value: u64, min: u64, max: u64, off: bool) -> Result<(), BadDuration> {
    if (off && value == 0) || (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(BadDuration::OutOfRange { min, max, off })
    }
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
    /// Outside the key's range (in its unit); zero too unless `off`.
    #[error("must be {}between {min} and {max}", .off.then_some("0 (off) or ").unwrap_or_default())]
    OutOfRange { min: u64, max: u64, off: bool },
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
    fn each_kind_of_key_takes_its_range_and_names_it() {
        let ms = Duration::from_millis;
        assert_eq!(LegMs::new(ms(1)).map(LegMs::get), Ok(ms(1)));
        assert_eq!(LegMs::new(ms(MAX_LEG_MS)).map(LegMs::get), Ok(ms(MAX_LEG_MS)));
        for bad in [ms(0), Duration::from_micros(500), ms(MAX_LEG_MS + 1)] {
            let message = LegMs::new(bad).map_err(|e| e.to_string());
            assert_eq!(message, Err(format!("must be between 1 and {MAX_LEG_MS}")), "{bad:?}");
        }
        assert_eq!(WatchMs::new(ms(0)).map(WatchMs::get), Ok(ms(0)), "0: not watched");
        assert_eq!(WatchMs::new(ms(100)).map(WatchMs::get), Ok(ms(100)));
        let message = WatchMs::new(ms(99)).map_err(|e| e.to_string());
        assert_eq!(message, Err("must be 0 (off) or between 100 and 600000".into()));
        assert_eq!(ShutdownSeconds::new(3600).map(ShutdownSeconds::get), Ok(3600));
        assert_eq!(ShutdownSeconds::new(0).map_err(|e| e.to_string()), Err("must be between 1 and 3600".into()));
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
