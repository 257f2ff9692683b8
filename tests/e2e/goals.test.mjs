// Goals: continuation turns while the session is idle; a goal whose turns
// keep looping pauses visibly after three loop-stopped turns.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { after, before, describe, test } from "node:test";

import { api, bin, openStream, script, startDaemon, tempDir } from "./lib/daemon.mjs";

let daemon;

before(async () => {
  daemon = await startDaemon();
});

after(async () => {
  await daemon?.stop();
});

const session = async (d = daemon) => (await api(d, "POST", "/api/sessions", { cwd: "/w" })).body.id;
const events = (s) => s.events.filter((e) => e.event === "event").map((e) => e.data);

describe("goals", () => {
  test("a goal runs its continuation turns, then completes", async () => {
    const sid = await session();
    const s = await openStream(daemon, sid, {});
    const set = await api(daemon, "PUT", `/api/sessions/${sid}/goal`, { objective: script([{ say: "step " }]), maxTurns: 3 });
    assert.equal(set.status, 200, JSON.stringify(set.body));
    await s.until(() => events(s).some((e) => e.type === "goal_completed"), 5000);
    const evs = events(s);
    const starts = evs.filter((e) => e.type === "prompt_started").map((e) => e.data.origin);
    assert.deepEqual(starts, ["goal", "goal", "goal"]);
    assert.equal(evs.filter((e) => e.type === "turn_complete").length, 3);
    assert.ok(evs.some((e) => e.type === "goal_set"));
    const goal = await api(daemon, "GET", `/api/sessions/${sid}/goal`);
    assert.equal(goal.body.status, "completed");
    assert.equal(goal.body.turnsDone, 3);
    s.close();
  });

  test("after three loop-stopped goal turns the goal pauses with reason loop_detected", async () => {
    const sid = await session();
    const s = await openStream(daemon, sid, {});
    const call = { name: "read_file", input: { path: "same" }, output: "same" };
    await api(daemon, "PUT", `/api/sessions/${sid}/goal`, { objective: script([{ tools: Array(6).fill(call) }]), maxTurns: 10 });
    await s.until(() => events(s).some((e) => e.type === "goal_paused"), 5000);
    // Give a fourth turn the chance to (wrongly) start.
    await new Promise((r) => setTimeout(r, 300));
    const evs = events(s);
    const paused = evs.find((e) => e.type === "goal_paused");
    assert.equal(paused.data.reason, "loop_detected");
    assert.equal(evs.filter((e) => e.type === "loop_stopped").length, 3);
    assert.equal(evs.filter((e) => e.type === "prompt_started").length, 3, "no turn after the pause");
    // Each loop-stopped goal turn resolves end_turn, never turn_error.
    assert.equal(evs.filter((e) => e.type === "turn_error").length, 0);
    assert.equal(evs.filter((e) => e.type === "turn_complete").every((e) => e.data.stopReason === "end_turn"), true);
    // The continuation after a loop stop carries a note.
    const texts = evs.filter((e) => e.type === "user_message").map((e) => e.data.text);
    assert.ok(!texts[0].includes("loop protection"));
    assert.match(texts[1], /stopped by loop protection/);
    const goal = await api(daemon, "GET", `/api/sessions/${sid}/goal`);
    assert.equal(goal.body.status, "paused");
    assert.equal(goal.body.pauseReason, "loop_detected");
    s.close();
  });

  test("pause, resume, clear; 404 without a goal; bad input is 400", async () => {
    const sid = await session();
    assert.equal((await api(daemon, "GET", `/api/sessions/${sid}/goal`)).status, 404);
    assert.equal((await api(daemon, "POST", `/api/sessions/${sid}/goal/pause`)).status, 404);
    assert.equal((await api(daemon, "POST", `/api/sessions/${sid}/goal/resume`)).status, 404);
    assert.equal((await api(daemon, "PUT", `/api/sessions/${sid}/goal`, { objective: "" })).status, 400);
    assert.equal((await api(daemon, "PUT", `/api/sessions/${sid}/goal`, { objective: "x", maxTurns: 0 })).status, 400);
    const s = await openStream(daemon, sid, {});
    // A long turn keeps the session busy while we pause.
    await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ sleep_ms: 300 }]) });
    await api(daemon, "PUT", `/api/sessions/${sid}/goal`, { objective: script([{ say: "g" }]), maxTurns: 5 });
    const paused = await api(daemon, "POST", `/api/sessions/${sid}/goal/pause`);
    assert.equal(paused.body.status, "paused");
    await new Promise((r) => setTimeout(r, 500));
    assert.equal(events(s).filter((e) => e.type === "prompt_started" && e.data.origin === "goal").length, 0);
    const resumed = await api(daemon, "POST", `/api/sessions/${sid}/goal/resume`);
    assert.equal(resumed.body.status, "active");
    await s.until(() => events(s).some((e) => e.type === "prompt_started" && e.data.origin === "goal"));
    assert.equal((await api(daemon, "DELETE", `/api/sessions/${sid}/goal`)).status, 204);
    assert.equal((await api(daemon, "DELETE", `/api/sessions/${sid}/goal`)).status, 404);
    // Each answer came once its event was stored; the stream follows.
    const hist = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=500`);
    const storedKinds = hist.body.events.map((e) => e.type);
    for (const k of ["goal_set", "goal_paused", "goal_resumed", "goal_cleared"]) assert.ok(storedKinds.includes(k), k);
    await s.until(() => events(s).some((e) => e.type === "goal_cleared"));
    s.close();
  });

  test("a goal survives a restart; the CLI shows it", async () => {
    const dataDir = tempDir();
    let d = await startDaemon({ dataDir });
    try {
      const sid = await session(d);
      await api(d, "PUT", `/api/sessions/${sid}/goal`, { objective: "plain prose objective", maxTurns: 2 });
      await api(d, "POST", `/api/sessions/${sid}/goal/pause`);
      await d.stop();
      d = await startDaemon({ dataDir });
      const out = await new Promise((resolve) =>
        execFile(bin, ["goal", "show", "--session", sid, "--url", d.http, "--token-file", d.tokenFile], (err, stdout, stderr) =>
          resolve({ code: err ? err.code : 0, stdout, stderr }),
        ),
      );
      assert.equal(out.code, 0, out.stderr);
      const g = JSON.parse(out.stdout);
      assert.equal(g.objective, "plain prose objective");
      assert.equal(g.status, "paused");
    } finally {
      await d.stop();
    }
  });
});
