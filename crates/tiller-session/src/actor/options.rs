//! Session options (`session/set_config_option`) and what is kept of them.

use super::*;

impl SessionState {
    /// The options a client may change.
    pub(super) fn options(&self) -> Vec<ConfigOption> {
        let mut v = Vec::new();
        let engines = self.engines.names();
        if engines.len() > 1 {
            v.push(ConfigOption {
                id: "engine".into(),
                name: "Engine".into(),
                category: "engine".into(),
                current: self.engine.name().to_owned(),
                choices: engines,
                boolean: false,
            });
        }
        let models = self.engine.models();
        if let Some(default) = models.first() {
            v.push(ConfigOption {
                id: "model".into(),
                name: "Model".into(),
                category: "model".into(),
                current: self
                    .model
                    .clone()
                    .filter(|m| models.contains(m))
                    .unwrap_or_else(|| default.clone()),
                choices: models.clone(),
                boolean: false,
            });
        }
        for (id, name, default) in self.engine.switches() {
            let on = self.switches.get(id).copied().unwrap_or(default);
            v.push(ConfigOption {
                id: id.into(),
                name: name.into(),
                category: "other".into(),
                current: on.to_string(),
                choices: vec!["false".into(), "true".into()],
                boolean: true,
            });
        }
        v.push(ConfigOption {
            id: "permission_mode".into(),
            name: "Permission mode".into(),
            category: "mode".into(),
            current: self.permissions.mode.as_str().into(),
            choices: ["ask", "accept-edits", "allow-all"]
                .map(String::from)
                .to_vec(),
            boolean: false,
        });
        // A hosted agent's own, after Tiller's.
        if let Some(a) = &self.agent {
            for o in &a.offered {
                v.push(ConfigOption {
                    id: format!("{AGENT_OPTION}{}", o.id),
                    name: o.name.clone(),
                    category: o.category.clone(),
                    current: a
                        .chosen
                        .get(&o.id)
                        .filter(|c| o.choices.contains(c))
                        .unwrap_or(&o.current)
                        .clone(),
                    choices: o.choices.clone(),
                    boolean: false,
                });
            }
        }
        v
    }

    /// The agent reported its options.
    pub(super) fn agent_offers(&mut self, offered: Vec<tiller_engine::AgentOption>) {
        let a = self.agent.get_or_insert_with(Box::default);
        if a.offered == offered {
            return;
        }
        a.offered = offered;
        let _ = self.myself.send_message(SessionMsg::SaveSettings);
        let options = self.options();
        self.publish(None, None, EventBody::ConfigOptions { options });
    }

    /// The values chosen for the agent's options.
    pub(super) fn agent_choices(&self) -> Vec<(String, String)> {
        self.agent
            .as_ref()
            .map(|a| a.chosen.clone().into_iter().collect())
            .unwrap_or_default()
    }

    pub(super) async fn set_option(
        &mut self,
        id: &str,
        value: &str,
    ) -> Result<Vec<ConfigOption>, String> {
        let Some(opt) = self.options().into_iter().find(|o| o.id == id) else {
            let known: Vec<String> = self.options().into_iter().map(|o| o.id).collect();
            return Err(format!(
                "unknown config option `{id}` (this session has: {})",
                known.join(", ")
            ));
        };
        // A switch takes on/off as well as true/false.
        let value = match (opt.boolean, value) {
            (true, "on") => "true",
            (true, "off") => "false",
            _ => value,
        };
        if !opt.choices.iter().any(|c| c == value) {
            return Err(format!(
                "`{value}` is not a value of `{id}` (choices: {})",
                opt.choices.join(", ")
            ));
        }
        // As it was, should storing the change fail.
        let before = (
            self.model.clone(),
            self.permissions.mode,
            self.switches.clone(),
        );
        let agent_before = self.agent.as_ref().map(|a| a.chosen.clone());
        match id {
            "engine" => {
                let engine = self.engines.get(Some(value)).map_err(|e| e.to_string())?;
                let root = self.toolbox.root();
                if engine.uses_directory() && !root.is_dir() {
                    return Err(format!(
                        "engine `{value}` runs tools in the session's directory, and {} is not one",
                        root.display()
                    ));
                }
                // Stored first: a change the store lost is not made.
                self.store
                    .save_state(self.id, tiller_store::StateColumn::Engine, value.to_owned())
                    .await
                    .map_err(|e| format!("the change could not be stored: {e}"))?;
                // The next turn runs on it, with the whole conversation.
                self.engine = engine;
                let models = self.engine.models();
                self.model = self.model.take().filter(|m| models.contains(m));
            }
            "model" => self.model = Some(value.to_owned()),
            // Set on the agent when its next turn starts.
            id if id.starts_with(AGENT_OPTION) => {
                let a = self.agent.get_or_insert_with(Box::default);
                a.chosen
                    .insert(id[AGENT_OPTION.len()..].to_owned(), value.to_owned());
            }
            id if opt.boolean => {
                self.switches.insert(id.to_owned(), value == "true");
            }
            _ => {
                self.permissions.mode =
                    PermissionMode::parse(value).expect("choices are valid modes");
            }
        }
        // Acknowledged only once stored; not made at all otherwise.
        if let Err(e) = self.save_settings().await {
            (self.model, self.permissions.mode, self.switches) = before;
            if let Some(a) = self.agent.as_mut() {
                a.chosen = agent_before.unwrap_or_default();
            }
            return Err(format!("the change could not be stored: {e}"));
        }
        let options = self.options();
        self.publish(
            None,
            None,
            EventBody::ConfigOptions {
                options: options.clone(),
            },
        );
        Ok(options)
    }

