// Three nodes over one PostgreSQL schema, killed (-9) and restarted in
// turn while clients send background notifications through any node and
// a cron job fires every second: every accepted notification runs
// exactly once, nothing runs twice, every cron due time fires at most
// once, and every started prompt has exactly one terminal. Runs in the
// PostgreSQL pass of scripts/test.

import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { after, test } from "node:test";

import { api, script, startDaemon, tempDir } from "./lib/daemon.mjs";

const pg = process.env.TILLER_TEST_POSTGRES_URL;
const skip = pg ? false : "needs PostgreSQL (the PostgreSQL pass of scripts/test runs it)";
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const NOTIFICATIONS = 1000;
const SECONDS = 60;

const running = new Set();
after(() => {
  for (const d of running) d.child.kill("SIGKILL");
});

test("1,000 notifications over 60 s and a cron job every second while nodes are killed and restarted", { skip, timeout: 300_000 }, async () => {
  const schema = `chaos_${randomBytes(6).toString("hex")}`;
  const env = {
    TILLER_STORE__KIND: "postgres",
    TILLER_STORE__SCHEMA: schema,
    TILLER_DATABASE_URL: pg,
    TILLER_SERVER__TOKEN: "cluster-secret",
    TILLER_CLUSTER__LEASE_TTL: "2s",
    TILLER_CLUSTER__RENEW_EVERY: "500ms",
    TILLER_LIMITS__MAX_QUEUED_NOTIFICATIONS: "2000",
  };
  const dirs = ["node-a", "node-b", "node-c"].map((name) => ({ name, dataDir: tempDir() }));
  const nodes = new Array(3);
  const start = async (i) => {
    const d = await startDaemon({
      dataDir: dirs[i].dataDir,
      env: { ...env, TILLER_CLUSTER__NODE_ID: dirs[i].name },
    });
    running.add(d);
    nodes[i] = d;
  };
  for (let i = 0; i < 3; i++) await start(i);

  const sessions = [];
  for (let i = 0; i < 6; i++) {
    const r = await api(nodes[i % 3], "POST", "/api/sessions", { cwd: "/tmp" });
    assert.equal(r.status, 201);
    sessions.push(r.body.id);
  }
  const job = await api(nodes[0], "POST", "/api/cron", {
    sessionId: sessions[0],
    schedule: "* * * * * *",
    prompt: script([{ say: "tick" }]),
  });
  assert.equal(job.status, 201);
  const cronFrom = Date.now();

  // Kill one node every 4 s and bring it back 1 or 3 s later.
  let stop = false;
  const chaos = (async () => {
    let k = 0;
    while (!stop) {
      await sleep(4000);
      if (stop) break;
      const i = k++ % 3;
      const victim = nodes[i];
      nodes[i] = undefined;
      running.delete(victim);
      await victim.stop("SIGKILL");
      // Back before its leases lapse (it settles its own prompts), or
      // after (another node has taken its sessions).
      await sleep(k % 2 ? 1000 : 3000);
      await start(i);
    }
  })();

  // Notifications through whichever node is up; a unique task id each
  // (a retry is a new notification, never the same id again).
  const accepted = new Map();
  const refused = [];
  const sending = (async () => {
    const every = (SECONDS * 1000) / NOTIFICATIONS;
    for (let n = 0; n < NOTIFICATIONS; n++) {
      const up = nodes.filter(Boolean);
      const d = up[n % up.length];
      const sid = sessions[n % sessions.length];
      const taskId = `t${n}`;
      try {
        const r = await api(d, "POST", `/api/sessions/${sid}/notifications`, {
          taskId,
          text: script([{ say: `ran ${taskId}` }, { sleep_ms: 40 }]),
        });
        if (r.status === 202) accepted.set(taskId, sid);
        else refused.push(r.status);
      } catch {
        refused.push("reset");
      }
      await sleep(every);
    }
  })();
  await sending;
  stop = true;
  await chaos;
  const up = nodes.filter(Boolean);
  assert.equal((await api(up[0], "DELETE", `/api/cron/${job.body.id}`)).status, 204);
  const cronTo = Date.now();
  console.log(`chaos: ${accepted.size} of ${NOTIFICATIONS} notifications accepted (${refused.length} refused or cut off while their node died)`);
  assert.ok(accepted.size >= NOTIFICATIONS * 0.8, `only ${accepted.size} accepted`);

  // Every accepted notification runs: wait for the queues to drain.
  const ranIn = (events) => {
    const ran = new Map();
    for (const e of events) {
      if (e.type !== "user_message") continue;
      const m = /ran (t\d+)/.exec(e.data.text);
      if (m) ran.set(m[1], (ran.get(m[1]) ?? 0) + 1);
    }
    return ran;
  };
  /** A session's whole log, page by page (newest first). */
  const fullHistory = async (d, sid) => {
    let events = [];
    let before;
    for (;;) {
      const q = before === undefined ? "" : `&before=${before}`;
      const h = await api(d, "GET", `/api/sessions/${sid}/history?limit=1000${q}`);
      if (h.status !== 200) return null;
      events = [...h.body.events, ...events];
      if (!h.body.hasMore) return events;
      before = h.body.nextBefore;
    }
  };
  const logs = new Map();
  const end = Date.now() + 90_000;
  for (;;) {
    let missing = 0;
    for (const sid of sessions) {
      try {
        const events = await fullHistory(nodes.find(Boolean), sid);
        if (events) logs.set(sid, events);
      } catch {}
    }
    const ran = new Map();
    for (const events of logs.values()) for (const [t, c] of ranIn(events)) ran.set(t, c);
    for (const t of accepted.keys()) if (!ran.has(t)) missing++;
    if (missing === 0) break;
    if (Date.now() > end) assert.fail(`${missing} accepted notifications never ran`);
    await sleep(500);
  }

  let started = 0;
  let cron = 0;
  for (const [sid, events] of logs) {
    // Exactly once: no task ran twice, accepted or not.
    for (const [t, c] of ranIn(events)) {
      assert.equal(c, 1, `${t} ran ${c} times`);
      if (accepted.has(t)) assert.equal(accepted.get(t), sid, `${t} ran on another session`);
    }
    // Every started prompt has exactly one terminal; the log is whole.
    for (const s of events.filter((e) => e.type === "prompt_started")) {
      started++;
      if (s.data.origin === "cron") cron++;
      const ends = events.filter(
        (e) => e.promptId === s.promptId && ["turn_complete", "turn_error"].includes(e.type),
      );
      assert.equal(ends.length, 1, `prompt ${s.promptId} of ${sid} has ${ends.length} terminals`);
    }
    assert.deepEqual(events.map((e) => e.seq), events.map((_, i) => i + 1), `${sid}: no gap, no repeat`);
  }
  const dueSeconds = Math.ceil((cronTo - cronFrom) / 1000);
  const errors = {};
  for (const e of [...logs.values()].flat()) {
    if (e.type === "turn_error") errors[e.data.errorKind] = (errors[e.data.errorKind] ?? 0) + 1;
  }
  console.log(`chaos: ${started} prompts started, turn errors ${JSON.stringify(errors)}; cron fired ${cron} times in ${dueSeconds} s`);
  assert.ok(cron <= dueSeconds + 1, `cron fired ${cron} times in ${dueSeconds} s`);
  assert.ok(cron >= 5, `cron fired only ${cron} times in ${dueSeconds} s`);
  for (const d of nodes.filter(Boolean)) await d.stop();
});
