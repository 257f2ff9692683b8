// The Web Shell: a client of Tiller's HTTP API only. The transcript is a
// view of the session's event log (history pages + the SSE stream);
// busy/idle and the last error come from the server's snapshot.

import { LANGS, errorText, pickLanguage, translator } from "/i18n.js";
import { Marked } from "/vendor/marked.esm.js";
import DOMPurify from "/vendor/purify.es.mjs";
import hljs from "/vendor/highlight.min.js";

// Agent text is Markdown: rendered by marked, code blocks highlighted, and
// always sanitized before it reaches the page (an agent's text is a
// hostile document: it may echo whatever it read).
const markdown = new Marked({ gfm: true, breaks: false });
// A task list's boxes as text (agent HTML gets no form fields: see SANITIZE).
markdown.use({ renderer: { checkbox: ({ checked }) => (checked ? "☑" : "☐") } });
// An image in agent text says what it is, or is marked decorative.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "IMG" && !node.hasAttribute("alt")) node.setAttribute("alt", "");
});
// Nothing of it may stand in for the page's own elements: no ids or names
// (`getElementById` and a form's named fields would find them), no forms,
// fields, buttons or dialogs (a forged prompt box or permission dialog), no
// roles, aria or data attributes (an alert, a label of the page's own
// controls, a string the page translates), no tab order, and classes only
// for code (a banner in the page's own style).
const SANITIZE = {
  USE_PROFILES: { html: true },
  ALLOW_DATA_ATTR: false,
  ALLOW_ARIA_ATTR: false,
  FORBID_ATTR: ["id", "name", "form", "formaction", "autofocus", "role", "tabindex"],
  FORBID_TAGS: ["form", "input", "textarea", "select", "option", "optgroup", "button", "dialog", "datalist", "fieldset", "label", "output", "style"],
};
DOMPurify.addHook("uponSanitizeAttribute", (_node, data) => {
  if (data.attrName === "class") {
    data.attrValue = data.attrValue.split(/\s+/).filter((c) => /^(language-|hljs)/.test(c)).join(" ");
    if (!data.attrValue) data.keepAttr = false;
  }
});
function renderMarkdown(node, text) {
  node.innerHTML = DOMPurify.sanitize(markdown.parse(text).trim(), SANITIZE);
  for (const code of node.querySelectorAll("pre code")) {
    const lang = [...code.classList].find((c) => c.startsWith("language-"))?.slice(9);
    if (lang && hljs.getLanguage(lang)) {
      // highlight.js escapes the text itself; the result is sanitized again.
      code.innerHTML = DOMPurify.sanitize(hljs.highlight(code.textContent, { language: lang }).value, SANITIZE);
      code.classList.add("hljs");
    }
  }
  for (const a of node.querySelectorAll("a[href]")) {
    a.target = "_blank";
    a.rel = "noopener noreferrer";
    a.title = a.href; // the real address, whatever the text says
  }
}

/** Whether `url` is on this machine (or this page's host, any port): the
 * browser sends this page's cookie with a visit there. */
function local(url) {
  const h = url.hostname.replace(/^\[|\]$/g, "");
  return h === location.hostname || h === "localhost" || h.endsWith(".localhost") ||
    /^127\./.test(h) || h === "::1" || h === "0.0.0.0";
}

const lines = (sign, text) => String(text ?? "").replace(/\n$/, "").split("\n").map((l) => [sign, l]);

/** The change an edit-like call makes, as diff lines: [sign, text]. */
function diffLines(name, input) {
  if (name === "edit") {
    const edits = Array.isArray(input?.edits) ? input.edits : [input ?? {}];
    return edits.flatMap((e, i) => [
      ...(edits.length > 1 ? [["@", `@@ ${i + 1}/${edits.length}`]] : []),
      ...lines("-", e?.old_string),
      ...lines("+", e?.new_string),
    ]);
  }
  if (name === "write_file") return lines("+", input?.content);
  if (name === "apply_patch") {
    return String(input?.patch ?? "").replace(/\n$/, "").split("\n").map((l) => {
      const sign = l.startsWith("+++") || l.startsWith("---") ? "@" : l[0] === "+" || l[0] === "-" || l[0] === "@" ? l[0] : " ";
      return [sign, l];
    });
  }
  return null;
}

