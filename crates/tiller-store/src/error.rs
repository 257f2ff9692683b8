//! Store errors, typed so callers can tell "try again later" from a bug.

use std::path::PathBuf;

/// Store failures. Messages say what happened and what to do.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "the store at {path} is {} (one daemon, or one `tiller acp --embedded`, per data directory)",
        if *here { "already open in this process" } else { "in use by another Tiller process" }
    )]
    /// Another process holds the database, or (`here`) another store of
    /// this one.
    InUse {
        /// The database file.
        path: PathBuf,
        /// Held by this process.
        here: bool,
    },
    #[error("cannot open the store at {path}: {source} (check the path and its permissions)")]
    /// The database could not be opened or migrated.
    Open {
        /// The database file.
        path: PathBuf,
        /// What SQLite said.
        source: rusqlite::Error,
    },
    #[error("cannot prepare the store file {path}: {source} (check the path and its permissions)")]
    /// The database file could not be created or restricted to its owner.
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    #[error("store error: {0}")]
    /// A statement failed (the source keeps SQLite's code).
    Sql(#[from] rusqlite::Error),
    /// An append failed; every event of its transaction shares the cause.
    #[error("cannot append to the log: {0}")]
    Append(#[source] std::sync::Arc<StoreError>),
    /// An earlier write of this session's log failed: nothing more is
    /// written to it (a gap would break the log) until it is reopened.
    #[error("an earlier write of this session's log failed; it is reloaded on next use")]
    LogBroken,
    /// A failure injected by a test (`test-hooks` feature).
    #[error("the store is unavailable (injected failure)")]
    Injected,
    /// A PostgreSQL statement or connection failed.
    #[error("PostgreSQL: {}", pg_message(.0))]
    Pg(#[from] postgres::Error),
    /// The store's configuration cannot work (a bad schema name, a
    /// database newer than this Tiller).
    #[error("{0}")]
    Config(String),
    /// What the database holds cannot be read back.
    #[error("the store holds unreadable data: {0}")]
    Corrupt(String),
    /// A session's log is damaged: the session is set aside (its reads
    /// and appends are refused) until it is deleted, which repairs the
    /// store.
    #[error(
        "the store holds unreadable data: session {session}'s log is damaged ({why}): delete it \
         (`DELETE /api/sessions/{session}?purge=true`) to repair the store"
    )]
    Damaged {
        /// The session set aside.
        session: tiller_core::SessionId,
        /// What is wrong with its log.
        why: String,
    },
    /// The connection to PostgreSQL is down (appends resume once it is
    /// made again and each session reloaded its log).
    #[error("the connection to PostgreSQL is lost; retry shortly")]
    Disconnected,
    /// This node no longer owns the session: another node took its lease
    /// (this one was paused, partitioned or too slow to renew). Nothing
    /// was written.
    #[error("session {0} is now served by another node (this node's lease on it was taken over)")]
    Fenced(tiller_core::SessionId),
    /// The session is gone (deleted or closed meanwhile): nothing was written for it.
    #[error("session {0} no longer exists")]
    SessionGone(tiller_core::SessionId),
    /// A claimed queue row was gone: another node started that work.
    #[error("queued work was already started elsewhere")]
    AlreadyClaimed,
    #[error("the store thread has stopped (the daemon is shutting down)")]
    /// The store thread is gone.
    Closed,
}

impl StoreError {
    /// The session whose lease this node lost, if that is the failure.
    pub fn fenced(&self) -> Option<tiller_core::SessionId> {
        match self {
            StoreError::Fenced(s) => Some(*s),
            StoreError::Append(e) => e.fenced(),
            _ => None,
        }
    }

    /// Whether it is a damaged session log's refusal (the session is set
    /// aside; deleting it is the repair), directly or as an append's cause.
    pub fn is_damaged_log(&self) -> bool {
        match self {
            StoreError::Damaged { .. } => true,
            StoreError::Append(e) => e.is_damaged_log(),
            _ => false,
        }
    }

