//! The store's unit tests. Those that are not about SQLite itself (its
//! file lock, its migrations, the inline store) run on PostgreSQL instead
//! when `TILLER_TEST_POSTGRES_URL` names a database (`scripts/test` runs
//! them both ways).

use std::path::Path;

/// A store for `path`: the SQLite file, or (with
/// `TILLER_TEST_POSTGRES_URL`) a PostgreSQL schema named after the path,
/// so opening the same path again opens the same data.
pub(crate) fn open_store(path: &Path) -> Result<crate::Store, crate::StoreError> {
    match std::env::var("TILLER_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => crate::Store::open_postgres(&url, &pg_schema(path)),
        _ => crate::Store::open(path),
    }
}

/// A session the store holds (a cron job needs one).
pub(crate) async fn stored_session(store: &crate::Store) -> tiller_core::SessionId {
    let id = tiller_core::SessionId::new();
    store
        .create_session(crate::SessionRecord {
            id,
            cwd: "/tmp".into(),
            title: None,
            created_ms: 1,
            updated_ms: 1,
            closed: false,
            channel: None,
        })
        .await
        .unwrap();
    id
}

/// The PostgreSQL schema a test's store path stands for.
pub(crate) fn pg_schema(path: &Path) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in path.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("t_{h:016x}")
}

mod basics {
    use crate::*;
    use std::time::Duration;
    use tiller_core::{PromptId, TurnId};

