//! Engines backed by a real model over HTTP: OpenAI-compatible Chat
//! Completions and Anthropic Messages. One turn is a loop of model calls:
//! stream a response, hand its tool calls to the session's pipeline, add
//! the results (and any steers, at this boundary) to the conversation, and
//! call the model again until it stops.

mod anthropic;
pub mod instructions;
mod openai;
mod repo;

use std::collections::VecDeque;
use std::time::Duration;

use eventsource_stream::Eventsource;
use futures::StreamExt;
use tiller_core::{ErrorKind, SteerId, SteerReceipt, StopReason, TurnId};
use tokio::sync::mpsc;

use crate::{
    CallRecord, CompactionPhase, Engine, EngineHandle, EngineInput, EngineSignal, Message,
    PreparedPrompt, ScriptError, SignalKind, SignalSink, ToolCall, ToolKind, TurnContext, Update,
};

/// Which wire format an engine speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    /// OpenAI Chat Completions, and compatible local servers.
    OpenAi,
    /// Anthropic Messages.
    Anthropic,
}

impl Provider {
    /// Parses `openai` or `anthropic`.
    pub fn parse(s: &str) -> Option<Provider> {
        match s {
            "openai" => Some(Provider::OpenAi),
            "anthropic" => Some(Provider::Anthropic),
            _ => None,
        }
    }

    /// The default `base_url`.
    pub fn default_base_url(self) -> &'static str {
        match self {
            Provider::OpenAi => "https://api.openai.com/v1",
            Provider::Anthropic => "https://api.anthropic.com",
        }
    }

    fn endpoint(self, base: &str) -> String {
        let base = base.trim_end_matches('/');
        match self {
            Provider::OpenAi => format!("{base}/chat/completions"),
            Provider::Anthropic => format!("{base}/v1/messages"),
        }
    }
}

/// One configured model engine (`[engine.<name>]`).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The engine's name in config, `session/new` and the API.
    pub name: String,
    pub provider: Provider,
    /// The API root, e.g. `http://localhost:11434/v1` for Ollama.
    pub base_url: String,
    /// The default model.
    pub model: String,
    /// Other models a session may switch to.
    pub models: Vec<String>,
    /// The environment variable holding the API key (none: no key sent).
    pub api_key_env: Option<String>,
    /// Most output tokens per model call.
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    /// Replaces the default instructions ([`instructions::DEFAULT`]).
    pub system_prompt: Option<String>,
    /// Added after the instructions (default or replaced).
    pub system_prompt_append: Option<String>,
    /// Bound on connecting and on waiting for the response headers, and on
    /// each gap between streamed chunks.
    pub request_timeout: Duration,
    /// Retries of a call that failed before its first token (429, 5xx,
    /// connection errors).
    pub max_retries: u32,
    /// The first retry's delay; each later one doubles it.
    pub retry_base: Duration,
    /// Most model calls in one turn (then the turn ends `max_turn_requests`).
    pub max_requests_per_turn: u32,
    /// The most conversation text (chars) sent with a call: older turns
    /// are left out, with a note. The session keeps four times this.
    pub context_chars: usize,
    /// The model's context window in tokens (reported with usage).
    pub context_window: u64,
    /// The share of `context_window` the conversation may fill before the
    /// engine compacts it (0: never by itself; `/compact` still does).
    pub compact_at: f64,
    /// What its tokens cost, if known.
    pub prices: Option<crate::Prices>,
}

/// Redirects followed only within the origin they start from (at most
/// five): the HTTP client drops on a redirect elsewhere only the headers
/// it knows (`Authorization`), and would hand Anthropic's `x-api-key` to
/// another host.
pub fn same_origin_redirects() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let first = attempt.previous().first().map(|u| u.origin());
        if attempt.previous().len() > 5 || first != Some(attempt.url().origin()) {
            attempt.stop()
        } else {
            attempt.follow()
        }
    })
}

/// A model engine (see the module docs).
pub struct ModelEngine {
    cfg: std::sync::Arc<ModelConfig>,
    client: reqwest::Client,
}

