// Model engines against a local server that streams the real OpenAI and
// Anthropic wire formats: real tool calls through the session's pipeline,
// retries, cancel, steering, loop protection, permissions, MCP servers, the
// editor's fs/terminal methods, and config options.

import assert from "node:assert/strict";
import { existsSync, readFileSync, realpathSync, writeFileSync } from "node:fs";
import path from "node:path";
import { after, before, beforeEach, describe, test } from "node:test";

import { agentText, api, connectEditor, initialize, startDaemon, tempDir, textPrompt, transports } from "./lib/daemon.mjs";
import { mcpServerPath, startMcpHttp } from "./lib/mcp-server.mjs";
import { anthropic, openai, startMockModel, userSide } from "./lib/mockmodel.mjs";

const KEY = "sk-test-SECRET-0123456789abcdef";
let mock;
let daemon;
let c;
let dataDir;
let configPath;
const daemonEnv = { TILLER_TEST_MODEL_KEY: KEY, TILLER_TURN__STALL_TIMEOUT: "10s" };

before(async () => {
  mock = await startMockModel();
  const dir = tempDir();
  dataDir = dir;
  const config = path.join(dir, "tiller.toml");
  configPath = config;
  writeFileSync(
    config,
    `
[engine.mock-openai]
kind = "openai"
base_url = "${mock.url}/v1"
model = "mock-1"
models = ["mock-2"]
api_key_env = "TILLER_TEST_MODEL_KEY"
retry_base = "10ms"
max_retries = 2
request_timeout = "2s"

[engine.mock-anthropic]
kind = "anthropic"
base_url = "${mock.url}"
model = "claude-mock"
api_key_env = "TILLER_TEST_MODEL_KEY"
retry_base = "10ms"
context_window = 32000
prices = { input = 2.0, output = 10.0, currency = "EUR" }

[engine.mock-short]
kind = "openai"
base_url = "${mock.url}/v1"
model = "short"
max_requests_per_turn = 2
context_chars = 1000

[engine.mock-slow]
kind = "openai"
base_url = "${mock.url}/v1"
model = "slow"
request_timeout = "300ms"
max_retries = 1
retry_base = "10ms"

# The MCP servers these tests name (nothing else may be started).
[tools.mcp]
allowed_commands = [${JSON.stringify(process.execPath)}, "/nonexistent/mcp-server"]
allowed_hosts = ["127.0.0.1"]
`,
  );
  daemon = await startDaemon({ dataDir: dir, args: ["--config", config], env: daemonEnv });
  c = await transports.unix(daemon);
  await initialize(c);
});

after(async () => {
  if (process.env.DUMP_LOG) console.log(daemon?.log().split("\n").filter((l) => /panic|ERROR|WARN/.test(l)).join("\n"));
  c?.close();
  await daemon?.stop();
  await mock?.close();
});

beforeEach(() => {
  mock.replies.length = 0;
});

/** A session on `engine` in a fresh directory holding `files`. */
async function session(engine, files = {}, extra = {}) {
  const cwd = tempDir();
  for (const [name, text] of Object.entries(files)) writeFileSync(path.join(cwd, name), text);
  const res = await (extra.conn ?? c).request("session/new", {
    cwd,
    mcpServers: extra.mcpServers ?? [],
    _meta: { tiller: { engine } },
  });
  return { sid: res.sessionId, cwd, res };
}

const since = (n) => mock.requests.slice(n);
/** A request's conversation, without its system message. */
const chat = (req) => req.body.messages.filter((m) => m.role !== "system");
const toolResults = (req) => userSide(req).filter((m) => m.role === "tool");
const statuses = (conn, sid) =>
  conn.updates
    .filter((u) => u.sessionId === sid && u.update.sessionUpdate === "tool_call_update")
    .map((u) => [u.update.toolCallId, u.update.status])
    .filter(([, s]) => s === "completed" || s === "failed");

/** Polls `pred` (for conditions no notification announces). */
async function waitFor(pred, ms = 5000) {
  const end = Date.now() + ms;
  while (!pred()) {
    if (Date.now() > end) throw new Error("condition not met in time");
    await new Promise((r) => setTimeout(r, 5));
  }
}

async function rejection(promise) {
  try {
    await promise;
  } catch (e) {
    return e;
  }
  assert.fail("the prompt was expected to fail");
}

