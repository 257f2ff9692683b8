// Soundness: every rule holds from outside, even when parts fail: a
// crashing engine, a closing session, a vanished daemon.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createHmac } from "node:crypto";
import { after, before, describe, test } from "node:test";

import { api, bin, initialize, newSession, script, startDaemon, tempDir, textPrompt, transports } from "./lib/daemon.mjs";

const SECRET = "soundness-secret";
let daemon;

before(async () => {
  daemon = await startDaemon({
    env: {
      TILLER_TURN__STALL_TIMEOUT: "20s",
      TILLER_CHANNELS__HOOK__SECRET: SECRET,
      TILLER_CHANNELS__HOOK__CWD: tempDir(),
    },
  });
});

async function channelPost(body) {
  const text = JSON.stringify(body);
  const ts = Math.floor(Date.now() / 1000);
  const mac = createHmac("sha256", SECRET).update(`${ts}.${text}`).digest("hex");
  const res = await fetch(`${daemon.http}/api/channels/hook/prompts`, {
    method: "POST",
    headers: { "content-type": "application/json", "x-tiller-timestamp": String(ts), "x-tiller-signature": `sha256=${mac}` },
    body: text,
  });
  return { status: res.status, body: await res.json() };
}

const waitFor = async (pred, ms = 5000, what = "condition") => {
  for (let i = 0; i < ms / 20; i++) {
    if (await pred()) return;
    await new Promise((r) => setTimeout(r, 20));
  }
  throw new Error(`${what} not met in time`);
};

describe("closing", () => {
  test("a closed session starts nothing: a channel prompt queued behind its turn settles cancelled", async () => {
    const first = await channelPost({ text: script([{ sleep_ms: 1500 }, { say: "first" }]) });
    assert.equal(first.status, 202, JSON.stringify(first.body));
    const sid = first.body.sessionId;
    const second = await channelPost({ sessionId: sid, text: script([{ say: "after the close" }]) });
    assert.equal(second.status, 202, JSON.stringify(second.body));
    assert.equal((await api(daemon, "DELETE", `/api/sessions/${sid}`)).status, 204);
    const history = async () => (await api(daemon, "GET", `/api/sessions/${sid}/history?limit=200`)).body.events;
    await waitFor(async () => (await history()).filter((e) => ["turn_complete", "turn_error"].includes(e.type)).length >= 2, 5000, "both terminals");
    await new Promise((r) => setTimeout(r, 1800)); // past the first turn's sleep
    const evs = await history();
    const terminal = (p) => evs.find((e) => ["turn_complete", "turn_error"].includes(e.type) && e.promptId === p);
    assert.equal(terminal(second.body.promptId).data.stopReason, "cancelled");
    assert.equal(terminal(first.body.promptId).data.stopReason, "cancelled");
    assert.ok(!evs.some((e) => e.type === "agent_message_chunk"), "nothing ran after the close");
    assert.equal(evs.filter((e) => e.type === "prompt_started").length, 1, "only the first turn ever started");
  });
});

after(async () => {
  await daemon?.stop();
});

describe("supervised engines", () => {
  test("an engine that panics settles engine_crashed at once, and the session goes on", async () => {
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const sid = await newSession(c);
      const t0 = Date.now();
      const err = await c.request("session/prompt", textPrompt(sid, script([{ say: "about to" }, { crash: "index out of bounds" }]))).then(
        () => null,
        (e) => e,
      );
      const took = Date.now() - t0;
      assert.ok(err, "the prompt failed");
      assert.equal(err.code, -32603);
      assert.equal(err.data.errorKind, "engine_crashed");
      assert.match(err.message, /crashed/);
      assert.ok(took < 1000, `settled after ${took} ms (the stall bound is 20 s)`);
      const res = await c.request("session/prompt", textPrompt(sid, script([{ say: "still here" }])));
      assert.equal(res.stopReason, "end_turn");
    } finally {
      c.close();
    }
  });
});