impl ModelEngine {
    pub fn new(cfg: ModelConfig) -> Self {
        let client = reqwest::Client::builder()
            .connect_timeout(cfg.request_timeout)
            .redirect(same_origin_redirects())
            .build()
            .expect("the HTTP client builds with static settings");
        Self {
            cfg: std::sync::Arc::new(cfg),
            client,
        }
    }
}

impl Engine for ModelEngine {
    fn name(&self) -> &str {
        &self.cfg.name
    }

    fn usage_basis(&self) -> crate::UsageBasis {
        crate::UsageBasis {
            context_window: self.cfg.context_window,
            prices: self.cfg.prices.clone(),
        }
    }

    fn prepare(&self, text: &str) -> Result<PreparedPrompt, ScriptError> {
        Ok(PreparedPrompt {
            text: text.to_owned(),
            script: None,
            images: Vec::new(),
        })
    }

    fn accepts_images(&self) -> bool {
        true
    }

    fn switches(&self) -> Vec<(&'static str, &'static str, bool)> {
        match self.cfg.provider {
            Provider::Anthropic => vec![("thinking", "Extended thinking", false)],
            Provider::OpenAi => Vec::new(),
        }
    }

    fn start(
        &self,
        turn: TurnId,
        prompt: PreparedPrompt,
        ctx: TurnContext,
        sink: SignalSink,
    ) -> EngineHandle {
        let (tx, rx) = mpsc::unbounded_channel();
        let model = ctx
            .model
            .clone()
            .filter(|m| self.models().contains(m))
            .unwrap_or_else(|| self.cfg.model.clone());
        let run = Run {
            turn,
            sink,
            rx,
            cfg: self.cfg.clone(),
            client: self.client.clone(),
            model,
            ctx,
            steers: VecDeque::new(),
            partial: String::new(),
            system: String::new(),
            turn_start: 0,
            compactions: 0,
            input_tokens: 0,
        };
        EngineHandle::new(tx, tokio::spawn(run.play(prompt.text, prompt.images)))
    }

    fn uses_directory(&self) -> bool {
        true
    }

    /// Its tool calls run in the session's pipeline; what it keeps of a
    /// cancelled turn (the text streamed so far) goes into the
    /// conversation before its last word, which the next turn waits for.
    fn acts_through_session(&self) -> bool {
        true
    }

    fn models(&self) -> Vec<String> {
        let mut m = vec![self.cfg.model.clone()];
        for x in &self.cfg.models {
            if !m.contains(x) {
                m.push(x.clone());
            }
        }
        m
    }
}

/// `T` read from a JSON object only (serde reads a struct from an array
/// too, by position, which the general path does not).
pub(super) struct Obj<T>(pub(super) T);

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for Obj<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Object<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for Object<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(Object(std::marker::PhantomData)).map(Obj)
    }
}

/// Content streamed by a response.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Delta {
    Text(String),
    Thought(String),
    /// Part of a tool call arrived (the response has begun).
    ToolProgress,
}

/// Why a response stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    EndTurn,
    MaxTokens,
    Refusal,
    ToolUse,
}

/// A tool call as streamed: its arguments are JSON text, maybe in pieces.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct RawCall {
    pub id: String,
    pub name: String,
    pub args: String,
}

/// A complete response.
#[derive(Debug, PartialEq)]
pub(crate) struct Finish {
    pub stop: Stop,
    pub calls: Vec<RawCall>,
    /// Reasoning blocks to send back with the reply (Anthropic).
    pub reasoning: Vec<serde_json::Value>,
    /// Input and output tokens.
    pub usage: (u64, u64),
}

/// A provider's streaming parser: fed one server-sent event at a time.
pub(crate) trait Parser: Send {
    /// Takes one event; `Err` is an error the model reported mid-stream.
    fn event(&mut self, event: &str, data: &str) -> Result<Vec<Delta>, String>;
    /// The response, once the stream said it is complete (`ended`: the
    /// byte stream ended too).
    fn finish(&mut self, ended: bool) -> Option<Finish>;
}

