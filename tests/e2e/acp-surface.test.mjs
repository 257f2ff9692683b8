// Today's ACP surface, as real editors expect it (issue 14): what each
// connection is sent, and the methods and updates of the stable v1 schema.
// Every message here is also checked against the official schema
// (lib/schema.mjs).

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import fs from "node:fs";
import path from "node:path";

import {
  agentText,
  api,
  initialize,
  newSession,
  rawUnix,
  script,
  startDaemon,
  tempDir,
  textPrompt,
  transports,
  turnStarted,
} from "./lib/daemon.mjs";

let daemon;

before(async () => {
  daemon = await startDaemon();
});

after(async () => {
  await daemon?.stop();
});

const kinds = (c, sid) => c.updates.filter((u) => u.sessionId === sid).map((u) => u.update.sessionUpdate);
const userChunks = (c, sid) =>
  c.updates.filter((u) => u.sessionId === sid && u.update.sessionUpdate === "user_message_chunk");

describe("which connection is sent what", () => {
  test("a prompt's own text is not echoed to its sender; other clients and a load get it", async () => {
    const a = await transports.unix(daemon);
    const b = await transports.websocket(daemon);
    try {
      await initialize(a);
      await initialize(b);
      const sid = await newSession(a);
      await b.request("session/resume", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
      const text = script([{ say: "hello" }]);
      const res = await a.request("session/prompt", textPrompt(sid, text));
      assert.equal(res.stopReason, "end_turn");
      await b.until(() => agentText(b, sid) === "hello");
      assert.equal(agentText(a, sid), "hello");
      assert.deepEqual(userChunks(a, sid), [], "the sender got its own prompt back");
      assert.deepEqual(userChunks(b, sid).map((u) => u.update.content.text), [text]);

      // A load replays the whole conversation, the user's part included.
      const c = await transports.unix(daemon);
      try {
        await initialize(c);
        await c.request("session/load", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
        assert.deepEqual(userChunks(c, sid).map((u) => u.update.content.text), [text]);
        assert.equal(agentText(c, sid), "hello");
      } finally {
        c.close();
      }
    } finally {
      a.close();
      b.close();
    }
  });

  test("every update names its prompt and turn; chunks carry messageId", async () => {
    const a = await transports.unix(daemon);
    const b = await transports.unix(daemon);
    try {
      await initialize(a);
      await initialize(b);
      const sid = await newSession(a);
      await b.request("session/resume", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
      await a.request(
        "session/prompt",
        textPrompt(
          sid,
          script([
            { say: "one " },
            { say: "message" },
            { tool: { name: "read_file", input: { path: "x" }, outcome: "ok", output: "x" } },
            { say: "another" },
          ]),
        ),
      );
      await b.request("session/prompt", textPrompt(sid, script([{ say: "b's" }])));
      await a.until(() => agentText(a, sid) === "one messageanotherb's");
      // Everything of a turn names it (session-wide updates, such as the
      // command list or the title, belong to none).
      const ofTurns = ["user_message_chunk", "agent_message_chunk", "agent_thought_chunk", "tool_call", "tool_call_update", "plan"];
      const updates = a.updates.filter((u) => u.sessionId === sid && ofTurns.includes(u.update.sessionUpdate));
      assert.ok(updates.length >= 6, `${updates.length} updates`);
      for (const u of updates) {
        assert.match(u._meta?.tiller?.promptId ?? "", /.+/, `no promptId on ${u.update.sessionUpdate}`);
        assert.equal(typeof u._meta.tiller.turnId, "number");
      }
      const text = updates.filter((u) => u.update.sessionUpdate === "agent_message_chunk");
      const ids = text.map((u) => u.update.messageId);
      assert.ok(ids.every((id) => typeof id === "string" && id.length > 0), `messageIds ${ids}`);
      // Two chunks in a row are one message; a tool call between starts a
      // new one; the other client's turn is another prompt and turn.
      assert.equal(ids[0], ids[1]);
      assert.notEqual(ids[1], ids[2]);
      assert.notEqual(ids[2], ids[3]);
      const prompts = text.map((u) => u._meta.tiller.promptId);
      assert.equal(prompts[0], prompts[2]);
      assert.notEqual(prompts[2], prompts[3]);
      assert.notEqual(text[2]._meta.tiller.turnId, text[3]._meta.tiller.turnId);
      // The other client's prompt reached A as a user message with its id.
      const user = userChunks(a, sid);
      assert.equal(user.length, 1);
      assert.equal(user[0].update.messageId, prompts[3]);
      assert.ok(kinds(a, sid).includes("tool_call"));
    } finally {
      a.close();
      b.close();
    }
  });
});

describe("permission requests", () => {
  test("reach a client whose own prompt waits behind the asking turn (only what is shown is left out)", async () => {
    const a = await transports.unix(daemon);
    const b = await transports.unix(daemon);
    try {
      await initialize(a);
      await initialize(b);
      const sid = await newSession(b);
      await a.request("session/resume", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
      b.answer = () => new Promise(() => {}); // B never answers
      a.answer = async () => ({ outcome: { outcome: "selected", optionId: "allow_once" } });
      const write = { tool: { name: "write_file", input: { path: "w.txt", content: "x" }, output: "ok" } };
      const asking = b.request("session/prompt", textPrompt(sid, script([{ sleep_ms: 200 }, write, { say: "B done" }])));
      await turnStarted(b, sid);
      // A's prompt queues behind B's turn; A still gets B's question.
      const mine = a.request("session/prompt", textPrompt(sid, script([{ say: "A done" }])));
      assert.equal((await asking).stopReason, "end_turn");
      assert.equal((await mine).stopReason, "end_turn");
      assert.equal(a.permissionRequests.length, 1);
      // What A was shown meanwhile is its own turn only.
      assert.equal(agentText(a, sid), "A done");
    } finally {
      a.close();
      b.close();
    }
  });

  test("carry the whole call: kind, rawInput, locations, a diff for edits, the command for shell", async () => {
    const dir = tempDir();
    fs.writeFileSync(path.join(dir, "old.txt"), "before\n");
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const sid = await newSession(c, dir);
      c.answer = async () => ({ outcome: { outcome: "selected", optionId: "reject_once" } });
      const calls = [
        { name: "write_file", input: { path: "old.txt", content: "after\n" }, output: "" },
        { name: "write_file", input: { path: "new.txt", content: "fresh\n" }, output: "" },
        { name: "edit", input: { path: "old.txt", old_string: "before", new_string: "later" }, output: "" },
        { name: "shell", input: { command: "rm -rf build" }, output: "" },
      ];
      await c.request("session/prompt", textPrompt(sid, script(calls.map((t) => ({ tool: t })))));
      assert.equal(c.permissionRequests.length, 4);
      const [overwrite, create, edit, shell] = c.permissionRequests.map((p) => p.toolCall);
      const real = fs.realpathSync(dir);
      assert.equal(overwrite.kind, "edit");
      assert.deepEqual(overwrite.rawInput, calls[0].input);
      assert.deepEqual(overwrite.locations, [{ path: path.join(real, "old.txt") }]);
      assert.deepEqual(overwrite.content, [
        { type: "diff", path: path.join(real, "old.txt"), oldText: "before\n", newText: "after\n" },
      ]);
      assert.equal(create.content[0].oldText ?? null, null, "a new file has no old text");
      assert.equal(create.content[0].newText, "fresh\n");
      assert.deepEqual(
        { old: edit.content[0].oldText, new: edit.content[0].newText, kind: edit.kind },
        { old: "before", new: "later", kind: "edit" },
      );
      assert.equal(shell.kind, "execute");
      assert.deepEqual(shell.rawInput, { command: "rm -rf build" });
      assert.equal(shell.content[0].content.text, "$ rm -rf build");
      // Each request names the tool call the client saw announced.
      const announced = c.updates.filter((u) => u.update.sessionUpdate === "tool_call").map((u) => u.update.toolCallId);
      assert.deepEqual(
        c.permissionRequests.map((p) => p.toolCall.toolCallId),
        announced,
      );
    } finally {
      c.close();
    }
  });
});

describe("$/cancel_request", () => {
  const rpc = (id, method, params) => JSON.stringify({ jsonrpc: "2.0", id, method, params });
  const cancelReq = (requestId) => JSON.stringify({ jsonrpc: "2.0", method: "$/cancel_request", params: { requestId } });

  async function rawSession(r) {
    r.send(rpc(1, "initialize", { protocolVersion: 1, clientCapabilities: {} }));
    await r.next((m) => m.id === 1);
    r.send(rpc(2, "session/new", { cwd: "/tmp", mcpServers: [] }));
    return (await r.next((m) => m.id === 2)).result.sessionId;
  }

  test("a running prompt is cancelled and answered -32800; the one queued behind it still runs", async () => {
    const r = await rawUnix(daemon);
    try {
      const sid = await rawSession(r);
      r.send(rpc(10, "session/prompt", textPrompt(sid, script([{ sleep_ms: 20000 }]))));
      r.send(rpc(11, "session/prompt", textPrompt(sid, script([{ say: "second ran" }]))));
      await r.next((m) => m.method === "_tiller/turn_started");
      r.send(cancelReq(10));
      const first = await r.next((m) => m.id === 10);
      assert.equal(first.error?.code, -32800, JSON.stringify(first));
      const second = await r.next((m) => m.id === 11);
      assert.equal(second.result?.stopReason, "end_turn");
    } finally {
      r.close();
    }
  });

  test("a queued prompt is withdrawn with -32800 and the running one is untouched", async () => {
    const r = await rawUnix(daemon);
    try {
      const sid = await rawSession(r);
      r.send(rpc(10, "session/prompt", textPrompt(sid, script([{ sleep_ms: 300 }, { say: "first" }]))));
      r.send(rpc(11, "session/prompt", textPrompt(sid, script([{ say: "never" }]))));
      r.send(cancelReq(11));
      const second = await r.next((m) => m.id === 11);
      assert.equal(second.error?.code, -32800, JSON.stringify(second));
      const first = await r.next((m) => m.id === 10);
      assert.equal(first.result?.stopReason, "end_turn");
      const hist = await api(daemon, "GET", `/api/sessions/${sid}/history`);
      const said = hist.body.events.filter((e) => e.type === "agent_message_chunk").map((e) => e.data.text);
      assert.deepEqual(said, ["first"]);
    } finally {
      r.close();
    }
  });

  test("a session/load cancelled before its replay writes nothing and answers -32800", async () => {
    const a = await transports.unix(daemon);
    const r = await rawUnix(daemon);
    try {
      await initialize(a);
      const sid = await newSession(a);
      await a.request("session/prompt", textPrompt(sid, script([{ say: "history" }])));
      r.send(rpc(1, "initialize", { protocolVersion: 1, clientCapabilities: {} }));
      await r.next((m) => m.id === 1);
      r.send(rpc(5, "session/load", { sessionId: sid, cwd: "/tmp", mcpServers: [] }) + "\n" + cancelReq(5));
      const res = await r.next((m) => m.id === 5);
      assert.equal(res.error?.code, -32800, JSON.stringify(res));
      assert.deepEqual(r.messages.filter((m) => m.method === "session/update"), []);
      // Detached: a later turn of the session is not sent to it.
      await a.request("session/prompt", textPrompt(sid, script([{ say: "later" }])));
      await new Promise((res) => setTimeout(res, 200));
      assert.deepEqual(r.messages.filter((m) => m.method === "session/update"), []);
      // And a load afterwards replays everything.
      r.send(rpc(6, "session/load", { sessionId: sid, cwd: "/tmp", mcpServers: [] }));
      assert.equal((await r.next((m) => m.id === 6)).result.modes.currentModeId, "ask");
      const text = r.messages
        .filter((m) => m.method === "session/update" && m.params.update.sessionUpdate === "agent_message_chunk")
        .map((m) => m.params.update.content.text);
      assert.deepEqual(text, ["history", "later"]);
    } finally {
      a.close();
      r.close();
    }
  });
});

describe("session modes", () => {
  test("the permission modes are session modes: set_mode switches, current_mode_update follows, the option agrees", async () => {
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const res = await c.request("session/new", { cwd: "/tmp", mcpServers: [] });
      const sid = res.sessionId;
      assert.equal(res.modes.currentModeId, "ask");
      assert.deepEqual(res.modes.availableModes.map((m) => m.id), ["ask", "accept-edits", "allow-all"]);
      assert.deepEqual(await c.request("session/set_mode", { sessionId: sid, modeId: "allow-all" }), {});
      await c.until(() =>
        c.updates.some((u) => u.sessionId === sid && u.update.sessionUpdate === "current_mode_update"),
      );
      const mode = c.updates.find((u) => u.update.sessionUpdate === "current_mode_update");
      assert.equal(mode.update.currentModeId, "allow-all");
      const options = c.updates.filter((u) => u.sessionId === sid && u.update.sessionUpdate === "config_option_update");
      const pm = options.at(-1).update.configOptions.find((o) => o.id === "permission_mode");
      assert.equal(pm.currentValue, "allow-all");
      // The mode is in force: a write runs without asking.
      await c.request(
        "session/prompt",
        textPrompt(sid, script([{ tool: { name: "write_file", input: { path: "m.txt", content: "x" }, output: "ok" } }])),
      );
      assert.equal(c.permissionRequests.length, 0);
      // Setting the option moves the mode too, and resume reports it.
      await c.request("session/set_config_option", { sessionId: sid, configId: "permission_mode", value: "ask" });
      const resumed = await c.request("session/resume", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
      assert.equal(resumed.modes.currentModeId, "ask");
      await assert.rejects(c.request("session/set_mode", { sessionId: sid, modeId: "yolo" }), (e) => e.code === -32602);
    } finally {
      c.close();
    }
  });
});

describe("session/delete", () => {
  test("removes history, state, queued work and cron jobs; attached clients are told", async () => {
    const a = await transports.unix(daemon);
    const b = await transports.websocket(daemon);
    try {
      const init = await initialize(a);
      assert.ok(init.agentCapabilities.sessionCapabilities.delete);
      await initialize(b);
      const sid = await newSession(a);
      const keep = await newSession(a);
      await a.request("session/prompt", textPrompt(sid, script([{ say: "history" }])));
      await b.request("session/resume", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
      const job = await api(daemon, "POST", "/api/cron", {
        sessionId: sid,
        schedule: "0 0 1 1 *",
        tz: "UTC",
        prompt: "yearly",
      });
      assert.equal(job.status, 201);
      // A running turn, and a notification queued behind it.
      const running = a.request("session/prompt", textPrompt(sid, script([{ sleep_ms: 20000 }])));
      await turnStarted(a, sid);
      const queued = await api(daemon, "POST", `/api/sessions/${sid}/notifications`, { taskId: "t", text: "later" });
      assert.equal(queued.status, 202);

      assert.deepEqual(await a.request("session/delete", { sessionId: sid }), {});
      assert.equal((await running).stopReason, "cancelled");
      // Both attached clients hear it closed, then deleted (once committed).
      for (const x of [a, b]) {
        await x.until(() => x.ext.some((e) => e.method === "_tiller/session_deleted" && e.params.sessionId === sid));
      }
      const order = b.ext.filter((e) => e.params?.sessionId === sid).map((e) => e.method);
      assert.ok(order.indexOf("_tiller/session_closed") < order.indexOf("_tiller/session_deleted"), order.join());

      assert.equal((await api(daemon, "GET", `/api/sessions/${sid}`)).status, 404);
      assert.equal((await api(daemon, "GET", `/api/sessions/${sid}/history`)).status, 404);
      const cron = await api(daemon, "GET", "/api/cron");
      assert.ok(!JSON.stringify(cron.body).includes(sid), "its cron job is gone");
      const listed = await a.request("session/list", {});
      assert.deepEqual(
        listed.sessions.map((s) => s.sessionId).filter((s) => s === sid || s === keep),
        [keep],
      );
      await assert.rejects(
        a.request("session/load", { sessionId: sid, cwd: "/tmp", mcpServers: [] }),
        (e) => e.code === -32002,
      );
      // Deleting it again: -32002, which the SDK reports as done (as ACP asks).
      assert.deepEqual(await a.request("session/delete", { sessionId: sid }), {});
      // The other session is untouched.
      assert.equal((await a.request("session/prompt", textPrompt(keep, script([{ say: "ok" }])))).stopReason, "end_turn");
    } finally {
      a.close();
      b.close();
    }
  });

  test("over HTTP: DELETE with purge=true deletes, without it closes", async () => {
    const made = await api(daemon, "POST", "/api/sessions", { cwd: "/tmp" });
    const sid = made.body.id;
    assert.equal((await api(daemon, "DELETE", `/api/sessions/${sid}?purge=true`)).status, 204);
    assert.equal((await api(daemon, "GET", `/api/sessions/${sid}/history`)).status, 404);
    assert.equal((await api(daemon, "DELETE", `/api/sessions/${sid}?purge=true`)).status, 404);
    assert.equal((await api(daemon, "DELETE", `/api/sessions/${sid}?purge=maybe`)).status, 400);
  });
});

describe("session titles", () => {
  const titles = (c, sid) =>
    c.updates
      .filter((u) => u.sessionId === sid && u.update.sessionUpdate === "session_info_update")
      .map((u) => u.update.title);

  test("the first prompt names a session; a person over HTTP and the agent rename it; session/list shows it", async () => {
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const sid = await newSession(c);
      await c.request("session/prompt", textPrompt(sid, "  fix the   flaky test\nand then some"));
      await c.request("session/prompt", textPrompt(sid, "second prompt"));
      await c.until(() => titles(c, sid).length >= 1);
      assert.deepEqual(titles(c, sid), ["fix the flaky test"]);
      const listed = async () => (await c.request("session/list", {})).sessions.find((s) => s.sessionId === sid);
      assert.equal((await listed()).title, "fix the flaky test");

      const patched = await api(daemon, "PATCH", `/api/sessions/${sid}`, { title: "Renamed" });
      assert.equal(patched.status, 200, JSON.stringify(patched.body));
      assert.equal(patched.body.title, "Renamed");
      await c.until(() => titles(c, sid).length === 2);
      assert.equal((await listed()).title, "Renamed");

      await c.request("session/prompt", textPrompt(sid, script([{ title: "Named by the agent" }])));
      await c.until(() => titles(c, sid).length === 3);
      assert.equal((await api(daemon, "GET", `/api/sessions/${sid}`)).body.title, "Named by the agent");
      const update = c.updates.filter((u) => u.update.sessionUpdate === "session_info_update").at(-1);
      assert.ok(!Number.isNaN(Date.parse(update.update.updatedAt)));

      assert.equal((await api(daemon, "PATCH", `/api/sessions/${sid}`, { title: 3 })).status, 400);
      assert.equal((await api(daemon, "PATCH", `/api/sessions/${sid}`, { name: "x" })).status, 400);
    } finally {
      c.close();
    }
  });

  test("a session created with a title keeps it", async () => {
    const made = await api(daemon, "POST", "/api/sessions", { cwd: "/tmp", title: "Given" });
    assert.equal(made.status, 201, JSON.stringify(made.body));
    const sid = made.body.id;
    await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: "hello" });
    await new Promise((r) => setTimeout(r, 300));
    assert.equal((await api(daemon, "GET", `/api/sessions/${sid}`)).body.title, "Given");
  });
});

describe("slash commands", () => {
  test("available_commands_update lists Tiller's commands; the daemon runs them whatever the engine", async () => {
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const sid = await newSession(c);
      await c.until(() => c.updates.some((u) => u.sessionId === sid && u.update.sessionUpdate === "available_commands_update"));
      const listed = c.updates.find((u) => u.update.sessionUpdate === "available_commands_update").update.availableCommands;
      // `compact` is listed too; its prompt reaches the engine.
      assert.deepEqual(listed.map((x) => x.name), ["clear", "model", "mode", "goal", "cancel", "compact"]);
      assert.equal(listed.find((x) => x.name === "mode").input.hint, "mode");

      const said = () => agentText(c, sid);
      // /mode switches the permission mode (and the mode update follows).
      assert.equal((await c.request("session/prompt", textPrompt(sid, "/mode allow-all"))).stopReason, "end_turn");
      assert.match(said(), /Permission mode: allow-all/);
      await c.until(() => c.updates.some((u) => u.update.sessionUpdate === "current_mode_update" && u.update.currentModeId === "allow-all"));
      // A bad one is refused with a clear error and changes nothing.
      await assert.rejects(c.request("session/prompt", textPrompt(sid, "/mode yolo")), (e) => e.code === -32602 && /yolo/.test(e.message));
      await assert.rejects(c.request("session/prompt", textPrompt(sid, "/model")), (e) => e.code === -32602);
      // /goal sets a goal the daemon runs.
      const objective = script([{ say: "goal turn" }]);
      await c.request("session/prompt", textPrompt(sid, `/goal ${objective}`));
      const goal = await api(daemon, "GET", `/api/sessions/${sid}/goal`);
      assert.equal(goal.body.objective, objective, JSON.stringify(goal.body));
      await c.until(() => said().includes("goal turn"));
      await api(daemon, "DELETE", `/api/sessions/${sid}/goal`);
      const idle = async () => (await api(daemon, "GET", `/api/sessions/${sid}`)).body.state === "idle";
      for (let i = 0; i < 100 && !(await idle()); i++) await new Promise((r) => setTimeout(r, 50));
      // /cancel during a turn: the turn ends cancelled.
      const started = c.ext.filter((e) => e.method === "_tiller/turn_started").length;
      const running = c.request("session/prompt", textPrompt(sid, script([{ sleep_ms: 20000 }])));
      await c.until(() => c.ext.filter((e) => e.method === "_tiller/turn_started").length > started);
      await c.request("session/prompt", textPrompt(sid, "/cancel"));
      assert.equal((await running).stopReason, "cancelled");
      // An unknown /word is an ordinary prompt for the engine.
      const before = said().length;
      await c.request("session/prompt", textPrompt(sid, "/review please"));
      assert.match(said().slice(before), /scripted engine/);
    } finally {
      c.close();
    }
  });

  test("/clear forgets the model conversation, keeps the history, and is refused during a turn", async () => {
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const sid = await newSession(c);
      await c.request("session/prompt", textPrompt(sid, script([{ say: "remember me" }])));
      await c.request("session/prompt", textPrompt(sid, "/clear"));
      assert.match(agentText(c, sid), /cleared/);
      const hist = await api(daemon, "GET", `/api/sessions/${sid}/history`);
      const types = hist.body.events.map((e) => e.type);
      assert.ok(types.includes("conversation_cleared"), types.join());
      assert.ok(hist.body.events.some((e) => e.type === "agent_message_chunk" && e.data.text === "remember me"));
      // Over HTTP too, with the answer in the response.
      const r = await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: "/clear" });
      assert.deepEqual([r.status, r.body.command], [200, true]);
      const running = c.request("session/prompt", textPrompt(sid, script([{ sleep_ms: 20000 }])));
      await turnStarted(c, sid);
      const busy = await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: "/clear" });
      assert.equal(busy.status, 400);
      assert.match(busy.body.error?.message ?? busy.body.message, /turn is running/);
      await c.notify("session/cancel", { sessionId: sid });
      await running;
    } finally {
      c.close();
    }
  });
});