function diffView(rows) {
  return el("pre", { class: "diff" }, ...rows.map(([sign, text]) =>
    el("span", { class: `diff-line diff-${{ "+": "add", "-": "del", "@": "hunk" }[sign] ?? "ctx"}`, text: sign === "@" || sign === " " ? `${text}\n` : `${sign} ${text}\n` })));
}

// The page's own elements, found once before any agent text is shown
// (which is sanitized of ids too: see SANITIZE).
const PAGE = new Map([...document.querySelectorAll("[id]")].map((n) => [n.id, n]));
const $ = (id) => PAGE.get(id);
// Credentials: the daemon's HttpOnly cookie, set when this page was opened
// through the link `tiller serve` printed (`/?token=...`, which the daemon
// trades for the cookie and a clean address); the browser sends it itself.

const state = {
  lang: "en",
  t: translator("en"),
  sessions: [],
  engines: { default: "scripted", engines: [] },
  current: null, // { id, title, events: Map(seq -> event), snapshot, es, hasMore, nextBefore }
};

async function api(method, path, body) {
  const headers = { "content-type": "application/json" };
  const res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await res.text();
  const json = text ? JSON.parse(text) : null;
  if (!res.ok) throw Object.assign(new Error(json?.error?.message ?? res.statusText), { status: res.status, body: json });
  return json;
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c) e.append(c);
  return e;
}

// --- language -------------------------------------------------------------

function setLanguage(lang) {
  state.lang = LANGS.includes(lang) ? lang : "en";
  state.t = translator(state.lang);
  localStorage.setItem("tiller.lang", state.lang);
  document.documentElement.lang = state.lang;
  $("lang-select").value = state.lang;
  // The page's own strings only, never agent text's.
  for (const node of document.querySelectorAll("[data-i18n]")) {
    if (!node.closest("#transcript")) node.textContent = state.t(node.dataset.i18n);
  }
  $("session-search").placeholder = state.t("searchSessions");
  $("session-search").setAttribute("aria-label", state.t("searchSessions"));
  if (state.current) $("session-title").textContent = state.current.title;
  render();
  renderOptions();
}

// --- sessions -------------------------------------------------------------

async function loadSessions() {
  const page = await api("GET", "/api/sessions?limit=100");
  state.sessions = page.sessions;
  renderSessions();
}

function sessionLabel(s) {
  return s.title || `${s.cwd} · ${s.id.slice(0, 8)}`;
}

function renderSessions() {
  const list = $("session-list");
  const q = ($("session-search").value ?? "").trim().toLowerCase();
  const shown = q ? state.sessions.filter((s) => sessionLabel(s).toLowerCase().includes(q)) : state.sessions;
  list.replaceChildren(
    ...shown.map((s) =>
      el(
        "li",
        {},
        el("button", {
          type: "button",
          text: sessionLabel(s),
          "data-session": s.id,
          "aria-current": state.current?.id === s.id ? "true" : "false",
          onclick: () => openSession(s.id),
        }),
      ),
    ),
  );
}

async function loadEngines() {
  try {
    state.engines = await api("GET", "/api/engines");
  } catch {
    // An older daemon: only its default engine.
  }
  const sel = $("new-engine");
  sel.replaceChildren(...state.engines.engines.map((e) => el("option", { value: e.name, text: e.name })));
  sel.value = state.engines.default;
}

function newSession() {
  const dlg = $("new-session-dialog");
  // Never `/` by default: a session's tools may read everything under its directory.
  $("new-cwd").value = localStorage.getItem("tiller.cwd") ?? state.current?.snapshot?.cwd ?? "";
  $("new-engine").value = localStorage.getItem("tiller.engine") ?? state.engines.default;
  if (!$("new-engine").value) $("new-engine").value = state.engines.default;
  $("new-status").textContent = "";
  dlg.showModal();
  $("new-cwd").focus();
}

async function createSession() {
  const cwd = $("new-cwd").value.trim();
  const engine = $("new-engine").value || undefined;
  try {
    const s = await api("POST", "/api/sessions", { cwd, engine });
    localStorage.setItem("tiller.cwd", cwd);
    if (engine) localStorage.setItem("tiller.engine", engine);
    $("new-session-dialog").close();
    await loadSessions();
    await openSession(s.id);
  } catch (e) {
    $("new-status").textContent = e.message;
  }
}

