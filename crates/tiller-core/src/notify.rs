//! The background-notification queues, as a pure core: per session, FIFO,
//! deduplicated by task id (a newer notification for a queued task replaces
//! its text and keeps its place), capped (the oldest are evicted). The
//! notification actor keeps this in memory, rebuilt from the store at
//! start, and writes what it decides ([`Change`]); the store decides
//! nothing. Reading the next item never removes it: the session's stored
//! start consumes it ([`Queues::consumed`]).

use std::collections::{BTreeMap, VecDeque};

use crate::SessionId;

/// One queued notification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Queued {
    /// Queue position, unique across sessions (the store's row id).
    pub id: i64,
    /// The task it reports on (the dedup key within a session).
    pub task_id: String,
    /// What the session is told.
    pub text: String,
    /// When it was first queued, ms since the epoch.
    pub created_ms: i64,
}

/// A change to write to the store, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// A new row.
    Insert {
        /// The session it prompts.
        session: SessionId,
        /// The row.
        item: Queued,
    },
    /// A queued row's text replaced (dedup). The whole row: a store
    /// shared by several nodes may no longer hold it (another node ran it
    /// meanwhile), and then it is queued again.
    Replace {
        /// The session it prompts.
        session: SessionId,
        /// The row, with its new text.
        item: Queued,
    },
    /// A row evicted over the cap.
    Evict {
        /// The row.
        id: i64,
    },
}

/// What queueing one notification did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Enqueued {
    /// It replaced a queued notification of the same task.
    pub deduplicated: bool,
    /// Task ids evicted (oldest first) to stay within the cap.
    pub evicted: Vec<String>,
    /// What to store.
    pub changes: Vec<Change>,
}

/// Every session's queue.
#[derive(Clone, Debug, Default)]
pub struct Queues {
    cap: usize,
    by_session: BTreeMap<SessionId, VecDeque<Queued>>,
    /// The next id to hand out.
    next_id: i64,
}

impl Queues {
    /// Empty queues of at most `cap` items per session.
    pub fn new(cap: usize) -> Self {
        Queues {
            cap: cap.max(1),
            by_session: BTreeMap::new(),
            next_id: 1,
        }
    }

    /// Queues rebuilt from stored rows (any order; ids give the order).
    pub fn restore(cap: usize, rows: impl IntoIterator<Item = (SessionId, Queued)>) -> Self {
        let mut q = Queues::new(cap);
        let mut rows: Vec<_> = rows.into_iter().collect();
        rows.sort_by_key(|(_, item)| item.id);
        for (session, item) in rows {
            q.next_id = q.next_id.max(item.id + 1);
            q.by_session.entry(session).or_default().push_back(item);
        }
        q
    }

    /// The next new item's id is at least `from` (a store shared by
    /// several nodes hands out ids, so no two nodes use the same one).
    pub fn reserve_ids(&mut self, from: i64) {
        self.next_id = self.next_id.max(from);
    }

    /// Queues a notification: replaces a queued one of the same task,
    /// else appends it and evicts the oldest over the cap.
    pub fn enqueue(
        &mut self,
        session: SessionId,
        task_id: &str,
        text: &str,
        now_ms: i64,
    ) -> Enqueued {
        let queue = self.by_session.entry(session).or_default();
        if let Some(item) = queue.iter_mut().find(|i| i.task_id == task_id) {
            item.text = text.to_owned();
            return Enqueued {
                deduplicated: true,
                evicted: Vec::new(),
                changes: vec![Change::Replace {
                    session,
                    item: item.clone(),
                }],
            };
        }
        let item = Queued {
            id: self.next_id,
            task_id: task_id.to_owned(),
            text: text.to_owned(),
            created_ms: now_ms,
        };
        self.next_id += 1;
        let mut changes = vec![Change::Insert {
            session,
            item: item.clone(),
        }];
        queue.push_back(item);
        let mut evicted = Vec::new();
        while queue.len() > self.cap {
            let old = queue.pop_front().expect("over the cap, so not empty");
            changes.push(Change::Evict { id: old.id });
            evicted.push(old.task_id);
        }
        Enqueued {
            deduplicated: false,
            evicted,
            changes,
        }
    }

    /// The session's oldest notification (it stays queued).
    pub fn next(&self, session: SessionId) -> Option<&Queued> {
        self.by_session.get(&session)?.front()
    }

