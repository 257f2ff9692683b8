// Real ACP agents from npm hosted by Tiller as engines (`kind = "acp"`):
// Claude Code's adapter (`@agentclientprotocol/claude-agent-acp`) and Qwen
// Code (`qwen --acp`), both offline against the mock model server. Every
// turn of theirs obeys Tiller's rules: streamed to every client and into
// the history, permissions through Tiller, cancel, a killed child, a
// daemon restart, loop protection over the agent's own tool calls,
// steering, and the seed 003 hang.

import assert from "node:assert/strict";
import { existsSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { after, before, describe, test } from "node:test";

import { launch, page as newPage } from "./lib/browser.mjs";
import { api, initialize, repo, startDaemon, tempDir, textPrompt, transports, turnStarted } from "./lib/daemon.mjs";
import { anthropic, openai, startMockModel } from "./lib/mockmodel.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const npmBin = (name) => path.join(here, "node_modules/.bin", name);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const KEYWORD = /^(hi|write|slow|loop|drop|steer)\b/;

/** The text blocks of a provider message. */
function texts(m) {
  if (!m) return [];
  if (typeof m.content === "string") return [m.content];
  return (m.content ?? []).filter((b) => b.type === "text").map((b) => b.text);
}

const isResult = (m) => m?.role === "tool" || (Array.isArray(m?.content) && m.content.some((b) => b.type === "tool_result"));

/** The keyword of the turn a request belongs to, or null (a background call). */
function keyword(body) {
  if (!body?.messages || !(body.tools ?? []).length) return null;
  // Claude Code appends its environment as a system message.
  const messages = body.messages.filter((m) => m.role !== "system");
  const last = messages.at(-1);
  // The newest keyword: an agent merges a turn that never finished with
  // the next prompt into one message.
  const own = (m) => texts(m).map((t) => t.trim().match(KEYWORD)?.[1]).filter(Boolean).at(-1);
  if (own(last)) return { word: own(last), afterTool: false };
  if (!isResult(last)) return null;
  for (let i = messages.length - 1; i >= 0; i--) {
    const w = own(messages[i]);
    if (w) return { word: w, afterTool: true };
  }
  return null;
}

/**
 * A mock model answering like a scripted model would, by the user's
 * keyword: `hi` text, `write` a write call then text, `slow` a slow text,
 * `loop` the same read call forever, `drop` a stream that breaks (every
 * retry too), `steer` text after a steer.
 */
function responder(kind, state) {
  const fmt = kind === "claude" ? anthropic : openai;
  const tool = (name, args) => fmt.tools([{ id: `call_${++state.calls}`, name, args }]);
  return async (req, res, entry) => {
    if (!/\/(messages|chat\/completions)/.test(req.url)) {
      res.writeHead(200, { "content-type": "application/json" });
      return res.end("{}");
    }
    const k = keyword(entry.body);
    let events;
    let pace = 0;
    let drop = false;
    if (!k) events = fmt.text("Background answer. ");
    else if (k.word === "hi") events = fmt.text(`Hello from ${kind}. `);
    else if (k.word === "write" && !k.afterTool)
      events = tool(kind === "claude" ? "Write" : "write_file", { file_path: state.file, content: "written by the agent" });
    else if (k.word === "write") events = fmt.text("Written. ");
    else if (k.word === "loop") events = tool(kind === "claude" ? "Read" : "read_file", { file_path: state.readFile });
    else if (k.word === "slow") {
      events = fmt.text(Array.from({ length: 60 }, (_, i) => `slow${i} `).join(""));
      pace = 100;
    } else if (k.word === "drop") {
      // The stream breaks before any text: the agent retries in silence.
      events = fmt.text("never seen ").slice(0, 1);
      drop = true;
    } else events = fmt.text(JSON.stringify(entry.body).includes("Be brief") ? "Steered answer. " : "Waiting for a steer. ");
    state.main += k ? 1 : 0;
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
    for (const ev of events) {
      if (res.destroyed) return;
      const data = typeof ev.data === "string" ? ev.data : JSON.stringify(ev.data);
      res.write((ev.event ? `event: ${ev.event}\n` : "") + `data: ${data}\n\n`);
      if (pace) await sleep(pace);
    }
    if (drop) {
      await sleep(20);
      return res.socket.destroy();
    }
    res.end();
  };
}

/** The pids of `pid`'s children (from /proc). */
function childrenOf(pid) {
  const out = [];
  for (const d of readdirSync("/proc")) {
    if (!/^\d+$/.test(d)) continue;
    try {
      const stat = readFileSync(`/proc/${d}/stat`, "utf8");
      const ppid = Number(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[1]);
      if (ppid === pid) out.push(Number(d));
    } catch {}
  }
  return out;
}

async function rejection(promise) {
  try {
    await promise;
  } catch (e) {
    return e;
  }
  assert.fail("the prompt was expected to fail");
}

let mock;
let daemon;
let config;
let dataDir;
const state = { calls: 0, main: 0 };
const homes = {};

async function start() {
  daemon = await startDaemon({ dataDir, args: ["--config", config], env: { TILLER_TURN__STALL_TIMEOUT: "15s", TILLER_TURN__CANCEL_GRACE: "2s" } });
}

before(async () => {
  mock = await startMockModel();
  const handlers = { claude: responder("claude", state), qwen: responder("qwen", state) };
  // One server, two wire formats: told apart by path.
  const serve = (req, res, entry) => (req.url.includes("chat/completions") ? handlers.qwen : handlers.claude)(req, res, entry);
  mock.replies.shift = () => serve;
  dataDir = tempDir();
  for (const name of ["claude", "qwen"]) homes[name] = tempDir();
  // Claude Code asks before edits in its "default" mode (its own default
  // on a fresh machine is "auto", which asks nobody).
  mkdirSync(path.join(homes.claude, ".claude"));
  writeFileSync(path.join(homes.claude, ".claude/settings.json"), JSON.stringify({ permissions: { defaultMode: "default" } }));
  config = path.join(dataDir, "tiller.toml");
  writeFileSync(
    config,
    `
[engine.claude]
kind = "acp"
command = ${JSON.stringify(npmBin("claude-agent-acp"))}
env = { ANTHROPIC_BASE_URL = "${mock.url}", ANTHROPIC_API_KEY = "sk-test-not-a-key", IS_SANDBOX = "1", HOME = ${JSON.stringify(homes.claude)} }

# The misbehaving test agent (built with the workspace).
[engine.fake]
kind = "acp"
command = ${JSON.stringify(path.join(repo, "target/debug/tiller-fake-acp"))}

[engine.qwen]
kind = "acp"
command = ${JSON.stringify(npmBin("qwen"))}
args = ["--acp", "--auth-type", "openai", "--openai-base-url", "${mock.url}/v1", "--model", "mock", "--approval-mode", "default"]
env = { HOME = ${JSON.stringify(homes.qwen)}, OPENAI_API_KEY = "sk-test-not-a-key" }
`,
  );
  await start();
});

after(async () => {
  if (process.env.DUMP_LOG) console.log(daemon?.log().split("\n").filter((l) => /panic|ERROR|WARN/.test(l)).join("\n"));
  await daemon?.stop();
  await mock?.close();
});

async function client() {
  const c = await transports.unix(daemon);
  await initialize(c);
  return c;
}

async function session(c, engine) {
  const cwd = tempDir();
  writeFileSync(path.join(cwd, "notes.txt"), "the same text every time\n");
  const res = await c.request("session/new", { cwd, mcpServers: [], _meta: { tiller: { engine } } });
  return { sid: res.sessionId, cwd };
}

const textOf = (c, sid) =>
  c.updates
    .filter((u) => u.sessionId === sid && u.update.sessionUpdate === "agent_message_chunk")
    .map((u) => u.update.content.text)
    .join("");

async function history(sid) {
  const h = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=500`);
  assert.equal(h.status, 200);
  // Each event's fields, flat.
  return h.body.events.map((e) => ({ ...e.data, type: e.type, seq: e.seq }));
}

for (const engine of ["claude", "qwen"]) {
  describe(`${engine} hosted by Tiller`, () => {
    test("a prompt streams to the client and into the HTTP history", async () => {
      const c = await client();
      try {
        const { sid } = await session(c, engine);
        const r = await c.request("session/prompt", textPrompt(sid, "hi there"));
        assert.equal(r.stopReason, "end_turn");
        assert.match(textOf(c, sid), new RegExp(`Hello from ${engine}`));
        const events = await history(sid);
        const kinds = events.map((e) => e.type);
        assert.ok(kinds.includes("agent_session"), kinds.join());
        const said = events.filter((e) => e.type === "agent_message_chunk").map((e) => e.text).join("");
        assert.match(said, new RegExp(`Hello from ${engine}`));
        assert.ok(kinds.includes("turn_complete"), kinds.join());
        // The agent's own options (its modes) are offered next to Tiller's.
        const offered = c.updates
          .filter((u) => u.sessionId === sid && u.update.sessionUpdate === "config_option_update")
          .flatMap((u) => u.update.configOptions.map((o) => o.id));
        assert.ok(offered.includes("agent.mode"), offered.join());
      } finally {
        c.close();
      }
    });

    test("the agent's write waits for a second client's allow", async () => {
      const a = await client();
      const b = await client();
      try {
        const { sid, cwd } = await session(a, engine);
        await b.request("session/load", { sessionId: sid, cwd, mcpServers: [] });
        state.file = path.join(cwd, "out.txt");
        // A answers nothing (its default denies; it is not asked in time).
        a.answer = () => new Promise(() => {});
        let asked;
        b.answer = async (p) => {
          asked = p;
          assert.ok(!existsSync(state.file), "nothing is written before the answer");
          return { outcome: { outcome: "selected", optionId: "allow_once" } };
        };
        const r = await a.request("session/prompt", textPrompt(sid, "write the file"));
        assert.equal(r.stopReason, "end_turn");
        assert.ok(asked, "the second client was asked");
        assert.equal(asked.toolCall.kind, "edit");
        assert.equal(readFileSync(state.file, "utf8"), "written by the agent");
      } finally {
        a.close();
        b.close();
      }
    });

    test("cancel mid-stream settles cancelled, and the next prompt works", async () => {
      const c = await client();
      try {
        const { sid } = await session(c, engine);
        const p = c.request("session/prompt", textPrompt(sid, "slow answer please"));
        await c.until(() => textOf(c, sid).includes("slow2"), 60000);
        await c.notify("session/cancel", { sessionId: sid });
        assert.equal((await p).stopReason, "cancelled");
        const r = await c.request("session/prompt", textPrompt(sid, "hi again"));
        assert.equal(r.stopReason, "end_turn");
      } finally {
        c.close();
      }
    });

    test("the child killed mid-turn fails engine_crashed; the next prompt runs on the reloaded session", async () => {
      const c = await client();
      try {
        const { sid } = await session(c, engine);
        assert.equal((await c.request("session/prompt", textPrompt(sid, "hi first"))).stopReason, "end_turn");
        const p = c.request("session/prompt", textPrompt(sid, "slow and then killed"));
        await c.until(() => textOf(c, sid).includes("slow1"), 60000);
        const before = new Set(childrenOf(daemon.child.pid));
        assert.ok(before.size >= 1);
        for (const pid of before) {
          try {
            process.kill(-pid, "SIGKILL");
          } catch {}
        }
        const e = await rejection(p);
        assert.equal(e.data.errorKind, "engine_crashed", JSON.stringify(e));
        const r = await c.request("session/prompt", textPrompt(sid, "hi after the crash"));
        assert.equal(r.stopReason, "end_turn");
        const starts = (await history(sid)).filter((e) => e.type === "agent_session");
        assert.equal(starts.at(-1).start, "loaded", JSON.stringify(starts));
        assert.equal(starts.at(-1).upstream, starts[0].upstream);
      } finally {
        c.close();
      }
    });

    test("repeated identical tool calls of the agent trip loop_detected", async () => {
      const c = await client();
      try {
        const { sid, cwd } = await session(c, engine);
        state.readFile = path.join(cwd, "notes.txt");
        const e = await rejection(c.request("session/prompt", textPrompt(sid, "loop over the file")));
        assert.equal(e.data.errorKind, "loop_detected", JSON.stringify(e));
        const events = await history(sid);
        assert.ok(events.some((e) => e.type === "turn_error" && e.errorKind === "loop_detected"));
        // Every call Tiller showed ended.
        const started = new Set(events.filter((e) => e.type === "tool_call").map((e) => e.toolCallId));
        const ended = new Set(events.filter((e) => e.type === "tool_call_update" && ["completed", "failed"].includes(e.status)).map((e) => e.toolCallId));
        for (const id of started) assert.ok(ended.has(id), `call ${id} ended`);
        const r = await c.request("session/prompt", textPrompt(sid, "hi after the loop"));
        assert.equal(r.stopReason, "end_turn");
      } finally {
        c.close();
      }
    });
  });
}

describe("steering hosted agents", () => {
  test("claude-agent-acp advertises steering: a steer is forwarded and consumed", async () => {
    const c = await client();
    try {
      const { sid } = await session(c, "claude");
      const p = c.request("session/prompt", textPrompt(sid, "slow answer please"));
      await c.until(() => textOf(c, sid).includes("slow1"), 60000);
      const answer = await c.request("_session/steering", { sessionId: sid, prompt: [{ type: "text", text: "Be brief." }] });
      assert.equal(answer.outcome, "injected");
      await p;
      const kinds = (await history(sid)).map((e) => e.type);
      assert.ok(kinds.includes("steer_accepted"), kinds.join());
      assert.ok(kinds.includes("steer_consumed") || kinds.includes("steer_dropped"), kinds.join());
    } finally {
      c.close();
    }
  });

  test("qwen does not: a steer during its turn answers promptRequired / notSupported", async () => {
    const c = await client();
    try {
      const { sid } = await session(c, "qwen");
      const p = c.request("session/prompt", textPrompt(sid, "slow answer please"));
      await c.until(() => textOf(c, sid).includes("slow1"), 60000);
      const answer = await c.request("_session/steering", { sessionId: sid, prompt: [{ type: "text", text: "Be brief." }] });
      assert.equal(answer.outcome, "promptRequired");
      assert.equal(answer.reason, "notSupported");
      await c.notify("session/cancel", { sessionId: sid });
      await p;
    } finally {
      c.close();
    }
  });

  test("seed 003: a steer, then a model stream that drops so the agent never answers, still settles within Tiller's bound", async () => {
    const c = await client();
    try {
      const { sid } = await session(c, "claude");
      const t0 = Date.now();
      const p = c.request("session/prompt", textPrompt(sid, "drop the stream"));
      await turnStarted(c, sid);
      await sleep(300);
      await c.request("_session/steering", { sessionId: sid, prompt: [{ type: "text", text: "and then?" }] }).catch(() => {});
      const e = await rejection(p);
      assert.equal(e.data.errorKind, "stalled", JSON.stringify(e));
      // Settled by the stall bound (15 s here), not by the agent.
      const took = Date.now() - t0;
      assert.ok(took >= 15000 && took < 15000 + 8000, `settled after ${took} ms`);
      const r = await c.request("session/prompt", textPrompt(sid, "hi after the hang"));
      assert.equal(r.stopReason, "end_turn");
    } finally {
      c.close();
    }
  });
});

describe("a daemon restart", () => {
  test("hosted sessions continue on the agents' reloaded sessions", async () => {
    const c = await client();
    const sids = {};
    for (const engine of ["claude", "qwen"]) {
      const s = await session(c, engine);
      sids[engine] = s;
      assert.equal((await c.request("session/prompt", textPrompt(s.sid, "hi before"))).stopReason, "end_turn");
    }
    c.close();
    const kids = childrenOf(daemon.child.pid);
    assert.ok(kids.length >= 2, `the agents' processes: ${kids}`);
    await daemon.stop();
    // The agents stopped with the daemon (their process groups killed).
    const alive = (pid) => {
      try {
        return !readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1].startsWith("Z");
      } catch {
        return false;
      }
    };
    for (let i = 0; i < 60 && kids.some(alive); i++) await sleep(50);
    assert.deepEqual(kids.filter(alive), []);
    await start();
    const d = await client();
    try {
      for (const engine of ["claude", "qwen"]) {
        const { sid, cwd } = sids[engine];
        await d.request("session/load", { sessionId: sid, cwd, mcpServers: [] });
        const r = await d.request("session/prompt", textPrompt(sid, "hi after the restart"));
        assert.equal(r.stopReason, "end_turn");
        const starts = (await history(sid)).filter((e) => e.type === "agent_session");
        assert.equal(starts.at(-1).start, "loaded", `${engine}: ${JSON.stringify(starts)}`);
        assert.equal(starts.at(-1).upstream, starts[0].upstream);
      }
    } finally {
      d.close();
    }
  });
});

