//! One ACP connection, whatever its transport.
//!
//! The connection is generic over channels: the transport feeds [`Frame`]s
//! in and writes the `String`s that come out, one JSON-RPC message each.
//! A single writer task owns everything written to the client, so a
//! prompt's response always follows the updates of its turn, and a
//! `session/load` replay is never interleaved with live events.
//!
//! A client that reads slower than its sessions publish is never cut off
//! and never slows them: live events that do not fit its queue are
//! skipped and noted, and before writing anything else the writer reads
//! what the client lacks from the store, page by page, with runs of text
//! and thought chunks coalesced. `session/load` is the same mechanism
//! from the log's start, so no history is ever held in memory whole.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use agent_client_protocol_schema::ProtocolVersion;
use agent_client_protocol_schema::v1::{
    AgentCapabilities, CancelNotification, CloseSessionRequest, CloseSessionResponse,
    DeleteSessionRequest, DeleteSessionResponse, Implementation, InitializeRequest,
    InitializeResponse, ListSessionsRequest, ListSessionsResponse, LoadSessionRequest,
    LoadSessionResponse, McpCapabilities, NewSessionRequest, NewSessionResponse,
    PromptCapabilities, PromptRequest, PromptResponse, ResumeSessionRequest, ResumeSessionResponse,
    SessionAdditionalDirectoriesCapabilities, SessionCapabilities, SessionCloseCapabilities,
    SessionDeleteCapabilities, SessionInfo, SessionListCapabilities, SessionResumeCapabilities,
    SetSessionConfigOptionRequest, SetSessionConfigOptionResponse, SetSessionModeRequest,
    SetSessionModeResponse, StopReason,
};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tiller_core::{Origin, PromptId, SessionId, TurnId};
use tiller_session::view::{Cursor, Live};
use tiller_session::{
    EventRecord, PromptRefused, SessionError, SessionHandle, Sessions, Subscriber, SubscriberId,
};
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore, mpsc};

use crate::client::{Calls, ClientCaps};
use crate::jsonrpc::{self, Incoming, Params, RpcError, code};
use crate::map;

/// What a transport hands the connection.
#[derive(Debug)]
pub enum Frame {
    /// One message.
    Text(String),
    /// A message over `max_message_bytes` (its size); it was discarded.
    TooLarge(usize),
}

/// Settings shared by every connection.
#[derive(Clone, Debug)]
pub struct AcpConfig {
    /// Largest accepted message.
    pub max_message_bytes: usize,
    /// Events buffered per connection; past it the connection reads what
    /// it missed from the log.
    pub subscriber_queue: usize,
    /// Reported in `initialize`.
    pub version: String,
    /// In a cluster: opens a connection to the node serving a session, to
    /// hand a connection over (see [`crate::splice`]).
    pub forward: Option<crate::splice::Forwarder>,
}

/// Messages into the connection's writer task.
enum Out {
    /// A live event from one of our subscriptions.
    Event(SubscriberId, Arc<EventRecord>),
    /// From now on, events of `session` come from subscription `sub` (sent
    /// before subscribing, so none of its events arrives unknown). With
    /// `replay`, its events wait for `Replayed` (a `session/load`).
    Attach {
        session: SessionId,
        sub: SubscriberId,
        replay: bool,
    },
    /// Subscription `sub` started after event `last`: the client has what
    /// it needs up to there. `pending` is the permission request the
    /// session waits on then: this client is asked too.
    Position {
        session: SessionId,
        sub: SubscriberId,
        last: u64,
        pending: Option<Arc<EventRecord>>,
    },
    /// `session/load`: replay the stored log (history up to `last`, then
    /// whatever followed), ask the pending permission request, then the
    /// response.
    Replayed {
        session: SessionId,
        sub: SubscriberId,
        last: u64,
        pending: Option<Arc<EventRecord>>,
        response: String,
        /// Set by `$/cancel_request`: the replay stops between pages, the
        /// session is detached, and `cancelled` is the answer.
        cancel: Arc<AtomicBool>,
        cancelled: String,
        /// The `session/load` request's id.
        request: Value,
    },
    /// The subscription `sub` announced by `Attach` never started (the
    /// session stopped): what was attached before it stands again.
    Revert {
        session: SessionId,
        sub: SubscriberId,
    },
    /// A ready-made message.
    Raw(String),
    /// This connection sends `prompt` to `session` (before it is
    /// submitted): its text is not echoed back live, the client has it,
    /// and until it is answered the client is sent only its turn.
    Mine {
        session: SessionId,
        prompt: PromptId,
    },
    /// The response to our prompt, which is over.
    Answer {
        msg: String,
        session: SessionId,
        prompt: PromptId,
    },
    /// The session was deleted (committed): a client attached to it is
    /// told, and it is detached.
    Deleted(SessionId),
    /// Everything before this is written: end.
    Close,
}

/// Sessions whose live events this connection could not queue: the
/// writer reads what they missed from the store before it writes
/// anything else, so a slow client loses nothing and is never cut off.
#[derive(Default)]
struct Lag {
    /// Set when `sessions` gained one (checked once per message).
    any: AtomicBool,
    sessions: std::sync::Mutex<HashSet<SessionId>>,
}

impl Lag {
    fn mark(&self, session: SessionId) {
        self.sessions
            .lock()
            .expect("lag set poisoned")
            .insert(session);
        self.any.store(true, Ordering::Release);
    }

    fn take(&self) -> Vec<SessionId> {
        if !self.any.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        self.sessions
            .lock()
            .expect("lag set poisoned")
            .drain()
            .collect()
    }
}

/// Delivers a session's events into a connection's writer task.
struct ConnSubscriber {
    id: SubscriberId,
    session: SessionId,
    /// The client's file and terminal methods for this session.
    client: Option<Arc<dyn tiller_tools::ClientTools>>,
    tx: mpsc::Sender<Out>,
    /// Where an event that did not fit is noted (it is in the store).
    lag: Arc<Lag>,
    /// The connection, to renew the attachment when the session's actor
    /// ends (this subscriber is dropped with it).
    shared: std::sync::Weak<Shared>,
}

impl Drop for ConnSubscriber {
    fn drop(&mut self) {
        let Some(shared) = self.shared.upgrade() else {
            return; // the connection is gone
        };
        let (session, sub) = (self.session, self.id);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(shared.renew(session, sub));
        }
    }
}

impl Subscriber for ConnSubscriber {
    fn deliver(&self, event: &Arc<EventRecord>) -> bool {
        match self.tx.try_send(Out::Event(self.id, event.clone())) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                // Costs the session nothing: the writer catches up from
                // the store.
                self.lag.mark(self.session);
                true
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    fn client_tools(&self) -> Option<Arc<dyn tiller_tools::ClientTools>> {
        self.client.clone()
    }
}

/// State shared by the request tasks of one connection.
struct Shared {
    sessions: Sessions,
    config: AcpConfig,
    tx: mpsc::Sender<Out>,
    lag: Arc<Lag>,
    /// Current subscription per attached session (guarded so two requests
    /// never attach the same session twice).
    attached: Mutex<HashMap<SessionId, (SessionHandle, SubscriberId)>>,
    /// Our requests to the client (`fs/*`, `terminal/*`).
    calls: Arc<Calls>,
    /// Our permission requests: JSON-RPC id -> (session, request id).
    asked: Arc<std::sync::Mutex<HashMap<String, (SessionId, String)>>>,
    /// Itself, for the subscribers it makes.
    me: std::sync::Weak<Shared>,
    /// See [`Writer::all_turns`].
    all_turns: Arc<AtomicBool>,
    /// See [`Writer::booleans`].
    booleans: Arc<AtomicBool>,
    /// See [`Writer::compaction`].
    compaction: Arc<AtomicBool>,
    /// The client's requests that `$/cancel_request` can cancel, by id.
    cancellable: std::sync::Mutex<HashMap<RequestKey, Cancellable>>,
    /// The client's `initialize` parameters (repeated to the owner when the
    /// connection is handed over).
    initialize: std::sync::Mutex<Option<Value>>,
    /// Asks the connection's loop to hand the connection over.
    handover: mpsc::Sender<crate::splice::Handover>,
}

/// A request's id as a map key: an integer is kept as it is read (no text
/// to format per lookup), anything else as its JSON text, so `1` and
/// `"1"` stay two requests, as do `-0` and `0.0` (equal as floats).
#[derive(PartialEq, Eq, Hash)]
enum RequestKey {
    Integer(i128),
    Text(String),
}

impl RequestKey {
    fn of(id: &Value) -> RequestKey {
        let integer = match id {
            Value::Number(n) => n.as_i64().map(i128::from).or(n.as_u64().map(i128::from)),
            _ => None,
        };
        match integer {
            Some(i) => RequestKey::Integer(i),
            None => RequestKey::Text(id.to_string()),
        }
    }
}

/// A request of the client's under way that it may cancel.
struct Cancellable {
    /// Set when it is cancelled.
    flag: Arc<AtomicBool>,
    /// A prompt: set by a `session/cancel` of its session read after it,
    /// so the cancel never overtakes a prompt the client sent before it
    /// (the prompt is answered `cancelled`, submitted or not).
    stopped: Arc<AtomicBool>,
    /// A prompt: the session it names, as read.
    session: Option<SessionId>,
    /// A prompt: withdrawn from its session.
    prompt: Option<(SessionId, PromptId)>,
}

/// How a prompt under way learns that the client cancelled it.
#[derive(Clone)]
struct CancelFlags {
    /// `$/cancel_request` (answered -32800).
    request: Arc<AtomicBool>,
    /// `session/cancel` (answered `cancelled`).
    session: Arc<AtomicBool>,
}

impl CancelFlags {
    fn any(&self) -> bool {
        self.request.load(Ordering::Acquire) || self.session.load(Ordering::Acquire)
    }
}

impl Shared {
    /// Makes request `id` cancellable (done as it is read, so a
    /// `$/cancel_request` read after it always finds it); the flag is set
    /// once it is cancelled. `prompt` names the prompt it submits.
    fn cancellable(&self, id: &Value, prompt: Option<(SessionId, PromptId)>) -> Arc<AtomicBool> {
        self.cancel_flags(id, None, prompt).request
    }

