//! What a route learns at run time, kept apart from its config: whether its pools serve
//! different models, the parity watch's hold on reuse, and its retry budget. A reload that
//! leaves a route unchanged (same name, mode and pools) carries this state over, as pools
//! carry their endpoints' health, versions and ejections.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::parity::ParityHold;
use crate::upstream::RetryBudget;

/// One route's learned state, shared by every snapshot of the route across reloads.
///
/// The shadow verification of locally tokenized ids (DESIGN §10, "local ids") is learned
/// per route too and belongs here when it lands.
#[derive(Debug)]
pub struct RouteState {
    /// Set by the health poller: the prefill and decode pools report different models.
    models_differ: AtomicBool,
    /// Held by the parity watch after a mismatch under `disable_reuse`.
    parity_hold: Arc<ParityHold>,
    /// Caps the legs re-sent after an unstarted failure.
    retry_budget: Arc<RetryBudget>,
}

/// The retry budget's rule: a share of legs sent, and a floor per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetRule {
    /// Percent (0–100) of legs sent that may be re-sent.
    pub percent: u32,
    /// Retries a second allowed whatever the share.
    pub min_per_second: u32,
}

impl RouteState {
    /// The state of a new route: nothing learned yet, a full budget start.
    pub fn new(budget: BudgetRule, now: Instant) -> Arc<Self> {
        Arc::new(Self {
            models_differ: AtomicBool::new(false),
            parity_hold: Arc::default(),
            retry_budget: Arc::new(RetryBudget::new(budget.percent, budget.min_per_second, now)),
        })
    }

    /// The state of a route a reload rebuilt, `old` being the same route's (same name, mode
    /// and pools) before it: `old` itself when its pieces all still apply; else a new state
    /// keeping what does (a budget whose rule changed starts again; a parity hold is dropped
    /// when the route no longer holds reuse off on a mismatch).
    pub fn carried(old: &Arc<Self>, budget: BudgetRule, holds_on_mismatch: bool, now: Instant) -> Arc<Self> {
        let same_budget = old.retry_budget.has_rule(budget.percent, budget.min_per_second);
        let hold_applies = holds_on_mismatch || !old.parity_hold.is_held();
        if same_budget && hold_applies {
            return Arc::clone(old);
        }
        Arc::new(Self {
            models_differ: AtomicBool::new(old.models_differ()),
            parity_hold: if hold_applies { Arc::clone(&old.parity_hold) } else { Arc::default() },
            retry_budget: if same_budget {
                Arc::clone(&old.retry_budget)
            } else {
                Arc::new(RetryBudget::new(budget.percent, budget.min_per_second, now))
            },
        })
    }

    /// True while the route's pools report different models.
    pub fn models_differ(&self) -> bool {
        self.models_differ.load(Ordering::Relaxed)
    }

    /// Records whether the route's pools serve different models; true when it changed.
    pub fn set_models_differ(&self, differ: bool) -> bool {
        self.models_differ.swap(differ, Ordering::Relaxed) != differ
    }

    /// The parity watch's hold on reuse (given to the route's watch).
    pub fn parity_hold(&self) -> &Arc<ParityHold> {
        &self.parity_hold
    }

    /// The route's retry budget.
    pub fn retry_budget(&self) -> &RetryBudget {
        &self.retry_budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: BudgetRule = BudgetRule { percent: 50, min_per_second: 0 };

    #[test]
    fn an_unchanged_route_keeps_the_same_state() {
        let now = Instant::now();
        let old = RouteState::new(RULE, now);
        old.set_models_differ(true);
        let new = RouteState::carried(&old, RULE, false, now);
        assert!(Arc::ptr_eq(&old, &new));
        assert!(new.models_differ());
    }

    #[test]
    fn a_changed_budget_starts_again_and_the_rest_is_kept() {
        let now = Instant::now();
        let old = RouteState::new(RULE, now);
        old.set_models_differ(true);
        old.retry_budget().sent();
        old.retry_budget().sent();
        assert_eq!(old.retry_budget().available(now), 1);
        let new = RouteState::carried(&old, BudgetRule { percent: 20, ..RULE }, true, now);
        assert!(!Arc::ptr_eq(&old, &new));
        assert!(new.models_differ());
        assert!(Arc::ptr_eq(old.parity_hold(), new.parity_hold()));
        assert_eq!(new.retry_budget().available(now), 0);
    }

    #[test]
    fn a_hold_is_dropped_when_the_route_no_longer_holds_on_a_mismatch() {
        let now = Instant::now();
        let old = RouteState::new(RULE, now);
        old.parity_hold().hold_until(now + std::time::Duration::from_secs(60));
        assert!(RouteState::carried(&old, RULE, true, now).parity_hold().is_held());
        let new = RouteState::carried(&old, RULE, false, now);
        assert!(!new.parity_hold().is_held());
        assert!(Arc::ptr_eq(old.parity_hold(), RouteState::carried(&old, RULE, true, now).parity_hold()));
    }
}