    /// One process owns a store: a second open is refused with a clear
    /// error (it would otherwise settle the owner's prompts as restarted),
    /// and once the owner closes it the file opens again with its data.
    #[tokio::test]
    async fn a_store_in_use_is_refused_until_its_owner_closes_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let owner = Store::open(&path).unwrap();
        let r = rec(1);
        owner.create_session(r.clone()).await.unwrap();
        // The log's index is in the process's memory (the `unix-excl`
        // VFS), not in a file another process could map.
        assert!(!dir.path().join("t.db-shm").exists());
        let second = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || Store::open(&path))
                .await
                .unwrap()
        };
        let Err(e) = second else {
            panic!("a second open of a store in use succeeded");
        };
        assert!(matches!(e, StoreError::InUse { .. }), "{e:?}");
        // Said as it is: this process holds it (another process is
        // refused by SQLite's lock, as the e2e test in restart.test.mjs
        // shows).
        assert!(
            e.to_string().contains("already open in this process"),
            "{e}"
        );
        // A check of the file (what `tiller doctor` runs) is told the
        // same, as a store that is busy, not a damaged one.
        let e = integrity_check(&path).unwrap_err();
        assert!(
            matches!(e, StoreError::InUse { .. }) && e.is_in_use(),
            "{e:?}"
        );
        owner.close().await;
        assert!(matches!(
            owner.get_session(r.id).await,
            Err(StoreError::Closed)
        ));
        let again = Store::open(&path).unwrap();
        assert_eq!(
            again.get_session(r.id).await.unwrap().unwrap().0.cwd,
            "/tmp"
        );
    }

    /// The store checkpoints SQLite's write-ahead log itself (SQLite's
    /// automatic checkpoint is replaced by the hook that counts frames):
    /// however much is written without a pause, on the store thread or
    /// inline, the log's file stays bounded ([`THREAD_BOUND`],
    /// [`INLINE_BOUND`]).
    #[tokio::test]
    async fn the_write_ahead_log_stays_bounded_by_the_writers_checkpoints() {
        for inline in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("t.db");
            let store = if inline {
                Store::open_inline(&path).unwrap()
            } else {
                Store::open(&path).unwrap()
            };
            let a = rec(1);
            store.create_session(a.clone()).await.unwrap();
            // Each durable append commits alone, with its 6 KB on pages of
            // their own: about 60 MB of log frames in all.
            let body = "x".repeat(6000);
            for seq in 1..=4500 {
                let mut e = ev(a.id, seq);
                e.data = format!("{{\"n\":{seq},\"pad\":\"{body}\"}}");
                store.append_durable(e, None).await.unwrap();
            }
            let bound = if inline { INLINE_BOUND } else { THREAD_BOUND };
            assert_log_bounded(dir.path(), bound, &format!("inline {inline}: "));
            let (_, head) = store.get_session(a.id).await.unwrap().unwrap();
            assert_eq!(head.last_seq, 4500, "inline {inline}");
            // The writer's checkpoints, not SQLite's own, kept it short.
            assert!(
                store.shared.checkpoints.load(Ordering::Relaxed) > 0,
                "inline {inline}: the writer never checkpointed"
            );
            store.close().await;
        }
    }

    /// An inline store's writer (one client, which waits for its
    /// checkpoints) checkpoints every [`writer::INLINE_CHECKPOINT_FRAMES`],
    /// not every [`writer::CHECKPOINT_FRAMES`]: a checkpoint's fsyncs are
    /// its fixed cost.
    #[tokio::test]
    async fn an_inline_store_checkpoints_at_its_own_interval() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_inline(&dir.path().join("t.db")).unwrap();
        let a = rec(1);
        store.create_session(a.clone()).await.unwrap();
        let frames = || store.shared.frames_written.load(Ordering::Relaxed);
        let checkpoints = || store.shared.checkpoints.load(Ordering::Relaxed);
        let mut seq = 0;
        while frames() < writer::INLINE_CHECKPOINT_FRAMES - 10 {
            seq += 1;
            store.append_durable(ev(a.id, seq), None).await.unwrap();
        }
        const { assert!(writer::CHECKPOINT_FRAMES < writer::INLINE_CHECKPOINT_FRAMES - 10) };
        assert_eq!(checkpoints(), 0, "checkpointed before {} frames", frames());
        while frames() < writer::INLINE_CHECKPOINT_FRAMES + 10 {
            seq += 1;
            store.append_durable(ev(a.id, seq), None).await.unwrap();
        }
        assert_eq!(checkpoints(), 1, "at {} frames", frames());
        store.close().await;
    }

    /// On the store thread, writes that pause now and then have their log
    /// checkpointed on the checkpoint thread, beside the commits, never by
    /// the writer (whose checkpoint a commit queued meanwhile waited for):
    /// in a pause, a pass copies everything and the log starts over.
    #[tokio::test]
    async fn a_log_written_with_pauses_is_checkpointed_beside_the_writer() {
        {
            let dir = tempfile::tempdir().unwrap();
            let store = Store::open(&dir.path().join("t.db")).unwrap();
            let a = rec(1);
            store.create_session(a.clone()).await.unwrap();
            let mut seq = 0;
            // Bursts of a few hundred frames, then a pause: the pass asked
            // for in each burst finds nothing after it.
            for _ in 0..16 {
                for _ in 0..150 {
                    seq += 1;
                    store.append_durable(ev(a.id, seq), None).await.unwrap();
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            // More than the cap in all: had the log not started over in
            // the pauses, the writer would have checkpointed it.
            let frames = store.shared.frames_written.load(Ordering::Relaxed);
            assert!(frames > writer::WAL_CAP_FRAMES, "{frames} frames written");
            assert!(
                store.shared.checkpoints.load(Ordering::Relaxed) > 0,
                "nothing checkpointed"
            );
            assert_eq!(
                store.shared.writer_checkpoints.load(Ordering::Relaxed),
                0,
                "the writer checkpointed"
            );
            // A commit after a pass in a pause starts the log over (a
            // commit every 50 ms, for up to 5 s, on a slow disk).
            let mut now = usize::MAX;
            for _ in 0..100 {
                seq += 1;
                store.append_durable(ev(a.id, seq), None).await.unwrap();
                now = store.shared.wal_frames.load(Ordering::Relaxed);
                if now < writer::CHECKPOINT_FRAMES {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert!(
                now < writer::CHECKPOINT_FRAMES,
                "the log holds {now} frames"
            );
            let all = store.events_after(a.id, 0, 10_000).await.unwrap();
            assert_eq!(all.len() as u64, seq);
            store.close().await;
        }
    }

    /// A checkpoint thread slower than the writes (a slow disk) does not
    /// let the log grow past the cap: the writer waits there for the pass
    /// under way, then checkpoints itself.
    #[tokio::test]
    async fn a_slow_checkpoint_thread_holds_the_writer_at_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).unwrap();
        let a = rec(1);
        store.create_session(a.clone()).await.unwrap();
        store.slow_passes(300);
        append_padded_past(&store, a.id, 3 * writer::WAL_CAP_FRAMES).await;
        assert_log_bounded(dir.path(), THREAD_BOUND, "");
        assert!(store.shared.writer_checkpoints.load(Ordering::Relaxed) > 0);
        store.close().await;
    }

    /// A checkpoint thread that ended (a panic) is not waited for: the
    /// writer checkpoints itself from then on, and the log stays bounded.
    #[tokio::test]
    async fn the_writer_checkpoints_itself_once_the_checkpoint_thread_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).unwrap();
        let a = rec(1);
        store.create_session(a.clone()).await.unwrap();
        store.crash_passes();
        let seq = append_padded_past(&store, a.id, 3 * writer::WAL_CAP_FRAMES).await;
        assert_log_bounded(dir.path(), THREAD_BOUND, "");
        assert!(store.shared.writer_checkpoints.load(Ordering::Relaxed) > 0);
        let all = store.events_after(a.id, 0, 100_000).await.unwrap();
        assert_eq!(all.len() as u64, seq);
        store.close().await;
    }

    /// A checkpoint that fails loses nothing and is not tried at every
    /// commit meanwhile, but once the log grew by another
    /// [`crate::writer::CHECKPOINT_FRAMES`]; once it works again the log
    /// is copied and starts over.
    #[tokio::test]
    async fn a_failing_checkpoint_is_retried_as_the_log_grows_not_at_every_commit() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).unwrap();
        let a = rec(1);
        store.create_session(a.clone()).await.unwrap();
        store.fail_checkpoints(true);
        // Each durable append commits alone (two pages or so each): some
        // thousands of commits after the first due checkpoint.
        for seq in 1..=4000 {
            store.append_durable(ev(a.id, seq), None).await.unwrap();
        }
        let tried = store.shared.checkpoints.load(Ordering::Relaxed);
        let frames = store.shared.wal_frames.load(Ordering::Relaxed);
        assert!(
            tried >= 1 && tried <= frames / writer::CHECKPOINT_FRAMES,
            "tried {tried} times while the log grew to {frames} frames"
        );
        store.fail_checkpoints(false);
        for seq in 4001..=6000 {
            store.append_durable(ev(a.id, seq), None).await.unwrap();
        }
        assert!(store.shared.checkpoints.load(Ordering::Relaxed) > tried);
        // Past the cap the writer checkpoints itself: the log (about 8,000
        // frames when checkpoints failed) started over, and 2,000 appends
        // later is shorter.
        assert!(frames > writer::WAL_CAP_FRAMES, "{frames}");
        let now = store.shared.wal_frames.load(Ordering::Relaxed);
        assert!(
            now < frames,
            "the log started over once a checkpoint worked: {now} frames, {frames} before"
        );
        let all = store.events_after(a.id, 0, 10_000).await.unwrap();
        assert_eq!(all.len(), 6000, "every event is kept");
        assert_eq!(all.last().map(|e| e.seq), Some(6000));
        store.close().await;
    }

    /// A backlog of many sessions' appends that one command drains is
    /// written in many commits (64 sessions each), checkpointed between
    /// them as they fill the log.
    #[tokio::test]
    async fn a_backlog_drained_by_one_command_is_checkpointed_between_its_batches() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let store = Store::open(&path).unwrap();
        let sessions: Vec<SessionRecord> = (0..3000).map(rec).collect();
        for s in &sessions {
            store.create_session(s.clone()).await.unwrap();
        }
        // The thread is held in its next append while the backlog queues.
        store.pause_appends(true);
        store.append(ev(sessions[0].id, 1), None, None);
        let body = "x".repeat(6000);
        for s in &sessions[1..] {
            let mut e = ev(s.id, 1);
            e.data = format!("{{\"pad\":\"{body}\"}}");
            store.append(e, None, None);
        }
        let flushed = tokio::spawn({
            let store = store.clone();
            async move { store.flush().await }
        });
        tokio::task::yield_now().await;
        store.pause_appends(false);
        flushed.await.unwrap().unwrap();
        assert_log_bounded(dir.path(), THREAD_BOUND, "");
        let (_, head) = store.get_session(sessions[2999].id).await.unwrap().unwrap();
        assert_eq!(head.last_seq, 1);
        store.close().await;
    }

    /// Writes the store thread takes off its channel in one go (calls
    /// that commit themselves, queued while it was busy) are checkpointed
    /// as they commit, not only once the channel is empty.
    #[tokio::test]
    async fn a_burst_of_calls_that_commit_is_checkpointed_as_it_goes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let store = Store::open(&path).unwrap();
        let a = rec(1);
        store.create_session(a.clone()).await.unwrap();
        // The thread is held in its next append while the calls queue up.
        store.pause_appends(true);
        store.append(ev(a.id, 1), None, None);
        let body = "x".repeat(6000);
        let calls: Vec<_> = (0..3000)
            .map(|n| {
                let (store, value) = (store.clone(), format!("{{\"n\":{n},\"pad\":\"{body}\"}}"));
                tokio::spawn(
                    async move { store.save_state(a.id, StateColumn::Settings, value).await },
                )
            })
            .collect();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        store.pause_appends(false);
        for c in calls {
            c.await.unwrap().unwrap();
        }
        assert_log_bounded(dir.path(), THREAD_BOUND, "");
        store.close().await;
    }

    /// Durable appends to `session` of about 6 KB each (two pages or so,
    /// each committed alone) until the log took `frames` frames in all;
    /// the last sequence number.
    async fn append_padded_past(store: &Store, session: SessionId, frames: usize) -> u64 {
        let body = "x".repeat(6000);
        let mut seq = 0;
        while store.shared.frames_written.load(Ordering::Relaxed) < frames {
            seq += 1;
            let mut e = ev(session, seq);
            e.data = format!("{{\"pad\":\"{body}\"}}");
            store.append_durable(e, None).await.unwrap();
        }
        seq
    }

    /// SQLite's log file in `dir` (`t.db`'s) stayed under `frames`.
    fn assert_log_bounded(dir: &Path, frames: usize, context: &str) {
        let wal = std::fs::metadata(dir.join("t.db-wal")).unwrap().len();
        let frame = 4096 + 24;
        assert!(
            wal < frames as u64 * frame,
            "{context}the log grew to {wal} bytes"
        );
    }

    /// What the store thread's log stays under: the cap, past which the
    /// writer waits for the checkpoint thread's pass under way and
    /// checkpoints itself (reached at most a due ask's frames late), and
    /// one commit's frames.
    const THREAD_BOUND: usize = writer::WAL_CAP_FRAMES + 2 * writer::CHECKPOINT_FRAMES;

    /// What the inline store's log stays under: its writer checkpoints
    /// every [`writer::INLINE_CHECKPOINT_FRAMES`].
    const INLINE_BOUND: usize = 2 * writer::INLINE_CHECKPOINT_FRAMES;

    fn rec(n: i64) -> SessionRecord {
        SessionRecord {
            id: SessionId::new(),
            cwd: "/tmp".into(),
            title: None,
            created_ms: n,
            updated_ms: n,
            closed: false,
            channel: None,
        }
    }

    fn ev(session: SessionId, seq: u64) -> StoredEvent {
        StoredEvent {
            session,
            seq,
            ts_ms: 10 + seq as i64,
            kind: "agent_message_chunk".into(),
            prompt: Some(PromptId::from_u128(3)),
            turn: Some(TurnId(seq)),
            data: format!("{{\"n\":{seq}}}"),
        }
    }

    #[tokio::test]
    async fn sessions_and_events_round_trip_and_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let store = super::open_store(&path).unwrap();
        let a = rec(1);
        let b = rec(2);
        store.create_session(a.clone()).await.unwrap();
        store.create_session(b.clone()).await.unwrap();
        for seq in 1..=5 {
            store.append(ev(a.id, seq), None, None);
        }
        store.append_durable(ev(a.id, 6), None).await.unwrap();
        drop(store);

        let store = super::open_store(&path).unwrap();
        let (got, head) = store.get_session(a.id).await.unwrap().unwrap();
        assert_eq!(got.id, a.id);
        assert_eq!(got.updated_ms, 16, "appends touch updated_ms");
        assert_eq!(
            head,
            LogHead {
                last_seq: 6,
                last_turn: 6
            }
        );
        let events = store.events_after(a.id, 2, 3).await.unwrap();
        assert_eq!(
            events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        assert_eq!(events[0], ev(a.id, 3));
        assert!(store.get_session(SessionId::new()).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn session_state_saves_each_column_and_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let id = SessionId::new();
        let write = |keep_from, replace_from, messages: &[&str]| ConversationWrite {
            keep_from,
            replace_from,
            messages: messages.iter().map(|m| m.to_string()).collect(),
        };
        {
            let store = super::open_store(&path).unwrap();
            assert_eq!(
                store.load_state(id).await.unwrap(),
                SessionExtras::default()
            );
            store
                .save_state(id, StateColumn::Engine, "openai".into())
                .await
                .unwrap();
            store
                .save_conversation(id, write(0, 0, &["1", "2", "3"]))
                .await
                .unwrap();
            // A turn appends; trimming drops the oldest; a repair replaces
            // from where it inserted.
            store
                .save_conversation(id, write(1, 2, &["3b", "4"]))
                .await
                .unwrap();
        }
        let store = super::open_store(&path).unwrap();
        assert_eq!(
            store.load_state(id).await.unwrap(),
            SessionExtras {
                engine: Some("openai".into()),
                settings: None,
                conversation: StoredConversation {
                    base: 1,
                    messages: vec!["2".into(), "3b".into(), "4".into()],
                },
            }
        );
    }

    /// A log stored one row per event (before v12) reads the same from
    /// segments: history pages, reads after a position, the head, the
    /// newest event of some kinds; and appends go on after it.
    #[tokio::test]
    async fn a_log_stored_per_event_is_migrated_to_segments() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let (s, other, prompt) = (SessionId::new(), SessionId::new(), PromptId::new());
        let n = 5_000u64;
        {
            let conn = Connection::open(&path).unwrap();
            for (i, sql) in schema::SCHEMA[..11].iter().enumerate() {
                conn.execute_batch(sql).unwrap();
                conn.pragma_update(None, "user_version", i as i64 + 1)
                    .unwrap();
            }
            for (session, count) in [(s, n), (other, 3)] {
                for seq in 1..=count {
                    let kind = if seq == 10 {
                        "turn_error"
                    } else {
                        "agent_message_chunk"
                    };
                    conn.execute(
                        "INSERT INTO events (session_id, seq, ts_ms, kind, prompt_id, turn_id, data)
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                        rusqlite::params![
                            session.to_string(),
                            seq as i64,
                            seq as i64 * 10,
                            kind,
                            prompt.to_string(),
                            (seq / 100) as i64,
                            format!("{{\"text\":\"line {seq}\\nnext\"}}")
                        ],
                    )
                    .unwrap();
                }
            }
        }
        let store = Store::open(&path).unwrap();
        let page = store.history(s, None, 100).await.unwrap();
        assert!(page.has_more);
        let seqs: Vec<u64> = page.events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (n - 99..=n).collect::<Vec<_>>());
        let e = &page.events[0];
        assert_eq!(
            (e.ts_ms, e.kind.as_str(), e.prompt, e.turn, e.data.as_str()),
            (
                (n - 99) as i64 * 10,
                "agent_message_chunk",
                Some(prompt),
                Some(TurnId((n - 99) / 100)),
                format!("{{\"text\":\"line {}\\nnext\"}}", n - 99).as_str()
            )
        );
        let after = store.events_after(s, 4_321, 10).await.unwrap();
        assert_eq!(after.first().map(|e| e.seq), Some(4_322));
        assert_eq!(after.len(), 10);
        let head = store.reopen_log(s).await.unwrap();
        assert_eq!((head.last_seq, head.last_turn), (n, n / 100));
        let last = store.last_of_kinds(s, &["turn_error"]).await.unwrap();
        assert_eq!(last.map(|e| e.seq), Some(10));
        assert_eq!(
            store.history(other, None, 100).await.unwrap().events.len(),
            3
        );
        // Appends continue the log; a reused number is refused.
        store.append_durable(ev(s, n + 1), None).await.unwrap();
        assert!(store.append_durable(ev(other, 2), None).await.is_err());
        assert_eq!(store.reopen_log(s).await.unwrap().last_seq, n + 1);
    }

    /// The ledger from before v11 keeps its prompts in flight, not the
    /// settled ones.
    #[tokio::test]
    async fn the_ledger_keeps_only_prompts_in_flight_after_migration() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let (s, open, done) = (SessionId::new(), PromptId::new(), PromptId::new());
        {
            let conn = Connection::open(&path).unwrap();
            for (i, sql) in schema::SCHEMA[..10].iter().enumerate() {
                conn.execute_batch(sql).unwrap();
                conn.pragma_update(None, "user_version", i as i64 + 1)
                    .unwrap();
            }
            for (p, settled) in [(open, None), (done, Some(5))] {
                conn.execute(
                    "INSERT INTO prompts (prompt_id, session_id, origin, admitted_ms, settled_ms) VALUES (?1, ?2, 'cron', 1, ?3)",
                    rusqlite::params![p.to_string(), s.to_string(), settled],
                )
                .unwrap();
            }
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(
            store.unsettled().await.unwrap(),
            vec![Unsettled {
                session: s,
                prompt: open,
                origin: "cron".into()
            }]
        );
    }

    /// A conversation stored whole (before v10) becomes one row per message.
    #[tokio::test]
    async fn a_conversation_stored_whole_is_migrated_to_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let id = SessionId::new();
        {
            let conn = Connection::open(&path).unwrap();
            for (i, sql) in schema::SCHEMA[..9].iter().enumerate() {
                conn.execute_batch(sql).unwrap();
                conn.pragma_update(None, "user_version", i as i64 + 1)
                    .unwrap();
            }
            conn.execute(
                "INSERT INTO session_state (session_id, conversation) VALUES (?1, ?2)",
                rusqlite::params![
                    id.to_string(),
                    r#"[{"role":"user","text":"hi"},null,{"role":"user","text":"again"}]"#
                ],
            )
            .unwrap();
            // A session whose stored conversation is not JSON at all.
            conn.execute(
                "INSERT INTO session_state (session_id, conversation) VALUES (?1, 'not json')",
                rusqlite::params![SessionId::new().to_string()],
            )
            .unwrap();
        }
        let store = Store::open(&path).unwrap();
        let c = store.load_state(id).await.unwrap().conversation;
        assert_eq!(c.base, 0);
        let texts: Vec<serde_json::Value> = c
            .messages
            .iter()
            .map(|m| serde_json::from_str(m).unwrap())
            .collect();
        assert_eq!(texts[0]["text"], "hi");
        assert_eq!(texts[1]["text"], "again");
        assert_eq!(
            texts.len(),
            2,
            "a null element is dropped, not a failed start"
        );
        // Positions stay contiguous: a turn appended later lands after them.
        store
            .save_conversation(
                id,
                ConversationWrite {
                    keep_from: 0,
                    replace_from: 2,
                    messages: vec!["{}".into()],
                },
            )
            .await
            .unwrap();
        assert_eq!(
            store
                .load_state(id)
                .await
                .unwrap()
                .conversation
                .messages
                .len(),
            3
        );
    }

    #[tokio::test]
    async fn duplicate_seq_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        let a = rec(1);
        store.create_session(a.clone()).await.unwrap();
        store.append_durable(ev(a.id, 1), None).await.unwrap();
        assert!(store.append_durable(ev(a.id, 1), None).await.is_err());
    }

    #[tokio::test]
    async fn listing_pages_newest_first_and_skips_closed() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        let recs: Vec<_> = (0..5).map(rec).collect();
        for r in &recs {
            store.create_session(r.clone()).await.unwrap();
        }
        store.close_session(recs[3].id).await.unwrap();
        let p1 = store.list_sessions(None, 2).await.unwrap();
        assert_eq!(
            p1.sessions.iter().map(|s| s.id).collect::<Vec<_>>(),
            vec![recs[4].id, recs[2].id]
        );
        let p2 = store
            .list_sessions(p1.next_cursor.as_deref(), 2)
            .await
            .unwrap();
        assert_eq!(
            p2.sessions.iter().map(|s| s.id).collect::<Vec<_>>(),
            vec![recs[1].id, recs[0].id]
        );
        assert_eq!(p2.next_cursor, None);
    }

    /// An awaited append (a cancel's terminal) sent while the store thread
    /// is in an upkeep commits right after it, before the streamed
    /// appends the thread had queued before the upkeep.
    #[tokio::test]
    async fn an_awaited_append_sent_during_an_upkeep_goes_before_the_queued_streams() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let store = Store::open(&path).unwrap();
        let (a, b, urgent) = (rec(1), rec(2), rec(3));
        for s in [&a, &b, &urgent] {
            store.create_session(s.clone()).await.unwrap();
        }
        // `a`'s batch is held while `b`'s append queues behind it; then
        // the thread takes `b`'s off its channel and is held in the upkeep.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let until = |what: &str, ok: &dyn Fn() -> bool| {
            while !ok() {
                assert!(std::time::Instant::now() < deadline, "{what}");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        store.pause_appends(true);
        store.append(ev(a.id, 1), None, None);
        until("`a` never held", &|| store.writer_held());
        store.hold_upkeep(true);
        store.append(ev(b.id, 1), None, None);
        store.pause_appends(false);
        until("never held in an upkeep after `a`", &|| {
            store.writer_held() && store.backlog() == 1
        });
        let durable = tokio::spawn({
            let store = store.clone();
            async move { store.append_durable(ev(urgent.id, 1), None).await }
        });
        while store.backlog() < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "the awaited append was not sent"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        store.hold_upkeep(false);
        durable.await.unwrap().unwrap();
        store.flush().await.unwrap();
        let db = Connection::open(&path).unwrap();
        let order: Vec<String> = db
            .prepare("SELECT session_id FROM log ORDER BY n")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let ids: Vec<String> = [a.id, urgent.id, b.id]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(order, ids, "committed in this order");
        store.close().await;
    }

    /// On a multi-thread runtime the sessions hear of their commits from
    /// a task on the runtime (one wake of it a batch), not from the store
    /// thread (a wake through the runtime's shared queue per session);
    /// without a runtime, from the store thread. A failed commit is told
    /// at once, from the store thread, either way (a session reads its
    /// reopen count when told).
    #[test]
    fn commit_notices_come_from_the_runtime_when_there_is_one() {
        type Heard = (Option<String>, bool);
        fn told_on(
            store: &Store,
            session: SessionId,
            seq: u64,
        ) -> std::sync::mpsc::Receiver<Heard> {
            let (tx, rx) = std::sync::mpsc::channel();
            let tx = std::sync::Mutex::new(tx);
            let tell: OnCommit = Arc::new(move |r| {
                let name = std::thread::current().name().map(str::to_owned);
                let _ = tx.lock().unwrap().send((name, r.is_ok()));
            });
            store.append(ev(session, seq), None, Some(tell));
            rx
        }
        let heard = |rx: std::sync::mpsc::Receiver<Heard>| {
            let (name, ok) = rx.recv_timeout(Duration::from_secs(10)).expect("told");
            (name.unwrap_or_default(), ok)
        };
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("runtime-worker")
            .build()
            .unwrap();
        let (a, b) = (rec(1), rec(2));
        let store = rt.block_on(async {
            let store = Store::open(&dir.path().join("a.db")).unwrap();
            store.create_session(a.clone()).await.unwrap();
            store.create_session(b.clone()).await.unwrap();
            store
        });
        assert_eq!(
            heard(told_on(&store, a.id, 1)),
            ("runtime-worker".into(), true)
        );
        store.fail_appends(true);
        assert_eq!(
            heard(told_on(&store, b.id, 1)),
            ("tiller-store".into(), false)
        );
        rt.block_on(store.close());
        drop(rt);

        let c = rec(3);
        let store = Store::open(&dir.path().join("b.db")).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(store.create_session(c.clone())).unwrap();
        assert_eq!(
            heard(told_on(&store, c.id, 1)),
            ("tiller-store".into(), true)
        );
        rt.block_on(store.close());
    }
}

