//! Deadlines on pingora's fast timer (10 ms buckets, one clock thread), not tokio's: arming a
//! tokio timer locks the time driver and, when no other timer is due sooner, wakes the thread
//! parked on it (an eventfd write and a thread wake-up per request on the hot path).

use std::future::Future;
use std::time::Duration;

use futures_util::future::{Either, FutureExt};

/// The longest wait put on pingora's fast timer at once: past it, pingora's `fast_timeout`
/// would arm a tokio timer instead (the non-streamed decode's 30 min deadline did, on every
/// request: a lock of the time driver and a wake-up of the thread parked on it).
pub const FAST_TIMER_SLICE: Duration = pingora::prelude::fast_timeout::DEFAULT_FAST_TIMEOUT_TO_TOKIO_THRESHOLD;

/// `work`'s output, or `None` once `deadline` passes first, on pingora's fast timer: at
/// most [`FAST_TIMER_SLICE`] ahead at once, as pingora's `fast_timeout` takes it; a longer
/// deadline is waited in slices ([`in_slices`], `work` boxed).
///
/// A plain function, not an async one: an async fn holds `work` as its argument and again
/// inside the timeout, which doubled the size of every leg's future (copied at each await
/// up the chain; in a debug build it overflowed the stack).
pub fn before<F: Future>(deadline: tokio::time::Instant, work: F) -> impl Future<Output = Option<F::Output>> {
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    if left <= FAST_TIMER_SLICE {
        Either::Left(pingora::prelude::fast_timeout::fast_timeout(left, work).map(Result::ok))
    } else {
        Either::Right(in_slices(deadline, FAST_TIMER_SLICE, Box::pin(work)))
    }
}

/// `work`'s output, or `None` once `deadline` passes first: waited on pingora's fast timer in
/// slices of at most `most`, so a long deadline never falls back to tokio's timer.
pub async fn in_slices<F: Future + ?Sized>(
    deadline: tokio::time::Instant,
    most: Duration,
    mut work: std::pin::Pin<Box<F>>,
) -> Option<F::Output> {
    // Bounded: each pass waits a slice (at least the timer's 10 ms resolution, but the last),
    // and the deadline is finite.
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let slice = left.min(most);
        match pingora::prelude::fast_timeout::fast_timeout(slice, work.as_mut()).await {
            Ok(output) => return Some(output),
            Err(_) if slice == left => return None,
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_done_in_time_is_returned() {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let work = async {
            tokio::task::yield_now().await;
            7
        };
        assert_eq!(before(deadline, work).await, Some(7));
    }

    #[tokio::test]
    async fn a_deadline_longer_than_a_slice_is_waited_whole() {
        let started = tokio::time::Instant::now();
        let deadline = started + Duration::from_millis(200);
        let never = std::future::pending::<()>();
        assert_eq!(in_slices(deadline, Duration::from_millis(30), Box::pin(never)).await, None);
        // Not after the first slice: the whole deadline (the fast timer fires in 10 ms buckets,
        // never early).
        assert!(started.elapsed() >= Duration::from_millis(190), "gave up after {:?}", started.elapsed());
    }

    #[tokio::test]
    async fn work_that_finishes_in_a_later_slice_is_returned() {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let work = async {
            tokio::time::sleep(Duration::from_millis(120)).await;
            "done"
        };
        assert_eq!(in_slices(deadline, Duration::from_millis(30), Box::pin(work)).await, Some("done"));
    }
}
