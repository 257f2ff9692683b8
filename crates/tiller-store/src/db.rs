//! What a store backend does: every statement the store runs, as one
//! method each, called on the store thread in the order commands were sent
//! (see [`crate::writer`]). SQLite (this file, over the functions of
//! `sessions`, `log`, `queues` and `deliveries`) and PostgreSQL (`pg`)
//! implement it; the writer, its batching, broken-log and head-cache rules
//! are shared.

use tiller_core::SessionId;

use crate::index::Tail;
use crate::log::Heads;
use crate::writer::Pending;
use crate::{
    ConversationWrite, CronFire, CronJob, Delivery, GoalRow, HistoryPage, Lease, LogHead, NodeInfo,
    NodeStatus, Notification, SessionExtras, SessionPage, SessionRecord, StateColumn, StoreError,
    StoredEvent, Unsettled, deliveries, log, queues, sessions,
};

type R<T> = Result<T, StoreError>;

/// A backend's connection, owned by the store thread.
pub(crate) trait Db: Send {
    /// Commits a batch of appends and what they imply (see
    /// [`log::append_batch`]).
    fn append_batch(&mut self, heads: &mut Heads, batch: &[Pending]) -> R<()>;
    /// Most sessions whose streamed appends share one commit (see
    /// [`crate::writer::next_batch`]): what a commit costs per session.
    fn sessions_per_commit(&self) -> usize {
        // A PostgreSQL commit's cost is its round trips and its flush of
        // the server's WAL, about the same for one session or a thousand:
        // a commit takes every session.
        usize::MAX
    }
    fn head(&mut self, session: SessionId) -> R<LogHead>;
    fn create_session(&mut self, rec: &SessionRecord, engine: Option<&str>) -> R<()>;
    fn get_session(&mut self, id: SessionId) -> R<Option<(SessionRecord, LogHead)>>;
    fn list_sessions(
        &mut self,
        cursor: Option<i64>,
        limit: usize,
        cwd: Option<&str>,
    ) -> R<SessionPage>;
    fn save_state(&mut self, id: SessionId, column: StateColumn, value: &str) -> R<()>;
    fn save_conversation(&mut self, id: SessionId, write: &ConversationWrite) -> R<()>;
    fn load_state(&mut self, id: SessionId) -> R<SessionExtras>;
    fn channel_seen(&mut self, key: &str, now_s: i64, window_s: i64) -> R<bool>;
    fn channel_unseen(&mut self, key: &str, seen_s: i64) -> R<()>;
    fn set_title(&mut self, id: SessionId, title: Option<&str>) -> R<()>;
    fn close_session(&mut self, id: SessionId) -> R<()>;
    fn delete_session(&mut self, id: SessionId) -> R<bool>;
    fn history(&mut self, session: SessionId, before: u64, limit: usize) -> R<HistoryPage>;
    fn last_of_kinds(&mut self, session: SessionId, kinds: &[&str]) -> R<Option<StoredEvent>>;
    fn events_after(&mut self, session: SessionId, after: u64, limit: usize)
    -> R<Vec<StoredEvent>>;
    fn unsettled(&mut self) -> R<Vec<Unsettled>>;
    fn notification_changes(&mut self, changes: &[tiller_core::notify::Change]) -> R<()>;
    /// Every queued notification, or `only` one session's.
    fn notifications(&mut self, only: Option<SessionId>) -> R<Vec<Notification>>;
    fn notification_backlog(&mut self) -> R<(Vec<SessionId>, usize)>;
    /// Adds a job; [`StoreError::SessionGone`] when its session was
    /// deleted meanwhile.
    fn cron_add(&mut self, job: &CronJob) -> R<()>;
    fn cron_list(&mut self) -> R<Vec<CronJob>>;
    fn cron_remove(&mut self, id: &str) -> R<bool>;
    /// Records a fire and moves its job from due time `.0` to `.1`;
    /// `AlreadyClaimed` (nothing written) if it was no longer due at `.0`.
    fn cron_fire(
        &mut self,
        change: &tiller_core::cron::FireChange,
        job_id: &str,
        from_to: (i64, i64),
    ) -> R<()>;
    /// Every waiting fire, or `only` one session's.
    fn cron_fires(&mut self, only: Option<SessionId>) -> R<Vec<CronFire>>;
    fn cron_backlog(&mut self) -> R<Vec<SessionId>>;
    fn goal_get(&mut self, session: SessionId) -> R<Option<GoalRow>>;
    /// Stores a goal; [`StoreError::SessionGone`] when its session was
    /// deleted meanwhile.
    fn goal_put(&mut self, goal: &GoalRow) -> R<()>;
    fn goal_delete(&mut self, session: SessionId) -> R<bool>;
    fn goals_active(&mut self) -> R<Vec<SessionId>>;
    fn deliveries_due(&mut self, now_ms: i64) -> R<Vec<Delivery>>;
    fn delivery_done(&mut self, id: i64, retry: Option<(i64, u32)>) -> R<()>;
    /// Holds delivery `id` until `until` if its row still says `held`.
    fn delivery_start(&mut self, id: i64, held: i64, until: i64) -> R<bool>;
    /// Whether the database answers (a trivial query).
    fn ping(&mut self) -> R<()>;
    /// Whether the connection was made again since the last call: what
    /// was cached of the logs may be stale (another daemon may have held
    /// the schema meanwhile).
    fn take_reconnected(&mut self) -> bool {
        false
    }
    /// Copies SQLite's write-ahead log into the database (nothing to do
    /// on PostgreSQL, whose server does its own); false when some frames
    /// could not be copied.
    fn checkpoint(&mut self) -> R<bool> {
        Ok(true)
    }
    /// Work the backend defers from commits, done between them when due
    /// (SQLite's log index, see [`crate::index`]); whether it did any.
    fn upkeep(&mut self) -> R<bool> {
        Ok(false)
    }
    /// Why a session's appends are refused, when its log is damaged (set
    /// aside, see [`crate::index`]): its reads are, so it must not grow.
    fn refusal(&self, _session: SessionId) -> Option<StoreError> {
        None
    }
    /// Whether any session's appends may be refused (a commit asks
    /// [`Db::refusal`] only then).
    fn refuses_any(&self) -> bool {
        false
    }
    /// Sets a session aside as if its log were found damaged.
    #[cfg(feature = "test-hooks")]
    fn set_aside_for_test(&mut self, _session: SessionId, _why: &str) {}
    /// Whether several daemons may share this store (leases apply).
    fn clustered(&self) -> bool {
        false
    }
    /// A fresh id for a queue's next item when several nodes share the
    /// store (`None`: the caller's own counter is the only one).
    fn fresh_id(&mut self, _queue: crate::IdQueue) -> R<Option<i64>> {
        Ok(None)
    }
    /// Records (or refreshes) this node in the cluster.
    fn join(&mut self, _node: &NodeInfo) -> R<()> {
        Ok(())
    }
    /// Takes the session's lease if it is free, expired or this node's.
    fn acquire_lease(&mut self, _session: SessionId, _node: &str, _ttl_ms: i64) -> R<Lease> {
        Ok(Lease::Acquired {
            fence: 0,
            previous: None,
        })
    }
    /// Renews every lease this node holds; the answer is the sessions
    /// whose lease another node took meanwhile (dropped from those held),
    /// with the fence this node held.
    fn renew_leases(&mut self, _node: &str, _ttl_ms: i64) -> R<Vec<(SessionId, i64)>> {
        Ok(Vec::new())
    }
    /// Lets go of leases (all of the node's when `only` is `None`) and,
    /// when leaving, of the node's row.
    fn release_leases(&mut self, _node: &str, _only: Option<&[SessionId]>, _leave: bool) -> R<()> {
        Ok(())
    }
    /// Sessions that need an owner now: work in flight or queued and no
    /// live lease (or a lease this node's earlier run left).
    fn orphans(&mut self, _node: &str, _limit: usize) -> R<Vec<SessionId>> {
        Ok(Vec::new())
    }
    /// The cluster's nodes.
    fn cluster_status(&mut self) -> R<Vec<NodeStatus>> {
        Ok(Vec::new())
    }
}

