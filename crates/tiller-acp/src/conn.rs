//! One ACP connection, whatever its transport.
//!
//! The connection is generic over channels: the transport feeds [`Frame`]s
//! in and writes the `String`s that come out, one JSON-RPC message each.
//! A single loop owns everything written to the client, so a prompt's
//! response always follows the updates of its turn, and a `session/load`
//! replay is never interleaved with live events.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use agent_client_protocol::schema::ProtocolVersion;
use agent_client_protocol::v1::schema::{
    AgentCapabilities, CancelNotification, CloseSessionRequest, CloseSessionResponse,
    Implementation, InitializeRequest, InitializeResponse, ListSessionsRequest,
    ListSessionsResponse, LoadSessionRequest, LoadSessionResponse, McpCapabilities,
    NewSessionRequest, NewSessionResponse, PromptCapabilities, PromptRequest, ResumeSessionRequest,
    ResumeSessionResponse, SessionCapabilities, SessionCloseCapabilities, SessionInfo,
    SessionListCapabilities, SessionResumeCapabilities, SetSessionConfigOptionRequest,
    SetSessionConfigOptionResponse,
};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tiller_core::{Origin, SessionId};
use tiller_session::{
    EventRecord, PromptRefused, SessionError, SessionHandle, Sessions, Subscriber, SubscriberId,
};
use tokio::sync::{Mutex, Notify, mpsc};

use crate::client::{Calls, ClientCaps};
use crate::jsonrpc::{self, Incoming, RpcError, code};
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
    /// Events buffered per connection before it is evicted as too slow.
    pub subscriber_queue: usize,
    /// Reported in `initialize`.
    pub version: String,
    /// Bound on connecting to each MCP server a client passes.
    pub mcp_connect_timeout: std::time::Duration,
}

/// Messages into the connection's writer loop.
enum Out {
    /// A live event from one of our subscriptions.
    Event(SubscriberId, Arc<EventRecord>),
    /// From now on, events of `session` come from subscription `sub`.
    Attached(SessionId, SubscriberId),
    /// Like `Attached`, but buffer live events until `Replayed`.
    Replaying(SessionId, SubscriberId),
    /// The stored history up to `last`, then the response.
    Replayed {
        session: SessionId,
        history: Vec<EventRecord>,
        last: u64,
        response: String,
    },
    /// A ready-made message.
    Raw(String),
}

/// Delivers a session's events into a connection's writer loop.
struct ConnSubscriber {
    id: SubscriberId,
    /// The client's file and terminal methods for this session.
    client: Option<Arc<dyn tiller_tools::ClientTools>>,
    tx: mpsc::Sender<Out>,
    /// Raised when the queue is full: the connection is then closed, so the
    /// client reconnects and reloads instead of silently missing events.
    overflow: Arc<Notify>,
}

