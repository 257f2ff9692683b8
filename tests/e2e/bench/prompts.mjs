// Per-prompt cost, side by side in one run: the official ACP TypeScript
// client drives three agents over stdio with N sequential prompts, each
// answered with a 3-chunk reply:
//   floor:  target/release/tiller-echo-agent (bare Rust JSON-RPC, no storage)
//   node:   bench/node-agent.mjs (the official SDK's agent side, no storage)
//   tiller: tiller acp --embedded (scripted engine, history durable in SQLite)
//   node-same: the Node agent again, answering `session/new` with exactly
//           what Tiller answered (its modes, config options and command
//           list, captured in this run): the client's own share of a
//           session's creation, which Tiller's richer answer costs it
// Agent-side CPU comes from /proc (every thread's schedstat, checked against
// the process's utime+stime). Prints a table and, with --json, one JSON line.
//   cargo build --release -p tiller -p tiller-bench
//   node bench/prompts.mjs [prompts=3000] [sessions=1000]
// Asserts nothing about speed.

import { spawn } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import os from "node:os";
import path from "node:path";
import { Readable, Writable } from "node:stream";
import { fileURLToPath } from "node:url";

import { client, ndJsonStream } from "@agentclientprotocol/sdk";

import { cpuNs } from "./proc.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, "../../..");
const release = path.join(repo, "target/release");
const prompts = Number(process.argv[2] ?? 3000);
const sessions = Number(process.argv[3] ?? 1000);
const json = process.argv.includes("--json");
const only = process.env.BENCH_AGENTS?.split(",");

const pct = (sorted, p) => sorted[Math.min(sorted.length - 1, Math.floor((sorted.length * p) / 100))];

// What Tiller answered its first `session/new` (the answer and the command
// list it sent with it), for the node-same agent: read off the wire as
// Tiller wrote it, not as the client's validation hands it on.
const answer = { result: null, commands: null };

function capture(stdout) {
  let buf = "";
  const onData = (chunk) => {
    buf += chunk.toString("utf8");
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl);
      buf = buf.slice(nl + 1);
      if (!answer.result && line.includes('"sessionId"') && line.includes('"result"')) {
        const msg = JSON.parse(line);
        if (msg.result?.sessionId) answer.result = msg.result;
      } else if (!answer.commands && line.includes('"available_commands_update"')) {
        answer.commands = JSON.parse(line).params.update;
      }
    }
    if (answer.result && answer.commands) stdout.off("data", onData);
  };
  stdout.on("data", onData);
}

async function measure(name, command, args, prompt, env = {}) {
  const child = spawn(command, args, { stdio: ["pipe", "pipe", "inherit"], env: { ...process.env, RUST_LOG: "warn", ...env } });
  if (name === "tiller") capture(child.stdout);
  let chunks = 0;
  const conn = client()
    .onNotification("session/update", () => {
      chunks++;
    })
    .onRequest("session/request_permission", () => ({ outcome: { outcome: "cancelled" } }))
    .connect(ndJsonStream(Writable.toWeb(child.stdin), Readable.toWeb(child.stdout)));
  const agent = conn.agent;
  await agent.request("initialize", { protocolVersion: 1, clientCapabilities: {} });
  const { sessionId } = await agent.request("session/new", { cwd: "/tmp", mcpServers: [] });
  // Warm up (allocators, SQLite's page cache, the JIT).
  for (let i = 0; i < 200; i++) await agent.request("session/prompt", { sessionId, prompt });

  chunks = 0;
  const cpu0 = cpuNs(child.pid);
  const t0 = performance.now();
  const rtt = [];
  for (let i = 0; i < prompts; i++) {
    const s = performance.now();
    const res = await agent.request("session/prompt", { sessionId, prompt });
    rtt.push((performance.now() - s) * 1000);
    if (res.stopReason !== "end_turn") throw new Error(`${name}: prompt ${i} ended ${res.stopReason}`);
  }
  const wall = performance.now() - t0;
  const cpu = cpuNs(child.pid) - cpu0;
  if (chunks !== 3 * prompts) throw new Error(`${name}: ${chunks} chunks for ${prompts} prompts`);

  const newCpu0 = cpuNs(child.pid);
  const s0 = performance.now();
  for (let i = 0; i < sessions; i++) await agent.request("session/new", { cwd: "/tmp", mcpServers: [] });
  const perSecond = (sessions / (performance.now() - s0)) * 1000;
  const newCpu = cpuNs(child.pid) - newCpu0;

  child.stdin.end();
  await new Promise((resolve) => {
    const timer = setTimeout(() => child.kill("SIGKILL"), 5000);
    child.once("exit", () => {
      clearTimeout(timer);
      resolve();
    });
  });
  rtt.sort((a, b) => a - b);
  return {
    agent: name,
    cpu_us: cpu / prompts / 1000,
    p50_us: pct(rtt, 50),
    p99_us: pct(rtt, 99),
    prompts_per_s: (prompts / wall) * 1000,
    sessions_per_s: perSecond,
    new_cpu_us: newCpu / sessions / 1000,
  };
}