describe("OpenAI-compatible engine", () => {
  test("a multi-tool turn: parallel calls with split arguments run for real", async () => {
    const { sid, cwd } = await session("mock-openai", { "notes.txt": "alpha\nbeta\n" });
    const n = mock.requests.length;
    mock.reply(
      {
        events: openai.tools(
          [
            { id: "call_1", name: "read_file", args: { path: "notes.txt" } },
            { id: "call_2", name: "list_dir", args: { path: "." } },
          ],
          { pieces: 4 },
        ),
        split: 7, // SSE frames cut across writes too
      },
      { events: openai.text("Two entries found.") },
    );
    const res = await c.request("session/prompt", textPrompt(sid, "What is here?"));
    assert.equal(res.stopReason, "end_turn");
    await c.until(() => agentText(c, sid) === "Two entries found.");
    const [first, second] = since(n);
    assert.equal(first.path, "/v1/chat/completions");
    assert.equal(first.headers.authorization, `Bearer ${KEY}`);
    assert.equal(first.body.model, "mock-1");
    assert.equal(first.body.stream, true);
    const offered = first.body.tools.map((t) => t.function.name);
    for (const t of ["read_file", "write_file", "edit", "list_dir", "glob", "grep", "shell"]) assert.ok(offered.includes(t), t);
    assert.deepEqual(userSide(first).at(-1), { role: "user", text: "What is here?", id: undefined });
    const results = toolResults(second);
    assert.deepEqual(results.map((r) => r.id), ["call_1", "call_2"]);
    assert.equal(results[0].text, "alpha\nbeta\n");
    assert.equal(results[1].text, "notes.txt");
    assert.deepEqual(statuses(c, sid), [
      ["call_1", "completed"],
      ["call_2", "completed"],
    ]);
    const kinds = c.updates.filter((u) => u.sessionId === sid && u.update.sessionUpdate === "tool_call").map((u) => u.update.kind);
    assert.deepEqual(kinds, ["read", "search"]);
    // Editors can follow along: the call names the file it reads.
    const announced = c.updates.filter((u) => u.sessionId === sid && u.update.sessionUpdate === "tool_call");
    assert.deepEqual(announced[0].update.locations, [{ path: path.join(realpathSync(cwd), "notes.txt") }]);
    assert.deepEqual(announced[1].update.locations, [{ path: realpathSync(cwd) }]);
    // Usage is in the log; nothing was written to the directory.
    const h = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=200`);
    assert.ok(h.body.events.some((e) => e.type === "usage" && e.data.inputTokens === 11 && e.data.outputTokens === 7));
    assert.ok(existsSync(path.join(cwd, "notes.txt")));
  });

  test("usage_update after each model call: tokens in context, the window, the cost so far; kept in the snapshot", async () => {
    const { sid } = await session("mock-anthropic");
    mock.reply({ events: anthropic.text("One.", { input: 100, output: 20 }) }, { events: anthropic.text("Two.", { input: 150, output: 30 }) });
    await c.request("session/prompt", textPrompt(sid, "one"));
    await c.request("session/prompt", textPrompt(sid, "two"));
    const usage = () => c.updates.filter((u) => u.sessionId === sid && u.update.sessionUpdate === "usage_update").map((u) => u.update);
    await c.until(() => usage().length === 2);
    const [a, b] = usage();
    assert.deepEqual([a.used, a.size, b.used, b.size], [120, 32000, 180, 32000]);
    assert.equal(a.cost.currency, "EUR");
    assert.ok(Math.abs(a.cost.amount - (100 * 2 + 20 * 10) / 1e6) < 1e-12, JSON.stringify(a.cost));
    assert.ok(Math.abs(b.cost.amount - (250 * 2 + 50 * 10) / 1e6) < 1e-12, "cumulative");
    const snap = await api(daemon, "GET", `/api/sessions/${sid}`);
    assert.deepEqual(
      { i: snap.body.usage.inputTokens, o: snap.body.usage.outputTokens, used: snap.body.usage.used, w: snap.body.usage.contextWindow },
      { i: 250, o: 50, used: 180, w: 32000 },
    );
    // And the engine without prices reports no cost.
    const other = await session("mock-openai");
    mock.reply({ events: openai.text("Hi.") });
    await c.request("session/prompt", textPrompt(other.sid, "hi"));
    await c.until(() => c.updates.some((u) => u.sessionId === other.sid && u.update.sessionUpdate === "usage_update"));
    const plain = c.updates.find((u) => u.sessionId === other.sid && u.update.sessionUpdate === "usage_update").update;
    assert.deepEqual([plain.used, plain.size, plain.cost ?? null], [18, 128000, null]);
  });

  test("additionalDirectories: real tools read an additional root by absolute path, and nothing outside it", async () => {
    const lib = tempDir();
    const outside = tempDir();
    writeFileSync(path.join(lib, "lib.txt"), "from the lib root\n");
    writeFileSync(path.join(outside, "secret.txt"), "secret\n");
    const cwd = tempDir();
    const res = await c.request("session/new", {
      cwd,
      mcpServers: [],
      additionalDirectories: [lib],
      _meta: { tiller: { engine: "mock-openai" } },
    });
    const sid = res.sessionId;
    const n = mock.requests.length;
    mock.reply(
      {
        events: openai.tools([
          { id: "call_1", name: "read_file", args: { path: path.join(lib, "lib.txt") } },
          { id: "call_2", name: "read_file", args: { path: path.join(outside, "secret.txt") } },
        ]),
      },
      { events: openai.text("Read.") },
    );
    await c.request("session/prompt", textPrompt(sid, "read them"));
    const results = toolResults(since(n)[1]);
    assert.equal(results[0].text, "from the lib root\n");
    assert.match(results[1].text, /outside/);
    assert.doesNotMatch(results[1].text, /secret\n/);
  });

  test("an image reaches the model (Anthropic and OpenAI shapes) and comes back on session/load", async () => {
    const init = await c.request("initialize", { protocolVersion: 1, clientCapabilities: {} });
    assert.equal(init.agentCapabilities.promptCapabilities.image, true);
    const PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==";
    const prompt = (sid) => ({
      sessionId: sid,
      prompt: [{ type: "text", text: "what is this?" }, { type: "image", mimeType: "image/png", data: PNG }],
    });
    const a = await session("mock-anthropic");
    let n = mock.requests.length;
    mock.reply({ events: anthropic.text("A pixel.") });
    await c.request("session/prompt", prompt(a.sid));
    const sent = since(n)[0].body.messages.at(-1).content;
    assert.deepEqual(sent.map((b) => b.type), ["text", "image"]);
    assert.deepEqual(sent[1].source, { type: "base64", media_type: "image/png", data: PNG });
    const o = await session("mock-openai");
    n = mock.requests.length;
    mock.reply({ events: openai.text("A pixel.") });
    await c.request("session/prompt", prompt(o.sid));
    const last = since(n)[0].body.messages.at(-1);
    assert.equal(last.content[0].image_url.url, `data:image/png;base64,${PNG}`);
    // The log keeps it: a load replays the image with the text.
    const d = await transports.unix(daemon);
    try {
      await initialize(d);
      await d.request("session/load", { sessionId: a.sid, cwd: a.cwd, mcpServers: [] });
      const user = d.updates.filter((u) => u.sessionId === a.sid && u.update.sessionUpdate === "user_message_chunk");
      assert.deepEqual(user.map((u) => u.update.content.type), ["text", "image"]);
      assert.equal(user[0].update.messageId, user[1].update.messageId);
    } finally {
      d.close();
    }
  });

  test("boolean options: Anthropic's thinking switch, boolean for clients that take it, off/on for the others", async () => {
    const b = await transports.unix(daemon);
    try {
      await b.request("initialize", {
        protocolVersion: 1,
        clientCapabilities: { session: { configOptions: { boolean: {} } } },
      });
      const cwd = tempDir();
      const res = await b.request("session/new", { cwd, mcpServers: [], _meta: { tiller: { engine: "mock-anthropic" } } });
      const sid = res.sessionId;
      const thinking = res.configOptions.find((o) => o.id === "thinking");
      assert.deepEqual({ type: thinking.type, current: thinking.currentValue }, { type: "boolean", current: false });
      // A client without the capability gets an off/on select.
      const plain = await session("mock-anthropic");
      const sel = plain.res.configOptions.find((o) => o.id === "thinking");
      assert.deepEqual([sel.type, sel.currentValue, sel.options.map((o) => o.value)], ["select", "off", ["off", "on"]]);
      // OpenAI engines have no such switch.
      assert.ok(!(await session("mock-openai")).res.configOptions.some((o) => o.id === "thinking"));

      const set = await b.request("session/set_config_option", { sessionId: sid, configId: "thinking", type: "boolean", value: true });
      assert.equal(set.configOptions.find((o) => o.id === "thinking").currentValue, true);
      const n = mock.requests.length;
      mock.reply(
        { events: anthropic.thinking("Let me look.", "sig-123", anthropic.tools([{ id: "toolu_1", name: "list_dir", args: { path: "." } }])) },
        { events: anthropic.text("Empty.") },
      );
      await b.request("session/prompt", textPrompt(sid, "what is here?"));
      const [first, second] = since(n);
      assert.deepEqual(first.body.thinking, { type: "enabled", budget_tokens: 4096 });
      assert.ok(first.body.max_tokens > 4096);
      // The thinking block goes back, signed, before the tool call it led to.
      const assistant = second.body.messages.find((m) => m.role === "assistant");
      assert.deepEqual(assistant.content.map((c) => c.type), ["thinking", "tool_use"]);
      assert.deepEqual([assistant.content[0].thinking, assistant.content[0].signature], ["Let me look.", "sig-123"]);
      // The thought streamed to the client; off again: no thinking asked.
      assert.ok(b.updates.some((u) => u.sessionId === sid && u.update.sessionUpdate === "agent_thought_chunk"));
      await b.request("session/set_config_option", { sessionId: sid, configId: "thinking", type: "boolean", value: false });
      const m = mock.requests.length;
      mock.reply({ events: anthropic.text("Ok.") });
      await b.request("session/prompt", textPrompt(sid, "again"));
      assert.equal(since(m)[0].body.thinking, undefined);
      // The select form works too.
      await c.request("session/set_config_option", { sessionId: plain.sid, configId: "thinking", value: "on" });
      const snap = await c.request("session/resume", { sessionId: plain.sid, cwd: plain.cwd, mcpServers: [] });
      assert.equal(snap.configOptions.find((o) => o.id === "thinking").currentValue, "on");
    } finally {
      b.close();
    }
  });

  test("the model is told the agent's instructions, the environment and AGENTS.md (not CLAUDE.md beside it)", async () => {
    const { sid, cwd } = await session("mock-openai", {
      "AGENTS.md": "Project rule: run `make check` after every change.",
      "CLAUDE.md": "CLAUDE-ONLY RULE",
    });
    const n = mock.requests.length;
    mock.reply({ events: openai.text("ok") });
    await c.request("session/prompt", textPrompt(sid, "hello"));
    const [first, ...rest] = since(n)[0].body.messages;
    assert.equal(first.role, "system");
    for (const want of [
      "You are a coding agent",
      "read_file",
      `Working directory: ${cwd}`,
      "Git repository: no",
      "# Project rules (AGENTS.md)",
      "Project rule: run `make check` after every change.",
    ]) {
      assert.ok(first.content.includes(want), `${want} missing from the system message`);
    }
    assert.ok(!first.content.includes("CLAUDE-ONLY RULE"));
    assert.deepEqual(rest.map((m) => [m.role, m.content]), [["user", "hello"]]);
  });

  test("/compact over ACP: compaction_update for a client that takes it, _tiller/compaction for one that does not; the next call carries the summary", async () => {
    const capable = await transports.unix(daemon);
    await capable.request("initialize", { protocolVersion: 1, clientCapabilities: { session: { compaction: {} } } });
    const { sid } = await session("mock-openai", {}, { conn: capable });
    mock.reply({ events: openai.text("First answer.") });
    await capable.request("session/prompt", textPrompt(sid, "one"));
    const n = mock.requests.length;
    mock.reply({ events: openai.text("## Goal\nSay hello.") });
    const res = await capable.request("session/prompt", textPrompt(sid, "/compact"));
    assert.equal(res.stopReason, "end_turn");
    const summaryCall = since(n)[0].body;
    assert.match(summaryCall.messages[0].content, /You summarize a coding session/);
    assert.equal(summaryCall.tools, undefined, "no tools offered to a summary");
    const updates = capable.updates.filter((u) => u.sessionId === sid && u.update.sessionUpdate === "compaction_update");
    assert.deepEqual(
      updates.map((u) => [u.update.status, u.update.summary?.[0]?.text]),
      [["in_progress", undefined], ["completed", "## Goal\nSay hello."]],
    );
    assert.equal(updates[0].update.compactionId, updates[1].update.compactionId);
    assert.ok(!capable.ext.some((e) => e.method === "_tiller/compaction"));
    // The summary's text is not shown as agent text.
    assert.ok(!agentText(capable, sid).includes("Say hello"));
    mock.reply({ events: openai.text("Hello.") });
    await capable.request("session/prompt", textPrompt(sid, "two"));
    const next = chat(mock.requests.at(-1)).map((m) => m.content);
    assert.equal(next.length, 2);
    assert.match(next[0], /compacted into this summary[\s\S]*## Goal\nSay hello\.$/);
    assert.equal(next[1], "two");
    capable.close();

    // A client without the capability: the extension notification.
    const other = await session("mock-openai");
    mock.reply({ events: openai.text("First answer.") }, { events: openai.text("Summary.") });
    await c.request("session/prompt", textPrompt(other.sid, "one"));
    await c.request("session/prompt", textPrompt(other.sid, "/compact"));
    assert.ok(!c.updates.some((u) => u.sessionId === other.sid && u.update.sessionUpdate === "compaction_update"));
    const ext = c.ext.filter((e) => e.method === "_tiller/compaction" && e.params.sessionId === other.sid);
    assert.deepEqual(ext.map((e) => [e.params.status, e.params.summary]), [["in_progress", null], ["completed", "Summary."]]);
  });

  test("/compact over HTTP: 202, the compaction is in the history, a failed one says it fell back", async () => {
    const { sid } = await session("mock-openai");
    mock.reply({ events: openai.text("First answer.") });
    await c.request("session/prompt", textPrompt(sid, "one"));
    mock.reply({ events: openai.text("HTTP summary.") });
    const r = await api(daemon, "POST", `/api/sessions/${sid}/compact`);
    assert.equal(r.status, 202);
    assert.ok(r.body.promptId);
    const settled = async () => {
      for (let i = 0; i < 200; i++) {
        const h = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=200`);
        const done = h.body.events.filter((e) => e.type === "compaction" && e.data.status !== "in_progress");
        if (done.length) return done;
        await new Promise((res) => setTimeout(res, 25));
      }
      throw new Error("no compaction settled");
    };
    let done = await settled();
    assert.deepEqual([done[0].data.status, done[0].data.summary], ["completed", "HTTP summary."]);
    // A summary call the model refuses: the compaction fails and says the
    // window applies instead; the prompt fails with the reason.
    mock.reply({ status: 400, body: { error: { message: "too long to summarize" } } });
    const again = await api(daemon, "POST", `/api/sessions/${sid}/compact`);
    assert.equal(again.status, 202);
    for (let i = 0; i < 200 && (done = await settled()).length < 2; i++) await new Promise((res) => setTimeout(res, 25));
    assert.equal(done[1].data.status, "failed");
    assert.match(done[1].data.message, /too long to summarize.*left out of the context window instead/);
    assert.equal((await api(daemon, "POST", `/api/sessions/nope/compact`)).status, 404);
  });

  test("the todo tool sets the plan clients see; apply_patch and multi-edit change files for real", async () => {
    const { sid, cwd } = await session("mock-openai", { "a.txt": "one\ntwo\n" });
    await c.request("session/set_config_option", { sessionId: sid, configId: "permission_mode", value: "allow-all" });
    const todos = [
      { content: "patch a.txt", status: "completed" },
      { content: "edit it again", status: "in_progress" },
    ];
    mock.reply(
      {
        events: openai.tools([
          { id: "call_1", name: "apply_patch", args: { patch: "--- a/a.txt\n+++ b/a.txt\n@@ -1,2 +1,2 @@\n one\n-two\n+2\n" } },
          { id: "call_2", name: "edit", args: { path: "a.txt", edits: [{ old_string: "one", new_string: "1" }, { old_string: "2", new_string: "two!" }] } },
          { id: "call_3", name: "todo", args: { todos } },
        ]),
      },
      { events: openai.text("Done.") },
    );
    await c.request("session/prompt", textPrompt(sid, "go"));
    assert.equal(readFileSync(path.join(cwd, "a.txt"), "utf8"), "1\ntwo!\n");
    const plans = c.updates.filter((u) => u.sessionId === sid && u.update.sessionUpdate === "plan");
    assert.deepEqual(
      plans.at(-1).update.entries.map((e) => [e.content, e.status]),
      todos.map((t) => [t.content, t.status]),
    );
    const kinds = Object.fromEntries(
      c.updates.filter((u) => u.sessionId === sid && u.update.sessionUpdate === "tool_call").map((u) => [u.update.title, u.update.kind]),
    );
    assert.deepEqual(kinds, { apply_patch: "edit", edit: "edit", todo: "think" });
  });

  test("the conversation carries over to the next prompt", async () => {
    const { sid } = await session("mock-openai");
    const n = mock.requests.length;
    mock.reply({ events: openai.text("First answer.") }, { events: openai.text("Second answer.") });
    await c.request("session/prompt", textPrompt(sid, "one"));
    await c.request("session/prompt", textPrompt(sid, "two"));
    const msgs = chat(since(n)[1]).map((m) => [m.role, m.content]);
    assert.deepEqual(msgs, [
      ["user", "one"],
      ["assistant", "First answer."],
      ["user", "two"],
    ]);
  });

  test("an error mid-stream fails the prompt with model_stream_interrupted", async () => {
    const { sid } = await session("mock-openai");
    mock.reply({ events: openai.text("Partial answer that never").slice(0, 3), drop: true });
    const e = await rejection(c.request("session/prompt", textPrompt(sid, "go")));
    assert.equal(e.code, -32603);
    assert.equal(e.data.errorKind, "model_stream_interrupted");
    assert.ok(agentText(c, sid).startsWith("Partial"));
    // The session goes on, and the model sees what the user saw.
    const n = mock.requests.length;
    mock.reply({ events: openai.text("Recovered.") });
    const res = await c.request("session/prompt", textPrompt(sid, "again"));
    assert.equal(res.stopReason, "end_turn");
    assert.deepEqual(
      chat(since(n)[0]).map((m) => [m.role, m.content]),
      [
        ["user", "go"],
        ["assistant", "Partial answer "],
        ["user", "again"],
      ],
    );
  });

  test("429, then success: retried with backoff before the first token", async () => {
    const { sid } = await session("mock-openai");
    const n = mock.requests.length;
    mock.reply(
      { status: 429, headers: { "retry-after": "0" }, body: { error: { type: "rate_limit", message: "slow down" } } },
      { status: 503, body: { error: { type: "server_error", message: "busy" } } },
      { events: openai.text("Made it.") },
    );
    const res = await c.request("session/prompt", textPrompt(sid, "go"));
    assert.equal(res.stopReason, "end_turn");
    assert.equal(since(n).length, 3);
    await c.until(() => agentText(c, sid) === "Made it.");
  });

  test("retries run out: the turn fails with the provider's reason", async () => {
    const { sid } = await session("mock-openai");
    const busy = { status: 500, body: { error: { type: "server_error", message: "down for maintenance" } } };
    mock.reply(busy, busy, busy);
    const e = await rejection(c.request("session/prompt", textPrompt(sid, "go")));
    assert.equal(e.data.errorKind, "model_stream_interrupted");
    assert.match(e.message, /HTTP 500.*down for maintenance/);
  });

  test("cancel mid-stream aborts the HTTP stream", async () => {
    const { sid } = await session("mock-openai");
    const n = mock.requests.length;
    mock.reply({ events: openai.text("Thinking about it").slice(0, 2), hang: true });
    const pending = c.request("session/prompt", textPrompt(sid, "go"));
    await c.until(() => agentText(c, sid).length > 0);
    await c.notify("session/cancel", { sessionId: sid });
    const res = await pending;
    await waitFor(() => mock.closed.length > 0 && since(n)[0].closedEarly, 3000);
    assert.equal(res.stopReason, "cancelled");
    assert.ok(since(n)[0].closedEarly, "the model stream was closed by the daemon");
  });

  test("a prompt sent as a cancel is answered waits for the engine, and sees the text the cancelled call streamed", async () => {
    const { sid } = await session("mock-openai");
    const n = mock.requests.length;
    mock.reply({ events: openai.text("Thinking about it").slice(0, 2), hang: true }, { events: openai.text("Next answer.") });
    const pending = c.request("session/prompt", textPrompt(sid, "go"));
    await c.until(() => agentText(c, sid).length > 0);
    await c.notify("session/cancel", { sessionId: sid });
    assert.equal((await pending).stopReason, "cancelled");
    // Sent at once: it waits for the cancelled turn's engine to stop, so
    // what that engine kept of its turn is in the conversation first.
    const next = await c.request("session/prompt", textPrompt(sid, "next"));
    assert.equal(next.stopReason, "end_turn");
    assert.deepEqual(
      chat(since(n)[1]).map((m) => [m.role, m.content]),
      [
        ["user", "go"],
        ["assistant", "Thinking "],
        ["user", "next"],
      ],
    );
  });

  test("a steer mid-turn joins the conversation at the next model boundary", async () => {
    const { sid } = await session("mock-openai", { "a.txt": "A" });
    const n = mock.requests.length;
    mock.reply(
      { events: openai.tools([{ id: "call_s", name: "read_file", args: { path: "a.txt" } }]), pace: 60 },
      { events: openai.text("Focusing on tests as asked.") },
    );
    const pending = c.request("session/prompt", textPrompt(sid, "Review the code"));
    // While the first response still streams.
    await waitFor(() => mock.requests.length > n);
    const answer = await c.request("_session/steering", {
      sessionId: sid,
      prompt: [{ type: "text", text: "Only look at the tests." }],
    });
    assert.equal(answer.outcome, "injected");
    const res = await pending;
    assert.equal(res.stopReason, "end_turn");
    const second = since(n)[1];
    const side = userSide(second);
    const steer = side.findIndex((m) => m.role === "user" && m.text === "Only look at the tests.");
    const result = side.findIndex((m) => m.role === "tool" && m.id === "call_s");
    assert.ok(steer > result && result >= 0, JSON.stringify(side));
    const h = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=200`);
    assert.ok(h.body.events.some((e) => e.type === "steer_consumed" && e.data.steerId === answer.steerId));
    assert.ok(!h.body.events.some((e) => e.type === "steer_dropped"));
  });

  test("loop protection trips on real tool calls; the next prompt works", async () => {
    const { sid } = await session("mock-openai", { "same.txt": "same" });
    const n = mock.requests.length;
    const same = [1, 2, 3, 4, 5, 6].map((i) => ({ id: `call_l${i}`, name: "read_file", args: { path: "same.txt" } }));
    mock.reply({ events: openai.tools(same) });
    const e = await rejection(c.request("session/prompt", textPrompt(sid, "read it")));
    if (e.data.errorKind !== "loop_detected") console.log(daemon.log().split("\n").slice(-30).join("\n"));
    assert.equal(e.code, -32603);
    assert.equal(e.data.errorKind, "loop_detected");
    assert.equal(e.data.loopType, "consecutive_identical_tool_calls");
    await c.until(() => statuses(c, sid).length === 6);
    const st = statuses(c, sid).map(([, s]) => s);
    assert.deepEqual(st, ["completed", "completed", "completed", "completed", "failed", "failed"]);
    assert.equal(since(n).length, 1, "the engine was stopped: no further model call");
    mock.reply({ events: openai.text("Okay.") });
    const res = await c.request("session/prompt", textPrompt(sid, "something else"));
    assert.equal(res.stopReason, "end_turn");
    // Every call the model made has a result in the conversation.
    const msgs = since(n)[1].body.messages;
    const callIds = msgs.flatMap((m) => (m.tool_calls ?? []).map((t) => t.id));
    const resultIds = msgs.filter((m) => m.role === "tool").map((m) => m.tool_call_id);
    assert.deepEqual(resultIds, callIds);
  });

  test("permission: a denied write does not run, an allowed one does", async () => {
    const { sid, cwd } = await session("mock-openai");
    const n = mock.requests.length;
    mock.reply(
      { events: openai.tools([{ id: "call_w1", name: "write_file", args: { path: "denied.txt", content: "no" } }]) },
      { events: openai.tools([{ id: "call_w2", name: "write_file", args: { path: "allowed.txt", content: "yes" } }]) },
      { events: openai.text("Done writing.") },
    );
    const answers = ["reject_once", "allow_once"];
    c.answer = async (params) => {
      assert.equal(params.sessionId, sid);
      return { outcome: { outcome: "selected", optionId: answers.shift() } };
    };
    try {
      const res = await c.request("session/prompt", textPrompt(sid, "write files"));
      assert.equal(res.stopReason, "end_turn");
    } finally {
      c.answer = async () => ({ outcome: { outcome: "selected", optionId: "reject_once" } });
    }
    assert.ok(!existsSync(path.join(cwd, "denied.txt")));
    assert.equal(readFileSync(path.join(cwd, "allowed.txt"), "utf8"), "yes");
    await c.until(() => statuses(c, sid).length === 2);
    const denied = toolResults(since(n)[1])[0];
    assert.match(denied.text, /denied/);
    assert.deepEqual(statuses(c, sid), [
      ["call_w1", "failed"],
      ["call_w2", "completed"],
    ]);
  });

  test("cancel while a command runs stops the command and fails the call", async () => {
    const { sid, cwd } = await session("mock-openai");
    await c.request("session/set_config_option", { sessionId: sid, configId: "permission_mode", value: "allow-all" });
    mock.reply({ events: openai.tools([{ id: "call_sh", name: "shell", args: { command: "sleep 1; touch late.txt" } }]) });
    const pending = c.request("session/prompt", textPrompt(sid, "run it"));
    await c.until(() =>
      c.updates.some(
        (u) => u.sessionId === sid && u.update.sessionUpdate === "tool_call_update" && u.update.status === "in_progress",
      ),
    );
    await c.notify("session/cancel", { sessionId: sid });
    assert.equal((await pending).stopReason, "cancelled");
    await c.until(() => statuses(c, sid).length === 1);
    assert.deepEqual(statuses(c, sid), [["call_sh", "failed"]]);
    await new Promise((r) => setTimeout(r, 1500));
    assert.ok(!existsSync(path.join(cwd, "late.txt")), "the command was killed with its turn");
  });

  test("a request that gets no answer is bounded by request_timeout", async () => {
    const { sid } = await session("mock-slow");
    mock.reply({ waitHeaders: 1500 }, { waitHeaders: 1500 });
    const e = await rejection(c.request("session/prompt", textPrompt(sid, "go")));
    assert.equal(e.data.errorKind, "model_stream_interrupted");
    assert.match(e.message, /no response from the model within 0.3s/);
  });

  test("max_requests_per_turn bounds the model calls of one turn", async () => {
    const { sid } = await session("mock-short", { "f.txt": "x" });
    const n = mock.requests.length;
    const again = () => ({ events: openai.tools([{ id: `call_r${Math.random()}`, name: "list_dir", args: {} }]) });
    mock.reply(again(), again(), again());
    const res = await c.request("session/prompt", textPrompt(sid, "loop forever"));
    assert.equal(res.stopReason, "max_turn_requests");
    assert.equal(since(n).length, 2);
  });

  test("old turns are left out of a call when the conversation outgrows context_chars", async () => {
    const { sid } = await session("mock-short");
    const n = mock.requests.length;
    const long = (i) => `turn ${i} ` + "x".repeat(300);
    for (let i = 0; i < 5; i++) {
      mock.reply({ events: openai.text(`answer ${i}`) });
      await c.request("session/prompt", textPrompt(sid, long(i)));
    }
    const last = chat(since(n).at(-1));
    assert.match(last[0].content, /left out to fit the model's context window/);
    assert.deepEqual(
      last.slice(1).map((m) => [m.role, m.content.slice(0, 8)]),
      // Three ~315-char turns fit 1000 chars; a fourth would not.
      [
        ["user", "turn 2 x"],
        ["assistant", "answer 2"],
        ["user", "turn 3 x"],
        ["assistant", "answer 3"],
        ["user", "turn 4 x"],
      ],
    );
  });

  test("stop reasons: length is max_tokens", async () => {
    const { sid } = await session("mock-openai");
    mock.reply({ events: openai.text("Cut", { finish: "length" }) });
    const res = await c.request("session/prompt", textPrompt(sid, "go"));
    assert.equal(res.stopReason, "max_tokens");
  });

  test("the API key never appears in errors or logs", async () => {
    const { sid } = await session("mock-openai");
    mock.reply({ status: 401, body: { error: { type: "invalid_request_error", message: `Incorrect API key provided: ${KEY}.` } } });
    const e = await rejection(c.request("session/prompt", textPrompt(sid, "go")));
    assert.match(e.message, /HTTP 401/);
    const seen = e.message + JSON.stringify(e.data);
    assert.ok(!seen.includes(KEY));
    assert.ok(seen.includes("[redacted]"), seen);
    const h = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=200`);
    assert.ok(!JSON.stringify(h.body).includes(KEY));
    assert.ok(!daemon.log().includes(KEY));
  });

  test("session/set_config_option switches the model", async () => {
    const { sid, res } = await session("mock-openai");
    const model = res.configOptions.find((o) => o.id === "model");
    assert.equal(model.currentValue, "mock-1");
    assert.deepEqual(model.options.map((o) => o.value), ["mock-1", "mock-2"]);
    assert.ok(res.configOptions.some((o) => o.id === "permission_mode" && o.currentValue === "ask"));
    const set = await c.request("session/set_config_option", { sessionId: sid, configId: "model", value: "mock-2" });
    assert.equal(set.configOptions.find((o) => o.id === "model").currentValue, "mock-2");
    await c.until(() => c.updates.some((u) => u.sessionId === sid && u.update.sessionUpdate === "config_option_update"));
    const n = mock.requests.length;
    mock.reply({ events: openai.text("From mock-2.") });
    await c.request("session/prompt", textPrompt(sid, "go"));
    assert.equal(since(n)[0].body.model, "mock-2");
    const bad = await rejection(c.request("session/set_config_option", { sessionId: sid, configId: "model", value: "gpt-9" }));
    assert.equal(bad.code, -32602);
    const unknown = await rejection(c.request("session/set_config_option", { sessionId: sid, configId: "colour", value: "red" }));
    assert.equal(unknown.code, -32602);
    // allow-all: a write runs without asking.
    await c.request("session/set_config_option", { sessionId: sid, configId: "permission_mode", value: "allow-all" });
    const before = c.permissionRequests.length;
    mock.reply(
      { events: openai.tools([{ id: "call_aa", name: "shell", args: { command: "echo hi > hi.txt" } }]) },
      { events: openai.text("ok") },
    );
    await c.request("session/prompt", textPrompt(sid, "go"));
    assert.equal(c.permissionRequests.length, before);
    await c.until(() => statuses(c, sid).some(([id]) => id === "call_aa"));
    assert.deepEqual(statuses(c, sid).at(-1), ["call_aa", "completed"]);
  });
});

