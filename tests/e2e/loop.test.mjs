// Loop protection end to end: an interactive turn that loops is rejected
// with a structured, honest error; only that turn stops.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { agentText, initialize, newSession, script, startDaemon, textPrompt, transports, turnStarted } from "./lib/daemon.mjs";

let daemon;
let c;

before(async () => {
  daemon = await startDaemon();
  c = await transports.websocket(daemon);
  await initialize(c);
});

after(async () => {
  c?.close();
  await daemon?.stop();
});

const call = { name: "read_file", input: { path: "src/main.rs" }, output: "fn main() {}" };
const sixIdentical = script([{ tools: Array(6).fill(call) }, { say: "never said" }]);

function toolUpdates(sid) {
  const mine = c.updates.filter((u) => u.sessionId === sid).map((u) => u.update);
  const calls = mine.filter((u) => u.sessionUpdate === "tool_call");
  const finals = mine.filter(
    (u) => u.sessionUpdate === "tool_call_update" && ["completed", "failed"].includes(u.status),
  );
  return { calls, finals };
}

describe("loop protection", () => {
  test("six identical calls: four run, two fail with the skip reason, the prompt is rejected", async () => {
    const sid = await newSession(c);
    let error;
    await c.request("session/prompt", textPrompt(sid, sixIdentical)).then(
      () => assert.fail("a looping turn must not report success"),
      (e) => (error = e),
    );
    assert.equal(error.code, -32603);
    assert.equal(error.data.errorKind, "loop_detected");
    assert.equal(error.data.loopType, "consecutive_identical_tool_calls");
    assert.equal(error.data.code, "LOOP_DETECTED");
    assert.equal(error.data.sessionId, sid);
    assert.match(error.data.promptId, /^[0-9a-f-]{36}$/);
    assert.match(error.message, /Loop protection stopped this turn/);
    assert.match(error.message, /Only this turn stopped/);

    const { calls, finals } = toolUpdates(sid);
    assert.equal(calls.length, 6);
    assert.deepEqual(
      finals.map((u) => u.status),
      ["completed", "completed", "completed", "completed", "failed", "failed"],
    );
    for (const skipped of finals.slice(4)) {
      assert.equal(skipped.rawOutput.errorKind, "loop_detected");
      assert.equal(skipped.rawOutput.loopType, "consecutive_identical_tool_calls");
      assert.equal(skipped.rawOutput.code, "LOOP_DETECTED");
      assert.match(skipped.content[0].content.text, /Skipped by loop protection/);
    }
    // No call stays pending: every tool_call has a terminal update.
    assert.deepEqual(
      new Set(finals.map((u) => u.toolCallId)),
      new Set(calls.map((u) => u.toolCallId)),
    );
    // The engine was stopped: the text after the batch never came.
    assert.equal(agentText(c, sid), "");
    // Every attached client learns the structured error.
    await c.until(() => c.ext.some((e) => e.method === "_tiller/turn_settled" && e.params.sessionId === sid));
    const settled = c.ext.find((e) => e.method === "_tiller/turn_settled" && e.params.sessionId === sid);
    assert.equal(settled.params.error.errorKind, "loop_detected");
    assert.equal(settled.params.error.loopType, "consecutive_identical_tool_calls");
    assert.equal(settled.params.promptId, error.data.promptId);

    // The session is alive: the next prompt works.
    const next = await c.request("session/prompt", textPrompt(sid, script([{ say: "next one" }])));
    assert.equal(next.stopReason, "end_turn");
    assert.equal(agentText(c, sid), "next one");
  });

  test("a prompt queued behind the looping one runs after the rejection", async () => {
    const sid = await newSession(c);
    const looping = c.request("session/prompt", textPrompt(sid, script([{ sleep_ms: 150 }, { tools: Array(6).fill(call) }])));
    await new Promise((r) => setTimeout(r, 50));
    const queued = c.request("session/prompt", textPrompt(sid, script([{ say: "queued ran" }])));
    await assert.rejects(looping, (e) => e.data?.errorKind === "loop_detected");
    assert.equal((await queued).stopReason, "end_turn");
    assert.equal(agentText(c, sid), "queued ran");
  });

  test("a cancel sent before the trip yields cancelled", async () => {
    const sid = await newSession(c);
    const pending = c.request("session/prompt", textPrompt(sid, script([{ sleep_ms: 300 }, { tools: Array(6).fill(call) }])));
    await turnStarted(c, sid);
    await c.notify("session/cancel", { sessionId: sid });
    assert.equal((await pending).stopReason, "cancelled");
    assert.equal(toolUpdates(sid).calls.length, 0, "the looping batch never ran");
  });

  test("repeated failures trip on the fourth call; a polling tool whose result changes does not", async () => {
    const sid = await newSession(c);
    const failing = { name: "build", input: {}, outcome: "error", output: "error[E0425]: x" };
    await assert.rejects(
      c.request("session/prompt", textPrompt(sid, script([{ tools: Array(5).fill(failing) }]))),
      (e) => e.data.loopType === "repeated_tool_failure",
    );
    const polls = Array.from({ length: 12 }, (_, i) => ({ tool: { name: "status", input: { id: 1 }, output: `${i * 10}%` } }));
    const res = await c.request("session/prompt", textPrompt(sid, script(polls)));
    assert.equal(res.stopReason, "end_turn");
  });
});
