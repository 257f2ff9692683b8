// The HTTP API and SSE stream with a real HTTP client (fetch): resumption,
// the durable turn_error, crash reconciliation, auth.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { api, openStream, script, startDaemon, tempDir } from "./lib/daemon.mjs";

let daemon;

before(async () => {
  daemon = await startDaemon();
});

after(async () => {
  await daemon?.stop();
});

async function newSession(d = daemon) {
  const res = await api(d, "POST", "/api/sessions", { cwd: "/work" });
  assert.equal(res.status, 201);
  return res.body.id;
}

async function prompt(sid, steps, d = daemon) {
  const res = await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: script(steps) });
  assert.equal(res.status, 202, JSON.stringify(res.body));
  return res.body.promptId;
}

async function waitIdle(sid, d = daemon) {
  for (let i = 0; i < 500; i++) {
    const res = await api(d, "GET", `/api/sessions/${sid}`);
    if (res.body.state === "idle") return res.body;
    await new Promise((r) => setTimeout(r, 10));
  }
  throw new Error("never idle");
}

const seqs = (s) => s.events.filter((e) => e.event === "event").map((e) => e.data.seq);

describe("SSE stream", () => {
  test("a client that disconnects mid-turn and resumes with Last-Event-ID gets every event exactly once", async () => {
    const sid = await newSession();
    const first = await openStream(daemon, sid, { after: 0 });
    await first.until(() => first.events.some((e) => e.event === "session_snapshot"));
    assert.equal(first.events[0].event, "session_snapshot", "the snapshot comes first");
    const pid = await prompt(sid, [{ repeat: { times: 60, steps: [{ say: "tick " }, { sleep_ms: 15 }] } }]);
    await first.until(() => seqs(first).length >= 15);
    first.close();
    const seen = seqs(first);
    const lastSeen = seen.at(-1);

    const second = await openStream(daemon, sid, { lastEventId: lastSeen });
    await second.until(() => second.events.some((e) => e.event === "session_snapshot"));
    const snap = second.events[0];
    assert.equal(snap.event, "session_snapshot");
    assert.equal(snap.data.state, "running", "the snapshot shows the true state");
    assert.equal(snap.data.activePromptId, pid);
    await second.until(() => second.events.some((e) => e.data.type === "turn_complete"), 10000);
    second.close();

    const all = [...seen, ...seqs(second)];
    const last = all.at(-1);
    assert.deepEqual(all, Array.from({ length: last }, (_, i) => i + 1), "no gap, no duplicate");
    const ids = second.events.filter((e) => e.event === "event").map((e) => e.id);
    assert.deepEqual(ids, seqs(second), "SSE ids are the sequence numbers");

    const third = await openStream(daemon, sid, {});
    await third.until(() => third.events.length > 0);
    assert.equal(third.events[0].data.state, "idle");
    assert.equal(third.events[0].data.lastSeq, last);
    third.close();
  });
});

describe("turn_error survives reloads", () => {
  test("after a loop-detected rejection, history and a new stream show it; a newer turn supersedes it", async () => {
    const sid = await newSession();
    const call = { name: "read_file", input: { path: "a" }, output: "same" };
    const pid = await prompt(sid, [{ tools: Array(6).fill(call) }]);
    const snap = await waitIdle(sid);
    assert.equal(snap.lastTurnError.errorKind, "loop_detected");
    assert.equal(snap.lastTurnError.loopType, "consecutive_identical_tool_calls");
    assert.equal(snap.lastTurnError.code, "LOOP_DETECTED");
    assert.equal(snap.lastTurnError.promptId, pid);
    assert.equal(snap.lastTurnError.sessionId, sid);

    // A page reload: the history holds the turn_error...
    const hist = await api(daemon, "GET", `/api/sessions/${sid}/history?limit=5`);
    const err = hist.body.events.find((e) => e.type === "turn_error");
    assert.equal(err.data.errorKind, "loop_detected");
    assert.equal(err.data.loopType, "consecutive_identical_tool_calls");
    assert.equal(err.promptId, pid);
    // ...and a new stream's snapshot carries it.
    const s = await openStream(daemon, sid, {});
    await s.until(() => s.events.length > 0);
    assert.equal(s.events[0].data.lastTurnError.errorKind, "loop_detected");
    // A newer turn supersedes it.
    await prompt(sid, [{ say: "newer" }]);
    await s.until(() => s.events.some((e) => e.data.type === "turn_complete"));
    s.close();
    const after = await waitIdle(sid);
    assert.equal(after.lastTurnError, null);
  });
});

