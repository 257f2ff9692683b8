// Parking, end to end: the real daemon with `[limits] park_after = "1s"`,
// driven by the official ACP TypeScript SDK. An idle session's actor stops
// (`tiller_sessions_parked` counts it); the client that stays attached
// keeps its session: its next prompt wakes it and streams to it as before,
// and another client loads it with its whole history.

import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import path from "node:path";
import { after, before, test } from "node:test";

import {
  agentText,
  api,
  connectUnix,
  initialize,
  newSession,
  repo,
  script,
  startDaemon,
  tempDir,
  textPrompt,
} from "./lib/daemon.mjs";

let daemon;

before(async () => {
  daemon = await startDaemon({ env: { TILLER_LIMITS__PARK_AFTER: "1s" } });
});

after(async () => {
  await daemon?.stop();
});

async function gauge(name, d = daemon) {
  const res = await fetch(`${d.http}/metrics`, { headers: d.auth });
  assert.equal(res.status, 200);
  const text = await res.text();
  const m = text.match(new RegExp(`^${name} (\\d+)`, "m"));
  return m ? Number(m[1]) : 0;
}

async function until(what, check, ms = 15000) {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    if (await check()) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.fail(`timed out waiting for ${what}`);
}

test("an idle session parks; its attached client's next prompt wakes it and streams as before", async () => {
  const a = await connectUnix(daemon);
  const b = await connectUnix(daemon);
  try {
    await initialize(a);
    await initialize(b);
    const sid = await newSession(a);
    const first = await a.request("session/prompt", textPrompt(sid, script([{ say: "one" }])));
    assert.equal(first.stopReason, "end_turn");
    await until("the session to park", async () => (await gauge("tiller_sessions_parked")) >= 1);
    assert.equal(await gauge("tiller_sessions_active"), 0, "no actor left for it");

    // The same connection, no reattach: the prompt wakes it and its
    // updates come to this client as before.
    const second = await a.request("session/prompt", textPrompt(sid, script([{ say: " two" }])));
    assert.equal(second.stopReason, "end_turn");
    await a.until(() => agentText(a, sid) === "one two");
    assert.equal(await gauge("tiller_sessions_active"), 1);

    // Parked again, another client loads it: the whole history replays.
    await until("the session to park again", async () => (await gauge("tiller_sessions_parked")) >= 1);
    await b.request("session/load", { sessionId: sid, cwd: "/tmp", mcpServers: [] });
    assert.equal(agentText(b, sid), "one two");
    const third = await b.request("session/prompt", textPrompt(sid, script([{ say: " three" }])));
    assert.equal(third.stopReason, "end_turn");
    // Both clients see the turn: the one attached while it was parked too.
    await a.until(() => agentText(a, sid) === "one two three");
    await b.until(() => agentText(b, sid) === "one two three");
  } finally {
    a.close();
    b.close();
  }
});

test("a hosted agent's idle session parks; it wakes with the agent's options and goes on in the same agent session", async () => {
  // The misbehaving test agent (built with the workspace), over ACP.
  const dataDir = tempDir();
  const config = path.join(dataDir, "tiller.toml");
  writeFileSync(
    config,
    `[engine.fake]\nkind = "acp"\ncommand = ${JSON.stringify(path.join(repo, "target/debug/tiller-fake-acp"))}\n`,
  );
  const hosting = await startDaemon({ dataDir, args: ["--config", config], env: { TILLER_LIMITS__PARK_AFTER: "1s" } });
  const c = await connectUnix(hosting);
  try {
    await initialize(c);
    const res = await c.request("session/new", { cwd: tempDir(), mcpServers: [], _meta: { tiller: { engine: "fake" } } });
    const sid = res.sessionId;
    const first = await c.request("session/prompt", textPrompt(sid, "options"));
    assert.equal(first.stopReason, "end_turn");
    assert.equal(agentText(c, sid), "mode=ask");
    await until("the hosted session to park", async () => (await gauge("tiller_sessions_parked", hosting)) >= 1);
    assert.equal(await gauge("tiller_sessions_active", hosting), 0);

    // Setting the agent's option wakes it: the option is known at once.
    const set = await c.request("session/set_config_option", { sessionId: sid, configId: "agent.mode", value: "auto" });
    const mode = set.configOptions.find((o) => o.id === "agent.mode");
    assert.equal(mode?.currentValue, "auto", JSON.stringify(set.configOptions));
    const second = await c.request("session/prompt", textPrompt(sid, "options"));
    assert.equal(second.stopReason, "end_turn");
    await c.until(() => agentText(c, sid) === "mode=askmode=auto");

    // One agent session throughout, never a fresh one.
    const h = await api(hosting, "GET", `/api/sessions/${sid}/history?limit=500`);
    assert.equal(h.status, 200);
    const sessions = h.body.events.filter((e) => e.type === "agent_session").map((e) => e.data);
    assert.ok(sessions.length >= 1);
    for (const s of sessions) {
      assert.equal(s.upstream, sessions[0].upstream);
      assert.notEqual(s.start, "fresh", JSON.stringify(sessions));
    }
  } finally {
    c.close();
    await hosting.stop();
  }
});
