// Channel ingress and webhook delivery: only a correctly signed channel
// request makes a channel turn; delivery meta never changes classification.

import assert from "node:assert/strict";
import { createHmac } from "node:crypto";
import http from "node:http";
import { after, before, describe, test } from "node:test";

import { api, initialize, newSession, openStream, script, startDaemon, tempDir, textPrompt, transports } from "./lib/daemon.mjs";

const SECRET = "k3y-for-tests";
let daemon;
let hook;
const received = [];

before(async () => {
  hook = http.createServer((req, res) => {
    let body = "";
    req.on("data", (d) => (body += d));
    req.on("end", () => {
      received.push(JSON.parse(body));
      res.writeHead(200).end("ok");
    });
  });
  await new Promise((r) => hook.listen(0, "127.0.0.1", r));
  daemon = await startDaemon({
    env: {
      TILLER_CHANNELS__HOOK__SECRET: SECRET,
      TILLER_CHANNELS__HOOK__CWD: tempDir(),
      TILLER_DELIVERY__ALLOWED_HOSTS: '["127.0.0.1"]',
    },
  });
});

after(async () => {
  await daemon?.stop();
  hook?.close();
});

const webhook = () => `http://127.0.0.1:${hook.address().port}/final`;
const call = { name: "read_file", input: { path: "x" }, output: "same" };
const looping = script([{ say: "partial answer" }, { tools: Array(6).fill(call) }]);

function sign(body, ts = Math.floor(Date.now() / 1000), secret = SECRET) {
  const mac = createHmac("sha256", secret).update(`${ts}.${body}`).digest("hex");
  return { "x-tiller-timestamp": String(ts), "x-tiller-signature": `sha256=${mac}` };
}

async function channelPost(body, headers) {
  const res = await fetch(`${daemon.http}/api/channels/hook/prompts`, {
    method: "POST",
    headers: { "content-type": "application/json", ...headers },
    body,
  });
  return { status: res.status, body: await res.json() };
}

async function until(pred, ms = 5000) {
  for (let i = 0; i < ms / 20; i++) {
    if (await pred()) return;
    await new Promise((r) => setTimeout(r, 20));
  }
  throw new Error("condition not met");
}