impl Subscriber for ConnSubscriber {
    fn deliver(&self, event: &Arc<EventRecord>) -> bool {
        match self.tx.try_send(Out::Event(self.id, event.clone())) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.overflow.notify_one();
                false
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
    overflow: Arc<Notify>,
    /// Current subscription per attached session (guarded so two requests
    /// never attach the same session twice).
    attached: Mutex<HashMap<SessionId, (SessionHandle, SubscriberId)>>,
    /// Our requests to the client (`fs/*`, `terminal/*`).
    calls: Arc<Calls>,
}

/// Serves one connection until the transport closes (or the client is too
/// slow to keep up). `outgoing` receives one JSON-RPC message per item.
pub async fn serve(
    sessions: Sessions,
    config: AcpConfig,
    transport: &'static str,
    mut incoming: mpsc::Receiver<Frame>,
    outgoing: mpsc::Sender<String>,
) {
    metrics::gauge!("tiller_connections_active", "transport" => transport).increment(1.0);
    let (tx, mut rx) = mpsc::channel::<Out>(config.subscriber_queue.max(16));
    let (call_tx, mut call_rx) = mpsc::channel::<String>(64);
    let shared = Arc::new(Shared {
        sessions,
        config,
        tx,
        overflow: Arc::new(Notify::new()),
        attached: Mutex::new(HashMap::new()),
        calls: Calls::new(call_tx),
    });
    let mut writer = Writer::default();
    // Once the client stops sending, answer what is in flight, then end.
    let mut input_open = true;
    let inflight = Arc::new(());
    loop {
        if !input_open && Arc::strong_count(&inflight) == 1 && rx.is_empty() {
            break;
        }
        tokio::select! {
            frame = incoming.recv(), if input_open => match frame {
                Some(Frame::Text(text)) => match jsonrpc::parse(&text) {
                    Incoming::Response { id, result } => {
                        if let Some((session, request_id)) = writer.answered(&id) {
                            answer_permission(&shared, session, request_id, result);
                        } else if !shared.calls.answered(&id, result) {
                            tracing::debug!(?id, "response to no request of ours ignored");
                        }
                    }
                    other => dispatch(&shared, other, &inflight),
                },
                Some(Frame::TooLarge(n)) => too_large(&shared, n, &inflight),
                None => input_open = false,
            },
            Some(msg) = call_rx.recv() => {
                if outgoing.send(msg).await.is_err() {
                    break;
                }
            }
            // Wake up to re-check the drain condition.
            () = tokio::time::sleep(std::time::Duration::from_millis(50)), if !input_open => {}
            out = rx.recv() => {
                let Some(out) = out else { break };
                for msg in writer.on(out) {
                    if outgoing.send(msg).await.is_err() {
                        break;
                    }
                }
            }
            () = shared.overflow.notified() => {
                tracing::warn!(transport, "ACP client too slow; closing its connection");
                break;
            }
        }
    }
    shared.calls.close();
    let attached = std::mem::take(&mut *shared.attached.lock().await);
    for (handle, sub) in attached.into_values() {
        handle.unsubscribe(sub);
    }
    metrics::gauge!("tiller_connections_active", "transport" => transport).decrement(1.0);
}

/// The writer loop's view: which subscription is current per session,
/// what is buffered during a replay, and the permission requests we sent.
#[derive(Default)]
struct Writer {
    current: HashMap<SessionId, SubscriberId>,
    buffering: HashMap<SessionId, Vec<Arc<EventRecord>>>,
    /// Our JSON-RPC id -> (session, permission request id).
    asked: HashMap<String, (SessionId, String)>,
    /// Counter for our request ids.
    next_request: u64,
}

impl Writer {
    fn on(&mut self, out: Out) -> Vec<String> {
        match out {
            Out::Raw(s) => vec![s],
            Out::Attached(session, sub) => {
                self.current.insert(session, sub);
                vec![]
            }
            Out::Replaying(session, sub) => {
                self.current.insert(session, sub);
                self.buffering.insert(session, Vec::new());
                vec![]
            }
            Out::Event(sub, rec) => {
                if self.current.get(&rec.session) != Some(&sub) {
                    return vec![]; // from a replaced subscription
                }
                if let Some(buf) = self.buffering.get_mut(&rec.session) {
                    buf.push(rec);
                    return vec![];
                }
                self.live(&rec)
            }
            Out::Replayed {
                session,
                history,
                last,
                response,
            } => {
                let mut msgs: Vec<String> = history
                    .iter()
                    .filter(|e| e.seq <= last)
                    .filter_map(map::session_update)
                    .map(|n| update_message(&n))
                    .collect();
                for rec in self.buffering.remove(&session).unwrap_or_default() {
                    if rec.seq > last {
                        msgs.extend(self.live(&rec));
                    }
                }
                if !response.is_empty() {
                    msgs.push(response);
                }
                msgs
            }
        }
    }
}

impl Writer {
    /// What a live event becomes for this client: updates, extension
    /// notifications, and permission requests (or their withdrawal).
    fn live(&mut self, rec: &EventRecord) -> Vec<String> {
        let mut msgs = live_messages(rec);
        if let Some((request_id, params)) = map::permission_request(rec) {
            self.next_request += 1;
            let id = format!("tiller-{}", self.next_request);
            msgs.push(jsonrpc::request(&id, "session/request_permission", params));
            self.asked.insert(id, (rec.session, request_id));
        }
        if let tiller_session::EventBody::PermissionResolved { request_id, .. } = &rec.body {
            // Answered elsewhere (or the turn ended): withdraw our request.
            let ours: Vec<String> = self
                .asked
                .iter()
                .filter(|(_, (s, r))| *s == rec.session && r == request_id)
                .map(|(id, _)| id.clone())
                .collect();
            for id in ours {
                self.asked.remove(&id);
                msgs.push(jsonrpc::notification(
                    "$/cancel_request",
                    json!({ "requestId": id }),
                ));
            }
        }
        msgs
    }