async function openSession(id) {
  // The last session chosen wins: an earlier choice still loading stops at
  // its next step (it would open a stream nothing reads).
  const ticket = (state.opening = (state.opening ?? 0) + 1);
  const superseded = () => state.opening !== ticket;
  state.current?.es?.close();
  const info = await api("GET", `/api/sessions/${id}`);
  if (superseded()) return;
  state.current?.es?.close();
  const cur = {
    id,
    title: sessionLabel(info),
    events: new Map(),
    snapshot: info,
    es: null,
    hasMore: false,
    nextBefore: null,
  };
  state.current = cur;
  history.replaceState(null, "", `#${id}`);
  $("session-title").textContent = cur.title;
  renderSessions();
  renderOptions(); // the previous session's options go at once
  const page = await api("GET", `/api/sessions/${id}/history?limit=100`);
  if (superseded()) return;
  for (const ev of page.events) cur.events.set(ev.seq, ev);
  cur.hasMore = page.hasMore;
  cur.nextBefore = page.nextBefore;
  render(true);
  connect(cur);
  try {
    cur.options = (await api("GET", `/api/sessions/${id}/options`)).options;
  } catch {
    cur.options = [];
  }
  if (state.current === cur) renderOptions();
}

// --- session options (model, permission mode) ------------------------------

function renderOptions() {
  const cur = state.current;
  const t = state.t;
  const box = $("options");
  if (!cur?.options) {
    box.replaceChildren();
    return;
  }
  box.replaceChildren(
    ...cur.options.map((o) => {
      const id = `option-${o.id}`;
      const label = (v) => (o.id === "permission_mode" ? t(`mode_${v}`) : v);
      return el(
        "label",
        { for: id, class: "option" },
        el("span", { text: t(`option_${o.id}`) }),
        el(
          "select",
          { id, "data-option": o.id, onchange: (e) => setOption(cur, o.id, e.target.value) },
          ...o.choices.map((c) => {
            const opt = el("option", { value: c, text: label(c) });
            opt.selected = c === o.current;
            return opt;
          }),
        ),
      );
    }),
  );
}

async function setOption(cur, id, value) {
  try {
    cur.options = (await api("PUT", `/api/sessions/${cur.id}/options/${encodeURIComponent(id)}`, { value })).options;
  } catch (e) {
    $("form-status").textContent = e.message;
  }
  if (state.current === cur) renderOptions();
}

function lastSeq(cur) {
  let max = 0;
  for (const seq of cur.events.keys()) max = Math.max(max, seq);
  return max;
}

function connect(cur) {
  const q = new URLSearchParams({ after: String(lastSeq(cur)) });
  const es = new EventSource(`/api/sessions/${cur.id}/events?${q}`);
  cur.es = es;
  // A stream of a session no longer shown is let go.
  const shown = () => {
    if (state.current === cur) return true;
    es.close();
    return false;
  };
  es.addEventListener("session_snapshot", (e) => {
    if (!shown()) return;
    const snap = JSON.parse(e.data);
    // The log ends before events this page was shown: a session that could
    // not store them was rebuilt from its log, and their numbers are used
    // again. What the page holds is not the log any more: load it afresh.
    if (snap.lastSeq < lastSeq(cur)) {
      es.close();
      if (state.current === cur) openSession(cur.id);
      return;
    }
    cur.snapshot = { ...cur.snapshot, ...snap };
    render();
  });
  es.addEventListener("event", (e) => {
    if (shown()) addEvent(cur, JSON.parse(e.data));
  });
  // While the stream is down the page says so (a lost connection must not
  // look like a turn that hangs).
  const link = (up) => {
    if (shown() && Boolean(cur.offline) === up) {
      cur.offline = !up;
      renderState();
    }
  };
  es.addEventListener("open", () => link(true));
  es.addEventListener("error", () => {
    if (cur.es !== es) return;
    link(false);
    // A refused reconnect closes an EventSource for good. Signed out or
    // the session gone: said so, and left. Else (the store full, the
    // daemon restarting) tried again.
    if (es.readyState === EventSource.CLOSED && state.current === cur) {
      setTimeout(async () => {
        if (state.current !== cur || cur.es !== es) return;
        try {
          await api("GET", `/api/sessions/${cur.id}`);
        } catch (e) {
          if (e.status === 401 || e.status === 404) {
            cur.refused = e.status;
            if (state.current === cur) renderState();
            return;
          }
        }
        if (state.current === cur && cur.es === es) connect(cur);
      }, 2000);
    }
  });
}

const STATE_EVENTS = new Set([
  "prompt_started", "prompt_queued", "turn_complete", "turn_error",
  "permission_requested", "permission_resolved", "goal_paused", "goal_resumed",
]);