describe("channels", () => {
  test("a signed channel prompt that loops ends end_turn with loop_stopped; its webhook gets the final text", async () => {
    const body = JSON.stringify({ text: looping, delivery: { webhook: webhook() } });
    const res = await channelPost(body, sign(body));
    assert.equal(res.status, 202, JSON.stringify(res.body));
    const { sessionId, promptId } = res.body;
    await until(() => received.some((r) => r.promptId === promptId));
    const got = received.find((r) => r.promptId === promptId);
    assert.equal(got.sessionId, sessionId);
    assert.equal(got.text, "partial answer");
    assert.equal(got.stopReason, "end_turn");
    const hist = await api(daemon, "GET", `/api/sessions/${sessionId}/history?limit=100`);
    const types = hist.body.events.map((e) => e.type);
    assert.ok(types.includes("loop_stopped"));
    assert.equal(hist.body.events.find((e) => e.type === "prompt_started").data.origin, "channel");
    assert.equal(hist.body.events.find((e) => e.type === "turn_complete").data.stopReason, "end_turn");
    assert.ok(!types.includes("turn_error"));
  });

  test("the webhook hears every end of a turn: cancelled, max_tokens, a failure with its kind", async () => {
    const post = async (text) => {
      const body = JSON.stringify({ text, delivery: { webhook: webhook() } });
      const res = await channelPost(body, sign(body));
      assert.equal(res.status, 202, JSON.stringify(res.body));
      return res.body;
    };
    const delivered = async (promptId) => {
      await until(() => received.some((r) => r.promptId === promptId), 15000);
      return received.find((r) => r.promptId === promptId);
    };
    const long = await post(script([{ say: "started" }, { sleep_ms: 60000 }]));
    await until(async () => (await api(daemon, "GET", `/api/sessions/${long.sessionId}`)).body.state === "running");
    await api(daemon, "POST", `/api/sessions/${long.sessionId}/cancel`);
    const cancelled = await delivered(long.promptId);
    assert.equal(cancelled.stopReason, "cancelled", JSON.stringify(cancelled));
    const capped = await delivered((await post(script([{ say: "half" }, { result: "max_tokens" }]))).promptId);
    assert.equal(capped.stopReason, "max_tokens");
    assert.equal(capped.text, "half");
    const failed = await delivered((await post(script([{ say: "so far" }, { fail: "boom" }]))).promptId);
    assert.equal(failed.stopReason, "error", JSON.stringify(failed));
    assert.equal(failed.errorKind, "model_stream_interrupted", JSON.stringify(failed));
    assert.equal(failed.text, "so far");
  });

  test("unsigned, badly signed, stale or replayed requests are refused", async () => {
    const body = JSON.stringify({ text: "hi" });
    const good = sign(body);
    const cases = [
      ["unsigned", {}],
      ["bad signature", sign(body, undefined, "wrong secret")],
      ["stale", sign(body, Math.floor(Date.now() / 1000) - 3600)],
    ];
    for (const [what, headers] of cases) {
      const res = await channelPost(body, headers);
      assert.equal(res.status, 401, what);
      assert.equal(res.body.error.errorKind, "unauthorized", what);
    }
    assert.equal((await channelPost(body, good)).status, 202);
    const replay = await channelPost(body, good);
    assert.equal(replay.status, 401);
    assert.match(replay.body.error.message, /replayed/);
    const unknown = await fetch(`${daemon.http}/api/channels/nope/prompts`, {
      method: "POST",
      headers: { "content-type": "application/json", ...sign(body) },
      body,
    });
    assert.equal(unknown.status, 401);
  });

  test("a request that was not admitted (429: the session's queue is full) can be sent again", async () => {
    const first = JSON.stringify({ text: script([{ say: "busy" }, { sleep_ms: 60000 }]) });
    const res = await channelPost(first, sign(first));
    assert.equal(res.status, 202, JSON.stringify(res.body));
    const { sessionId } = res.body;
    // Its queue fills (config: max_queued_prompts = 8).
    for (let i = 0; ; i++) {
      const body = JSON.stringify({ sessionId, text: `queued ${i}` });
      const r = await channelPost(body, sign(body));
      if (r.status === 429) break;
      assert.equal(r.status, 202, JSON.stringify(r.body));
      assert.ok(i < 100, "the queue never filled");
    }
    const body = JSON.stringify({ sessionId, text: script([{ say: "finally" }]) });
    const headers = sign(body);
    const full = await channelPost(body, headers);
    assert.equal(full.status, 429, JSON.stringify(full.body));
    // The turn ends, the queue drains: the sender's identical retry is
    // taken (it was never admitted, so it is no replay).
    assert.equal((await api(daemon, "POST", `/api/sessions/${sessionId}/cancel`)).status < 300, true);
    let again;
    await until(async () => {
      again = await channelPost(body, headers);
      assert.notEqual(again.status, 401, JSON.stringify(again.body));
      return again.status === 202;
    }, 20000);
    // And now it was admitted, it is one.
    const replay = await channelPost(body, headers);
    assert.equal(replay.status, 401);
    assert.match(replay.body.error.message, /replayed/);
  });

  test("a webhook to a host the config does not allow is refused", async () => {
    const body = JSON.stringify({ text: "hi", delivery: { webhook: "http://evil.example/x" } });
    const res = await channelPost(body, sign(body));
    assert.equal(res.status, 400);
    assert.match(res.body.error.message, /allowed_hosts/);
  });

  test("channel markers or delivery meta in _meta over ACP still get the interactive loop_detected rejection", async () => {
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const sid = await newSession(c);
      const meta = { channel: "hook", origin: "channel", tiller: { channel: "hook", origin: "cron", delivery: { webhook: webhook() } } };
      await assert.rejects(
        c.request("session/prompt", { ...textPrompt(sid, looping), _meta: meta }),
        (e) => e.code === -32603 && e.data.errorKind === "loop_detected",
      );
      // Its webhook hears the same failure (never a success).
      await until(() => received.some((r) => r.sessionId === sid));
      const told = received.find((r) => r.sessionId === sid);
      assert.equal(told.stopReason, "error", JSON.stringify(told));
      assert.equal(told.errorKind, "loop_detected", JSON.stringify(told));
      // The delivery meta alone does work for a normal turn.
      await c.request("session/prompt", { ...textPrompt(sid, script([{ say: "delivered" }])), _meta: meta });
      await until(() => received.some((r) => r.sessionId === sid && r.text === "delivered"));
    } finally {
      c.close();
    }
  });

  test("the same through /prompts: markers are ignored, the turn is interactive", async () => {
    const sid = (await api(daemon, "POST", "/api/sessions", {})).body.id;
    const s = await openStream(daemon, sid, {});
    const res = await api(daemon, "POST", `/api/sessions/${sid}/prompts`, {
      text: looping,
      _meta: { origin: "channel", tiller: { channel: "hook", delivery: { webhook: webhook() } } },
    });
    assert.equal(res.status, 202);
    await s.until(() => s.events.some((e) => e.data.type === "turn_error"));
    const evs = s.events.map((e) => e.data);
    assert.equal(evs.find((e) => e.type === "prompt_started").data.origin, "interactive");
    assert.equal(evs.find((e) => e.type === "turn_error").data.errorKind, "loop_detected");
    s.close();
    const metrics = await (await fetch(`${daemon.http}/metrics`, { headers: daemon.auth })).text();
    assert.match(metrics, /tiller_origin_markers_stripped_total\{ingress="http"\} [1-9]/);
    assert.match(metrics, /tiller_origin_markers_stripped_total\{ingress="acp"\} [1-9]/);
  });

  test("a replay is refused after a restart too", async () => {
    const dataDir = tempDir();
    const env = { TILLER_CHANNELS__HOOK__SECRET: SECRET, TILLER_CHANNELS__HOOK__CWD: tempDir() };
    let d = await startDaemon({ dataDir, env });
    const body = JSON.stringify({ text: "once" });
    const headers = { "content-type": "application/json", ...sign(body) };
    const post = () => fetch(`${d.http}/api/channels/hook/prompts`, { method: "POST", headers, body });
    try {
      assert.equal((await post()).status, 202);
      await d.stop();
      d = await startDaemon({ dataDir, env });
      assert.equal((await post()).status, 401);
    } finally {
      await d.stop();
    }
  });
});