    /// A client's answer to one of our requests.
    fn answered(&mut self, id: &Value) -> Option<(SessionId, String)> {
        self.asked.remove(id.as_str()?)
    }
}

fn update_message(n: &agent_client_protocol::v1::schema::SessionNotification) -> String {
    jsonrpc::notification(
        "session/update",
        serde_json::to_value(n).expect("serialize"),
    )
}

fn live_messages(rec: &EventRecord) -> Vec<String> {
    let mut msgs = Vec::new();
    if let Some(n) = map::session_update(rec) {
        msgs.push(update_message(&n));
    }
    if let Some((method, params)) = map::extension_notification(rec) {
        msgs.push(jsonrpc::notification(method, params));
    }
    msgs
}

fn too_large(shared: &Arc<Shared>, n: usize, inflight: &Arc<()>) {
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

fn dispatch(shared: &Arc<Shared>, msg: Incoming, inflight: &Arc<()>) {
    match msg {
        Incoming::Invalid { id, error } => send_raw(shared, jsonrpc::error(&id, &error), inflight),
        Incoming::Response { .. } => {}
        Incoming::Notification { method, params } => {
            if method == "session/cancel" {
                let shared = shared.clone();
                tokio::spawn(async move {
                    if let Ok(p) = serde_json::from_value::<CancelNotification>(params)
                        && let Some(id) = SessionId::parse(&p.session_id.0)
                        && let Ok(h) = shared.sessions.open(id).await
                    {
                        let _ = h.cancel();
                    }
                });
            }
            // Other notifications are ignored, as JSON-RPC asks.
        }
        Incoming::Request { id, method, params } => {
            let shared = shared.clone();
            let token = inflight.clone();
            tokio::spawn(async move {
                let _inflight = token;
                let msg = match handle(&shared, &method, params).await {
                    Ok(result) => jsonrpc::response(&id, result),
                    Err(Reply::Error(e)) => jsonrpc::error(&id, &e),
                    Err(Reply::Replay {
                        session,
                        history,
                        last,
                        result,
                    }) => {
                        let _ = shared
                            .tx
                            .send(Out::Replayed {
                                session,
                                history,
                                last,
                                response: jsonrpc::response(&id, result),
                            })
                            .await;
                        return;
                    }
                };
                let _ = shared.tx.send(Out::Raw(msg)).await;
            });
        }
    }
}

fn send_raw(shared: &Arc<Shared>, msg: String, inflight: &Arc<()>) {
    let tx = shared.tx.clone();
    let token = inflight.clone();
    tokio::spawn(async move {
        let _ = tx.send(Out::Raw(msg)).await;
        drop(token);
    });
}

/// A request's answer other than a plain result.
enum Reply {
    Error(RpcError),
    /// `session/load`: the history goes out before the response.
    Replay {
        session: SessionId,
        history: Vec<EventRecord>,
        last: u64,
        result: Value,
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
        other => Reply::Error(RpcError::new(code::INTERNAL_ERROR, other.to_string())),
    }
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
        PromptRefused::BadDelivery(why) => Reply::Error(
            RpcError::new(code::INVALID_PARAMS, format!("invalid params: {why}"))
                .with_data(json!({ "field": "_meta.tiller.delivery.webhook" })),
        ),
    }
}

fn to_value<T: serde::Serialize>(v: T) -> Value {
    serde_json::to_value(v).expect("ACP types serialize")
}

impl Shared {
    /// Subscribes this connection to a session unless it already is.
    async fn attach(&self, handle: &SessionHandle) -> Result<(), Reply> {
        let mut attached = self.attached.lock().await;
        if attached.contains_key(&handle.id()) {
            return Ok(());
        }
        let sub = self.sessions.subscriber_id();
        let _ = self.tx.send(Out::Attached(handle.id(), sub)).await;
        handle
            .subscribe(sub, Box::new(self.subscriber(sub, handle.id())))
            .await
            .map_err(session_error)?;
        attached.insert(handle.id(), (handle.clone(), sub));
        Ok(())
    }

