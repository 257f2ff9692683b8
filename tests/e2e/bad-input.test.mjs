// Bad input gets the right JSON-RPC error, and the connection and the
// daemon keep working. A bad config exits 2 naming the key; nothing starts.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync, writeFileSync } from "node:fs";
import path from "node:path";
import { after, before, describe, test } from "node:test";

import {
  api,
  bin,
  initialize,
  newSession,
  rawUnix,
  script,
  startDaemon,
  tempDir,
  textPrompt,
  transports,
} from "./lib/daemon.mjs";

const LIMIT = 64 * 1024;
let daemon;

before(async () => {
  daemon = await startDaemon({ env: { TILLER_LIMITS__MAX_MESSAGE_BYTES: String(LIMIT) } });
});

after(async () => {
  await daemon?.stop();
});

const req = (id, method, params) => JSON.stringify({ jsonrpc: "2.0", id, method, params });

describe("malformed traffic on one connection", () => {
  test("each gets its error code and the connection keeps working", async () => {
    const raw = await rawUnix(daemon);
    try {
      raw.send(req(1, "initialize", { protocolVersion: 1 }));
      assert.equal((await raw.next((m) => m.id === 1)).result.protocolVersion, 1);
      raw.send(req(2, "session/new", { cwd: "/tmp", mcpServers: [] }));
      const sid = (await raw.next((m) => m.id === 2)).result.sessionId;

      const cases = [
        ["malformed JSON", "{this is not json", null, -32700],
        ["not an object", "[1, 2]", null, -32600],
        ["unknown method", req(10, "session/dance", {}), 10, -32601],
        ["unknown session", req(11, "session/prompt", textPrompt("00000000-0000-4000-8000-000000000000", "hi")), 11, -32002],
        ["garbage session id", req(12, "session/prompt", textPrompt("nope", "hi")), 12, -32002],
        ["bad params", req(13, "session/new", { cwd: 42 }), 13, -32602],
        ["missing params", req(14, "session/prompt", { sessionId: sid }), 14, -32602],
        ["malformed script", req(15, "session/prompt", textPrompt(sid, script([{ say: "a" }, { jump: 1 }]))), 15, -32602],
        ["over the size limit", req(16, "session/new", { cwd: "x".repeat(LIMIT) }), null, -32600],
        ["bad idleBehavior", req(17, "_session/steering", { sessionId: sid, prompt: [], _meta: { steering: { idleBehavior: "maybe" } } }), 17, -32602],
      ];
      for (const [what, frame, id, code] of cases) {
        raw.send(frame);
        const m = await raw.next((m) => m.error && m.id === id);
        assert.equal(m.error.code, code, `${what}: ${JSON.stringify(m)}`);
        assert.ok(m.error.message.length > 0, what);
        // The connection still answers.
        raw.send(req(100, "session/list", {}));
        assert.ok((await raw.next((m) => m.id === 100)).result, `alive after ${what}`);
      }

      // The malformed script names the bad step.
      raw.send(req(20, "session/prompt", textPrompt(sid, script([{ say: 1 }]))));
      const bad = await raw.next((m) => m.id === 20);
      assert.equal(bad.error.data.step, "script[0].say");

      // And a real prompt still runs on the same session.
      raw.send(req(21, "session/prompt", textPrompt(sid, script([{ say: "still fine" }]))));
      assert.equal((await raw.next((m) => m.id === 21)).result.stopReason, "end_turn");
    } finally {
      raw.close();
    }
  });

  test("over WebSocket: an oversized message gets the JSON-RPC error, then the socket closes; a new one works", async () => {
    // The WebSocket limits are limits.max_message_bytes, so nothing larger
    // is ever buffered; the protocol cannot skip the rest of a message, so
    // the socket ends after the error.
    const open = async () => {
      const ws = new WebSocket(daemon.ws, { headers: daemon.auth });
      ws.closed = new Promise((r) => (ws.onclose = (e) => r(e.code)));
      await new Promise((r, j) => {
        ws.onopen = r;
        ws.onerror = j;
      });
      return ws;
    };
    let ws = await open();
    const inbox = [];
    let wake = () => {};
    const listen = (w) =>
      (w.onmessage = (e) => {
        inbox.push(JSON.parse(e.data));
        wake();
      });
    listen(ws);
    const next = (pred) =>
      new Promise((resolve, reject) => {
        const t = setTimeout(() => reject(new Error("no reply")), 5000);
        const check = () => {
          const i = inbox.findIndex(pred);
          if (i >= 0) {
            clearTimeout(t);
            resolve(inbox.splice(i, 1)[0]);
          }
        };
        wake = check;
        check();
      });
    try {
      ws.send(req(1, "session/new", { cwd: "y".repeat(LIMIT + 10) }));
      assert.equal((await next((m) => m.error)).error.code, -32600);
      await ws.closed;
      ws = await open();
      listen(ws);
      ws.send("{nope");
      assert.equal((await next((m) => m.error)).error.code, -32700);
      ws.send(req(2, "initialize", { protocolVersion: 1 }));
      assert.equal((await next((m) => m.id === 2)).result.protocolVersion, 1);
    } finally {
      ws.close();
    }
  });

  test("the daemon still serves new connections afterwards", async () => {
    const c = await transports.unix(daemon);
    try {
      await initialize(c);
      const sid = await newSession(c);
      const res = await c.request("session/prompt", textPrompt(sid, "hello again"));
      assert.equal(res.stopReason, "end_turn");
    } finally {
      c.close();
    }
  });

  test("the SDK surfaces the malformed-script error as a request error", async () => {
    const c = await transports.websocket(daemon);
    try {
      await initialize(c);
      const sid = await newSession(c);
      await assert.rejects(
        c.request("session/prompt", textPrompt(sid, script([{ result: "done" }]))),
        (e) => e.code === -32602 && /script\[0\]\.result/.test(e.message),
      );
    } finally {
      c.close();
    }
  });
});