fn parser(p: Provider) -> Box<dyn Parser> {
    match p {
        Provider::OpenAi => Box::<openai::OpenAiParser>::default(),
        Provider::Anthropic => Box::<anthropic::AnthropicParser>::default(),
    }
}

/// A provider's error object as one line.
fn error_text(err: &serde_json::Value) -> String {
    let kind = err["type"]
        .as_str()
        .or(err["code"].as_str())
        .unwrap_or("error");
    let msg = err["message"].as_str().unwrap_or("no message");
    format!("the model reported an error: {kind}: {msg}")
}

/// A model call's complete response.
struct Response {
    text: String,
    stop: Stop,
    calls: Vec<CallRecord>,
    reasoning: Vec<serde_json::Value>,
}

/// Why a model call did not produce a response.
enum CallError {
    /// The session told us to stop.
    Aborted,
    /// Failed before the first token: may be retried.
    Retryable(String, Option<Duration>),
    /// Failed for good.
    Fatal(String),
}

/// One playing turn.
struct Run {
    turn: TurnId,
    sink: SignalSink,
    rx: mpsc::UnboundedReceiver<EngineInput>,
    cfg: std::sync::Arc<ModelConfig>,
    client: reqwest::Client,
    model: String,
    ctx: TurnContext,
    /// Text of the model call in progress (kept when the call breaks off:
    /// the user saw it).
    partial: String,
    /// Steers received and not yet in the conversation.
    steers: VecDeque<(SteerId, String)>,
    /// The system text of this turn's calls.
    system: String,
    /// Where this turn's messages begin in the conversation: what comes
    /// before is what a compaction summarizes.
    turn_start: usize,
    /// Compactions this turn (they are named by it).
    compactions: u32,
    /// Input tokens of the last model call (0: none since a compaction).
    input_tokens: u64,
}

/// What a model call is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Purpose {
    /// The turn's own: its text streams to the user, the tools are offered.
    Turn,
    /// A compaction's summary: nothing shown, no tools.
    Summary,
}

/// The command that compacts the conversation now.
pub const COMPACT_COMMAND: &str = "/compact";

/// The engine was told to abort (or the session went away).
struct Aborted;

impl Run {
    fn emit(&self, kind: SignalKind) {
        (self.sink)(EngineSignal {
            turn: self.turn,
            kind,
        });
    }

    fn input(
        &mut self,
        input: Option<EngineInput>,
    ) -> Result<Option<Vec<crate::ToolResult>>, Aborted> {
        match input {
            Some(EngineInput::Steer { id, text }) => {
                self.steers.push_back((id, text));
                Ok(None)
            }
            Some(EngineInput::ToolResults(r)) => Ok(Some(r)),
            Some(EngineInput::Permission { .. } | EngineInput::File { .. }) => Ok(None),
            Some(EngineInput::Abort) | None => Err(Aborted),
        }
    }

    /// Runs `fut` while taking in steers (results outside a batch wait are
    /// ignored); `Err` on abort.
    async fn wait<F: Future>(&mut self, fut: F) -> Result<F::Output, Aborted> {
        tokio::pin!(fut);
        loop {
            tokio::select! {
                out = &mut fut => return Ok(out),
                input = self.rx.recv() => { self.input(input)?; }
            }
        }
    }