    /// Subscribes afresh (replacing any earlier subscription) and returns
    /// the last sequence number the replay must cover.
    async fn attach_for_replay(&self, handle: &SessionHandle) -> Result<u64, Reply> {
        let mut attached = self.attached.lock().await;
        let sub = self.sessions.subscriber_id();
        let _ = self.tx.send(Out::Replaying(handle.id(), sub)).await;
        let last = handle
            .subscribe(sub, Box::new(self.subscriber(sub, handle.id())))
            .await
            .map_err(session_error)?
            .last_seq;
        if let Some((old, old_sub)) = attached.insert(handle.id(), (handle.clone(), sub)) {
            old.unsubscribe(old_sub);
        }
        Ok(last)
    }

    /// Gives the session the MCP servers a request passed (none: keeps
    /// what it has).
    async fn connect_mcp(
        &self,
        handle: &SessionHandle,
        servers: Vec<tiller_tools::McpServerConfig>,
    ) -> Result<(), Reply> {
        if !servers.is_empty() {
            handle
                .set_mcp(servers, self.config.mcp_connect_timeout)
                .await
                .map_err(session_error)?;
        }
        Ok(())
    }

    fn subscriber(&self, id: SubscriberId, session: SessionId) -> ConnSubscriber {
        ConnSubscriber {
            id,
            client: self.calls.tools_for(session),
            tx: self.tx.clone(),
            overflow: self.overflow.clone(),
        }
    }

