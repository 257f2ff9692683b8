//! History pages, walked backward then forward, concatenate to the whole
//! log with no gap or duplicate, also while appends happen.

use proptest::prelude::*;
use tiller_core::{SessionId, TurnId};
use tiller_store::{SessionRecord, Store, StoredEvent};

fn ev(session: SessionId, seq: u64) -> StoredEvent {
    StoredEvent {
        session,
        seq,
        ts_ms: seq as i64,
        kind: "agent_message_chunk".into(),
        prompt: None,
        turn: Some(TurnId(1)),
        data: format!("{{\"n\":{seq}}}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]
    #[test]
    fn pages_concatenate_to_the_whole_log(
        initial in 0u64..300,
        limit in 1usize..40,
        // Appends made before each page fetch (backward, then forward).
        appends in proptest::collection::vec(0u64..25, 1..30),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let store = Store::open(&dir.path().join("t.db")).unwrap();
            let s = SessionId::new();
            store.create_session(SessionRecord {
                id: s, cwd: "/".into(), title: None, created_ms: 0, updated_ms: 0, closed: false,
                channel: None,
            }).await.unwrap();
            let mut head = 0u64;
            let append = |n: u64, head: &mut u64| {
                for _ in 0..n {
                    *head += 1;
                    store.append(ev(s, *head), None, None);
                }
            };
            append(initial, &mut head);
            let mut bursts = appends.iter().copied().cycle();

            // Backward from the newest event at the time of the first page.
            let mut back: Vec<u64> = Vec::new();
            let mut before = None;
            loop {
                let page = store.history(s, before, limit).await.unwrap();
                let seqs: Vec<u64> = page.events.iter().map(|e| e.seq).collect();
                prop_assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "page in order: {seqs:?}");
                let mut merged = seqs.clone();
                merged.extend(back);
                back = merged;
                append(bursts.next().unwrap(), &mut head);
                if !page.has_more {
                    break;
                }
                before = page.events.first().map(|e| e.seq);
            }
            // Forward from there until caught up.
            let mut all = back.clone();
            let mut after = back.last().copied().unwrap_or(0);
            for round in 0.. {
                let page = store.events_after(s, after, limit).await.unwrap();
                if page.is_empty() {
                    break;
                }
                after = page.last().unwrap().seq;
                all.extend(page.iter().map(|e| e.seq));
                if round < appends.len() {
                    append(bursts.next().unwrap(), &mut head);
                }
            }
            prop_assert_eq!(all, (1..=head).collect::<Vec<_>>());
            Ok(())
        })?;
    }
}