describe("crash", () => {
  test("kill -9 during a running turn, then restart: history intact, daemon_restarted terminal, new prompts work", async () => {
    const dataDir = tempDir();
    let d = await startDaemon({ dataDir });
    const sid = await newSession(d);
    await prompt(sid, [{ say: "before the crash" }], d);
    await waitIdle(sid, d);
    const inflight = await prompt(sid, [{ say: "working" }, { sleep_ms: 60000 }], d);
    await new Promise((r) => setTimeout(r, 200));
    const beforeCrash = await api(d, "GET", `/api/sessions/${sid}/history?limit=1000`);
    const { signal } = await d.stop("SIGKILL");
    assert.equal(signal, "SIGKILL");

    d = await startDaemon({ dataDir });
    try {
      const hist = await api(d, "GET", `/api/sessions/${sid}/history?limit=1000`);
      // Everything stored before the crash is still there, in order.
      assert.deepEqual(hist.body.events.slice(0, beforeCrash.body.events.length), beforeCrash.body.events);
      const terminals = hist.body.events.filter(
        (e) => e.promptId === inflight && ["turn_complete", "turn_error"].includes(e.type),
      );
      assert.equal(terminals.length, 1, "exactly one terminal");
      assert.equal(terminals[0].type, "turn_error");
      assert.equal(terminals[0].data.errorKind, "daemon_restarted");
      const snap = await api(d, "GET", `/api/sessions/${sid}`);
      assert.equal(snap.body.state, "idle");
      assert.equal(snap.body.lastTurnError.errorKind, "daemon_restarted");
      await prompt(sid, [{ say: "after" }], d);
      const done = await waitIdle(sid, d);
      assert.equal(done.lastTurnError, null);
    } finally {
      await d.stop();
    }
  });
});

describe("auth", () => {
  test("with a token: none or wrong is 401, right is 200; a foreign Host is refused", async () => {
    const d = await startDaemon({ env: { TILLER_SERVER__TOKEN: "s3cret" } });
    try {
      assert.equal((await api(d, "GET", "/api/sessions", undefined, { authorization: undefined })).status, 401);
      assert.equal((await api(d, "GET", "/api/sessions", undefined, { authorization: "Bearer wrong" })).status, 401);
      assert.equal((await api(d, "GET", "/api/sessions", undefined, { authorization: "Bearer s3cret" })).status, 200);
      assert.equal((await fetch(`${d.http}/healthz`)).status, 200);
    } finally {
      await d.stop();
    }
    // fetch cannot forge Host; use a raw request.
    const net = await import("node:net");
    const [host, port] = daemon.listen.split(":");
    const reply = await new Promise((resolve, reject) => {
      const sock = net.connect(Number(port), host, () => {
        sock.write("GET /api/sessions HTTP/1.1\r\nHost: rebind.evil.example\r\nConnection: close\r\n\r\n");
      });
      let buf = "";
      sock.on("data", (d) => (buf += d));
      sock.on("end", () => resolve(buf));
      sock.on("error", reject);
    });
    assert.match(reply, /^HTTP\/1\.1 421/);
  });
});

describe("keep-alive", () => {
  test("responses announce the idle timeout, so a client never reuses a connection the daemon is closing", async () => {
    const d = await startDaemon({ env: { TILLER_LIMITS__HTTP_HEADER_TIMEOUT: "1s" } });
    try {
      const res = await fetch(`${d.http}/healthz`);
      assert.equal(res.headers.get("keep-alive"), "timeout=1");
      // Idle past the daemon's bound, then a POST (which a client does
      // not retry): it goes out on a fresh connection and succeeds.
      for (let i = 0; i < 3; i++) {
        await new Promise((r) => setTimeout(r, 1000));
        const made = await api(d, "POST", "/api/sessions", { cwd: "/tmp" });
        assert.equal(made.status, 201);
      }
    } finally {
      await d.stop();
    }
  });
});

describe("tiller sessions (admin CLI over the HTTP API)", () => {
  test("list, show, history, close", async () => {
    const { execFile } = await import("node:child_process");
    const { bin } = await import("./lib/daemon.mjs");
    const run = (...args) =>
      new Promise((resolve) => {
        // No token flag: the CLI finds the daemon's token file in the data
        // directory, as an operator's would.
        execFile(
          bin,
          ["sessions", ...args, "--url", daemon.http],
          { env: { ...process.env, TILLER_STORE__DATA_DIR: daemon.dataDir } },
          (err, stdout, stderr) => resolve({ code: err ? err.code : 0, stdout, stderr }),
        );
      });
    const sid = await newSession();
    await prompt(sid, [{ say: "for the cli" }]);
    await waitIdle(sid);
    const list = await run("list");
    assert.equal(list.code, 0, list.stderr);
    assert.ok(JSON.parse(list.stdout).sessions.some((s) => s.id === sid));
    const show = JSON.parse((await run("show", sid)).stdout);
    assert.equal(show.state, "idle");
    const hist = JSON.parse((await run("history", sid, "--limit", "2")).stdout);
    assert.equal(hist.events.length, 2);
    assert.equal(hist.events.at(-1).type, "turn_complete");
    assert.equal((await run("close", sid)).code, 0);
    const gone = await run("show", sid);
    assert.notEqual(gone.code, 0);
    assert.match(gone.stderr, /404/);
    const bad = await run("show", "../etc");
    assert.equal(bad.code, 2);
  });
});