mod ledger {
    use crate::*;
    use tiller_core::PromptId;

    pub(super) fn ev(session: SessionId, seq: u64, kind: &str) -> StoredEvent {
        StoredEvent {
            session,
            seq,
            ts_ms: seq as i64,
            kind: kind.into(),
            prompt: None,
            turn: None,
            data: "{}".into(),
        }
    }

    /// An inline store runs each command on the caller's thread: an
    /// append has committed (and said so) when `append_many` returns, and
    /// it keeps the thread store's rules (ledger, order, close).
    #[tokio::test(flavor = "current_thread")]
    async fn an_inline_store_commits_before_the_call_returns() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let store = Store::open_inline(&path).unwrap();
        let s = SessionId::new();
        let p = PromptId::new();
        let told = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let tell: OnCommit = {
            let told = told.clone();
            Arc::new(move |seq: Result<u64, Arc<StoreError>>| {
                told.store(seq.expect("committed"), Ordering::SeqCst);
            })
        };
        let admit = LedgerOp::Admit {
            prompt: p,
            origin: "interactive".into(),
            consumes: None,
        };
        store.append_many(
            vec![
                (ev(s, 1, "prompt_started"), Some(admit)),
                (ev(s, 2, "agent_message_chunk"), None),
            ],
            tell,
        );
        assert_eq!(
            told.load(Ordering::SeqCst),
            2,
            "told before the call returned"
        );
        assert_eq!(store.unsettled().await.unwrap().len(), 1);
        // A gap is refused as on the thread, and the log stays whole.
        assert!(store.append_durable(ev(s, 2, "again"), None).await.is_err());
        store.reopen_log(s).await.unwrap();
        store
            .append_durable(
                ev(s, 3, "turn_complete"),
                Some(LedgerOp::Settle {
                    prompt: p,
                    delivery: None,
                }),
            )
            .await
            .unwrap();
        assert!(
            store.unsettled().await.unwrap().is_empty(),
            "a settled prompt leaves the ledger"
        );
        let seqs: Vec<u64> = store
            .events_after(s, 0, 10)
            .await
            .unwrap()
            .iter()
            .map(|e| e.seq)
            .collect();
        assert_eq!(seqs, vec![1, 2, 3]);
        store.close().await;
        assert!(matches!(store.unsettled().await, Err(StoreError::Closed)));
        drop(store);
        assert_eq!(
            Store::open(&path)
                .unwrap()
                .events_after(s, 0, 10)
                .await
                .unwrap()
                .len(),
            3
        );
    }

    /// A prompt admitted and settled in one commit never enters the
    /// ledger (its insert is skipped); one admitted beside it, and settled
    /// in a later commit beside another such prompt, is in the ledger in
    /// between and leaves it then.
    #[tokio::test]
    async fn a_prompt_admitted_and_settled_in_one_commit_leaves_no_ledger_row() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        let s = SessionId::new();
        let (p1, p2, p3) = (PromptId::new(), PromptId::new(), PromptId::new());
        let admit = |p| {
            Some(LedgerOp::Admit {
                prompt: p,
                origin: "interactive".into(),
                consumes: None,
            })
        };
        let settle = |p| {
            Some(LedgerOp::Settle {
                prompt: p,
                delivery: None,
            })
        };
        store
            .append_durable_after(
                vec![
                    (ev(s, 1, "prompt_started"), admit(p1)),
                    (ev(s, 2, "prompt_queued"), admit(p2)),
                ],
                ev(s, 3, "turn_complete"),
                settle(p1),
            )
            .await
            .unwrap();
        let open: Vec<PromptId> = store
            .unsettled()
            .await
            .unwrap()
            .iter()
            .map(|u| u.prompt)
            .collect();
        assert_eq!(open, vec![p2]);
        store
            .append_durable_after(
                vec![
                    (ev(s, 4, "turn_complete"), settle(p2)),
                    (ev(s, 5, "prompt_started"), admit(p3)),
                ],
                ev(s, 6, "turn_complete"),
                settle(p3),
            )
            .await
            .unwrap();
        assert!(store.unsettled().await.unwrap().is_empty());
        assert_eq!(store.events_after(s, 0, 10).await.unwrap().len(), 6);
    }

    #[tokio::test]
    async fn the_ledger_finds_unsettled_prompts_across_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let s = SessionId::new();
        let (p1, p2) = (PromptId::new(), PromptId::new());
        {
            let store = super::open_store(&path).unwrap();
            let admit = |p| {
                Some(LedgerOp::Admit {
                    prompt: p,
                    origin: "interactive".into(),
                    consumes: None,
                })
            };
            store
                .append_durable(ev(s, 1, "prompt_started"), admit(p1))
                .await
                .unwrap();
            store
                .append_durable(ev(s, 2, "prompt_queued"), admit(p2))
                .await
                .unwrap();
            store
                .append_durable(
                    ev(s, 3, "turn_complete"),
                    Some(LedgerOp::Settle {
                        prompt: p1,
                        delivery: None,
                    }),
                )
                .await
                .unwrap();
        }
        let store = super::open_store(&path).unwrap();
        let open = store.unsettled().await.unwrap();
        assert_eq!(
            open,
            vec![Unsettled {
                session: s,
                prompt: p2,
                origin: "interactive".into()
            }]
        );
        let last = store
            .last_of_kinds(s, &["prompt_started", "turn_complete"])
            .await
            .unwrap()
            .unwrap();
        assert_eq!(last.seq, 3);
        assert!(
            store
                .last_of_kinds(s, &["turn_error"])
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn history_pages_backward() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        let s = SessionId::new();
        for seq in 1..=10 {
            store.append(ev(s, seq, "x"), None, None);
        }
        let p = store.history(s, None, 4).await.unwrap();
        assert_eq!(
            p.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![7, 8, 9, 10]
        );
        assert!(p.has_more);
        let p = store.history(s, Some(3), 4).await.unwrap();
        assert_eq!(
            p.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert!(!p.has_more);
    }

    /// A `before` or an `after` beyond every sequence number (a client's
    /// query reaches both) reads as the newest: the whole last page, and
    /// nothing after. Bound as a signed number, a `before` of 2^63 or
    /// more read nothing from the index.
    #[tokio::test]
    async fn positions_beyond_every_sequence_number_read_as_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let s = SessionId::new();
        {
            let store = super::open_store(&path).unwrap();
            for seq in 1..=10 {
                store.append(ev(s, seq, "x"), None, None);
            }
            // A clean close: the log is read through its index.
            store.close().await;
        }
        let store = super::open_store(&path).unwrap();
        for before in [None, Some(u64::MAX), Some(1 << 63), Some(i64::MAX as u64)] {
            let p = store.history(s, before, 4).await.unwrap();
            let seqs: Vec<u64> = p.events.iter().map(|e| e.seq).collect();
            assert_eq!(seqs, [7, 8, 9, 10], "before {before:?}");
            assert!(p.has_more);
        }
        for after in [u64::MAX, 1 << 63, i64::MAX as u64, 10] {
            let got = store.events_after(s, after, 4).await.unwrap();
            assert!(got.is_empty(), "after {after}: {got:?}");
        }
        let got = store.events_after(s, 8, 4).await.unwrap();
        assert_eq!(got.iter().map(|e| e.seq).collect::<Vec<_>>(), [9, 10]);
    }
}