    async fn play(mut self, prompt: String, images: Vec<crate::Image>) {
        let host = self.ctx.host.clone();
        let Ok(env) = self.wait(instructions::Environment::gather(&host)).await else {
            // Cancelled before anything was asked: nothing to keep (its
            // `git status` is killed as it is dropped).
            self.emit(SignalKind::Result(StopReason::Cancelled));
            self.emit(SignalKind::Idle);
            return;
        };
        self.system = instructions::system_text(
            self.cfg.system_prompt.as_deref(),
            self.cfg.system_prompt_append.as_deref(),
            &env,
        );
        self.ctx.conversation.repair();
        self.ctx
            .conversation
            .trim(self.cfg.context_chars.saturating_mul(4));
        self.turn_start = self.ctx.conversation.len();
        if prompt.trim() == COMPACT_COMMAND && images.is_empty() {
            return self.compact_now().await;
        }
        self.ctx.conversation.push(Message::User { text: prompt });
        for i in images {
            self.ctx.conversation.push(Message::Image(i));
        }
        let outcome = self.turn_loop().await;
        if outcome.is_err() && !self.partial.is_empty() {
            self.ctx.conversation.push(Message::Assistant {
                text: std::mem::take(&mut self.partial),
                calls: Vec::new(),
            });
        }
        match outcome {
            Ok(stop) => {
                self.emit(SignalKind::Result(stop));
                self.emit(SignalKind::Idle);
            }
            Err(None) => {
                self.emit(SignalKind::Result(StopReason::Cancelled));
                self.emit(SignalKind::Idle);
            }
            Err(Some(message)) => {
                self.emit(SignalKind::Failed(
                    ErrorKind::ModelStreamInterrupted,
                    message,
                ));
            }
        }
    }

    /// A `/compact` turn: the whole conversation so far is summarized.
    async fn compact_now(mut self) {
        let outcome = self.compact(self.turn_start).await;
        match outcome {
            Ok(done) => {
                if !done {
                    self.emit(SignalKind::Update(Update::Text(
                        "Nothing to compact yet: the conversation is empty.".into(),
                    )));
                }
                self.emit(SignalKind::Result(StopReason::EndTurn));
                self.emit(SignalKind::Idle);
            }
            Err(None) => {
                self.emit(SignalKind::Result(StopReason::Cancelled));
                self.emit(SignalKind::Idle);
            }
            Err(Some(why)) => self.emit(SignalKind::Failed(
                ErrorKind::ModelStreamInterrupted,
                format!("the conversation could not be compacted: {why}"),
            )),
        }
    }

    /// Whether the conversation has outgrown `compact_at` of the window:
    /// by the last call's input tokens, or by its size (4 chars a token).
    fn over_threshold(&self) -> bool {
        if self.cfg.compact_at <= 0.0 {
            return false;
        }
        let estimate = ((self.ctx.conversation.chars() + self.system.len()) / 4) as u64;
        let used = estimate.max(self.input_tokens);
        used as f64 >= self.cfg.compact_at * self.cfg.context_window as f64
    }

    /// Replaces the first `upto` messages with the model's summary of
    /// them. `Ok(false)`: nothing to summarize. `Err(None)`: aborted.
    /// `Err(Some(why))`: the summary call failed (the conversation is
    /// unchanged, and the window applies).
    async fn compact(&mut self, upto: usize) -> Result<bool, Option<String>> {
        if upto == 0 {
            return Ok(false);
        }
        self.compactions += 1;
        let id = format!("{}-{}", self.turn, self.compactions);
        let phase = |phase| {
            SignalKind::Update(Update::Compaction {
                id: id.clone(),
                phase,
            })
        };
        self.emit(phase(CompactionPhase::Started));
        let older = self.ctx.conversation.snapshot();
        let mut msgs = crate::window(&older[..upto.min(older.len())], self.cfg.context_chars);
        msgs.push(Message::User {
            text: instructions::COMPACTION_REQUEST.into(),
        });
        match self.call_with_retries(Purpose::Summary, Some(msgs)).await {
            Ok(r) if !r.text.trim().is_empty() => {
                let summary = r.text.trim().to_owned();
                self.ctx
                    .conversation
                    .compact(upto, instructions::summary_message(&summary));
                self.turn_start = self.turn_start + 1 - upto;
                self.input_tokens = 0;
                metrics::counter!("tiller_compactions_total", "engine" => self.cfg.name.clone(), "outcome" => "completed").increment(1);
                self.emit(phase(CompactionPhase::Completed(summary)));
                Ok(true)
            }
            Ok(_) => self.compaction_failed(&id, "the model returned an empty summary".into()),
            Err(None) => {
                metrics::counter!("tiller_compactions_total", "engine" => self.cfg.name.clone(), "outcome" => "cancelled").increment(1);
                self.emit(phase(CompactionPhase::Cancelled));
                Err(None)
            }
            Err(Some(why)) => self.compaction_failed(&id, why),
        }
    }