/// The SQLite backend: its one connection, and the log's index entries
/// not yet written (see [`crate::index`]), which reads of the log merge
/// with what the index names.
pub(crate) struct Sqlite {
    pub(crate) conn: rusqlite::Connection,
    tail: Tail,
}

impl Sqlite {
    /// Takes a migrated connection, and what a previous run left
    /// unindexed.
    pub(crate) fn new(conn: rusqlite::Connection) -> rusqlite::Result<Sqlite> {
        let tail = Tail::open(&conn)?;
        Ok(Sqlite { conn, tail })
    }
}

impl Drop for Sqlite {
    /// A clean close leaves nothing to take up at the next open.
    fn drop(&mut self) {
        if let Err(e) = self.tail.write_all(&self.conn) {
            tracing::warn!(error = %e, "the log's index could not be written at close; the next open takes it up");
        }
    }
}

impl Db for Sqlite {
    fn checkpoint(&mut self) -> R<bool> {
        // The writer runs it only while the checkpoint thread is idle, so
        // nothing should keep it from copying every frame.
        crate::checkpoint::passive(&self.conn)
    }
    fn refusal(&self, session: SessionId) -> Option<StoreError> {
        self.tail.refusal(session)
    }
    fn refuses_any(&self) -> bool {
        self.tail.refuses_any()
    }
    #[cfg(feature = "test-hooks")]
    fn set_aside_for_test(&mut self, session: SessionId, why: &str) {
        self.tail.set_aside_for_test(session, why);
    }
    fn upkeep(&mut self) -> R<bool> {
        if !self.tail.due() {
            return Ok(false);
        }
        self.tail.write_oldest(&self.conn)?;
        Ok(true)
    }
    fn append_batch(&mut self, heads: &mut Heads, batch: &[Pending]) -> R<()> {
        Ok(log::append_batch(
            &mut self.conn,
            heads,
            &mut self.tail,
            batch,
        )?)
    }
    fn sessions_per_commit(&self) -> usize {
        // A commit writes its segments one after the other at the log's
        // end, and no index page (see `crate::index`); what it costs per
        // session is the segment. 64 sessions' bursts keep a commit, what
        // an awaited append may wait for, short.
        64
    }
    fn head(&mut self, session: SessionId) -> R<LogHead> {
        Ok(log::head(
            &self.conn,
            session,
            self.tail.readable(session)?,
        )?)
    }
    fn create_session(&mut self, rec: &SessionRecord, engine: Option<&str>) -> R<()> {
        match engine {
            Some(engine) => sessions::create_with_engine(&mut self.conn, rec, engine)?,
            None => sessions::create_session(&self.conn, rec)?,
        }
        Ok(())
    }
    fn get_session(&mut self, id: SessionId) -> R<Option<(SessionRecord, LogHead)>> {
        Ok(sessions::get_session(
            &self.conn,
            id,
            self.tail.readable(id)?,
        )?)
    }
    fn list_sessions(
        &mut self,
        cursor: Option<i64>,
        limit: usize,
        cwd: Option<&str>,
    ) -> R<SessionPage> {
        let tail = &self.tail;
        let updated = |s| tail.of(s).last().map(|e| e.last_ts_ms);
        Ok(sessions::list_sessions(
            &self.conn, cursor, limit, cwd, updated,
        )?)
    }
    fn save_state(&mut self, id: SessionId, column: StateColumn, value: &str) -> R<()> {
        Ok(sessions::save_state(&self.conn, id, column, value)?)
    }
    fn save_conversation(&mut self, id: SessionId, write: &ConversationWrite) -> R<()> {
        Ok(sessions::save_conversation(&self.conn, id, write)?)
    }
    fn load_state(&mut self, id: SessionId) -> R<SessionExtras> {
        Ok(sessions::load_state(&self.conn, id)?)
    }
    fn channel_seen(&mut self, key: &str, now_s: i64, window_s: i64) -> R<bool> {
        Ok(sessions::channel_seen(&self.conn, key, now_s, window_s)?)
    }

