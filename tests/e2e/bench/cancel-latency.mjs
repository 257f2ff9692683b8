// Load generator (not a test): cancel latency of a running turn over the
// unix socket, from `session/cancel` sent to the `cancelled` response.
// Run: `node --experimental-websocket bench/cancel-latency.mjs` (TILLER_BIN
// picks the binary; default target/debug/tiller).
import { initialize, newSession, script, startDaemon, textPrompt, transports } from "../lib/daemon.mjs";
const d = await startDaemon();
const c = await transports.unix(d);
await initialize(c);
const sid = await newSession(c);
const times = [];
for (let i = 0; i < 30; i++) {
  const p = c.request("session/prompt", textPrompt(sid, script([{ say: "x" }, { sleep_ms: 5000 }])));
  await new Promise((r) => setTimeout(r, 50));
  const t0 = process.hrtime.bigint();
  await c.notify("session/cancel", { sessionId: sid });
  await p;
  times.push(Number(process.hrtime.bigint() - t0) / 1e6);
}
times.sort((a, b) => a - b);
console.log(`cancel latency over 30: p50 ${times[15].toFixed(2)} ms, p90 ${times[27].toFixed(2)} ms, max ${times[29].toFixed(2)} ms`);
c.close();
await d.stop();
process.exit(0);