function addEvent(cur, ev) {
  if (state.current !== cur || cur.events.has(ev.seq)) return;
  cur.events.set(ev.seq, ev);
  if (ev.type === "config_options") {
    cur.options = ev.data.options;
    renderOptions();
  }
  scheduleRender();
  if (STATE_EVENTS.has(ev.type)) refreshSnapshot(cur);
}

async function refreshSnapshot(cur) {
  try {
    const snap = await api("GET", `/api/sessions/${cur.id}`);
    // Answers may arrive out of order: one older than the state shown is
    // ignored (it would say running while the session is idle).
    if (state.current === cur && snap.lastSeq >= (cur.snapshot?.lastSeq ?? 0)) {
      cur.snapshot = snap;
      scheduleRender();
    }
  } catch {
    // The stream goes on; the next event refreshes it.
  }
}

async function loadOlder() {
  const cur = state.current;
  if (!cur?.hasMore || cur.loading) return;
  cur.loading = true;
  try {
    const page = await api("GET", `/api/sessions/${cur.id}/history?limit=100&before=${cur.nextBefore}`);
    const box = $("transcript");
    const fromBottom = box.scrollHeight - box.scrollTop;
    for (const ev of page.events) cur.events.set(ev.seq, ev);
    cur.hasMore = page.hasMore;
    cur.nextBefore = page.nextBefore;
    render();
    box.scrollTop = box.scrollHeight - fromBottom;
  } finally {
    cur.loading = false;
  }
}

// --- rendering ------------------------------------------------------------

let pending = false;
function scheduleRender() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => {
    pending = false;
    render();
  });
}

// The transcript is built incrementally: events that follow the last one
// rendered are appended to the DOM as they come (what the user opened or
// selected stays as it is); anything else (older history, a language
// change, another session) rebuilds it.
function render(scrollToEnd = false) {
  const cur = state.current;
  const box = $("transcript");
  if (!cur) {
    box.replaceChildren();
    state.view = null;
    return;
  }
  const atEnd = scrollToEnd || box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  let view = state.view;
  const fresh = [...cur.events.values()].filter((ev) => !view || ev.seq > view.last);
  const rebuild =
    !view || view.cur !== cur || view.lang !== state.lang || view.hasMore !== cur.hasMore ||
    view.count + fresh.length !== cur.events.size;
  if (rebuild) {
    // What the user opened stays open across a rebuild.
    const opened = new Set([...box.querySelectorAll("details[open][data-key]")].map((d) => d.dataset.key));
    view = state.view = { cur, lang: state.lang, hasMore: cur.hasMore, last: 0, count: 0, turn: null, agent: null, thought: null, tools: new Map(), opened };
    box.replaceChildren();
    if (cur.hasMore) {
      box.append(el("button", { type: "button", class: "secondary", text: state.t("loadOlder"), onclick: loadOlder }));
    }
  }
  const events = (rebuild ? [...cur.events.values()] : fresh).sort((a, b) => a.seq - b.seq);
  for (const ev of events) {
    try {
      apply(view, box, ev);
    } catch (e) {
      // One event this page cannot draw (a call's odd input) is shown as
      // such; the others, the state and any permission request still are.
      console.error("event", ev.seq, e);
      (view.turn ?? box).append(el("div", { class: "notice", "data-unshown": String(ev.seq), text: state.t("unshown") }));
    }
    view.last = Math.max(view.last, ev.seq);
    view.count += 1;
  }
  if (atEnd) box.scrollTop = box.scrollHeight;
  renderState();
}

