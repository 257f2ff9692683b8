// What the daemon adds to a model's stream, end to end: a local server
// streams an OpenAI Chat Completions reply as fast as it can; an ACP client
// (the official SDK over the unix socket) receives it through the daemon.
//   cargo build --release
//   TILLER_BIN=target/release/tiller node bench/model-stream.mjs [runs] [chunks]
// Prints, against reading the same stream straight from the server:
// time to first chunk and chunks per second; then session/cancel latency
// with a model stream open. Asserts nothing about speed.

import { writeFileSync } from "node:fs";
import path from "node:path";

import { initialize, startDaemon, tempDir, textPrompt, transports } from "../lib/daemon.mjs";
import { openai, startMockModel } from "../lib/mockmodel.mjs";

const runs = Number(process.argv[2] ?? 20);
const chunks = Number(process.argv[3] ?? 2000);
const text = Array.from({ length: chunks }, (_, i) => `w${i} `).join("");

const mock = await startMockModel();
const dir = tempDir();
const config = path.join(dir, "tiller.toml");
writeFileSync(config, `[engine]\ndefault = "bench"\n[engine.bench]\nkind = "openai"\nbase_url = "${mock.url}/v1"\nmodel = "m"\n`);
const daemon = await startDaemon({ dataDir: dir, args: ["--config", config], env: { RUST_LOG: "warn,tiller::daemon=info" } });
const c = await transports.unix(daemon);
await initialize(c);

const stats = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return { p50: s[Math.floor(s.length / 2)], max: s.at(-1) };
};

// Straight from the server.
const direct = { first: [], rate: [] };
for (let i = 0; i < runs; i++) {
  mock.reply({ events: openai.text(text) });
  const t0 = performance.now();
  const res = await fetch(`${mock.url}/v1/chat/completions`, { method: "POST", body: "{}" });
  const reader = res.body.getReader();
  let first;
  for (;;) {
    const { done } = await reader.read();
    first ??= performance.now() - t0;
    if (done) break;
  }
  direct.first.push(first);
  direct.rate.push(chunks / ((performance.now() - t0) / 1000));
}

// Through the daemon.
const viaTiller = { first: [], rate: [] };
for (let i = 0; i < runs; i++) {
  const { sessionId } = await c.request("session/new", { cwd: dir, mcpServers: [] });
  mock.reply({ events: openai.text(text) });
  let first;
  let seen = 0;
  const before = c.updates.length;
  const t0 = performance.now();
  const pending = c.request("session/prompt", textPrompt(sessionId, "go"));
  let idx = before;
  await c.until(() => {
    for (; idx < c.updates.length; idx++) {
      if (c.updates[idx].update.sessionUpdate === "agent_message_chunk") seen++;
    }
    if (seen > 0) first ??= performance.now() - t0;
    return seen === chunks;
  }, 60000);
  const elapsed = performance.now() - t0;
  await pending;
  viaTiller.first.push(first);
  viaTiller.rate.push(chunks / (elapsed / 1000));
}

// Cancel mid-stream: session/cancel -> `cancelled`, the HTTP stream dropped.
const cancels = [];
for (let i = 0; i < runs; i++) {
  const { sessionId } = await c.request("session/new", { cwd: dir, mcpServers: [] });
  mock.reply({ events: openai.text("one two three").slice(0, 2), hang: true });
  const before = c.updates.length;
  const pending = c.request("session/prompt", textPrompt(sessionId, "go"));
  await c.until(() => c.updates.slice(before).some((u) => u.update.sessionUpdate === "agent_message_chunk"));
  const t0 = performance.now();
  await c.notify("session/cancel", { sessionId });
  const res = await pending;
  cancels.push(performance.now() - t0);
  if (res.stopReason !== "cancelled") throw new Error(`got ${res.stopReason}`);
}

const fmt = (r) => {
  const f = stats(r.first);
  const x = stats(r.rate);
  return `first chunk p50 ${f.p50.toFixed(2)} ms (max ${f.max.toFixed(2)}), ${Math.round(x.p50)} chunks/s p50`;
};
console.log(`${chunks}-chunk reply, ${runs} runs`);
console.log(`  straight from the server: ${fmt(direct)}`);
console.log(`  through tiller (ACP):     ${fmt(viaTiller)}`);
const cs = stats(cancels);
console.log(`  cancel mid-stream -> cancelled: p50 ${cs.p50.toFixed(2)} ms (max ${cs.max.toFixed(2)})`);
c.close();
await daemon.stop();
await mock.close();