    /// [`Shared::cancellable`], for a prompt: `session` is the session
    /// it names (given as it is read).
    fn cancel_flags(
        &self,
        id: &Value,
        session: Option<SessionId>,
        prompt: Option<(SessionId, PromptId)>,
    ) -> CancelFlags {
        let mut all = self.cancellable.lock().expect("poisoned");
        let c = all
            .entry(RequestKey::of(id))
            .or_insert_with(|| Cancellable {
                flag: Arc::new(AtomicBool::new(false)),
                stopped: Arc::new(AtomicBool::new(false)),
                session: None,
                prompt: None,
            });
        if session.is_some() {
            c.session = session;
        }
        if prompt.is_some() {
            c.prompt = prompt;
        }
        CancelFlags {
            request: c.flag.clone(),
            session: c.stopped.clone(),
        }
    }

    /// `session/cancel`, as it is read: every prompt of this connection
    /// for the session read before it is cancelled, even one its handler
    /// has not submitted yet.
    fn cancel_prompts_of(&self, session: SessionId) {
        for c in self.cancellable.lock().expect("poisoned").values() {
            if c.session == Some(session) {
                c.stopped.store(true, Ordering::Release);
            }
        }
    }

    /// Whether a cancellable request with this id is under way.
    fn in_flight(&self, id: &Value) -> bool {
        self.cancellable
            .lock()
            .expect("poisoned")
            .contains_key(&RequestKey::of(id))
    }

    /// The node serving `session` when it is another one and this
    /// connection can be handed to it (a cluster, the session not served
    /// here).
    async fn elsewhere(&self, session: SessionId) -> Option<(String, String)> {
        self.config.forward.as_ref()?;
        if self.attached.lock().await.contains_key(&session) {
            return None;
        }
        self.sessions.served_elsewhere(session).await
    }

    fn settled(&self, id: &Value) {
        self.cancellable
            .lock()
            .expect("poisoned")
            .remove(&RequestKey::of(id));
    }