describe("Anthropic engine", () => {
  test("a multi-tool turn with split tool input", async () => {
    const { sid } = await session("mock-anthropic", { "lib.rs": "fn main() {}\n// TODO: tests\n" });
    const n = mock.requests.length;
    mock.reply(
      {
        events: anthropic.tools(
          [
            { id: "toolu_1", name: "grep", args: { pattern: "TODO" } },
            { id: "toolu_2", name: "glob", args: { pattern: "*.rs" } },
          ],
          { pieces: 5 },
        ),
        split: 11,
      },
      { events: anthropic.text("One TODO in lib.rs.") },
    );
    const res = await c.request("session/prompt", textPrompt(sid, "Find TODOs"));
    assert.equal(res.stopReason, "end_turn");
    await c.until(() => agentText(c, sid) === "One TODO in lib.rs.");
    const [first, second] = since(n);
    assert.equal(first.path, "/v1/messages");
    assert.equal(first.headers["x-api-key"], KEY);
    assert.equal(first.headers["anthropic-version"], "2023-06-01");
    assert.equal(first.body.max_tokens, 8192);
    assert.ok(first.body.tools.some((t) => t.name === "grep" && t.input_schema.type === "object"));
    const results = toolResults(second);
    assert.deepEqual(results.map((r) => r.id), ["toolu_1", "toolu_2"]);
    assert.equal(results[0].text, "lib.rs:2: // TODO: tests\n");
    assert.equal(results[1].text, "lib.rs");
  });

  test("an error event mid-stream fails the prompt; 529 is retried", async () => {
    const { sid } = await session("mock-anthropic");
    mock.reply(
      { status: 529, body: { type: "error", error: { type: "overloaded_error", message: "Overloaded" } } },
      {
        events: [
          ...anthropic.text("Starting now").slice(0, 4),
          { event: "error", data: { type: "error", error: { type: "api_error", message: "Internal server error" } } },
        ],
      },
    );
    const e = await rejection(c.request("session/prompt", textPrompt(sid, "go")));
    assert.equal(e.data.errorKind, "model_stream_interrupted");
    assert.match(e.message, /api_error: Internal server error/);
  });

  test("a steer mid-turn joins the conversation after the tool results", async () => {
    const { sid } = await session("mock-anthropic", { "a.txt": "A" });
    const n = mock.requests.length;
    mock.reply(
      { events: anthropic.tools([{ id: "toolu_s", name: "read_file", args: { path: "a.txt" } }]), pace: 60 },
      { events: anthropic.text("Steered.") },
    );
    const pending = c.request("session/prompt", textPrompt(sid, "Review"));
    await waitFor(() => mock.requests.length > n);
    const answer = await c.request("_session/steering", { sessionId: sid, prompt: [{ type: "text", text: "Be brief." }] });
    assert.equal(answer.outcome, "injected");
    assert.equal((await pending).stopReason, "end_turn");
    // One user message: the tool result first, then the steer.
    const last = since(n)[1].body.messages.at(-1);
    assert.equal(last.role, "user");
    assert.deepEqual(
      last.content.map((b) => b.type),
      ["tool_result", "text"],
    );
    assert.equal(last.content[1].text, "Be brief.");
  });

  test("refusal maps to the refusal stop reason", async () => {
    const { sid } = await session("mock-anthropic");
    mock.reply({ events: anthropic.text("I can't help with that.", { stop: "refusal" }) });
    const res = await c.request("session/prompt", textPrompt(sid, "go"));
    assert.equal(res.stopReason, "refusal");
  });

  test("cancel mid-stream aborts the HTTP stream", async () => {
    const { sid } = await session("mock-anthropic");
    const n = mock.requests.length;
    mock.reply({ events: anthropic.text("Let me think").slice(0, 4), hang: true });
    const pending = c.request("session/prompt", textPrompt(sid, "go"));
    await c.until(() => agentText(c, sid).length > 0);
    await c.notify("session/cancel", { sessionId: sid });
    assert.equal((await pending).stopReason, "cancelled");
    await waitFor(() => since(n)[0].closedEarly, 3000);
  });
});

