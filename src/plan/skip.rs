//! The prefill decision: whether an orchestrated request's decode computes the prompt alone
//! (token-in, no prefill leg) because it already holds nearly all of it and has room to.

use crate::metrics::{DecisionReason, PrefillDecision};

/// What is known when the decode has been chosen: the route's threshold, whether the request
/// has trusted local ids the decode can take token-in, the prompt's length in tokens, what
/// the chosen decode holds of it by its KV events, and the work already on that decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkipFacts {
    /// `prefill.skip_below_tokens` (0: off).
    pub threshold: u64,
    /// The prompt's token count, when the request has local ids the decode may take.
    pub prompt_tokens: Option<u64>,
    /// The prompt tokens the chosen decode holds (full blocks), by its events (`None`: no
    /// usable events).
    pub held_tokens: Option<u64>,
    /// Prompt tokens the decode is computing now for this instance's requests sent to it
    /// alone (not yet answering).
    pub computing_alone: u64,
    /// Requests the decode's engine reports queued (`vllm:num_requests_waiting`, a believed
    /// read; `None`: none).
    pub engine_waiting: Option<u64>,
}

/// The decision, why, and the tokens the decode lacks when that was known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decided {
    /// Prefill leg or decode alone.
    pub decision: PrefillDecision,
    /// What decided.
    pub reason: DecisionReason,
    /// The prompt tokens the decode would compute or pull: not held, the partial last block
    /// included.
    pub lacking: Option<u64>,
}

/// Decides: the decode alone when it lacks at most `threshold` tokens of a prompt it can take
/// token-in, and has room: what it computes alone for this instance stays within `threshold`
/// with this prompt added, and its engine queues nothing. A prefill leg otherwise, or when
/// either fact is unknown.
///
/// The room rule is what keeps the decode a decode: a prompt computed there stalls every
/// stream it generates for that step, and a queue there delays every P/D request's first
/// token too, so under load the prefill engine takes the work back.
pub fn decide(facts: SkipFacts) -> Decided {
    let prefill = |reason, lacking| Decided { decision: PrefillDecision::Prefill, reason, lacking };
    if facts.threshold == 0 {
        return prefill(DecisionReason::Off, None);
    }
    let Some(prompt) = facts.prompt_tokens else { return prefill(DecisionReason::NoLocalIds, None) };
    let Some(held) = facts.held_tokens else { return prefill(DecisionReason::NoDecodeEvents, None) };
    let lacking = prompt.saturating_sub(held);
    let busy = facts.computing_alone.saturating_add(lacking) > facts.threshold
        || facts.engine_waiting.is_some_and(|waiting| waiting > 0);
    if lacking <= facts.threshold && busy {
        prefill(DecisionReason::DecodeBusy, Some(lacking))
    } else if lacking <= facts.threshold {
        Decided {
            decision: PrefillDecision::DecodeAlone,
            reason: DecisionReason::UnderThreshold,
            lacking: Some(lacking),
        }
    } else {
        prefill(DecisionReason::OverThreshold, Some(lacking))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(threshold: u64, prompt: Option<u64>, held: Option<u64>) -> SkipFacts {
        SkipFacts { threshold, prompt_tokens: prompt, held_tokens: held, computing_alone: 0, engine_waiting: Some(0) }
    }

    #[test]
    fn an_agentic_turn_the_decode_mostly_holds_skips_the_prefill() {
        // 4,000 tokens of history held in blocks, 300 new: 300 lacking, under 512.
        let d = decide(facts(512, Some(4_300), Some(4_000)));
        assert_eq!(
            (d.decision, d.reason, d.lacking),
            (PrefillDecision::DecodeAlone, DecisionReason::UnderThreshold, Some(300))
        );
        // At the threshold exactly: still alone.
        assert_eq!(decide(facts(300, Some(4_300), Some(4_000))).decision, PrefillDecision::DecodeAlone);
    }

    #[test]
    fn a_prompt_the_decode_lacks_more_of_gets_its_prefill() {
        let d = decide(facts(512, Some(4_300), Some(3_000)));
        assert_eq!(
            (d.decision, d.reason, d.lacking),
            (PrefillDecision::Prefill, DecisionReason::OverThreshold, Some(1_300))
        );
        // A cold prompt: everything lacking.
        assert_eq!(decide(facts(512, Some(4_300), Some(0))).lacking, Some(4_300));
    }

    #[test]
    fn without_a_threshold_ids_or_events_the_prefill_runs() {
        assert_eq!(decide(facts(0, Some(10), Some(10))).reason, DecisionReason::Off);
        assert_eq!(decide(facts(512, None, Some(10))).reason, DecisionReason::NoLocalIds);
        assert_eq!(decide(facts(512, Some(10), None)).reason, DecisionReason::NoDecodeEvents);
        for d in
            [decide(facts(0, Some(10), Some(10))), decide(facts(512, None, None)), decide(facts(512, Some(1), None))]
        {
            assert_eq!((d.decision, d.lacking), (PrefillDecision::Prefill, None));
        }
    }

    #[test]
    fn events_claiming_more_than_the_prompt_lack_nothing() {
        // Held is counted in leading blocks of this prompt's chain, so never more than it;
        // should a source say so, nothing underflows.
        assert_eq!(decide(facts(1, Some(64), Some(96))).lacking, Some(0));
    }

    #[test]
    fn a_decode_already_computing_or_queueing_gets_a_prefill_leg() {
        let idle = facts(512, Some(4_300), Some(4_000));
        // 300 lacking: alone while what it computes alone stays within 512 with it.
        assert_eq!(decide(SkipFacts { computing_alone: 212, ..idle }).decision, PrefillDecision::DecodeAlone);
        let busy = decide(SkipFacts { computing_alone: 213, ..idle });
        assert_eq!(
            (busy.decision, busy.reason, busy.lacking),
            (PrefillDecision::Prefill, DecisionReason::DecodeBusy, Some(300))
        );
        // Its engine queues a request: the prefill engine takes the work.
        assert_eq!(decide(SkipFacts { engine_waiting: Some(1), ..idle }).reason, DecisionReason::DecodeBusy);
        // No believed read of its queue: its own count decides.
        assert_eq!(decide(SkipFacts { engine_waiting: None, ..idle }).decision, PrefillDecision::DecodeAlone);
        // Over the threshold stays over it, busy or not.
        let over = SkipFacts { held_tokens: Some(3_000), engine_waiting: Some(4), ..idle };
        assert_eq!(decide(over).reason, DecisionReason::OverThreshold);
    }
}