    /// A started prompt consumed item `id` (its row goes with the start).
    pub fn consumed(&mut self, session: SessionId, id: i64) {
        if let Some(q) = self.by_session.get_mut(&session) {
            q.retain(|i| i.id != id);
            if q.is_empty() {
                self.by_session.remove(&session);
            }
        }
    }

    /// One session's queue, to put back if storing a change failed.
    pub fn session(&self, session: SessionId) -> Option<VecDeque<Queued>> {
        self.by_session.get(&session).cloned()
    }

    /// Puts a session's queue back as it was (see [`Queues::session`]).
    pub fn put_back(&mut self, session: SessionId, queue: Option<VecDeque<Queued>>) {
        match queue {
            Some(q) => self.by_session.insert(session, q),
            None => self.by_session.remove(&session),
        };
    }

    /// Sessions with queued notifications.
    pub fn sessions(&self) -> impl Iterator<Item = SessionId> + '_ {
        self.by_session.keys().copied()
    }

    /// How many are queued in all.
    pub fn len(&self) -> usize {
        self.by_session.values().map(VecDeque::len).sum()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.by_session.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Enqueue(u8, u8),
        Consume(u8),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        proptest::collection::vec(
            prop_oneof![
                3 => (0u8..3, 0u8..6).prop_map(|(s, t)| Op::Enqueue(s, t)),
                1 => (0u8..3).prop_map(Op::Consume),
            ],
            0..60,
        )
    }

    proptest! {
        /// Against a plain model: FIFO per session, one item per task,
        /// never over the cap, every change replayed on stored rows gives
        /// the same queues (what `restore` rebuilds after a restart).
        #[test]
        fn queues_match_the_model_and_their_stored_changes(ops in ops(), cap in 1usize..5) {
            let sid = |s: u8| SessionId::from_u128(u128::from(s) + 1);
            let mut q = Queues::new(cap);
            let mut model: BTreeMap<u8, Vec<(u8, u32)>> = BTreeMap::new();
            let mut rows: BTreeMap<i64, (SessionId, Queued)> = BTreeMap::new();
            for (n, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Enqueue(s, t) => {
                        let text = format!("{n}");
                        let out = q.enqueue(sid(s), &format!("t{t}"), &text, n as i64);
                        let m = model.entry(s).or_default();
                        let mut evicted = Vec::new();
                        if let Some(e) = m.iter_mut().find(|(task, _)| *task == t) {
                            e.1 = n as u32;
                            prop_assert!(out.deduplicated);
                        } else {
                            m.push((t, n as u32));
                            while m.len() > cap {
                                evicted.push(format!("t{}", m.remove(0).0));
                            }
                            prop_assert!(!out.deduplicated);
                        }
                        prop_assert_eq!(&out.evicted, &evicted);
                        for c in out.changes {
                            match c {
                                Change::Insert { session, item } => {
                                    prop_assert!(rows.insert(item.id, (session, item)).is_none());
                                }
                                Change::Replace { session, item } => {
                                    let row = rows.get_mut(&item.id).expect("stored");
                                    prop_assert_eq!(row.0, session);
                                    prop_assert_eq!(&row.1.task_id, &item.task_id);
                                    row.1.text = item.text;
                                }
                                Change::Evict { id } => {
                                    prop_assert!(rows.remove(&id).is_some());
                                }
                            }
                        }
                    }
                    Op::Consume(s) => {
                        let next = q.next(sid(s)).cloned();
                        let m = model.entry(s).or_default();
                        prop_assert_eq!(next.as_ref().map(|i| i.task_id.clone()), m.first().map(|(t, _)| format!("t{t}")));
                        if let Some(item) = next {
                            q.consumed(sid(s), item.id);
                            m.remove(0);
                            rows.remove(&item.id);
                        }
                    }
                }
                for (s, m) in &model {
                    let got: Vec<(String, String)> = q
                        .session(sid(*s))
                        .unwrap_or_default()
                        .into_iter()
                        .map(|i| (i.task_id, i.text))
                        .collect();
                    let want: Vec<(String, String)> =
                        m.iter().map(|(t, n)| (format!("t{t}"), format!("{n}"))).collect();
                    prop_assert_eq!(&got, &want);
                    prop_assert!(got.len() <= cap);
                }
                let restored = Queues::restore(cap, rows.values().cloned());
                for s in 0u8..3 {
                    prop_assert_eq!(restored.session(sid(s)), q.session(sid(s)));
                }
            }
        }
    }
}
