// Durability from outside: nothing is acknowledged before it is stored
// (a full disk refuses the prompt, retryably), and queued work survives a
// kill -9 at any moment (every accepted notification either ran or is
// still queued, and runs after the restart).

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { closeSync, mkdirSync, openSync, rmSync, writeSync } from "node:fs";
import path from "node:path";
import { describe, test } from "node:test";

import { launch, page as newPage } from "./lib/browser.mjs";
import { agentText, api, initialize, newSession, script, startDaemon, tempDir, textPrompt, transports } from "./lib/daemon.mjs";

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Writes files until the filesystem is full (ENOSPC), big chunks then small. */
function fill(file) {
  for (const [name, size] of [[file, 64 * 1024], [`${file}.tail`, 512]]) {
    const fd = openSync(name, "w");
    try {
      for (;;) writeSync(fd, Buffer.alloc(size, 1));
    } catch (e) {
      if (e.code !== "ENOSPC") throw e;
    } finally {
      closeSync(fd);
    }
  }
}

describe("a full disk", () => {
  test("answers the prompt with a retryable store_unavailable (HTTP 503 at once; ACP -32603, its turn stopped) and loses nothing once space is back", async () => {
    // A small tmpfs of our own as the data directory (needs root, as CI has).
    const mnt = tempDir();
    execFileSync("mount", ["-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", mnt]);
    const dataDir = path.join(mnt, "data");
    mkdirSync(dataDir, { mode: 0o700 });
    // The disk that fills is the data directory's: SQLite's, also when
    // the rest of the suite runs on PostgreSQL.
    const d = await startDaemon({ dataDir, env: { TILLER_STORE__KIND: "sqlite" } });
    const c = await transports.unix(d);
    const watcher = await transports.unix(d);
    try {
      await initialize(c);
      await initialize(watcher);
      const sid = await newSession(c);
      await watcher.request("session/load", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
      const ok = await c.request("session/prompt", textPrompt(sid, script([{ say: "before" }])));
      assert.equal(ok.stopReason, "end_turn");
      const admitted = async () => {
        const text = await (await fetch(`${d.http}/metrics`, { headers: d.auth })).text();
        return Number(text.match(/^tiller_prompts_admitted_total\{origin="interactive"\} (\d+)/m)?.[1] ?? 0);
      };
      const admittedBefore = await admitted();
      fill(path.join(mnt, "filler"));

      const http = await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "while full" }]) });
      assert.equal(http.status, 503, JSON.stringify(http.body));
      assert.equal(http.body.error.errorKind, "store_unavailable");
      assert.equal(http.body.error.retryable, true);

      const err = await c.request("session/prompt", textPrompt(sid, script([{ say: "while full" }]))).then(
        () => null,
        (e) => e,
      );
      assert.ok(err, "the prompt was refused");
      assert.equal(err.code, -32603);
      assert.equal(err.data?.errorKind, "store_unavailable", JSON.stringify(err));
      assert.equal(err.data?.retryable, true);

      rmSync(path.join(mnt, "filler"));
      rmSync(path.join(mnt, "filler.tail"));
      const again = await c.request("session/prompt", textPrompt(sid, script([{ say: "after" }])));
      assert.equal(again.stopReason, "end_turn");
      // Only the prompt that was stored counts as admitted.
      assert.equal(await admitted(), admittedBefore + 1, "tiller_prompts_admitted_total counts stored admissions only");
      // The session's actor was rebuilt: both connections' attachments were
      // renewed, the prompting one and the one that only watches.
      assert.match(agentText(c, sid), /after/, "the prompting client saw its own turn");
      for (let i = 0; i < 100 && !/after/.test(agentText(watcher, sid)); i++) await sleep(20);
      assert.match(agentText(watcher, sid), /after/, "the watching client saw the turn");
      // The log never saw the refused prompts, and has no gaps.
      const evs = (await api(d, "GET", `/api/sessions/${sid}/history?limit=500`)).body.events;
      assert.deepEqual(
        evs.map((e) => e.seq),
        evs.map((_, i) => i + 1),
      );
      const said = evs.filter((e) => e.type === "user_message").map((e) => e.data.text);
      assert.equal(said.length, 2, JSON.stringify(said));
      assert.ok(!said.some((t) => t.includes("while full")));
    } finally {
      c.close();
      watcher.close();
      await d.stop();
      execFileSync("umount", [mnt]);
    }
  });
});

