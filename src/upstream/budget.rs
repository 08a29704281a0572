//! A route's retry budget: a token bucket that caps re-sent legs at a share of the legs
//! sent plus a small floor per second, so a failing engine is not hit twice as hard and a
//! quiet route can still retry. Pure (time is passed in), so tests need no clock.

use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// Tokens are kept in thousandths of a retry, so a 20 % share is a whole number per send.
const MILLI: u64 = 1000;

/// Seconds of the floor the bucket can save up (at least [`MIN_CAP_RETRIES`] retries): a
/// burst after a quiet spell may retry this much, no more.
const CAP_SECONDS: u64 = 10;

/// Smallest bucket, in retries, so a share-only budget (floor 0) can still save a few.
const MIN_CAP_RETRIES: u64 = 10;

/// The rule: every leg sent earns `percent`/100 of a retry, every second earns
/// `min_per_second` retries; the bucket holds at most `CAP_SECONDS` of the floor (at least
/// `MIN_CAP_RETRIES`) and starts with one second of the floor; a retry spends one. So over
/// any span, retries ≤ percent % of legs + min_per_second × seconds + the cap.
#[derive(Debug)]
pub struct RetryBudget {
    per_send: u64,
    per_second: u64,
    cap: u64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    milli: u64,
    refilled_at: Instant,
}

impl RetryBudget {
    /// A budget of `percent` (0–100) of legs plus `min_per_second` retries a second.
    pub fn new(percent: u32, min_per_second: u32, now: Instant) -> Self {
        let per_second = u64::from(min_per_second) * MILLI;
        let cap = (per_second * CAP_SECONDS).max(MIN_CAP_RETRIES * MILLI);
        Self {
            per_send: u64::from(percent.min(100)) * MILLI / 100,
            per_second,
            cap,
            state: Mutex::new(State { milli: per_second.min(cap), refilled_at: now }),
        }
    }

    /// True when this budget follows the rule `new(percent, min_per_second, _)` sets.
    pub fn has_rule(&self, percent: u32, min_per_second: u32) -> bool {
        self.per_send == u64::from(percent.min(100)) * MILLI / 100
            && self.per_second == u64::from(min_per_second) * MILLI
    }

    /// A leg was sent (its first attempt): earns the share.
    pub fn sent(&self) {
        let mut s = self.state.lock();
        s.milli = (s.milli + self.per_send).min(self.cap);
    }

    /// Asks for one retry at `now`: true (and spent) when the bucket holds one.
    pub fn try_retry(&self, now: Instant) -> bool {
        let mut s = self.state.lock();
        let elapsed = now.saturating_duration_since(s.refilled_at);
        let earned = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX).saturating_mul(self.per_second) / MILLI;
        if earned > 0 || self.per_second == 0 {
            s.milli = s.milli.saturating_add(earned).min(self.cap);
            s.refilled_at = now;
        }
        if s.milli >= MILLI {
            s.milli -= MILLI;
            true
        } else {
            false
        }
    }

    /// Retries available now, rounded down (for tests and logs).
    pub fn available(&self, now: Instant) -> u64 {
        let s = self.state.lock();
        let elapsed = now.saturating_duration_since(s.refilled_at).min(Duration::from_secs(CAP_SECONDS));
        let earned = u64::try_from(elapsed.as_millis()).unwrap_or(0) * self.per_second / MILLI;
        (s.milli + earned).min(self.cap) / MILLI
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn share_only_budget_allows_one_retry_per_five_sends_at_20_percent() {
        let t = Instant::now();
        let b = RetryBudget::new(20, 0, t);
        assert!(!b.try_retry(t), "nothing earned yet");
        for _ in 0..4 {
            b.sent();
        }
        assert!(!b.try_retry(t));
        b.sent();
        assert!(b.try_retry(t));
        assert!(!b.try_retry(t));
        for _ in 0..1000 {
            b.sent();
        }
        assert_eq!(b.available(t), MIN_CAP_RETRIES, "capped");
    }

    #[test]
    fn floor_lets_a_quiet_route_retry_and_refills_with_time() {
        let t = Instant::now();
        let b = RetryBudget::new(0, 3, t);
        assert!((0..3).all(|_| b.try_retry(t)), "one second of the floor to start");
        assert!(!b.try_retry(t));
        assert!(b.try_retry(t + Duration::from_millis(400)), "1.2 retries earned");
        assert!(!b.try_retry(t + Duration::from_millis(400)));
        assert_eq!(b.available(t + Duration::from_secs(3600)), 30, "ten seconds of the floor at most");
    }

    #[test]
    fn zero_budget_never_retries() {
        let t = Instant::now();
        let b = RetryBudget::new(0, 0, t);
        b.sent();
        assert!(!b.try_retry(t + Duration::from_secs(60)));
    }
}
