//! Goal pacing: when a goal offers a continuation turn, what it says, and
//! what each ended turn does to the goal. Pure.

/// Consecutive loop-stopped goal turns that pause the goal.
pub const LOOP_STOPS_BEFORE_PAUSE: u32 = 3;

/// Where a goal stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GoalStatus {
    /// Goal turns are offered while the session is idle.
    Active,
    /// No goal turns until resumed; why it paused.
    Paused(PauseReason),
    /// The objective was met or the turn budget spent.
    Completed,
}

/// Why a goal paused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PauseReason {
    /// A person paused it.
    User,
    /// Too many consecutive turns were stopped by loop protection.
    LoopDetected,
}

impl PauseReason {
    /// The stable name (stored, and in `goal_paused` events).
    pub fn as_str(self) -> &'static str {
        match self {
            PauseReason::User => "user",
            PauseReason::LoopDetected => "loop_detected",
        }
    }

    /// The reason named `s`, if it is one.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "user" => Some(PauseReason::User),
            "loop_detected" => Some(PauseReason::LoopDetected),
            _ => None,
        }
    }
}

/// A goal's pacing state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Goal {
    /// What the goal's turns work toward (their prompt).
    pub objective: String,
    /// How many goal turns it may take.
    pub max_turns: u32,
    /// How many it took so far.
    pub turns_done: u32,
    /// Whether it offers turns now.
    pub status: GoalStatus,
    /// Consecutive goal turns stopped by loop protection.
    pub loop_stops: u32,
}

/// What an ended turn did to the goal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GoalChange {
    /// It paused (loop protection, or the user).
    Paused(PauseReason),
    /// A paused goal runs again.
    Resumed,
    /// It ran its turns.
    Completed,
}

impl Goal {
    /// An active goal with no turns taken.
    pub fn new(objective: String, max_turns: u32) -> Self {
        Self {
            objective,
            max_turns,
            turns_done: 0,
            status: GoalStatus::Active,
            loop_stops: 0,
        }
    }

    /// The next continuation prompt, if the goal wants a turn. It starts
    /// with the objective; after a loop-stopped turn it carries a note.
    pub fn continuation(&self) -> Option<String> {
        if self.status != GoalStatus::Active || self.turns_done >= self.max_turns {
            return None;
        }
        let mut text = self.objective.clone();
        text.push_str(&format!(
            "\n\n(Goal continuation {} of {}.",
            self.turns_done + 1,
            self.max_turns
        ));
        if self.loop_stops > 0 {
            text.push_str(
                " The last turn was stopped by loop protection: try a different approach.",
            );
        }
        text.push(')');
        Some(text)
    }

    /// Records an ended goal turn.
    pub fn turn_ended(&mut self, loop_stopped: bool) -> Option<GoalChange> {
        self.turns_done += 1;
        self.loop_stops = if loop_stopped { self.loop_stops + 1 } else { 0 };
        if self.status != GoalStatus::Active {
            return None;
        }
        if self.loop_stops >= LOOP_STOPS_BEFORE_PAUSE {
            self.status = GoalStatus::Paused(PauseReason::LoopDetected);
            return Some(GoalChange::Paused(PauseReason::LoopDetected));
        }
        if self.turns_done >= self.max_turns {
            self.status = GoalStatus::Completed;
            return Some(GoalChange::Completed);
        }
        None
    }

    /// A person resumes a paused goal (the loop count starts over).
    /// The user pauses it: only an active goal pauses.
    pub fn pause(&mut self) -> Option<GoalChange> {
        if self.status != GoalStatus::Active {
            return None;
        }
        self.status = GoalStatus::Paused(PauseReason::User);
        Some(GoalChange::Paused(PauseReason::User))
    }

    /// The user resumes it: only a paused goal resumes (its loop-stop
    /// count starts again).
    pub fn resume(&mut self) -> Option<GoalChange> {
        if let GoalStatus::Paused(_) = self.status {
            self.status = GoalStatus::Active;
            self.loop_stops = 0;
            Some(GoalChange::Resumed)
        } else {
            None
        }
    }
}

