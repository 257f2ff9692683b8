// Permission requests: the tool pipeline pauses an edit or a command until
// a person decides, over ACP (session/request_permission) or HTTP.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { api, initialize, newSession, openStream, script, startDaemon, textPrompt, transports } from "./lib/daemon.mjs";

let daemon;

before(async () => {
  daemon = await startDaemon();
});

after(async () => {
  await daemon?.stop();
});

const write = { name: "write_file", input: { path: "a.txt", text: "hi" }, output: "written" };
const finalStatus = (c, sid) =>
  c.updates
    .filter((u) => u.sessionId === sid && u.update.sessionUpdate === "tool_call_update")
    .map((u) => u.update.status)
    .filter((s) => s === "completed" || s === "failed");

describe("over ACP", () => {
  test("allow runs the call, deny fails it, and the turn goes on", async () => {
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const sid = await newSession(c);
      const answers = ["allow_once", "reject_once"];
      c.answer = async (params) => {
        assert.equal(params.sessionId, sid);
        assert.equal(params.toolCall.title, "write_file");
        assert.deepEqual(
          params.options.map((o) => o.kind),
          ["allow_once", "allow_always", "reject_once"],
        );
        return { outcome: { outcome: "selected", optionId: answers.shift() } };
      };
      const res = await c.request(
        "session/prompt",
        textPrompt(sid, script([{ tool: write }, { tool: { ...write, input: { path: "b.txt" } } }, { say: "done" }])),
      );
      assert.equal(res.stopReason, "end_turn");
      assert.equal(c.permissionRequests.length, 2);
      assert.deepEqual(finalStatus(c, sid), ["completed", "failed"]);
    } finally {
      c.close();
    }
  });

  test("allow always is remembered for the session", async () => {
    const c = await transports.websocket(daemon);
    try {
      await initialize(c);
      const sid = await newSession(c);
      c.answer = async () => ({ outcome: { outcome: "selected", optionId: "allow_always" } });
      const calls = [1, 2, 3].map((n) => ({ tool: { ...write, input: { path: `${n}.txt` } } }));
      await c.request("session/prompt", textPrompt(sid, script(calls)));
      assert.equal(c.permissionRequests.length, 1);
      assert.deepEqual(finalStatus(c, sid), ["completed", "completed", "completed"]);
    } finally {
      c.close();
    }
  });

  test("cancel while a permission is pending: cancelled, and the call is not left pending", async () => {
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const sid = await newSession(c);
      let release;
      c.answer = () => new Promise((r) => (release = r));
      const pending = c.request("session/prompt", textPrompt(sid, script([{ tool: write }])));
      await c.until(() => c.permissionRequests.length === 1);
      await c.notify("session/cancel", { sessionId: sid });
      assert.equal((await pending).stopReason, "cancelled");
      assert.deepEqual(finalStatus(c, sid), ["failed"]);
      release({ outcome: { outcome: "cancelled" } });
    } finally {
      c.close();
    }
  });
});

describe("over HTTP", () => {
  test("the snapshot shows the pending request; POST answers it; a second answer is 404", async () => {
    const sid = (await api(daemon, "POST", "/api/sessions", { cwd: "/w" })).body.id;
    const s = await openStream(daemon, sid, {});
    await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ tool: { name: "shell", input: { cmd: "ls" }, output: "a b" } }]) });
    await s.until(() => s.events.some((e) => e.data.type === "permission_requested"));
    const req = s.events.find((e) => e.data.type === "permission_requested").data.data;
    const snap = await api(daemon, "GET", `/api/sessions/${sid}`);
    assert.equal(snap.body.state, "running");
    assert.equal(snap.body.pendingPermission.requestId, req.requestId);
    assert.equal(snap.body.pendingPermission.title, "shell");

    const bad = await api(daemon, "POST", `/api/sessions/${sid}/permissions/${req.requestId}`, { optionId: "maybe" });
    assert.equal(bad.status, 400);
    const ok = await api(daemon, "POST", `/api/sessions/${sid}/permissions/${req.requestId}`, { optionId: "allow_once" });
    assert.equal(ok.status, 204);
    await s.until(() => s.events.some((e) => e.data.type === "turn_complete"));
    const again = await api(daemon, "POST", `/api/sessions/${sid}/permissions/${req.requestId}`, { optionId: "allow_once" });
    assert.equal(again.status, 404);
    const types = s.events.map((e) => e.data.type);
    assert.ok(types.indexOf("permission_resolved") < types.indexOf("turn_complete"));
    const done = s.events.filter((e) => e.data.type === "tool_call_update").map((e) => e.data.data.status);
    assert.deepEqual(done.at(-1), "completed");
    s.close();
    const after = await api(daemon, "GET", `/api/sessions/${sid}`);
    assert.equal(after.body.pendingPermission, null);
  });
});
