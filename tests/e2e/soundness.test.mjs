// Soundness: every rule holds from outside, even when parts fail: a
// crashing engine, a closing session, a vanished daemon.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { after, before, describe, test } from "node:test";

import { bin, initialize, newSession, script, startDaemon, textPrompt, transports } from "./lib/daemon.mjs";

let daemon;

before(async () => {
  daemon = await startDaemon({ env: { TILLER_TURN__STALL_TIMEOUT: "20s" } });
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