    /// `$/cancel_request`: a prompt is withdrawn (answered -32800 once it
    /// settles `cancelled`), a replay stops. Other requests are short and
    /// answered as they are.
    /// Returns the prompt to withdraw, if the request submitted one.
    fn cancel_request(&self, id: &Value) -> Option<(SessionId, PromptId)> {
        let all = self.cancellable.lock().expect("poisoned");
        let c = all.get(&RequestKey::of(id))?;
        c.flag.store(true, Ordering::Release);
        c.prompt
    }
}

/// Serves one connection until the transport closes. `outgoing` receives
/// one JSON-RPC message per item.
pub async fn serve(
    sessions: Sessions,
    config: AcpConfig,
    transport: &'static str,
    mut incoming: mpsc::Receiver<Frame>,
    outgoing: mpsc::Sender<String>,
) {
    metrics::gauge!("tiller_connections_active", "transport" => transport).increment(1.0);
    let (tx, rx) = mpsc::channel::<Out>(config.subscriber_queue.max(16));
    let (call_tx, mut call_rx) = mpsc::channel::<String>(64);
    let (handover_tx, mut handover_rx) = mpsc::channel::<crate::splice::Handover>(1);
    let lag = Arc::new(Lag::default());
    let asked = Arc::new(std::sync::Mutex::new(HashMap::new()));
    let all_turns = Arc::new(AtomicBool::new(false));
    let booleans = Arc::new(AtomicBool::new(false));
    let compaction = Arc::new(AtomicBool::new(false));
    let shared = Arc::new_cyclic(|me| Shared {
        all_turns: all_turns.clone(),
        booleans: booleans.clone(),
        compaction: compaction.clone(),
        cancellable: std::sync::Mutex::new(HashMap::new()),
        sessions: sessions.clone(),
        config,
        tx,
        lag: lag.clone(),
        attached: Mutex::new(HashMap::new()),
        calls: Calls::new(call_tx),
        asked: asked.clone(),
        me: me.clone(),
        initialize: std::sync::Mutex::new(None),
        handover: handover_tx,
    });
    let writer = Writer {
        sessions,
        lag,
        asked,
        out: outgoing.clone(),
        attached: foldhash::HashMap::default(),
        next_request: 0,
        mine: foldhash::HashMap::default(),
        all_turns: all_turns.clone(),
        booleans,
        compaction,
        shared: Arc::downgrade(&shared),
    };
    let mut writing = tokio::spawn(writer.run(rx));
    let mut deletions = shared.sessions.deletions();
    // Once the client stops sending, answer what is in flight, then end.
    let mut input_open = true;
    // Requests being handled; at the bound the loop stops reading, so a
    // client that sends without reading cannot grow the daemon's memory.
    let inflight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    // One wait for the transport's end, not a new one each turn of the loop
    // (each would register with the channel and unregister again).
    let transport_gone = outgoing.closed();
    tokio::pin!(transport_gone);
    loop {
        if !input_open && inflight.available_permits() == MAX_IN_FLIGHT {
            break;
        }
        tokio::select! {
            frame = incoming.recv(), if input_open => match frame {
                Some(Frame::Text(text)) => match jsonrpc::parse(&text) {
                    Incoming::Response { id, result } => {
                        let ours = id.as_str().and_then(|id| shared.asked.lock().expect("poisoned").remove(id));
                        if let Some((session, request_id)) = ours {
                            answer_permission(&shared, session, request_id, result);
                        } else if !shared.calls.answered(&id, result) {
                            tracing::debug!(?id, "response to no request of ours ignored");
                        }
                    }
                    other => dispatch(&shared, other, permit(&inflight).await),
                },
                Some(Frame::TooLarge(n)) => too_large(&shared, n, permit(&inflight).await),
                None => input_open = false,
            },
            Some(msg) = call_rx.recv() => {
                if outgoing.send(msg).await.is_err() {
                    break;
                }
            }
            Some(h) = handover_rx.recv() => {
                // Only a connection serving no session here is handed over
                // (its other sessions would be cut off).
                let alone = shared.attached.lock().await.is_empty();
                let init = shared.initialize.lock().expect("poisoned").clone();
                let why = match (&shared.config.forward, alone) {
                    (Some(f), true) => {
                        match crate::splice::run(f, &h, init, &mut incoming, &outgoing).await {
                            Ok(()) => break,
                            Err(why) => why,
                        }
                    }
                    _ => "this connection serves other sessions here".to_owned(),
                };
                let e = RpcError::new(
                    code::INTERNAL_ERROR,
                    format!("the session is served by node {} ({}): {why}; connect there", h.node, h.address),
                )
                .with_data(json!({ "errorKind": "owned_elsewhere", "retryable": true, "node": h.node, "address": h.address }));
                if outgoing.send(jsonrpc::error(&h.id, &e)).await.is_err() {
                    break;
                }
            }
            Ok(id) = deletions.recv() => {
                if let Some((h, sub)) = shared.attached.lock().await.remove(&id) {
                    h.unsubscribe(sub);
                }
                let _ = shared.tx.send(Out::Deleted(id)).await;
            }
            // Wake up to re-check the drain condition.
            () = tokio::time::sleep(std::time::Duration::from_millis(50)), if !input_open => {}
            // The writer ends only when the client stopped reading.
            _ = &mut writing => break,
            // So does the transport's (a write the client left unread for
            // `WRITE_STALL`), with nothing of ours waiting to be written.
            () = &mut transport_gone => break,
        }
    }
    shared.calls.close();
    let attached = std::mem::take(&mut *shared.attached.lock().await);
    for (handle, sub) in attached.into_values() {
        handle.unsubscribe(sub);
    }
    if !writing.is_finished() {
        // Everything queued before `Close` is written first (bounded: a
        // client that stopped reading does not pin the connection).
        let closing = async {
            let _ = shared.tx.send(Out::Close).await;
            let _ = (&mut writing).await;
        };
        if tokio::time::timeout(WRITE_STALL, closing).await.is_err() {
            writing.abort();
        }
    }
    metrics::gauge!("tiller_connections_active", "transport" => transport).decrement(1.0);
}

/// One attached session, as the writer sees it.
struct Attachment {
    /// The current subscription (events of older ones are dropped).
    sub: SubscriberId,
    /// The last event the client has (or needs none before); `None` until
    /// the subscription's start is known.
    sent: Option<u64>,
    /// Events up to here are history (replayed as updates only); later
    /// ones are live (with permission requests and extension notifications).
    live_from: u64,
    /// A `session/load` is under way: live events wait for its replay.
    replaying: bool,
    /// What this attachment replaced, until its subscription has started.
    replaced: Option<Box<Attachment>>,
    /// The run of message chunks last written: `(thought?, turn, id)`.
    /// Chunks continuing it share its `messageId`.
    run: Option<(bool, Option<TurnId>, u64)>,
}

/// Events read from the store per page when catching up.
const PAGE: usize = 256;
/// Longest text one coalesced chunk carries.
const COALESCE_MAX: usize = 256 * 1024;

/// The writer task: owns everything written to the client, in order.
struct Writer {
    sessions: Sessions,
    lag: Arc<Lag>,
    asked: Arc<std::sync::Mutex<HashMap<String, (SessionId, String)>>>,
    out: mpsc::Sender<String>,
    attached: foldhash::HashMap<SessionId, Attachment>,
    /// Counter for our request ids.
    next_request: u64,
    /// The connection, to detach a session.
    shared: std::sync::Weak<Shared>,
    /// Prompts this connection sent that are not over, per session.
    mine: foldhash::HashMap<SessionId, Vec<PromptId>>,
    /// The client separates turns itself (`_meta.tiller.allTurns` in its
    /// `initialize`): it is sent every turn, even while its own prompt
    /// waits or runs.
    all_turns: Arc<AtomicBool>,
    /// The client takes boolean config options (its `initialize`).
    booleans: Arc<AtomicBool>,
    /// The client takes `compaction_update` (`session.compaction` in its
    /// `initialize`); the others get `_tiller/compaction`.
    compaction: Arc<AtomicBool>,
}

/// The client stopped reading.
struct Gone;

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Out>) {
        loop {
            // A lag still open is read again now and then, even when no
            // message comes (a session that went quiet).
            let out = if self.lag.any.load(Ordering::Acquire) {
                match tokio::time::timeout(GAP_RETRY, rx.recv()).await {
                    Ok(out) => out,
                    Err(_) => {
                        for session in self.lag.take() {
                            if self.catch_up(session).await.is_err() {
                                return;
                            }
                        }
                        continue;
                    }
                }
            } else {
                rx.recv().await
            };
            let Some(out) = out else {
                return;
            };
            if matches!(out, Out::Close) || self.on(out).await.is_err() {
                return;
            }
            // A message can make a lag actionable (`Position`): nothing
            // waits for the next one.
            for session in self.lag.take() {
                if self.catch_up(session).await.is_err() {
                    return;
                }
            }
        }
    }

    async fn write(&self, msg: String) -> Result<(), Gone> {
        // Room in the queue (nearly always): no timer to arm, no clock read.
        let msg = match self.out.try_send(msg) {
            Ok(()) => return Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(Gone),
            Err(mpsc::error::TrySendError::Full(msg)) => msg,
        };
        match tokio::time::timeout(WRITE_STALL, self.out.send(msg)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Gone),
            Err(_) => {
                tracing::warn!(
                    "an ACP client read nothing for {WRITE_STALL:?}; closing its connection"
                );
                Err(Gone)
            }
        }
    }

    async fn on(&mut self, out: Out) -> Result<(), Gone> {
        // What did not fit in the queue goes out first, from the store.
        for session in self.lag.take() {
            self.catch_up(session).await?;
        }
        match out {
            Out::Raw(s) => self.write(s).await?,
            Out::Mine { session, prompt } => self.mine.entry(session).or_default().push(prompt),
            Out::Answer {
                msg,
                session,
                prompt,
            } => {
                if let Some(mine) = self.mine.get_mut(&session) {
                    mine.retain(|p| *p != prompt);
                    if mine.is_empty() {
                        self.mine.remove(&session);
                    }
                }
                self.write(msg).await?;
            }
            Out::Close => {}
            Out::Deleted(session) => {
                if self.attached.remove(&session).is_some() {
                    let note = jsonrpc::notification(
                        "_tiller/session_deleted",
                        json!({ "sessionId": session.to_string() }),
                    );
                    self.write(note).await?;
                }
            }
            Out::Attach {
                session,
                sub,
                replay,
            } => {
                let replaced = self.attached.remove(&session).map(Box::new);
                self.attached.insert(
                    session,
                    Attachment {
                        sub,
                        sent: None,
                        live_from: 0,
                        replaying: replay,
                        replaced,
                        run: None,
                    },
                );
            }
            Out::Revert { session, sub } => {
                if self.attached.get(&session).is_some_and(|a| a.sub == sub)
                    && let Some(before) = self.attached.remove(&session).and_then(|a| a.replaced)
                {
                    self.attached.insert(session, *before);
                }
            }
            Out::Position {
                session,
                sub,
                last,
                pending,
            } => {
                if let Some(a) = self.attached.get_mut(&session).filter(|a| a.sub == sub) {
                    match a.replaced.as_ref().and_then(|r| r.sent) {
                        // The session's actor was replaced (it failed and
                        // was rebuilt): the client goes on from what it was
                        // sent, and what it missed meanwhile is read from
                        // the log, as live events.
                        Some(before) if before < last && a.sent.is_none() => {
                            a.sent = Some(before);
                            a.live_from = before;
                            self.lag.mark(session);
                        }
                        _ => {
                            a.sent = Some(a.sent.unwrap_or(0).max(last));
                            a.live_from = last;
                        }
                    }
                    a.replaced = None;
                    if let Some(msg) = pending.and_then(|rec| self.ask(&rec)) {
                        self.write(msg).await?;
                    }
                }
            }
            Out::Replayed {
                session,
                sub,
                last,
                pending,
                response,
                cancel,
                cancelled,
                request,
            } => {
                let mut response = response;
                let mut loaded = false;
                if let Some(a) = self.attached.get_mut(&session).filter(|a| a.sub == sub) {
                    a.sent = Some(0);
                    a.live_from = last;
                    a.replaying = false;
                    a.replaced = None;
                    self.catch_up_until(session, Some(&cancel)).await?;
                    if cancel.load(Ordering::Acquire) {
                        self.detach(session, sub);
                        response = cancelled;
                    } else {
                        loaded = true;
                        if let Some(msg) = pending.and_then(|rec| self.ask(&rec)) {
                            self.write(msg).await?;
                        }
                    }
                }
                if let Some(shared) = self.shared.upgrade() {
                    shared.settled(&request);
                }
                if !response.is_empty() {
                    self.write(response).await?;
                }
                if loaded {
                    self.write(map::available_commands_line(session)).await?;
                }
            }
            Out::Event(sub, rec) => {
                let Some(a) = self.attached.get_mut(&rec.session).filter(|a| a.sub == sub) else {
                    return Ok(()); // from a replaced subscription
                };
                // During a replay the store has it.
                if a.replaying {
                    return Ok(());
                }
                // The one rule every viewer follows (`view::Cursor`): the
                // client may have it already (a catch-up covered it), it
                // is the next one, or events before it were dropped for
                // this connection and are read from the log first.
                let step = a
                    .sent
                    .map_or(Live::Send, |s| Cursor::at(rec.session, s).live(rec.seq));
                match step {
                    Live::Skip => {}
                    Live::Send => {
                        a.sent = Some(rec.seq);
                        for msg in self.live(&rec) {
                            self.write(msg).await?;
                        }
                    }
                    Live::CatchUp => {
                        self.catch_up(rec.session).await?;
                        let sent = self.attached.get(&rec.session).and_then(|a| a.sent);
                        match sent.map(|s| Cursor::at(rec.session, s).live(rec.seq)) {
                            // The gap is read; this one is next.
                            Some(Live::Send) => {
                                if let Some(a) = self.attached.get_mut(&rec.session) {
                                    a.sent = Some(rec.seq);
                                }
                                for msg in self.live(&rec) {
                                    self.write(msg).await?;
                                }
                            }
                            // The log does not hold the gap yet (the store
                            // is recovering): never out of order; read
                            // again soon.
                            Some(Live::CatchUp) => self.lag.mark(rec.session),
                            _ => {}
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes what the client lacks of `session` from the store, page by
    /// page (never the whole log in memory), consecutive text and thought
    /// chunks coalesced, until the store has nothing newer.
    async fn catch_up(&mut self, session: SessionId) -> Result<(), Gone> {
        self.catch_up_until(session, None).await
    }

    /// [`Writer::catch_up`], stopping between pages once `stop` is set.
    async fn catch_up_until(
        &mut self,
        session: SessionId,
        stop: Option<&AtomicBool>,
    ) -> Result<(), Gone> {
        let Some(a) = self.attached.get(&session) else {
            return Ok(());
        };
        let Some(from) = a.sent.filter(|_| !a.replaying) else {
            // Its start is not known yet (or a replay will cover it).
            if !a.replaying {
                self.lag.mark(session);
            }
            return Ok(());
        };
        let live_from = a.live_from;
        metrics::counter!("tiller_acp_catch_ups_total").increment(1);
        let mut cursor = Cursor::at(session, from);
        loop {
            if stop.is_some_and(|s| s.load(Ordering::Acquire)) {
                break;
            }
            let page = match cursor.page(&self.sessions, None, PAGE).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(%session, error = %e, "cannot read the log to catch a client up");
                    break;
                }
            };
            if page.is_empty() {
                break;
            }
            for msg in self.page_messages(&page, live_from) {
                self.write(msg).await?;
            }
            if let Some(a) = self.attached.get_mut(&session) {
                a.sent = Some(cursor.sent());
            }
            if page.len() < PAGE {
                break;
            }
        }
        Ok(())
    }

    /// The messages of a page of the log: history as updates only, live
    /// events as live; runs of text (or thought) chunks of one turn merged.
    fn page_messages(&mut self, page: &[EventRecord], live_from: u64) -> Vec<String> {
        let mut msgs = Vec::new();
        let mut run: Option<EventRecord> = None;
        for rec in page {
            if let Some(r) = run.as_mut()
                && merge(r, rec)
            {
                continue;
            }
            if let Some(r) = run.take() {
                msgs.extend(self.messages(&r, live_from));
            }
            if is_chunk(rec) {
                run = Some(rec.clone());
            } else {
                msgs.extend(self.messages(rec, live_from));
            }
        }
        if let Some(r) = run {
            msgs.extend(self.messages(&r, live_from));
        }
        msgs
    }

    fn messages(&mut self, rec: &EventRecord, live_from: u64) -> Vec<String> {
        if rec.seq <= live_from {
            let message = self.message_id(rec);
            map::update_line(
                rec,
                message.as_deref(),
                self.booleans.load(Ordering::Relaxed),
            )
            .into_iter()
            .chain(
                map::compaction_update(rec, self.compaction.load(Ordering::Relaxed))
                    .into_iter()
                    .chain(map::extra_updates(rec))
                    .map(|n| map::update_message(&n)),
            )
            .collect()
        } else {
            self.live(rec)
        }
    }

    /// The `messageId` of a message chunk: chunks of one kind that follow
    /// each other in one turn are one message; anything shown between
    /// them (a tool call, a plan) starts a new one.
    fn message_id(&mut self, rec: &EventRecord) -> Option<String> {
        use tiller_session::EventBody::{AgentMessageChunk, AgentThoughtChunk};
        let a = self.attached.get_mut(&rec.session)?;
        let thought = match rec.body {
            AgentMessageChunk { .. } => false,
            AgentThoughtChunk { .. } => true,
            _ => {
                if map::shown(&rec.body) {
                    a.run = None;
                }
                return None;
            }
        };
        let id = match a.run {
            Some((t, turn, id)) if t == thought && turn == rec.turn => id,
            _ => rec.seq,
        };
        a.run = Some((thought, rec.turn, id));
        let kind = if thought { "thought-" } else { "msg-" };
        let mut n = itoa::Buffer::new();
        let n = n.format(id);
        let mut message = String::with_capacity(kind.len() + n.len());
        message.push_str(kind);
        message.push_str(n);
        Some(message)
    }

    /// What a live event becomes for this client: updates, extension
    /// notifications, and permission requests (or their withdrawal). The
    /// text of a prompt this connection sent is not echoed back to it.
    ///
    /// While a prompt of this connection waits or runs, it is sent only
    /// that prompt's turn: clients show what arrives then as the answer
    /// to their prompt, so another client's turn meanwhile (or an
    /// automatic one) is left out for it, unless it separates turns
    /// itself (`all_turns`). `session/load` replays everything.
    fn live(&mut self, rec: &EventRecord) -> Vec<String> {
        let message = self.message_id(rec);
        // What is shown (updates, notifications) is left out; what needs an
        // answer (a permission request, its withdrawal) never is, or a turn
        // could wait on a question nobody saw.
        let mut shown = true;
        let mut echo = false;
        if let Some(mine) = self.mine.get(&rec.session)
            && let Some(p) = rec.prompt
        {
            let own = mine.contains(&p);
            shown = own || self.all_turns.load(Ordering::Relaxed);
            // The client has its own text.
            echo = own && matches!(rec.body, tiller_session::EventBody::UserMessage { .. });
        }
        let mut msgs = Vec::new();
        if shown
            && !echo
            && let Some(line) = map::update_line(
                rec,
                message.as_deref(),
                self.booleans.load(Ordering::Relaxed),
            )
        {
            msgs.push(line);
        }
        let compaction = self.compaction.load(Ordering::Relaxed);
        if shown && !echo {
            msgs.extend(map::compaction_update(rec, compaction).map(|n| map::update_message(&n)));
            msgs.extend(map::extra_updates(rec).iter().map(map::update_message));
        }
        if shown
            && let Some((method, params)) = map::extension_notification(rec)
            && !(compaction && method == map::COMPACTION_NOTIFICATION)
        {
            msgs.push(map::extension_line(method, &params));
        }
        msgs.extend(self.ask(rec));
        let mut asked = self.asked.lock().expect("poisoned");
        if let tiller_session::EventBody::PermissionResolved { request_id, .. } = &rec.body {
            // Answered elsewhere (or the turn ended): withdraw our request.
            let ours: Vec<String> = asked
                .iter()
                .filter(|(_, (s, r))| *s == rec.session && r == request_id)
                .map(|(id, _)| id.clone())
                .collect();
            for id in ours {
                asked.remove(&id);
                msgs.push(jsonrpc::notification(
                    "$/cancel_request",
                    json!({ "requestId": id }),
                ));
            }
        }
        msgs
    }
}

impl Writer {
    /// Ends this connection's attachment `sub` to `session` (a cancelled
    /// `session/load`): nothing more of it is written.
    fn detach(&mut self, session: SessionId, sub: SubscriberId) {
        self.attached.remove(&session);
        if let Some(shared) = self.shared.upgrade() {
            tokio::spawn(async move {
                let mut attached = shared.attached.lock().await;
                if attached.get(&session).is_some_and(|(_, s)| *s == sub)
                    && let Some((h, sub)) = attached.remove(&session)
                {
                    h.unsubscribe(sub);
                }
            });
        }
    }

    /// The `session/request_permission` for a `permission_requested`,
    /// remembered so the answer finds its session (and so the request can
    /// be withdrawn when someone else answers).
    fn ask(&mut self, rec: &EventRecord) -> Option<String> {
        let (request_id, params) = map::permission_request(rec)?;
        let mut asked = self.asked.lock().expect("poisoned");
        if asked
            .values()
            .any(|(s, r)| *s == rec.session && *r == request_id)
        {
            return None; // this client was asked already
        }
        self.next_request += 1;
        let id = format!("tiller-{}", self.next_request);
        asked.insert(id.clone(), (rec.session, request_id));
        Some(jsonrpc::request(&id, "session/request_permission", params))
    }
}

fn is_chunk(rec: &EventRecord) -> bool {
    use tiller_session::EventBody::{AgentMessageChunk, AgentThoughtChunk};
    matches!(
        rec.body,
        AgentMessageChunk { .. } | AgentThoughtChunk { .. }
    )
}

/// Appends `next` to the run `into` when both are chunks of one kind of
/// one turn (and the run is not too long yet).
fn merge(into: &mut EventRecord, next: &EventRecord) -> bool {
    use tiller_session::EventBody::{AgentMessageChunk, AgentThoughtChunk};
    if into.prompt != next.prompt || into.turn != next.turn {
        return false;
    }
    let ((AgentMessageChunk { text: a }, AgentMessageChunk { text: b })
    | (AgentThoughtChunk { text: a }, AgentThoughtChunk { text: b })) =
        (&mut into.body, &next.body)
    else {
        return false;
    };
    if a.len() + b.len() > COALESCE_MAX {
        return false;
    }
    a.push_str(b);
    into.seq = next.seq;
    true
}

/// Requests of one connection handled at once.
const MAX_IN_FLIGHT: usize = 256;
/// Longest a write to the client may wait before the client is taken for
/// gone (it is not reading at all; a slow one is caught up from the store).
pub const WRITE_STALL: std::time::Duration = std::time::Duration::from_secs(300);
/// How soon a lag the log could not cover yet is read again.
const GAP_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

/// Waits for room to handle one more request.
async fn permit(inflight: &Arc<Semaphore>) -> OwnedSemaphorePermit {
    inflight
        .clone()
        .acquire_owned()
        .await
        .expect("the semaphore is never closed")
}

fn too_large(shared: &Arc<Shared>, n: usize, inflight: OwnedSemaphorePermit) {
    let e = RpcError::new(
        code::INVALID_REQUEST,
        format!(
            "message of {n} bytes exceeds limits.max_message_bytes ({})",
            shared.config.max_message_bytes
        ),
    )
    .with_data(json!({ "maxMessageBytes": shared.config.max_message_bytes }));
    send_raw(shared, jsonrpc::error(&Value::Null, &e), inflight);
}

/// Hands a client's permission answer to its session.
fn answer_permission(
    shared: &Arc<Shared>,
    session: SessionId,
    request_id: String,
    result: Result<Value, Value>,
) {
    let option = match &result {
        Ok(v) => map::permission_choice(v).unwrap_or_else(|| "reject_once".into()),
        // A client that errors on the request denies it.
        Err(_) => "reject_once".into(),
    };
    let shared = shared.clone();
    tokio::spawn(async move {
        if let Ok(h) = shared.sessions.open(session).await
            && let Ok(Err(e)) = h.permission(request_id, option).await
        {
            tracing::debug!(error = %e, "late permission answer ignored");
        }
    });
}

fn dispatch(shared: &Arc<Shared>, msg: Incoming, inflight: OwnedSemaphorePermit) {
    match msg {
        Incoming::Invalid { id, error } => send_raw(shared, jsonrpc::error(&id, &error), inflight),
        Incoming::Response { .. } => {}
        Incoming::Notification { method, params } => {
            if method == "$/cancel_request" {
                let Some(id) = params.get("requestId").cloned() else {
                    return;
                };
                // Marked at once, in the order the client sent it; only the
                // prompt's withdrawal waits for its session.
                if let Some((session, prompt)) = shared.cancel_request(&id) {
                    let shared = shared.clone();
                    tokio::spawn(async move {
                        if let Ok(h) = shared.sessions.open(session).await {
                            let _ = h.withdraw(prompt);
                        }
                    });
                }
                return;
            }
            if method == "session/cancel" {
                let Ok(p) = serde_json::from_value::<CancelNotification>(params) else {
                    return;
                };
                let Some(id) = SessionId::parse(&p.session_id.0) else {
                    return;
                };
                // Prompts read before it, submitted or not, end cancelled.
                shared.cancel_prompts_of(id);
                // An attached session is cancelled here, in the order the
                // client sent it: a request sent after the cancel (a steer)
                // reaches the session after it.
                if let Ok(attached) = shared.attached.try_lock()
                    && let Some((h, _)) = attached.get(&id)
                    && h.cancel().is_ok()
                {
                    return;
                }
                let shared = shared.clone();
                tokio::spawn(async move {
                    if let Ok(h) = shared.sessions.open(id).await {
                        let _ = h.cancel();
                    }
                });
            }
            // Other notifications are ignored, as JSON-RPC asks.
        }
        Incoming::Request { id, method, params } => {
            if matches!(method.as_str(), "session/prompt" | "session/load") {
                // Ids name requests: one still under way is not reused.
                if shared.in_flight(&id) {
                    let e = RpcError::new(
                        code::INVALID_REQUEST,
                        format!("request id {id} is already in use by a request under way"),
                    );
                    send_raw(shared, jsonrpc::error(&id, &e), inflight);
                    return;
                }
            }
            let shared = shared.clone();
            let params_session = params.session_id().and_then(SessionId::parse);
            match method.as_str() {
                "session/prompt" => {
                    shared.cancel_flags(&id, params_session, None);
                }
                "session/load" => {
                    shared.cancellable(&id, None);
                }
                _ => {}
            }
            tokio::spawn(async move {
                let _inflight = inflight;
                if let Some(session) = params_session
                    && method != "session/new"
                    && let Some((node, address)) = shared.elsewhere(session).await
                {
                    shared.settled(&id);
                    let request =
                        json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params.into_value() })
                            .to_string();
                    let _ = shared
                        .handover
                        .send(crate::splice::Handover {
                            node,
                            address,
                            id,
                            request,
                        })
                        .await;
                    return;
                }
                // Boxed: the handler's future is about 4 KB (its largest
                // method's), which the task would otherwise carry, and
                // tokio copies a task's future when it spawns it and
                // again when it stores its output.
                let result = Box::pin(handle(&shared, &id, &method, params)).await;
                let msg = match result {
                    Ok(result) => jsonrpc::response(&id, &result),
                    Err(Reply::Error(e)) => jsonrpc::error(&id, &e),
                    Err(Reply::Opened { result, session }) => {
                        shared.settled(&id);
                        let msg = jsonrpc::response(&id, &result);
                        let _ = shared.tx.send(Out::Raw(msg)).await;
                        // The answer goes out on its own first (the writer
                        // runs meanwhile): the client waits on it, not on
                        // the command list, which would otherwise share
                        // its write.
                        tokio::task::yield_now().await;
                        let line = map::available_commands_line(session);
                        let _ = shared.tx.send(Out::Raw(line)).await;
                        return;
                    }
                    Err(Reply::Mine {
                        result,
                        session,
                        prompt,
                    }) => {
                        let msg = match *result {
                            Ok(v) => jsonrpc::response(&id, &v),
                            Err(e) => jsonrpc::error(&id, &e),
                        };
                        shared.settled(&id);
                        let _ = shared
                            .tx
                            .send(Out::Answer {
                                msg,
                                session,
                                prompt,
                            })
                            .await;
                        return;
                    }
                    Err(Reply::Replay {
                        session,
                        sub,
                        last,
                        pending,
                        result,
                        cancel,
                    }) => {
                        let _ = shared
                            .tx
                            .send(Out::Replayed {
                                session,
                                sub,
                                last,
                                pending,
                                response: jsonrpc::response(&id, &result),
                                cancelled: jsonrpc::error(&id, &request_cancelled()),
                                cancel,
                                request: id.clone(),
                            })
                            .await;
                        return;
                    }
                };
                shared.settled(&id);
                let _ = shared.tx.send(Out::Raw(msg)).await;
            });
        }
    }
}

/// What prompts may carry: images when some engine takes them (a session
/// on one that does not refuses them, saying so), embedded text context.
fn prompt_capabilities(sessions: &Sessions) -> PromptCapabilities {
    let engines = sessions.engines();
    let image = engines
        .names()
        .iter()
        .any(|n| engines.get(Some(n)).is_ok_and(|e| e.accepts_images()));
    PromptCapabilities::new()
        .image(image)
        .embedded_context(true)
}

/// After a session is opened on this connection: the commands it has.
fn send_raw(shared: &Arc<Shared>, msg: String, inflight: OwnedSemaphorePermit) {
    let tx = shared.tx.clone();
    tokio::spawn(async move {
        let _ = tx.send(Out::Raw(msg)).await;
        drop(inflight);
    });
}

/// A request's answer other than a plain result.
enum Reply {
    Error(RpcError),
    /// The answer to this connection's prompt `prompt`.
    Mine {
        result: Box<Result<Json, RpcError>>,
        session: SessionId,
        prompt: PromptId,
    },
    /// `session/new`, `session/resume`: the answer, then the session's
    /// commands.
    Opened {
        result: Json,
        session: SessionId,
    },
    /// `session/load`: the history goes out before the response.
    Replay {
        session: SessionId,
        sub: SubscriberId,
        last: u64,
        /// The permission request the session waits on: asked after the replay.
        pending: Option<Arc<EventRecord>>,
        result: Json,
        /// Set by `$/cancel_request`.
        cancel: Arc<AtomicBool>,
    },
}

impl From<RpcError> for Reply {
    fn from(e: RpcError) -> Self {
        Reply::Error(e)
    }
}

fn params<T: DeserializeOwned>(v: Value) -> Result<T, Reply> {
    serde_json::from_value(v).map_err(|e| Reply::Error(RpcError::invalid_params(e)))
}

fn session_id(raw: &str) -> Result<SessionId, Reply> {
    SessionId::parse(raw).ok_or_else(|| unknown_session(raw))
}

fn unknown_session(raw: &str) -> Reply {
    Reply::Error(
        RpcError::new(code::UNKNOWN_SESSION, format!("unknown session {raw}"))
            .with_data(json!({ "sessionId": raw })),
    )
}

fn session_error(e: SessionError) -> Reply {
    match e {
        SessionError::Unknown(id) => unknown_session(&id.to_string()),
        SessionError::BadCwd(..) => Reply::Error(
            RpcError::invalid_params(e.to_string()).with_data(json!({ "field": "cwd" })),
        ),
        SessionError::UnknownEngine(..) => Reply::Error(
            RpcError::invalid_params(e.to_string())
                .with_data(json!({ "field": "_meta.tiller.engine" })),
        ),
        SessionError::TooManySessions(_) => Reply::Error(
            RpcError::new(code::OVERLOADED, e.to_string())
                .with_data(json!({ "errorKind": "overloaded", "retryable": true })),
        ),
        SessionError::Store(e) => {
            tracing::warn!(error = %e, "a request failed in the store");
            if e.is_unavailable() {
                store_unavailable(e.for_client())
            } else {
                Reply::Error(RpcError::new(code::INTERNAL_ERROR, e.for_client()))
            }
        }
        SessionError::Elsewhere {
            ref node,
            ref address,
            ..
        } => Reply::Error(RpcError::new(code::INTERNAL_ERROR, e.to_string()).with_data(
            json!({ "errorKind": "owned_elsewhere", "retryable": true, "node": node, "address": address }),
        )),
        SessionError::HandingOver(_) => store_unavailable(e.to_string()),
        SessionError::Stopped => Reply::Error(
            RpcError::new(code::INTERNAL_ERROR, e.to_string())
                .with_data(json!({ "errorKind": "session_stopped", "retryable": false })),
        ),
        other => Reply::Error(RpcError::new(code::INTERNAL_ERROR, other.to_string())),
    }
}

/// The store cannot record the request: nothing was acknowledged.
fn store_unavailable(message: String) -> Reply {
    Reply::Error(
        RpcError::new(code::INTERNAL_ERROR, message)
            .with_data(json!({ "errorKind": "store_unavailable", "retryable": true })),
    )
}

fn refused(e: PromptRefused) -> Reply {
    match e {
        PromptRefused::Invalid(e) => Reply::Error(
            RpcError::new(code::INVALID_PARAMS, e.to_string())
                .with_data(json!({ "error": e.message, "step": e.path })),
        ),
        PromptRefused::Overloaded => Reply::Error(
            RpcError::new(code::OVERLOADED, e.to_string())
                .with_data(json!({ "errorKind": "overloaded", "retryable": true })),
        ),
        PromptRefused::SessionClosed => {
            Reply::Error(RpcError::new(code::UNKNOWN_SESSION, e.to_string()))
        }
        PromptRefused::Unsupported(why) => Reply::Error(
            RpcError::new(code::INVALID_PARAMS, format!("invalid params: {why}"))
                .with_data(json!({ "field": "prompt" })),
        ),
        PromptRefused::BadDelivery(why) => Reply::Error(
            RpcError::new(code::INVALID_PARAMS, format!("invalid params: {why}"))
                .with_data(json!({ "field": "_meta.tiller.delivery.webhook" })),
        ),
        PromptRefused::StoreUnavailable => store_unavailable(e.to_string()),
    }
}

/// A request's result as JSON text, written straight from its ACP type
/// (no `Value` in between: `session/new`'s options and modes, a prompt's
/// stop reason).
type Json = Box<serde_json::value::RawValue>;

fn json<T: serde::Serialize + ?Sized>(v: &T) -> Json {
    serde_json::value::to_raw_value(v).expect("ACP types serialize")
}

impl Shared {
    /// Subscribes this connection to a session unless it already is.
    async fn attach(&self, handle: &SessionHandle) -> Result<(), Reply> {
        let mut attached = self.attached.lock().await;
        // An attachment to an actor that was replaced is stale: renewed.
        if attached
            .get(&handle.id())
            .is_some_and(|(h, _)| h.same_actor(handle))
        {
            return Ok(());
        }
        let (sub, snap) = self.subscribe(handle, false).await?;
        let session = handle.id();
        let _ = self
            .tx
            .send(Out::Position {
                session,
                sub,
                last: snap.last_seq,
                pending: snap.pending_permission,
            })
            .await;
        attached.insert(session, (handle.clone(), sub));
        Ok(())
    }

    /// The actor of an attached session ended (its subscriber `sub` was
    /// dropped with it): attach to its successor, so this client goes on
    /// receiving the session's events, its own prompts' and others'. A
    /// closed session (or a daemon shutting down) ends the attachment.
    async fn renew(self: Arc<Self>, session: SessionId, sub: SubscriberId) {
        {
            let mut attached = self.attached.lock().await;
            if !attached.get(&session).is_some_and(|(_, s)| *s == sub) {
                return; // replaced or detached on purpose
            }
            attached.remove(&session);
        }
        // The registry may not have noticed the old actor's end yet, and
        // a store that cannot write keeps the session from reopening until
        // it is back: tried again, less and less often, for as long as the
        // connection lasts. Only an unknown (deleted, closed) session, or
        // another attachment made meanwhile, ends it.
        let mut wait = std::time::Duration::from_millis(25);
        let mut warned = false;
        loop {
            if self.tx.is_closed() {
                return; // the connection ended
            }
            match self.sessions.open(session).await {
                Ok(h) if self.attach(&h).await.is_ok() => return,
                Ok(_)
                | Err(
                    SessionError::Store(_) | SessionError::Stopped | SessionError::HandingOver(_),
                ) => {}
                Err(_) => return,
            }
            if !warned && wait >= std::time::Duration::from_secs(1) {
                warned = true;
                tracing::warn!(%session, "cannot attach a connection to its session again yet; retrying");
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(std::time::Duration::from_secs(2));
            if self.attached.lock().await.contains_key(&session) {
                return; // attached again by the connection's own request
            }
        }
    }

    /// Subscribes afresh (replacing any earlier subscription) for a
    /// replay; returns the subscription and the last event the replay's
    /// history covers (later ones are live).
    async fn attach_for_replay(
        &self,
        handle: &SessionHandle,
    ) -> Result<(SubscriberId, tiller_session::Snapshot), Reply> {
        let mut attached = self.attached.lock().await;
        let (sub, snap) = self.subscribe(handle, true).await?;
        if let Some((old, old_sub)) = attached.insert(handle.id(), (handle.clone(), sub)) {
            old.unsubscribe(old_sub);
        }
        Ok((sub, snap))
    }

    /// A new subscription to `handle`, announced to the writer first (so
    /// none of its events arrives unknown) and withdrawn there if the
    /// session cannot take it. Returns it with the session's state at
    /// that instant.
    async fn subscribe(
        &self,
        handle: &SessionHandle,
        replay: bool,
    ) -> Result<(SubscriberId, tiller_session::Snapshot), Reply> {
        let (session, sub) = (handle.id(), self.sessions.subscriber_id());
        let _ = self
            .tx
            .send(Out::Attach {
                session,
                sub,
                replay,
            })
            .await;
        match handle
            .subscribe(sub, Box::new(self.subscriber(sub, session)))
            .await
        {
            Ok(snap) => Ok((sub, snap)),
            Err(e) => {
                let _ = self.tx.send(Out::Revert { session, sub }).await;
                Err(session_error(e))
            }
        }
    }

    /// Widens the session's file tools to the `additionalDirectories` a
    /// request passed (none: keeps what it has).
    async fn set_roots(&self, handle: &SessionHandle, dirs: &[PathBuf]) -> Result<(), Reply> {
        if dirs.is_empty() {
            return Ok(());
        }
        let roots = dirs.iter().map(|d| d.display().to_string()).collect();
        handle
            .set_roots(roots)
            .await
            .map_err(session_error)?
            .map_err(|why| {
                Reply::Error(
                    RpcError::invalid_params(why)
                        .with_data(json!({ "field": "additionalDirectories" })),
                )
            })
    }

    /// Gives the session the MCP servers a request passed (none: keeps
    /// what it has).
    async fn connect_mcp(
        &self,
        handle: &SessionHandle,
        servers: Vec<tiller_tools::McpServerConfig>,
    ) -> Result<(), Reply> {
        if !servers.is_empty() {
            handle.set_mcp(servers).await.map_err(session_error)?;
        }
        Ok(())
    }

    fn subscriber(&self, id: SubscriberId, session: SessionId) -> ConnSubscriber {
        ConnSubscriber {
            id,
            session,
            client: self.calls.tools_for(session),
            tx: self.tx.clone(),
            lag: self.lag.clone(),
            shared: self.me.clone(),
        }
    }

    async fn open(&self, raw: &str) -> Result<SessionHandle, Reply> {
        let id = session_id(raw)?;
        self.sessions.open(id).await.map_err(session_error)
    }

    /// The session a request names, attached to this connection: the
    /// handle the connection holds while its actor runs (no round trip
    /// through the registry per prompt), else opened and attached.
    async fn open_attached(&self, raw: &str) -> Result<SessionHandle, Reply> {
        let id = session_id(raw)?;
        if let Some((handle, _)) = self.attached.lock().await.get(&id)
            && handle.is_running()
        {
            return Ok(handle.clone());
        }
        let handle = self.sessions.open(id).await.map_err(session_error)?;
        self.attach(&handle).await?;
        Ok(handle)
    }
}

async fn handle(shared: &Shared, id: &Value, method: &str, raw: Params) -> Result<Json, Reply> {
    let (raw, prompt_read) = match raw {
        Params::Prompt(p) if method == "session/prompt" => (Value::Null, Some(p)),
        other => (other.into_value(), None),
    };
    match method {
        "initialize" => {
            *shared.initialize.lock().expect("poisoned") = Some(raw.clone());
            shared.calls.set_caps(ClientCaps::from_initialize(&raw));
            let all_turns = raw["clientCapabilities"]["_meta"]["tiller"]["allTurns"] == json!(true);
            shared.all_turns.store(all_turns, Ordering::Relaxed);
            let booleans =
                raw["clientCapabilities"]["session"]["configOptions"]["boolean"].is_object();
            shared.booleans.store(booleans, Ordering::Relaxed);
            let compaction = raw["clientCapabilities"]["session"]["compaction"].is_object();
            shared.compaction.store(compaction, Ordering::Relaxed);
            let _req: InitializeRequest = params(raw)?;
            let caps = AgentCapabilities::new()
                .load_session(true)
                .prompt_capabilities(prompt_capabilities(&shared.sessions))
                .mcp_capabilities(McpCapabilities::new().http(true))
                .session_capabilities(
                    SessionCapabilities::new()
                        .list(SessionListCapabilities::new())
                        .resume(SessionResumeCapabilities::new())
                        .close(SessionCloseCapabilities::new())
                        .additional_directories(SessionAdditionalDirectoriesCapabilities::new())
                        .delete(SessionDeleteCapabilities::new()),
                )
                .meta(
                    json!({ "steering": { "supported": true } })
                        .as_object()
                        .cloned(),
                );
            let mut res = serde_json::to_value(
                InitializeResponse::new(ProtocolVersion::V1)
                    .agent_capabilities(caps)
                    .agent_info(Implementation::new("tiller", shared.config.version.clone())),
            )
            .expect("ACP types serialize");
            res["_meta"] = json!({
                "tiller": { "version": shared.config.version, "promptQueueing": true },
                "steering": { "supported": true },
            });
            Ok(json(&res))
        }
        "session/new" => {
            let req: NewSessionRequest = params(raw)?;
            // Checked before anything is made for the session.
            let dirs: Vec<String> = req
                .additional_directories
                .iter()
                .map(|d| d.display().to_string())
                .collect();
            tiller_session::check_roots(&dirs).await.map_err(|why| {
                Reply::Error(
                    RpcError::invalid_params(why)
                        .with_data(json!({ "field": "additionalDirectories" })),
                )
            })?;
            let mcp = map::mcp_servers(&req.mcp_servers).map_err(Reply::Error)?;
            // `_meta.tiller.engine` picks an engine other than the default.
            let engine = match req
                .meta
                .as_ref()
                .and_then(|m| m.get("tiller"))
                .and_then(|t| t.get("engine"))
            {
                None | Some(Value::Null) => None,
                Some(Value::String(e)) => Some(e.clone()),
                Some(other) => {
                    return Err(Reply::Error(
                        RpcError::invalid_params(format!("engine must be a string; got {other}"))
                            .with_data(json!({ "field": "_meta.tiller.engine" })),
                    ));
                }
            };
            let handle = shared
                .sessions
                .create_with(req.cwd.display().to_string(), None, engine)
                .await
                .map_err(session_error)?;
            shared.connect_mcp(&handle, mcp).await?;
            if let Err(e) = shared.set_roots(&handle, &req.additional_directories).await {
                // Refused: the session it was made for does not stay.
                let _ = shared.sessions.delete(handle.id()).await;
                return Err(e);
            }
            shared.attach(&handle).await?;
            let options = handle.options().await.map_err(session_error)?;
            Err(Reply::Opened {
                result: json(
                    &NewSessionResponse::new(handle.id().to_string())
                        .config_options(map::config_options(
                            &options,
                            shared.booleans.load(Ordering::Relaxed),
                        ))
                        .modes(map::modes(&options)),
                ),
                session: handle.id(),
            })
        }
        "session/set_mode" => {
            let req: SetSessionModeRequest = params(raw)?;
            let handle = shared.open_attached(&req.session_id.0).await?;
            handle
                .set_option("permission_mode".into(), req.mode_id.0.to_string())
                .await
                .map_err(session_error)?
                .map_err(|e| {
                    Reply::Error(
                        RpcError::invalid_params(e).with_data(json!({ "field": "modeId" })),
                    )
                })?;
            Ok(json(&SetSessionModeResponse::new()))
        }
        "session/set_config_option" => {
            let req: SetSessionConfigOptionRequest = params(raw)?;
            let value = match serde_json::to_value(&req.value) {
                Ok(Value::Object(o)) => match o.get("value") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Bool(b)) => b.to_string(),
                    _ => String::new(),
                },
                _ => String::new(),
            };
            let handle = shared.open_attached(&req.session_id.0).await?;
            let options = handle
                .set_option(req.config_id.0.to_string(), value)
                .await
                .map_err(session_error)?
                .map_err(|e| {
                    Reply::Error(
                        RpcError::invalid_params(e).with_data(json!({ "field": "configId/value" })),
                    )
                })?;
            Ok(json(&SetSessionConfigOptionResponse::new(
                map::config_options(&options, shared.booleans.load(Ordering::Relaxed)),
            )))
        }
        "session/load" => {
            let req: LoadSessionRequest = params(raw)?;
            let mcp = map::mcp_servers(&req.mcp_servers).map_err(Reply::Error)?;
            let handle = shared.open(&req.session_id.0).await?;
            shared.connect_mcp(&handle, mcp).await?;
            shared
                .set_roots(&handle, &req.additional_directories)
                .await?;
            // The writer replays the log page by page from the store, then
            // answers; live events that arrive meanwhile are in the store too.
            let options = handle.options().await.map_err(session_error)?;
            let (sub, snap) = shared.attach_for_replay(&handle).await?;
            Err(Reply::Replay {
                cancel: shared.cancellable(id, None),
                session: handle.id(),
                sub,
                last: snap.last_seq,
                pending: snap.pending_permission,
                result: json(
                    &LoadSessionResponse::new()
                        .config_options(map::config_options(
                            &options,
                            shared.booleans.load(Ordering::Relaxed),
                        ))
                        .modes(map::modes(&options)),
                ),
            })
        }
        "session/resume" => {
            let req: ResumeSessionRequest = params(raw)?;
            let mcp = map::mcp_servers(&req.mcp_servers).map_err(Reply::Error)?;
            let handle = shared.open(&req.session_id.0).await?;
            shared.connect_mcp(&handle, mcp).await?;
            shared
                .set_roots(&handle, &req.additional_directories)
                .await?;
            shared.attach(&handle).await?;
            let options = handle.options().await.map_err(session_error)?;
            Err(Reply::Opened {
                result: json(
                    &ResumeSessionResponse::new()
                        .config_options(map::config_options(
                            &options,
                            shared.booleans.load(Ordering::Relaxed),
                        ))
                        .modes(map::modes(&options)),
                ),
                session: handle.id(),
            })
        }
        "session/list" => {
            let req: ListSessionsRequest = params(raw)?;
            let cwd = req.cwd.as_ref().map(|c| c.display().to_string());
            let page = shared
                .sessions
                .list_in(req.cursor.as_deref(), 100, cwd)
                .await
                .map_err(session_error)?;
            let sessions = page
                .sessions
                .into_iter()
                .map(|s| {
                    SessionInfo::new(s.id.to_string(), PathBuf::from(s.cwd))
                        .title(s.title)
                        .updated_at(rfc3339(s.updated_ms))
                })
                .collect();
            Ok(json(
                &ListSessionsResponse::new(sessions).next_cursor(page.next_cursor),
            ))
        }
        "session/delete" => {
            let req: DeleteSessionRequest = params(raw)?;
            let id = session_id(&req.session_id.0)?;
            // Attached clients (this one included) hear
            // `_tiller/session_deleted` once it is committed.
            shared.sessions.delete(id).await.map_err(session_error)?;
            Ok(json(&DeleteSessionResponse::new()))
        }
        "session/close" => {
            let req: CloseSessionRequest = params(raw)?;
            let handle = shared.open(&req.session_id.0).await?;
            if let Some((h, sub)) = shared.attached.lock().await.remove(&handle.id()) {
                h.unsubscribe(sub);
            }
            handle.close().await.map_err(session_error)?;
            Ok(json(&CloseSessionResponse::new()))
        }
        "session/prompt" => {
            // The writer learns the id first: the client has the text, it
            // is not echoed back live.
            let req: PromptRequest = match prompt_read {
                Some(p) => p,
                None => params(raw)?,
            };
            let session = session_id(&req.session_id.0)?;
            let mine = PromptId::new();
            let _ = shared
                .tx
                .send(Out::Mine {
                    session,
                    prompt: mine,
                })
                .await;
            let cancel = shared.cancel_flags(id, Some(session), Some((session, mine)));
            let result = match prompt(shared, req, mine, &cancel).await {
                // Cancelled by `$/cancel_request`: answered as JSON-RPC says.
                Ok(StopReason::Cancelled) if cancel.request.load(Ordering::Acquire) => {
                    Err(request_cancelled())
                }
                Ok(stop) => Ok(json(&PromptResponse::new(stop))),
                Err(Reply::Error(e)) => Err(e),
                Err(_) => Err(RpcError::new(code::INTERNAL_ERROR, "unexpected reply")),
            };
            Err(Reply::Mine {
                result: Box::new(result),
                session,
                prompt: mine,
            })
        }
        "_session/steering" => steering(shared, raw).await,
        other => Err(Reply::Error(RpcError::new(
            code::METHOD_NOT_FOUND,
            format!("method not found: {other}"),
        ))),
    }
}

