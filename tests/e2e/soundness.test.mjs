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

describe("tiller acp", () => {
  test("when the daemon is killed, the relay fails the pending request and exits non-zero with one line", async () => {
    const d = await startDaemon();
    const child = spawn(bin, ["acp", "--connect", `unix:${d.socket}`], { stdio: ["pipe", "pipe", "pipe"] });
    let out = "";
    let err = "";
    child.stdout.on("data", (x) => (out += x));
    child.stderr.on("data", (x) => (err += x));
    const exited = new Promise((r) => child.on("exit", (code) => r(code)));
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