describe("additionalDirectories", () => {
  test("widen the file tools to those roots, each confined and checked like the cwd", async () => {
    const cwd = tempDir();
    const lib = tempDir();
    const outside = tempDir();
    fs.writeFileSync(path.join(lib, "lib.txt"), "from lib\n");
    fs.writeFileSync(path.join(outside, "secret.txt"), "secret\n");
    const c = await transports.unix(daemon);
    try {
      const init = await initialize(c);
      assert.ok(init.agentCapabilities.sessionCapabilities.additionalDirectories);
      const res = await c.request("session/new", { cwd, mcpServers: [], additionalDirectories: [lib] });
      const sid = res.sessionId;
      c.answer = async () => ({ outcome: { outcome: "selected", optionId: "allow_once" } });
      const realLib = fs.realpathSync(lib);
      const read = (p) => ({ tool: { name: "read_file", input: { path: p } } });
      const write = { tool: { name: "write_file", input: { path: path.join(realLib, "made.txt"), content: "made" } } };
      // A scripted engine runs no real tools: check through a model-free
      // path, the HTTP history of a real-tools engine is in engines.test;
      // here the permission request shows where the write would land.
      await c.request("session/prompt", textPrompt(sid, script([write])));
      const asked = c.permissionRequests.at(-1).toolCall;
      assert.deepEqual(asked.locations, [{ path: path.join(realLib, "made.txt") }]);
      // Outside every root nothing is located (the tools refuse it).
      await c.request("session/prompt", textPrompt(sid, script([read(path.join(outside, "secret.txt"))])));
      const announced = c.updates.filter((u) => u.sessionId === sid && u.update.sessionUpdate === "tool_call").at(-1);
      assert.deepEqual(announced.update.locations ?? [], []);
      // Another client widening the roots on resume is seen by everyone attached.
      const other = tempDir();
      const b = await transports.unix(daemon);
      try {
        await initialize(b);
        await b.request("session/resume", { sessionId: sid, cwd, mcpServers: [], additionalDirectories: [other] });
        const real = fs.realpathSync(other);
        await c.until(() =>
          c.ext.some((e) => e.method === "_tiller/roots_changed" && e.params.additionalDirectories.includes(real)),
        );
      } finally {
        b.close();
      }
      // Bad roots are refused with the field named, and no session is left.
      const before = (await c.request("session/list", {})).sessions.length;
      for (const bad of ["relative/dir", path.join(outside, "secret.txt"), "/nonexistent/dir"]) {
        await assert.rejects(
          c.request("session/new", { cwd, mcpServers: [], additionalDirectories: [bad] }),
          (e) => e.code === -32602 && e.data?.field === "additionalDirectories",
          bad,
        );
      }
      assert.equal((await c.request("session/list", {})).sessions.length, before);
    } finally {
      c.close();
    }
  });
});

