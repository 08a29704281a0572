//! One leg to an engine as the request path sends it (orchestrated prefill and decode, relay
//! legs, the release leg, passthrough with a read body): pick its endpoint, send it within its
//! deadline, re-send or fail over when the rules allow, and feed its outcome to ejection.
//!
//! A leg is re-sent once only when the engine provably never got it and the route's budget
//! allows; a pool leg fails over to another endpoint; every outcome (a deadline that passed
//! included) feeds the endpoint's ejection. Retries, refusals, failovers and ejections are
//! counted, and the leg's trace context carried (a re-send, a failover and an ejection are
//! marked on its span). The client going away races this in the caller and counts as neither
//! outcome.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt;

use super::client::RequestHead;
use super::metrics::{LegMetrics, UpstreamMetrics};
use super::{Delivery, Endpoint, Exchange, Picked, Pool, Prompt, RetryBudget, UpstreamClient, UpstreamError};
use crate::metrics::{ErrorKind, Leg};
use crate::telemetry::RequestTrace;

/// Why a leg has no answer head.
#[derive(Debug)]
pub enum LegError {
    /// The leg's pool has no endpoint.
    NoEndpoint(Leg),
    /// The engine could not be reached or gave no answer head.
    Upstream {
        /// Which leg.
        leg: Leg,
        /// The failure, with the address (for the log only).
        source: UpstreamError,
    },
    /// The trace context could not be put in the leg's head.
    Head(String),
    /// The leg's deadline passed first.
    Timeout {
        /// Which leg.
        leg: Leg,
        /// The deadline that passed.
        after: Duration,
    },
}

/// An endpoint of `pool` for `leg` that carries no prompt to choose by (passthrough),
/// counted in flight until dropped.
///
/// # Errors
/// [`LegError::NoEndpoint`] when the pool is empty.
pub fn pick(pool: &Pool, leg: Leg) -> Result<Picked, LegError> {
    pool.pick().ok_or(LegError::NoEndpoint(leg))
}

/// An endpoint of `pool` for `leg` whose prompt is known by `prompt`, counted in flight
/// until dropped.
///
/// # Errors
/// [`LegError::NoEndpoint`] when the pool is empty.
pub fn pick_for<'c>(pool: &Pool, leg: Leg, prompt: impl Into<Prompt<'c>>) -> Result<Picked, LegError> {
    pool.pick_for(Instant::now(), &[], prompt).ok_or(LegError::NoEndpoint(leg))
}

/// A header-named engine, as a one-off endpoint (not in any pool, never ejected), reached
/// with its allowlist entry's TLS.
pub fn named_endpoint(addr: String, tls: Option<crate::tls::UpstreamTls>) -> Picked {
    Picked::new(Arc::new(Endpoint::with_tls(addr, tls)))
}

/// The endpoints a pool leg may fail over to: others of its pool, not tried yet, while its
/// attempts last (at most the pool's size; a one-off endpoint has no other).
pub struct Failover<'p> {
    pool: Option<&'p Pool>,
    tried: Vec<String>,
    left: usize,
}

impl<'p> Failover<'p> {
    /// After a first attempt on `first`, `attempts` in all.
    pub fn new(pool: Option<&'p Pool>, first: &Picked, attempts: usize) -> Self {
        let attempts = pool.map_or(1, |p| attempts.min(p.endpoints().len()));
        Self { pool, tried: vec![first.name().to_owned()], left: attempts.saturating_sub(1) }
    }
}

/// What sending a leg needs of its request: the connections, the route's retry budget, and
/// where its outcomes are counted and logged.
pub struct LegClient<'a> {
    /// The connections to the engines.
    pub client: &'a UpstreamClient,
    /// Process-wide series (retries by leg, ejections by pool).
    pub metrics: &'a UpstreamMetrics,
    /// The route's retry budget.
    pub budget: &'a RetryBudget,
    /// The route's leg series (budget refusals, prefill failovers).
    pub leg_metrics: &'a LegMetrics,
    /// The route's name, for logs.
    pub route: &'a str,
    /// The request's id, for logs.
    pub request_id: &'a str,
    /// The request's spans: each leg sends its own span's context.
    pub trace: &'a RequestTrace,
}