describe("bounded engine work", () => {
  test("a runaway script neither floods the daemon nor delays a cancel; past the bound the turn fails turn_too_long", async (t) => {
    const { readFileSync, writeFileSync } = await import("node:fs");
    const d = await startDaemon({ env: { TILLER_LIMITS__MAX_TURN_EVENTS: "20000" } });
    const pid = d.child.pid;
    const kb = (f) => Number(readFileSync(`/proc/${pid}/status`, "utf8").match(new RegExp(`^${f}:\\s+(\\d+) kB`, "m"))[1]);
    const c = await transports.unix(d);
    try {
      await initialize(c);
      const sid = await newSession(c);
      const flood = script([{ repeat: { times: 10000, steps: [{ repeat: { times: 10000, steps: [{ say: "x" }] } }] } }]);
      writeFileSync(`/proc/${pid}/clear_refs`, "5");
      const before = kb("VmRSS");
      // A cancel in the middle of the flood settles at once.
      const first = c.request("session/prompt", textPrompt(sid, flood));
      // Once the flood shows (a fixed wait could outlast the bound on a
      // fast run, and the turn would end turn_too_long before the cancel).
      await c.until(() => c.updates.some((u) => u.sessionId === sid));
      const t0 = Date.now();
      await c.notify("session/cancel", { sessionId: sid });
      assert.equal((await first).stopReason, "cancelled");
      const cancelTook = Date.now() - t0;
      // Left alone, it stops at limits.max_turn_events.
      const err = await c.request("session/prompt", textPrompt(sid, flood)).then(() => null, (e) => e);
      assert.equal(err?.data?.errorKind, "turn_too_long", JSON.stringify(err));
      const peak = kb("VmHWM");
      t.diagnostic(`cancel during a flood: ${cancelTook} ms; RSS ${before} kB before, peak ${peak} kB (+${Math.round((peak - before) / 1024)} MB)`);
      assert.ok(cancelTook < 2000, `the cancel took ${cancelTook} ms`);
      assert.ok(peak - before < 150 * 1024, `peak RSS grew by ${Math.round((peak - before) / 1024)} MB`);
    } finally {
      c.close();
      await d.stop();
    }
  });
});

describe("tiller acp", () => {
  test("when the daemon is killed, the relay fails the pending request and exits non-zero with one line", async () => {
    const d = await startDaemon();
    const child = spawn(bin, ["acp", "--connect", `unix:${d.socket}`], { stdio: ["pipe", "pipe", "pipe"] });
    let out = "";
    let err = "";
    child.stdout.on("data", (x) => (out += x));
    child.stderr.on("data", (x) => (err += x));
    // "close", not "exit": the relay's stderr line may still be in the pipe
    // when the process has exited.
    const exited = new Promise((r) => child.on("close", (code) => r(code)));
    const send = (m) => child.stdin.write(JSON.stringify({ jsonrpc: "2.0", ...m }) + "\n");
    const lines = () => out.split("\n").filter(Boolean).map((l) => JSON.parse(l));
    const until = async (pred, what) => {
      for (let i = 0; i < 250 && !pred(); i++) await new Promise((r) => setTimeout(r, 20));
      assert.ok(pred(), what);
    };
    try {
      send({ id: 1, method: "initialize", params: { protocolVersion: 1 } });
      send({ id: 2, method: "session/new", params: { cwd: "/", mcpServers: [] } });
      await until(() => lines().some((m) => m.id === 2), "a session");
      const sid = lines().find((m) => m.id === 2).result.sessionId;
      send({ id: 3, method: "session/prompt", params: textPrompt(sid, script([{ sleep_ms: 60000 }])) });
      await new Promise((r) => setTimeout(r, 300));
      await d.stop("SIGKILL");
      // Stdin stays open, as an editor's does.
      const code = await Promise.race([exited, new Promise((r) => setTimeout(() => r("still running"), 5000))]);
      assert.equal(code, 1, `the relay exited with ${code}`);
      const failed = lines().find((m) => m.id === 3);
      assert.equal(failed?.error?.data?.errorKind, "daemon_gone", out);
      assert.equal(err.trim().split("\n").length, 1, err);
      assert.match(err, /went away/);
    } finally {
      child.kill();
    }
  });
});

