// Several daemons (nodes) sharing one PostgreSQL schema: leases, fencing,
// failover. Runs in the PostgreSQL pass of scripts/test (it needs a shared
// store; the SQLite pass has one daemon per file by design).

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { after, describe, test } from "node:test";

import { api, bin, script, startDaemon, tempDir } from "./lib/daemon.mjs";

const pg = process.env.TILLER_TEST_POSTGRES_URL;
const skip = pg ? false : "needs PostgreSQL (the PostgreSQL pass of scripts/test runs it)";

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Cluster settings every node of one test shares. */
function clusterEnv(schema) {
  return {
    TILLER_STORE__KIND: "postgres",
    TILLER_STORE__SCHEMA: schema,
    TILLER_DATABASE_URL: pg,
    TILLER_SERVER__TOKEN: "cluster-secret",
    TILLER_CLUSTER__LEASE_TTL: "2s",
    TILLER_CLUSTER__RENEW_EVERY: "500ms",
  };
}

const nodes = [];
async function startNode(schema, name, dataDir = tempDir()) {
  const d = await startDaemon({ dataDir, env: { ...clusterEnv(schema), TILLER_CLUSTER__NODE_ID: name } });
  d.name = name;
  nodes.push(d);
  return d;
}

after(async () => {
  for (const d of nodes) {
    try {
      d.child.kill("SIGCONT");
      d.child.kill("SIGKILL");
    } catch {}
  }
});

function status(schema) {
  const r = spawnSync(bin, ["cluster", "status", "--json"], {
    env: { ...process.env, ...clusterEnv(schema) },
    encoding: "utf8",
  });
  assert.equal(r.status, 0, r.stderr);
  return JSON.parse(r.stdout).nodes;
}

async function history(d, sid) {
  const h = await api(d, "GET", `/api/sessions/${sid}/history?limit=1000`);
  assert.equal(h.status, 200, JSON.stringify(h.body));
  return h.body.events;
}

async function until(what, pred, ms = 15000) {
  const end = Date.now() + ms;
  for (;;) {
    const v = await pred();
    if (v) return v;
    if (Date.now() > end) throw new Error(`${what}: not in ${ms} ms`);
    await sleep(50);
  }
}

const terminalsOf = (events, pid) =>
  events.filter((e) => e.promptId === pid && ["turn_complete", "turn_error"].includes(e.type));

