//! One endpoint's place in its publisher's sequence: which live batch comes next, when a jump
//! asks for a replay, and which batches of a replay's answer continue the sequence.

/// What a sequence number means for an endpoint's continuity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The next one (or the first since continuity was lost): apply it.
    Apply,
    /// Already applied (a replay covered it): skip it.
    Skip,
    /// Batches from `from` on were missed: replay them first.
    Gap { from: u64 },
}

/// What a replay is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    /// The whole buffer: a first contact, or one whose replay failed, asked again.
    Start,
    /// The batches from `from` on, missed on the live connection.
    Gap { from: u64 },
}

impl Replay {
    /// The first sequence asked for.
    pub fn from(self) -> u64 {
        match self {
            Replay::Start => 0,
            Replay::Gap { from } => from,
        }
    }
}

/// An endpoint's position in its publisher's sequence.
#[derive(Debug, Default, Clone, Copy)]
pub struct Sequencer {
    next: Option<u64>,
}

impl Sequencer {
    /// The step for a live message with sequence `seq` (moves past it unless a gap). A
    /// sequence below the next expected is a batch the connection's replay already brought,
    /// never a restart: a restarted engine is a new connection, which starts over anyway
    /// (a sequence back to 0 on the same connection cannot be told from such a duplicate).
    pub fn live(&mut self, seq: u64) -> Step {
        match self.next {
            Some(next) if seq > next => return Step::Gap { from: next },
            Some(next) if seq < next => return Step::Skip,
            _ => {}
        }
        self.next = Some(seq.saturating_add(1));
        Step::Apply
    }

    /// The next sequence expected, if continuity holds.
    pub fn next(&self) -> Option<u64> {
        self.next
    }

    /// Continuity from `next` on.
    pub fn resume_at(&mut self, next: Option<u64>) {
        self.next = next;
    }

    /// A replay from `from` answered, its first batch numbered `first` (none: nothing
    /// buffered). Returns whether it reaches back to `from`; continuity then resumes at `from`,
    /// and is lost when it does not (the endpoint must then be cleared). From the start
    /// whatever is buffered is a start, and an empty buffer means nothing was published yet:
    /// the next live batch must be 0 (one published before this subscription reached the
    /// publisher then shows as a gap).
    pub fn replay_answered(&mut self, from: u64, first: Option<u64>) -> bool {
        let fills = from == 0 || first.is_some_and(|seq| seq <= from);
        self.next = fills.then_some(from);
        fills
    }

    /// Whether the replayed batch `seq` continues the sequence (and moves past it if so): one
    /// at or past the next expected does, a hole in the buffer included; one before it was
    /// applied already.
    pub fn replayed(&mut self, seq: u64) -> bool {
        if self.next.is_none_or(|n| seq >= n) {
            self.next = Some(seq.saturating_add(1));
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequencer_applies_in_order_and_sees_gaps_and_duplicates() {
        let mut s = Sequencer::default();
        assert_eq!(s.live(5), Step::Apply, "the first after connecting");
        assert_eq!(s.live(6), Step::Apply);
        assert_eq!(s.live(9), Step::Gap { from: 7 });
        assert_eq!(s.next(), Some(7), "a gap does not move past it");
        s.resume_at(Some(9));
        assert_eq!(s.live(8), Step::Skip);
        assert_eq!(s.live(9), Step::Apply);
        assert_eq!(s.live(0), Step::Skip, "a replayed batch arriving live too");
        s.resume_at(None);
        assert_eq!(s.live(0), Step::Apply, "continuity lost: any sequence starts it again");
    }

    /// A replay from the start always fills (an empty buffer: nothing published yet), and its
    /// batches continue the sequence in order.
    #[test]
    fn a_replay_from_the_start_resumes_after_its_last_batch() {
        let mut s = Sequencer::default();
        assert!(s.replay_answered(Replay::Start.from(), None));
        assert_eq!(s.next(), Some(0), "nothing buffered: the next live batch must be 0");
        assert!(s.replay_answered(0, Some(40)), "a buffer starting later is still a start");
        assert!(s.replayed(40));
        assert!(s.replayed(41));
        assert_eq!(s.next(), Some(42));
        assert_eq!(s.live(42), Step::Apply);
    }

    /// A gap's replay fills when its buffer reaches back to the first missing batch; the
    /// batches before it were applied already.
    #[test]
    fn a_gap_replay_skips_what_was_applied_and_sees_whether_it_reaches_back() {
        let mut s = Sequencer::default();
        let from = Replay::Gap { from: 7 }.from();
        assert!(s.replay_answered(from, Some(3)));
        assert!(!s.replayed(5), "applied before the gap");
        assert!(s.replayed(7));
        assert!(s.replayed(9), "a hole in the buffer is not a gap");
        assert_eq!(s.next(), Some(10));

        assert!(!s.replay_answered(from, Some(8)), "the buffer no longer reaches back to 7");
        assert_eq!(s.next(), None, "continuity lost");
        assert!(s.replayed(8), "the first batch after starts it again");
        assert_eq!(s.next(), Some(9));
        assert!(!s.replay_answered(from, None), "nothing buffered past the start: cannot fill");
    }
}