    async fn open(&self, raw: &str) -> Result<SessionHandle, Reply> {
        let id = session_id(raw)?;
        self.sessions.open(id).await.map_err(session_error)
    }
}

async fn handle(shared: &Shared, method: &str, raw: Value) -> Result<Value, Reply> {
    match method {
        "initialize" => {
            shared.calls.set_caps(ClientCaps::from_initialize(&raw));
            let _req: InitializeRequest = params(raw)?;
            let caps = AgentCapabilities::new()
                .load_session(true)
                .prompt_capabilities(PromptCapabilities::new())
                .mcp_capabilities(McpCapabilities::new().http(true))
                .session_capabilities(
                    SessionCapabilities::new()
                        .list(SessionListCapabilities::new())
                        .resume(SessionResumeCapabilities::new())
                        .close(SessionCloseCapabilities::new()),
                )
                .meta(
                    json!({ "steering": { "supported": true } })
                        .as_object()
                        .cloned(),
                );
            let mut res = to_value(
                InitializeResponse::new(ProtocolVersion::V1)
                    .agent_capabilities(caps)
                    .agent_info(Implementation::new("tiller", shared.config.version.clone())),
            );
            res["_meta"] = json!({
                "tiller": { "version": shared.config.version, "promptQueueing": true },
                "steering": { "supported": true },
            });
            Ok(res)
        }
        "session/new" => {
            let req: NewSessionRequest = params(raw)?;
            if !req.cwd.is_absolute() {
                return Err(Reply::Error(
                    RpcError::invalid_params(format!(
                        "cwd must be an absolute path; got {}",
                        req.cwd.display()
                    ))
                    .with_data(json!({ "field": "cwd" })),
                ));
            }
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
            shared.attach(&handle).await?;
            let options = handle.options().await.map_err(session_error)?;
            Ok(to_value(
                NewSessionResponse::new(handle.id().to_string())
                    .config_options(map::config_options(&options)),
            ))
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
            let handle = shared.open(&req.session_id.0).await?;
            shared.attach(&handle).await?;
            let options = handle
                .set_option(req.config_id.0.to_string(), value)
                .await
                .map_err(session_error)?
                .map_err(|e| {
                    Reply::Error(
                        RpcError::invalid_params(e).with_data(json!({ "field": "configId/value" })),
                    )
                })?;
            Ok(to_value(SetSessionConfigOptionResponse::new(
                map::config_options(&options),
            )))
        }
        "session/load" => {
            let req: LoadSessionRequest = params(raw)?;
            let mcp = map::mcp_servers(&req.mcp_servers).map_err(Reply::Error)?;
            let handle = shared.open(&req.session_id.0).await?;
            shared.connect_mcp(&handle, mcp).await?;
            let last = shared.attach_for_replay(&handle).await?;
            let history = match shared
                .sessions
                .events_after(handle.id(), 0, last as usize)
                .await
            {
                Ok(h) => h,
                Err(e) => {
                    // Release the buffered replay before answering the error.
                    let _ = shared
                        .tx
                        .send(Out::Replayed {
                            session: handle.id(),
                            history: Vec::new(),
                            last,
                            response: String::new(),
                        })
                        .await;
                    return Err(session_error(e));
                }
            };
            Err(Reply::Replay {
                session: handle.id(),
                history,
                last,
                result: to_value(LoadSessionResponse::new()),
            })
        }
        "session/resume" => {
            let req: ResumeSessionRequest = params(raw)?;
            let mcp = map::mcp_servers(&req.mcp_servers).map_err(Reply::Error)?;
            let handle = shared.open(&req.session_id.0).await?;
            shared.connect_mcp(&handle, mcp).await?;
            shared.attach(&handle).await?;
            Ok(to_value(ResumeSessionResponse::new()))
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
            Ok(to_value(
                ListSessionsResponse::new(sessions).next_cursor(page.next_cursor),
            ))
        }
        "session/close" => {
            let req: CloseSessionRequest = params(raw)?;
            let handle = shared.open(&req.session_id.0).await?;
            if let Some((h, sub)) = shared.attached.lock().await.remove(&handle.id()) {
                h.unsubscribe(sub);
            }
            handle.close().await.map_err(session_error)?;
            Ok(to_value(CloseSessionResponse::new()))
        }
        "session/prompt" => {
            let req: PromptRequest = params(raw)?;
            let handle = shared.open(&req.session_id.0).await?;
            shared.attach(&handle).await?;
            let text = map::prompt_text(&req.prompt);
            // Origin comes from the ingress, never from `_meta`.
            let meta = req.meta.clone().map(Value::Object);
            let delivery = tiller_session::delivery::caller_meta(meta.as_ref(), "acp");
            let (prompt, settled) = handle
                .prompt_with(text, Origin::Interactive, delivery)
                .await
                .map_err(session_error)?
                .map_err(refused)?;
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
        "_session/steering" => steering(shared, raw).await,
        other => Err(Reply::Error(RpcError::new(
            code::METHOD_NOT_FOUND,
            format!("method not found: {other}"),
        ))),
    }
}

/// `_session/steering` (see `turn-lifecycle.md`, Steering).
async fn steering(shared: &Shared, raw: Value) -> Result<Value, Reply> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct SteerParams {
        session_id: String,
        prompt: Vec<agent_client_protocol::v1::schema::ContentBlock>,
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
    let handle = shared.open(&req.session_id).await?;
    shared.attach(&handle).await?;
    let answer = handle
        .steer(map::prompt_text(&req.prompt), prompt_required)
        .await
        .map_err(session_error)?
        .map_err(refused)?;
    Ok(map::steer_answer(&answer))
}

/// Formats ms since the epoch as RFC 3339 (UTC).
fn rfc3339(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

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