impl LegClient<'_> {
    /// Sends `head` and `body` to `endpoint` on `leg` and returns the engine's answer head,
    /// which must come within `limit` (none: unbounded). The head gets the leg's trace
    /// context (`traceparent`) first, and the endpoint's data-parallel rank when it has one
    /// (replacing any the client sent).
    ///
    /// Retry rule: a leg is re-sent once, to the same endpoint on a new connection, only when
    /// the engine provably never got it (connect failed, or the request could not be written
    /// whole; see `UpstreamClient::attempt`), the failure is not a refused certificate, and
    /// the route's retry budget has a retry. A failure after the request was written is never
    /// re-sent: a decode must not run twice.
    ///
    /// The outcome feeds the endpoint's passive ejection: no answer, a 5xx head or `limit`
    /// passing is a failure, any other head a success. `delivery` is marked once the request
    /// is written whole.
    ///
    /// # Errors
    /// [`LegError::Upstream`] when the engine gave no answer head, [`LegError::Timeout`] when
    /// `limit` passed first, [`LegError::Head`] when the trace context is not a header value.
    pub async fn send(
        &self,
        leg: Leg,
        endpoint: &Picked,
        head: RequestHead<'_>,
        body: &[Bytes],
        delivery: &Delivery,
        limit: Option<Duration>,
    ) -> Result<Exchange, LegError> {
        let trace = self.trace.headers_for(leg);
        let rank = endpoint.endpoint().rank_header();
        let extra: Vec<(&str, &str)> = trace
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .chain(rank.as_ref().map(|(name, value)| (*name, value.as_str())))
            .collect();
        let head = head.wire(endpoint.addr(), &extra).map_err(|e| LegError::Head(format!("{leg} leg head: {e}")))?;
        let exchange = async {
            let result = self.send_and_resend(leg, endpoint, &head, body, delivery).await;
            match &result {
                Err(e) => self.failed(leg, endpoint, e.kind()),
                Ok(exchange) if exchange.status() >= 500 => self.failed(leg, endpoint, ErrorKind::Status5xx),
                Ok(_) => endpoint.endpoint().request_succeeded(),
            }
            result.map_err(|source| LegError::Upstream { leg, source })
        };
        let Some(limit) = limit else { return exchange.await };
        match self.before(leg, endpoint, tokio::time::Instant::now() + limit, exchange).await {
            Some(result) => result,
            None => Err(LegError::Timeout { leg, after: limit }),
        }
    }

    /// Runs `work` on `endpoint` (`leg`'s exchange, and reading its answer) until `deadline`;
    /// `None` when the deadline passed first, a failure of `endpoint` for its ejection, as
    /// no answer is: an engine that accepts and never answers is ejected like one that refuses.
    ///
    /// The deadline is pingora's fast timer (10 ms buckets, armed only if `work` waits), as
    /// pingora's own session timeouts are: arming a tokio timer locks the time driver and,
    /// when no other timer is due sooner, wakes the thread parked on it, once per leg.
    pub fn before<'a, T>(
        &'a self,
        leg: Leg,
        endpoint: &'a Picked,
        deadline: tokio::time::Instant,
        work: impl Future<Output = T> + 'a,
    ) -> impl Future<Output = Option<T>> + 'a {
        // A combinator, not an async block: one awaiting `work` would hold it twice.
        crate::deadline::before(deadline, work).map(move |result| {
            if result.is_none() {
                self.failed(leg, endpoint, ErrorKind::Timeout);
            }
            result
        })
    }

    /// The next endpoint `failover` allows, counted and logged as a prefill failover; `None`
    /// when its attempts are spent or every endpoint of the pool was tried.
    pub fn fail_over(&self, failover: &mut Failover<'_>) -> Option<Picked> {
        if failover.left == 0 {
            return None;
        }
        let tried: Vec<&str> = failover.tried.iter().map(String::as_str).collect();
        let next =
            failover.pool.and_then(|p| p.pick_at(Instant::now(), &tried)).filter(|n| !tried.contains(&n.name()))?;
        failover.left -= 1;
        failover.tried.push(next.name().to_owned());
        self.leg_metrics.prefill_failover();
        self.trace.leg_attribute(Leg::Prefill, "tokenonce.failed_over", true);
        tracing::info!(request_id = %self.request_id, route = %self.route, "prefill failed over to another endpoint");
        Some(next)
    }

    /// One failure of `endpoint`, of `kind`: counted in its `endpoint_errors_total`, and for
    /// its pool's ejection rule (counted, logged and marked on `leg`'s span when it ejects).
    fn failed(&self, leg: Leg, endpoint: &Picked, kind: ErrorKind) {
        endpoint.endpoint().error(kind);
        let Some(pool) = endpoint.ejection() else { return };
        if endpoint.endpoint().request_failed(Instant::now(), pool.rule) {
            self.metrics.upstream_ejection(&pool.name);
            self.trace.leg_attribute(leg, "tokenonce.endpoint_ejected", endpoint.name().to_owned());
            tracing::warn!(pool = %pool.name, endpoint = %endpoint.name(), "endpoint ejected after consecutive failures");
        }
    }

    /// [`Self::send`] without the deadline and the ejection bookkeeping: the send and its one
    /// re-send.
    async fn send_and_resend(
        &self,
        leg: Leg,
        to: &Picked,
        head: &[u8],
        body: &[Bytes],
        delivery: &Delivery,
    ) -> Result<Exchange, UpstreamError> {
        self.budget.sent();
        let failure = match self.client.send(to.endpoint().target(), head, body, delivery).await {
            Ok(exchange) => return Ok(exchange),
            Err(failure) => failure,
        };
        // A refused certificate is refused again: never worth a retry.
        if !failure.unstarted || failure.error.kind() == ErrorKind::Tls {
            return Err(failure.error);
        }
        if !self.budget.try_retry(Instant::now()) {
            self.leg_metrics.retry_refused();
            tracing::info!(request_id = %self.request_id, route = %self.route, error = %failure.error, "retry budget exhausted");
            return Err(failure.error);
        }
        self.metrics.upstream_retry(leg);
        self.trace.leg_attribute(leg, "tokenonce.resent", true);
        tracing::debug!(request_id = %self.request_id, error = %failure.error, "leg re-sent: the engine never got it");
        self.client.resend(to.endpoint().target(), head, body, delivery).await.map_err(|f| f.error)
    }
}