    /// The engine's switches as this session has them.
    pub(super) fn switch_values(&self) -> Vec<(String, bool)> {
        self.engine
            .switches()
            .into_iter()
            .map(|(id, _, default)| {
                (
                    id.to_owned(),
                    self.switches.get(id).copied().unwrap_or(default),
                )
            })
            .collect()
    }

    /// Widens the file tools to `roots` (each absolute, an existing
    /// directory; kept canonical), stored with the settings.
    pub(super) async fn set_roots(&mut self, roots: Vec<String>) -> Result<(), String> {
        let canonical = crate::check_roots(&roots).await?;
        if canonical.as_slice() == self.toolbox.roots() {
            return Ok(());
        }
        let before = self.toolbox.clone();
        self.toolbox = Arc::new((*self.toolbox).clone().with_roots(canonical));
        if let Err(e) = self.save_settings().await {
            self.toolbox = before;
            return Err(format!(
                "the additional directories could not be stored: {e}"
            ));
        }
        // Everyone attached sees the tools' reach change.
        let roots = self
            .toolbox
            .roots()
            .iter()
            .map(|r| r.display().to_string())
            .collect();
        self.publish(None, None, EventBody::Roots { roots });
        Ok(())
    }

    /// Sets (or clears) the title: stored, then published.
    pub(super) async fn set_title(
        &mut self,
        title: Option<String>,
    ) -> Result<(), crate::SessionError> {
        let title = title.map(|t| t.trim().to_owned()).filter(|t| !t.is_empty());
        if title.as_deref() == self.title.as_deref() {
            return Ok(());
        }
        self.store.set_title(self.id, title.clone()).await?;
        self.title = title.clone().map(String::into_boxed_str);
        self.publish(None, None, EventBody::SessionInfo { title });
        Ok(())
    }

    /// Names an untitled session after its first prompt.
    pub(super) async fn title_from(&mut self, text: &str) {
        if self.title.is_some() {
            return;
        }
        let Some(title) = crate::title_of(text) else {
            return;
        };
        if let Err(e) = self.set_title(Some(title)).await {
            tracing::warn!(session = %self.id, error = %e, "cannot store the session's title");
        }
    }

    /// Stores the session's options and "always allowed" tools.
    pub(super) async fn save_settings(&mut self) -> Result<(), StoreError> {
        let settings = Settings {
            model: self.model.clone(),
            // A session on the configured mode follows the config.
            permission_mode: (self.permissions.mode != self.config.permission_mode)
                .then(|| self.permissions.mode.as_str().into()),
            always: self.permissions.always(),
            usage: self.usage.as_deref().cloned(),
            switches: self.switches.clone(),
            upstream: self.upstream.clone(),
            agent_options: self
                .agent
                .as_ref()
                .map(|a| a.chosen.clone())
                .unwrap_or_default(),
            agent_offered: self
                .agent
                .as_ref()
                .map(|a| a.offered.clone())
                .unwrap_or_default(),
            roots: self
                .toolbox
                .roots()
                .iter()
                .map(|r| r.display().to_string())
                .collect(),
        };
        let json = serde_json::to_string(&settings).expect("settings serialize");
        let r = self
            .store
            .save_state(self.id, tiller_store::StateColumn::Settings, json)
            .await;
        if let Err(e) = &r {
            tracing::error!(session = %self.id, error = %e, "cannot store the session's settings");
        }
        self.settings_unsaved = r.is_err();
        r
    }

    /// Stores what the turn added to the conversation (only that: the
    /// conversation is stored a row per message).
    pub(super) async fn save_conversation(&mut self) -> Result<(), StoreError> {
        let Some(change) = self.conversation.take_changes() else {
            return Ok(());
        };
        let write = tiller_store::ConversationWrite {
            keep_from: change.keep_from,
            replace_from: change.replace_from,
            messages: change
                .messages
                .iter()
                .map(|m| serde_json::to_string(m).expect("messages serialize"))
                .collect(),
        };
        let r = self.store.save_conversation(self.id, write).await;
        if let Err(e) = &r {
            tracing::error!(session = %self.id, error = %e, "cannot store the conversation");
            self.conversation.unsaved(&change);
        }
        r
    }
}