/// `session/prompt`, submitted as `mine`: answered once the prompt is over.
async fn prompt(
    shared: &Shared,
    req: PromptRequest,
    mine: PromptId,
    cancel: &CancelFlags,
) -> Result<StopReason, Reply> {
    let handle = shared.open_attached(&req.session_id.0).await?;
    let (text, images) = map::prompt_content(&req.prompt).map_err(Reply::Error)?;
    // Tiller's slash commands are the daemon's, whatever the engine.
    if let Some(cmd) = tiller_session::commands::parse(&text) {
        let message = match cmd {
            Ok(cmd) => shared.sessions.run_command(&handle, cmd).await,
            Err(why) => Err(tiller_session::commands::CommandError::Refused(why)),
        };
        let message = match message {
            Ok(m) => m,
            Err(tiller_session::commands::CommandError::Refused(why)) => {
                return Err(Reply::Error(
                    RpcError::invalid_params(why).with_data(json!({ "field": "prompt" })),
                ));
            }
            Err(tiller_session::commands::CommandError::Session(e)) => {
                return Err(session_error(e));
            }
        };
        let note = map::agent_text(handle.id(), &message);
        let _ = shared.tx.send(Out::Raw(map::update_message(&note))).await;
        return Ok(StopReason::EndTurn);
    }
    // Origin comes from the ingress, never from `_meta`.
    let meta = req.meta.clone().map(Value::Object);
    let delivery = tiller_session::delivery::caller_meta(meta.as_ref(), "acp");
    // Cancelled before it was submitted: it never runs.
    if cancel.request.load(Ordering::Acquire) {
        return Err(Reply::Error(request_cancelled()));
    }
    if cancel.session.load(Ordering::Acquire) {
        return Ok(StopReason::Cancelled);
    }
    let (prompt, settled) = handle
        // Its one answer is its result: the admission commits with the
        // turn's first events.
        .submit(
            mine,
            (text, images),
            Origin::Interactive,
            delivery,
            tiller_session::Acknowledge::Terminal,
        )
        .await
        .map_err(session_error)?
        .map_err(refused)?;
    // Cancelled while it was being admitted.
    if cancel.any() {
        let _ = handle.withdraw(prompt);
    }
    // A dropped terminal port means the session actor failed; the
    // registry settles the prompt as `session_restarted`.
    let done = settled.await.map_err(|_| {
        let kind = tiller_core::ErrorKind::SessionRestarted;
        Reply::Error(
            RpcError::new(code::INTERNAL_ERROR, kind.default_message()).with_data(json!({
                "errorKind": kind.as_str(),
                "sessionId": handle.id().to_string(),
                "promptId": prompt.to_string(),
            })),
        )
    })?;
    map::prompt_result(handle.id(), prompt, &done.terminal).map_err(Reply::Error)
}

