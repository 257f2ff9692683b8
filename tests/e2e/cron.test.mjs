// Cron jobs: durable, time-zoned schedules whose fires run as their own
// turns when the session is idle, after notifications, never stranded.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { after, before, describe, test } from "node:test";

import {
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
  daemon = await startDaemon();
});

after(async () => {
  await daemon?.stop();
});

const session = async (d = daemon) => (await api(d, "POST", "/api/sessions", { cwd: "/w" })).body.id;
const events = (s) => s.events.filter((e) => e.event === "event").map((e) => e.data);
const EVERY_SECOND = "* * * * * *";

describe("cron", () => {
  test("a job fires and runs a turn; list shows it; remove stops it", async () => {
    const sid = await session();
    const s = await openStream(daemon, sid, {});
    const add = await api(daemon, "POST", "/api/cron", {
      sessionId: sid,
      schedule: EVERY_SECOND,
      tz: "Europe/Berlin",
      prompt: script([{ say: "tick" }]),
    });
    assert.equal(add.status, 201, JSON.stringify(add.body));
    assert.ok(add.body.nextFire > Date.now() - 1000);
    await s.until(() => events(s).some((e) => e.type === "turn_complete"), 5000);
    const evs = events(s);
    assert.ok(evs.some((e) => e.type === "cron_fired" && e.data.jobId === add.body.id));
    assert.equal(evs.find((e) => e.type === "prompt_started").data.origin, "cron");
    assert.equal(evs.find((e) => e.type === "agent_message_chunk").data.text, "tick");
    const list = await api(daemon, "GET", "/api/cron");
    const job = list.body.jobs.find((j) => j.id === add.body.id);
    assert.equal(job.tz, "Europe/Berlin");
    assert.equal(job.sessionId, sid);
    assert.equal((await api(daemon, "DELETE", `/api/cron/${add.body.id}`)).status, 204);
    assert.equal((await api(daemon, "DELETE", `/api/cron/${add.body.id}`)).status, 404);
    s.close();
  });

  test("bad schedules, zones and sessions are refused", async () => {
    const sid = await session();
    const bad = [
      [{ sessionId: sid, schedule: "every minute", prompt: "x" }, 400, /cron expression/],
      [{ sessionId: sid, schedule: "* * * * *", tz: "Mars/Base", prompt: "x" }, 400, /time zone/],
      [{ sessionId: "00000000-0000-4000-8000-000000000000", schedule: "* * * * *", prompt: "x" }, 404, /unknown session/],
      [{ sessionId: sid, schedule: "* * * * *" }, 400, /prompt/],
    ];
    for (const [body, status, message] of bad) {
      const res = await api(daemon, "POST", "/api/cron", body);
      assert.equal(res.status, status, JSON.stringify(res.body));
      assert.match(res.body.error.message, message);
    }
  });

  test("an interactive prompt rejected by loop protection is followed by the queued notification, then the cron turn", async () => {
    const c = await transports.unix(daemon);
    let jobId;
    try {
      await initialize(c);
      const sid = await acpSession(c);
      const s = await openStream(daemon, sid, {});
      const call = { name: "read_file", input: { path: "x" }, output: "same" };
      const looping = c.request("session/prompt", textPrompt(sid, script([{ sleep_ms: 1500 }, { tools: Array(6).fill(call) }])));
      await s.until(() => events(s).some((e) => e.type === "prompt_started"));
      jobId = (
        await api(daemon, "POST", "/api/cron", { sessionId: sid, schedule: EVERY_SECOND, prompt: script([{ say: "cron turn" }]) })
      ).body.id;
      await api(daemon, "POST", `/api/sessions/${sid}/notifications`, { taskId: "t", text: script([{ say: "notification turn" }]) });
      await s.until(() => events(s).some((e) => e.type === "cron_fired"), 5000);
      await assert.rejects(looping, (e) => e.data?.errorKind === "loop_detected");
      await s.until(() => events(s).filter((e) => e.type === "turn_complete").length >= 2, 5000);
      await api(daemon, "DELETE", `/api/cron/${jobId}`);
      jobId = undefined;
      const evs = events(s);
      const order = evs
        .filter((e) => e.type === "prompt_started")
        .map((e) => e.data.origin)
        .slice(0, 3);
      assert.deepEqual(order, ["interactive", "notification", "cron"], "admission order after the rejection");
      const terminals = evs.filter((e) => e.type === "turn_error" || e.type === "turn_complete").map((e) => e.type);
      assert.deepEqual(terminals.slice(0, 3), ["turn_error", "turn_complete", "turn_complete"]);
      s.close();
    } finally {
      if (jobId) await api(daemon, "DELETE", `/api/cron/${jobId}`);
      c.close();
    }
  });

  test("jobs survive a restart; the CLI adds, lists and removes them", async () => {
    const dataDir = tempDir();
    let d = await startDaemon({ dataDir });
    const run = (...args) =>
      new Promise((resolve) =>
        execFile(bin, ["cron", ...args, "--url", d.http, "--token-file", d.tokenFile], (err, stdout, stderr) =>
          resolve({ code: err ? err.code : 0, stdout, stderr }),
        ),
      );
    try {
      const sid = await session(d);
      const added = await run("add", "--session", sid, "--schedule", "0 9 * * MON", "--tz", "Asia/Tokyo", "--prompt", "weekly review");
      assert.equal(added.code, 0, added.stderr);
      const id = JSON.parse(added.stdout).id;
      await d.stop();
      d = await startDaemon({ dataDir });
      const listed = JSON.parse((await run("list")).stdout);
      const job = listed.jobs.find((j) => j.id === id);
      assert.equal(job.schedule, "0 9 * * MON");
      assert.equal(job.tz, "Asia/Tokyo");
      assert.ok(job.nextFire > Date.now());
      assert.equal((await run("remove", id)).code, 0);
      assert.equal(JSON.parse((await run("list")).stdout).jobs.length, 0);
      const bad = await run("add", "--session", sid, "--schedule", "nope", "--prompt", "x");
      assert.notEqual(bad.code, 0);
      assert.match(bad.stderr, /400/);
    } finally {
      await d.stop();
    }
  });
});