/// Which goal each session's goal turn is for. A goal set gets a number no
/// other ever had; an offered continuation takes the current one; the turn
/// counts (towards the budget, the loop stops) only while that is still
/// the session's goal. One set while the old goal's turn ran starts
/// afresh. In memory: a turn never outlives the daemon that started it.
#[derive(Debug, Default)]
pub struct Turns {
    current: std::collections::HashMap<crate::SessionId, u64>,
    offered: std::collections::HashMap<crate::SessionId, u64>,
    /// Sessions whose offered turn was offered before a resume.
    resumed: std::collections::HashSet<crate::SessionId>,
    last: u64,
}

impl Turns {
    /// A goal was set for `session`.
    pub fn set(&mut self, session: crate::SessionId) {
        self.last += 1;
        self.current.insert(session, self.last);
    }

    /// The session's goal was cleared.
    pub fn cleared(&mut self, session: crate::SessionId) {
        self.current.remove(&session);
    }

    /// The session was deleted: nothing of it is kept.
    pub fn forget(&mut self, session: crate::SessionId) {
        self.current.remove(&session);
        self.offered.remove(&session);
        self.resumed.remove(&session);
    }

    /// The user resumed the session's goal: the turn offered before, if
    /// one runs, no longer counts as a loop stop (a resume starts the
    /// count over; that turn's stop would count against the resumed goal).
    pub fn resumed(&mut self, session: crate::SessionId) {
        if self.offered.contains_key(&session) {
            self.resumed.insert(session);
        }
    }

    /// A continuation of the session's stored goal was offered (one stored
    /// before this daemon started is numbered now).
    pub fn offered(&mut self, session: crate::SessionId) {
        if !self.current.contains_key(&session) {
            self.set(session);
        }
        self.offered.insert(session, self.current[&session]);
        self.resumed.remove(&session);
    }

    /// A goal turn of `session` ended, stopped by loop protection or not:
    /// `None` when it does not count for its goal, else whether it counts
    /// as a loop stop (not when the goal was resumed since its offer).
    pub fn ended(&mut self, session: crate::SessionId, loop_stopped: bool) -> Option<bool> {
        let offered = self.offered.remove(&session);
        let before_resume = self.resumed.remove(&session);
        (offered.is_some() && offered == self.current.get(&session).copied())
            .then_some(loop_stopped && !before_resume)
    }
}

/// The ends of goal turns the store could not count yet, per session.
/// While a turn's end waits, the goal offers nothing (its next turn must
/// not start before the last one counted); a goal set or cleared meanwhile
/// drops it (that turn was not the new goal's). The tries again are the
/// queue actors' (`crate::backoff::Failures`).
#[derive(Debug, Default)]
pub struct Unstored {
    ends: std::collections::HashMap<crate::SessionId, End>,
}

/// A goal turn's end on its way to the stored goal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct End {
    /// Loop protection stopped the turn.
    pub loop_stopped: bool,
    /// The write an earlier try made, when one was made: it may have
    /// landed though its answer was lost (a connection to PostgreSQL that
    /// drops during `COMMIT`), and counting the end again would count it
    /// twice.
    pub tried: Option<Tried>,
}

/// What a tried write made of the goal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tried {
    /// The turn count it wrote (one more than the goal had).
    pub turns_done: u32,
    /// The status it wrote.
    pub status: GoalStatus,
    /// The change it made.
    pub change: Option<GoalChange>,
}

/// How an end counts in the goal the store holds now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counted {
    /// An earlier try's write landed: nothing to write; the change it
    /// made, to publish (none when the goal moved on since: a pause).
    Landed(Option<GoalChange>),
    /// Counted in the goal, which is to be written; the change it made.
    Write(Option<GoalChange>),
}

impl End {
    /// A turn's end not tried yet.
    pub fn new(loop_stopped: bool) -> Self {
        Self {
            loop_stopped,
            tried: None,
        }
    }

    /// Counts the end in `goal`, as the store holds it now. An earlier
    /// try's write landed when the stored count is the one it wrote (only
    /// a goal set or cleared, which drops the end, resets the count).
    pub fn count(&self, goal: &mut Goal) -> Counted {
        match self.tried {
            Some(t) if t.turns_done == goal.turns_done => {
                Counted::Landed(t.change.filter(|_| goal.status == t.status))
            }
            _ => Counted::Write(goal.turn_ended(self.loop_stopped)),
        }
    }