describe("the Web Shell on a hosted agent", () => {
  test("a crash is a localized turn error, and the restarted agent's reload is told", async () => {
    const browser = await launch();
    try {
      const cwd = tempDir();
      const created = await api(daemon, "POST", "/api/sessions", { cwd, engine: "fake", title: "hosted" });
      assert.equal(created.status, 201, JSON.stringify(created.body));
      const sid = created.body.id;
      const p = await newPage(browser, { locale: "de-DE" });
      await p.goto(`${daemon.http}/?token=${daemon.token}#${sid}`);
      await p.waitForSelector("#state[data-state]");
      await p.fill("#prompt-text", "exit now");
      await p.click("#send");
      await p.waitForSelector("#last-error[data-error-kind=engine_crashed]", { timeout: 20000 });
      await p.fill("#prompt-text", "hello again");
      await p.click("#send");
      await p.waitForFunction(() => [...document.querySelectorAll(".notice")].some((n) => n.textContent.includes("neu geladen")), null, { timeout: 20000 });
      await p.waitForFunction(() => document.querySelector(".agent:last-of-type")?.textContent.includes("chunk3") || [...document.querySelectorAll(".agent")].some((a) => a.textContent.includes("chunk3")), null, { timeout: 20000 });
      await p.context().close();
    } finally {
      await browser.close();
    }
  });
});
