// Sessions and their history survive a daemon restart; session/load replays
// the stored log as session/updates, on every transport.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import path from "node:path";
import { Readable, Writable } from "node:stream";
import { describe, test } from "node:test";

import { ndJsonStream } from "@agentclientprotocol/sdk";

import {
  agentText,
  bin,
  connectStream,
  initialize,
  newSession,
  script,
  startDaemon,
  tempDir,
  textPrompt,
  transports,
  storeEnv,
} from "./lib/daemon.mjs";

describe("restart", () => {
  test("session/list then session/load after a restart replays the history", async () => {
    const dataDir = tempDir();
    let daemon = await startDaemon({ dataDir });
    const sessions = {};
    try {
      const c = await transports.unix(daemon);
      await initialize(c);
      for (const name of Object.keys(transports)) {
        const sid = await newSession(c, `/work/${name}`);
        sessions[name] = sid;
        await c.request(
          "session/prompt",
          textPrompt(
            sid,
            script([{ say: `history of ${name}` }, { tool: { name: "probe", output: "seen" } }]),
          ),
        );
      }
      c.close();
    } finally {
      const { code } = await daemon.stop("SIGINT");
      assert.equal(code, 0, "graceful shutdown exits 0");
    }

    daemon = await startDaemon({ dataDir });
    try {
      for (const [name, connect] of Object.entries(transports)) {
        const c = await connect(daemon);
        try {
          await initialize(c);
          const listed = await c.request("session/list", {});
          const ids = listed.sessions.map((s) => s.sessionId);
          for (const sid of Object.values(sessions)) assert.ok(ids.includes(sid), `${sid} listed`);

          const sid = sessions[name];
          const res = await c.request("session/load", { sessionId: sid, cwd: `/work/${name}`, mcpServers: [] });
          assert.ok(res.modes && res.configOptions, JSON.stringify(res));
          // The replay arrived before the response.
          assert.equal(agentText(c, sid), `history of ${name}`);
          const kinds = c.updates.filter((u) => u.sessionId === sid).map((u) => u.update.sessionUpdate);
          assert.equal(kinds[0], "user_message_chunk");
          assert.ok(kinds.includes("tool_call") && kinds.includes("tool_call_update"), kinds.join());

          // The loaded session keeps working, and live updates follow the replay.
          const more = await c.request("session/prompt", textPrompt(sid, script([{ say: " and more" }])));
          assert.equal(more.stopReason, "end_turn");
          assert.equal(agentText(c, sid), `history of ${name} and more`);
        } finally {
          c.close();
        }
      }
    } finally {
      await daemon.stop();
    }
  });

  test("loading an unknown session is -32002", async () => {
    const daemon = await startDaemon();
    try {
      const c = await transports.websocket(daemon);
      await initialize(c);
      await assert.rejects(
        c.request("session/load", {
          sessionId: "00000000-0000-4000-8000-000000000000",
          cwd: "/",
          mcpServers: [],
        }),
        (e) => e.code === -32002,
      );
      c.close();
    } finally {
      await daemon.stop();
    }
  });
});

describe("one daemon per SQLite store", () => {
  test("a second daemon on the same store is refused at start, and the first goes on", async () => {
    // SQLite whatever the suite's store: the lock is the file's.
    const dataDir = tempDir();
    const daemon = await startDaemon({ dataDir, env: { TILLER_STORE__KIND: "sqlite" } });
    try {
      const c = await transports.unix(daemon);
      await initialize(c);
      const first = await newSession(c);
      const second = spawn(bin, ["serve", "--data-dir", dataDir, "--listen", "127.0.0.1:0"], {
        env: { ...process.env, TILLER_STORE__KIND: "sqlite" },
        stdio: ["ignore", "ignore", "pipe"],
      });
      let log = "";
      second.stderr.on("data", (d) => (log += d.toString()));
      const code = await new Promise((resolve) => second.on("exit", resolve));
      assert.notEqual(code, 0, log);
      assert.match(log, /in use by another Tiller process/);
      // The first daemon still has its store, its socket and its sessions.
      const after = await newSession(c);
      assert.notEqual(after, first);
      const { sessions } = await c.request("session/list", {});
      assert.ok(sessions.some((s) => s.sessionId === first), JSON.stringify(sessions));
      c.close();
    } finally {
      await daemon.stop();
    }
  });
});

describe("tiller acp", () => {
  test("--embedded runs a private daemon on stdio", async () => {
    const dataDir = tempDir();
    const child = spawn(bin, ["acp", "--embedded", "--data-dir", dataDir], {
      stdio: ["pipe", "pipe", "pipe"],
      env: { ...process.env, RUST_LOG: "warn", ...storeEnv(dataDir) },
    });
    const c = connectStream(ndJsonStream(Writable.toWeb(child.stdin), Readable.toWeb(child.stdout)));
    try {
      await initialize(c);
      const sid = await newSession(c);
      const res = await c.request("session/prompt", textPrompt(sid, script([{ say: "embedded" }])));
      assert.equal(res.stopReason, "end_turn");
      assert.equal(agentText(c, sid), "embedded");
    } finally {
      c.close();
      child.kill();
    }
  });

  test("--embedded logs to a file in its data directory; stderr gets warnings only, never INFO chatter", async () => {
    const { existsSync, readFileSync, statSync } = await import("node:fs");
    const dataDir = tempDir();
    const child = spawn(bin, ["acp", "--embedded", "--data-dir", dataDir], {
      stdio: ["pipe", "pipe", "pipe"],
      env: { ...process.env, RUST_LOG: "info", ...storeEnv(dataDir) },
    });
    let err = "";
    child.stderr.on("data", (d) => (err += d));
    const c = connectStream(ndJsonStream(Writable.toWeb(child.stdin), Readable.toWeb(child.stdout)));
    try {
      await initialize(c);
      const sid = await newSession(c);
      const res = await c.request("session/prompt", textPrompt(sid, script([{ say: "quiet" }])));
      assert.equal(res.stopReason, "end_turn");
    } finally {
      c.close();
      child.stdin.end();
    }
    await new Promise((r) => child.on("close", r));
    assert.doesNotMatch(err, /INFO/, err);
    const log = path.join(dataDir, "tiller-acp.log");
    assert.ok(existsSync(log), "the log file exists");
    assert.equal(statSync(log).mode & 0o777, 0o600);
    assert.match(readFileSync(log, "utf8"), /INFO/);
  });

  test("with no daemon it prints a one-line hint and exits non-zero", async () => {
    const child = spawn(bin, ["acp", "--connect", `unix:${tempDir()}/none.sock`], {
      stdio: ["pipe", "pipe", "pipe"],
    });
    let err = "";
    child.stderr.on("data", (d) => (err += d));
    const code = await new Promise((r) => child.on("close", r));
    assert.notEqual(code, 0);
    assert.match(err, /no daemon answers at unix:.*tiller serve/);
    assert.equal(err.trim().split("\n").length, 1, err);
  });
});
