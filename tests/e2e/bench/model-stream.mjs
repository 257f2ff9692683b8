// What the daemon adds to a model's stream, end to end: a local server
// streams an OpenAI Chat Completions reply as fast as it can; an ACP client
// (the official SDK over the unix socket) receives it through the daemon.
//   cargo build --release
//   TILLER_BIN=target/release/tiller node bench/model-stream.mjs [runs] [chunks]
// Prints, against reading the same stream straight from the server (bytes
// only, and with every chunk's JSON parsed, as a client using it would):
// time to first chunk and chunks per second through the daemon, for the
// official SDK's client and for a raw client that parses each line (the
// SDK validates every message, which bounds its rate), with the daemon's
// CPU per chunk; then session/cancel latency with a model stream open.
// Asserts nothing about speed.

import { writeFileSync } from "node:fs";
import net from "node:net";
import path from "node:path";

import { initialize, startDaemon, tempDir, textPrompt, transports } from "../lib/daemon.mjs";
import { openai, startMockModel } from "../lib/mockmodel.mjs";
import { cpuNs } from "./proc.mjs";

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

// Straight from the server, every chunk's JSON parsed.
const parsed = { first: [], rate: [] };
for (let i = 0; i < runs; i++) {
  mock.reply({ events: openai.text(text) });
  const t0 = performance.now();
  const res = await fetch(`${mock.url}/v1/chat/completions`, { method: "POST", body: "{}" });
  const decoder = new TextDecoderStream();
  const reader = res.body.pipeThrough(decoder).getReader();
  let first;
  let seen = 0;
  let rest = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    const lines = (rest + value).split("\n");
    rest = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      if (JSON.parse(line.slice(6)).choices?.[0]?.delta?.content) seen++;
      first ??= performance.now() - t0;
    }
  }
  if (seen !== chunks) throw new Error(`parsed ${seen} chunks of ${chunks}`);
  parsed.first.push(first);
  parsed.rate.push(chunks / ((performance.now() - t0) / 1000));
}

// Through the daemon.
const viaTiller = { first: [], rate: [] };
const cpu0 = cpuNs(daemon.child.pid);
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
viaTiller.cpu = (cpuNs(daemon.child.pid) - cpu0) / (runs * chunks) / 1000;

// Through the daemon, read by a raw client: JSON lines over the unix
// socket, each parsed once (what the SDK's client adds is its own).
const raw = await rawClient(daemon.socket);
await raw.request("initialize", { protocolVersion: 1, clientCapabilities: {} });
const viaRaw = { first: [], rate: [] };
const rawCpu0 = cpuNs(daemon.child.pid);
for (let i = 0; i < runs; i++) {
  const { sessionId } = await raw.request("session/new", { cwd: dir, mcpServers: [] });
  mock.reply({ events: openai.text(text) });
  raw.chunks = 0;
  raw.first = undefined;
  const t0 = performance.now();
  raw.t0 = t0;
  await raw.request("session/prompt", textPrompt(sessionId, "go"));
  if (raw.chunks !== chunks) throw new Error(`raw client saw ${raw.chunks} chunks of ${chunks}`);
  viaRaw.first.push(raw.first);
  viaRaw.rate.push(chunks / ((performance.now() - t0) / 1000));
}
viaRaw.cpu = (cpuNs(daemon.child.pid) - rawCpu0) / (runs * chunks) / 1000;
raw.close();

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
const ratio = (a, b) => (stats(a.rate).p50 / stats(b.rate).p50).toFixed(2);
console.log(`  straight from the server, bytes only:    ${fmt(direct)}`);
console.log(`  straight from the server, chunks parsed: ${fmt(parsed)}`);
console.log(`  through tiller, official SDK client:     ${fmt(viaTiller)}; daemon CPU ${viaTiller.cpu.toFixed(1)} us per chunk`);
console.log(`  through tiller, raw JSON-lines client:   ${fmt(viaRaw)}; daemon CPU ${viaRaw.cpu.toFixed(1)} us per chunk`);
console.log(`  raw client through tiller / parsed straight = ${ratio(viaRaw, parsed)} (goal >= 0.5); / bytes only = ${ratio(viaRaw, direct)}`);
const cs = stats(cancels);
console.log(`  cancel mid-stream -> cancelled: p50 ${cs.p50.toFixed(2)} ms (max ${cs.max.toFixed(2)})`);
c.close();
await daemon.stop();
await mock.close();

/** A minimal ACP client: JSON lines over the unix socket, each parsed once;
 * counts agent message chunks (and when the first came, from `t0`). */
async function rawClient(socket) {
  const sock = net.connect(socket);
  await new Promise((resolve, reject) => {
    sock.once("connect", resolve);
    sock.once("error", reject);
  });
  const waiting = new Map();
  let next = 1;
  let rest = "";
  const c = {
    chunks: 0,
    first: undefined,
    t0: 0,
    request(method, params) {
      const id = next++;
      sock.write(JSON.stringify({ jsonrpc: "2.0", id, method, params }) + "\n");
      return new Promise((resolve, reject) => waiting.set(id, { resolve, reject }));
    },
    close: () => sock.destroy(),
  };
  sock.setEncoding("utf8");
  sock.on("data", (data) => {
    const lines = (rest + data).split("\n");
    rest = lines.pop();
    for (const line of lines) {
      const m = JSON.parse(line);
      if (m.method === "session/update" && m.params.update.sessionUpdate === "agent_message_chunk") {
        c.chunks++;
        c.first ??= performance.now() - c.t0;
      } else if (m.id !== undefined && waiting.has(m.id)) {
        const w = waiting.get(m.id);
        waiting.delete(m.id);
        if (m.error) w.reject(new Error(JSON.stringify(m.error)));
        else w.resolve(m.result);
      }
    }
  });
  return c;
}
