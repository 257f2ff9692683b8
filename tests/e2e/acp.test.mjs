// The real daemon, driven with the official ACP TypeScript SDK over stdio
// (through `tiller acp`), the unix socket and WebSocket.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  agentText,
  initialize,
  newSession,
  script,
  startDaemon,
  textPrompt,
  transports,
} from "./lib/daemon.mjs";

let daemon;

before(async () => {
  daemon = await startDaemon();
});

after(async () => {
  await daemon?.stop();
});

for (const [name, connect] of Object.entries(transports)) {
  describe(`ACP over ${name}`, () => {
    let c;
    before(async () => {
      c = await connect(daemon);
    });
    after(() => c?.close());

    test("initialize advertises Tiller's capabilities", async () => {
      const res = await initialize(c);
      assert.equal(res.protocolVersion, 1);
      assert.equal(res.agentCapabilities.loadSession, true);
      assert.deepEqual(Object.keys(res.agentCapabilities.sessionCapabilities).sort(), [
        "additionalDirectories",
        "close",
        "delete",
        "list",
        "resume",
      ]);
      assert.equal(res._meta.steering.supported, true);
      assert.equal(res._meta.tiller.promptQueueing, true);
      assert.match(res._meta.tiller.version, /^\d+\.\d+\.\d+/);
    });

    test("a demo prompt streams session/updates and ends end_turn", async () => {
      const sid = await newSession(c);
      const res = await c.request("session/prompt", textPrompt(sid, "hello"));
      assert.equal(res.stopReason, "end_turn");
      const chunks = c.updates.filter(
        (u) => u.sessionId === sid && u.update.sessionUpdate === "agent_message_chunk",
      );
      assert.ok(chunks.length >= 2, `streamed in several chunks, got ${chunks.length}`);
      assert.match(agentText(c, sid), /scripted engine/);
      // The sender has its text: it is not echoed back.
      const user = c.updates.filter(
        (u) => u.sessionId === sid && u.update.sessionUpdate === "user_message_chunk",
      );
      assert.deepEqual(user, []);
    });

    test("a scripted prompt plays its steps, tool calls included", async () => {
      const sid = await newSession(c);
      const res = await c.request(
        "session/prompt",
        textPrompt(
          sid,
          script([
            { think: "planning" },
            { plan: [{ content: "read", status: "in_progress" }, { content: "fix" }] },
            { say: "reading " },
            { tool: { name: "read_file", input: { path: "a.txt" }, output: "contents" } },
            { tool: { name: "run", outcome: "error", output: "boom" } },
            { say: "done" },
            { result: "max_tokens" },
          ]),
        ),
      );
      assert.equal(res.stopReason, "max_tokens");
      assert.equal(agentText(c, sid), "reading done");
      const mine = c.updates.filter((u) => u.sessionId === sid).map((u) => u.update);
      assert.ok(mine.some((u) => u.sessionUpdate === "agent_thought_chunk"));
      const plan = mine.find((u) => u.sessionUpdate === "plan");
      assert.deepEqual(
        plan.entries.map((e) => [e.content, e.status]),
        [
          ["read", "in_progress"],
          ["fix", "pending"],
        ],
      );
      const calls = mine.filter((u) => u.sessionUpdate === "tool_call");
      assert.deepEqual(
        calls.map((u) => [u.title, u.status ?? "pending"]), // pending is ACP's default
        [
          ["read_file", "pending"],
          ["run", "pending"],
        ],
      );
      const finals = mine.filter(
        (u) => u.sessionUpdate === "tool_call_update" && ["completed", "failed"].includes(u.status),
      );
      assert.deepEqual(
        finals.map((u) => [u.toolCallId, u.status, u.rawOutput]),
        [
          [calls[0].toolCallId, "completed", "contents"],
          [calls[1].toolCallId, "failed", "boom"],
        ],
      );
    });

    test("cancel during sleep_ms returns cancelled at once", async () => {
      const sid = await newSession(c);
      const pending = c.request("session/prompt", textPrompt(sid, script([{ sleep_ms: 60000 }])));
      await new Promise((r) => setTimeout(r, 100));
      const t0 = performance.now();
      await c.notify("session/cancel", { sessionId: sid });
      const res = await pending;
      const ms = performance.now() - t0;
      assert.equal(res.stopReason, "cancelled");
      assert.ok(ms < 1000, `cancel took ${ms} ms`);
    });

    test("a session/cancel sent right after its prompt cancels that prompt: it never overtakes it", async () => {
      const sid = await newSession(c);
      for (let i = 0; i < 5; i++) {
        const pending = c.request("session/prompt", textPrompt(sid, script([{ say: "x" }, { sleep_ms: 5000 }])));
        await c.notify("session/cancel", { sessionId: sid });
        assert.equal((await pending).stopReason, "cancelled", `prompt ${i}`);
      }
    });

    test("a hanging engine is torn down after cancel_grace", async () => {
      const sid = await newSession(c);
      const pending = c.request("session/prompt", textPrompt(sid, script([{ hang: true }])));
      await new Promise((r) => setTimeout(r, 50));
      await c.notify("session/cancel", { sessionId: sid });
      const res = await pending;
      assert.equal(res.stopReason, "cancelled");
    });

    test("session/list shows sessions and session/close removes one", async () => {
      const sid = await newSession(c, "/srv/listed");
      const listed = await c.request("session/list", {});
      const mine = listed.sessions.find((s) => s.sessionId === sid);
      assert.equal(mine.cwd, "/srv/listed");
      assert.ok(mine.updatedAt);
      const filtered = await c.request("session/list", { cwd: "/srv/listed" });
      assert.deepEqual(
        filtered.sessions.map((s) => s.sessionId),
        [sid],
      );
      await c.request("session/close", { sessionId: sid });
      const after = await c.request("session/list", {});
      assert.ok(!after.sessions.some((s) => s.sessionId === sid));
      await assert.rejects(c.request("session/prompt", textPrompt(sid, "hi")), (e) => e.code === -32002);
    });
  });
}