    /// Whether the database is held by a daemon (or a store of this
    /// process): a check of it is to wait, not a finding.
    pub fn is_in_use(&self) -> bool {
        use rusqlite::ErrorCode as C;
        match self {
            StoreError::InUse { .. } => true,
            StoreError::Sql(rusqlite::Error::SqliteFailure(e, _)) => {
                matches!(e.code, C::DatabaseBusy | C::DatabaseLocked)
            }
            _ => false,
        }
    }

    /// Whether the failure is the store's condition (disk full, database
    /// locked, I/O error, shutting down) rather than a bad request: the
    /// caller may retry later, and clients are told `store_unavailable`.
    pub fn is_unavailable(&self) -> bool {
        use rusqlite::ErrorCode as C;
        match self {
            StoreError::Sql(rusqlite::Error::SqliteFailure(e, _)) => matches!(
                e.code,
                C::DiskFull
                    | C::DatabaseBusy
                    | C::DatabaseLocked
                    | C::SystemIoFailure
                    | C::CannotOpen
                    | C::ReadOnly
                    | C::OutOfMemory
            ),
            // A lost connection, the server out of room or shutting down.
            StoreError::Pg(e) => {
                e.is_closed()
                    || e.as_db_error().map_or_else(
                        || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>()),
                        |d| {
                            let code = d.code().code();
                            ["08", "53", "57", "58"].contains(&&code[..2])
                                // A read-only server: a standby after a failover.
                                || code == "25006"
                        },
                    )
            }
            StoreError::Sql(_)
            | StoreError::Open { .. }
            | StoreError::InUse { .. }
            | StoreError::Config(_)
            | StoreError::Corrupt(_)
            | StoreError::Damaged { .. }
            | StoreError::Fenced(_)
            | StoreError::SessionGone(_)
            | StoreError::AlreadyClaimed => false,
            StoreError::Append(e) => e.is_unavailable(),
            StoreError::Io { .. }
            | StoreError::LogBroken
            | StoreError::Disconnected
            | StoreError::Injected
            | StoreError::Closed => true,
        }
    }
}

impl StoreError {
    /// What a client is told: the database's own words (names of tables,
    /// values, the server's host) stay in the daemon's log; a client gets
    /// what happened and the SQLSTATE or SQLite code to quote.
    pub fn for_client(&self) -> String {
        match self {
            StoreError::Pg(e) => match e.as_db_error() {
                Some(d) => format!(
                    "the database refused the operation (SQLSTATE {}); the daemon's log has the details",
                    d.code().code()
                ),
                None if self.is_unavailable() => {
                    "the connection to PostgreSQL failed; retry shortly".to_owned()
                }
                None => {
                    "the database operation failed; the daemon's log has the details".to_owned()
                }
            },
            StoreError::Sql(e) => match e.sqlite_error_code() {
                Some(code) => format!(
                    "the database refused the operation ({code:?}); the daemon's log has the details"
                ),
                None => {
                    "the database operation failed; the daemon's log has the details".to_owned()
                }
            },
            StoreError::Append(e) => format!("cannot append to the log: {}", e.for_client()),
            other => other.to_string(),
        }
    }
}

/// The server's own message when there is one (`db error` alone says
/// nothing), else the client's.
fn pg_message(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{} ({})", d.message(), d.code().code()),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a set-aside session's refusal lets its delete go on past a
    /// failed close: other unreadable data (a PostgreSQL log whose
    /// sequence numbers clash) is an error the delete reports.
    #[test]
    fn only_a_set_aside_log_is_a_damaged_one() {
        let session = tiller_core::SessionId::new();
        let damaged = StoreError::Damaged {
            session,
            why: "overlapping segments".into(),
        };
        assert!(damaged.is_damaged_log());
        assert!(
            damaged
                .to_string()
                .contains(&format!("DELETE /api/sessions/{session}?purge=true"))
        );
        assert!(!damaged.is_unavailable());
        assert!(StoreError::Append(std::sync::Arc::new(damaged)).is_damaged_log());
        let clash = StoreError::Corrupt("events 3-5 follow 7".into());
        assert!(!clash.is_damaged_log());
        assert!(!StoreError::Append(std::sync::Arc::new(clash)).is_damaged_log());
    }
}
