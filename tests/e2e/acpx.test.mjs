// A third-party ACP client nobody here wrote: the `acpx` CLI (pinned in
// package.json) driving `tiller acp` as its agent, the way people run it.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { after, before, describe, test } from "node:test";
import { createRequire } from "node:module";

import { api, bin, script, startDaemon, tempDir } from "./lib/daemon.mjs";

const require = createRequire(import.meta.url);
const cli = path.join(path.dirname(require.resolve("acpx/package.json")), "dist/cli.js");

let daemon;
let work;

before(async () => {
  daemon = await startDaemon();
  work = tempDir();
});

after(async () => {
  await daemon?.stop();
});

/** Runs acpx as the user whose state lives in `home`; resolves with its output. */
function acpx(home, args, { timeout = 30000 } = {}) {
  const agent = `${bin} acp --connect unix:${daemon.socket}`;
  return new Promise((resolve) => {
    execFile(
      process.execPath,
      [cli, "--agent", agent, "--ttl", "1", "--cwd", work, ...args],
      { cwd: work, timeout, env: { PATH: process.env.PATH, HOME: home } },
      (err, stdout, stderr) => resolve({ code: err ? (err.code ?? 1) : 0, stdout, stderr }),
    );
  });
}

/** A fresh acpx user with a session of its own (or attached to `resume`). */
async function user({ resume } = {}) {
  const home = tempDir();
  const args = ["sessions", "new", ...(resume ? ["--resume-session", resume] : [])];
  const out = await acpx(home, args);
  assert.equal(out.code, 0, out.stderr);
  const id = out.stdout.trim().split("\n").pop();
  assert.match(id, /^[0-9a-f-]{36}$/);
  return { home, id };
}

describe("acpx against tiller acp", () => {
  test("a prompt is recorded once in acpx's history", async () => {
    const u = await user();
    const prompt = script([{ say: "hello from tiller" }]);
    const out = await acpx(u.home, ["--format", "quiet", "prompt", prompt]);
    assert.equal(out.code, 0, out.stderr);
    assert.equal(out.stdout.trim(), "hello from tiller");
    const hist = await acpx(u.home, ["sessions", "history"]);
    const users = hist.stdout.split("\n").filter((l) => l.split("\t")[1] === "user");
    assert.equal(users.length, 1, hist.stdout);
    assert.ok(users[0].endsWith(prompt));
  });

  test("autoApprove by kind approves a shell call and nothing else", async () => {
    const u = await user();
    const prompt = script([
      { tool: { name: "shell", input: { command: "ls" }, output: "listed" } },
      { tool: { name: "write_file", input: { path: "x", content: "y" }, output: "wrote" } },
      { say: "done" },
    ]);
    const policy = JSON.stringify({ autoApprove: ["execute"] });
    const out = await acpx(u.home, ["--permission-policy", policy, "--format", "json", "prompt", prompt]);
    assert.equal(out.code, 0, out.stderr);
    const events = out.stdout.split("\n").filter(Boolean).map((l) => JSON.parse(l));
    const final = {};
    for (const e of events) {
      const up = e.params?.update;
      if (up?.sessionUpdate === "tool_call_update" && ["completed", "failed"].includes(up.status)) {
        final[up.toolCallId] = up.status;
      }
    }
    assert.deepEqual(Object.values(final), ["completed", "failed"], out.stdout.slice(-2000));
  });

  test("cancel stops the running prompt", async () => {
    const u = await user();
    const running = acpx(u.home, ["prompt", script([{ sleep_ms: 20000 }, { say: "late" }])]);
    // The prompt is running once the session shows it.
    const deadline = Date.now() + 10000;
    for (;;) {
      const snap = await api(daemon, "GET", `/api/sessions/${u.id}`);
      if (snap.body?.activePromptId) break;
      if (Date.now() > deadline) assert.fail(`the prompt never started: ${JSON.stringify(snap.body)}`);
      await new Promise((r) => setTimeout(r, 100));
    }
    const cancel = await acpx(u.home, ["cancel"]);
    assert.equal(cancel.code, 0, cancel.stderr);
    const out = await running;
    assert.match(out.stdout + out.stderr, /cancelled/);
    assert.doesNotMatch(out.stdout, /late/);
  });

  test("a second acpx user attaches to the session and both see one conversation", async () => {
    const a = await user();
    assert.equal((await acpx(a.home, ["--format", "quiet", "prompt", script([{ say: "first" }])])).code, 0);
    const b = await user({ resume: a.id });
    assert.equal(b.id, a.id);
    const out = await acpx(b.home, ["--format", "quiet", "prompt", script([{ say: "second" }])]);
    assert.equal(out.stdout.trim(), "second", out.stderr);
    const hist = await api(daemon, "GET", `/api/sessions/${a.id}/history`);
    const said = hist.body.events.filter((e) => e.type === "agent_message_chunk").map((e) => e.data.text);
    assert.deepEqual(said, ["first", "second"]);
  });

  test("two acpx users prompting one session at once each print only their own turn", async () => {
    const a = await user();
    const b = await user({ resume: a.id });
    const first = acpx(a.home, ["--format", "quiet", "prompt", script([{ sleep_ms: 1500 }, { say: "AAA" }])]);
    await new Promise((r) => setTimeout(r, 500));
    const second = await acpx(b.home, ["--format", "quiet", "prompt", script([{ say: "BBB" }])]);
    const one = await first;
    assert.equal(one.stdout.trim(), "AAA", one.stderr);
    assert.equal(second.stdout.trim(), "BBB", second.stderr);
  });
});