    fn channel_unseen(&mut self, key: &str, seen_s: i64) -> R<()> {
        Ok(sessions::channel_unseen(&self.conn, key, seen_s)?)
    }
    fn set_title(&mut self, id: SessionId, title: Option<&str>) -> R<()> {
        Ok(sessions::set_title(&self.conn, id, title)?)
    }
    fn close_session(&mut self, id: SessionId) -> R<()> {
        Ok(sessions::close(&mut self.conn, id)?)
    }
    fn delete_session(&mut self, id: SessionId) -> R<bool> {
        let deleted = sessions::delete(&mut self.conn, id, self.tail.of(id))?;
        self.tail.forget(id);
        Ok(deleted)
    }
    fn history(&mut self, session: SessionId, before: u64, limit: usize) -> R<HistoryPage> {
        Ok(log::history(
            &self.conn,
            session,
            before,
            limit,
            self.tail.readable(session)?,
        )?)
    }
    fn last_of_kinds(&mut self, session: SessionId, kinds: &[&str]) -> R<Option<StoredEvent>> {
        Ok(log::last_of_kinds(
            &self.conn,
            session,
            kinds,
            self.tail.readable(session)?,
        )?)
    }
    fn events_after(
        &mut self,
        session: SessionId,
        after: u64,
        limit: usize,
    ) -> R<Vec<StoredEvent>> {
        Ok(log::events_after(
            &self.conn,
            session,
            after,
            limit,
            self.tail.readable(session)?,
        )?)
    }
    fn unsettled(&mut self) -> R<Vec<Unsettled>> {
        // A damaged session's prompts wait for its delete (which settles
        // nothing: it removes them): settling one would read its log,
        // which is refused, and stop the start-up.
        let mut open = log::unsettled(&self.conn)?;
        open.retain(|u| self.tail.readable(u.session).is_ok());
        Ok(open)
    }
    fn notification_changes(&mut self, changes: &[tiller_core::notify::Change]) -> R<()> {
        match queues::notification_changes(&mut self.conn, changes)? {
            None => Ok(()),
            Some(gone) => Err(StoreError::SessionGone(gone)),
        }
    }
    fn notifications(&mut self, only: Option<SessionId>) -> R<Vec<Notification>> {
        Ok(queues::notifications(&self.conn, only)?)
    }
    fn notification_backlog(&mut self) -> R<(Vec<SessionId>, usize)> {
        Ok(queues::notification_backlog(&self.conn)?)
    }
    fn cron_add(&mut self, job: &CronJob) -> R<()> {
        match queues::cron_add(&self.conn, job)? {
            true => Ok(()),
            false => Err(StoreError::SessionGone(job.session)),
        }
    }
    fn cron_list(&mut self) -> R<Vec<CronJob>> {
        Ok(queues::cron_list(&self.conn)?)
    }
    fn cron_remove(&mut self, id: &str) -> R<bool> {
        Ok(queues::cron_remove(&mut self.conn, id)?)
    }
    fn cron_fire(
        &mut self,
        change: &tiller_core::cron::FireChange,
        job_id: &str,
        from_to: (i64, i64),
    ) -> R<()> {
        match queues::cron_fire(&mut self.conn, change, job_id, from_to)? {
            true => Ok(()),
            false => Err(StoreError::AlreadyClaimed),
        }
    }
    fn cron_fires(&mut self, only: Option<SessionId>) -> R<Vec<CronFire>> {
        Ok(queues::cron_fires(&self.conn, only)?)
    }
    fn cron_backlog(&mut self) -> R<Vec<SessionId>> {
        Ok(queues::session_ids(&self.conn, queues::CRON_BACKLOG)?)
    }
    fn goal_get(&mut self, session: SessionId) -> R<Option<GoalRow>> {
        Ok(queues::goal_get(&self.conn, session)?)
    }
    fn goal_put(&mut self, goal: &GoalRow) -> R<()> {
        match queues::goal_put(&self.conn, goal)? {
            true => Ok(()),
            false => Err(StoreError::SessionGone(goal.session)),
        }
    }
    fn goal_delete(&mut self, session: SessionId) -> R<bool> {
        Ok(queues::goal_delete(&self.conn, session)?)
    }
    fn goals_active(&mut self) -> R<Vec<SessionId>> {
        Ok(queues::session_ids(&self.conn, queues::GOALS_ACTIVE)?)
    }
    fn deliveries_due(&mut self, now_ms: i64) -> R<Vec<Delivery>> {
        Ok(deliveries::due(&self.conn, now_ms)?)
    }
    fn delivery_done(&mut self, id: i64, retry: Option<(i64, u32)>) -> R<()> {
        Ok(deliveries::done(&self.conn, id, retry)?)
    }
    fn delivery_start(&mut self, id: i64, held: i64, until: i64) -> R<bool> {
        Ok(deliveries::start(&self.conn, id, held, until)?)
    }
    fn ping(&mut self) -> R<()> {
        Ok(self.conn.query_row("SELECT 1", [], |_| Ok(()))?)
    }
}