mod notifications {
    use tiller_core::notify::Queues;

    #[tokio::test]
    async fn what_the_core_decides_is_stored_and_restores_the_same_queues() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let mut q = Queues::new(3);
        let s;
        {
            let store = super::open_store(&path).unwrap();
            s = super::stored_session(&store).await;
            for (t, text) in [("a", "1"), ("b", "2"), ("a", "3"), ("c", "4"), ("d", "5")] {
                let out = q.enqueue(s, t, text, 1);
                store.notification_changes(out.changes).await.unwrap();
            }
            assert_eq!(store.notification_backlog().await.unwrap(), (vec![s], 3));
        }
        let store = super::open_store(&path).unwrap();
        let rows = store.notifications().await.unwrap();
        let restored = Queues::restore(
            3,
            rows.into_iter().map(|n| {
                (
                    n.session,
                    tiller_core::notify::Queued {
                        id: n.id,
                        task_id: n.task_id,
                        text: n.text,
                        created_ms: n.created_ms,
                    },
                )
            }),
        );
        assert_eq!(restored.session(s), q.session(s));
        let tasks: Vec<String> = q
            .session(s)
            .unwrap()
            .into_iter()
            .map(|i| i.task_id)
            .collect();
        assert_eq!(
            tasks,
            ["b", "c", "d"],
            "a (deduplicated, then oldest) was evicted"
        );
    }
}