    fn compaction_failed(&mut self, id: &str, why: String) -> Result<bool, Option<String>> {
        metrics::counter!("tiller_compactions_total", "engine" => self.cfg.name.clone(), "outcome" => "failed").increment(1);
        self.emit(SignalKind::Update(Update::Compaction {
            id: id.to_owned(),
            phase: CompactionPhase::Failed(format!(
                "{why}; older turns are left out of the context window instead"
            )),
        }));
        Err(Some(why))
    }

    /// Runs model calls until the model stops. `Err(None)` is an abort,
    /// `Err(Some(m))` a failure.
    async fn turn_loop(&mut self) -> Result<StopReason, Option<String>> {
        let mut requests = 0;
        let mut compacted = false;
        loop {
            // A model boundary: steers received so far join the conversation.
            while let Ok(input) = self.rx.try_recv() {
                if self.input(Some(input)).map_err(|_| None)?.is_some() {
                    tracing::debug!(session = %self.ctx.host.session, "tool results outside a batch ignored");
                }
            }
            for (id, text) in std::mem::take(&mut self.steers) {
                self.ctx.conversation.push(Message::User { text });
                self.emit(SignalKind::SteerReceipt(id, SteerReceipt::Consumed));
            }
            if requests == self.cfg.max_requests_per_turn {
                return Ok(StopReason::MaxTurnRequests);
            }
            // Once a turn: a failed compaction falls back to the window.
            if !compacted && self.over_threshold() {
                compacted = true;
                if let Err(None) = self.compact(self.turn_start).await {
                    return Err(None);
                }
            }
            requests += 1;
            let Response {
                text,
                stop,
                calls,
                reasoning,
            } = self.call_with_retries(Purpose::Turn, None).await?;
            let calls: Vec<CallRecord> = match stop {
                // A cut-off response's calls may be incomplete: none runs.
                Stop::MaxTokens | Stop::Refusal => Vec::new(),
                _ => calls,
            };
            if !reasoning.is_empty() {
                self.ctx
                    .conversation
                    .push(Message::Reasoning { blocks: reasoning });
            }
            self.ctx.conversation.push(Message::Assistant {
                text,
                calls: calls.clone(),
            });
            if calls.is_empty() {
                match stop {
                    Stop::MaxTokens => return Ok(StopReason::MaxTokens),
                    Stop::Refusal => return Ok(StopReason::Refusal),
                    // The user steered while the model was finishing: the
                    // steer still reaches the model.
                    _ if !self.steers.is_empty() => continue,
                    _ => return Ok(StopReason::EndTurn),
                }
            }
            let batch = calls
                .iter()
                .map(|c| ToolCall {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    kind: self.kind_of(&c.name),
                    input: c.input.clone(),
                    simulated: None,
                })
                .collect();
            self.emit(SignalKind::ToolBatch(batch));
            let results = loop {
                let input = self.rx.recv().await;
                if let Some(r) = self.input(input).map_err(|_| None)? {
                    break r;
                }
            };
            for r in results {
                self.ctx.conversation.push(Message::ToolResult {
                    id: r.id,
                    ok: r.output.ok,
                    output: r.output.output,
                });
            }
        }
    }

    fn kind_of(&self, name: &str) -> ToolKind {
        self.ctx
            .tools
            .iter()
            .find(|t| t.name == name)
            .map_or(ToolKind::Other, |t| t.kind)
    }