/** Appends one event's rendering to the transcript. */
function apply(view, box, ev) {
  const t = state.t;
  const d = ev.data ?? {};
  const turnBox = (origin) => {
    view.turn = el("section", { class: "turn", "data-origin": origin ?? "interactive" });
    if (origin && origin !== "interactive") view.turn.append(el("span", { class: "origin", text: t(`origin_${origin}`) }));
    box.append(view.turn);
    view.agent = null;
    view.thought = null;
    return view.turn;
  };
  const into = () => view.turn ?? turnBox(null);
  if (ev.type !== "agent_thought_chunk") view.thought = null;
  switch (ev.type) {
    case "prompt_started":
      turnBox(d.origin);
      break;
    case "user_message": {
      const user = el("div", { class: "user", text: d.text });
      // Images the daemon took (their types are checked at the door).
      for (const img of d.images ?? []) {
        if (!/^image\/(png|jpeg|gif|webp)$/.test(img.mimeType)) continue;
        user.append(el("img", { class: "attachment", alt: img.mimeType, src: `data:${img.mimeType};base64,${img.data}` }));
      }
      into().append(user);
      view.agent = null;
      break;
    }
    case "agent_message_chunk":
      if (!view.agent) {
        view.agent = el("div", { class: "agent markdown" });
        view.agentText = "";
        into().append(view.agent);
      }
      view.agentText += d.text;
      renderMarkdown(view.agent, view.agentText);
      break;
    case "agent_thought_chunk":
      // Consecutive thought chunks are one thought.
      if (!view.thought) {
        const parent = into(); // may start a turn box, which resets `thought`
        view.thought = el("p", {});
        parent.append(el("details", { class: "thought", "data-key": String(ev.seq), open: view.opened.has(String(ev.seq)) }, el("summary", { text: t("thinking") }), view.thought));
      }
      view.thought.textContent += d.text;
      view.agent = null;
      break;
    case "plan":
      into().append(el("ol", { class: "plan", "aria-label": t("plan") },
        ...d.entries.map((e) => el("li", { "data-status": e.status, text: `${e.content} (${t(e.status)})` }))));
      view.agent = null;
      break;
    case "tool_call": {
      // A call: its name and status; its input (a diff for edits) and
      // output in a collapsible body.
      const status = el("span", { class: "tool-status", text: t(d.status ?? "pending") });
      const key = `tool-${ev.seq}`;
      const body = el("div", { class: "tool-body" });
      const diff = diffLines(d.name, d.input);
      if (diff) body.append(el("p", { class: "tool-label", text: t("toolChange") }), diffView(diff));
      else if (d.input && Object.keys(d.input).length) {
        body.append(el("p", { class: "tool-label", text: t("toolInput") }), el("pre", { class: "tool-input", text: JSON.stringify(d.input, null, 2) }));
      }
      const node = el("details", { class: "tool", "data-tool-call": d.toolCallId, "data-status": d.status ?? "pending", "data-key": key, open: view.opened.has(key) },
        el("summary", {}, el("strong", { text: d.name }), " · ", status), body);
      view.tools.set(d.toolCallId, { node, status, body });
      into().append(node);
      view.agent = null;
      break;
    }
    case "tool_call_update": {
      const tool = view.tools.get(d.toolCallId);
      if (!tool) break;
      tool.node.dataset.status = d.status;
      tool.status.textContent = t(d.status);
      if (d.status === "failed" || d.status === "completed") {
        const text = d.error?.message ?? d.output;
        if (text) tool.body.append(el("p", { class: "tool-label", text: t("toolOutput") }), el("pre", { class: "tool-output", text }));
        // A failure is shown without a click.
        if (d.status === "failed") tool.node.open = true;
      }
      break;
    }
    case "compaction": {
      const notes = { in_progress: "compacting", completed: "compacted", failed: "compactFailed", cancelled: "compactCancelled" };
      const node = el("div", { class: "notice compaction", "data-compaction": d.status, text: t(notes[d.status] ?? "compacting") });
      if (d.message) node.append(el("span", { text: ` ${d.message}` }));
      if (d.summary) {
        const summary = el("div", { class: "markdown" });
        renderMarkdown(summary, d.summary);
        node.append(el("details", { "data-key": `compaction-${ev.seq}`, open: view.opened.has(`compaction-${ev.seq}`) }, el("summary", { text: t("compactSummary") }), summary));
      }
      into().append(node);
      view.agent = null;
      break;
    }
    case "turn_error":
      into().append(el("div", { class: "turn-error", role: "alert", "data-error-kind": d.errorKind, text: errorText(t, d) }));
      view.turn = null;
      break;
    case "turn_complete":
      view.turn = null;
      break;
    case "loop_stopped":
      into().append(el("div", { class: "notice", text: t("loopStopped") }));
      break;
    case "steer_dropped":
      into().append(el("div", { class: "notice" }, `${t("steerDropped")} “${d.text}” `,
        el("button", { type: "button", class: "secondary", text: t("resend"), onclick: () => sendText(d.text) })));
      break;
    case "mcp_server":
      if (d.error) into().append(el("div", { class: "notice", "data-mcp": d.name, text: t("mcpFailed", { name: d.name, error: d.error }) }));
      break;
    case "agent_session":
      // A hosted agent restarted: reloaded, or started over.
      if (d.start === "loaded") into().append(el("div", { class: "notice", text: t("agentReloaded", { reason: d.reason ?? "" }) }));
      if (d.start === "fresh") into().append(el("div", { class: "notice", text: t("agentFresh", { reason: d.reason ?? "" }) }));
      break;
    case "goal_paused":
      into().append(el("div", { class: "notice", text: d.reason === "loop_detected" ? t("goalPaused") : t("goalPausedUser") }));
      break;
    default:
      break;
  }
}