describe("MCP servers from session/new", () => {
  test("stdio and HTTP servers' tools are offered and called", async () => {
    const web = await startMcpHttp();
    try {
      const { sid } = await session("mock-openai", {}, {
        mcpServers: [
          { name: "calc", command: process.execPath, args: [mcpServerPath], env: [] },
          { type: "http", name: "web", url: web.url, headers: [] },
        ],
      });
      const n = mock.requests.length;
      mock.reply(
        {
          events: openai.tools([
            { id: "call_m1", name: "calc__add", args: { a: 2, b: 3 } },
            { id: "call_m2", name: "web__add", args: { a: 5, b: 7 } },
            { id: "call_m3", name: "calc__fail", args: {} },
          ]),
        },
        { events: openai.text("5 and 12.") },
      );
      const res = await c.request("session/prompt", textPrompt(sid, "add"));
      assert.equal(res.stopReason, "end_turn");
      const offered = since(n)[0].body.tools.map((t) => t.function.name);
      for (const t of ["calc__add", "calc__fail", "web__add", "web__fail"]) assert.ok(offered.includes(t), t);
      const results = toolResults(since(n)[1]);
      assert.deepEqual(results.map((r) => r.text), ["sum=5", "sum=12", "it broke"]);
      assert.deepEqual(web.calls, [{ tool: "add", a: 5, b: 7 }]);
      await c.until(() => statuses(c, sid).length === 3);
      assert.deepEqual(statuses(c, sid).map(([, s]) => s), ["completed", "completed", "failed"]);
      const h = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=200`);
      const servers = h.body.events.filter((e) => e.type === "mcp_server").map((e) => [e.data.name, e.data.tools.length]);
      assert.deepEqual(servers.sort(), [["calc", 2], ["web", 2]]);
    } finally {
      await web.close();
    }
  });

  test("a server that cannot start is reported, and the session still works", async () => {
    const { sid } = await session("mock-openai", {}, {
      mcpServers: [{ name: "broken", command: "/nonexistent/mcp-server", args: [], env: [] }],
    });
    const h = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=50`);
    const ev = h.body.events.find((e) => e.type === "mcp_server");
    assert.equal(ev.data.name, "broken");
    assert.match(ev.data.error, /cannot start/);
    mock.reply({ events: openai.text("Fine.") });
    assert.equal((await c.request("session/prompt", textPrompt(sid, "go"))).stopReason, "end_turn");
  });
});