describe("kill -9", () => {
  test("during notification claims leaves every accepted notification run or queued, and all run after restart", async () => {
    const dataDir = tempDir();
    const env = { TILLER_LIMITS__MAX_QUEUED_NOTIFICATIONS: "1000" };
    let d = await startDaemon({ dataDir, env });
    const created = await api(d, "POST", "/api/sessions", { cwd: "/tmp" });
    assert.equal(created.status, 201, JSON.stringify(created.body));
    const sid = created.body.id;
    const tasks = Array.from({ length: 200 }, (_, i) => `task-${i}`);
    for (const t of tasks) {
      const r = await api(d, "POST", `/api/sessions/${sid}/notifications`, { taskId: t, text: script([{ say: `ran ${t}` }]) });
      assert.equal(r.status, 202, JSON.stringify(r.body));
    }
    // Kill it several times while it drains the queue, at varying moments.
    for (const wait of [40, 90, 25, 140, 60, 10, 35, 70, 15, 55, 5, 45, 80, 20, 65, 30, 100, 12, 50, 8]) {
      await sleep(wait);
      await d.stop("SIGKILL");
      d = await startDaemon({ dataDir, env });
    }
    const ran = async () => {
      const evs = (await api(d, "GET", `/api/sessions/${sid}/history?limit=10000`)).body.events;
      return new Set(evs.filter((e) => e.type === "user_message").map((e) => e.data.text.match(/ran (task-\d+)/)?.[1]));
    };
    let seen = new Set();
    const deadline = Date.now() + 30_000;
    while (seen.size < tasks.length && Date.now() < deadline) {
      seen = await ran();
      if (seen.size < tasks.length) await sleep(200);
    }
    const lost = tasks.filter((t) => !seen.has(t));
    assert.deepEqual(lost, [], `${lost.length} accepted notifications never ran`);
    await d.stop();
  });
});

describe("a session rebuilt from its log", () => {
  test("the Web Shell never shows what was not stored, and shows what follows the rebuild", async () => {
    const mnt = tempDir();
    execFileSync("mount", ["-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", mnt]);
    const dataDir = path.join(mnt, "data");
    mkdirSync(dataDir, { mode: 0o700 });
    // The disk that fills is the data directory's: SQLite's store.
    const d = await startDaemon({ dataDir, env: { TILLER_STORE__KIND: "sqlite" } });
    const browser = await launch();
    try {
      const sid = (await api(d, "POST", "/api/sessions", { cwd: "/tmp" })).body.id;
      const p = await newPage(browser);
      await p.goto(`${d.http}/?token=${d.token}#${sid}`);
      await p.waitForSelector("#state[data-state]");
      const steps = [{ say: "stored " }, { sleep_ms: 400 }, { repeat: { times: 12, steps: [{ say: "lost " }, { sleep_ms: 10 }] } }];
      assert.equal((await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: script(steps) })).status, 202);
      await p.waitForFunction(() => document.querySelector(".agent")?.textContent === "stored ");
      fill(path.join(mnt, "filler"));
      // The lost chunks cannot be stored, so they are never shown; their
      // turn fails after its retries and the session is rebuilt.
      await sleep(3000);
      assert.ok(!(await p.evaluate(() => document.querySelector(".agent")?.textContent ?? "")).includes("lost"), "an unstored chunk was shown");
      rmSync(path.join(mnt, "filler"));
      rmSync(path.join(mnt, "filler.tail"));
      assert.equal((await api(d, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ say: "after the rebuild" }]) })).status, 202);
      await p.waitForFunction(() => [...document.querySelectorAll(".agent")].some((a) => a.textContent === "after the rebuild"), null, { timeout: 15000 });
      await p.waitForFunction(() => !document.querySelector(".agent")?.textContent.includes("lost"), null, { timeout: 5000 });
      assert.ok(await p.$('.turn-error[data-error-kind="store_unavailable"]'), "the failed turn shows its error");
      await p.context().close();
    } finally {
      await browser.close();
      await d.stop();
      execFileSync("umount", [mnt]);
    }
  });
});