    /// One model call, retried on 429/5xx/connection errors before its first
    /// token.
    async fn call_with_retries(
        &mut self,
        purpose: Purpose,
        msgs: Option<Vec<Message>>,
    ) -> Result<Response, Option<String>> {
        let mut attempt = 0;
        loop {
            match self.call(purpose, msgs.as_deref()).await {
                Ok(done) => {
                    metrics::counter!("tiller_model_requests_total", "engine" => self.cfg.name.clone(), "outcome" => "ok").increment(1);
                    return Ok(done);
                }
                Err(CallError::Aborted) => return Err(None),
                Err(CallError::Retryable(why, after)) if attempt < self.cfg.max_retries => {
                    attempt += 1;
                    let delay = after
                        .unwrap_or(self.cfg.retry_base * 2u32.saturating_pow(attempt - 1))
                        .min(Duration::from_secs(60));
                    tracing::warn!(session = %self.ctx.host.session, turn = %self.turn, attempt, delay_ms = delay.as_millis() as u64, why = %self.redact(&why), "model call failed; retrying");
                    metrics::counter!("tiller_model_retries_total", "engine" => self.cfg.name.clone()).increment(1);
                    self.wait(tokio::time::sleep(delay))
                        .await
                        .map_err(|_| None)?;
                }
                Err(CallError::Retryable(why, _) | CallError::Fatal(why)) => {
                    metrics::counter!("tiller_model_requests_total", "engine" => self.cfg.name.clone(), "outcome" => "error").increment(1);
                    let why = self.redact(&why);
                    tracing::warn!(session = %self.ctx.host.session, turn = %self.turn, why = %why, "model call failed");
                    return Err(Some(why));
                }
            }
        }
    }

    /// Never lets the key out, whatever a server echoes back.
    fn redact(&self, s: &str) -> String {
        match self.key() {
            Some(Ok(k)) if k.len() >= 4 => s.replace(&k, "[redacted]"),
            _ => s.to_owned(),
        }
    }

    fn key(&self) -> Option<Result<String, String>> {
        let var = self.cfg.api_key_env.as_ref()?;
        Some(match std::env::var(var) {
            Ok(k) if !k.trim().is_empty() => Ok(k.trim().to_owned()),
            _ => Err(format!(
                "engine `{}`: the environment variable {var} (engine.{}.api_key_env) is not set",
                self.cfg.name, self.cfg.name
            )),
        })
    }