/// Typed durability: a failed append is an error to its caller, breaks
/// nothing else, and what an event implies is stored with it or not at all.
mod durability {
    use crate::*;
    use tiller_core::PromptId;

    use super::ledger::ev;

    fn open() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        (dir, store)
    }

    #[tokio::test]
    async fn a_failed_append_breaks_the_log_until_reopened_and_leaves_no_gap() {
        let (_dir, store) = open();
        let s = SessionId::new();
        store.append_durable(ev(s, 1, "a"), None).await.unwrap();
        // A duplicate sequence number fails its transaction.
        store.append(ev(s, 1, "dup"), None, None);
        store.flush().await.unwrap();
        // Later appends of that session are refused, not stored past the
        // gap; another session's, queued with them, are stored.
        let t = SessionId::new();
        store.append(ev(s, 3, "b"), None, None);
        store.append(ev(t, 1, "other"), None, None);
        let e = store.append_durable(ev(s, 4, "c"), None).await.unwrap_err();
        assert!(matches!(e, StoreError::LogBroken), "{e}");
        assert!(e.is_unavailable());
        assert_eq!(store.events_after(s, 0, 10).await.unwrap().len(), 1);
        assert_eq!(store.events_after(t, 0, 10).await.unwrap().len(), 1);
        // Reopened, it reports its real head and takes appends again.
        assert_eq!(store.reopen_log(s).await.unwrap().last_seq, 1);
        store.append_durable(ev(s, 2, "d"), None).await.unwrap();
        let seqs: Vec<u64> = store
            .events_after(s, 0, 10)
            .await
            .unwrap()
            .iter()
            .map(|e| e.seq)
            .collect();
        assert_eq!(seqs, vec![1, 2]);
    }

    #[tokio::test]
    async fn one_sessions_failure_costs_another_session_nothing() {
        let (_dir, store) = open();
        let (a, b) = (SessionId::new(), SessionId::new());
        store.append_durable(ev(a, 1, "x"), None).await.unwrap();
        // Sent together, these share a transaction; a's duplicate fails it.
        store.append(ev(b, 1, "y"), None, None);
        store.append(ev(a, 1, "dup"), None, None);
        store.append(ev(b, 2, "y"), None, None);
        store.append_durable(ev(b, 3, "y"), None).await.unwrap();
        assert_eq!(store.events_after(b, 0, 10).await.unwrap().len(), 3);
        assert!(store.append_durable(ev(a, 2, "x"), None).await.is_err());
    }

    #[tokio::test]
    async fn deleting_a_session_removes_everything_kept_for_it_and_nothing_else() {
        let (_dir, store) = open();
        let ids = [SessionId::new(), SessionId::new()];
        let mut q = tiller_core::notify::Queues::new(10);
        let mut fires = tiller_core::cron::Fires::default();
        for (n, &s) in ids.iter().enumerate() {
            store
                .create_session(SessionRecord {
                    id: s,
                    cwd: "/tmp".into(),
                    title: None,
                    created_ms: n as i64,
                    updated_ms: n as i64,
                    closed: false,
                    channel: None,
                })
                .await
                .unwrap();
            let admit = Some(LedgerOp::Admit {
                prompt: PromptId::new(),
                origin: "interactive".into(),
                consumes: None,
            });
            store
                .append_durable(ev(s, 1, "prompt_started"), admit)
                .await
                .unwrap();
            store
                .save_state(s, StateColumn::Settings, "{}".into())
                .await
                .unwrap();
            store
                .notification_changes(q.enqueue(s, "t", "done", 1).changes)
                .await
                .unwrap();
            let job = CronJob {
                id: format!("job-{n}"),
                session: s,
                schedule: "* * * * *".into(),
                tz: "UTC".into(),
                prompt: "tick".into(),
                next_fire_ms: 0,
                created_ms: 0,
            };
            store.cron_add(job.clone()).await.unwrap();
            let change = fires.fire(s, &job.id, "tick", 5);
            store.cron_fire(change, job.id, (0, 60_000)).await.unwrap();
            store
                .goal_put(GoalRow {
                    session: s,
                    objective: "o".into(),
                    max_turns: 3,
                    turns_done: 0,
                    status: "active".into(),
                    pause_reason: None,
                    loop_stops: 0,
                })
                .await
                .unwrap();
        }
        let [gone, kept] = ids;
        assert!(store.delete_session(gone).await.unwrap());
        assert!(!store.delete_session(gone).await.unwrap(), "deleted twice");
        assert!(store.get_session(gone).await.unwrap().is_none());
        assert!(store.events_after(gone, 0, 10).await.unwrap().is_empty());
        assert!(store.goal_get(gone).await.unwrap().is_none());
        let sessions_of = |v: Vec<SessionId>| v.into_iter().filter(|s| *s == gone).count();
        assert_eq!(
            sessions_of(
                store
                    .unsettled()
                    .await
                    .unwrap()
                    .iter()
                    .map(|u| u.session)
                    .collect()
            ),
            0
        );
        assert_eq!(
            sessions_of(
                store
                    .notifications()
                    .await
                    .unwrap()
                    .iter()
                    .map(|n| n.session)
                    .collect()
            ),
            0
        );
        assert_eq!(
            sessions_of(
                store
                    .cron_list()
                    .await
                    .unwrap()
                    .iter()
                    .map(|j| j.session)
                    .collect()
            ),
            0
        );
        assert_eq!(
            sessions_of(
                store
                    .cron_fires()
                    .await
                    .unwrap()
                    .iter()
                    .map(|f| f.session)
                    .collect()
            ),
            0
        );
        assert_eq!(store.load_state(gone).await.unwrap().settings, None);
        // The other session keeps all of its own.
        assert!(store.get_session(kept).await.unwrap().is_some());
        assert_eq!(store.events_after(kept, 0, 10).await.unwrap().len(), 1);
        assert!(store.goal_get(kept).await.unwrap().is_some());
        assert_eq!(store.unsettled().await.unwrap().len(), 1);
        assert_eq!(store.notifications().await.unwrap().len(), 1);
        assert_eq!(store.cron_list().await.unwrap().len(), 1);
        assert_eq!(store.cron_fires().await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_failed_start_leaves_its_notification_queued_and_unadmitted() {
        let (_dir, store) = open();
        let s = super::stored_session(&store).await;
        let mut q = tiller_core::notify::Queues::new(10);
        let out = q.enqueue(s, "t", "done", 1);
        store.notification_changes(out.changes).await.unwrap();
        let n = store.notifications().await.unwrap().remove(0);
        let admit = Some(LedgerOp::Admit {
            prompt: PromptId::new(),
            origin: "notification".into(),
            consumes: Some(Claim::Notification(n.id)),
        });
        store.fail_appends(true);
        let e = store
            .append_durable(ev(s, 1, "prompt_started"), admit.clone())
            .await
            .unwrap_err();
        assert!(e.is_unavailable(), "{e}");
        store.fail_appends(false);
        assert_eq!(store.notifications().await.unwrap(), vec![n.clone()]);
        assert!(store.unsettled().await.unwrap().is_empty());
        store.reopen_log(s).await.unwrap();
        store
            .append_durable(ev(s, 1, "prompt_started"), admit)
            .await
            .unwrap();
        assert!(store.notifications().await.unwrap().is_empty());
        assert_eq!(store.unsettled().await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_cron_fire_leaves_its_queue_with_the_start_that_runs_it() {
        let (_dir, store) = open();
        let s = super::stored_session(&store).await;
        let job = CronJob {
            id: "j".into(),
            session: s,
            schedule: "* * * * *".into(),
            tz: "UTC".into(),
            prompt: "tick".into(),
            next_fire_ms: 0,
            created_ms: 0,
        };
        store.cron_add(job.clone()).await.unwrap();
        let mut fires = tiller_core::cron::Fires::default();
        let change = fires.fire(s, &job.id, &job.prompt, 5);
        store
            .cron_fire(change, job.id.clone(), (0, 60_000))
            .await
            .unwrap();
        // The same due time again (another node that fired it too): refused,
        // nothing written.
        let again = fires.fire(s, &job.id, "twice", 5);
        assert!(matches!(
            store.cron_fire(again, job.id.clone(), (0, 60_000)).await,
            Err(StoreError::AlreadyClaimed)
        ));
        // A second fire coalesces into the waiting one.
        let change = fires.fire(s, &job.id, &job.prompt, 6);
        store
            .cron_fire(change, job.id.clone(), (60_000, 120_000))
            .await
            .unwrap();
        let all = store.cron_fires().await.unwrap();
        assert_eq!((all.len(), all[0].fired_ms), (1, 6));
        let f = all[0].clone();
        assert_eq!(store.cron_backlog().await.unwrap(), vec![s]);
        store
            .append_durable(
                ev(s, 1, "prompt_started"),
                Some(LedgerOp::Admit {
                    prompt: PromptId::new(),
                    origin: "cron".into(),
                    consumes: Some(Claim::CronFire(f.id)),
                }),
            )
            .await
            .unwrap();
        assert!(store.cron_backlog().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_delivery_is_stored_with_its_terminal_or_not_at_all() {
        let (_dir, store) = open();
        let s = SessionId::new();
        let p = PromptId::new();
        let settle = Some(LedgerOp::Settle {
            prompt: p,
            delivery: Some(Delivery {
                id: 0,
                url: "https://example.invalid/hook".into(),
                session: s,
                prompt: p,
                text: "final".into(),
                stop_reason: "end_turn".into(),
                attempts: 0,
                next_at_ms: 7,
            }),
        });
        store.fail_appends(true);
        assert!(
            store
                .append_durable(ev(s, 1, "turn_complete"), settle.clone())
                .await
                .is_err()
        );
        store.fail_appends(false);
        assert!(store.deliveries_due(i64::MAX).await.unwrap().is_empty());
        store.reopen_log(s).await.unwrap();
        store
            .append_durable(ev(s, 1, "turn_complete"), settle)
            .await
            .unwrap();
        let due = store.deliveries_due(i64::MAX).await.unwrap();
        assert_eq!((due.len(), due[0].text.as_str()), (1, "final"));
    }
}

/// Leases and fencing: two handles on one schema are two nodes. On
/// SQLite (one daemon per file) there is no cluster: every lease is
/// granted and nothing is fenced.
mod cluster {
    use crate::*;
    use tiller_core::PromptId;

    fn rec() -> SessionRecord {
        SessionRecord {
            id: SessionId::new(),
            cwd: "/tmp".into(),
            title: None,
            created_ms: 1,
            updated_ms: 1,
            closed: false,
            channel: None,
        }
    }

    fn ev(session: SessionId, seq: u64, data: &str) -> StoredEvent {
        StoredEvent {
            session,
            seq,
            ts_ms: seq as i64,
            kind: "agent_message_chunk".into(),
            prompt: None,
            turn: None,
            data: format!("{{\"by\":\"{data}\"}}"),
        }
    }

    fn two_nodes() -> (tempfile::TempDir, Store, Store) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let a = super::open_store(&path).unwrap();
        let b = if a_cluster() {
            super::open_store(&path).unwrap()
        } else {
            a.clone()
        };
        (dir, a, b)
    }

    fn a_cluster() -> bool {
        std::env::var("TILLER_TEST_POSTGRES_URL").is_ok_and(|u| !u.is_empty())
    }

    /// A lease is exclusive while live; once it lapses another node takes
    /// it with a higher fence, and from then on the old owner's writes are
    /// refused (nothing it sends lands), while the new owner continues
    /// the log from what was stored.
    #[tokio::test]
    async fn a_node_that_lost_its_lease_cannot_write() {
        let (_dir, a, b) = two_nodes();
        let s = rec();
        a.create_session(s.clone()).await.unwrap();
        if !a_cluster() {
            assert!(!a.clustered().await.unwrap());
            assert_eq!(
                a.acquire_lease(s.id, "a".into(), 1).await.unwrap(),
                Lease::Acquired {
                    fence: 0,
                    previous: None
                }
            );
            return;
        }
        assert!(a.clustered().await.unwrap());
        for (n, store) in [("a", &a), ("b", &b)] {
            store
                .join(NodeInfo {
                    id: n.into(),
                    address: format!("http://{n}:1"),
                })
                .await
                .unwrap();
        }
        let Lease::Acquired {
            fence: f1,
            previous,
        } = a.acquire_lease(s.id, "a".into(), 300).await.unwrap()
        else {
            panic!("a free session's lease was refused");
        };
        assert_eq!(previous, None);
        match b.acquire_lease(s.id, "b".into(), 300).await.unwrap() {
            Lease::Held { node, address, .. } => {
                assert_eq!((node.as_str(), address.as_str()), ("a", "http://a:1"));
            }
            other => panic!("a live lease was taken: {other:?}"),
        }
        a.append_durable(ev(s.id, 1, "a"), None).await.unwrap();
        // Renewed, it stays a's.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert_eq!(a.renew_leases("a".into(), 300).await.unwrap(), vec![]);
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(matches!(
            b.acquire_lease(s.id, "b".into(), 300).await.unwrap(),
            Lease::Held { .. }
        ));
        // a stops renewing (paused): the lease lapses and b takes it.
        tokio::time::sleep(std::time::Duration::from_millis(400)).await;
        let Lease::Acquired {
            fence: f2,
            previous,
        } = b.acquire_lease(s.id, "b".into(), 60_000).await.unwrap()
        else {
            panic!("an expired lease was not taken over");
        };
        assert!(f2 > f1, "fence {f2} after {f1}");
        assert_eq!(previous.as_deref(), Some("a"));
        // a resumes: its writes are refused, streamed or durable.
        let e = a.append_durable(ev(s.id, 2, "a"), None).await.unwrap_err();
        assert_eq!(e.fenced(), Some(s.id), "{e:?}");
        assert!(!e.is_unavailable());
        assert!(matches!(
            a.save_state(s.id, StateColumn::Settings, "{}".into()).await,
            Err(StoreError::Fenced(_))
        ));
        // Its title and its close too: the session is b's now.
        assert!(matches!(
            a.set_title(s.id, Some("a's".into())).await,
            Err(StoreError::Fenced(_))
        ));
        assert!(matches!(
            a.close_session(s.id).await,
            Err(StoreError::Fenced(_))
        ));
        assert_eq!(
            a.renew_leases("a".into(), 300).await.unwrap(),
            vec![(s.id, f1)]
        );
        assert_eq!(a.renew_leases("a".into(), 300).await.unwrap(), vec![]);
        // b continues from what was stored.
        let head = b.reopen_log(s.id).await.unwrap();
        assert_eq!(head.last_seq, 1);
        b.append_durable(ev(s.id, 2, "b"), None).await.unwrap();
        let page = b.history(s.id, None, 10).await.unwrap();
        assert_eq!(
            page.events
                .iter()
                .map(|e| e.data.as_str())
                .collect::<Vec<_>>(),
            vec!["{\"by\":\"a\"}", "{\"by\":\"b\"}"]
        );
        // b lets go: a takes it back at once, with a fence higher still.
        b.release_leases("b".into(), None, false).await.unwrap();
        let Lease::Acquired {
            fence: f3,
            previous,
        } = a.acquire_lease(s.id, "a".into(), 300).await.unwrap()
        else {
            panic!("a released lease was not free");
        };
        assert!(f3 > f2);
        assert_eq!(previous.as_deref(), Some("b"));
        let e = b.append_durable(ev(s.id, 3, "b"), None).await.unwrap_err();
        assert_eq!(e.fenced(), Some(s.id), "{e:?}");
        let status = b.cluster_status().await.unwrap();
        let by: Vec<(&str, i64)> = status.iter().map(|n| (n.id.as_str(), n.leases)).collect();
        assert_eq!(by, vec![("a", 1), ("b", 0)]);
    }

    /// A node stalled inside a transaction (paused, or cut off from the
    /// store) holds the lock its write took on a lease row; the server
    /// ends that transaction, so the other nodes go on taking the lease
    /// instead of freezing behind it, and the stalled write never lands.
    #[tokio::test]
    async fn a_stalled_transaction_does_not_freeze_the_others() {
        let (dir, a, b) = two_nodes();
        let path = dir.path().join("t.db");
        let s = rec();
        a.create_session(s.clone()).await.unwrap();
        let url = match std::env::var("TILLER_TEST_POSTGRES_URL") {
            Ok(url) if !url.is_empty() => url,
            _ => {
                // One daemon per SQLite file: there is nobody to stall.
                assert!(!b.clustered().await.unwrap());
                return;
            }
        };
        assert!(matches!(
            a.acquire_lease(s.id, "a".into(), 1).await.unwrap(),
            Lease::Acquired { .. }
        ));
        // a's connection, as the store makes it, in the middle of a write
        // (the fence checked, the row share-locked), and then it stalls.
        let (locked, go_on) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
        let schema = super::pg_schema(&path);
        let id = s.id.to_string();
        let stalled = std::thread::spawn(move || {
            let mut c = pg::open(&url, &schema).unwrap();
            let mut tx = c.transaction().unwrap();
            tx.query_one(
                "SELECT fence FROM leases WHERE session_id = $1 FOR SHARE",
                &[&id],
            )
            .unwrap();
            locked.0.send(()).unwrap();
            let _ = go_on.1.recv_timeout(std::time::Duration::from_secs(60));
            tx.execute("UPDATE sessions SET title = 'stale' WHERE id = $1", &[&id])
                .and_then(|_| tx.commit())
        });
        locked.1.recv().unwrap();
        let took = tokio::time::timeout(
            std::time::Duration::from_secs(20),
            b.acquire_lease(s.id, "b".into(), 60_000),
        )
        .await;
        let _ = go_on.0.send(());
        assert!(
            matches!(took, Ok(Ok(Lease::Acquired { .. }))),
            "the lease could not be taken past a stalled node: {took:?}"
        );
        assert!(stalled.join().unwrap().is_err(), "the stalled write landed");
        let (rec, _) = b.get_session(s.id).await.unwrap().unwrap();
        assert_eq!(rec.title, None);
    }

    /// The terminal of prompt `p` of session `s`, with a webhook delivery
    /// due at 7.
    fn settled_with_delivery(s: SessionId, p: PromptId) -> Option<LedgerOp> {
        Some(LedgerOp::Settle {
            prompt: p,
            delivery: Some(Delivery {
                id: 0,
                url: "https://example.invalid/hook".into(),
                session: s,
                prompt: p,
                text: "final".into(),
                stop_reason: "end_turn".into(),
                attempts: 0,
                next_at_ms: 7,
            }),
        })
    }

    /// A webhook delivery is attempted by one node at a time; if that
    /// node dies mid-attempt another one retries it after a while.
    #[tokio::test]
    async fn a_delivery_is_attempted_by_one_node_at_a_time() {
        let (_dir, a, b) = two_nodes();
        let (s, p) = (SessionId::new(), PromptId::new());
        a.append_durable(ev(s, 1, "end"), settled_with_delivery(s, p))
            .await
            .unwrap();
        assert_eq!(a.deliveries_due(1_000).await.unwrap().len(), 1);
        let second = b.deliveries_due(1_000).await.unwrap();
        if a_cluster() {
            assert_eq!(second, vec![], "two nodes attempt the same delivery");
            let later = b
                .deliveries_due(1_000 + DELIVERY_HOLD_MS + 1)
                .await
                .unwrap();
            assert_eq!(later.len(), 1, "a delivery held by a dead node stays stuck");
        } else {
            // One daemon: its worker keeps track of what is under way.
            assert_eq!(second.len(), 1);
        }
    }

    /// An attempt starts only while its node still holds the delivery: one
    /// that waited past the hold (behind a slow host's attempts) is not
    /// made once another node took the row, which would post it twice.
    #[tokio::test]
    async fn an_attempt_starts_only_while_its_delivery_is_held() {
        let (_dir, a, b) = two_nodes();
        let (s, p) = (SessionId::new(), PromptId::new());
        a.append_durable(ev(s, 1, "end"), settled_with_delivery(s, p))
            .await
            .unwrap();
        let mine = a.deliveries_due(1_000).await.unwrap().remove(0);
        if a_cluster() {
            // a's attempt waited past its hold; b took the row meanwhile.
            let later = 1_000 + DELIVERY_HOLD_MS + 1;
            let theirs = b.deliveries_due(later).await.unwrap().remove(0);
            assert!(
                !a.delivery_start(&mine, later + 5).await.unwrap(),
                "posted twice"
            );
            assert!(b.delivery_start(&theirs, later + 5).await.unwrap());
        } else {
            assert!(a.delivery_start(&mine, 1_005).await.unwrap());
        }
        // Its hold now runs from the start: nobody takes it meanwhile.
        assert_eq!(
            b.deliveries_due(1_000 + DELIVERY_HOLD_MS).await.unwrap(),
            vec![]
        );
    }

    /// A session its new owner deleted refuses the old owner's writes as
    /// a live one does (the lease row went with the session).
    #[tokio::test]
    async fn a_deleted_session_refuses_its_old_owners_writes() {
        let (_dir, a, b) = two_nodes();
        let s = rec();
        a.create_session(s.clone()).await.unwrap();
        if !a_cluster() {
            assert!(!a.clustered().await.unwrap());
            return;
        }
        assert!(matches!(
            a.acquire_lease(s.id, "a".into(), 1).await.unwrap(),
            Lease::Acquired { .. }
        ));
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(matches!(
            b.acquire_lease(s.id, "b".into(), 60_000).await.unwrap(),
            Lease::Acquired { .. }
        ));
        assert!(b.delete_session(s.id).await.unwrap());
        let e = a.append_durable(ev(s.id, 1, "a"), None).await.unwrap_err();
        assert_eq!(e.fenced(), Some(s.id), "{e:?}");
        assert!(b.events_after(s.id, 0, 10).await.unwrap().is_empty());
    }

    /// Two nodes offering the same queued notification: the first start
    /// consumes it, the second is refused and admits nothing.
    #[tokio::test]
    async fn queued_work_starts_once_across_nodes() {
        let (_dir, a, b) = two_nodes();
        let s = super::stored_session(&a).await;
        let mut q = tiller_core::notify::Queues::new(10);
        let out = q.enqueue(s, "t", "done", 1);
        a.notification_changes(out.changes).await.unwrap();
        let n = a.notifications().await.unwrap().remove(0);
        let start = |store: &Store, seq| {
            let prompt = PromptId::new();
            let op = Some(LedgerOp::Admit {
                prompt,
                origin: "notification".into(),
                consumes: Some(Claim::Notification(n.id)),
            });
            let store = store.clone();
            async move {
                store
                    .append_durable(ev(s, seq, "start"), op)
                    .await
                    .map(|_| prompt)
            }
        };
        start(&a, 1).await.unwrap();
        let second = start(&b, 2).await;
        if a_cluster() {
            assert!(second.is_err(), "the same notification started twice");
            assert_eq!(a.unsettled().await.unwrap().len(), 1);
        } else {
            // One daemon: its queue actor never offers a row twice.
            assert!(second.is_ok());
        }
    }
}

/// What a node knows of the queues can be stale (another node ran a row
/// meanwhile); the store never loses work because of it.
mod stale {
    use crate::*;
    use tiller_core::PromptId;

    fn ev(session: SessionId, seq: u64) -> StoredEvent {
        StoredEvent {
            session,
            seq,
            ts_ms: 1,
            kind: "prompt_started".into(),
            prompt: None,
            turn: None,
            data: "{}".into(),
        }
    }

    /// A job of `session` firing every minute.
    fn job(id: &str, session: SessionId) -> CronJob {
        CronJob {
            id: id.into(),
            session,
            schedule: "* * * * *".into(),
            tz: "UTC".into(),
            prompt: "tick".into(),
            next_fire_ms: 0,
            created_ms: 0,
        }
    }

    /// A SQLite store at `path` whose one session has a cron job, closed.
    async fn a_file_with_a_job(path: &Path) {
        let store = Store::open(path).unwrap();
        let s = super::stored_session(&store).await;
        store.cron_add(job("j", s)).await.unwrap();
        store.close().await;
    }

    fn start(claim: Claim) -> Option<LedgerOp> {
        Some(LedgerOp::Admit {
            prompt: PromptId::new(),
            origin: "cron".into(),
            consumes: Some(claim),
        })
    }

    /// A job is added only for a session the store still holds: one added
    /// while its session was being deleted outlived it (firing for nothing
    /// for good).
    #[tokio::test]
    async fn a_cron_job_for_a_deleted_session_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        let s = super::stored_session(&store).await;
        store.cron_add(job("kept", s)).await.unwrap();
        assert!(store.delete_session(s).await.unwrap());
        let e = store.cron_add(job("late", s)).await.unwrap_err();
        assert!(matches!(e, StoreError::SessionGone(g) if g == s), "{e}");
        assert!(store.cron_list().await.unwrap().is_empty());
    }

    /// A notification is queued only for a session the store still holds:
    /// one enqueued while its session was being deleted was written after
    /// the delete (and started the session's queue again at the next start).
    #[tokio::test]
    async fn a_notification_for_a_deleted_session_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        let s = super::stored_session(&store).await;
        let mut q = tiller_core::notify::Queues::new(10);
        store
            .notification_changes(q.enqueue(s, "a", "1", 1).changes)
            .await
            .unwrap();
        assert!(store.delete_session(s).await.unwrap());
        let e = store
            .notification_changes(q.enqueue(s, "b", "2", 2).changes)
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::SessionGone(g) if g == s), "{e}");
        assert!(store.notifications().await.unwrap().is_empty());
    }

    /// A goal is stored only for a session the store still holds: a goal
    /// turn counted while its session was being deleted wrote the deleted
    /// session's goal back (listed as active at every start).
    #[tokio::test]
    async fn a_goal_for_a_deleted_session_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        let s = super::stored_session(&store).await;
        let goal = GoalRow {
            session: s,
            objective: "o".into(),
            max_turns: 3,
            turns_done: 0,
            status: "active".into(),
            pause_reason: None,
            loop_stops: 0,
        };
        store.goal_put(goal.clone()).await.unwrap();
        store
            .goal_put(GoalRow {
                turns_done: 1,
                ..goal.clone()
            })
            .await
            .unwrap();
        assert_eq!(store.goal_get(s).await.unwrap().unwrap().turns_done, 1);
        assert!(store.delete_session(s).await.unwrap());
        let e = store.goal_put(goal).await.unwrap_err();
        assert!(matches!(e, StoreError::SessionGone(g) if g == s), "{e}");
        assert!(store.goal_get(s).await.unwrap().is_none());
        assert!(store.goals_active().await.unwrap().is_empty());
    }

    /// Closing a session removes its queued automatic work with it, and
    /// nothing is queued for it afterwards: a closed session's cron jobs
    /// fired for nothing for good, its goal stayed active and its
    /// notifications waited for ever.
    #[tokio::test]
    async fn a_closed_sessions_queued_work_goes_with_its_close() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        let (s, other) = (
            super::stored_session(&store).await,
            super::stored_session(&store).await,
        );
        let goal = |session| GoalRow {
            session,
            objective: "o".into(),
            max_turns: 3,
            turns_done: 0,
            status: "active".into(),
            pause_reason: None,
            loop_stops: 0,
        };
        let mut q = tiller_core::notify::Queues::new(10);
        let mut fires = tiller_core::cron::Fires::default();
        for (session, id) in [(s, "closed"), (other, "kept")] {
            store.cron_add(job(id, session)).await.unwrap();
            let change = fires.fire(session, id, "tick", 5);
            store.cron_fire(change, id.into(), (0, 60)).await.unwrap();
            store.goal_put(goal(session)).await.unwrap();
            store
                .notification_changes(q.enqueue(session, "a", "1", 1).changes)
                .await
                .unwrap();
        }
        store.close_session(s).await.unwrap();
        let jobs = store.cron_list().await.unwrap();
        assert_eq!(jobs.iter().map(|j| j.session).collect::<Vec<_>>(), [other]);
        let waiting = store.cron_fires().await.unwrap();
        assert_eq!(
            waiting.iter().map(|f| f.session).collect::<Vec<_>>(),
            [other]
        );
        let queued = store.notifications().await.unwrap();
        assert_eq!(
            queued.iter().map(|n| n.session).collect::<Vec<_>>(),
            [other]
        );
        assert!(store.goal_get(s).await.unwrap().is_none());
        assert_eq!(store.goals_active().await.unwrap(), [other]);
        // Nothing is queued for it afterwards.
        let e = store.cron_add(job("late", s)).await.unwrap_err();
        assert!(matches!(e, StoreError::SessionGone(g) if g == s), "{e}");
        let e = store.goal_put(goal(s)).await.unwrap_err();
        assert!(matches!(e, StoreError::SessionGone(g) if g == s), "{e}");
        let e = store
            .notification_changes(q.enqueue(s, "b", "2", 2).changes)
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::SessionGone(g) if g == s), "{e}");
    }

    /// A session an older version closed kept its queued work: the store
    /// removes it when it opens.
    #[tokio::test]
    async fn work_queued_for_a_session_closed_before_is_removed_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        a_file_with_a_job(&path).await;
        // Closed as an older version did: the flag only.
        Connection::open(&path)
            .unwrap()
            .execute("UPDATE sessions SET closed = 1", [])
            .unwrap();
        let store = Store::open(&path).unwrap();
        assert!(store.cron_list().await.unwrap().is_empty());
    }

    /// A newer version's file is refused untouched: the sweep of closed
    /// sessions' work does not run on it (an older binary deleted rows
    /// the newer one's rules keep, before refusing the file).
    #[tokio::test]
    async fn a_newer_versions_file_is_refused_without_the_sweep() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        a_file_with_a_job(&path).await;
        let raw = Connection::open(&path).unwrap();
        raw.execute("UPDATE sessions SET closed = 1", []).unwrap();
        raw.pragma_update(None, "user_version", schema::latest() + 1)
            .unwrap();
        drop(raw);
        assert!(Store::open(&path).is_err(), "a newer version's file");
        let jobs: i64 = Connection::open(&path)
            .unwrap()
            .query_row("SELECT COUNT(*) FROM cron_jobs", [], |r| r.get(0))
            .unwrap();
        assert_eq!(jobs, 1);
    }

    /// A fire coalesced into a waiting fire that another node already
    /// started is a waiting fire again, not an update of nothing.
    #[tokio::test]
    async fn a_fire_coalesced_into_a_fire_run_elsewhere_waits() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        let s = super::stored_session(&store).await;
        store.cron_add(job("j", s)).await.unwrap();
        let mut fires = tiller_core::cron::Fires::default();
        let change = fires.fire(s, "j", "tick", 5);
        store.cron_fire(change, "j".into(), (0, 60)).await.unwrap();
        let id = store.cron_fires().await.unwrap()[0].id;
        // Run by another node: this one's queue still shows it waiting.
        store
            .append_durable(ev(s, 1), start(Claim::CronFire(id)))
            .await
            .unwrap();
        assert!(store.cron_fires().await.unwrap().is_empty());
        let change = fires.fire(s, "j", "tock", 65);
        assert!(matches!(
            change,
            tiller_core::cron::FireChange::Refresh { .. }
        ));
        store
            .cron_fire(change, "j".into(), (60, 120))
            .await
            .unwrap();
        let waiting = store.cron_fires().await.unwrap();
        assert_eq!(
            waiting
                .iter()
                .map(|f| (f.session, f.job_id.as_str(), f.prompt.as_str(), f.fired_ms))
                .collect::<Vec<_>>(),
            vec![(s, "j", "tock", 65)],
            "the second fire was lost"
        );
    }

    /// The same for a notification that replaces one already run.
    #[tokio::test]
    async fn a_notification_replacing_one_run_elsewhere_is_queued() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        let s = super::stored_session(&store).await;
        let mut q = tiller_core::notify::Queues::new(10);
        store
            .notification_changes(q.enqueue(s, "build", "failed", 1).changes)
            .await
            .unwrap();
        let id = store.notifications().await.unwrap()[0].id;
        store
            .append_durable(ev(s, 1), start(Claim::Notification(id)))
            .await
            .unwrap();
        let out = q.enqueue(s, "build", "passed", 2);
        assert!(out.deduplicated);
        store.notification_changes(out.changes).await.unwrap();
        let queued = store.notifications().await.unwrap();
        assert_eq!(
            queued
                .iter()
                .map(|n| (n.session, n.task_id.as_str(), n.text.as_str()))
                .collect::<Vec<_>>(),
            vec![(s, "build", "passed")],
            "the second notification was lost"
        );
    }
}

