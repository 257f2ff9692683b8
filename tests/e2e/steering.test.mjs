// Turn lifecycle and steering, end to end: every conformance case of
// turn-lifecycle.md (1-8) and both reproduction tables of the seed
// 003_fa828f1aeaa2cdcd.txt settle with the terminal the rules give,
// instead of hanging. Timers are short (see fastTimers in lib/daemon.mjs).

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { agentText, initialize, newSession, script, startDaemon, textPrompt, transports, turnStarted } from "./lib/daemon.mjs";

let daemon;
let c;

before(async () => {
  daemon = await startDaemon();
  c = await transports.unix(daemon);
  await initialize(c);
});

after(async () => {
  c?.close();
  await daemon?.stop();
});

const STEER = "please also check the tests";

/** Runs a prompt; when `steer` is set, steers once the turn has started. */
async function run({ steps, steer = false, settleWithin = 2000 }) {
  const sid = await newSession(c);
  const t0 = performance.now();
  const outcome = c.request("session/prompt", textPrompt(sid, script(steps))).then(
    (res) => ({ stopReason: res.stopReason }),
    (err) => ({ code: err.code, errorKind: err.data?.errorKind }),
  );
  let steerAnswer;
  if (steer) {
    await turnStarted(c, sid);
    steerAnswer = await c.request("_session/steering", { sessionId: sid, prompt: [{ type: "text", text: STEER }] });
  }
  const result = await outcome;
  const ms = performance.now() - t0;
  assert.ok(ms < settleWithin, `settled in ${Math.round(ms)} ms, bound ${settleWithin}`);
  // Every terminal is also announced to attached clients.
  await c.until(() => c.ext.some((e) => e.method === "_tiller/turn_settled" && e.params.sessionId === sid));
  const dropped = c.ext.filter((e) => e.method === "_tiller/steer_dropped" && e.params.sessionId === sid);
  return { sid, result, ms, steerAnswer, dropped };
}

const END = { stopReason: "end_turn" };
const NO_RESULT = { code: -32603, errorKind: "no_result" };

describe("conformance cases of turn-lifecycle.md", () => {
  const cases = [
    ["1: P, R(end_turn), I: end_turn at R", { steps: [{ result: "end_turn" }, { idle: true }] }, END, 0],
    ["2: P, I: no_result at I", { steps: [{ idle: true }] }, NO_RESULT, 0],
    [
      "3: P, S, Rc, I, I: no_result at the first I",
      { steer: true, steps: [{ await_steer: 2000 }, { consume_steer: true }, { idle: true }, { idle: true }] },
      NO_RESULT,
      0,
    ],
    [
      "4: P, S, R, I: end_turn at I, steer dropped and reported",
      { steer: true, steps: [{ await_steer: 2000 }, { result: "end_turn" }, { idle: true }] },
      END,
      1,
    ],
    [
      "5a: P, R without I: end_turn at R",
      { steps: [{ result: "end_turn" }, { sleep_ms: 60000 }], settleWithin: 1000 },
      END,
      0,
    ],
    [
      "5b: steered, consumed before R, no I: end_turn at R",
      {
        steer: true,
        steps: [{ await_steer: 2000 }, { consume_steer: true }, { result: "end_turn" }, { sleep_ms: 60000 }],
        settleWithin: 1000,
      },
      END,
      0,
    ],
    [
      "6: P, X(I), X(R), R, I: stale signals change nothing",
      { steps: [{ stale: { idle: true } }, { stale: { result: "refusal" } }, { result: "end_turn" }, { idle: true }] },
      END,
      0,
    ],
    [
      "7a: P, S, R, silence: settles at the steer receipt timeout",
      { steer: true, steps: [{ await_steer: 2000 }, { result: "end_turn" }, { hang: true }] },
      END,
      1,
    ],
    [
      "7b: P, S, silence: the stall bound ends it",
      { steer: true, steps: [{ await_steer: 2000 }, { hang: true }], settleWithin: 5000 },
      { code: -32603, errorKind: "stalled" },
      1,
    ],
  ];
  for (const [name, spec, want, drops] of cases) {
    test(name, async () => {
      const { result, steerAnswer, dropped } = await run(spec);
      assert.deepEqual(result, want);
      if (spec.steer) {
        assert.equal(steerAnswer.outcome, "injected");
        assert.match(steerAnswer.steerId, /^[0-9a-f-]{36}$/);
      }
      assert.equal(dropped.length, drops, JSON.stringify(dropped));
      for (const d of dropped) assert.equal(d.params.prompt[0].text, STEER);
    });
  }

  test("8: P, C, silence: cancelled within cancel_grace", async () => {
    const sid = await newSession(c);
    const pending = c.request("session/prompt", textPrompt(sid, script([{ hang: true }])));
    await turnStarted(c, sid);
    const t0 = performance.now();
    await c.notify("session/cancel", { sessionId: sid });
    assert.equal((await pending).stopReason, "cancelled");
    const ms = performance.now() - t0;
    assert.ok(ms < 1000, `cancelled after ${ms} ms (grace 300 ms)`);
  });
});