describe("cluster over PostgreSQL", { skip }, () => {
  test("kill -9 of a session's node mid-turn: one node_lost terminal, the session continues on another node", async () => {
    const schema = `cluster_${randomBytes(6).toString("hex")}`;
    const a = await startNode(schema, "node-a");
    const b = await startNode(schema, "node-b");
    const c = await startNode(schema, "node-c");

    // Sessions spread: each node owns those it created.
    const made = {};
    for (const d of [a, b, c]) {
      const r = await api(d, "POST", "/api/sessions", { cwd: "/tmp" });
      assert.equal(r.status, 201);
      made[d.name] = r.body.id;
    }
    const live = status(schema);
    assert.deepEqual(
      live.map((n) => [n.node, n.alive, n.leases]),
      [["node-a", true, 1], ["node-b", true, 1], ["node-c", true, 1]],
    );
    assert.equal(live[0].address, a.http, "a node advertises the address it listens on");

    // A session owned by A: B answers reads from the shared log, and
    // says who serves it for anything else.
    const sid = made["node-a"];
    const started = await api(a, "POST", `/api/sessions/${sid}/prompts`, {
      text: script([{ say: "working" }, { sleep_ms: 60000 }]),
    });
    assert.equal(started.status, 202);
    const pid = started.body.promptId;
    await until("the turn's first words stored", async () =>
      (await history(b, sid)).some((e) => e.type === "agent_message_chunk"),
    );
    const elsewhere = await api(b, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "no" }]) });
    assert.equal(elsewhere.status, 503);
    assert.equal(elsewhere.body.error.errorKind, "owned_elsewhere");
    assert.equal(elsewhere.body.error.node, "node-a");
    assert.equal(elsewhere.body.error.address, a.http);

    const killed = Date.now();
    assert.equal((await a.stop("SIGKILL")).signal, "SIGKILL");

    // Within the lease time (plus a renewal round) another node takes the
    // session over and settles the prompt exactly once.
    const events = await until("the prompt settled by another node", async () => {
      const ev = await history(b, sid);
      return terminalsOf(ev, pid).length > 0 ? ev : null;
    });
    const failover = Date.now() - killed;
    const terms = terminalsOf(events, pid);
    assert.equal(terms.length, 1, "exactly one terminal");
    assert.equal(terms[0].type, "turn_error");
    assert.equal(terms[0].data.errorKind, "node_lost");
    assert.ok(failover < 2000 + 500 + 2000, `failover took ${failover} ms`);
    console.log(`failover: kill -9 to node_lost terminal in ${failover} ms (lease 2 s, renewal 0.5 s)`);

    // The session continues, on whichever node took it.
    const owner = await until("a live owner named", async () => {
      for (const d of [b, c]) {
        const r = await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "after failover" }]) });
        if (r.status === 202) return { d, pid: r.body.promptId };
      }
      return null;
    });
    await until("the new turn completes", async () => {
      const ev = await history(owner.d, sid);
      return terminalsOf(ev, owner.pid).some((e) => e.type === "turn_complete");
    });
    const after = await history(owner.d, sid);
    assert.equal(terminalsOf(after, pid).length, 1, "still one terminal for the lost prompt");
    assert.deepEqual(
      after.map((e) => e.seq),
      after.map((_, i) => i + 1),
      "the log has no gap and no repeat",
    );

    const st = status(schema);
    const byName = Object.fromEntries(st.map((n) => [n.node, n]));
    assert.equal(byName["node-a"].alive, false, "the killed node shows as lost");
    assert.equal(byName["node-a"].leases, 0);
    assert.ok(byName["node-b"].alive && byName["node-c"].alive);
    assert.equal(byName["node-b"].leases + byName["node-c"].leases, 3);

    for (const d of [b, c]) await d.stop();
    assert.deepEqual(status(schema).map((n) => n.node), ["node-a"], "stopped nodes leave the cluster");
  });

  test("a paused owner whose lease was taken cannot append when it resumes", async () => {
    const schema = `cluster_${randomBytes(6).toString("hex")}`;
    const a = await startNode(schema, "node-a");
    const b = await startNode(schema, "node-b");
    const r = await api(a, "POST", "/api/sessions", { cwd: "/tmp" });
    const sid = r.body.id;
    const first = await api(a, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "from a" }]) });
    assert.equal(first.status, 202);
    await until("a's turn completes", async () =>
      terminalsOf(await history(a, sid), first.body.promptId).length === 1,
    );

    a.child.kill("SIGSTOP");
    // A prompt sent to the paused node waits in its socket.
    const stale = api(a, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "STALE WRITE" }]) });
    // Its lease lapses; b takes the session on the next request that
    // needs its owner (a snapshot: b writes nothing to the log yet, so
    // only the fence stands between a's stale write and the log).
    await until("b takes the session", async () => {
      const t = await api(b, "GET", `/api/sessions/${sid}`);
      return t.status === 200;
    });
    a.child.kill("SIGCONT");
    const refused = await stale;
    assert.equal(refused.status, 503, JSON.stringify(refused.body));
    assert.ok(
      ["owned_elsewhere", "store_unavailable"].includes(refused.body.error.errorKind),
      JSON.stringify(refused.body),
    );
    // The resumed node learns it lost the lease and stops serving it.
    await until("a points to b", async () => {
      const t = await api(a, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "again" }]) });
      return t.status === 503 && t.body.error.errorKind === "owned_elsewhere" && t.body.error.node === "node-b";
    });
    const taken = await api(b, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "from b" }]) });
    assert.equal(taken.status, 202, JSON.stringify(taken.body));
    await until("b's turn completes", async () =>
      terminalsOf(await history(b, sid), taken.body.promptId).some((e) => e.type === "turn_complete"),
    );
    const events = await history(b, sid);
    assert.ok(!JSON.stringify(events).includes("STALE WRITE"), "nothing of the stale prompt was stored");
    assert.deepEqual(events.map((e) => e.seq), events.map((_, i) => i + 1), "no gap, no repeat");
    assert.equal(events.filter((e) => e.type === "turn_complete").length, 2);
  });

  test("background notifications: each owner queues and runs its own, a non-owner refuses, ids never collide", async () => {
    const schema = `cluster_${randomBytes(6).toString("hex")}`;
    const a = await startNode(schema, "node-a");
    const b = await startNode(schema, "node-b");
    const sa = (await api(a, "POST", "/api/sessions", { cwd: "/tmp" })).body.id;
    const sb = (await api(b, "POST", "/api/sessions", { cwd: "/tmp" })).body.id;
    const notify = (d, sid, taskId) =>
      api(d, "POST", `/api/sessions/${sid}/notifications`, { taskId, text: script([{ say: `done ${taskId}` }]) });
    // Not the owner: refused before anything is queued.
    const refused = await notify(b, sa, "t0");
    assert.equal(refused.status, 503, JSON.stringify(refused.body));
    assert.equal(refused.body.error.errorKind, "owned_elsewhere");
    // Both sessions busy, so their notifications wait side by side in the
    // shared table: each owner numbers its rows from the store (one counter
    // per node would give both nodes' first rows the same id).
    for (const [d, sid] of [[a, sa], [b, sb]]) {
      const r = await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ sleep_ms: 1500 }]) });
      assert.equal(r.status, 202);
    }
    for (let i = 1; i <= 3; i++) {
      for (const [d, sid] of [[a, sa], [b, sb]]) {
        const r = await notify(d, sid, `t${i}`);
        assert.equal(r.status, 202, JSON.stringify(r.body));
      }
    }
    for (const [d, sid] of [[a, sa], [b, sb]]) {
      await until("three notification turns ran", async () => {
        const ev = await history(d, sid);
        return ev.filter((e) => e.type === "turn_complete").length === 4;
      });
      const ev = await history(d, sid);
      const starts = ev.filter((e) => e.type === "prompt_started");
      assert.deepEqual(starts.map((e) => e.data.origin), ["interactive", "notification", "notification", "notification"]);
      assert.ok(!JSON.stringify(ev).includes("done t0"), "the refused notification never ran");
    }
  });

  test("a cron job firing every second fires each due time once across three nodes, through a kill -9 and a restart", async () => {
    const schema = `cluster_${randomBytes(6).toString("hex")}`;
    const a = await startNode(schema, "node-a");
    const b = await startNode(schema, "node-b");
    const c = await startNode(schema, "node-c");
    const sid = (await api(a, "POST", "/api/sessions", { cwd: "/tmp" })).body.id;
    // Added through another node: every node follows the job from the store.
    const added = Date.now();
    const job = await api(b, "POST", "/api/cron", {
      sessionId: sid,
      schedule: "* * * * * *",
      prompt: script([{ say: "tick" }]),
    });
    assert.equal(job.status, 201, JSON.stringify(job.body));
    const cronStarts = async (d) =>
      (await history(d, sid)).filter((e) => e.type === "prompt_started" && e.data.origin === "cron");
    await until("cron turns on the owner", async () => (await cronStarts(b)).length >= 2);
    assert.equal((await a.stop("SIGKILL")).signal, "SIGKILL");
    const killedAt = (await cronStarts(b)).length;
    await until("cron turns continue on another node", async () => (await cronStarts(b)).length >= killedAt + 2, 20000);
    const a2 = await startNode(schema, "node-a", a.dataDir);
    await sleep(2000);
    assert.equal((await api(a2, "DELETE", `/api/cron/${job.body.id}`)).status, 204);
    const removed = Date.now();
    await sleep(1500);
    const events = await history(c, sid);
    const starts = events.filter((e) => e.type === "prompt_started" && e.data.origin === "cron");
    const seconds = Math.ceil((removed - added) / 1000);
    console.log(`cron across 3 nodes: ${starts.length} fires in ${seconds} s (kill -9 and restart of the owner)`);
    // Once per due time: never more fires than due seconds (missed ones
    // during the failover coalesce into one).
    assert.ok(starts.length <= seconds + 1, `${starts.length} fires in ${seconds} s`);
    assert.ok(starts.length >= 4, `${starts.length} fires in ${seconds} s`);
    for (const s of starts) {
      const ends = terminalsOf(events, s.promptId);
      assert.equal(ends.length, 1, `prompt ${s.promptId} has ${ends.length} terminals`);
    }
    assert.deepEqual(events.map((e) => e.seq), events.map((_, i) => i + 1), "no gap, no repeat");
  });
});