describe("several connections on one session", () => {
  test("both see the updates, only the sender gets the response", async () => {
    const a = await transports.unix(daemon);
    const b = await transports.websocket(daemon);
    try {
      await initialize(a);
      await initialize(b);
      const sid = await newSession(a);
      await b.request("session/resume", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
      const res = await a.request("session/prompt", textPrompt(sid, script([{ say: "to all" }])));
      assert.equal(res.stopReason, "end_turn");
      await b.until(() => agentText(b, sid) === "to all");
      assert.equal(agentText(a, sid), "to all");
      // B saw the turn settle as a notification, never as a response.
      await b.until(() => b.ext.some((e) => e.method === "_tiller/turn_settled"));
      const settled = b.ext.find((e) => e.method === "_tiller/turn_settled");
      assert.equal(settled.params.sessionId, sid);
      assert.equal(settled.params.stopReason, "end_turn");

      // And the other way round: B prompts, A watches.
      const res2 = await b.request("session/prompt", textPrompt(sid, script([{ say: " and back" }])));
      assert.equal(res2.stopReason, "end_turn");
      await a.until(() => agentText(a, sid) === "to all and back");
    } finally {
      a.close();
      b.close();
    }
  });

  test("two prompts at once: the second queues and each sender gets its own answer", async () => {
    const a = await transports.unix(daemon);
    const b = await transports.unix(daemon);
    try {
      await initialize(a);
      await initialize(b);
      const sid = await newSession(a);
      const first = a.request("session/prompt", textPrompt(sid, script([{ sleep_ms: 200 }, { say: "1" }])));
      await new Promise((r) => setTimeout(r, 50));
      const second = b.request(
        "session/prompt",
        textPrompt(sid, script([{ say: "2" }, { result: "max_tokens" }])),
      );
      assert.equal((await first).stopReason, "end_turn");
      assert.equal((await second).stopReason, "max_tokens");
      await a.until(() => agentText(a, sid) === "12");
    } finally {
      a.close();
      b.close();
    }
  });
});

describe("metrics", () => {
  test("/metrics serves Prometheus text with sessions and connections", async () => {
    const c = await transports.websocket(daemon);
    try {
      await initialize(c);
      await newSession(c);
      const res = await fetch(`${daemon.http}/metrics`, { headers: daemon.auth });
      assert.equal(res.status, 200);
      assert.match(res.headers.get("content-type"), /text\/plain/);
      const text = await res.text();
      const active = Number(text.match(/^tiller_sessions_active (\d+)/m)?.[1]);
      assert.ok(active >= 1, text);
      const ws = Number(text.match(/^tiller_connections_active\{transport="websocket"\} (\d+)/m)?.[1]);
      assert.ok(ws >= 1, text);
      assert.match(text, /^tiller_turns_settled_total\{/m);
      assert.equal((await fetch(`${daemon.http}/healthz`)).status, 200);
      assert.equal((await fetch(`${daemon.http}/readyz`)).status, 200);
    } finally {
      c.close();
    }
  });
});