function renderState() {
  const cur = state.current;
  const t = state.t;
  const snap = cur?.snapshot ?? {};
  const s = snap.state ?? "idle";
  const queued = snap.queued?.length ?? 0;
  $("state").textContent = cur ? (queued ? `${t(s)} · ${t("queued", { n: queued })}` : t(s)) : "";
  $("state").dataset.queued = String(queued);
  $("state").dataset.state = s;
  // A prompt may wait while a cancelled turn's engine stops: it can be cancelled.
  $("cancel").hidden = !cur || (s === "idle" && queued === 0);
  // Usage: tokens in context against the window, and the cost so far.
  const u = snap.usage;
  const usage = $("usage");
  if (u && u.contextWindow > 0) {
    const share = Math.min(100, Math.round((100 * u.used) / u.contextWindow));
    usage.textContent = t("usage", { used: u.used.toLocaleString(state.lang), size: u.contextWindow.toLocaleString(state.lang), share })
      + (u.cost ? ` · ${u.cost.amount.toFixed(2)} ${u.cost.currency}` : "");
    usage.dataset.share = String(share);
    usage.hidden = false;
  } else {
    usage.textContent = "";
    usage.hidden = true;
  }
  $("send").textContent = s === "running" ? t("steer") : t("send");
  // Banners: the last turn error (server-owned) and a paused goal.
  const banners = [];
  if (cur?.refused === 401) {
    banners.push(el("div", { class: "banner banner-error", role: "alert", id: "sign-in", text: t("signIn") }));
  } else if (cur?.refused === 404) {
    banners.push(el("div", { class: "banner banner-error", role: "alert", id: "session-gone", text: t("sessionGone") }));
  } else if (cur?.offline) {
    banners.push(el("div", { class: "banner notice", role: "status", id: "offline", text: t("resync") }));
  }
  if (snap.lastTurnError) {
    banners.push(el("div", { class: "banner banner-error", role: "alert", id: "last-error", "data-error-kind": snap.lastTurnError.errorKind },
      el("strong", { text: `${t("lastError")} ` }), errorText(t, snap.lastTurnError)));
  }
  // A paused goal: the latest goal event decides.
  const goal = cur
    ? [...cur.events.values()].filter((e) => e.type.startsWith("goal_")).sort((a, b) => b.seq - a.seq)[0]
    : null;
  if (goal?.type === "goal_paused") {
    banners.push(el("div", { class: "banner notice", role: "status", id: "goal-banner", "data-reason": goal.data.reason },
      goal.data.reason === "loop_detected" ? t("goalPaused") : t("goalPausedUser")));
  }
  $("banners").replaceChildren(...banners);
  // The permission dialog follows the snapshot.
  const dlg = $("permission");
  const pp = snap.pendingPermission;
  if (pp && dlg.dataset.request !== pp.requestId) {
    dlg.dataset.request = pp.requestId;
    delete dlg.dataset.answered;
    $("permission-text").textContent = t("permissionText", { tool: pp.title });
    $("permission-call").replaceChildren(...callView(pp));
    $("permission-options").replaceChildren(
      ...pp.options.map((o) =>
        el("button", {
          type: "button",
          class: o.kind.startsWith("reject") ? "secondary" : undefined,
          "data-option": o.optionId,
          text: o.name,
          onclick: () => answerPermission(pp.requestId, o.optionId),
        }),
      ),
    );
  }
  if (pp && dlg.dataset.answered !== pp.requestId) {
    // Until it is answered: closed unanswered (Esc), it opens again.
    if (!dlg.open) dlg.showModal();
  } else if (!pp) {
    if (dlg.open) dlg.close();
    delete dlg.dataset.request;
    delete dlg.dataset.answered;
  }
}

/** What a call asking for permission would do: its paths, and its change,
 * command or input (a title is only the agent's word for it). */