/// `_session/steering` (see `turn-lifecycle.md`, Steering).
async fn steering(shared: &Shared, raw: Value) -> Result<Json, Reply> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct SteerParams {
        session_id: String,
        prompt: Vec<agent_client_protocol_schema::v1::ContentBlock>,
        #[serde(rename = "_meta", default)]
        meta: Option<Value>,
    }
    let req: SteerParams = params(raw)?;
    let prompt_required = match req
        .meta
        .as_ref()
        .and_then(|m| m.get("steering"))
        .and_then(|s| s.get("idleBehavior"))
    {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) if s == "promptRequired" => true,
        Some(other) => {
            return Err(Reply::Error(
                RpcError::new(
                    code::INVALID_PARAMS,
                    format!(
                        "invalid params: unknown idleBehavior {other}; expected \"promptRequired\""
                    ),
                )
                .with_data(json!({ "field": "_meta.steering.idleBehavior" })),
            ));
        }
    };
    let handle = shared.open_attached(&req.session_id).await?;
    let answer = handle
        .steer(steer_text(&req.prompt)?, prompt_required)
        .await
        .map_err(session_error)?
        .map_err(refused)?;
    Ok(json(&map::steer_answer(&answer)))
}

/// A steer's text: what a prompt's content gives (refused the same way);
/// images cannot join a running turn.
fn steer_text(blocks: &[agent_client_protocol_schema::v1::ContentBlock]) -> Result<String, Reply> {
    let (text, images) = map::prompt_content(blocks).map_err(Reply::Error)?;
    if !images.is_empty() {
        return Err(Reply::Error(
            RpcError::invalid_params("a steer cannot carry images; send them as a prompt")
                .with_data(json!({ "field": "prompt" })),
        ));
    }
    Ok(text)
}

