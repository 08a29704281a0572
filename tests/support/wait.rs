//! Waiting for a condition the test cannot be told about (polled, bounded).

use std::time::Duration;

/// Polls `cond` every 50 ms until it holds; panics naming `what` if it has not within 60 s.
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..1200 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never: {what}");
}