describe("bad configuration", () => {
  const cases = [
    ["unknown key", "[turn]\ncancel_grac = \"1s\"\n", {}, "turn.cancel_grac"],
    ["bad duration", "[turn]\nstall_timeout = \"forever\"\n", {}, "turn.stall_timeout"],
    ["unknown engine", "[engine]\ndefault = \"nope\"\n", {}, "engine.default"],
    ["auth none off loopback", "[server]\nauth = \"none\"\n", {}, "server.auth", ["--listen", "0.0.0.0:0"]],
    ["bad env override", "", { TILLER_LIMITS__MAX_SESIONS: "3" }, "TILLER_LIMITS__MAX_SESIONS"],
  ];
  for (const [what, toml, env, key, args = ["--listen", "127.0.0.1:0"]] of cases) {
    test(`${what}: exits 2 naming ${key}, nothing starts`, async () => {
      const dir = tempDir();
      const file = path.join(dir, "tiller.toml");
      writeFileSync(file, toml);
      const child = spawn(bin, ["serve", "--config", file, "--data-dir", dir, ...args], {
        env: { ...process.env, ...env },
        stdio: ["ignore", "pipe", "pipe"],
      });
      let err = "";
      child.stderr.on("data", (d) => (err += d));
      const killer = setTimeout(() => child.kill(), 5000); // it must not start
      const code = await new Promise((r) => child.on("close", r));
      clearTimeout(killer);
      assert.equal(code, 2, err);
      assert.ok(err.includes(key), err);
      assert.equal(err.trim().split("\n").length, 1, `one line: ${err}`);
      assert.ok(!existsSync(path.join(dir, "tiller.sock")), "no socket");
      assert.ok(!existsSync(path.join(dir, "tiller.db")), "no store");
    });
  }

  test("tiller config check accepts the documented default", async () => {
    const child = spawn(bin, ["config", "check", path.resolve(import.meta.dirname, "../../config/tiller.toml")]);
    const code = await new Promise((r) => child.on("close", r));
    assert.equal(code, 0);
  });
});

describe("bad query strings over HTTP", () => {
  test("get a JSON 400 naming the problem, like every other API error", async () => {
    const made = await api(daemon, "POST", "/api/sessions", { cwd: "/tmp" });
    const sid = made.body.id;
    for (const path of [
      `/api/sessions/${sid}/history?limit=lots`,
      `/api/sessions?limit=-1`,
      `/api/sessions/${sid}?purge=maybe`,
      `/api/sessions/${sid}/events?after=x`,
    ]) {
      const method = path.includes("purge") ? "DELETE" : "GET";
      const headers = { ...daemon.auth, "content-type": "application/json" };
      const res = await fetch(`${daemon.http}${path}`, { method, headers });
      assert.equal(res.status, 400, path);
      assert.match(res.headers.get("content-type") ?? "", /json/, path);
      const body = await res.json();
      assert.match(body.error?.message ?? body.message ?? "", /.+/, `${path}: ${JSON.stringify(body)}`);
    }
  });
});
