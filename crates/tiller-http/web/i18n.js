// Localized strings of the Web Shell. Error texts come from the daemon's
// structured `errorKind`, never from its English message.

export const LANGS = ["en", "zh-CN", "ja", "de", "es"];

const STRINGS = {
  en: {
    workingDir: "Working directory", engine: "Engine", create: "Create",
    option_engine: "Engine", option_model: "Model", option_permission_mode: "Permissions",
    mode_ask: "Ask before edits and commands", "mode_accept-edits": "Accept edits, ask before commands", "mode_allow-all": "Allow everything",
    mcpFailed: "The MCP server {name} is unavailable: {error}",
    agentReloaded: "The agent restarted ({reason}) and reloaded this session.",
    agentFresh: "The agent could not reload this session ({reason}); it goes on without the earlier conversation.",
    plan: "Plan",
    queued: "{n} queued",
    sessions: "Sessions", newSession: "New session", language: "Language", noSession: "No session selected",
    promptLabel: "Message", send: "Send", steer: "Steer", cancel: "Cancel", skipToPrompt: "Skip to the prompt",
    idle: "Idle", running: "Running", cancelling: "Cancelling", thinking: "Thinking",
    permissionTitle: "Permission requested", permissionText: "The agent wants to run {tool}.",
    pending: "pending", in_progress: "running", completed: "completed", failed: "failed",
    steerInjected: "Steer sent to the running turn.", steerNewTurn: "No turn was running: started a new one.",
    steerRefused: "The turn is ending; send a new prompt instead.", steerDropped: "A steer was not used:",
    resend: "Resend", loopStopped: "Loop protection stopped this automatic turn.",
    goalPaused: "The goal is paused because its turns kept looping. Resume it when ready.",
    goalPausedUser: "The goal is paused.", origin_cron: "Cron", origin_notification: "Notification",
    origin_channel: "Channel", origin_goal: "Goal", loadOlder: "Load older messages", resync: "Reconnecting…",
    err_loop_detected: "The model repeated the same tool use or reached a safety limit, so this turn was stopped. Only this turn stopped: the session is still here, and you can continue with a more specific instruction.",
    err_no_result: "The agent stopped without producing an answer. Try again.",
    err_stalled: "The turn made no progress for too long and was stopped.",
    err_model_stream_interrupted: "The connection to the model was interrupted. Try again.",
    err_engine_crashed: "The agent crashed during this turn. Try again.",
    err_daemon_restarted: "Tiller restarted while this turn was running. Nothing else was lost; send the prompt again.",
    err_session_restarted: "The session restarted while this turn was running. Send the prompt again.",
    err_turn_too_long: "The agent produced more than one turn may hold, so the turn was stopped.",
    err_store_unavailable: "Tiller could not save this turn (the disk may be full), so it was stopped. Send the prompt again once storage is available.",
    err_overloaded: "The agent engine is running as many processes as it may. Send the prompt again in a moment.",
    lastError: "Last turn stopped:",
    signIn: "Not signed in. Open the Web Shell link that `tiller serve` printed (it carries the token once), or ask whoever runs the daemon for it.",
  },
  "zh-CN": {
    workingDir: "工作目录", engine: "引擎", create: "创建",
    option_engine: "引擎", option_model: "模型", option_permission_mode: "权限",
    mode_ask: "编辑和命令前询问", "mode_accept-edits": "自动接受编辑，命令前询问", "mode_allow-all": "全部允许",
    mcpFailed: "MCP 服务器 {name} 不可用：{error}",
    agentReloaded: "智能体已重启（{reason}），并重新载入了此会话。",
    agentFresh: "智能体无法重新载入此会话（{reason}）；它将在没有先前对话的情况下继续。",
    plan: "计划",
    queued: "{n} 个排队中",
    sessions: "会话", newSession: "新建会话", language: "语言", noSession: "未选择会话",
    promptLabel: "消息", send: "发送", steer: "引导", cancel: "取消", skipToPrompt: "跳到输入框",
    idle: "空闲", running: "运行中", cancelling: "正在取消", thinking: "思考过程",
    permissionTitle: "请求权限", permissionText: "智能体想要运行 {tool}。",
    pending: "等待中", in_progress: "运行中", completed: "已完成", failed: "失败",
    steerInjected: "已将引导发送到正在运行的轮次。", steerNewTurn: "没有正在运行的轮次：已开始新的轮次。",
    steerRefused: "该轮次正在结束，请改为发送新的提示。", steerDropped: "一条引导未被使用：",
    resend: "重新发送", loopStopped: "循环保护停止了这个自动轮次。",
    goalPaused: "目标已暂停，因为它的轮次一直在循环。准备好后可以继续。",
    goalPausedUser: "目标已暂停。", origin_cron: "定时任务", origin_notification: "通知",
    origin_channel: "渠道", origin_goal: "目标", loadOlder: "加载更早的消息", resync: "正在重新连接…",
    err_loop_detected: "模型重复使用了相同的工具或达到了安全上限，因此本轮已停止。只有这一轮停止了：会话仍然可用，你可以给出更具体的指示后继续。",
    err_no_result: "智能体没有给出回答就停止了。请重试。",
    err_stalled: "本轮长时间没有进展，已被停止。",
    err_model_stream_interrupted: "与模型的连接中断了。请重试。",
    err_engine_crashed: "智能体在本轮中崩溃了。请重试。",
    err_daemon_restarted: "本轮运行时 Tiller 重新启动了。其他内容没有丢失，请重新发送提示。",
    err_session_restarted: "本轮运行时会话重新启动了。请重新发送提示。",
    err_turn_too_long: "智能体产生的内容超过了一轮的上限，因此本轮已停止。",
    err_store_unavailable: "Tiller 无法保存本轮（磁盘可能已满），因此本轮已停止。存储恢复后请重新发送提示。",
    err_overloaded: "智能体引擎运行的进程已达上限。请稍后重新发送提示。",
    lastError: "上一轮已停止：",
    signIn: "尚未登录。请打开 `tiller serve` 打印的 Web Shell 链接（其中带有一次性令牌），或向运行守护进程的人索取。",
  },
  ja: {
    workingDir: "作業ディレクトリ", engine: "エンジン", create: "作成",
    option_engine: "エンジン", option_model: "モデル", option_permission_mode: "権限",
    mode_ask: "編集とコマンドの前に確認", "mode_accept-edits": "編集は許可、コマンドの前に確認", "mode_allow-all": "すべて許可",
    mcpFailed: "MCP サーバー {name} は利用できません: {error}",
    agentReloaded: "エージェントが再起動し（{reason}）、このセッションを再読み込みしました。",
    agentFresh: "エージェントはこのセッションを再読み込みできませんでした（{reason}）。以前の会話なしで続行します。",
    plan: "計画",
    queued: "{n} 件待機",
    sessions: "セッション", newSession: "新しいセッション", language: "言語", noSession: "セッションが選択されていません",
    promptLabel: "メッセージ", send: "送信", steer: "軌道修正", cancel: "キャンセル", skipToPrompt: "入力欄へ移動",
    idle: "待機中", running: "実行中", cancelling: "キャンセル中", thinking: "思考",
    permissionTitle: "許可の要求", permissionText: "エージェントが {tool} を実行しようとしています。",
    pending: "保留中", in_progress: "実行中", completed: "完了", failed: "失敗",
    steerInjected: "実行中のターンに指示を送りました。", steerNewTurn: "実行中のターンがなかったため、新しいターンを開始しました。",
    steerRefused: "ターンが終了中です。新しいプロンプトを送ってください。", steerDropped: "使われなかった指示があります：",
    resend: "再送信", loopStopped: "ループ保護がこの自動ターンを停止しました。",
    goalPaused: "ターンがループし続けたため、ゴールは一時停止しています。準備ができたら再開してください。",
    goalPausedUser: "ゴールは一時停止しています。", origin_cron: "定期実行", origin_notification: "通知",
    origin_channel: "チャネル", origin_goal: "ゴール", loadOlder: "以前のメッセージを読み込む", resync: "再接続中…",
    err_loop_detected: "モデルが同じツールの使用を繰り返したか、安全上の上限に達したため、このターンを停止しました。停止したのはこのターンだけです。セッションはそのまま使えるので、より具体的な指示で続けてください。",
    err_no_result: "エージェントが回答を出さずに停止しました。もう一度お試しください。",
    err_stalled: "このターンは長時間進まなかったため停止しました。",
    err_model_stream_interrupted: "モデルとの接続が中断されました。もう一度お試しください。",
    err_engine_crashed: "このターンの途中でエージェントがクラッシュしました。もう一度お試しください。",
    err_daemon_restarted: "このターンの実行中に Tiller が再起動しました。ほかのものは失われていません。プロンプトをもう一度送ってください。",
    err_session_restarted: "このターンの実行中にセッションが再起動しました。プロンプトをもう一度送ってください。",
    err_turn_too_long: "エージェントの出力が 1 ターンの上限を超えたため、このターンを停止しました。",
    err_store_unavailable: "Tiller がこのターンを保存できなかった（ディスクがいっぱいかもしれません）ため停止しました。保存できるようになったらプロンプトをもう一度送ってください。",
    err_overloaded: "エージェントのエンジンは実行できる上限までプロセスを動かしています。少ししてからプロンプトをもう一度送ってください。",
    lastError: "前のターンは停止しました：",
    signIn: "サインインしていません。`tiller serve` が表示した Web Shell のリンク（トークン付き）を開くか、デーモンの管理者に尋ねてください。",
  },
  de: {
    workingDir: "Arbeitsverzeichnis", engine: "Engine", create: "Erstellen",
    option_engine: "Engine", option_model: "Modell", option_permission_mode: "Berechtigungen",
    mode_ask: "Vor Änderungen und Befehlen fragen", "mode_accept-edits": "Änderungen erlauben, vor Befehlen fragen", "mode_allow-all": "Alles erlauben",
    mcpFailed: "Der MCP-Server {name} ist nicht verfügbar: {error}",
    agentReloaded: "Der Agent wurde neu gestartet ({reason}) und hat diese Sitzung neu geladen.",
    agentFresh: "Der Agent konnte diese Sitzung nicht neu laden ({reason}); er macht ohne das bisherige Gespräch weiter.",
    plan: "Plan",
    queued: "{n} in der Warteschlange",
    sessions: "Sitzungen", newSession: "Neue Sitzung", language: "Sprache", noSession: "Keine Sitzung ausgewählt",
    promptLabel: "Nachricht", send: "Senden", steer: "Steuern", cancel: "Abbrechen", skipToPrompt: "Zur Eingabe springen",
    idle: "Bereit", running: "Läuft", cancelling: "Wird abgebrochen", thinking: "Überlegungen",
    permissionTitle: "Berechtigung angefragt", permissionText: "Der Agent möchte {tool} ausführen.",
    pending: "wartet", in_progress: "läuft", completed: "fertig", failed: "fehlgeschlagen",
    steerInjected: "Hinweis an den laufenden Durchgang gesendet.", steerNewTurn: "Es lief kein Durchgang: ein neuer wurde gestartet.",
    steerRefused: "Der Durchgang endet gerade; sende stattdessen eine neue Nachricht.", steerDropped: "Ein Hinweis wurde nicht verwendet:",
    resend: "Erneut senden", loopStopped: "Der Schleifenschutz hat diesen automatischen Durchgang beendet.",
    goalPaused: "Das Ziel ist pausiert, weil seine Durchgänge sich ständig wiederholten. Setze es fort, wenn du so weit bist.",
    goalPausedUser: "Das Ziel ist pausiert.", origin_cron: "Zeitplan", origin_notification: "Benachrichtigung",
    origin_channel: "Kanal", origin_goal: "Ziel", loadOlder: "Ältere Nachrichten laden", resync: "Verbindung wird wiederhergestellt…",
    err_loop_detected: "Das Modell hat dasselbe Werkzeug immer wieder benutzt oder eine Sicherheitsgrenze erreicht, darum wurde dieser Durchgang beendet. Nur dieser Durchgang wurde beendet: Die Sitzung bleibt erhalten, und du kannst mit einer genaueren Anweisung weitermachen.",
    err_no_result: "Der Agent hat ohne Antwort aufgehört. Versuche es noch einmal.",
    err_stalled: "Der Durchgang kam zu lange nicht voran und wurde beendet.",
    err_model_stream_interrupted: "Die Verbindung zum Modell wurde unterbrochen. Versuche es noch einmal.",
    err_engine_crashed: "Der Agent ist in diesem Durchgang abgestürzt. Versuche es noch einmal.",
    err_daemon_restarted: "Tiller wurde während dieses Durchgangs neu gestartet. Sonst ging nichts verloren; sende die Nachricht noch einmal.",
    err_session_restarted: "Die Sitzung wurde während dieses Durchgangs neu gestartet. Sende die Nachricht noch einmal.",
    err_turn_too_long: "Der Agent hat mehr erzeugt, als ein Durchgang fassen darf, darum wurde er beendet.",
    err_store_unavailable: "Tiller konnte diesen Durchgang nicht speichern (vielleicht ist die Festplatte voll), darum wurde er beendet. Sende die Nachricht noch einmal, sobald wieder Speicher verfügbar ist.",
    err_overloaded: "Die Agent-Engine betreibt bereits so viele Prozesse, wie sie darf. Sende die Nachricht gleich noch einmal.",
    lastError: "Der letzte Durchgang wurde beendet:",
    signIn: "Nicht angemeldet. Öffnen Sie den Web-Shell-Link, den `tiller serve` ausgegeben hat (er enthält das Token), oder fragen Sie, wer den Dienst betreibt.",
  },
  es: {
    workingDir: "Directorio de trabajo", engine: "Motor", create: "Crear",
    option_engine: "Motor", option_model: "Modelo", option_permission_mode: "Permisos",
    mode_ask: "Preguntar antes de ediciones y comandos", "mode_accept-edits": "Aceptar ediciones, preguntar antes de comandos", "mode_allow-all": "Permitir todo",
    mcpFailed: "El servidor MCP {name} no está disponible: {error}",
    agentReloaded: "El agente se reinició ({reason}) y volvió a cargar esta sesión.",
    agentFresh: "El agente no pudo volver a cargar esta sesión ({reason}); sigue sin la conversación anterior.",
    plan: "Plan",
    queued: "{n} en cola",
    sessions: "Sesiones", newSession: "Nueva sesión", language: "Idioma", noSession: "Ninguna sesión seleccionada",
    promptLabel: "Mensaje", send: "Enviar", steer: "Orientar", cancel: "Cancelar", skipToPrompt: "Ir al mensaje",
    idle: "Inactiva", running: "En curso", cancelling: "Cancelando", thinking: "Razonamiento",
    permissionTitle: "Permiso solicitado", permissionText: "El agente quiere ejecutar {tool}.",
    pending: "pendiente", in_progress: "en curso", completed: "completada", failed: "fallida",
    steerInjected: "Indicación enviada al turno en curso.", steerNewTurn: "No había un turno en curso: se inició uno nuevo.",
    steerRefused: "El turno está terminando; envía un mensaje nuevo.", steerDropped: "Una indicación no se usó:",
    resend: "Reenviar", loopStopped: "La protección contra bucles detuvo este turno automático.",
    goalPaused: "El objetivo está en pausa porque sus turnos se repetían. Reanúdalo cuando quieras.",
    goalPausedUser: "El objetivo está en pausa.", origin_cron: "Programado", origin_notification: "Notificación",
    origin_channel: "Canal", origin_goal: "Objetivo", loadOlder: "Cargar mensajes anteriores", resync: "Reconectando…",
    err_loop_detected: "El modelo repitió el mismo uso de herramientas o alcanzó un límite de seguridad, así que este turno se detuvo. Solo se detuvo este turno: la sesión sigue disponible y puedes continuar con una instrucción más concreta.",
    err_no_result: "El agente se detuvo sin dar una respuesta. Inténtalo de nuevo.",
    err_stalled: "El turno no avanzó durante demasiado tiempo y se detuvo.",
    err_model_stream_interrupted: "Se interrumpió la conexión con el modelo. Inténtalo de nuevo.",
    err_engine_crashed: "El agente falló durante este turno. Inténtalo de nuevo.",
    err_daemon_restarted: "Tiller se reinició mientras este turno estaba en curso. No se perdió nada más; envía el mensaje de nuevo.",
    err_session_restarted: "La sesión se reinició mientras este turno estaba en curso. Envía el mensaje de nuevo.",
    err_turn_too_long: "El agente produjo más de lo que cabe en un turno, así que el turno se detuvo.",
    err_store_unavailable: "Tiller no pudo guardar este turno (puede que el disco esté lleno), así que se detuvo. Envía el mensaje de nuevo cuando vuelva a haber espacio.",
    err_overloaded: "El motor del agente ya ejecuta tantos procesos como puede. Envía el mensaje de nuevo en un momento.",
    lastError: "El último turno se detuvo:",
    signIn: "No has iniciado sesión. Abre el enlace de la Web Shell que mostró `tiller serve` (lleva el token), o pídeselo a quien ejecuta el servicio.",
  },
};

/** The best supported language for a list of browser preferences. */
export function pickLanguage(prefs) {
  for (const p of prefs ?? []) {
    const exact = LANGS.find((l) => l.toLowerCase() === p.toLowerCase());
    if (exact) return exact;
    const base = p.toLowerCase().split("-")[0];
    if (base === "zh") return "zh-CN";
    const near = LANGS.find((l) => l.toLowerCase().split("-")[0] === base);
    if (near) return near;
  }
  return "en";
}

/** A translator for `lang`: t(key, {vars}). */
export function translator(lang) {
  const table = STRINGS[lang] ?? STRINGS.en;
  return (key, vars = {}) => {
    const s = table[key] ?? STRINGS.en[key] ?? key;
    return s.replace(/\{(\w+)\}/g, (_, k) => vars[k] ?? "");
  };
}

/** The localized text of a turn error: from its kind, or the daemon's message for unknown kinds. */
export function errorText(t, error) {
  const key = `err_${error.errorKind}`;
  const text = t(key);
  return text === key ? error.message : text;
}