describe("permissions", () => {
  test("two calls that share a model's call id are asked about separately; one answer approves one call", async () => {
    const { startMockModel, openai } = await import("./lib/mockmodel.mjs");
    const { writeFileSync } = await import("node:fs");
    const path = await import("node:path");
    const mock = await startMockModel();
    const dir = tempDir();
    const config = path.join(dir, "tiller.toml");
    writeFileSync(config, `[engine.mock]\nkind = "openai"\nbase_url = "${mock.url}/v1"\nmodel = "m"\n`);
    const d = await startDaemon({ dataDir: dir, args: ["--config", config] });
    try {
      const cwd = tempDir();
      const sid = (await api(d, "POST", "/api/sessions", { cwd, engine: "mock" })).body.id;
      mock.reply(
        {
          events: openai.tools([
            { id: "dup", name: "write_file", args: { path: "one.txt", content: "1" } },
            { id: "dup", name: "write_file", args: { path: "two.txt", content: "2" } },
          ]),
        },
        { events: openai.text("done") },
      );
      assert.equal((await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: "write" })).status, 202);
      const pending = async () => (await api(d, "GET", `/api/sessions/${sid}`)).body.pendingPermission;
      await waitFor(async () => (await pending())?.requestId, 5000, "the first request");
      const first = (await pending()).requestId;
      assert.equal((await api(d, "POST", `/api/sessions/${sid}/permissions/${first}`, { optionId: "allow_once" })).status, 204);
      // One read per look: the first request may be cleared between two.
      await waitFor(
        async () => {
          const p = await pending();
          return p?.requestId && p.requestId !== first;
        },
        5000,
        "the second request",
      );
      // A repeated answer to the first request (a double click, a second
      // client) must not approve the second call.
      assert.equal((await api(d, "POST", `/api/sessions/${sid}/permissions/${first}`, { optionId: "allow_once" })).status, 404);
      const second = (await pending()).requestId;
      assert.equal((await api(d, "POST", `/api/sessions/${sid}/permissions/${second}`, { optionId: "reject_once" })).status, 204);
      await waitFor(async () => (await api(d, "GET", `/api/sessions/${sid}`)).body.state === "idle", 5000, "the turn ends");
      const { existsSync } = await import("node:fs");
      assert.ok(existsSync(path.join(cwd, "one.txt")));
      assert.ok(!existsSync(path.join(cwd, "two.txt")), "the denied call did not run");
      // Nor do they share an id in what clients see: each update names one call.
      const hist = await api(d, "GET", `/api/sessions/${sid}/history?limit=200`);
      const ids = hist.body.events.filter((e) => e.type === "tool_call").map((e) => e.data.toolCallId);
      assert.equal(ids.length, 2);
      assert.notEqual(ids[0], ids[1], `published ids ${ids}`);
    } finally {
      await d.stop();
      await mock.close();
    }
  });

  test("a client that attaches while a permission request is pending is asked too, and its answer counts", async () => {
    const a = await transports.unix(daemon);
    const b = await transports.websocket(daemon);
    try {
      await initialize(a);
      await initialize(b);
      const sid = await newSession(a);
      // A never answers (an editor that went away, or a person who left).
      a.answer = () => new Promise(() => {});
      const write = { tool: { name: "write_file", input: { path: "x.txt" }, output: "written" } };
      const prompt = a.request("session/prompt", textPrompt(sid, script([write, { say: "after" }])));
      await a.until(() => a.permissionRequests.length === 1);
      b.answer = async () => ({ outcome: { outcome: "selected", optionId: "allow_once" } });
      await b.request("session/load", { sessionId: sid, cwd: "/", mcpServers: [] });
      await b.until(() => b.permissionRequests.length === 1, 3000);
      assert.equal((await prompt).stopReason, "end_turn");
      const h = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=50`);
      const resolved = h.body.events.find((e) => e.type === "permission_resolved");
      assert.equal(resolved.data.outcome, "allow_once");
    } finally {
      a.close();
      b.close();
    }
  });
});