describe("the editor's fs and terminal methods", () => {
  test("reads, edits and commands go through the client that offers them", async () => {
    const ed = await connectEditor(daemon);
    try {
      await ed.request("initialize", {
        protocolVersion: 1,
        clientCapabilities: { fs: { readTextFile: true, writeTextFile: true }, terminal: true },
      });
      const { sid, cwd } = await session("mock-openai", { "main.rs": "on disk" }, { conn: ed });
      const buffers = new Map([[path.join(cwd, "main.rs"), "unsaved buffer"]]);
      ed.onClient = async (method, params) => {
        assert.equal(params.sessionId, sid);
        switch (method) {
          case "fs/read_text_file":
            return { content: buffers.get(params.path) };
          case "fs/write_text_file":
            buffers.set(params.path, params.content);
            return {};
          case "terminal/create":
            assert.deepEqual(params.args, ["-c", "cargo test"]);
            assert.equal(params.cwd, cwd);
            return { terminalId: "term-1" };
          case "terminal/wait_for_exit":
            return { exitCode: 0, signal: null };
          case "terminal/output":
            return { output: "test result: ok", truncated: false, exitStatus: { exitCode: 0, signal: null } };
          default:
            return {};
        }
      };
      ed.answer = async () => ({ outcome: { outcome: "selected", optionId: "allow_always" } });
      const n = mock.requests.length;
      mock.reply(
        {
          events: openai.tools([
            { id: "call_e1", name: "read_file", args: { path: "main.rs" } },
            { id: "call_e2", name: "edit", args: { path: "main.rs", old_string: "unsaved", new_string: "edited" } },
            { id: "call_e3", name: "shell", args: { command: "cargo test" } },
          ]),
        },
        { events: openai.text("All good.") },
      );
      const res = await ed.request("session/prompt", textPrompt(sid, "check"));
      assert.equal(res.stopReason, "end_turn");
      const results = toolResults(since(n)[1]);
      assert.equal(results[0].text, "unsaved buffer");
      assert.match(results[2].text, /test result: ok/);
      assert.equal(buffers.get(path.join(cwd, "main.rs")), "edited buffer");
      assert.equal(readFileSync(path.join(cwd, "main.rs"), "utf8"), "on disk");
      const methods = ed.clientRequests.map((r) => r.method);
      assert.deepEqual(methods, [
        "fs/read_text_file",
        "fs/read_text_file",
        "fs/write_text_file",
        "terminal/create",
        "terminal/wait_for_exit",
        "terminal/output",
        "terminal/release",
      ]);
      // A command past its timeout is killed in the editor's terminal.
      ed.clientRequests.length = 0;
      const base = ed.onClient;
      ed.onClient = async (method, params) => {
        if (method === "terminal/wait_for_exit") return new Promise(() => {}); // never exits
        if (method === "terminal/kill") return {};
        if (method === "terminal/output") return { output: "still going", truncated: false, exitStatus: null };
        if (method === "terminal/create") return { terminalId: "term-2" };
        return base(method, params);
      };
      const m = mock.requests.length;
      mock.reply(
        { events: openai.tools([{ id: "call_e4", name: "shell", args: { command: "sleep 100", timeout_ms: 200 } }]) },
        { events: openai.text("It timed out.") },
      );
      assert.equal((await ed.request("session/prompt", textPrompt(sid, "slow"))).stopReason, "end_turn");
      assert.deepEqual(ed.clientRequests.map((r) => r.method), [
        "terminal/create",
        "terminal/wait_for_exit",
        "terminal/kill",
        "terminal/output",
        "terminal/release",
      ]);
      const timedOut = toolResults(since(m)[1]).at(-1);
      assert.match(timedOut.text, /still going[\s\S]*killed after the 200ms timeout/);
    } finally {
      ed.close();
    }
  });
});