describe("content blocks", () => {
  const PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==";

  test("text resources are inlined as context, links named; images, audio and blobs refused where unsupported", async () => {
    const c = await transports.unix(daemon);
    try {
      const init = await initialize(c);
      // The default daemon has only the scripted engine: no images.
      assert.deepEqual(
        { image: init.agentCapabilities.promptCapabilities.image, ctx: init.agentCapabilities.promptCapabilities.embeddedContext },
        { image: false, ctx: true },
      );
      const sid = await newSession(c);
      const res = await c.request("session/prompt", {
        sessionId: sid,
        prompt: [
          { type: "text", text: "look at this" },
          { type: "resource", resource: { uri: "file:///w/notes.md", mimeType: "text/markdown", text: "# Notes\nremember" } },
          { type: "resource_link", uri: "file:///w/big.log", name: "big.log" },
        ],
      });
      assert.equal(res.stopReason, "end_turn");
      const hist = await api(daemon, "GET", `/api/sessions/${sid}/history`);
      const user = hist.body.events.find((e) => e.type === "user_message").data.text;
      assert.equal(user, 'look at this\n<context uri="file:///w/notes.md">\n# Notes\nremember\n</context>\n[big.log](file:///w/big.log)');
      const refused = async (block, pattern) =>
        assert.rejects(
          c.request("session/prompt", { sessionId: sid, prompt: [{ type: "text", text: "x" }, block] }),
          (e) => e.code === -32602 && pattern.test(e.message),
        );
      await refused({ type: "image", mimeType: "image/png", data: PNG }, /does not take images/);
      await refused({ type: "image", mimeType: "image/tiff", data: PNG }, /prompt\[1\].*image\/tiff/);
      await refused({ type: "image", mimeType: "image/png", data: "not base64!!" }, /base64/);
      await refused({ type: "audio", mimeType: "audio/wav", data: PNG }, /audio/);
      await refused({ type: "resource", resource: { uri: "file:///b", blob: PNG } }, /binary resource/);
      // Nothing refused reached the log.
      const after = await api(daemon, "GET", `/api/sessions/${sid}/history`);
      assert.equal(after.body.events.filter((e) => e.type === "user_message").length, 1);
    } finally {
      c.close();
    }
  });
});