function callView(pp) {
  const parts = [];
  const input = pp.input && typeof pp.input === "object" ? pp.input : {};
  const paths = pp.locations?.length ? pp.locations : typeof input.path === "string" ? [input.path] : [];
  if (paths.length) parts.push(el("p", { class: "call-paths", text: paths.join("\n") }));
  const diff = pp.diff ? [...(pp.diff.oldText == null ? [] : lines("-", pp.diff.oldText)), ...lines("+", pp.diff.newText)] : diffLines(pp.name, input);
  // All of it (the box scrolls): what is decided on is never cut short.
  if (diff) parts.push(diffView(diff));
  else if (typeof input.command === "string") parts.push(el("pre", { class: "tool-input", text: input.command }));
  else if (Object.keys(input).length) parts.push(el("pre", { class: "tool-input", text: JSON.stringify(input, null, 2) }));
  return parts;
}

// --- actions --------------------------------------------------------------

async function answerPermission(requestId, optionId) {
  const cur = state.current;
  const dlg = $("permission");
  dlg.dataset.answered = requestId;
  dlg.close();
  try {
    await api("POST", `/api/sessions/${cur.id}/permissions/${encodeURIComponent(requestId)}`, { optionId });
  } catch (e) {
    // Not taken: say why, and ask again.
    $("form-status").textContent = e.message;
    if (dlg.dataset.answered === requestId) delete dlg.dataset.answered;
  } finally {
    refreshSnapshot(cur);
  }
}

async function sendText(text) {
  const cur = state.current;
  if (!cur || !text.trim()) return;
  const t = state.t;
  const status = $("form-status");
  status.textContent = "";
  try {
    // Tiller's slash commands run at once, even during a turn.
    const command = /^\s*\/(clear|model|mode|goal|cancel|compact)(\s|$)/.test(text);
    if (cur.snapshot?.state === "running" && !command) {
      const r = await api("POST", `/api/sessions/${cur.id}/steer`, { text });
      status.textContent =
        r.outcome === "injected" ? t("steerInjected") : r.outcome === "startedNewTurn" ? t("steerNewTurn") : t("steerRefused");
      status.dataset.outcome = r.outcome;
    } else {
      // Attached images go with the text as content blocks.
      const body = state.images.length
        ? { content: [{ type: "text", text }, ...state.images.map((i) => ({ type: "image", mimeType: i.mimeType, data: i.data }))] }
        : { text };
      const r = await api("POST", `/api/sessions/${cur.id}/prompts`, body);
      delete status.dataset.outcome;
      if (r?.command) status.textContent = r.message;
      state.images = [];
      renderAttachments();
    }
    $("prompt-text").value = "";
    renderPalette();
  } catch (e) {
    status.textContent = e.message;
  }
  refreshSnapshot(cur);
}

// --- start ----------------------------------------------------------------

$("prompt-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sendText($("prompt-text").value);
});
$("prompt-text").addEventListener("keydown", (e) => {
  const palette = $("palette");
  if (!palette.hidden && (e.key === "ArrowDown" || e.key === "ArrowUp" || e.key === "Tab")) {
    e.preventDefault();
    const items = [...palette.children];
    const at = items.findIndex((i) => i.getAttribute("aria-selected") === "true");
    const next = e.key === "ArrowUp" ? (at - 1 + items.length) % items.length : (at + 1) % items.length;
    items.forEach((i, k) => i.setAttribute("aria-selected", String(k === next)));
    return;
  }
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    const chosen = palette.hidden ? null : palette.querySelector("[aria-selected=true]");
    if (chosen) return choose(chosen.dataset.command);
    sendText($("prompt-text").value);
  }
});
$("prompt-text").addEventListener("input", renderPalette);

// The command palette: Tiller's commands, shown while the prompt is a
// `/word` being typed.
const COMMANDS = ["clear", "compact", "model", "mode", "goal", "cancel"];
function renderPalette() {
  const text = $("prompt-text").value;
  const m = /^\/(\w*)$/.exec(text);
  const palette = $("palette");
  const hits = m ? COMMANDS.filter((c) => c.startsWith(m[1])) : [];
  palette.hidden = hits.length === 0;
  palette.replaceChildren(...hits.map((c, k) => el("li", {
    role: "option", "data-command": c, "aria-selected": String(k === 0),
    onclick: () => choose(c),
  }, el("code", { text: `/${c}` }), ` ${state.t(`cmd_${c}`)}`)));
}
function choose(command) {
  const takesArgument = ["model", "mode", "goal"].includes(command);
  $("prompt-text").value = `/${command}${takesArgument ? " " : ""}`;
  renderPalette();
  $("prompt-text").focus();
  if (!takesArgument) sendText($("prompt-text").value);
}