describe("HTTP and restarts", () => {
  test("HTTP picks the engine and changes options; unknown engines are 400", async () => {
    const bad = await api(daemon, "POST", "/api/sessions", { cwd: tempDir(), engine: "gpt-9" });
    assert.equal(bad.status, 400);
    assert.match(bad.body.error.message, /unknown engine `gpt-9`.*mock-openai/);
    const rel = await api(daemon, "POST", "/api/sessions", { cwd: "relative/dir" });
    assert.equal(rel.status, 400);
    const noCwd = await api(daemon, "POST", "/api/sessions", { engine: "mock-openai" });
    assert.equal(noCwd.status, 400);
    assert.match(noCwd.body.error.message, /cwd is required/);
    const gone = await api(daemon, "POST", "/api/sessions", { cwd: "/nonexistent/tiller-dir", engine: "mock-openai" });
    assert.equal(gone.status, 400);
    assert.match(gone.body.error.message, /nonexistent\/tiller-dir is not a directory/);
    const acpGone = await rejection(
      c.request("session/new", { cwd: "/nonexistent/tiller-dir", mcpServers: [], _meta: { tiller: { engine: "mock-anthropic" } } }),
    );
    assert.equal(acpGone.code, -32602);
    assert.equal(acpGone.data.field, "cwd");
    const made = await api(daemon, "POST", "/api/sessions", { cwd: tempDir(), engine: "mock-openai" });
    assert.equal(made.status, 201);
    const id = made.body.id;
    const opts = await api(daemon, "GET", `/api/sessions/${id}/options`);
    assert.deepEqual(
      opts.body.options.map((o) => [o.id, o.current]),
      [["engine", "mock-openai"], ["model", "mock-1"], ["permission_mode", "ask"]],
    );
    const set = await api(daemon, "PUT", `/api/sessions/${id}/options/model`, { value: "mock-2" });
    assert.equal(set.status, 200);
    assert.equal(set.body.options.find((o) => o.id === "model").current, "mock-2");
    const wrong = await api(daemon, "PUT", `/api/sessions/${id}/options/model`, { value: "nope" });
    assert.equal(wrong.status, 400);
    const n = mock.requests.length;
    mock.reply({ events: openai.text("Via HTTP.") });
    const p = await api(daemon, "POST", `/api/sessions/${id}/prompts`, { text: "hello" });
    assert.equal(p.status, 202);
    await waitFor(() => mock.requests.length > n);
    assert.equal(since(n)[0].body.model, "mock-2");
  });

  test("a session switches engine between turns and keeps its conversation", async () => {
    const { sid, res } = await session("mock-openai");
    const engine = res.configOptions.find((o) => o.id === "engine");
    assert.equal(engine.currentValue, "mock-openai");
    assert.ok(engine.options.some((o) => o.value === "mock-anthropic"));
    const n = mock.requests.length;
    mock.reply({ events: openai.text("From OpenAI.") }, { events: anthropic.text("From Anthropic.") });
    await c.request("session/prompt", textPrompt(sid, "first"));
    const set = await c.request("session/set_config_option", { sessionId: sid, configId: "engine", value: "mock-anthropic" });
    assert.equal(set.configOptions.find((o) => o.id === "model").currentValue, "claude-mock");
    await c.request("session/prompt", textPrompt(sid, "second"));
    const [a, b] = since(n);
    assert.equal(a.path, "/v1/chat/completions");
    assert.equal(b.path, "/v1/messages");
    assert.deepEqual(
      b.body.messages.map((m) => [m.role, m.content.map((x) => x.text).join("")]),
      [
        ["user", "first"],
        ["assistant", "From OpenAI."],
        ["user", "second"],
      ],
    );
    const bad = await rejection(c.request("session/set_config_option", { sessionId: sid, configId: "engine", value: "nope" }));
    assert.equal(bad.code, -32602);
  });

  test("a session keeps its engine, options and conversation across a restart", async () => {
    const { sid } = await session("mock-anthropic");
    await c.request("session/set_config_option", { sessionId: sid, configId: "permission_mode", value: "accept-edits" });
    mock.reply({ events: anthropic.text("Remember the number 42.") });
    await c.request("session/prompt", textPrompt(sid, "Pick a number"));
    // "Always allow" is remembered across the restart too.
    const other = await session("mock-openai");
    mock.reply(
      { events: openai.tools([{ id: "call_a1", name: "shell", args: { command: "echo one" } }]) },
      { events: openai.text("ok") },
    );
    c.answer = async () => ({ outcome: { outcome: "selected", optionId: "allow_always" } });
    await c.request("session/prompt", textPrompt(other.sid, "run"));
    c.close();
    await daemon.stop();
    daemon = await startDaemon({ dataDir, args: ["--config", configPath], env: daemonEnv });
    c = await transports.unix(daemon);
    await initialize(c);
    await c.request("session/load", { sessionId: sid, cwd: "/", mcpServers: [] });
    const opts = await api(daemon, "GET", `/api/sessions/${sid}/options`);
    assert.equal(opts.body.options.find((o) => o.id === "permission_mode").current, "accept-edits");
    const n = mock.requests.length;
    mock.reply({ events: anthropic.text("It was 42.") });
    const res = await c.request("session/prompt", textPrompt(sid, "Which number?"));
    assert.equal(res.stopReason, "end_turn");
    const req = since(n)[0];
    assert.equal(req.path, "/v1/messages", "still the Anthropic engine");
    mock.reply(
      // "Always allow" on `echo one` covers commands starting `echo one`.
      { events: openai.tools([{ id: "call_a2", name: "shell", args: { command: "echo one two" } }]) },
      { events: openai.text("ok") },
    );
    await c.request("session/resume", { sessionId: other.sid, cwd: "/", mcpServers: [] });
    await c.request("session/prompt", textPrompt(other.sid, "run again"));
    assert.equal(c.permissionRequests.length, 0, "no permission asked after the restart");
    assert.match(toolResults(mock.requests.at(-1)).at(-1).text, /one two/);
    assert.deepEqual(
      req.body.messages.map((m) => [m.role, m.content.map((b) => b.text).join("")]),
      [
        ["user", "Pick a number"],
        ["assistant", "Remember the number 42."],
        ["user", "Which number?"],
      ],
    );
  });
});

