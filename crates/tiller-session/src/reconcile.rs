//! Settling what a dead actor or daemon left in flight.

use super::*;

/// Reconciliation: every prompt admitted and never settled gets exactly one
/// `turn_error` of `kind`: at start-up for all sessions (`daemon_restarted`),
/// and for one session whose actor failed (`session_restarted`).
pub(crate) async fn reconcile(
    store: &Store,
    only: Option<SessionId>,
    kind: tiller_core::ErrorKind,
) -> Result<usize, SessionError> {
    let open: Vec<_> = store
        .unsettled()
        .await?
        .into_iter()
        .filter(|u| only.is_none_or(|s| s == u.session))
        .collect();
    let mut heads: std::collections::HashMap<SessionId, u64> = std::collections::HashMap::new();
    for u in &open {
        let seq = match heads.get(&u.session) {
            Some(s) => *s,
            // Reopened: a failed actor may have left the log refusing appends.
            None => store.reopen_log(u.session).await?.last_seq,
        } + 1;
        heads.insert(u.session, seq);
        let rec = EventRecord {
            session: u.session,
            seq,
            ts_ms: clock::unix_ms(),
            prompt: Some(u.prompt),
            turn: None,
            body: EventBody::TurnError {
                error_kind: kind.as_str().into(),
                message: kind.default_message(),
                loop_type: None,
                code: None,
            },
        };
        store
            .append_durable(rec.to_stored(), rec.ledger_op())
            .await?;
    }
    Ok(open.len())
}
