// Several daemons (nodes) sharing one PostgreSQL schema: leases, fencing,
// failover. Runs in the PostgreSQL pass of scripts/test (it needs a shared
// store; the SQLite pass has one daemon per file by design).

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { readdirSync, readFileSync } from "node:fs";
import { after, describe, test } from "node:test";

import {
  agentText,
  api,
  bin,
  connectStdio,
  connectWs,
  initialize,
  openStream,
  script,
  startDaemon,
  tempDir,
  textPrompt,
} from "./lib/daemon.mjs";

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
async function startNode(schema, name, dataDir = tempDir(), env = {}) {
  const d = await startDaemon({ dataDir, env: { ...clusterEnv(schema), TILLER_CLUSTER__NODE_ID: name, ...env } });
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

/** Polls `pred` until it returns something truthy; a failed attempt (a
 * node that cannot reach the owner yet) counts as not yet. */
async function until(what, pred, ms = 15000) {
  const end = Date.now() + ms;
  let last;
  for (;;) {
    try {
      const v = await pred();
      if (v) return v;
    } catch (e) {
      last = e;
    }
    if (Date.now() > end) throw new Error(`${what}: not in ${ms} ms${last ? ` (last: ${last.message})` : ""}`);
    await sleep(50);
  }
}

/**
 * SIGSTOP, then wait until every thread of the process has stopped: kill()
 * returns once the signal is pending, and under load the other threads go
 * on running (and answering requests) until one of them takes it.
 */
async function pause(child) {
  child.kill("SIGSTOP");
  const tasks = `/proc/${child.pid}/task`;
  await until("the process stops", () =>
    readdirSync(tasks).every((t) => {
      // The state follows the command name, which is in parentheses.
      const stat = readFileSync(`${tasks}/${t}/stat`, "utf8");
      return stat.slice(stat.lastIndexOf(")") + 2)[0] === "T";
    }),
  );
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

    // A session owned by A, used through B: B sends each request on to A
    // and its answers (the stream too) come back as A gave them.
    const sid = made["node-a"];
    const seqs = (st) => st.events.filter((e) => e.event === "event").map((e) => e.data.seq);
    const first = await openStream(b, sid, { after: 0 });
    const started = await api(b, "POST", `/api/sessions/${sid}/prompts`, {
      text: script([{ say: "working" }, { sleep_ms: 60000 }]),
    });
    assert.equal(started.status, 202, JSON.stringify(started.body));
    const pid = started.body.promptId;
    await first.until(() => first.events.some((e) => e.data.type === "agent_message_chunk"));
    const viaB = await api(b, "GET", `/api/sessions/${sid}`);
    const onA = await api(a, "GET", `/api/sessions/${sid}`);
    assert.equal(viaB.body.state, "running");
    assert.equal(viaB.body.activePromptId, pid);
    assert.deepEqual(viaB.body, onA.body, "through B, exactly what A says");

    const killed = Date.now();
    assert.equal((await a.stop("SIGKILL")).signal, "SIGKILL");
    await first.until(() => first.ended(), 10000).catch(() => {});
    assert.ok(first.ended(), "the stream through B ends with A");
    const seen = seqs(first);

    // The client follows on C from the last event it saw; once A's lease
    // lapses, a live node serves the session (C itself, or the node that
    // adopted it) and the prompt left in flight settles exactly once.
    const second = await until("a stream on C", async () => {
      try {
        return await openStream(c, sid, { lastEventId: seen.at(-1) });
      } catch {
        return null;
      }
    });
    await second.until(
      () => second.events.some((e) => e.data.promptId === pid && e.data.type === "turn_error"),
      15000,
    );
    const failover = Date.now() - killed;
    const events = await history(c, sid);
    const terms = terminalsOf(events, pid);
    assert.equal(terms.length, 1, "exactly one terminal");
    assert.equal(terms[0].type, "turn_error");
    assert.equal(terms[0].data.errorKind, "node_lost");
    console.log(`failover: kill -9 to the node_lost terminal on a follower in ${failover} ms (lease 2 s, renewal 0.5 s)`);

    // The session continues, whichever node took it, asked through any.
    const next = await api(b, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "after failover" }]) });
    assert.equal(next.status, 202, JSON.stringify(next.body));
    await second.until(
      () => second.events.some((e) => e.data.promptId === next.body.promptId && e.data.type === "turn_complete"),
      10000,
    );
    second.close();
    const after = await history(b, sid);
    assert.equal(terminalsOf(after, pid).length, 1, "still one terminal for the lost prompt");
    assert.deepEqual(after.map((e) => e.seq), after.map((_, i) => i + 1), "the log has no gap and no repeat");
    // The follower saw every event once, across the failover.
    const followed = [...seen, ...seqs(second)].filter((q) => q <= after.at(-1).seq);
    assert.deepEqual(followed, after.map((e) => e.seq), "every event once, in order");

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

    await pause(a.child);
    // A prompt sent to the paused node waits in its socket. (Marked as
    // sent on by another node, so a resumed a serves it or refuses it,
    // and never sends it on: this test is about a's own writes.)
    const direct = { "x-tiller-forwarded": "1" };
    const stale = api(a, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "STALE WRITE" }]) }, direct);
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
      // Refused by the fence, by the lease, or the actor stopped under it
      // (its lease was found lost while the prompt waited in its mailbox).
      ["owned_elsewhere", "store_unavailable", "session_stopped"].includes(refused.body.error.errorKind),
      JSON.stringify(refused.body),
    );
    // The resumed node learns it lost the lease and stops serving it.
    await until("a points to b", async () => {
      const t = await api(a, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "again" }]) }, direct);
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

  test("an owner that finds its lease taken tells its clients' prompts node_lost, what the new owner stores", async () => {
    const schema = `cluster_${randomBytes(6).toString("hex")}`;
    // No stall watchdog to fire first when a resumes.
    const a = await startNode(schema, "node-a", tempDir(), { TILLER_TURN__STALL_TIMEOUT: "600s" });
    const b = await startNode(schema, "node-b");
    const sid = (await api(a, "POST", "/api/sessions", { cwd: "/tmp" })).body.id;
    const onA = await connectWs(a);
    try {
      await initialize(onA);
      await onA.request("session/load", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
      // A quiet turn: nothing is written while it sleeps, so a finds its
      // lease lost by renewing it, not by a fenced write.
      const prompt = onA.request("session/prompt", textPrompt(sid, script([{ say: "working" }, { sleep_ms: 60000 }])));
      const answered = prompt.then(
        (r) => ({ result: r }),
        (e) => ({ error: e }),
      );
      await onA.until(() => agentText(onA, sid) === "working");
      await pause(a.child);
      await until("b takes the session", async () => (await api(b, "GET", `/api/sessions/${sid}`)).status === 200);
      const events = await history(b, sid);
      const started = events.find((e) => e.type === "prompt_started");
      const terms = terminalsOf(events, started.promptId);
      assert.equal(terms.length, 1, "the new owner settled the prompt left in flight");
      assert.equal(terms[0].data.errorKind, "node_lost");
      a.child.kill("SIGCONT");
      const { result, error } = await answered;
      assert.equal(result, undefined, `a's client heard a result: ${JSON.stringify(result)}`);
      assert.equal(error.data?.errorKind, "node_lost", `a's client heard: ${JSON.stringify(error)}`);
      assert.equal(error.data?.promptId, started.promptId);
    } finally {
      onA.close();
    }
  });

  test("an owner cut off from the store stops its sessions before its leases lapse: its clients hear node_lost, only the new owner runs them", async () => {
    const schema = `cluster_${randomBytes(6).toString("hex")}`;
    // Node a reaches PostgreSQL through a proxy that can stop carrying
    // anything (a network partition between a and the store).
    const net = await import("node:net");
    const port = Number(/port=(\d+)/.exec(pg)[1]);
    let cut = false;
    const held = new Set();
    const proxy = net.createServer((client) => {
      const upstream = net.connect(port, "127.0.0.1");
      for (const [from, to] of [[client, upstream], [upstream, client]]) {
        held.add(from);
        from.on("error", () => {});
        from.on("data", (d) => {
          if (!cut) to.write(d);
        });
        from.on("close", () => to.destroy());
      }
    });
    await new Promise((r) => proxy.listen(0, "127.0.0.1", r));
    const viaProxy = pg.replace(/port=\d+/, `port=${proxy.address().port}`);
    const a = await startNode(schema, "node-a", tempDir(), {
      TILLER_DATABASE_URL: viaProxy,
      TILLER_TURN__STALL_TIMEOUT: "600s",
    });
    const b = await startNode(schema, "node-b");
    const sid = (await api(a, "POST", "/api/sessions", { cwd: "/tmp" })).body.id;
    const onA = await connectWs(a);
    try {
      await initialize(onA);
      await onA.request("session/load", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
      const prompt = onA.request("session/prompt", textPrompt(sid, script([{ say: "working" }, { sleep_ms: 60000 }])));
      const answered = prompt.then(
        (r) => ({ result: r }),
        (e) => ({ error: e }),
      );
      await onA.until(() => agentText(onA, sid) === "working");
      cut = true;
      // a cannot renew: it stops the session itself, before its lease
      // lapses (2 s), and tells its client; it does not go on running the
      // turn beside the node that takes the session over.
      const { result, error } = await Promise.race([
        answered,
        sleep(15000).then(() => ({ result: "still running after 15 s" })),
      ]);
      assert.equal(result, undefined, `a's client heard: ${JSON.stringify(result)}`);
      assert.equal(error.data?.errorKind, "node_lost", `a's client heard: ${JSON.stringify(error)}`);
      // Nor does a open it again meanwhile (a new lease of it would be let
      // go with the old one), and it says so at once.
      const direct = { "x-tiller-forwarded": "1" };
      const reopen = await Promise.race([
        api(a, "GET", `/api/sessions/${sid}`, undefined, direct),
        sleep(5000).then(() => ({ status: "no answer in 5 s" })),
      ]);
      assert.equal(reopen.status, 503, JSON.stringify(reopen.body));
      // b takes the session and settles the prompt left in flight.
      await until("b takes the session", async () => (await api(b, "GET", `/api/sessions/${sid}`)).status === 200);
      const events = await history(b, sid);
      const started = events.find((e) => e.type === "prompt_started");
      assert.deepEqual(terminalsOf(events, started.promptId).map((e) => e.data.errorKind), ["node_lost"]);
      // a, reconnected, does not take it back by renewing its old lease.
      cut = false;
      for (const s of held) s.destroy();
      await sleep(3000);
      const again = await api(b, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "from b" }]) });
      assert.equal(again.status, 202, JSON.stringify(again.body));
    } finally {
      onA.close();
      proxy.close();
      for (const s of held) s.destroy();
    }
  });

  test("a channel request for a session another node serves is carried to it", async () => {
    const schema = `cluster_${randomBytes(6).toString("hex")}`;
    const secret = "channel-secret";
    const channelEnv = { TILLER_CHANNELS__HOOK__SECRET: secret, TILLER_CHANNELS__HOOK__CWD: tempDir() };
    const a = await startNode(schema, "node-a", tempDir(), channelEnv);
    const b = await startNode(schema, "node-b", tempDir(), channelEnv);
    const { createHmac } = await import("node:crypto");
    const post = async (d, body) => {
      const ts = String(Math.floor(Date.now() / 1000));
      const mac = createHmac("sha256", secret).update(`${ts}.${body}`).digest("hex");
      const res = await fetch(`${d.http}/api/channels/hook/prompts`, {
        method: "POST",
        headers: { "content-type": "application/json", "x-tiller-timestamp": ts, "x-tiller-signature": `sha256=${mac}` },
        body,
      });
      return { status: res.status, body: await res.json() };
    };
    // The channel's session starts on a.
    const first = await post(a, JSON.stringify({ text: script([{ say: "on a" }]) }));
    assert.equal(first.status, 202, JSON.stringify(first.body));
    const sid = first.body.sessionId;
    // The sender's next request reaches b (a balancer's choice).
    const next = await post(b, JSON.stringify({ sessionId: sid, text: script([{ say: "through b" }]) }));
    assert.equal(next.status, 202, JSON.stringify(next.body));
    await until("the prompt runs on a", async () =>
      terminalsOf(await history(a, sid), next.body.promptId).some((e) => e.type === "turn_complete"),
    );
  });

  test("background notifications: each owner queues and runs its own, one sent through another node too, ids never collide", async () => {
    const schema = `cluster_${randomBytes(6).toString("hex")}`;
    const a = await startNode(schema, "node-a");
    const b = await startNode(schema, "node-b");
    const sa = (await api(a, "POST", "/api/sessions", { cwd: "/tmp" })).body.id;
    const sb = (await api(b, "POST", "/api/sessions", { cwd: "/tmp" })).body.id;
    const notify = (d, sid, taskId) =>
      api(d, "POST", `/api/sessions/${sid}/notifications`, { taskId, text: script([{ say: `done ${taskId}` }]) });
    // Both sessions busy, so their notifications wait side by side in the
    // shared table: each owner numbers its rows from the store (one counter
    // per node would give both nodes' first rows the same id).
    for (const [d, sid] of [[a, sa], [b, sb]]) {
      const r = await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ sleep_ms: 1500 }]) });
      assert.equal(r.status, 202);
    }
    // Through the node that does not serve it: sent on to the owner,
    // queued and run there.
    const through = await notify(b, sa, "t0");
    assert.equal(through.status, 202, JSON.stringify(through.body));
    for (let i = 1; i <= 3; i++) {
      for (const [d, sid] of [[a, sa], [b, sb]]) {
        const r = await notify(d, sid, `t${i}`);
        assert.equal(r.status, 202, JSON.stringify(r.body));
      }
    }
    for (const [d, sid] of [[a, sa], [b, sb]]) {
      await until("three notification turns ran", async () => {
        const ev = await history(d, sid);
        return ev.filter((e) => e.type === "turn_complete").length === (sid === sa ? 5 : 4);
      });
      const ev = await history(d, sid);
      const starts = ev.filter((e) => e.type === "prompt_started");
      const notes = sid === sa ? 4 : 3;
      assert.deepEqual(starts.map((e) => e.data.origin), ["interactive", ...Array(notes).fill("notification")]);
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
    const killedAt = (await until("the log read once the session has a live owner", () => cronStarts(b))).length;
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

  test("a node that cannot start a session (it is full) does not keep it from the others", async () => {
    const schema = `cluster_${randomBytes(6).toString("hex")}`;
    const a = await startNode(schema, "node-a");
    const full = await startNode(schema, "node-b", tempDir(), { TILLER_LIMITS__MAX_SESSIONS: "1" });
    assert.equal((await api(full, "POST", "/api/sessions", { cwd: "/tmp" })).status, 201);
    const sid = (await api(a, "POST", "/api/sessions", { cwd: "/tmp" })).body.id;
    a.child.kill("SIGKILL");
    await a.exited;
    // A's lease lapses; the full node is asked first and cannot serve it.
    await until("node a's lease lapses", async () =>
      status(schema).find((n) => n.node === "node-a")?.leases === 0,
    );
    const refused = await api(full, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "x" }]) });
    assert.equal(refused.status, 503);
    assert.match(refused.body.error.message, /limits\.max_sessions/);
    // Another node serves it at once: the full node took no lease.
    const c = await startNode(schema, "node-c");
    const r = await api(c, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "served by c" }]) });
    assert.equal(r.status, 202, JSON.stringify(r.body));
    await until("the prompt completes on node c", async () =>
      terminalsOf(await history(c, sid), r.body.promptId).length === 1,
    );
    const leases = Object.fromEntries(status(schema).map((n) => [n.node, n.leases]));
    assert.equal(leases["node-b"], 1, "the full node holds only its own session");
    assert.equal(leases["node-c"], 1);
  });

  test("a node that advertises a wrong address gets an error back, not an endless chain of hand-overs", async () => {
    const schema = `cluster_${randomBytes(6).toString("hex")}`;
    const b = await startNode(schema, "node-b", tempDir(), { TILLER_LIMITS__MAX_CONNECTIONS: "8" });
    // A misconfigured node: it advertises B's address (as a loopback or
    // copied address would on several machines).
    const a = await startNode(schema, "node-a", tempDir(), { TILLER_CLUSTER__ADVERTISE: b.http });
    const sid = (await api(a, "POST", "/api/sessions", { cwd: "/tmp" })).body.id;
    const viaB = await connectWs(b);
    try {
      await initialize(viaB);
      // B hands the connection to "A" (itself); the connection handed over
      // is never handed on again: the client gets owned_elsewhere.
      const err = await viaB.request("session/load", { sessionId: sid, cwd: "/tmp", mcpServers: [] }).then(
        () => assert.fail("a session served by no reachable node was loaded"),
        (e) => e,
      );
      assert.equal(err.data?.errorKind, "owned_elsewhere", JSON.stringify(err));
      assert.equal(err.data?.node, "node-a");
      // B spent two of its eight connections on it, not all of them.
      const other = await connectWs(b);
      try {
        await initialize(other);
        const made = await other.request("session/new", { cwd: "/tmp", mcpServers: [] });
        assert.ok(made.sessionId);
      } finally {
        other.close();
      }
    } finally {
      viaB.close();
    }
  });

  test("an ACP client on node B prompts a session node A serves and sees exactly what A's clients see", async () => {
    const schema = `cluster_${randomBytes(6).toString("hex")}`;
    const a = await startNode(schema, "node-a");
    const b = await startNode(schema, "node-b");
    const sid = (await api(a, "POST", "/api/sessions", { cwd: "/tmp" })).body.id;
    const first = await api(a, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "earlier turn" }]) });
    assert.equal(first.status, 202);
    await until("the earlier turn completes", async () =>
      terminalsOf(await history(a, sid), first.body.promptId).length === 1,
    );

    const onA = await connectWs(a);
    await initialize(onA);
    await onA.request("session/load", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
    // Two clients of node B, over WebSocket and over stdio (`tiller acp`
    // relaying to B's unix socket): both are handed to A.
    for (const connect of [connectWs, connectStdio]) {
      const viaB = await connect(b);
      try {
        await initialize(viaB);
        const before = agentText(onA, sid);
        await viaB.request("session/load", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
        assert.equal(agentText(viaB, sid), before, "the load replays A's history");
        const said = `through ${connect.name}`;
        const answer = await viaB.request("session/prompt", textPrompt(sid, script([{ say: said }])));
        assert.equal(answer.stopReason, "end_turn");
        assert.equal(agentText(viaB, sid), `${before}${said}`);
        await onA.until(() => agentText(onA, sid).endsWith(said));
      } finally {
        viaB.close();
      }
    }
    // What B's clients saw is what A's client saw.
    assert.equal(agentText(onA, sid), "earlier turnthrough connectWsthrough connectStdio");
    onA.close();
    // A served every turn: B never took the session.
    const nodes = status(schema);
    assert.deepEqual(nodes.map((n) => [n.node, n.leases]), [["node-a", 1], ["node-b", 0]]);
    const events = await history(a, sid);
    assert.equal(events.filter((e) => e.type === "turn_complete").length, 3);
  });
});