describe("the seed's reproduction tables settle instead of hanging", () => {
  const rows = [
    ["steer; echo returns; no result; idle x2", [{ await_steer: 2000 }, { consume_steer: true }, { idle: true }, { idle: true }], NO_RESULT, 0],
    [
      "steer; steered message never echoed; result, idle x3",
      [{ await_steer: 2000 }, { result: "end_turn" }, { idle: true }, { idle: true }, { idle: true }],
      END,
      1,
    ],
    ["steer; echo; result; idle", [{ await_steer: 2000 }, { consume_steer: true }, { result: "end_turn" }, { idle: true }], END, 0],
    ["steer; echo; result; stream ends", [{ await_steer: 2000 }, { consume_steer: true }, { result: "end_turn" }], END, 0],
    ["steered: result(end_turn), no idle, steer never echoed", [{ await_steer: 2000 }, { result: "end_turn" }], END, 1],
  ];
  for (const [name, steps, want, drops] of rows) {
    test(name, async () => {
      const { result, dropped } = await run({ steer: true, steps });
      assert.deepEqual(result, want);
      assert.equal(dropped.length, drops);
    });
  }

  test("result first, the steer lands after it: end_turn, the steer starts a new turn", async () => {
    const sid = await newSession(c);
    const res = await c.request("session/prompt", textPrompt(sid, script([{ result: "end_turn" }, { idle: true }])));
    assert.equal(res.stopReason, "end_turn");
    const answer = await c.request("_session/steering", {
      sessionId: sid,
      prompt: [{ type: "text", text: script([{ say: "steered turn" }]) }],
    });
    assert.equal(answer.outcome, "startedNewTurn");
    // The started turn has an observable end.
    await c.until(() =>
      c.ext.some((e) => e.method === "_tiller/turn_settled" && e.params.promptId === answer.promptId),
    );
    const settled = c.ext.find((e) => e.method === "_tiller/turn_settled" && e.params.promptId === answer.promptId);
    assert.equal(settled.params.stopReason, "end_turn");
    assert.equal(agentText(c, sid), "steered turn");
  });

  test("plain: result(end_turn), no idle: end_turn", async () => {
    const { result } = await run({ steps: [{ result: "end_turn" }] });
    assert.deepEqual(result, END);
  });
});

describe("_session/steering outcomes", () => {
  test("promptRequired when idle, turnCancelling while cancelling", async () => {
    const sid = await newSession(c);
    const idle = await c.request("_session/steering", {
      sessionId: sid,
      prompt: [{ type: "text", text: "x" }],
      _meta: { steering: { idleBehavior: "promptRequired" } },
    });
    assert.deepEqual(idle, { outcome: "promptRequired", reason: "noRunningTurn" });

    const pending = c.request("session/prompt", textPrompt(sid, script([{ hang: true }])));
    await turnStarted(c, sid);
    await c.notify("session/cancel", { sessionId: sid });
    const during = await c.request("_session/steering", { sessionId: sid, prompt: [{ type: "text", text: "x" }] });
    assert.deepEqual(during, { outcome: "promptRequired", reason: "turnCancelling" });
    assert.equal((await pending).stopReason, "cancelled");
  });

  test("a consumed steer that is a script runs inside the turn", async () => {
    const sid = await newSession(c);
    const pending = c.request(
      "session/prompt",
      textPrompt(sid, script([{ say: "before " }, { await_steer: 2000 }, { consume_steer: true }, { say: " after" }])),
    );
    await c.until(() => agentText(c, sid) === "before ");
    const answer = await c.request("_session/steering", {
      sessionId: sid,
      prompt: [{ type: "text", text: script([{ say: "steered" }]) }],
    });
    assert.equal(answer.outcome, "injected");
    assert.equal((await pending).stopReason, "end_turn");
    assert.equal(agentText(c, sid), "before steered after");
  });
});

describe("admission", () => {
  test("a prompt over the queue bound is refused with a retryable overloaded error", async () => {
    const d = await startDaemon({ env: { TILLER_TURN__MAX_QUEUED_PROMPTS: "1" } });
    const k = await transports.websocket(d);
    try {
      await initialize(k);
      const sid = await newSession(k);
      const slow = script([{ sleep_ms: 5000 }]);
      const first = k.request("session/prompt", textPrompt(sid, slow));
      await turnStarted(k, sid);
      const second = k.request("session/prompt", textPrompt(sid, slow));
      await new Promise((r) => setTimeout(r, 100));
      await assert.rejects(
        k.request("session/prompt", textPrompt(sid, slow)),
        (e) => e.code === -32001 && e.data.errorKind === "overloaded" && e.data.retryable === true,
      );
      await k.notify("session/cancel", { sessionId: sid });
      assert.equal((await first).stopReason, "cancelled");
      assert.equal((await second).stopReason, "cancelled", "queued prompts are cancelled too");
    } finally {
      k.close();
      await d.stop();
    }
  });
});