// Images pasted or dropped into the prompt go with the next prompt.
state.images = [];
const IMAGE_TYPES = /^image\/(png|jpeg|gif|webp)$/;
async function attach(files) {
  for (const f of files) {
    if (!IMAGE_TYPES.test(f.type)) continue;
    const data = await new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(String(r.result).split(",")[1]);
      r.onerror = reject;
      r.readAsDataURL(f);
    });
    state.images.push({ mimeType: f.type, data, name: f.name || f.type });
  }
  renderAttachments();
}
function renderAttachments() {
  $("attachments").replaceChildren(...state.images.map((img, k) => el("span", { class: "attachment-chip" },
    el("img", { alt: img.name, src: `data:${img.mimeType};base64,${img.data}` }),
    el("button", { type: "button", class: "secondary", "aria-label": state.t("removeImage"), text: "×",
      onclick: () => { state.images.splice(k, 1); renderAttachments(); } }))));
}
$("prompt-text").addEventListener("paste", (e) => {
  const files = [...(e.clipboardData?.files ?? [])];
  if (files.some((f) => IMAGE_TYPES.test(f.type))) {
    e.preventDefault();
    attach(files);
  }
});
$("prompt-text").addEventListener("dragover", (e) => e.preventDefault());
$("prompt-text").addEventListener("drop", (e) => {
  const files = [...(e.dataTransfer?.files ?? [])];
  if (files.length) {
    e.preventDefault();
    attach(files);
  }
});

// Keyboard shortcuts (listed in the help dialog).
document.addEventListener("keydown", (e) => {
  const snap = state.current?.snapshot;
  const busy = snap && (snap.state !== "idle" || snap.queued?.length > 0);
  if (e.key === "Escape" && busy && !document.querySelector("dialog[open]")) {
    e.preventDefault();
    $("cancel").click();
  } else if (e.key === "/" && (e.ctrlKey || e.metaKey)) {
    e.preventDefault();
    $("prompt-text").focus();
  }
});
$("help").addEventListener("click", () => $("help-dialog").showModal());
// A permission request waits for an answer: Esc does not dismiss it (and
// if it closes anyway, it opens again).
$("permission").addEventListener("cancel", (e) => e.preventDefault());
$("permission").addEventListener("close", () => scheduleRender());
$("session-search").addEventListener("input", renderSessions);
$("compact").addEventListener("click", async () => {
  const cur = state.current;
  if (!cur) return;
  try {
    await api("POST", `/api/sessions/${encodeURIComponent(cur.id)}/compact`);
  } catch (e) {
    $("form-status").textContent = String(e.message ?? e);
  }
});

$("cancel").addEventListener("click", async () => {
  const cur = state.current;
  if (cur) await api("POST", `/api/sessions/${cur.id}/cancel`);
});
$("new-session").addEventListener("click", newSession);
$("new-session-form").addEventListener("submit", (e) => {
  e.preventDefault();
  createSession();
});
$("new-close").addEventListener("click", () => $("new-session-dialog").close());
$("lang-select").addEventListener("change", (e) => setLanguage(e.target.value));
// A link in agent text to this machine asks first: another port of this
// host gets the page's cookie with the visit (browsers ignore ports).
$("transcript").addEventListener("click", (e) => {
  const a = e.target.closest?.(".markdown a[href]");
  if (!a) return;
  let url;
  try {
    url = new URL(a.href);
  } catch {
    e.preventDefault();
    return;
  }
  if (local(url) && !window.confirm(state.t("openLocal", { url: url.href }))) e.preventDefault();
});
$("transcript").addEventListener("scroll", (e) => {
  if (e.target.scrollTop < 20) loadOlder();
});

setLanguage(localStorage.getItem("tiller.lang") ?? pickLanguage(navigator.languages));
try {
  await loadSessions();
} catch (e) {
  if (e.status !== 401) throw e;
  // Not signed in: say how, and stop here.
  $("banners").replaceChildren(el("div", { class: "banner banner-error", role: "alert", id: "sign-in", text: state.t("signIn") }));
  throw e;
}
await loadEngines();
const wanted = location.hash.slice(1);
if (wanted && state.sessions.some((s) => s.id === wanted)) await openSession(wanted);
else if (state.sessions.length) await openSession(state.sessions[0].id);