/// The answer to a request the client cancelled (`$/cancel_request`).
fn request_cancelled() -> RpcError {
    RpcError::new(code::REQUEST_CANCELLED, "request cancelled")
}

/// Formats ms since the epoch as RFC 3339 (UTC).
pub(crate) fn rfc3339(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A request id as a client may write it (read from its text, as the
    /// connection reads it: `-0` is a float there).
    fn id_text() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|i| i.to_string()),
            any::<u64>().prop_map(|u| u.to_string()),
            (0..3u8).prop_map(|i| i.to_string()),
            Just("-0".to_string()),
            Just("0.0".to_string()),
            Just("-0.0".to_string()),
            Just("1.0".to_string()),
            Just("1e0".to_string()),
            Just("18446744073709551616".to_string()),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| f.to_string()),
            "[0-9]{1,3}".prop_map(|s| format!("\"{s}\"")),
            Just("null".to_string()),
        ]
    }

    proptest! {
        /// Two ids are one request exactly when their JSON texts are the
        /// same, as when the keys were those texts.
        #[test]
        fn request_keys_are_equal_exactly_when_the_ids_texts_are(
            a in id_text(),
            b in id_text(),
        ) {
            let (a, b): (Value, Value) =
                (serde_json::from_str(&a).unwrap(), serde_json::from_str(&b).unwrap());
            // The texts, not the values: `-0` and `0.0` are equal floats.
            let (text_a, text_b) = (a.to_string(), b.to_string());
            prop_assert_eq!(
                RequestKey::of(&a) == RequestKey::of(&b),
                text_a == text_b,
                "{} {}", a, b
            );
        }
    }

    #[test]
    fn rfc3339_table() {
        for (ms, want) in [
            (0, "1970-01-01T00:00:00Z"),
            (951_782_400_000, "2000-02-29T00:00:00Z"),
            (1_796_000_000_000, "2026-11-30T00:53:20Z"),
        ] {
            assert_eq!(rfc3339(ms), want);
        }
    }
}
