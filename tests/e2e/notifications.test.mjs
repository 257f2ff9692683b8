// Background notifications: durable, deduplicated by task id, one per turn,
// admitted only when the session is idle, never stranded by a rejected turn.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { after, before, describe, test } from "node:test";

import {
  turnStarted,
  api,
  bin,
  initialize,
  newSession as acpSession,
  openStream,
  script,
  startDaemon,
  tempDir,
  textPrompt,
  transports,
} from "./lib/daemon.mjs";

let daemon;

before(async () => {
  daemon = await startDaemon({ env: { TILLER_LIMITS__MAX_QUEUED_NOTIFICATIONS: "2" } });
});

after(async () => {
  await daemon?.stop();
});

async function session(d = daemon) {
  return (await api(d, "POST", "/api/sessions", { cwd: "/w" })).body.id;
}

const notify = (sid, taskId, steps, d = daemon) =>
  api(d, "POST", `/api/sessions/${sid}/notifications`, { taskId, text: script(steps) });

const types = (s) => s.events.filter((e) => e.event === "event").map((e) => e.data);

describe("notifications", () => {
  test("a notification posted during a turn runs after it, as its own turn", async () => {
    const sid = await session();
    const s = await openStream(daemon, sid, {});
    await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ sleep_ms: 300 }, { say: "first" }]) });
    await s.until(() => types(s).some((e) => e.type === "prompt_started"));
    const res = await notify(sid, "build-42", [{ say: "build finished" }]);
    assert.equal(res.status, 202);
    await s.until(() => types(s).filter((e) => e.type === "turn_complete").length === 2, 5000);
    const evs = types(s);
    const starts = evs.filter((e) => e.type === "prompt_started");
    assert.deepEqual(
      starts.map((e) => e.data.origin),
      ["interactive", "notification"],
    );
    const firstDone = evs.findIndex((e) => e.type === "turn_complete");
    const notifStart = evs.findIndex((e) => e.type === "prompt_started" && e.data.origin === "notification");
    assert.ok(firstDone < notifStart, "it waited for the running turn");
    assert.ok(evs.some((e) => e.type === "notification_queued" && e.data.taskId === "build-42"));
    s.close();
  });

  test("an interactive prompt rejected by loop protection is followed by the queued notification turn", async () => {
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const sid = await acpSession(c);
      const call = { name: "read_file", input: { path: "x" }, output: "same" };
      const looping = c.request("session/prompt", textPrompt(sid, script([{ sleep_ms: 200 }, { tools: Array(6).fill(call) }])));
      await turnStarted(c, sid);
      assert.equal((await notify(sid, "ci", [{ say: "CI is green" }])).status, 202);
      await assert.rejects(looping, (e) => e.data?.errorKind === "loop_detected");
      await c.until(() =>
        c.updates.some(
          (u) => u.sessionId === sid && u.update.sessionUpdate === "agent_message_chunk" && u.update.content.text === "CI is green",
        ),
      );
      await c.until(() => c.ext.filter((e) => e.method === "_tiller/turn_settled" && e.params.sessionId === sid).length === 2);
      const settled = c.ext.filter((e) => e.method === "_tiller/turn_settled" && e.params.sessionId === sid);
      assert.equal(settled[0].params.error.errorKind, "loop_detected");
      assert.equal(settled[1].params.stopReason, "end_turn");
    } finally {
      c.close();
    }
  });

  test("a looping notification turn ends end_turn with loop_stopped", async () => {
    const sid = await session();
    const s = await openStream(daemon, sid, {});
    const call = { name: "read_file", input: { path: "x" }, output: "same" };
    await notify(sid, "loop", [{ tools: Array(6).fill(call) }]);
    await s.until(() => types(s).some((e) => e.type === "turn_complete"));
    const evs = types(s);
    assert.equal(evs.find((e) => e.type === "loop_stopped").data.loopType, "consecutive_identical_tool_calls");
    assert.equal(evs.find((e) => e.type === "turn_complete").data.stopReason, "end_turn");
    assert.ok(!evs.some((e) => e.type === "turn_error"));
    s.close();
  });

  test("deduplicated by task id; over the cap the oldest is evicted and reported", async () => {
    const sid = await session();
    const s = await openStream(daemon, sid, {});
    await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ sleep_ms: 400 }]) });
    await s.until(() => types(s).some((e) => e.type === "prompt_started"));
    assert.equal((await notify(sid, "a", [{ say: "a1 " }])).body.deduplicated, false);
    assert.equal((await notify(sid, "a", [{ say: "a2 " }])).body.deduplicated, true);
    await notify(sid, "b", [{ say: "b " }]);
    const third = await notify(sid, "c", [{ say: "c " }]);
    assert.deepEqual(third.body.evicted, ["a"]);
    await s.until(() => types(s).filter((e) => e.type === "turn_complete").length === 3, 5000);
    const evs = types(s);
    assert.ok(evs.some((e) => e.type === "notification_evicted" && e.data.taskId === "a"));
    const said = evs.filter((e) => e.type === "agent_message_chunk").map((e) => e.data.text);
    assert.deepEqual(said, ["b ", "c "], "one notification per turn, oldest first");
    s.close();
  });

  test("bad input is refused", async () => {
    const sid = await session();
    assert.equal((await api(daemon, "POST", `/api/sessions/${sid}/notifications`, { taskId: "", text: "x" })).status, 400);
    assert.equal((await api(daemon, "POST", `/api/sessions/${sid}/notifications`, { text: "x" })).status, 400);
    assert.equal(
      (await api(daemon, "POST", "/api/sessions/00000000-0000-4000-8000-000000000000/notifications", { taskId: "t", text: "x" })).status,
      404,
    );
  });

  test("queued notifications survive a restart and run", async () => {
    const dataDir = tempDir();
    let d = await startDaemon({ dataDir });
    const sid = await session(d);
    await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ sleep_ms: 60000 }]) });
    // Through the CLI, like an operator's script would.
    const out = await new Promise((resolve) =>
      execFile(
        bin,
        ["notify", "--url", d.http, "--token-file", d.tokenFile, "--session", sid, "--task-id", "nightly", "--text", script([{ say: "after restart" }])],
        (err, stdout, stderr) => resolve({ code: err ? err.code : 0, stdout, stderr }),
      ),
    );
    assert.equal(out.code, 0, out.stderr);
    await d.stop("SIGKILL");
    d = await startDaemon({ dataDir });
    try {
      for (let i = 0; i < 300; i++) {
        const hist = await api(d, "GET", `/api/sessions/${sid}/history?limit=50`);
        if (hist.body.events.some((e) => e.type === "agent_message_chunk" && e.data.text === "after restart")) return;
        await new Promise((r) => setTimeout(r, 20));
      }
      assert.fail("the queued notification never ran after the restart");
    } finally {
      await d.stop();
    }
  });

  test("the prompt queue depth gauge is back at zero once queued and automatic turns ran", async () => {
    const d = await startDaemon();
    try {
      const sid = await session(d);
      const s = await openStream(d, sid, {});
      await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ sleep_ms: 200 }]) });
      await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "queued" }]) });
      for (const t of ["a", "b", "c"]) await notify(sid, t, [{ say: t }], d);
      await s.until(() => types(s).filter((e) => e.type === "turn_complete").length === 5, 5000);
      s.close();
      const text = await (await fetch(`${d.http}/metrics`, { headers: d.auth })).text();
      const line = text.split("\n").find((l) => l.startsWith("tiller_prompt_queue_depth "));
      assert.ok(line, "the gauge is exported");
      assert.equal(Number(line.split(" ")[1]), 0, line);
    } finally {
      await d.stop();
    }
  });
});
