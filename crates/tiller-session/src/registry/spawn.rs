//! Starting a session's actor: what it starts with, on which slot.

use super::*;

impl RegistryState {
    /// What a session's actor starts with: its clients (when it wakes) and
    /// the slot its handles send through.
    pub(super) fn args(
        &self,
        id: SessionId,
        head: LogHead,
        (cwd, title): (String, Option<String>),
        extras: SessionExtras,
        (slot, subscribers): (Arc<Slot>, Subscribers),
    ) -> Result<SessionArgs, SessionError> {
        let engine = match self.engines.get(extras.engine.as_deref()) {
            Ok(e) => e,
            Err(_) => {
                tracing::warn!(session = %id, engine = ?extras.engine, "the session's engine is no longer configured; using the default");
                self.engines.get(None)?
            }
        };
        Ok(SessionArgs {
            id,
            head,
            cwd,
            title,
            extras,
            engine,
            engines: self.engines.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
            automation: self.automation.clone(),
            slot,
            subscribers,
        })
    }

    pub(super) async fn spawn(
        &mut self,
        myself: &ActorRef<RegistryMsg>,
        args: SessionArgs,
    ) -> Result<ActorRef<SessionMsg>, SessionError> {
        let id = args.id;
        let (actor, _) = Actor::spawn_linked(None, SessionActor, args, myself.get_cell())
            .await
            .map_err(|e| SessionError::Internal(e.to_string()))?;
        self.by_actor.insert(actor.get_id(), id);
        Ok(actor)
    }

    /// Starts a session's actor on its slot, with its clients: from
    /// `state` (a new session), else from what the store holds.
    pub(super) async fn load(
        &mut self,
        myself: &ActorRef<RegistryMsg>,
        id: SessionId,
        cwd_title: (String, Option<String>),
        state: Option<(LogHead, SessionExtras)>,
        at: (Arc<Slot>, Subscribers),
    ) -> Result<ActorRef<SessionMsg>, SessionError> {
        let (head, extras) = match state {
            Some(state) => state,
            // A failed actor may have left its log refusing appends.
            None => (
                self.store.reopen_log(id).await?,
                self.store.load_state(id).await?,
            ),
        };
        let args = self.args(id, head, cwd_title, extras, at)?;
        self.spawn(myself, args).await
    }

    /// A session that was not live here starts: a new slot, a new actor.
    pub(super) async fn start(
        &mut self,
        myself: &ActorRef<RegistryMsg>,
        id: SessionId,
        cwd_title: (String, Option<String>),
        state: Option<(LogHead, SessionExtras)>,
    ) -> Result<Arc<Slot>, SessionError> {
        if self.live.len() >= self.config.max_sessions {
            return Err(SessionError::TooManySessions(self.config.max_sessions));
        }
        let slot = Slot::new(id, myself.clone());
        let at = (slot.clone(), Subscribers::default());
        let actor = self.load(myself, id, cwd_title, state, at).await?;
        resume(&slot, actor.clone());
        self.live.insert(
            id,
            Live {
                slot: slot.clone(),
                run: Run::Running(actor),
            },
        );
        self.gauges();
        Ok(slot)
    }
}