    /// One model call: the turn's (the conversation's window, the tools)
    /// or a summary's (`msgs`, no tools).
    async fn call(
        &mut self,
        purpose: Purpose,
        msgs: Option<&[Message]>,
    ) -> Result<Response, CallError> {
        let turn_msgs;
        let (system, msgs, tools) = match (purpose, msgs) {
            (Purpose::Summary, Some(m)) => (instructions::COMPACTION, m, &[][..]),
            _ => {
                turn_msgs =
                    crate::window(&self.ctx.conversation.snapshot(), self.cfg.context_chars);
                (self.system.as_str(), &turn_msgs[..], &self.ctx.tools[..])
            }
        };
        let show = purpose == Purpose::Turn;
        let body = match self.cfg.provider {
            Provider::OpenAi => openai::body(&self.cfg, &self.model, system, msgs, tools),
            Provider::Anthropic => {
                let thinking = self
                    .ctx
                    .switches
                    .iter()
                    .any(|(id, on)| id == "thinking" && *on);
                anthropic::body(&self.cfg, &self.model, system, msgs, tools, thinking)
            }
        };
        let mut req = self
            .client
            .post(self.cfg.provider.endpoint(&self.cfg.base_url))
            .header("accept", "text/event-stream")
            .json(&body);
        match self.key() {
            Some(Ok(key)) => {
                req = match self.cfg.provider {
                    Provider::OpenAi => req.bearer_auth(key),
                    Provider::Anthropic => req.header("x-api-key", key),
                };
            }
            Some(Err(why)) => return Err(CallError::Fatal(why)),
            None => {}
        }
        if self.cfg.provider == Provider::Anthropic {
            req = req.header("anthropic-version", "2023-06-01");
        }
        let timeout = self.cfg.request_timeout;
        let resp = self
            .wait(tokio::time::timeout(timeout, req.send()))
            .await
            .map_err(|_| CallError::Aborted)?;
        let resp = match resp {
            Err(_) => {
                return Err(CallError::Retryable(
                    format!(
                        "no response from the model within {}s",
                        timeout.as_secs_f64()
                    ),
                    None,
                ));
            }
            Ok(Err(e)) => {
                return Err(CallError::Retryable(
                    format!("cannot reach the model: {}", error_chain(&e.without_url())),
                    None,
                ));
            }
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        if !status.is_success() {
            let after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite())
                .map(|s| Duration::from_secs_f64(s.clamp(0.0, 60.0)));
            // The error body is bounded too: a server that sends headers
            // and then nothing must not hold the turn.
            let text = self
                .wait(tokio::time::timeout(timeout, resp.text()))
                .await
                .map_err(|_| CallError::Aborted)?
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
            let detail = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .map(|v| error_text(&v["error"]))
                .unwrap_or_else(|| text.chars().take(300).collect());
            let why = format!("the model answered HTTP {status}: {detail}");
            let retryable =
                status.as_u16() == 429 || status.as_u16() == 408 || status.is_server_error();
            return Err(if retryable {
                CallError::Retryable(why, after)
            } else {
                CallError::Fatal(why)
            });
        }
        let mut parser = parser(self.cfg.provider);
        let mut events = resp.bytes_stream().eventsource();
        let mut text = String::new();
        self.partial.clear();
        let mut started = false;
        loop {
            // Read no faster than the session takes the signals in.
            let pace = self.ctx.pace.clone();
            self.wait(pace.room())
                .await
                .map_err(|_| CallError::Aborted)?;
            let ev = self
                .wait(tokio::time::timeout(timeout, events.next()))
                .await
                .map_err(|_| CallError::Aborted)?;
            let interrupted = |why: String| {
                if started {
                    CallError::Fatal(why)
                } else {
                    CallError::Retryable(why, None)
                }
            };
            let ev = match ev {
                Err(_) => {
                    return Err(interrupted(format!(
                        "the model stream stalled for {}s",
                        timeout.as_secs_f64()
                    )));
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    return Err(interrupted(format!("the model stream broke: {e}")));
                }
                Ok(Some(Ok(ev))) => ev,
            };
            let deltas = parser.event(&ev.event, &ev.data).map_err(interrupted)?;
            for d in deltas {
                started = true;
                match d {
                    Delta::Text(t) if show => {
                        text.push_str(&t);
                        self.partial.push_str(&t);
                        self.emit(SignalKind::Update(Update::Text(t)));
                    }
                    Delta::Text(t) => text.push_str(&t),
                    Delta::Thought(t) if show => self.emit(SignalKind::Update(Update::Thought(t))),
                    Delta::Thought(_) => {}
                    Delta::ToolProgress => {}
                }
            }
            if let Some(done) = parser.finish(false) {
                drop(events);
                return Ok(self.finished(text, done));
            }
        }
        match parser.finish(true) {
            Some(done) => Ok(self.finished(text, done)),
            None => Err(if started {
                CallError::Fatal("the model stream ended before the response was complete".into())
            } else {
                CallError::Retryable("the model stream ended before any content".into(), None)
            }),
        }
    }

    fn finished(&mut self, text: String, done: Finish) -> Response {
        self.partial.clear();
        let (input, output) = done.usage;
        self.input_tokens = input;
        if input + output > 0 {
            metrics::counter!("tiller_model_tokens_total", "engine" => self.cfg.name.clone(), "kind" => "input").increment(input);
            metrics::counter!("tiller_model_tokens_total", "engine" => self.cfg.name.clone(), "kind" => "output").increment(output);
            self.emit(SignalKind::Update(Update::Usage { input, output }));
        }
        let turn = self.turn;
        let calls = done
            .calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| CallRecord {
                id: if c.id.is_empty() {
                    format!("call-{turn}-{i}")
                } else {
                    c.id
                },
                name: c.name,
                input: parse_args(&c.args),
            })
            .collect();
        Response {
            text,
            stop: done.stop,
            calls,
            reasoning: done.reasoning,
        }
    }
}

/// A call's arguments: an object, `{}` when empty; text that is not JSON
/// stays a string (the tool then refuses it with a clear error).
pub(crate) fn parse_args(args: &str) -> serde_json::Value {
    if args.trim().is_empty() {
        return serde_json::json!({});
    }
    serde_json::from_str(args).unwrap_or_else(|_| serde_json::Value::String(args.to_owned()))
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}

#[cfg(test)]
mod tests;