mod errors {
    use crate::*;

    /// A client is told what failed, not the database's own words.
    #[tokio::test]
    async fn a_client_never_sees_the_databases_text() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::open_store(&dir.path().join("t.db")).unwrap();
        let job = CronJob {
            id: "j".into(),
            session: super::stored_session(&store).await,
            schedule: "* * * * *".into(),
            tz: "UTC".into(),
            prompt: "tick".into(),
            next_fire_ms: 0,
            created_ms: 0,
        };
        store.cron_add(job.clone()).await.unwrap();
        let e = store.cron_add(job).await.unwrap_err();
        assert!(
            e.to_string().contains("cron_jobs") || e.to_string().contains("duplicate"),
            "{e}"
        );
        let told = e.for_client();
        assert!(told.contains("the daemon's log has the details"), "{told}");
        for leak in ["cron_jobs", "duplicate", "UNIQUE", "unique"] {
            assert!(!told.contains(leak), "{told}");
        }
    }
}

mod ids {
    use crate::*;

    /// Two nodes never get the same queue id from a shared store; one
    /// SQLite daemon numbers its own rows.
    #[tokio::test]
    async fn queue_ids_are_unique_across_nodes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let a = super::open_store(&path).unwrap();
        if std::env::var("TILLER_TEST_POSTGRES_URL").is_ok_and(|u| !u.is_empty()) {
            let b = super::open_store(&path).unwrap();
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..5 {
                for s in [&a, &b] {
                    for q in [IdQueue::Notifications, IdQueue::CronFires] {
                        let id = s
                            .fresh_id(q)
                            .await
                            .unwrap()
                            .expect("a shared store numbers rows");
                        assert!(
                            seen.insert((q == IdQueue::Notifications, id)),
                            "{q:?} {id} twice"
                        );
                    }
                }
            }
        } else {
            assert_eq!(a.fresh_id(IdQueue::Notifications).await.unwrap(), None);
        }
    }
}