describe("Web Shell with model engines", () => {
  test("a session on a chosen engine and model, from the browser", async () => {
    const { launch, page: newPage, screenshot } = await import("./lib/browser.mjs");
    const { createRequire } = await import("node:module");
    const AXE = readFileSync(createRequire(import.meta.url).resolve("axe-core/axe.min.js"), "utf8");
    const browser = await launch();
    try {
      // axe is injected inline: this page bypasses the Web Shell's CSP.
      const p = await newPage(browser, { bypassCSP: true });
      await p.goto(`${daemon.http}/?token=${daemon.token}`);
      await p.waitForSelector("#new-engine option[value='mock-openai']", { state: "attached" });
      await p.click("#new-session");
      const cwd = tempDir();
      await p.fill("#new-cwd", cwd);
      await p.selectOption("#new-engine", "mock-openai");
      // The dialog passes an accessibility check.
      await p.addScriptTag({ content: AXE });
      const violations = await p.evaluate(async () => {
        const r = await window.axe.run(document, { resultTypes: ["violations"] });
        return r.violations.filter((v) => v.impact === "serious" || v.impact === "critical").map((v) => v.id);
      });
      assert.deepEqual(violations, []);
      await p.click("#new-create");
      await p.waitForFunction((dir) => document.querySelector("#session-title")?.textContent.includes(dir), cwd);
      await p.waitForSelector("#option-model");
      assert.equal(await p.inputValue("#option-model"), "mock-1");
      await p.selectOption("#option-model", "mock-2");
      const sid = await p.evaluate(() => location.hash.slice(1));
      for (let i = 0; i < 100; i++) {
        const o = await api(daemon, "GET", `/api/sessions/${sid}/options`);
        if (o.body.options.find((x) => x.id === "model").current === "mock-2") break;
        await new Promise((r) => setTimeout(r, 20));
      }
      const n = mock.requests.length;
      mock.reply({ events: openai.text("Hello from the browser.") });
      await p.fill("#prompt-text", "hi");
      await p.click("#send");
      await p.waitForFunction(() => document.querySelector("#transcript")?.textContent.includes("Hello from the browser."));
      assert.equal(since(n)[0].body.model, "mock-2");
      const rec = await api(daemon, "GET", `/api/sessions/${sid}`);
      assert.equal(rec.body.cwd, cwd);
      // Another client changes the mode: the page follows.
      await api(daemon, "PUT", `/api/sessions/${sid}/options/permission_mode`, { value: "allow-all" });
      await p.waitForFunction(() => document.querySelector("#option-permission_mode")?.value === "allow-all");
      await screenshot(p, "webshell-model-engine");
      // Usage: tokens in context against the model's window.
      await p.waitForFunction(() => !document.querySelector("#usage").hidden);
      assert.match(await p.textContent("#usage"), /18 \/ 128,000 tokens \(0 %\)/);

      // An image dropped on the prompt goes to the model with the text.
      const PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
      await p.evaluate((b64) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], "dot.png", { type: "image/png" }));
        document.querySelector("#prompt-text").dispatchEvent(new DragEvent("drop", { dataTransfer: dt, bubbles: true, cancelable: true }));
      }, PNG);
      await p.waitForSelector("#attachments img[alt='dot.png']");
      const m = mock.requests.length;
      mock.reply({ events: openai.text("A dot.") });
      await p.fill("#prompt-text", "what is this?");
      await p.click("#send");
      await p.waitForFunction(() => document.querySelector("#transcript")?.textContent.includes("A dot."));
      const sent = JSON.stringify(since(m)[0].body.messages);
      assert.ok(sent.includes(`data:image/png;base64,${PNG}`), "the mock model saw the image");
      assert.equal(await p.$$eval("#attachments img", (i) => i.length), 0, "sent and cleared");

      // The command palette: `/` lists the commands, arrows pick, Enter runs.
      await p.fill("#prompt-text", "/c");
      await p.dispatchEvent("#prompt-text", "input");
      await p.waitForSelector("#palette:not([hidden])");
      assert.deepEqual(await p.$$eval("#palette li", (ls) => ls.map((l) => l.dataset.command)), ["clear", "compact", "cancel"]);
      await screenshot(p, "command-palette");
      const k = mock.requests.length;
      mock.reply({ events: openai.text("## Goal\nA dot was shown.") });
      await p.focus("#prompt-text");
      await p.keyboard.press("ArrowDown");
      await p.keyboard.press("Enter");
      // /compact ran: the compaction is shown, with its summary.
      await p.waitForSelector(".compaction[data-compaction=completed]");
      assert.match(since(k)[0].body.messages[0].content, /You summarize a coding session/);
      await p.click(".compaction summary");
      assert.equal(await p.textContent(".compaction details h2"), "Goal");

      // Shortcuts: listed in the help dialog; Ctrl+/ focuses the prompt.
      await p.click("#help");
      assert.ok(await p.isVisible("#help-dialog"));
      assert.match(await p.textContent("#help-dialog"), /Focus the prompt/);
      await p.keyboard.press("Escape");
      await p.focus("#session-search");
      await p.keyboard.press("Control+/");
      assert.equal(await p.evaluate(() => document.activeElement.id), "prompt-text");
      // The search box filters the sessions by title.
      await p.fill("#session-search", "no session has this title");
      await p.waitForFunction(() => document.querySelectorAll("#session-list li").length === 0);
      await p.fill("#session-search", "");
      await p.waitForFunction(() => document.querySelectorAll("#session-list li").length > 0);

      // A bad directory is refused in the dialog, nothing is created.
      await p.click("#new-session");
      await p.fill("#new-cwd", "relative/path");
      await p.click("#new-create");
      await p.waitForFunction(() => document.querySelector("#new-status")?.textContent.includes("absolute"));
      assert.ok(await p.isVisible("#new-session-dialog"));
    } finally {
      await browser.close();
    }
  });
});