const script = JSON.stringify({ script: [{ say: "one " }, { say: "two " }, { say: "three" }] });
const tmp = mkdtempSync(path.join(os.tmpdir(), "tiller-bench-"));
const nodeAgent = [process.execPath, [path.join(here, "node-agent.mjs")], [{ type: "text", text: "hi" }]];
const agents = [
  ["floor", path.join(release, "tiller-echo-agent"), [], [{ type: "text", text: "hi" }]],
  ["node", ...nodeAgent],
  ["tiller", process.env.TILLER_BIN ?? path.join(release, "tiller"), ["acp", "--embedded", "--data-dir", tmp], [{ type: "text", text: script }]],
  ["node-same", ...nodeAgent],
].filter(([name]) => !only || only.includes(name));

const rows = [];
for (const [name, command, args, prompt] of agents) {
  let env = {};
  if (name === "node-same") {
    if (!answer.result || !answer.commands) throw new Error("node-same runs after tiller, whose session/new answer it repeats");
    const file = path.join(tmp, "session-new.json");
    writeFileSync(file, JSON.stringify(answer));
    env = { NODE_AGENT_SESSION_NEW: file };
  }
  rows.push(await measure(name, command, args, prompt, env));
}

const by = Object.fromEntries(rows.map((r) => [r.agent, r]));
const f = (x, d = 0) => x.toLocaleString("en-US", { maximumFractionDigits: d, minimumFractionDigits: d });
console.log(`per prompt (${prompts} sequential 3-chunk prompts, official ACP TS client over stdio; ${sessions} session/new for the rate)`);
console.log("agent     CPU/prompt  p50 round trip  p99 round trip  prompts/s  sessions/s  CPU/session");
for (const r of rows) {
  console.log(
    `${r.agent.padEnd(9)} ${(f(r.cpu_us, 1) + " us").padStart(10)}  ${(f(r.p50_us) + " us").padStart(14)}  ${(f(r.p99_us) + " us").padStart(14)}  ${f(r.prompts_per_s).padStart(9)}  ${f(r.sessions_per_s).padStart(10)}  ${(f(r.new_cpu_us, 1) + " us").padStart(11)}`,
  );
}
if (by.tiller && by.node && by.floor) {
  console.log(
    `tiller CPU/prompt = ${f(by.tiller.cpu_us / by.node.cpu_us, 2)} x node (goal <= 0.33), ${f(by.tiller.cpu_us / by.floor.cpu_us, 2)} x floor (goal <= 3)`,
  );
}
if (by.tiller && by["node-same"]) {
  console.log(
    `session/new: tiller ${f(by.tiller.sessions_per_s)} /s; the Node agent answering the same (free, no storage) ${f(by["node-same"].sessions_per_s)} /s: the official client's reading of the answer bounds both (goal >= 5,000 /s)`,
  );
}
if (json) console.log(JSON.stringify({ prompts: rows }));
rmSync(tmp, { recursive: true, force: true });
process.exit(0);