    /// Records the write about to be tried (`goal` as counted).
    pub fn trying(&mut self, goal: &Goal, change: Option<GoalChange>) {
        self.tried = Some(Tried {
            turns_done: goal.turns_done,
            status: goal.status,
            change,
        });
    }
}

impl Unstored {
    /// A goal turn's end could not be stored: it waits to be tried again.
    pub fn end_waits(&mut self, session: crate::SessionId, end: End) {
        self.ends.insert(session, end);
    }

    /// Whether a turn's end waits to be stored (the goal offers nothing).
    pub fn end_waiting(&self, session: crate::SessionId) -> bool {
        self.ends.contains_key(&session)
    }

    /// The turn's end that waits, taken to be tried again (`None` once a
    /// goal set or cleared since dropped it).
    pub fn take_end(&mut self, session: crate::SessionId) -> Option<End> {
        self.ends.remove(&session)
    }

    /// The session's goal was set or cleared: a turn's end that waits was
    /// not the new goal's.
    pub fn replaced(&mut self, session: crate::SessionId) {
        self.ends.remove(&session);
    }

    /// The user resumed the session's goal: a turn's end that waits still
    /// counts as a turn, no longer as a loop stop (it came before the
    /// resume, which starts that count over).
    pub fn resumed(&mut self, session: crate::SessionId) {
        if let Some(end) = self.ends.get_mut(&session) {
            end.loop_stopped = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_counts_only_for_the_goal_it_was_offered_for() {
        let (a, b) = (crate::SessionId::new(), crate::SessionId::new());
        let mut t = Turns::default();
        t.set(a);
        t.offered(a);
        assert_eq!(t.ended(a, false), Some(false), "the goal's own turn");
        assert_eq!(t.ended(a, false), None, "once");
        t.offered(a);
        t.set(a); // replaced while its turn ran
        assert_eq!(t.ended(a, true), None);
        t.offered(a);
        t.cleared(a);
        t.set(a); // cleared and set again: a new goal too
        assert_eq!(t.ended(a, false), None);
        // Stored before the daemon started: numbered at its first offer.
        t.offered(b);
        assert_eq!(t.ended(b, true), Some(true));
        assert_eq!(t.ended(b, false), None, "no turn was offered");
        t.set(b);
        t.offered(b);
        t.forget(b);
        assert!(!t.current.contains_key(&b) && !t.offered.contains_key(&b));
        assert_eq!(
            t.ended(b, false),
            None,
            "a deleted session's turn counts for nothing"
        );
    }

    #[test]
    fn an_uncounted_turn_end_holds_the_goal_back_until_taken_or_replaced() {
        let (a, b) = (crate::SessionId::new(), crate::SessionId::new());
        let mut u = Unstored::default();
        u.end_waits(a, End::new(true));
        assert!(u.end_waiting(a) && !u.end_waiting(b));
        assert_eq!(u.take_end(a), Some(End::new(true)));
        assert!(!u.end_waiting(a));
        assert_eq!(u.take_end(a), None, "taken once");
        u.end_waits(a, End::new(false));
        u.replaced(a);
        assert!(!u.end_waiting(a), "a new goal drops the old turn's end");
        assert_eq!(u.take_end(a), None);
    }

    /// A resume starts the loop-stop count over: a turn offered before
    /// it, or one whose end waits to be counted, still counts as a turn
    /// but not as a loop stop of the resumed goal.
    #[test]
    fn a_resume_drops_the_loop_stop_of_a_turn_from_before_it() {
        let s = crate::SessionId::new();
        let mut t = Turns::default();
        t.set(s);
        t.offered(s);
        t.resumed(s);
        assert_eq!(t.ended(s, true), Some(false), "offered before the resume");
        t.offered(s);
        assert_eq!(t.ended(s, true), Some(true), "offered after it");
        t.resumed(s); // nothing offered: the next turn's stop counts
        t.offered(s);
        assert_eq!(t.ended(s, true), Some(true));
        let mut u = Unstored::default();
        u.end_waits(s, End::new(true));
        u.resumed(s);
        assert_eq!(
            u.take_end(s),
            Some(End::new(false)),
            "its end waited across the resume"
        );
        u.resumed(s);
        assert!(!u.end_waiting(s), "a resume makes no end wait");
    }

    /// An end whose write landed though its answer was lost is not
    /// counted again; one whose write did not land is.
    #[test]
    fn an_end_is_counted_once_whatever_its_write_answered() {
        let mut stored = Goal::new("obj".into(), 2);
        let mut end = End::new(false);
        let mut goal = stored.clone();
        assert_eq!(end.count(&mut goal), Counted::Write(None));
        end.trying(&goal, None);
        // The write did not land: counted again, in the goal as it was.
        assert_eq!(end.count(&mut stored.clone()), Counted::Write(None));
        // It landed: found, nothing written again.
        stored = goal.clone();
        assert_eq!(end.count(&mut stored), Counted::Landed(None));
        assert_eq!(stored.turns_done, 1);
        // The last turn: its change is published once found.
        let mut last = End::new(false);
        let mut goal = stored.clone();
        let change = match last.count(&mut goal) {
            Counted::Write(c) => c,
            other => panic!("{other:?}"),
        };
        assert_eq!(change, Some(GoalChange::Completed));
        last.trying(&goal, change);
        assert_eq!(last.count(&mut goal.clone()), Counted::Landed(change));
        // Not when the goal moved on since (a pause of a loop-stopped goal).
        let mut looped = Goal::new("obj".into(), 9);
        looped.loop_stops = LOOP_STOPS_BEFORE_PAUSE - 1;
        let mut end = End::new(true);
        let change = match end.count(&mut looped) {
            Counted::Write(c) => c,
            other => panic!("{other:?}"),
        };
        end.trying(&looped, change);
        looped.status = GoalStatus::Active; // resumed since
        assert_eq!(end.count(&mut looped), Counted::Landed(None));
    }

    #[test]
    fn three_loop_stops_in_a_row_pause_the_goal() {
        let mut g = Goal::new("obj".into(), 10);
        assert_eq!(g.turn_ended(true), None);
        assert!(
            g.continuation()
                .unwrap()
                .contains("stopped by loop protection")
        );
        assert_eq!(g.turn_ended(false), None, "a clean turn resets the count");
        assert!(!g.continuation().unwrap().contains("loop protection"));
        assert_eq!(g.turn_ended(true), None);
        assert_eq!(g.turn_ended(true), None);
        assert_eq!(
            g.turn_ended(true),
            Some(GoalChange::Paused(PauseReason::LoopDetected))
        );
        assert_eq!(g.continuation(), None, "a paused goal offers nothing");
        assert_eq!(g.resume(), Some(GoalChange::Resumed));
        assert!(g.continuation().unwrap().starts_with("obj"));
    }

    #[test]
    fn max_turns_completes_the_goal() {
        let mut g = Goal::new("obj".into(), 2);
        assert!(g.continuation().unwrap().contains("1 of 2"));
        assert_eq!(g.turn_ended(false), None);
        assert_eq!(g.turn_ended(false), Some(GoalChange::Completed));
        assert_eq!(g.continuation(), None);
        assert_eq!(g.resume(), None);
    }
}

#[cfg(test)]
mod user_changes {
    use super::*;

    #[test]
    fn pause_and_resume_change_only_what_they_may() {
        let mut g = Goal::new("obj".into(), 2);
        assert_eq!(g.resume(), None, "an active goal does not resume");
        assert_eq!(g.pause(), Some(GoalChange::Paused(PauseReason::User)));
        assert_eq!(g.pause(), None, "already paused");
        assert_eq!(g.resume(), Some(GoalChange::Resumed));
        g.turn_ended(false);
        assert_eq!(g.turn_ended(false), Some(GoalChange::Completed));
        assert_eq!(g.pause(), None, "a completed goal stays completed");
        assert_eq!(g.resume(), None);
    }
}
