//! One leg to an engine as the request path sends it (orchestrated prefill and decode, relay
//! legs, the release leg, passthrough with a read body): send, re-send once only when the
//! engine provably never got it and the route's budget allows, feed the outcome to the
//! endpoint's ejection, count retries, refusals and ejections. Deadlines and the client going
//! away race this future in the caller; a deadline that passes is reported back here as a
//! failure (`timed_out`), the client leaving counts as neither outcome.

use std::time::Instant;

use bytes::Bytes;
use pingora::http::RequestHeader;

use super::{Delivery, Exchange, Picked, RetryBudget, UpstreamClient, UpstreamError};
use crate::metrics::{ErrorKind, Leg, Metrics, RouteMetrics};

/// What sending a leg needs of its request: the connections, the route's retry budget, and
/// where its outcomes are counted and logged.
pub struct LegClient<'a> {
    /// The connections to the engines.
    pub client: &'a UpstreamClient,
    /// Process-wide series (retries by leg, ejections by pool).
    pub metrics: &'a Metrics,
    /// The route's retry budget.
    pub budget: &'a RetryBudget,
    /// The route's series (budget refusals).
    pub route_metrics: &'a RouteMetrics,
    /// The route's name, for logs.
    pub route: &'a str,
    /// The request's id, for logs.
    pub request_id: &'a str,
}

impl LegClient<'_> {
    /// Sends `head` and `body` to `endpoint` on `leg` and returns the engine's answer head.
    ///
    /// Retry rule: a leg is re-sent once, to the same endpoint on a new connection, only when
    /// the engine provably never got it (connect failed, or the request could not be written
    /// whole; see `UpstreamClient::attempt`), the failure is not a refused certificate, and
    /// the route's retry budget has a retry. A failure after the request was written is never
    /// re-sent: a decode must not run twice.
    ///
    /// The outcome feeds the endpoint's passive ejection: no answer or a 5xx head is a
    /// failure, any other head a success (a deadline the caller lets pass: [`Self::timed_out`]). `delivery` is marked once the request is written whole.
    ///
    /// # Errors
    /// [`UpstreamError`] when the engine gave no answer head.
    pub async fn exchange(
        &self,
        leg: Leg,
        endpoint: &Picked,
        head: &RequestHeader,
        body: &[Bytes],
        delivery: &Delivery,
    ) -> Result<Exchange, UpstreamError> {
        let result = self.send_and_resend(leg, endpoint, head, body, delivery).await;
        let failed = result.as_ref().map_or(true, |exchange| exchange.status() >= 500);
        if failed {
            self.failed(endpoint);
        } else {
            endpoint.endpoint().request_succeeded();
        }
        result
    }

    /// Records that `endpoint` let a leg's deadline pass (the caller dropped the exchange): a
    /// failure for its ejection, as no answer is, so an engine that accepts and never answers
    /// is ejected like one that refuses.
    pub fn timed_out(&self, endpoint: &Picked) {
        self.failed(endpoint);
    }

    /// One failure of `endpoint` for its pool's ejection rule (counted and logged when it ejects).
    fn failed(&self, endpoint: &Picked) {
        let Some(pool) = endpoint.ejection() else { return };
        if endpoint.endpoint().request_failed(Instant::now(), pool.eject_after) {
            self.metrics.upstream_ejection(&pool.name);
            tracing::warn!(pool = %pool.name, endpoint = %endpoint.addr(), "endpoint ejected after consecutive failures");
        }
    }

    /// [`Self::exchange`] without the ejection bookkeeping: the send and its one re-send.
    async fn send_and_resend(
        &self,
        leg: Leg,
        to: &Picked,
        head: &RequestHeader,
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
            self.route_metrics.retry_refused();
            tracing::info!(request_id = %self.request_id, route = %self.route, error = %failure.error, "retry budget exhausted");
            return Err(failure.error);
        }
        self.metrics.upstream_retry(leg);
        tracing::debug!(request_id = %self.request_id, error = %failure.error, "leg re-sent: the engine never got it");
        self.client.resend(to.endpoint().target(), head, body, delivery).await.map_err(|f| f.error)
    }
}
